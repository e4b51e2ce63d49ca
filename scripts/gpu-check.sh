#!/usr/bin/env bash
# The GPU checks, from a bundle made by scripts/gpu-bundle.sh, on a GPU machine with no
# Rust toolchain. Changes NO GPU setting: the run is dry-run (observe-only); only the
# workload's own batch size moves. Writes everything under OUT.
#
#   gpu-check.sh OUT [SECONDS_PER_BATCH]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: gpu-check.sh OUT [SECONDS_PER_BATCH]}"
seconds="${2:-6}"
mkdir -p "$out"
cd "$here"
export TOKWATT_PLUGIN_DIR="$here"
status=0
step() { echo; echo "== $*"; }

# Only the settings tokwatt could change: power limits and clock locks.
settings() {
  nvidia-smi -q -d POWER,CLOCK | grep -E "Power Limit|Locked|Applications Clocks|Default Applications|Max Clocks" -A0 \
    | grep -vE "Power Draw|Instantaneous" || true
}

step "GPU settings before"
settings | tee "$out/settings-before.txt"

step "tokwatt gpus"
./tokwatt gpus | tee "$out/gpus.txt" || status=1

step "library tests (CUDA and NVML tests run for real here)"
./tokwatt-lib-tests --test-threads=1 2>&1 | tail -n 40 | tee "$out/lib-tests.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

step "tokwatt bench workload (llama-3-8b, ctx 1024)"
./tokwatt bench workload --model llama-3-8b --context 1024 --seconds "$seconds" \
  --json "$out/bench-tokwatt.json" 2>&1 | tee "$out/bench-tokwatt.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

if [[ -f pytorch_decode_reference.py ]]; then
  step "PyTorch reference, same GPU, same run"
  MODEL=llama-3-8b CTX=1024 BATCHES=1,4,16,64,128,256,512 \
    python3 pytorch_decode_reference.py > "$out/bench-reference.json" 2> "$out/bench-reference.log" || status=1
  tail -n 12 "$out/bench-reference.log"
fi

step "dry-run tokwatt run: cap and batch decided, caps logged not applied"
./tokwatt run --gpu 0 --dry-run --policy specs/cap-and-batch.toml --duration 60s \
  --out "$out/run" --log tokwatt=info 2> "$out/run.log" | tee "$out/run.txt"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
grep -c "dry-run: would" "$out/run.log" | sed 's/^/dry-run decisions logged: /'

step "GPU settings after (must equal before)"
settings | tee "$out/settings-after.txt"
if diff "$out/settings-before.txt" "$out/settings-after.txt"; then
  echo "settings unchanged"
else
  echo "SETTINGS CHANGED"; status=1
fi
exit $status
