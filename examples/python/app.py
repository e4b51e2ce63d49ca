"""A tokwatt policy in Python: hold a power cap, steer the batch by p99 TPOT (the shipped
example, and the start `tokwatt plugin new --lang python` writes). This module wires the
rules (`rules.py`, tested by `python3 -m unittest`) to the contract.

Built into a WebAssembly component with componentize-py (README.md), `-d` naming the
contract's folder (`../../wit` in the repository, `wit` in a scaffold):

    componentize-py -d <wit> -w policy componentize app -o policy.wasm

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
  calm and grows the batch blind; `rules.batch_step` neither cuts nor counts such a
  tick as calm.
- One answer per observation, in order: the host refuses any other number.
- Settling windows (a setting changed during them) are skipped.
- An error in `init` or `restore` is raised as `Err("...")`, which the host shows as the
  reason: the rules raise `PolicyError`, and the exports below turn it into `Err`. Any
  other exception traps the call; the host prints its traceback.
"""

from typing import List

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import host
from wit_world.imports.types import InitArgs, Knobs, LogLevel, Observation, Settings, State

import rules
from rules import PolicyError, PolicyState

# The policy's state: module-level, because each exported call gets a new `Guest`.
_POLICY = PolicyState()


class Guest(exports.Guest):
    """The exports. Keep no state on `self`: this object lives for one call only."""

    def init(self, args: InitArgs) -> List[Settings]:
        global _POLICY
        try:
            params = rules.parse_params(args.params)
        except PolicyError as error:
            raise Err(str(error))
        tpot_limit_ms = args.objective.tpot_p99_limit_ms
        steer_batch = Knobs.BATCH_SIZE in args.knobs and tpot_limit_ms is not None
        if Knobs.BATCH_SIZE in args.knobs and tpot_limit_ms is None:
            host.log(LogLevel.INFO, "no tpot_p99_limit_ms objective: the batch size is left as it is")
        hold_cap = Knobs.POWER_CAP in args.knobs
        gpus = [rules.new_gpu(device, params, hold_cap) for device in args.devices]
        _POLICY = PolicyState(
            params=params,
            tpot_limit_ms=tpot_limit_ms if steer_batch else None,
            gpus=gpus,
        )
        return [
            Settings(
                power_cap_w=gpu.power_cap_w,
                sm_clock_max_mhz=None,
                batch_size=gpu.batch_target if steer_batch else None,
                token_budget=None,
            )
            for gpu in gpus
        ]

    def decide(self, observations: List[Observation]) -> List[Settings]:
        answers = []
        for index, observation in enumerate(observations):
            settings = Settings(
                power_cap_w=None, sm_clock_max_mhz=None, batch_size=None, token_budget=None
            )
            # The host sends one observation per GPU in init's device order; a mismatch
            # would be a host bug, and leaving that GPU alone is safe.
            if index < len(_POLICY.gpus):
                gpu = _POLICY.gpus[index]
                settings.power_cap_w = rules.cap_to_ask(gpu, observation)
                batch = rules.batch_step(gpu, _POLICY.params, _POLICY.tpot_limit_ms, observation)
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
        return State(schema_version=rules.SCHEMA_VERSION, bytes=rules.save_gpus(_POLICY.gpus))

    def restore(self, state: State) -> None:
        try:
            rules.restore_gpus(_POLICY.gpus, state.schema_version, state.bytes)
        except PolicyError as error:
            raise Err(str(error))
