#!/usr/bin/env bash
# Issue 42, item 4: a policy under TTFT and TPOT bounds, turning the batch size and the
# token budget per step, against the best fixed setting of a sweep of the same knobs, on
# the same phased scenario with prompts. Batch and token budget only: no GPU setting is
# turned (--batch-only, and --dry-run on a GPU).
#
#   budget-sweep.sh OUT                      # on a GPU machine, from the bundle (dist/)
#   RUN_ON="--sim h100" budget-sweep.sh OUT  # the same on the simulator (SIMULATOR OUTPUT)
#
# Environment: TOKWATT (default ./tokwatt beside this script, else target/release/tokwatt),
# SPECS (default specs/ beside it, else policies/), SCENARIO (default serving-budget.toml),
# SECONDS_PER_RUN (60), BATCHES ("16 64"), BUDGETS ("512 2048 8192"), and the objective:
# TTFT_MS (800) and TPOT_MS (30), which the policy's spec and the judging share.
# The fixed settings run with --no-guard (their violations are counted, never taken over:
# a take-over would judge the guard's fallback under the setting's name); the policy runs
# under the guard, as an operator runs it.
# Writes OUT/fixed-B-T/ and OUT/policy/ (each run's files), OUT/sweep.json and
# OUT/sweep.txt (every run's tokens/J, whether the objective held, the verdict).
set -uo pipefail
out="${1:?usage: budget-sweep.sh OUT}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out"; out="$(cd "$out" && pwd)"
tokwatt="${TOKWATT:-}"
for candidate in "$here/tokwatt" "$here/../target/release/tokwatt"; do
  [[ -z "$tokwatt" && -x "$candidate" ]] && tokwatt="$candidate"
done
[[ -x "$tokwatt" ]] || { echo "no tokwatt binary: set TOKWATT" >&2; exit 2; }
specs="${SPECS:-}"
for candidate in "$here/specs" "$here/../policies"; do
  [[ -z "$specs" && -f "$candidate/slo-batch-budget.toml" ]] && specs="$candidate"
done
scenario="${SCENARIO:-}"
for candidate in "$here/scenarios/serving-budget.toml" "$here/../host/scenarios/serving-budget.toml"; do
  [[ -z "$scenario" && -f "$candidate" ]] && scenario="$candidate"
done
read -r -a run_on <<< "${RUN_ON:---gpu 0 --dry-run}"
# The specs written here name their plugins bare: found beside tokwatt (a bundle) or in
# the build's plugin folder.
export TOKWATT_PLUGIN_DIR="${TOKWATT_PLUGIN_DIR:-$(dirname "$tokwatt")}"
seconds="${SECONDS_PER_RUN:-60}"
ttft="${TTFT_MS:-800}"; tpot="${TPOT_MS:-30}"
status=0

# One run: NAME SPEC [FLAG...]. The objective is the same for every run (the judging one).
run() {
  local name=$1 spec=$2
  shift 2
  echo "== $name"
  "$tokwatt" run "${run_on[@]}" --batch-only "$@" --policy "$spec" --scenario "$scenario" \
    --duration "${seconds}s" --out "$out/$name" --overwrite --quiet \
    > "$out/$name.txt" 2> "$out/$name.log" || { echo "$name failed:"; tail -5 "$out/$name.log"; status=1; }
}

for batch in ${BATCHES:-16 64}; do
  for budget in ${BUDGETS:-512 2048 8192}; do
    spec="$out/fixed-$batch-$budget.toml"
    python3 - "$specs/static-batch.toml" "$spec" "$batch" "$budget" "$ttft" "$tpot" <<'PY'
import re, sys
src, dst, batch, budget, ttft, tpot = sys.argv[1:]
text = open(src).read()
text = re.sub(r'(?m)^name = .*$', f'name = "fixed-{batch}-{budget}"', text, count=1)
text = re.sub(r'(?m)^knobs = .*$', 'knobs = ["batch-size", "token-budget"]', text, count=1)
text = re.sub(r'(?m)^batch_size = .*$', f'batch_size = "{batch}"\ntoken_budget = "{budget}"', text, count=1)
text = re.sub(r'(?m)^\[objective\]$', f'[objective]\nttft_p99_limit_ms = {ttft}\ntpot_p99_limit_ms = {tpot}', text, count=1)
open(dst, "w").write(text)
PY
    # A fixed setting stays fixed: the guard counts its violations but never takes over
    # (a take-over would judge the guard's fallback under the fixed setting's name).
    run "fixed-$batch-$budget" "$spec" --no-guard
  done
