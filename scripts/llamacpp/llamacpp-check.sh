#!/usr/bin/env bash
# llama.cpp's server on the GPU, read by tokwatt (issue 42, part 5). Runs on the GPU machine
# from the folder scripts/llamacpp-bundle.sh made, beside dist/ from scripts/gpu-bundle.sh:
#
#   dist-llamacpp/llamacpp-check.sh OUT
#
# 1. builds llama-server with CUDA for sm_90 (cached in $LLAMACPP_WORK, default
#    /tmp/tokwatt-llamacpp, so a second call on the same machine skips it);
# 2. writes a random-weight Llama-3-8B-shaped GGUF of $LAYERS layers (default 4) with the
#    tree's own gguf-py;
# 3. starts `llama-server --metrics -ngl 99` on loopback;
# 4. starts `tokwatt run --gpu 0 --dry-run --workload external --engine llamacpp` on its
#    /metrics, then drives loadgen.py ($CLIENTS clients, $REQUESTS requests of $PROMPT prompt
#    and $PREDICT predicted tokens), waits for two more scrapes and stops tokwatt (SIGINT);
# 5. writes into OUT: compare.json and compare.txt (both sides' tokens, TTFT and TPOT), load.json
#    (the load generator's), run/ (tokwatt's summary.json, trace.csv), refusals.txt (tokwatt
#    asked for a TTFT and a TPOT bound on llama.cpp), gpu-settings-{before,after}.txt and
#    settings-unchanged.txt, timings.txt, and each step's log.
#
# Reads the GPU's settings, never sets one (tokwatt runs --dry-run). Each step has a time
# limit; the whole fits one 10-minute device call (the CUDA build took 313 s on 16 cores).
# The tokwatt binary: $TOKWATT, else ./tokwatt beside this script, else ../dist/tokwatt.
#
# To try the script on a machine without a GPU: BUILD=cpu SHAPE=tiny RUN_ON="--sim h200"
# (a CPU server, the ~16 MB model, tokwatt beside the simulated GPU).
set -uo pipefail
out="${1:?usage: llamacpp-check.sh OUT}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out"; out="$(cd "$out" && pwd)"
work="${LLAMACPP_WORK:-/tmp/tokwatt-llamacpp}"
layers="${LAYERS:-4}"; clients="${CLIENTS:-8}"; requests="${REQUESTS:-128}"
prompt="${PROMPT:-512}"; predict="${PREDICT:-256}"; port="${PORT:-18080}"
build="${BUILD:-cuda}"; shape="${SHAPE:-llama-3-8b}"
read -r -a run_on <<< "${RUN_ON:---gpu 0 --dry-run}"
tokwatt="${TOKWATT:-}"
# The bundle carries tokwatt gzipped (scripts/llamacpp-bundle.sh).
if [[ -z "$tokwatt" && -f "$here/tokwatt.gz" && ! -x "$here/tokwatt" ]]; then
  gunzip -c "$here/tokwatt.gz" > "$here/tokwatt" && chmod +x "$here/tokwatt"
fi
for candidate in "$here/tokwatt" "$here/../dist/tokwatt"; do
  [[ -z "$tokwatt" && -x "$candidate" ]] && tokwatt="$candidate"
done
[[ -x "$tokwatt" ]] || { echo "no tokwatt binary: set TOKWATT, or carry dist/ (scripts/gpu-bundle.sh) beside $here" >&2; exit 2; }
"$tokwatt" run --help | grep -q llamacpp \
  || { echo "$tokwatt has no llamacpp engine preset: rebuild dist/ with scripts/gpu-bundle.sh" >&2; exit 2; }
specs="$(dirname "$tokwatt")/specs"
[[ -f "$specs/static.toml" ]] || specs="$here/../policies"

timings="$out/timings.txt"; : > "$timings"
step() { echo "== $1 [$SECONDS s]"; }
took() { echo "$1 $2 s" | tee -a "$timings"; }
server_pid=""; tokwatt_pid=""
cleanup() {
  [[ -n "$tokwatt_pid" ]] && kill -INT "$tokwatt_pid" 2>/dev/null
  [[ -n "$server_pid" ]] && kill "$server_pid" 2>/dev/null
  wait 2>/dev/null
}
trap cleanup EXIT

