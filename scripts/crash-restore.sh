#!/usr/bin/env bash
# Crash safety, end to end: N times, start a simulated run whose policy changes the power
# cap and the SM clock every 50 ms tick, kill it with `kill -9` at a random moment
# (0.05-2 s after start), then run `tokwatt restore` on the state file it left behind
# and check, by value, that every saved original is the GPU's stock setting and that the
# restore put each one back.
#
#   scripts/crash-restore.sh [N=100]
#
# Environment:
#   TOKWATT_BIN   use this tokwatt binary instead of building one
#   PROFILE       debug (default) or release: which build to make and use
#   SEED          seed for the kill delays (default: the time); printed, so a failing
#                 sequence can be replayed
#   KEEP=1        keep the temporary folder of each failed iteration
#
# What "by value" means on the simulator: `tokwatt restore --sim` restores through a fresh
# simulated GPU, which starts at the profile's defaults, so the restore cannot show a
# changed value going back. The script therefore checks the three things that together
# make a crash safe: (1) before the kill the run had really changed the settings (its
# observations show the policy's cap and clock in force); (2) the state file it left
# holds, for every GPU, exactly the profile's stock values (default power limit, no clock
# locks) — the values a restore must write; (3) `tokwatt restore` names every GPU and
# every setting with that same original value and an outcome of "restored" or "already in
# place", deletes the state file, and a second restore finds nothing to do. That the
# restore writes those values into a GPU whose settings were changed is checked in the
# test suite (tests/all/restore.rs, `random_kill_9s_are_all_restored_by_value`), through
# the library on a simulated GPU left in the crashed run's settings.
#
# Prints "N passed, M failed" and exits non-zero when any iteration failed.

set -euo pipefail

N="${1:-100}"
if ! [[ "$N" =~ ^[0-9]+$ ]] || [ "$N" -lt 1 ]; then
    echo "usage: $0 [N>=1]" >&2
    exit 2
fi
for tool in jq python3; do
    command -v "$tool" >/dev/null || { echo "$0 needs $tool" >&2; exit 2; }
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROFILE="${PROFILE:-debug}"
if [ -n "${TOKWATT_BIN:-}" ]; then
    BIN="$TOKWATT_BIN"
else
    case "$PROFILE" in
        debug) (cd "$ROOT" && cargo build -q -p tokwatt --bin tokwatt) ;;
        release) (cd "$ROOT" && cargo build -q --release -p tokwatt --bin tokwatt) ;;
        *) echo "PROFILE must be debug or release" >&2; exit 2 ;;
    esac
    BIN="$ROOT/target/$PROFILE/tokwatt"
fi
[ -x "$BIN" ] || { echo "no tokwatt binary at $BIN" >&2; exit 2; }

SEED="${SEED:-$(date +%s)}"
RANDOM="$SEED"
GPUS=2
WORK="$(mktemp -d "${TMPDIR:-/tmp}/tokwatt-crash-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# Compiled plugins are cached once for all iterations, away from the user's cache.
export TOKWATT_CACHE_DIR="$WORK/component-cache"
unset RUST_LOG

# The stock settings of the simulated H200, from its profile: what every saved original
# must be, since each run starts on a fresh simulated GPU.
DEFAULT_W="$(python3 - "$ROOT/host/profiles/h200.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print(tomllib.load(f)["power_cap"]["default_w"])
EOF
)"
SM_MAX="$(python3 - "$ROOT/host/profiles/h200.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print(tomllib.load(f)["clocks"]["sm_max_mhz"])
EOF
)"

# The shipped `static` policy at a 50 ms tick, holding a cap and a clock far from the
# defaults: the first tick changes both, so almost every kill lands on changed settings.
SPEC="$WORK/crash-static.toml"
cat >"$SPEC" <<EOF
name = "crash-static"
plugin = "policy_static.wasm"
knobs = ["power-cap", "sm-clock", "batch-size"]
tick_ms = 50
[params]
power_cap_w = "400"
sm_clock_max_mhz = "1500"
batch_size = "128"
[guardrails]
power_cap_min_w = 300.0
power_cap_max_w = 700.0
# A call may take up to twice its deadline, and must fit in its tick.
[sandbox]
deadline_ms = 25
EOF

# A lock in the restore report's words.
describe_lock() {
    jq -r 'if . == null then "no lock" else "\(.[0])-\(.[1]) MHz" end' <<<"$1"
}

