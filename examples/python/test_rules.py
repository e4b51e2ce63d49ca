"""Tests of the rules under plain CPython: `python3 -m unittest` in this folder. The
component's own check is `tokwatt plugin check policy.wasm`, after the build."""

import math
import unittest
from types import SimpleNamespace

from rules import (
    SCHEMA_VERSION,
    PolicyError,
    batch_step,
    cap_to_ask,
    new_gpu,
    parse_params,
    restore_gpus,
    save_gpus,
)

H200 = SimpleNamespace(batch_size_max=512, power_cap_min_w=200.0, power_cap_max_w=700.0)
LIMIT_MS = 25.0


def observation(**fields):
    """A busy observation within the limit, with `fields` changed."""
    values = dict(
        tpot_p99_ms=10.0,
        settling=False,
        queue_depth=4,
        active_sequences=512,
        in_force=SimpleNamespace(power_cap_w=700.0),
    )
    values.update(fields)
    return SimpleNamespace(**values)


class RulesTest(unittest.TestCase):
    def test_parameters_default_and_a_bad_one_is_named_with_a_valid_value(self):
        self.assertEqual(parse_params([]).power_cap_w, 500.0)
        self.assertEqual(parse_params([("shrink", "0.5")]).shrink, 0.5)
        with self.assertRaisesRegex(PolicyError, "`shrink` = 2.0 must lie between 0 and 1"):
            parse_params([("shrink", "2")])
        with self.assertRaisesRegex(PolicyError, "not an integer"):
            parse_params([("grow_after_ticks", "2.5")])
        with self.assertRaisesRegex(PolicyError, r"unknown parameter\(s\) power_cap;"):
            parse_params([("power_cap", "300")])

    def test_the_cap_is_fitted_to_the_device_range_and_asked_for_only_when_it_drifts(self):
        gpu = new_gpu(H200, parse_params([("power_cap_w", "900")]), True)
        self.assertEqual(gpu.power_cap_w, 700.0)
        self.assertIsNone(cap_to_ask(gpu, observation(in_force=SimpleNamespace(power_cap_w=700.0))))
        self.assertEqual(cap_to_ask(gpu, observation(in_force=SimpleNamespace(power_cap_w=500.0))), 700.0)
        self.assertIsNone(cap_to_ask(new_gpu(H200, parse_params([]), False), observation()))

    def test_a_violation_cuts_the_batch_and_calm_ticks_grow_it_back(self):
        params = parse_params([("grow_after_ticks", "2")])
        gpu = new_gpu(H200, params, False)
        self.assertEqual(batch_step(gpu, params, LIMIT_MS, observation(tpot_p99_ms=30.0)), 409)
        gpu.batch_target = 409
        self.assertIsNone(batch_step(gpu, params, LIMIT_MS, observation()))
        self.assertEqual(batch_step(gpu, params, LIMIT_MS, observation()), 450)

    def test_an_unknown_tpot_neither_cuts_nor_counts_as_calm(self):
        params = parse_params([("grow_after_ticks", "1")])
        gpu = new_gpu(H200, params, False)
        gpu.batch_target = 100
        self.assertIsNone(batch_step(gpu, params, LIMIT_MS, observation(tpot_p99_ms=math.nan)))
        self.assertEqual(gpu.calm_ticks, 0)
        self.assertIsNone(batch_step(gpu, params, None, observation(tpot_p99_ms=90.0)))

    def test_a_snapshot_restores_and_a_bad_one_changes_nothing(self):
        gpus = [new_gpu(H200, parse_params([]), False)]
        gpus[0].batch_target = 300
        saved = save_gpus(gpus)
        gpus[0].batch_target = 100
        restore_gpus(gpus, SCHEMA_VERSION, saved)
        self.assertEqual(gpus[0].batch_target, 300)
        with self.assertRaisesRegex(PolicyError, r"outside 1\.\.512"):
            restore_gpus(gpus, SCHEMA_VERSION, b'{"gpus": [{"batch_target": 9999, "calm_ticks": 0}]}')
        with self.assertRaisesRegex(PolicyError, "state schema"):
            restore_gpus(gpus, SCHEMA_VERSION + 1, saved)
        with self.assertRaisesRegex(PolicyError, "not this policy's JSON"):
            restore_gpus(gpus, SCHEMA_VERSION, b"not json")
        self.assertEqual(gpus[0].batch_target, 300)


if __name__ == "__main__":
    unittest.main()
