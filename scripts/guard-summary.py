"""What gpu-check.sh's guard part saw: each serve run's status before and after its swap,
the trace around the switch, and the run's violating ticks (H200 measurements)."""
import csv
import glob
import json
import sys

d = sys.argv[1]
for name in ["swap-cap", "floor-guard", "floor-probation"]:
    before = json.load(open(f"{d}/{name}-status-before.json"))
    after = json.load(open(f"{d}/{name}-status-after.json"))
    b, a = before["gpus"][0]["in_force"], after["gpus"][0]["in_force"]
    print(f"{name}: before the swap {before['policy']['name']}, cap {b['power_cap_requested_w']} W, "
          f"batch {b['batch_size']}; after: {after['policy']['name']}, cap {a['power_cap_requested_w']} W, "
          f"batch {a['batch_size']}; rollbacks {after['policy']['rollbacks']}; guard {after['guard']}")
    trace = sorted(glob.glob(f"{d}/{name}-out/*/trace.csv"))[-1]
    rows = list(csv.DictReader(open(trace)))
    swap = next((i for i, r in enumerate(rows) if r["policy"] != rows[0]["policy"]), None)
    if swap is not None:
        for r in rows[max(0, swap - 2): swap + 12]:
            print(f"  tick {r['tick']:>3} {r['policy']:<12} cap {r['power_cap_requested_w']:>6} "
                  f"batch {r['batch_size']:>4} {float(r['tokens_per_s']):>9.0f} tok/s "
                  f"violation {r['slo_violation']}")
    violating = sum(int(r["slo_violation"]) for r in rows)
    tokens = sum(int(r["tokens"]) for r in rows)
    energy = sum(float(r["energy_j"]) for r in rows)
    print(f"  {len(rows)} ticks, {violating} violating, {tokens / energy:.2f} tok/J (H200 measurement)")
