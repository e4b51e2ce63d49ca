#!/usr/bin/env bash
# Build everything the GPU checks need on a machine WITHOUT a GPU, into one folder that
# travels to a GPU machine WITHOUT a Rust toolchain:
#
#   scripts/gpu-bundle.sh [DIR]          # default DIR: dist/
#   (copy DIR to the GPU machine)
#   DIR/gpu-check.sh OUT                 # on the GPU machine; results land in OUT
#
# The bundle holds the release `tokwatt` binary, the built policy plugins and specs, the
# unit-test binaries of the agent, NVML and CUDA crates (their GPU tests run for real where
# a GPU is present),
# and the PyTorch decode and prefill references when ../shared/calibration has it. With LAB=1 it also holds
# `kernel-lab`, the kernel timings kept out of the product (docs/kernel-experiments.md). With
# TESTS=0 it leaves the unit-test binaries out (minutes of building saved where the call runs
# no `tests` part).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dist="${1:-$root/dist}"
cd "$root"

cargo build --release -p tokwatt
# The unit tests of the crates that touch a GPU (NVML, the CUDA decode) and of the agent's
# library, one executable each, as `name path` lines (cargo prints their paths).
test_bins=""
[[ "${TESTS:-1}" == 0 ]] || test_bins="$(cargo test --release -p tokwatt -p tokwatt-nvml -p tokwatt-cuda --lib --no-run \
  --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["target"]["name"], m["executable"])')"

rm -rf "$dist"
mkdir -p "$dist/specs" "$dist/scenarios"
# Stripped: the debug info is most of their size, and the bundle travels.
strip -o "$dist/tokwatt" target/release/tokwatt
while read -r name path; do
  [[ -n "$name" ]] || continue
  strip -o "$dist/tests-$name" "$path"
done <<< "$test_bins"
if [[ "${LAB:-0}" == 1 ]]; then
  cargo build --release -p tokwatt --features lab --bin kernel-lab
  strip -o "$dist/kernel-lab" target/release/kernel-lab
fi
# The shipped policies, and the fixtures the library's plugin tests load.
cp target/plugins/wasm32-wasip2/plugin/policy_*.wasm "$dist/"
cp target/plugins/wasm32-wasip2/plugin/fixture_*.wasm "$dist/"
cp policies/*.toml "$dist/specs/"
cp host/scenarios/*.toml "$dist/scenarios/"
cp scripts/gpu-check.sh scripts/guard-summary.py scripts/budget-sweep.sh scripts/clock-sampler.py "$dist/"
# promtool checks the agent's /metrics on the GPU machine (a static Go binary, compressed:
# it is twice the size of tokwatt).
if command -v promtool >/dev/null; then
  gzip -9 -c "$(command -v promtool)" > "$dist/promtool.gz"
fi
for reference in pytorch_decode_reference.py pytorch_prefill_reference.py; do
  if [[ -f "$root/../shared/calibration/$reference" ]]; then
    cp "$root/../shared/calibration/$reference" "$dist/"
  fi
done
du -sh "$dist"
echo "bundle ready in $dist: run $dist/gpu-check.sh OUT on a GPU machine"
