#!/usr/bin/env bash
# Issue 18 on two H200s of one node, in one call: caps and clocks dry-run, batch sizes real.
#   1. `tokwatt serve` manages both GPUs (one CUDA decode each) for SERVE_S seconds, a policy
#      swap through the API half-way, /metrics scraped and checked by promtool, and from the
#      run's trace: no missed tick around the swap, telemetry and decisions for every GPU.
#   2. `tokwatt ab --crossover`: static batch 256 (A) against 512 (B), A on one GPU and B on
#      the other, then swapped; ratio, interval and the GPU-to-GPU difference it cancelled.
#   3. The node-budget policy with a budget below the GPUs' default caps (450 W per GPU),
#      dry-run: its cap decisions per tick, checked to sum within the budget.
# No GPU setting is changed: only nvidia-smi queries, saved before and after each step and
# diffed. Every step has a timeout and its exit code is recorded in exit-codes.txt.
#
# Run from a bundle folder (scripts/gpu-bundle.sh dist; cp this script into dist/):
#   OUT=/path/to/results dist/exp-two-gpu.sh          # two GPUs (one GPU: what one allows)
#   SIM=1 OUT=/tmp/two-gpu-sim dist/exp-two-gpu.sh    # the same steps on 2 simulated H200s
# Results land in $OUT (summary.txt first), packed into results.tgz after every step, in
# $PACK_TO (default $OUT): on the device machine, whose $OUT returns only 8 files, run with
# OUT=/tmp/r PACK_TO=$OUT so that results.tgz, summary.txt and exit-codes.txt come back,
# with the steps done so far even if the call is cut short.
set -uo pipefail
d="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:?set OUT to the folder for the results}"
sim="${SIM:-0}"
serve_s="${SERVE_S:-120}"      # serve's run; the swap comes at SWAP_AT_S into it
swap_at="${SWAP_AT_S:-60}"
port="${METRICS_PORT:-19401}"  # /metrics on loopback
ab_epoch="${AB_EPOCH:-10s}"
ab_warmup="${AB_WARMUP:-5s}"
ab_budget="${AB_BUDGET:-6}"    # looks at 4 and 6 blocks: at most 6 x 2 x 15 s = 180 s
nb_s="${NB_S:-60}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
pack_to="${PACK_TO:-$out}"
mkdir -p "$pack_to"
tw="$d/tokwatt"
py="${PYTHON:-python3}"
# info: the dry run's "would set power cap ..." lines are the logged cap and clock decisions.
log="${LOG:-info}"
# tokwatt opens CUDA device N for NVML index N: make CUDA number the GPUs as NVML does (by
# PCI bus), not fastest first, so each GPU's decode runs on the GPU it is measured on.
export CUDA_DEVICE_ORDER=PCI_BUS_ID

: > "$out/exit-codes.txt"
: > "$out/summary.txt"
note() { echo "$*" | tee -a "$out/summary.txt"; }
rc_of() { echo "$1 exit $2 at ${SECONDS} s" >> "$out/exit-codes.txt"; }
pack() { # results.tgz of everything so far (packed beside, then moved in: tar would
  # otherwise read the folder it is writing into)
  local tgz
  tgz="$(mktemp /tmp/two-gpu-results.XXXXXX)"
  tar czf "$tgz" -C "$out" --exclude results.tgz . && mv "$tgz" "$pack_to/results.tgz"
  if [[ "$pack_to" != "$out" ]]; then cp "$out/summary.txt" "$out/exit-codes.txt" "$pack_to/"; fi
}

# --- Where: two simulated H200s, or the real GPUs (the first two) -------------------------
if [[ "$sim" == 1 ]]; then
  ngpu=2
  note "MODE: SIMULATOR (SIM=1): 2 simulated H200s; every figure below is simulator output"
else
  ngpu="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"
  if (( ngpu < 1 )); then
    note "FAILED: nvidia-smi lists no GPU (run with SIM=1 to rehearse on the simulator)"
    exit 1
  fi
  (( ngpu > 2 )) && ngpu=2
  note "MODE: REAL GPUs: using $ngpu ($(nvidia-smi -L | head -n "$ngpu" | tr '\n' ';'))"
fi
gpu_list="$(seq -s, 0 $((ngpu - 1)))"     # 0,1 (or 0)
gpu_toml="[$(seq -s', ' 0 $((ngpu - 1)))]" # [0, 1]
note "date: $(date -u +%FT%TZ)  tokwatt: $("$tw" --version 2>&1)  gpus: $gpu_list"