passed=0
failed=0
changed=0
early=0
echo "crash-restore: $N iterations, seed $SEED, binary $BIN"
for i in $(seq 1 "$N"); do
    dir="$WORK/$i"
    mkdir -p "$dir"
    state="$dir/state.json"
    delay_ms=$((50 + RANDOM % 1951))
    "$BIN" run --sim h200 --gpus "$GPUS" --realtime --quiet --duration 1h \
        --policy "$SPEC" --state-file "$state" --out "$dir/out" \
        >"$dir/run.out" 2>"$dir/run.err" &
    pid=$!
    sleep "$(printf '%d.%03d' $((delay_ms / 1000)) $((delay_ms % 1000)))"
    problems=()
    if ! kill -0 "$pid" 2>/dev/null; then
        problems+=("the run exited before the kill: $(tail -3 "$dir/run.err")")
    fi
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true

    # (1) What the run had in force when it died: the last whole observation per GPU
    # (the line being written at the kill may be cut short).
    in_force="[]"
    if [ -f "$dir/out/observations.jsonl" ]; then
        in_force="$(jq -R 'fromjson? // empty' "$dir/out/observations.jsonl" |
            jq -s 'group_by(.observation.gpu) | map(last.in_force_after)')"
    fi
    if jq -e --argjson w "$DEFAULT_W" --argjson f "$SM_MAX" \
        'any(.[]; .power_cap_w != $w or .sm_clock_max_mhz != $f)' <<<"$in_force" >/dev/null; then
        changed=$((changed + 1))
    fi

    if [ -f "$state" ]; then
        # (2) The saved originals, by value.
        if ! jq -e --argjson w "$DEFAULT_W" --argjson n "$GPUS" '
            .format == 1 and (.gpus | length) == $n
            and ([.gpus[].uuid] | sort) == ([range($n)] | map("SIM-h200-\(.)"))
            and all(.gpus[]; .original.power_cap_w == $w
                and .original.sm_clock_lock_mhz == null
                and .original.mem_clock_lock_mhz == null)' "$state" >/dev/null; then
            problems+=("the state file does not hold the stock settings: $(jq -c . "$state" 2>&1)")
        fi
        saved="$(jq -c . "$state")"
        # (3) The restore, by value, GPU by GPU and setting by setting.
        if "$BIN" restore --sim h200 --state-file "$state" >"$dir/restore.out" 2>"$dir/restore.err"; then
            report="$(cat "$dir/restore.out")"
            for g in $(seq 0 $((GPUS - 1))); do
                uuid="$(jq -r ".gpus[$g].uuid" <<<"$saved")"
                index="$(jq -r ".gpus[$g].index" <<<"$saved")"
                watts="$(jq -r ".gpus[$g].original.power_cap_w | round" <<<"$saved")"
                sm="$(describe_lock "$(jq -c ".gpus[$g].original.sm_clock_lock_mhz" <<<"$saved")")"
                mem="$(describe_lock "$(jq -c ".gpus[$g].original.mem_clock_lock_mhz" <<<"$saved")")"
                block="$(awk -v head="GPU $uuid (was $index):" '
                    $0 == head { on = 1; next } /^GPU / { on = 0 } on' <<<"$report")"
                ok='(restored|already in place)$'
                grep -Eq "^  power cap -> $watts W: $ok" <<<"$block" ||
                    problems+=("GPU $uuid: power cap not restored to $watts W")
                grep -Eq "^  SM clock lock -> $sm: $ok" <<<"$block" ||
                    problems+=("GPU $uuid: SM clock lock not restored to $sm")
                grep -Eq "^  memory clock lock -> $mem: $ok" <<<"$block" ||
                    problems+=("GPU $uuid: memory clock lock not restored to $mem")
            done
            [ ! -e "$state" ] || problems+=("the state file is still there after a complete restore")
            again="$("$BIN" restore --sim h200 --state-file "$state" 2>&1)" || true
            grep -q "nothing to restore" <<<"$again" ||
                problems+=("a second restore did something: $again")
        else
            problems+=("tokwatt restore failed: $(cat "$dir/restore.err")")
        fi
    else
        # Killed before the originals were saved: nothing may have changed yet.
        early=$((early + 1))
        if [ "$in_force" != "[]" ]; then
            problems+=("settings were in force but no state file was left: $in_force")
        fi
        out="$("$BIN" restore --sim h200 --state-file "$state" 2>&1)" || true
        grep -q "nothing to restore" <<<"$out" ||
            problems+=("restore without a state file: $out")
    fi

    if [ "${#problems[@]}" -eq 0 ]; then
        passed=$((passed + 1))
        rm -rf "$dir"
    else
        failed=$((failed + 1))
        echo "iteration $i (kill after ${delay_ms} ms) FAILED:" >&2
        printf '  %s\n' "${problems[@]}" >&2
        if [ "${KEEP:-}" = 1 ]; then
            kept="$(mktemp -d "${TMPDIR:-/tmp}/tokwatt-crash-failed-XXXXXX")"
            cp -r "$dir/." "$kept/"
            echo "  kept in $kept" >&2
        fi
    fi
done

echo "crash-restore: settings changed at the kill in $changed of $N runs; $early killed before the first change"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
