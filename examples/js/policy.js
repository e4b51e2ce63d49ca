// A tokwatt policy in JavaScript: hold a power cap, steer the batch by p99 TPOT (the
// shipped example, and the start `tokwatt plugin new --lang js` writes). This file wires
// the rules (`rules.js`, tested by `npm test`) to the contract.
//
// Built into a WebAssembly component with componentize-js by `npm run build`, which runs
// (with `--wit` at the contract's folder; package.json has the exact line):
//
//   componentize-js policy.js --wit <wit> --world-name policy --disable http fetch-event -o policy.wasm
//
// The rules are those of the Python example and the Rust scaffold of `tokwatt plugin new`:
//
// - Power cap (knob `power-cap`): held at the `power_cap_w` parameter, fitted to each
//   GPU's range, and asked for again only when the cap in force drifts from it.
// - Batch size (knob `batch-size`, only under a `tpot_p99_limit_ms` objective): starts at
//   the workload's largest batch; a tick whose p99 TPOT breaks the limit cuts it to
//   `shrink` of itself; `grow_after_ticks` calm ticks in a row (p99 under `headroom` of
//   the limit, with requests waiting or every slot busy) grow it by `grow`.
//
// Parameters (all optional, TOML strings in the spec's [params]):
//
//   power_cap_w       500   power cap to hold, watts
//   shrink            0.8   batch multiplier on a violation (0 < shrink < 1)
//   grow              1.1   batch multiplier when calm (> 1)
//   grow_after_ticks  5     calm ticks in a row before one growth step
//   headroom          0.8   "calm": p99 under this fraction of the limit
//
// Traps this example handles:
//
// - package.json NAMES @bytecodealliance/preview2-shim: componentize-js 0.23.0 imports it
//   but lists it only as an optional peer dependency, so `npm ci` may leave it out.
// - THE IMPORT CARRIES THE PACKAGE VERSION: `tokwatt:policy/host@0.4.0`. Without
//   `@0.4.0` componentize-js does not match it to the world's import.
// - BUILD WITH `--disable http fetch-event`. By default componentize-js links `fetch`,
//   which imports `wasi:http`; the sandbox gives a policy no network, so tokwatt refuses
//   such a component (`tokwatt plugin check` names the import).
// - FIELD NAMES ARE camelCase: the contract's `tpot-p99-ms` is `tpotP99Ms`, the flag
//   `batch-size` is `knobs.batchSize`, the log level `info` is the string "info".
// - u64 VALUES ARE BigInt: `observation.tick`, `observation.tokens`, `args.seed` and the
//   host's `random()`. Mixing them with numbers throws a TypeError; convert with
//   `Number(...)` where the value is small.
// - AN ABSENT OPTION IS `undefined`, never `null`: a setting left `undefined` leaves its
//   knob alone.
// - `init` AND `restore` REPORT ERRORS BY THROWING a string: the component returns it as
//   the `err` the host shows. In `decide` or `snapshot` a throw traps the call, and
//   `tokwatt plugin check` and `tokwatt replay` show what the guest wrote to stderr.
// - Module state persists: the host keeps one instance, so `policy` below lives from
//   `init` to the last `decide`.
// - One answer per observation, in order: the host refuses any other number.

import { log } from "tokwatt:policy/host@0.4.0";

import { batchStep, capToAsk, newGpu, parseParams, restoreGpus, saveGpus, SCHEMA_VERSION } from "./rules.js";

// Everything the policy knows: its parameters, the objective's limit, and one entry
// per GPU (rules.js `newGpu`).
let policy = { config: undefined, limitMs: undefined, gpus: [] };

export const guest = {
  init(args) {
    const config = parseParams(args.params);
    const limitMs = args.objective.tpotP99LimitMs;
    const steerBatch = args.knobs.batchSize && limitMs !== undefined;
    if (args.knobs.batchSize && limitMs === undefined) {
      log("info", "no tpot_p99_limit_ms objective: the batch size is left as it is");
    }
    const gpus = args.devices.map((device) => newGpu(device, config, args.knobs.powerCap));
    policy = { config, limitMs: steerBatch ? limitMs : undefined, gpus };
    return gpus.map((gpu) => ({
      powerCapW: gpu.powerCapW,
      smClockMaxMhz: undefined,
      batchSize: steerBatch ? gpu.batchTarget : undefined,
      tokenBudget: undefined,
    }));
  },

  decide(observations) {
    return observations.map((observation, index) => {
      const settings = {
        powerCapW: undefined,
        smClockMaxMhz: undefined,
        batchSize: undefined,
        tokenBudget: undefined,
      };
      // The host sends one observation per GPU in init's device order; a mismatch would
      // be a host bug, and leaving that GPU alone is safe.
      const gpu = policy.gpus[index];
      if (gpu === undefined) {
        return settings;
      }
      settings.powerCapW = capToAsk(gpu, observation);
      const batch = batchStep(gpu, policy.config, policy.limitMs, observation);
      if (batch !== undefined) {
        log(
          "debug",
          `gpu ${index}: batch ${gpu.batchTarget} -> ${batch} (p99 ${observation.tpotP99Ms.toFixed(2)} ms)`,
        );
        gpu.batchTarget = batch;
        settings.batchSize = batch;
      }
      return settings;
    });
  },

  snapshot() {
    return {
      schemaVersion: SCHEMA_VERSION,
      bytes: new TextEncoder().encode(saveGpus(policy.gpus)),
    };
  },

  restore(state) {
    restoreGpus(policy.gpus, state.schemaVersion, new TextDecoder().decode(state.bytes));
  },
};