# --- GPU settings, queried only (never set) -----------------------------------------------
settings_q="index,uuid,power.limit,power.default_limit,enforced.power.limit,clocks.applications.graphics,clocks.applications.memory,persistence_mode,compute_mode"
snapshot() { # snapshot WHEN: the settings now, and the clock event reasons (state, not settings)
  [[ "$sim" == 1 ]] && return 0
  sleep 3 # let the last step's load end, so the event reasons read idle
  timeout 30 nvidia-smi --query-gpu="$settings_q" --format=csv > "$out/settings-$1.csv" 2>&1
  timeout 30 nvidia-smi --query-gpu=index,clocks_event_reasons.active,clocks.sm,power.draw \
    --format=csv > "$out/state-$1.csv" 2>&1
}
compare_settings() { # compare_settings STEP: after the step, against before the first
  [[ "$sim" == 1 ]] && return 0
  snapshot "after-$1"
  if diff "$out/settings-before.csv" "$out/settings-after-$1.csv" > "$out/settings-diff-$1.txt"; then
    note "GPU settings after $1: identical to before"
  else
    note "FAILED: GPU settings after $1 differ from before (settings-diff-$1.txt)"
  fi
}
if [[ "$sim" == 1 ]]; then
  note "nvidia-smi steps: skipped (SIM=1)"
else
  timeout 30 nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  timeout 60 "$tw" gpus > "$out/tokwatt-gpus-before.txt" 2>&1
  snapshot before
fi

# promtool: installed, or the bundle's compressed copy, or none (recorded, not a failure)
promtool_bin=""
if command -v promtool > /dev/null; then
  promtool_bin="$(command -v promtool)"
elif [[ -f "$d/promtool.gz" ]]; then
  promtool_bin="$(mktemp -d)/promtool"
  gunzip -c "$d/promtool.gz" > "$promtool_bin" && chmod +x "$promtool_bin"
fi

# =========================================================================================
# 1. serve: both GPUs, one CUDA decode each, a swap half-way, /metrics
# =========================================================================================
s="$out/serve"
mkdir -p "$s"
# A short socket path: Unix sockets are limited to ~100 bytes and $OUT may be deep.
sock_dir="$(mktemp -d /tmp/tokwatt-2gpu.XXXXXX)"
sock="$sock_dir/tokwatt.sock"
if [[ "$sim" == 1 ]]; then
  node_block=$'backend = "sim"\nsim_profile = "h200"\nsim_gpus = 2'
else
  # dry_run: cap and clock decisions are logged and exported, nothing is set; the batch
  # size is the workload's own knob and still changes.
  node_block="backend = \"nvml\"
gpus = $gpu_toml
dry_run = true
batch_only = false

[workload]
source = \"cuda\"
model = \"llama-3-8b\"
context = 1024
batch_size_max = 512"
fi
cat > "$s/serve.toml" << EOF
# Written by exp-two-gpu.sh. Starts on slo-batch (SM clock + batch), swapped half-way to
# cap-and-batch (power cap + batch) through the control API.
[policy]
spec = "$d/specs/slo-batch.toml"
plugin_dirs = ["$d"]
cache_dir = "$d/cache"
probation_ticks = 10

[node]
$node_block

[api]
socket = "$sock"

[metrics]
listen = "127.0.0.1:$port"

[output]
dir = "$s/run"
summary_every = "10s"
EOF

scrape() { # scrape NAME: /metrics and the status, at this moment
  curl -sf --max-time 5 "http://127.0.0.1:$port/metrics" > "$s/metrics-$1.txt" 2> "$s/metrics-$1.err"
  rc_of "scrape-$1" $?
  timeout 10 "$tw" status --json --socket "$sock" > "$s/status-$1.json" 2>> "$s/status.err"
}

t0=$SECONDS
timeout $((serve_s + 180)) "$tw" serve --log "$log" --config "$s/serve.toml" --duration "${serve_s}s" \
  > "$s/serve.stdout" 2> "$s/serve.stderr" &
serve_pid=$!
# The loop starts when the socket appears (after the GPUs, workloads and the policy are up).
for _ in $(seq 1 300); do
  [[ -S "$sock" ]] && break
  kill -0 "$serve_pid" 2> /dev/null || break
  sleep 0.5