done
policy_spec="$out/policy.toml"
python3 - "$specs/slo-batch-budget.toml" "$policy_spec" "$ttft" "$tpot" <<'PY'
import re, sys
src, dst, ttft, tpot = sys.argv[1:]
text = open(src).read()
text = re.sub(r'(?m)^ttft_p99_limit_ms = .*$', f'ttft_p99_limit_ms = {ttft}', text, count=1)
text = re.sub(r'(?m)^tpot_p99_limit_ms = .*$', f'tpot_p99_limit_ms = {tpot}', text, count=1)
open(dst, "w").write(text)
PY
run policy "$policy_spec"

python3 - "$out" "$ttft" "$tpot" "${run_on[*]}" <<'PY' | tee "$out/sweep.txt" || status=1
import json, os, sys
out, ttft, tpot, on = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
rows = []
for name in sorted(os.listdir(out)):
    path = os.path.join(out, name, "summary.json")
    if not os.path.isfile(path):
        continue
    s = json.load(open(path))
    lat = s.get("request_latency") or {}
    t99, p99 = lat.get("ttft_p99_ms"), lat.get("tpot_p99_ms")
    held = t99 is not None and p99 is not None and t99 <= ttft and p99 <= tpot
    rows.append({
        "run": name, "tokens_per_joule": s["tokens_per_joule"], "tokens": s["tokens"],
        "energy_j": s["energy_j"], "requests": lat.get("requests"),
        "ttft_p99_ms": t99, "tpot_p99_ms": p99, "objective_held": held,
        "slo_violation_ticks": s.get("slo_violation_ticks"), "ticks": s.get("ticks"),
        "simulated": s.get("simulated"), "gpu": s.get("gpu_name"),
    })
fixed = [r for r in rows if r["run"].startswith("fixed-")]
policy = next((r for r in rows if r["run"] == "policy"), None)
held = [r for r in fixed if r["objective_held"]]
best = max(held, key=lambda r: r["tokens_per_joule"]) if held else None
label = "SIMULATOR OUTPUT" if rows and rows[0]["simulated"] else "measured on the GPU"
print(f"token-budget sweep ({label}; {on}); objective: request TTFT p99 <= {ttft} ms, TPOT p99 <= {tpot} ms")
print(f"{'run':18} {'tok/J':>7} {'TTFT p99':>9} {'TPOT p99':>9} {'held':>5} {'SLO ticks':>9}")
for r in rows:
    f = lambda v, d: "n/a" if v is None else f"{v:.{d}f}"
    print(f"{r['run']:18} {r['tokens_per_joule']:7.3f} {f(r['ttft_p99_ms'], 1):>9} {f(r['tpot_p99_ms'], 2):>9} "
          f"{str(r['objective_held']):>5} {str(r['slo_violation_ticks']):>9}")
verdict = {}
if best:
    verdict["best_fixed"] = best["run"]
    print(f"best fixed setting that held the objective: {best['run']} ({best['tokens_per_joule']:.3f} tok/J)")
else:
    print("no fixed setting held the objective")
if policy and best:
    verdict["policy_over_best_fixed"] = policy["tokens_per_joule"] / best["tokens_per_joule"]
    print(f"policy: {policy['tokens_per_joule']:.3f} tok/J = {verdict['policy_over_best_fixed']:.3f} x the best fixed; objective held: {policy['objective_held']}")
json.dump({"label": label, "on": on, "ttft_p99_limit_ms": ttft, "tpot_p99_limit_ms": tpot,
           "runs": rows, **verdict}, open(os.path.join(out, "sweep.json"), "w"), indent=1)
sys.exit(0 if policy is not None and len(fixed) > 0 else 1)
PY
exit $status
