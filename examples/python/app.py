"""An example tokwatt policy in Python: hold a power cap, steer the batch by p99 TPOT.

Built into a WebAssembly component with componentize-py (see README.md):

    componentize-py -d ../../wit -w policy componentize app -o policy.wasm

The rules (the same as the Rust scaffold of `tokwatt plugin new`):

- Power cap (knob `power-cap`): held at the `power_cap_w` parameter, fitted to each
  GPU's range, and asked for again only when the cap in force drifts from it.
- Batch size (knob `batch-size`, only under a `tpot_p99_limit_ms` objective): starts at
  the workload's largest batch; a tick whose p99 TPOT breaks the limit cuts it to
  `shrink` of itself; `grow_after_ticks` calm ticks in a row (p99 under `headroom` of
  the limit, with requests waiting or every slot busy) grow it by `grow`.

Parameters (all optional, TOML strings in the spec's [params]):

    power_cap_w       500   power cap to hold, watts
    shrink            0.8   batch multiplier on a violation (0 < shrink < 1)
    grow              1.1   batch multiplier when calm (> 1)
    grow_after_ticks  5     calm ticks in a row before one growth step
    headroom          0.8   "calm": p99 under this fraction of the limit

Traps this example handles:

- STATE LIVES IN A MODULE-LEVEL OBJECT, NOT ON `self`. componentize-py makes a fresh
  `Guest` object for every exported call, so anything `init` stored on `self` is gone
  by `decide` (and the policy then fails on every tick). The module itself stays alive
  for as long as the host keeps the instance, so `_POLICY` below holds everything.
- An unknown TPOT is NaN, never "within the limit". A window in which the engine
  finished no request has no p99. `nan > limit` is False, so a naive check reads it as
  calm and grows the batch blind; here such a tick neither cuts nor counts as calm.
- One answer per observation, in order: the host refuses any other number.
- Settling windows (a setting changed during them) are skipped.
- An error in `init` or `restore` is raised as `Err("...")`, which the host shows as the
  reason. Any other exception traps the call; the host prints its traceback.
"""

import json
import math
from dataclasses import dataclass, field
from typing import List, Optional

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import host
from wit_world.imports.types import (
    InitArgs,
    Knobs,
    LogLevel,
    Observation,
    Settings,
    State,
)

# The layout of `snapshot`'s JSON: {"gpus": [{"batch_target", "calm_ticks"}, ...]}.
# Raise it when the layout changes, and keep reading the old one in `restore`.
SCHEMA_VERSION = 1

# The power cap counts as drifted when it is further than this from its target (NVML
# keeps milliwatts; a host may round to whole watts).
POWER_CAP_TOLERANCE_W = 0.5

KNOWN_PARAMS = ("power_cap_w", "shrink", "grow", "grow_after_ticks", "headroom")


@dataclass
class GpuState:
    """What one GPU's batch rule remembers between ticks."""

    batch_target: int  # the batch size asked for, sequences
    batch_max: int  # the largest batch the workload takes on this GPU
    calm_ticks: int  # calm ticks in a row since the last change
    power_cap_w: Optional[float]  # the cap to hold, fitted to the GPU's range


@dataclass
class PolicyState:
    """Everything the policy knows: its parameters and one GpuState per GPU."""

    tpot_limit_ms: Optional[float] = None
    steer_batch: bool = False
    shrink: float = 0.8
    grow: float = 1.1
    grow_after_ticks: int = 5
    headroom: float = 0.8
    gpus: List[GpuState] = field(default_factory=list)


# The policy's state: module-level, because each exported call gets a new `Guest`.
_POLICY = PolicyState()


def _param(params: dict, key: str, default, kind):
    text = params.get(key)
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        raise Err(f"`{key}` = {text!r} is not a {kind.__name__}")


def _batch_step(gpu: GpuState, observation: Observation) -> Optional[int]:
    """The batch rule for one GPU: the new target, or None to leave it."""
    limit_ms = _POLICY.tpot_limit_ms
    if limit_ms is None or not _POLICY.steer_batch or observation.settling:
        return None
    p99_ms = observation.tpot_p99_ms
    if math.isnan(p99_ms):
        # Unknown latency: no evidence either way. Hold, and do not count it calm.
        return None
    if p99_ms > limit_ms:
        gpu.calm_ticks = 0
        cut = max(1, math.floor(gpu.batch_target * _POLICY.shrink))
        return cut if cut != gpu.batch_target else None
    busy = observation.queue_depth > 0 or observation.active_sequences >= gpu.batch_target
    if p99_ms < _POLICY.headroom * limit_ms and busy:
        gpu.calm_ticks += 1
    else:
        gpu.calm_ticks = 0
    if gpu.calm_ticks < _POLICY.grow_after_ticks or gpu.batch_target >= gpu.batch_max:
        return None
    gpu.calm_ticks = 0
    grown = math.ceil(gpu.batch_target * _POLICY.grow)
    return min(max(grown, gpu.batch_target + 1), gpu.batch_max)