done
if [[ -S "$sock" ]]; then
  echo "socket after $((SECONDS - t0)) s" > "$s/timeline.txt"
  up=$SECONDS
  wait_until() { local left=$(($1 - (SECONDS - up))); ((left > 0)) && sleep "$left"; }
  wait_until $((swap_at / 2)); scrape early
  wait_until $((swap_at - 3)); scrape before-swap
  wait_until "$swap_at"
  echo "swap at $((SECONDS - up)) s" >> "$s/timeline.txt"
  timeout 60 "$tw" policy swap "$d/specs/cap-and-batch.toml" --socket "$sock" \
    > "$s/swap.txt" 2>&1
  rc_of "policy-swap" $?
  wait_until $((swap_at + 5)); scrape after-swap
  wait_until $((serve_s - 10)); scrape late
else
  echo "FAILED: no control socket (serve exited, or took over 150 s to start: see serve.stderr)" > "$s/timeline.txt"
fi
wait "$serve_pid"
serve_rc=$?
rc_of serve "$serve_rc"
echo "serve ended after $((SECONDS - t0)) s, exit $serve_rc" >> "$s/timeline.txt"
rm -rf "$sock_dir"

if [[ -n "$promtool_bin" ]]; then
  for name in before-swap after-swap; do
    { echo "== promtool check metrics < metrics-$name.txt"
      timeout 30 "$promtool_bin" check metrics < "$s/metrics-$name.txt" 2>&1
      echo "promtool exit $?"; } >> "$s/promtool.txt"
  done
else
  echo "promtool: not installed" > "$s/promtool.txt"
fi

# The checks, from the run's own files. "No missed tick" as tests/all/serve.rs asserts it:
# the trace holds ticks 0..N-1 in order with one row per GPU each, N = summary's ticks;
# and, on the wall clock, no tick around the swap started a tick or more late.
"$py" - "$s" "$ngpu" > "$s/verdict.txt" 2>&1 << 'PY'
import csv, glob, json, os, re, sys
s, ngpu = sys.argv[1], int(sys.argv[2])
ok = True
def say(good, text):
    global ok
    ok &= good
    print(("ok      " if good else "FAILED  ") + text)
runs = sorted(glob.glob(os.path.join(s, "run", "serve-*")))
if not runs:
    print("FAILED  no run folder under serve/run"); sys.exit(1)
run = runs[-1]
summary = json.load(open(os.path.join(run, "summary.json")))
totals = summary  # summary.json holds the totals at its top level
rows = list(csv.DictReader(open(os.path.join(run, "trace.csv"))))
n = totals["ticks"]
tick_s = summary["tick_ms"] / 1000
print(f"run {os.path.basename(run)}: {n} ticks of {tick_s:g} s on {summary['gpu_count']} GPU(s), "
      f"{summary['data_source']}")
