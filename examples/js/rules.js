// The policy's rules, with no import from the host: `policy.js` wires them to the
// contract, and `rules.test.js` tests them under plain Node.js (`npm test`).
//
// Units follow the contract (wit/policy.wit): watts, MHz, milliseconds, sequences.

// The layout of the snapshot's JSON: {"gpus": [{"batchTarget", "calmTicks"}, ...]}.
// Raise it when the layout changes, and keep reading the old one in `restoreGpus`.
export const SCHEMA_VERSION = 1;

// The power cap counts as drifted when it is further than this from its target (NVML
// keeps milliwatts; a host may round to whole watts).
export const POWER_CAP_TOLERANCE_W = 0.5;

export const KNOWN_PARAMS = ["power_cap_w", "shrink", "grow", "grow_after_ticks", "headroom"];

// One parameter from the spec's [params] (all values are strings there).
function param(params, key, fallback, integer) {
  const text = params.get(key);
  if (text === undefined) {
    return fallback;
  }
  const value = Number(text.trim());
  if (text.trim() === "" || !Number.isFinite(value) || (integer && !Number.isInteger(value))) {
    throw `\`${key}\` = "${text}" is not ${integer ? "an integer" : "a number"}`;
  }
  return value;
}

// The parameters, checked: `params` is the contract's list of [key, value] pairs. Throws
// a message naming the parameter and a valid value (`init` passes it on as its error).
export function parseParams(pairs) {
  const params = new Map(pairs);
  const unknown = [...params.keys()].filter((key) => !KNOWN_PARAMS.includes(key)).sort();
  if (unknown.length > 0) {
    throw `unknown parameter(s) ${unknown.join(", ")}; known: ${KNOWN_PARAMS.join(", ")}`;
  }
  const config = {
    powerCapW: param(params, "power_cap_w", 500, false),
    shrink: param(params, "shrink", 0.8, false),
    grow: param(params, "grow", 1.1, false),
    growAfterTicks: param(params, "grow_after_ticks", 5, true),
    headroom: param(params, "headroom", 0.8, false),
  };
  if (!(config.powerCapW > 0)) {
    throw `\`power_cap_w\` = ${config.powerCapW} must be a positive number of watts`;
  }
  if (!(config.shrink > 0 && config.shrink < 1)) {
    throw `\`shrink\` = ${config.shrink} must lie between 0 and 1, e.g. 0.8`;
  }
  if (!(config.grow > 1)) {
    throw `\`grow\` = ${config.grow} must be above 1, e.g. 1.1`;
  }
  if (config.growAfterTicks < 1) {
    throw `\`grow_after_ticks\` = ${config.growAfterTicks} must be at least 1`;
  }
  if (!(config.headroom > 0 && config.headroom <= 1)) {
    throw `\`headroom\` = ${config.headroom} must lie in (0, 1], e.g. 0.8`;
  }
  return config;
}

// What one GPU's rules remember between ticks. `powerCapW` is the cap to hold, fitted to
// the device's range (after the operator's guardrails), or undefined to leave the cap.
export function newGpu(device, config, holdCap) {
  const batchMax = Math.max(device.batchSizeMax, 1);
  return {
    batchTarget: batchMax,
    batchMax,
    calmTicks: 0,
    powerCapW: holdCap
      ? Math.min(Math.max(config.powerCapW, device.powerCapMinW), device.powerCapMaxW)
      : undefined,
  };
}

// The cap to ask for this tick: the target when the cap in force drifted from it, else
// undefined (asking again for what is in force would only count as a change).
export function capToAsk(gpu, observation) {
  if (gpu.powerCapW === undefined) {
    return undefined;
  }
  const drift = Math.abs(observation.inForce.powerCapW - gpu.powerCapW);
  return drift > POWER_CAP_TOLERANCE_W ? gpu.powerCapW : undefined;
}

// The batch rule for one GPU: the new target, or undefined to leave it. `limitMs` is the
// objective's p99 TPOT limit (undefined: the batch is not steered).
//
// An unknown TPOT is NaN, never "within the limit": `NaN > limit` is false, so a naive
// check reads it as calm and grows the batch blind. Such a tick neither cuts nor counts
// as calm. Settling windows (a setting changed during them) are skipped.
export function batchStep(gpu, config, limitMs, observation) {
  if (limitMs === undefined || observation.settling) {
    return undefined;
  }
  const p99Ms = observation.tpotP99Ms;
  if (Number.isNaN(p99Ms)) {
    return undefined;
  }
  if (p99Ms > limitMs) {
    gpu.calmTicks = 0;
    const cut = Math.max(1, Math.floor(gpu.batchTarget * config.shrink));
    return cut !== gpu.batchTarget ? cut : undefined;
  }
  const busy = observation.queueDepth > 0 || observation.activeSequences >= gpu.batchTarget;
  gpu.calmTicks = p99Ms < config.headroom * limitMs && busy ? gpu.calmTicks + 1 : 0;
  if (gpu.calmTicks < config.growAfterTicks || gpu.batchTarget >= gpu.batchMax) {
    return undefined;
  }
  gpu.calmTicks = 0;
  const grown = Math.ceil(gpu.batchTarget * config.grow);
  return Math.min(Math.max(grown, gpu.batchTarget + 1), gpu.batchMax);
}

// The snapshot's JSON text.
export function saveGpus(gpus) {
  return JSON.stringify({
    gpus: gpus.map((gpu) => ({ batchTarget: gpu.batchTarget, calmTicks: gpu.calmTicks })),
  });
}

// Takes a snapshot's JSON back into `gpus`. Every value is checked before any is taken
// over, so a refused state (thrown as a message) changes nothing.
export function restoreGpus(gpus, schemaVersion, text) {
  if (schemaVersion !== SCHEMA_VERSION) {
    throw `state schema ${schemaVersion} is not the ${SCHEMA_VERSION} this version reads; starting from init`;
  }
  let entries;
  try {
    entries = JSON.parse(text).gpus.map((gpu) => [gpu.batchTarget, gpu.calmTicks]);
  } catch (error) {
    throw `state is not this policy's JSON (${error}); starting from init`;
  }
  if (entries.length !== gpus.length) {
    throw `state has ${entries.length} GPUs, this run ${gpus.length}; starting from init`;
  }
  entries.forEach(([batchTarget, calmTicks], index) => {
    const batchMax = gpus[index].batchMax;
    if (!Number.isInteger(batchTarget) || batchTarget < 1 || batchTarget > batchMax) {
      throw `state has batch ${batchTarget} outside 1..${batchMax}; starting from init`;
    }
    if (!Number.isInteger(calmTicks) || calmTicks < 0) {
      throw `state has calm ticks ${calmTicks}; starting from init`;
    }
  });
  entries.forEach(([batchTarget, calmTicks], index) => {
    gpus[index].batchTarget = batchTarget;
    gpus[index].calmTicks = calmTicks;
  });
}