class Guest(exports.Guest):
    """The exports. Keep no state on `self`: this object lives for one call only."""

    def init(self, args: InitArgs) -> List[Settings]:
        global _POLICY
        params = dict(args.params)
        unknown = sorted(set(params) - set(KNOWN_PARAMS))
        if unknown:
            raise Err(f"unknown parameter(s) {unknown}; known: {list(KNOWN_PARAMS)}")
        power_cap_w = _param(params, "power_cap_w", 500.0, float)
        shrink = _param(params, "shrink", 0.8, float)
        grow = _param(params, "grow", 1.1, float)
        grow_after_ticks = _param(params, "grow_after_ticks", 5, int)
        headroom = _param(params, "headroom", 0.8, float)
        if not (math.isfinite(power_cap_w) and power_cap_w > 0):
            raise Err(f"`power_cap_w` = {power_cap_w} must be a positive number of watts")
        if not 0 < shrink < 1:
            raise Err(f"`shrink` = {shrink} must lie between 0 and 1, e.g. 0.8")
        if not (math.isfinite(grow) and grow > 1):
            raise Err(f"`grow` = {grow} must be above 1, e.g. 1.1")
        if grow_after_ticks < 1:
            raise Err(f"`grow_after_ticks` = {grow_after_ticks} must be at least 1")
        if not 0 < headroom <= 1:
            raise Err(f"`headroom` = {headroom} must lie in (0, 1], e.g. 0.8")
        hold_cap = Knobs.POWER_CAP in args.knobs
        steer_batch = Knobs.BATCH_SIZE in args.knobs
        tpot_limit_ms = args.objective.tpot_p99_limit_ms
        if steer_batch and tpot_limit_ms is None:
            host.log(LogLevel.INFO, "no tpot_p99_limit_ms objective: the batch size is left as it is")
        gpus = [
            GpuState(
                batch_target=max(device.batch_size_max, 1),
                batch_max=max(device.batch_size_max, 1),
                calm_ticks=0,
                # max then min: the device's range after the operator's guardrails.
                power_cap_w=(
                    min(max(power_cap_w, device.power_cap_min_w), device.power_cap_max_w)
                    if hold_cap
                    else None
                ),
            )
            for device in args.devices
        ]
        _POLICY = PolicyState(
            tpot_limit_ms=tpot_limit_ms,
            steer_batch=steer_batch,
            shrink=shrink,
            grow=grow,
            grow_after_ticks=grow_after_ticks,
            headroom=headroom,
            gpus=gpus,
        )
        steering = steer_batch and tpot_limit_ms is not None
        return [
            Settings(
                power_cap_w=gpu.power_cap_w,
                sm_clock_max_mhz=None,
                batch_size=gpu.batch_target if steering else None,
            )
            for gpu in gpus
        ]

    def decide(self, observations: List[Observation]) -> List[Settings]:
        answers = []
        for index, observation in enumerate(observations):
            settings = Settings(power_cap_w=None, sm_clock_max_mhz=None, batch_size=None)
            # The host sends one observation per GPU in init's device order; a mismatch
            # would be a host bug, and leaving that GPU alone is safe.
            if index < len(_POLICY.gpus):
                gpu = _POLICY.gpus[index]
                cap_w = gpu.power_cap_w
                if cap_w is not None and abs(observation.in_force.power_cap_w - cap_w) > POWER_CAP_TOLERANCE_W:
                    settings.power_cap_w = cap_w
                batch = _batch_step(gpu, observation)
                if batch is not None:
                    host.log(
                        LogLevel.DEBUG,
                        f"gpu {index}: batch {gpu.batch_target} -> {batch} (p99 {observation.tpot_p99_ms:.2f} ms)",
                    )
                    gpu.batch_target = batch
                    settings.batch_size = batch
            answers.append(settings)
        return answers

    def snapshot(self) -> State:
        payload = {
            "gpus": [
                {"batch_target": gpu.batch_target, "calm_ticks": gpu.calm_ticks}
                for gpu in _POLICY.gpus
            ]
        }
        return State(schema_version=SCHEMA_VERSION, bytes=json.dumps(payload).encode())

    def restore(self, state: State) -> None:
        if state.schema_version != SCHEMA_VERSION:
            raise Err(
                f"state schema {state.schema_version} is not the {SCHEMA_VERSION} this version reads; starting from init"
            )
        try:
            saved = json.loads(bytes(state.bytes).decode())["gpus"]
            entries = [(int(g["batch_target"]), int(g["calm_ticks"])) for g in saved]
        except (ValueError, KeyError, TypeError) as error:
            raise Err(f"state is not this policy's JSON ({error}); starting from init")
        if len(entries) != len(_POLICY.gpus):
            raise Err(
                f"state has {len(entries)} GPUs, this run {len(_POLICY.gpus)}; starting from init"
            )
        # Check all before changing any: a refused state changes nothing.
        for gpu, (batch_target, calm_ticks) in zip(_POLICY.gpus, entries):
            if not 1 <= batch_target <= gpu.batch_max or calm_ticks < 0:
                raise Err(f"state has batch {batch_target} outside 1..{gpu.batch_max}; starting from init")
        for gpu, (batch_target, calm_ticks) in zip(_POLICY.gpus, entries):
            gpu.batch_target = batch_target
            gpu.calm_ticks = calm_ticks
