#!/usr/bin/env bash
# Issue 17 on the H200: the Python and JavaScript example policies steer the real CUDA
# decode's batch size (caps and clocks dry-run: no GPU setting is changed). Results in $OUT.
set -uo pipefail
d="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:?}"
cd "$d"
timev=""
[ -x /usr/bin/time ] && timev="/usr/bin/time -v"
gunzip -kf python.wasm.gz js.wasm.gz
q="power.limit,power.default_limit,clocks.applications.graphics,clocks_event_reasons.active,persistence_mode,compute_mode"
nvidia-smi --query-gpu=$q --format=csv > "$out/settings-before.csv"
for lang in python js; do
  t0=$SECONDS
  timeout 60 ./tokwatt plugin compile "$lang.wasm" --cache-dir "$d/cache" > "$out/$lang-compile.txt" 2>&1
  timeout 40 ./tokwatt bench decide --plugin "$lang.wasm" --cache-dir "$d/cache" --gpus 8 --calls 20000 > "$out/$lang-bench-decide.txt" 2>&1
  timeout 200 $timev ./tokwatt run --gpu 0 --dry-run --batch-only --policy "$lang.toml" \
    --duration 90s --out "$out/$lang-run" --cache-dir "$d/cache" --state-file "$d/state-$lang.json" --log info \
    > "$out/$lang-run.stdout" 2> "$out/$lang-run.stderr"
  echo "$lang run exit $? after $((SECONDS - t0)) s (compile, bench and run)" >> "$out/exit-codes.txt"
done
nvidia-smi --query-gpu=$q --format=csv > "$out/settings-after.csv"
diff "$out/settings-before.csv" "$out/settings-after.csv" > "$out/settings-diff.txt" && echo "settings identical" >> "$out/settings-diff.txt"
rm -f "$out"/*-run/trace.csv.gz
tar czf "$out/results.tgz" -C "$out" --exclude results.tgz .