# What tokwatt could change: power limits, application clocks, clock locks. Read only.
settings() {
  nvidia-smi --query-gpu=index,name,power.limit,enforced.power.limit,power.default_limit,clocks.applications.graphics,clocks.applications.memory,clocks.default_applications.graphics,persistence_mode,compute_mode --format=csv
  nvidia-smi -q -d POWER,CLOCK | grep -E "Power Limit|Locked|Applications Clocks|Default Applications" -A0
}
step "GPU settings before"
settings > "$out/gpu-settings-before.txt" 2>&1; cat "$out/gpu-settings-before.txt"

step "build llama-server ($build)"
s=$SECONDS
server="$(timeout 420 "$here/build-server.sh" "$here" "$work" "$build" "$(nproc)" 2> "$out/build.err" | tail -1)"
took build $((SECONDS - s))
cp "$work"/{cmake,build}.log "$out/" 2>/dev/null
[[ -x "$server" ]] || { echo "the CUDA build failed or ran out of time:"; tail -30 "$out/build.err"; exit 1; }

step "random-weight $shape-shaped model, $layers layers"
s=$SECONDS
model="$work/$shape-$layers.gguf"
if [[ ! -f "$model" ]]; then
  timeout 180 python3 "$here/make_model.py" --gguf-py "$work/llama.cpp/gguf-py" \
    --vocab "$here/ggml-vocab-llama-bpe.gguf" --out "$model.part" --layers "$layers" --shape "$shape" \
    > "$out/model.log" 2>&1 && mv "$model.part" "$model"
fi
took model $((SECONDS - s))
[[ -f "$model" ]] || { echo "writing the model failed:"; tail -20 "$out/model.log"; exit 1; }

step "llama-server --metrics -ngl 99 on 127.0.0.1:$port"
s=$SECONDS
# Each of the $clients slots gets a context of prompt + predicted tokens with room to spare.
context=$(( clients * (prompt + predict + 64) ))
"$server" -m "$model" --metrics -ngl 99 -c "$context" -np "$clients" \
  --host 127.0.0.1 --port "$port" > "$out/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.5
done
took server-start $((SECONDS - s))
curl -sf "http://127.0.0.1:$port/health" > /dev/null \
  || { echo "llama-server did not come up:"; tail -30 "$out/server.log"; exit 1; }
curl -s "http://127.0.0.1:$port/metrics" > "$out/metrics-before.txt"

step "tokwatt run ${run_on[*]} --workload external --engine llamacpp, under load"
metrics="http://127.0.0.1:$port/metrics"
run_flags=("${run_on[@]}" --workload external --engine llamacpp --metrics-url "$metrics")
"$tokwatt" run "${run_flags[@]}" --policy "$specs/static.toml" --duration 5m \
  --out "$out/run" --overwrite > "$out/run.txt" 2> "$out/run.log" &
tokwatt_pid=$!
# tokwatt's first scrape is the baseline its windows count from: load only after it.
for _ in $(seq 1 60); do
  grep -q "running policy" "$out/run.log" && break
  kill -0 "$tokwatt_pid" 2>/dev/null || break
  sleep 0.5
done
grep -q "running policy" "$out/run.log" || { echo "tokwatt did not start:"; cat "$out/run.log"; exit 1; }
s=$SECONDS
timeout 300 python3 "$here/loadgen.py" --url "http://127.0.0.1:$port" --clients "$clients" \
  --requests "$requests" --prompt-tokens "$prompt" --n-predict "$predict" \
  --out "$out/load.json" > /dev/null 2> "$out/load.log" || echo "the load generator reported failures (load.json)"
took load $((SECONDS - s))
# Two more scrapes (1 s apart) and ticks, so the last tokens are in a window.
sleep 3
kill -INT "$tokwatt_pid"; wait "$tokwatt_pid"; echo "tokwatt exited $?"; tokwatt_pid=""
curl -s "http://127.0.0.1:$port/metrics" > "$out/metrics-after.txt"