say(summary["gpu_count"] == ngpu, f"GPUs managed: {summary['gpu_count']} (wanted {ngpu})")
say(len(rows) == n * ngpu, f"trace rows {len(rows)} = ticks {n} x GPUs {ngpu}")
in_order = all(int(r["tick"]) == i // ngpu and int(r["gpu"]) == i % ngpu for i, r in enumerate(rows))
say(in_order, "every tick 0..N-1 in order with one row per GPU (no missed tick)")
# The swap: the first tick the new policy is named on.
first = rows[0]["policy"]
swap_tick = next((int(r["tick"]) for r in rows if r["policy"] != first), None)
say(swap_tick is not None, f"policy swapped: {first} -> "
    f"{rows[-1]['policy']} at tick {swap_tick}")
sw = totals["swaps"]
say(sw["swaps"] == 1 and sw["rollbacks"] == 0,
    f"summary: swaps {sw['swaps']}, rollbacks {sw['rollbacks']}, fallback ticks {totals['fallback_ticks']}")
times = {}
for r in rows:
    times.setdefault(int(r["tick"]), float(r["time_s"]))
gaps = [(t, times[t] - times[t - 1]) for t in sorted(times) if t - 1 in times]
if swap_tick is not None:
    near = [(t, g) for t, g in gaps if abs(t - swap_tick) <= 10]
    worst = max(near, key=lambda x: x[1])
    say(worst[1] < 1.5 * tick_s,
        f"around the swap (ticks {swap_tick - 10}..{swap_tick + 10}) the longest tick-to-tick "
        f"interval is {worst[1]:.3f} s at tick {worst[0]} (a missed tick would be >= {2 * tick_s:g} s)")
    at = [r for r in rows if int(r["tick"]) == swap_tick]
    say(all(r["fallback"] == "0" for r in at), "the swap tick was decided by the new policy (no fallback)")
allg = sorted(g for _, g in gaps)
if allg:
    print(f"        tick intervals over the run: median {allg[len(allg)//2]:.4f} s, max {allg[-1]:.4f} s")
# Per GPU: telemetry and decisions.
jsonl = [json.loads(l) for l in open(os.path.join(run, "observations.jsonl"))]
for g in range(ngpu):
    gr = [r for r in rows if int(r["gpu"]) == g]
    watts = [float(r["power_avg_w"]) for r in gr if r["power_avg_w"]]
    toks = sum(int(r["tokens"]) for r in gr)
    dec = [j for j in jsonl if j["observation"]["gpu"] == g]
    asked = {k: sum(1 for j in dec if j["requested"].get(k) is not None)
             for k in ("power_cap_w", "sm_clock_max_mhz", "batch_size")}
    batches = sorted({r["batch_size"] for r in gr}, key=lambda b: int(b) if b.isdigit() else -1)
    caps = sorted({r["power_cap_w"] for r in gr})
    clocks = sorted({r["sm_clock_max_mhz"] for r in gr})
    gt = totals["gpus"][g]
    median_w = sorted(watts)[len(watts) // 2] if watts else 0.0
    say(median_w > 150, f"GPU {g}: under load, median power {median_w:.0f} W (its own workload runs on it)")
    say(len(gr) == n and len(watts) == n and toks > 0 and len(dec) == n,
        f"GPU {g}: {len(gr)} telemetry rows (power {min(watts):.0f}-{max(watts):.0f} W), {toks} tokens, "
        f"{gt['tokens_per_joule']:.3f} tok/J; {len(dec)} decisions, requests per knob {asked}; "
        f"batch sizes in force {batches[:8]}{'...' if len(batches) > 8 else ''}; "
        f"caps decided {caps[:6]}; SM max decided {clocks[:6]}")
# /metrics: every GPU's series in each scrape.
for name in ("early", "before-swap", "after-swap", "late"):
    path = os.path.join(s, f"metrics-{name}.txt")
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        say(False, f"/metrics {name}: no scrape"); continue
    text = open(path).read()
    per = [len(re.findall(r'^tokwatt_gpu_\w+\{[^}]*gpu="%d"' % g, text, re.M)) for g in range(ngpu)]
    pol = re.findall(r'^tokwatt_policy_info\{([^}]*)\}', text, re.M)
    say(all(c > 0 for c in per), f"/metrics {name}: per-GPU series {per}; policy_info {pol}")
print("VERDICT serve:", "PASS" if ok else "FAIL")
PY
rc_of serve-verdict $?
note "$(grep '^VERDICT' "$s/verdict.txt" || echo 'VERDICT serve: FAIL (no verdict, see serve/verdict.txt)')"
note "$(grep -m1 'no missed tick' "$s/verdict.txt")"
note "$(grep -m1 'around the swap' "$s/verdict.txt")"
if [[ -n "$promtool_bin" ]]; then
  note "promtool check metrics: $(grep -c '^promtool exit 0' "$s/promtool.txt") of 2 scrapes clean"
else
  note "promtool: not installed"
fi
compare_settings serve
pack

# =========================================================================================
# 2. ab --crossover: batch 256 (A) vs 512 (B), A on one GPU and B on the other, swapped
# =========================================================================================
a="$out/ab"
mkdir -p "$a/specs"
for b in 256 512; do
  # Batch only: the cap line goes (the operator grants only the batch size).
  sed -e "/^power_cap_w = /d" -e "s/^# batch_size = \"256\"/batch_size = \"$b\"/" \
    -e "s/^name = \"static\"/name = \"static-b$b\"/" \
    -e "s|^plugin = \"policy_static.wasm\"|plugin = \"$d/policy_static.wasm\"|" \
    "$d/specs/static.toml" > "$a/specs/static-b$b.toml"
done
grep -n "batch_size\|^name\|^plugin" "$a/specs/"static-b*.toml > "$a/specs.txt"
if (( ngpu < 2 )); then
  echo "SKIPPED: ab --crossover needs two GPUs; this machine has $ngpu" > "$a/SKIPPED.txt"
  note "SKIPPED: ab --crossover needs two GPUs; this machine has $ngpu"
else
  if [[ "$sim" == 1 ]]; then
    where=(--sim h200 --gpus 2 --batch-only)
  else
    where=(--gpu "$gpu_list" --dry-run --batch-only)
  fi
  timeout 300 "$tw" ab --log "$log" --crossover "${where[@]}" \
    --a "$a/specs/static-b256.toml" --b "$a/specs/static-b512.toml" \
    --epoch "$ab_epoch" --warmup "$ab_warmup" --budget "$ab_budget" --seed 7 \
    --out "$a/out" --overwrite --cache-dir "$d/cache" --quiet > "$a/ab.stdout" 2> "$a/ab.stderr"
  rc_of ab $?
  # ab.json has the ratio and its interval; the GPU-to-GPU difference is computed here from
  # its epochs (each group ran both arms in every block, so the arms cancel in it).
  "$py" - "$a/out/ab.json" > "$a/summary.txt" 2>&1 << 'PY'
import json, math, sys
from collections import defaultdict
ab = json.load(open(sys.argv[1]))
gm = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))
print(f"mode {ab['mode']}: A = {ab['a']['policy']}, B = {ab['b']['policy']}; {ab['meta']['data_source']}")
print(f"decision {ab['decision']}: tokens/J B/A {ab['ratio_b_over_a']:.4f}, "
      f"{100 * ab['confidence']:.2f} % interval [{ab['ci_low']:.4f}, {ab['ci_high']:.4f}], "
      f"{len(ab['pairs'])} blocks of {ab['budget_pairs']}, run {ab['run_time_s']:.0f} s")
