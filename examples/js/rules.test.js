// Tests of the rules under plain Node.js: `npm test` (node --test). The component's own
// check is `tokwatt plugin check policy.wasm`, after `npm run build`.

import assert from "node:assert/strict";
import { test } from "node:test";

import { batchStep, capToAsk, newGpu, parseParams, restoreGpus, saveGpus, SCHEMA_VERSION } from "./rules.js";

const H200 = { batchSizeMax: 512, powerCapMinW: 200, powerCapMaxW: 700 };
const LIMIT_MS = 25;

function observation(fields) {
  return {
    tpotP99Ms: 10,
    settling: false,
    queueDepth: 4,
    activeSequences: 512,
    inForce: { powerCapW: 700 },
    ...fields,
  };
}

test("parameters default, and a bad one is named with a valid value", () => {
  assert.equal(parseParams([]).powerCapW, 500);
  assert.equal(parseParams([["shrink", "0.5"]]).shrink, 0.5);
  assert.throws(() => parseParams([["shrink", "2"]]), /`shrink` = 2 must lie between 0 and 1/);
  assert.throws(() => parseParams([["grow_after_ticks", "2.5"]]), /not an integer/);
  assert.throws(() => parseParams([["power_cap", "300"]]), /unknown parameter\(s\) power_cap/);
});

test("the cap is fitted to the device's range and asked for only when it drifts", () => {
  const gpu = newGpu(H200, parseParams([["power_cap_w", "900"]]), true);
  assert.equal(gpu.powerCapW, 700);
  assert.equal(capToAsk(gpu, observation({ inForce: { powerCapW: 700 } })), undefined);
  assert.equal(capToAsk(gpu, observation({ inForce: { powerCapW: 500 } })), 700);
  assert.equal(capToAsk(newGpu(H200, parseParams([]), false), observation({})), undefined);
});

test("a violation cuts the batch; calm ticks grow it back", () => {
  const config = parseParams([["grow_after_ticks", "2"]]);
  const gpu = newGpu(H200, config, false);
  assert.equal(batchStep(gpu, config, LIMIT_MS, observation({ tpotP99Ms: 30 })), 409);
  gpu.batchTarget = 409;
  assert.equal(batchStep(gpu, config, LIMIT_MS, observation({})), undefined);
  assert.equal(batchStep(gpu, config, LIMIT_MS, observation({})), 450);
});

test("an unknown TPOT (NaN) neither cuts nor counts as calm", () => {
  const config = parseParams([["grow_after_ticks", "1"]]);
  const gpu = newGpu(H200, config, false);
  gpu.batchTarget = 100;
  assert.equal(batchStep(gpu, config, LIMIT_MS, observation({ tpotP99Ms: NaN })), undefined);
  assert.equal(gpu.calmTicks, 0);
  assert.equal(batchStep(gpu, config, undefined, observation({ tpotP99Ms: 90 })), undefined);
});

test("a snapshot restores, and a bad one changes nothing", () => {
  const config = parseParams([]);
  const gpus = [newGpu(H200, config, false)];
  gpus[0].batchTarget = 300;
  const saved = saveGpus(gpus);
  gpus[0].batchTarget = 100;
  restoreGpus(gpus, SCHEMA_VERSION, saved);
  assert.equal(gpus[0].batchTarget, 300);
  assert.throws(() => restoreGpus(gpus, SCHEMA_VERSION, '{"gpus":[{"batchTarget":9999,"calmTicks":0}]}'), /outside 1..512/);
  assert.throws(() => restoreGpus(gpus, SCHEMA_VERSION + 1, saved), /state schema/);
  assert.throws(() => restoreGpus(gpus, SCHEMA_VERSION, "not json"), /not this policy's JSON/);
  assert.equal(gpus[0].batchTarget, 300);
});