step "tokwatt asked to bound latencies llama.cpp does not export"
{
  echo "\$ tokwatt run ... --engine llamacpp --ttft-p99-limit-ms 500 (spec static)"
  "$tokwatt" run "${run_flags[@]}" --policy "$specs/static.toml" --duration 1s \
    --ttft-p99-limit-ms 500 --out "$out/refused-ttft" 2>&1
  echo "exit $?"
  echo "\$ tokwatt run ... --engine llamacpp (spec cap-and-batch, tpot_p99_limit_ms = 20)"
  "$tokwatt" run "${run_flags[@]}" --policy "$specs/cap-and-batch.toml" --duration 1s \
    --out "$out/refused-tpot" 2>&1
  echo "exit $?"
} > "$out/refusals.txt"
cat "$out/refusals.txt"

kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null; server_pid=""
step "GPU settings after"
settings > "$out/gpu-settings-after.txt" 2>&1
if diff "$out/gpu-settings-before.txt" "$out/gpu-settings-after.txt" > /dev/null; then
  echo "unchanged" > "$out/settings-unchanged.txt"
else
  { echo "CHANGED"; diff "$out/gpu-settings-before.txt" "$out/gpu-settings-after.txt"; } > "$out/settings-unchanged.txt"
fi
cat "$out/settings-unchanged.txt"

python3 - "$out" <<'PY'
import csv, json, sys
out = sys.argv[1]
load = json.load(open(f"{out}/load.json"))
# summary.json writes the run's facts and totals at its top level.
totals = json.load(open(f"{out}/run/summary.json"))
rows = list(csv.DictReader(open(f"{out}/run/trace.csv")))
with_tokens = [r for r in rows if float(r.get("tokens") or 0) > 0]
tpot_values = sorted({r.get("tpot_p99_ms") for r in with_tokens})
refusals = open(f"{out}/refusals.txt").read()
compare = {
    "load_generator": {
        "requests": load["requests"], "failed": load["failed"],
        "tokens_predicted": load["tokens_predicted"], "prompt_tokens": load["prompt_tokens"],
        "ttft_ms": load["ttft_ms"], "tpot_ms": load["tpot_ms"], "tokens_per_s": load["tokens_per_s"],
    },
    "tokwatt": {
        "tokens": totals["tokens"],
        "ticks_with_tokens": len(with_tokens),
        "tpot_p99_ms_in_trace_on_ticks_with_tokens": tpot_values,
        "tpot": "unavailable: llama.cpp exports no TPOT histogram (NaN in trace.csv; a TPOT bound is refused)",
        "ttft": "unavailable: llama.cpp exports no TTFT histogram (no requests in summary.json; a TTFT bound is refused)"
                if "requests" not in totals else totals["requests"],
        "summary_has_requests": "requests" in totals,
        "ttft_bound_refused": "--ttft-histogram" in refusals,
        "tpot_bound_refused": "--tpot-histogram" in refusals,
    },
}
generated = load["tokens_predicted"]
compare["tokens_ratio"] = totals["tokens"] / generated if generated else None
compare["tokens_within_1_percent"] = bool(generated) and abs(totals["tokens"] - generated) <= 0.01 * generated
json.dump(compare, open(f"{out}/compare.json", "w"), indent=2)
lines = [
    f"{'':28} {'load generator':>16} {'tokwatt':>16}",
    f"{'tokens predicted':28} {generated:>16} {totals['tokens']:>16}",
    f"{'TTFT p50 / p99 ms':28} {load['ttft_ms']['p50'] or float('nan'):>7.1f} / {load['ttft_ms']['p99'] or float('nan'):>6.1f} {'unavailable':>16}",
    f"{'TPOT p50 / p99 ms':28} {load['tpot_ms']['p50'] or float('nan'):>7.2f} / {load['tpot_ms']['p99'] or float('nan'):>6.2f} {'unavailable':>16}",
    f"tokens within 1 %: {compare['tokens_within_1_percent']} (ratio {compare['tokens_ratio']})",
    f"TTFT bound refused: {compare['tokwatt']['ttft_bound_refused']}, TPOT bound refused: {compare['tokwatt']['tpot_bound_refused']}",
]
open(f"{out}/compare.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "done in $SECONDS s; results in $out"