tpj = defaultdict(dict)  # (block) -> (group, arm) -> tokens/J
batch = defaultdict(set)
fallback = 0
for e in ab["epochs"]:
    tpj[e["pair"]][(e["group"], e["arm"])] = e["tokens_per_joule"]
    batch[e["arm"]] |= {s["batch_size"] for s in e["settings"]}
    fallback += e["fallback_ticks"]
print(f"batch sizes in force: A {sorted(batch['a'])}, B {sorted(batch['b'])}; fallback ticks {fallback}")
gpu_ratio, naive = [], []
print("block  GPU0 A      GPU0 B      GPU1 A      GPU1 B      GPU1/GPU0  B/A")
for p in sorted(tpj):
    v = tpj[p]
    if len(v) != 4:
        continue
    g = math.sqrt(v[(1, "a")] * v[(1, "b")] / (v[(0, "a")] * v[(0, "b")]))
    r = math.sqrt(v[(0, "b")] * v[(1, "b")] / (v[(0, "a")] * v[(1, "a")]))
    gpu_ratio.append(g)
    naive.append((v[(1, "b")] / v[(0, "a")], v[(0, "b")] / v[(1, "a")]))
    print(f"{p:5d}  {v[(0,'a')]:10.4f}  {v[(0,'b')]:10.4f}  {v[(1,'a')]:10.4f}  {v[(1,'b')]:10.4f}  {g:9.4f}  {r:.4f}")
if gpu_ratio:
    g = gm(gpu_ratio)
    print(f"GPU-to-GPU difference cancelled: GPU 1 / GPU 0 tokens/J = {g:.4f} ({100 * (g - 1):+.2f} %), "
          f"blocks {min(gpu_ratio):.4f}..{max(gpu_ratio):.4f}")
    print(f"without the swap, B/A would have read {gm([x for x, _ in naive]):.4f} (B on GPU 1, A on GPU 0) "
          f"or {gm([y for _, y in naive]):.4f} (B on GPU 0, A on GPU 1); crossover: {ab['ratio_b_over_a']:.4f}")
ok = ab["mode"] == "crossover" and gpu_ratio and fallback == 0 and batch["a"] != batch["b"]
print("VERDICT ab-crossover:", "PASS" if ok else "FAIL", f"({ab['decision']})")
PY
  rc_of ab-summary $?
  note "$(grep -m1 '^decision' "$a/summary.txt")"
  note "$(grep -m1 '^GPU-to-GPU' "$a/summary.txt")"
  note "$(grep '^VERDICT' "$a/summary.txt" || echo 'VERDICT ab-crossover: FAIL (no summary, see ab/)')"
fi
compare_settings ab
pack

# =========================================================================================
# 3. node-budget, dry-run: 450 W per GPU shared, below the 700 W defaults
# =========================================================================================
n="$out/node-budget"
mkdir -p "$n"
budget=$((450 * ngpu))
sed -e "s/^node_budget_w = .*/node_budget_w = \"$budget\"/" \
  -e "s/^name = \"node-budget\"/name = \"node-budget-${budget}w\"/" \
  -e "s|^plugin = \"policy_node_budget.wasm\"|plugin = \"$d/policy_node_budget.wasm\"|" \
  "$d/specs/node-budget.toml" > "$n/node-budget-${budget}w.toml"
