#!/usr/bin/env bash
# Issue 16 on the H200: an interleaved A/B of two batch policies (observe-only: dry run,
# batch only; no GPU setting is changed), and issue 15's NVML call cost. Results in $OUT.
set -uo pipefail
d="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:?}"
q="power.limit,power.default_limit,clocks.applications.graphics,clocks_event_reasons.active,persistence_mode,compute_mode"
nvidia-smi --query-gpu=$q --format=csv > "$out/settings-before.csv"
nvidia-smi > "$out/nvidia-smi.txt"
for b in 256 512; do
  sed -e "/^power_cap_w = /d" -e "s/^# batch_size = \"256\"/batch_size = \"$b\"/" -e "s/^name = \"static\"/name = \"static-b$b\"/" \
      -e "s|^plugin = \"policy_static.wasm\"|plugin = \"$d/policy_static.wasm\"|" "$d/specs/static.toml" > "$d/specs/static-b$b.toml"
done
grep -n "batch_size\|^name\|^plugin" "$d/specs/static-b256.toml" > "$out/specs.txt"
export TOKWATT_LOG=info
timeout 420 "$d/tokwatt" ab --gpu 0 --dry-run --batch-only \
  --a "$d/specs/static-b256.toml" --b "$d/specs/static-b512.toml" \
  --epoch 15s --warmup 5s --budget 8 --seed 7 --out "$out/ab-h200" \
  --cache-dir "$d/cache" > "$out/ab.stdout" 2> "$out/ab.stderr"
echo "ab exit $?" >> "$out/ab.stdout"
timeout 150 python3 "$d/nvml_call_cost.py" "$out/nvml-call-cost.json" > "$out/nvml-call-cost.txt" 2>&1
timeout 60 "$d/tokwatt" bench agent-cpu --nvml 0 --nvml-repeat 8 --energy-only --samples-per-tick 1 \
  --tick-gauges-every 10 --slow-gauges-every 60 --duration 20s --repeats 1 \
  --policy "$d/specs/static.toml" --plugin-dir "$d" --cache-dir "$d/cache" > "$out/agent-cpu.txt" 2>&1
nvidia-smi --query-gpu=$q --format=csv > "$out/settings-after.csv"
diff "$out/settings-before.csv" "$out/settings-after.csv" > "$out/settings-diff.txt" && echo "settings identical" >> "$out/settings-diff.txt"
tar czf "$out/results.tgz" -C "$out" --exclude results.tgz .
