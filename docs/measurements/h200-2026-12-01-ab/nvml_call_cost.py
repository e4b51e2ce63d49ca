"""CPU cost of single NVML reads on this GPU (read-only calls; nothing is set).

For each read: CPU time per call back to back (dense), and per call when spaced like an
agent at 1 Hz for 8 GPUs (8 calls each second, i.e. sparse), from getrusage deltas.
"""
import ctypes, json, resource, sys, time

nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0


class FieldValue(ctypes.Structure):
    _fields_ = [("fieldId", ctypes.c_uint), ("scopeId", ctypes.c_uint),
                ("timestamp", ctypes.c_longlong), ("latencyUsec", ctypes.c_longlong),
                ("valueType", ctypes.c_uint), ("nvmlReturn", ctypes.c_uint),
                ("value", ctypes.c_ulonglong)]


def energy():
    v = ctypes.c_ulonglong()
    return nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(v))


def power():
    v = ctypes.c_uint()
    return nvml.nvmlDeviceGetPowerUsage(handle, ctypes.byref(v))


def fields_energy():
    f = (FieldValue * 1)()
    f[0].fieldId = 83
    return nvml.nvmlDeviceGetFieldValues(handle, 1, f)


def fields_energy_power():
    f = (FieldValue * 2)()
    f[0].fieldId = 83
    f[1].fieldId = 186
    return nvml.nvmlDeviceGetFieldValues(handle, 2, f)


def sm_clock():
    v = ctypes.c_uint()
    return nvml.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(v))


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def dense(call, n=2000):
    c0, w0 = cpu(), time.perf_counter()
    for _ in range(n):
        assert call() == 0
    return (cpu() - c0) / n * 1e3, (time.perf_counter() - w0) / n * 1e3


def sparse(call, seconds=15, per_second=8):
    # 8 calls each second, back to back, as an agent reading 8 GPUs once per tick.
    c0 = cpu()
    start = time.perf_counter()
    calls = 0
    for s in range(seconds):
        for _ in range(per_second):
            assert call() == 0
            calls += 1
        time.sleep(max(0.0, start + s + 1 - time.perf_counter()))
    spent = cpu() - c0
    return spent / calls * 1e3, spent / seconds * 100.0


def idle(seconds=10):
    c0 = cpu()
    start = time.perf_counter()
    for s in range(seconds):
        time.sleep(max(0.0, start + s + 1 - time.perf_counter()))
    return (cpu() - c0) / seconds * 100.0


results = {"idle_cpu_pct": idle()}
for name, call in [("energy", energy), ("power", power), ("fields_energy", fields_energy),
                   ("fields_energy_power", fields_energy_power), ("sm_clock", sm_clock)]:
    d_cpu, d_wall = dense(call)
    s_cpu, s_pct = sparse(call)
    results[name] = {"dense_cpu_ms": d_cpu, "dense_wall_ms": d_wall,
                     "sparse_cpu_ms_per_call": s_cpu, "sparse_8_per_s_cpu_pct": s_pct}
    print(name, json.dumps(results[name]), flush=True)
json.dump(results, open(sys.argv[1], "w"), indent=2)
