#!/usr/bin/env python3
"""Turns `tokwatt bench serving-steps --json` rows into the calibration CSV the simulator's
serving-step tests read (host/profiles/calibration/<gpu>_serving_steps_<model>.csv).

    serving-steps-csv.py serving-steps.jsonl "NVIDIA H100 80GB HBM3, driver 580, 2026-12-07" > CSV

A row without a power or an SM clock reading is an error: the fit needs both."""
import json
import sys

rows_in, source = sys.argv[1], sys.argv[2]
print("# Measured serving steps: tokwatt bench serving-steps (tokwatt's CUDA serving loop, each step")
print("# waited for; llama-3-8b, random bf16 weights; default settings: no cap or clock changed).")
print(f"# {source}. step_ms is the mean step; watts from the NVML energy counter over the case;")
print("# sm_mhz the median SM clock over the case.")
print("decodes,decode_context,chunks,chunk_len,chunk_start,step_ms,watts,sm_mhz")
for line in open(rows_in):
    line = line.strip()
    if not line:
        continue
    r = json.loads(line)
    if r.get("watts") is None or r.get("sm_mhz") is None:
        sys.exit(f"row without power or SM clock: {line}")
    print(f"{r['decodes']},{r['decode_context']},{r['chunks']},{r['chunk_len']},{r['chunk_start']},"
          f"{r['step_ms']:.4f},{r['watts']:.1f},{r['sm_mhz']}")
