"""The policy's rules, with no import from the host: `app.py` wires them to the contract,
and `test_rules.py` tests them under plain CPython (`python3 -m unittest`).

Units follow the contract (wit/policy.wit): watts, MHz, milliseconds, sequences. The
contract's records (a device's facts, an observation) are read by attribute, so the
tests pass any object with the same fields.
"""

import json
import math
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Tuple

# The layout of the snapshot's JSON: {"gpus": [{"batch_target", "calm_ticks"}, ...]}.
# Raise it when the layout changes, and keep reading the old one in `restore_gpus`.
SCHEMA_VERSION = 1

# The power cap counts as drifted when it is further than this from its target (NVML
# keeps milliwatts; a host may round to whole watts).
POWER_CAP_TOLERANCE_W = 0.5

KNOWN_PARAMS = ("power_cap_w", "shrink", "grow", "grow_after_ticks", "headroom")


class PolicyError(ValueError):
    """A bad parameter or state, with a message naming it and the fix. `app.py` turns it
    into the `Err` the host shows."""


@dataclass(frozen=True)
class Params:
    """The spec's [params], checked."""

    power_cap_w: float = 500.0  # power cap to hold, watts
    shrink: float = 0.8  # batch multiplier on a violation (0 < shrink < 1)
    grow: float = 1.1  # batch multiplier when calm (> 1)
    grow_after_ticks: int = 5  # calm ticks in a row before one growth step
    headroom: float = 0.8  # "calm": p99 under this fraction of the limit


@dataclass
class GpuState:
    """What one GPU's rules remember between ticks."""

    batch_target: int  # the batch size asked for, sequences
    batch_max: int  # the largest batch the workload takes on this GPU
    calm_ticks: int  # calm ticks in a row since the last change
    power_cap_w: Optional[float]  # the cap to hold, fitted to the GPU's range; None: leave it


@dataclass
class PolicyState:
    """Everything the policy knows: its parameters, the objective's p99 TPOT limit (None
    when the batch is not steered) and one GpuState per GPU."""

    params: Params = field(default_factory=Params)
    tpot_limit_ms: Optional[float] = None
    gpus: List[GpuState] = field(default_factory=list)


def _param(params: dict, key: str, default, kind):
    text = params.get(key)
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        raise PolicyError(f"`{key}` = {text!r} is not {'an integer' if kind is int else 'a number'}")


def parse_params(pairs: Iterable[Tuple[str, str]]) -> Params:
    """The parameters from the contract's list of (key, value) pairs, checked. Raises
    PolicyError naming the parameter and a valid value."""
    params = dict(pairs)
    unknown = sorted(set(params) - set(KNOWN_PARAMS))
    if unknown:
        raise PolicyError(f"unknown parameter(s) {', '.join(unknown)}; known: {', '.join(KNOWN_PARAMS)}")
    parsed = Params(
        power_cap_w=_param(params, "power_cap_w", 500.0, float),
        shrink=_param(params, "shrink", 0.8, float),
        grow=_param(params, "grow", 1.1, float),
        grow_after_ticks=_param(params, "grow_after_ticks", 5, int),
        headroom=_param(params, "headroom", 0.8, float),
    )
    if not (math.isfinite(parsed.power_cap_w) and parsed.power_cap_w > 0):
        raise PolicyError(f"`power_cap_w` = {parsed.power_cap_w} must be a positive number of watts")
    if not 0 < parsed.shrink < 1:
        raise PolicyError(f"`shrink` = {parsed.shrink} must lie between 0 and 1, e.g. 0.8")
    if not (math.isfinite(parsed.grow) and parsed.grow > 1):
        raise PolicyError(f"`grow` = {parsed.grow} must be above 1, e.g. 1.1")
    if parsed.grow_after_ticks < 1:
        raise PolicyError(f"`grow_after_ticks` = {parsed.grow_after_ticks} must be at least 1")
    if not 0 < parsed.headroom <= 1:
        raise PolicyError(f"`headroom` = {parsed.headroom} must lie in (0, 1], e.g. 0.8")
    return parsed


