#!/usr/bin/env python3
"""The prefill-saturation check side by side: the GPU's `tokwatt bench serving` runs against
the simulator's `tokwatt run --sim` on the same scenarios and seeds.

    prefill-sat-compare.py GPU_DIR SIM_DIR [SIM_DIR ...]

GPU_DIR holds NAME-sSEED.json (and NAME-sSEED-r2.json for a second GPU run of the same
requests), from `gpu-check.sh OUT 6 prefill-sat`; each SIM_DIR holds sim-NAME-sSEED/summary.json.
Prints, per scenario, the GPU's figures, each simulator's ratio to them, and the GPU's own
spread between its two runs where it has two.
"""
import glob
import json
import os
import sys

KEYS = [
    ("tok/s", "tokens_per_s"),
    ("W", "watts"),
    ("TTFT50", "ttft_p50_ms"),
    ("TTFT99", "ttft_p99_ms"),
    ("TPOT50", "tpot_p50_ms"),
    ("TPOT99", "tpot_p99_ms"),
]
LIMITS = {"tok/s": 0.05, "W": 0.05, "TTFT50": 0.10, "TTFT99": 0.15, "TPOT50": 0.10, "TPOT99": 0.15}


def gpu_figures(path):
    s = json.load(open(path))
    return {k: s[v] for k, v in KEYS} | {"requests": s["requests_finished"], "gpu": s.get("gpu")}


def sim_figures(path):
    s = json.load(open(path))
    lat = s["request_latency"]
    d = s["duration_s"]
    return {
        "tok/s": s["tokens"] / d,
        "W": s["energy_j"] / d,
        "TTFT50": lat["ttft_p50_ms"],
        "TTFT99": lat["ttft_p99_ms"],
        "TPOT50": lat["tpot_p50_ms"],
        "TPOT99": lat["tpot_p99_ms"],
        "requests": lat["requests"],
    }


def requests(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        out[(round(r["arrival_s"], 4), r["prompt"], r["output"])] = r
    return out


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def breakdown(gpu_requests, sim_requests):
    """Medians and p99s of each request's time in the queue (arrival to a slot), in
    prefill (slot to first token) and in decode (first token to finish), on both, for the
    requests both finished."""
    both = [k for k in gpu_requests if k in sim_requests]
    parts = {
        "queue": lambda r: r["admitted_s"] - r["arrival_s"],
        "prefill": lambda r: r["first_token_s"] - r["admitted_s"],
        "decode": lambda r: r["finish_s"] - r["first_token_s"],
    }
    cells = []
    for name, part in parts.items():
        g = [1e3 * part(gpu_requests[k]) for k in both]
        m = [1e3 * part(sim_requests[k]) for k in both]
        cells.append(
            f"{name} p50 {quantile(g, 0.5):.0f}/{quantile(m, 0.5):.0f} p99 {quantile(g, 0.99):.0f}/{quantile(m, 0.99):.0f}"
        )
    return f"{len(both)} same requests, ms GPU/sim: " + "; ".join(cells)


def main():
    gpu_dir, sim_dirs = sys.argv[1], sys.argv[2:]
    runs = sorted(
        p for p in glob.glob(os.path.join(gpu_dir, "*-s[0-9]*.json")) if "-r" not in os.path.basename(p)
    )
    for path in runs:
        tag = os.path.basename(path)[: -len(".json")]
        g = gpu_figures(path)
        print(f"\n{tag}: GPU ({g['gpu']}), {g['requests']} requests finished")
        print(f"{'':24}" + "".join(f"{k:>9}" for k, _ in KEYS))
        print(f"{'GPU':24}" + "".join(f"{g[k]:>9.1f}" for k, _ in KEYS))
        spread = {}
        replicate = os.path.join(gpu_dir, tag + "-r2.json")
        if os.path.exists(replicate):
            r = gpu_figures(replicate)
            print(f"{'GPU again':24}" + "".join(f"{r[k]:>9.1f}" for k, _ in KEYS))
            spread = {k: abs(r[k] / g[k] - 1.0) for k, _ in KEYS}
            print(f"{'GPU run 2 / run 1':24}" + "".join(f"{r[k] / g[k]:>9.3f}" for k, _ in KEYS))
        for sim_dir in sim_dirs:
            summary = os.path.join(sim_dir, "sim-" + tag, "summary.json")
            if not os.path.exists(summary):
                continue
            m = sim_figures(summary)
            ratios = {k: m[k] / g[k] for k, _ in KEYS}
            missed = [
                k for k, _ in KEYS if abs(ratios[k] - 1.0) > max(LIMITS[k], spread.get(k, 0.0)) + 1e-9
            ]
            label = "sim/GPU " + os.path.basename(os.path.normpath(sim_dir))
            verdict = "all within" if not missed else "missed: " + ", ".join(missed)
            print(f"{label[:24]:24}" + "".join(f"{ratios[k]:>9.3f}" for k, _ in KEYS) + "  " + verdict)
            gpu_req = os.path.join(gpu_dir, tag + "-requests.jsonl")
            sim_req = os.path.join(sim_dir, "sim-" + tag, "requests.jsonl")
            if os.path.exists(gpu_req) and os.path.exists(sim_req):
                print("    " + breakdown(requests(gpu_req), requests(sim_req)))


if __name__ == "__main__":
    main()