if [[ "$sim" == 1 ]]; then
  where=(--sim h200 --gpus 2)
else
  where=(--gpu "$gpu_list" --dry-run)
fi
timeout $((nb_s + 120)) "$tw" run --log "$log" --policy "$n/node-budget-${budget}w.toml" "${where[@]}" \
  --duration "${nb_s}s" --out "$n/run" --overwrite --cache-dir "$d/cache" --quiet \
  > "$n/run.stdout" 2> "$n/run.stderr"
rc_of node-budget $?
"$py" - "$n/run" "$budget" "$ngpu" "$n/run.stderr" > "$n/verdict.txt" 2>&1 << 'PY'
import json, re, sys
from collections import defaultdict
run, budget, ngpu, log = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ticks = defaultdict(dict)
for line in open(f"{run}/observations.jsonl"):
    j = json.loads(line)
    ticks[j["observation"]["tick"]][j["observation"]["gpu"]] = j
with open(f"{run}/caps.csv", "w") as caps:
    caps.write("tick," + ",".join(f"gpu{g}_requested_w,gpu{g}_in_force_w" for g in range(ngpu)) + ",sum_in_force_w\n")
    over, complete, worst = [], 0, 0.0
    for t in sorted(ticks):
        per = ticks[t]
        if len(per) != ngpu:
            continue
        complete += 1
        forced = [per[g]["in_force_after"]["power_cap_w"] for g in range(ngpu)]
        asked = [per[g]["requested"]["power_cap_w"] for g in range(ngpu)]
        total = sum(forced)
        worst = max(worst, total)
        if total > budget + 1e-6:
            over.append((t, total))
        caps.write(f"{t}," + ",".join(f"{'' if a is None else f'{a:g}'},{f:g}" for a, f in zip(asked, forced)) + f",{total:g}\n")
s = json.load(open(f"{run}/summary.json"))
print(f"{s['policy']} on {s['gpu_count']} GPU(s), {s['data_source']}; actuator {s['actuator']}")
print(f"budget {budget:g} W; {complete} ticks with a decision for every GPU; largest sum of caps in force {worst:g} W")
for g in range(ngpu):
    c = [ticks[t][g]["in_force_after"]["power_cap_w"] for t in sorted(ticks) if g in ticks[t]]
    b = [ticks[t][g]["in_force_after"]["batch_size"] for t in sorted(ticks) if g in ticks[t]]
    print(f"GPU {g}: cap {min(c):g}-{max(c):g} W (last {c[-1]:g}), batch {min(b)}-{max(b)}, "
          f"{s['gpus'][g]['tokens_per_joule']:.3f} tok/J")
print(f"ticks over the budget: {len(over)} {over[:5]}")
# The caps init decided before the first tick (observations.jsonl's `init`, on the first
# tick's line of each GPU), and whether they too sum within the budget.
first = ticks[min(ticks)] if ticks else {}
init_caps = [(first.get(g) or {}).get("init", {}).get("requested", {}).get("power_cap_w") for g in range(ngpu)]
init_known = all(c is not None for c in init_caps)
init_sum = sum(init_caps) if init_known else None
print(f"init caps requested: {init_caps}; sum {init_sum if init_known else 'unknown (no init record)'}")
if init_known and init_sum > budget + 1e-6:
    over.append(("init", init_sum))
# On real GPUs the dry run logs each cap it would set (the simulator applies them instead).
would = [re.sub("\x1b\\[[0-9;]*m", "", l).strip() for l in open(log, errors="replace")
         if "would set power cap" in l]
print(f"dry-run log: {len(would)} 'would set power cap' lines")
for w in would[:6]:
    print("    " + w[w.find("dry-run:"):])
ok = complete > 0 and not over and s["gpu_count"] == ngpu
print("VERDICT node-budget:", "PASS" if ok else "FAIL")
PY
rc_of node-budget-verdict $?
note "$(grep -m1 '^budget' "$n/verdict.txt")"
note "$(grep '^VERDICT' "$n/verdict.txt" || echo 'VERDICT node-budget: FAIL (no verdict, see node-budget/)')"
compare_settings node-budget
if [[ "$sim" != 1 ]]; then
  timeout 60 "$tw" gpus > "$out/tokwatt-gpus-after.txt" 2>&1
fi
note "exit codes: $(tr '\n' ';' < "$out/exit-codes.txt")"
pack