def new_gpu(device, params: Params, hold_cap: bool) -> GpuState:
    """A GPU's starting state from its facts (`batch_size_max`, `power_cap_min_w`,
    `power_cap_max_w`): the largest batch, and the cap fitted to the device's range (after
    the operator's guardrails) when the policy holds the cap."""
    batch_max = max(device.batch_size_max, 1)
    return GpuState(
        batch_target=batch_max,
        batch_max=batch_max,
        calm_ticks=0,
        # max then min: a reversed range still gives a number.
        power_cap_w=(
            min(max(params.power_cap_w, device.power_cap_min_w), device.power_cap_max_w) if hold_cap else None
        ),
    )


def cap_to_ask(gpu: GpuState, observation) -> Optional[float]:
    """The cap to ask for this tick: the target when the cap in force drifted from it, else
    None (asking again for what is in force would only count as a change)."""
    if gpu.power_cap_w is None:
        return None
    if abs(observation.in_force.power_cap_w - gpu.power_cap_w) > POWER_CAP_TOLERANCE_W:
        return gpu.power_cap_w
    return None


def batch_step(gpu: GpuState, params: Params, limit_ms: Optional[float], observation) -> Optional[int]:
    """The batch rule for one GPU: the new target, or None to leave it. `limit_ms` is the
    objective's p99 TPOT limit (None: the batch is not steered).

    An unknown TPOT is NaN, never "within the limit": `nan > limit` is False, so a naive
    check reads it as calm and grows the batch blind. Such a tick neither cuts nor counts
    as calm. Settling windows (a setting changed during them) are skipped.
    """
    if limit_ms is None or observation.settling:
        return None
    p99_ms = observation.tpot_p99_ms
    if math.isnan(p99_ms):
        return None
    if p99_ms > limit_ms:
        gpu.calm_ticks = 0
        cut = max(1, math.floor(gpu.batch_target * params.shrink))
        return cut if cut != gpu.batch_target else None
    busy = observation.queue_depth > 0 or observation.active_sequences >= gpu.batch_target
    if p99_ms < params.headroom * limit_ms and busy:
        gpu.calm_ticks += 1
    else:
        gpu.calm_ticks = 0
    if gpu.calm_ticks < params.grow_after_ticks or gpu.batch_target >= gpu.batch_max:
        return None
    gpu.calm_ticks = 0
    grown = math.ceil(gpu.batch_target * params.grow)
    return min(max(grown, gpu.batch_target + 1), gpu.batch_max)


def save_gpus(gpus: List[GpuState]) -> bytes:
    """The snapshot's JSON."""
    payload = {"gpus": [{"batch_target": gpu.batch_target, "calm_ticks": gpu.calm_ticks} for gpu in gpus]}
    return json.dumps(payload).encode()


def restore_gpus(gpus: List[GpuState], schema_version: int, data: bytes) -> None:
    """Takes a snapshot's JSON back into `gpus`. Every value is checked before any is taken
    over, so a refused state (raised as PolicyError) changes nothing."""
    if schema_version != SCHEMA_VERSION:
        raise PolicyError(
            f"state schema {schema_version} is not the {SCHEMA_VERSION} this version reads; starting from init"
        )
    try:
        saved = json.loads(bytes(data).decode())["gpus"]
        entries = [(int(gpu["batch_target"]), int(gpu["calm_ticks"])) for gpu in saved]
    except (ValueError, KeyError, TypeError) as error:
        raise PolicyError(f"state is not this policy's JSON ({error}); starting from init")
    if len(entries) != len(gpus):
        raise PolicyError(f"state has {len(entries)} GPUs, this run {len(gpus)}; starting from init")
    for gpu, (batch_target, calm_ticks) in zip(gpus, entries):
        if not 1 <= batch_target <= gpu.batch_max:
            raise PolicyError(f"state has batch {batch_target} outside 1..{gpu.batch_max}; starting from init")
        if calm_ticks < 0:
            raise PolicyError(f"state has calm ticks {calm_ticks}; starting from init")
    for gpu, (batch_target, calm_ticks) in zip(gpus, entries):
        gpu.batch_target = batch_target
        gpu.calm_ticks = calm_ticks
