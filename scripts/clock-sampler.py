#!/usr/bin/env python3
"""Run a command and sample GPU 0's SM clock, power and clock-event reasons beside it.

    clock-sampler.py OUT.csv [--period-ms 10] -- COMMAND ...

Read-only NVML (nvidia-ml-py's pynvml): nothing is set. Times in OUT.csv are seconds from the
moment the command printed its first line of output; `tokwatt bench serving` prints it as its
serving thread starts, the origin of its step log's times (`--steps`), so the samples line up
with the logged steps to within a few milliseconds. The command's output is passed through.
Columns: t_s, sm_mhz, power_w (NVML's power reading, a 1 s average on Hopper), inst_w (field
186, the instantaneous reading, when the driver answers it), reasons (clock event reasons, hex:
0x4 is the software power cap).
"""
import subprocess
import sys
import threading
import time


def main():
    args = sys.argv[1:]
    if "--" not in args:
        sys.exit(__doc__)
    split = args.index("--")
    opts, command = args[:split], args[split + 1 :]
    out = opts[0]
    period = 0.010
    if "--period-ms" in opts:
        period = float(opts[opts.index("--period-ms") + 1]) / 1e3
    try:
        import pynvml as nv

        nv.nvmlInit()
        handle = nv.nvmlDeviceGetHandleByIndex(0)
        event_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons"
        )
    except Exception as error:  # no NVML: run the command unsampled
        print(f"clock-sampler: no NVML ({error}); not sampling", file=sys.stderr)
        sys.exit(subprocess.call(command))

    def instantaneous():
        try:
            value = nv.nvmlDeviceGetFieldValues(handle, [186])[0]
            if value.nvmlReturn == 0:
                return value.value.uiVal / 1e3
        except Exception:
            pass
        return float("nan")

    samples = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            t = time.monotonic()
            try:
                mhz = nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM)
                watts = nv.nvmlDeviceGetPowerUsage(handle) / 1e3
                reasons = event_reasons(handle)
            except Exception:
                mhz, watts, reasons = -1, float("nan"), 0
            samples.append((t, mhz, watts, instantaneous(), reasons))
            left = period - (time.monotonic() - t)
            if left > 0:
                time.sleep(left)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    origin = None
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1)
    for line in proc.stdout:
        if origin is None:
            origin = time.monotonic()
        sys.stdout.write(line)
        sys.stdout.flush()
    rc = proc.wait()
    stop.set()
    thread.join()
    origin = origin if origin is not None else samples[0][0] if samples else 0.0
    with open(out, "w") as f:
        f.write("t_s,sm_mhz,power_w,inst_w,reasons\n")
        for t, mhz, watts, inst, reasons in samples:
            f.write(f"{t - origin:.4f},{mhz},{watts:.1f},{inst:.1f},{reasons:#x}\n")
    print(f"clock-sampler: {len(samples)} samples in {out}", file=sys.stderr)
    sys.exit(rc)


if __name__ == "__main__":
    main()
