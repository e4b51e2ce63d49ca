#!/usr/bin/env python3
"""The fleet on one machine, with faults: a 3-member etcd cluster on loopback, two
`tokwatt fleet coordinate` replicas and N real `tokwatt serve` agents on the simulator
(8 GPUs each by default), each asking every GPU for its largest cap. Every second the
sum of every agent's power caps in force (scraped from its /metrics) is checked against
the domain's budget. Faults on a schedule: the leading coordinator killed, an etcd
member killed and restarted, an agent killed with SIGKILL and restarted, the budget
lowered. Every figure is simulator output.

    python3 scripts/fleet-scale-run.py --nodes 125            # issue 31's run
    python3 scripts/fleet-scale-run.py --nodes 4 --duration 90   # a quick one

Needs etcd (Debian's etcd-server) and a built tokwatt (cargo build --release -p tokwatt).
A killed agent is counted at its reserve: on a real node the systemd unit's ExecStopPost
(`tokwatt restore`) puts its GPUs back there, and its simulated GPUs vanish with it here.
Exits non-zero if any second's caps passed the budget in force.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, patience=30.0):
    end = time.time() + patience
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.read().decode()
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {patience} s")


class Etcd:
    def __init__(self, root, members=3):
        self.root = root
        self.members = [
            {"name": f"m{i}", "client": free_port(), "peer": free_port(), "proc": None}
            for i in range(members)
        ]
        self.initial = ",".join(f"{m['name']}=http://127.0.0.1:{m['peer']}" for m in self.members)
        for i in range(members):
            self.start(i, "new")
        for m in self.members:
            wait_http(f"http://127.0.0.1:{m['client']}/health")

    def start(self, i, state):
        m = self.members[i]
        client, peer = f"http://127.0.0.1:{m['client']}", f"http://127.0.0.1:{m['peer']}"
        log = open(os.path.join(self.root, f"{m['name']}.log"), "a")
        m["proc"] = subprocess.Popen(
            ["etcd", "--name", m["name"], "--data-dir", os.path.join(self.root, m["name"]),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", self.initial, "--initial-cluster-state", state,
             "--heartbeat-interval", "100", "--election-timeout", "1000"],
            stdout=subprocess.DEVNULL, stderr=log)

    def kill(self, i):
        self.members[i]["proc"].kill()
        self.members[i]["proc"].wait()

    def restart(self, i):
        self.start(i, "existing")

    def endpoints(self):
        return [f"http://127.0.0.1:{m['client']}" for m in self.members]

    def stop(self):
        for m in self.members:
            if m["proc"] and m["proc"].poll() is None:
                m["proc"].kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=125)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds")
    ap.add_argument("--tokwatt", default=None, help="the binary (default: target/release, else target/debug)")
    ap.add_argument("--out", default=None, help="where the table and samples go (default: a temporary folder)")
    args = ap.parse_args()
    binary = args.tokwatt or next(
        (p for p in (os.path.join(REPO, "target", k, "tokwatt") for k in ("release", "debug")) if os.path.exists(p)),
        None)
    if not binary:
        raise SystemExit("no tokwatt binary: cargo build --release -p tokwatt, or pass --tokwatt")
    if not shutil.which("etcd"):
        raise SystemExit("etcd is not installed (apt-get install etcd-server)")
    root = tempfile.mkdtemp(prefix="tokwatt-fleet-")
    out = args.out or root
    os.makedirs(out, exist_ok=True)
    procs = []
    etcd = Etcd(root)
    endpoints = etcd.endpoints()
    etcd_flags = sum((["--etcd", e] for e in endpoints), [])
    # H200 on the simulator: 200-700 W a GPU. Reserves at 300 W a GPU; a budget at 450 W
    # a GPU on average, so watts must move between nodes for the greedy ones.
    reserve = 300.0 * args.gpus
    max_w = 700.0 * args.gpus
    budget = 450.0 * args.gpus * args.nodes
    lowered = budget * 0.85
    names = [f"node-{i:03d}" for i in range(args.nodes)]

    def write_budget(watts):
        path = os.path.join(root, "budget.toml")
        with open(path, "w") as f:
            f.write(f'domain = "row-1"\nbudget_w = {watts}\n')
            for n in names:
                f.write(f'[[nodes]]\nnode = "{n}"\nreserve_w = {reserve}\nmax_w = {max_w}\n')
        subprocess.run([binary, "fleet", "budget", *etcd_flags, "--file", path], check=True,
                       stdout=subprocess.DEVNULL)

    spec = os.path.join(root, "greedy.toml")
    with open(spec, "w") as f:
        f.write('name = "greedy"\nplugin = "policy_static.wasm"\nknobs = ["power-cap"]\ntick_ms = 1000\n'
                '[params]\npower_cap_w = "700"\n')

    coordinators = []

    def start_coordinator(name):
        p = subprocess.Popen([binary, "fleet", "coordinate", *etcd_flags, "--domain", "row-1",
                              "--name", name, "--ttl", "5s", "--period", "1s"],
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(root, f"{name}.log"), "a"))
        coordinators.append((name, p))
        procs.append(p)
        return p

    agents = {}

    def start_agent(n):
        d = os.path.join(root, n)
        os.makedirs(d, exist_ok=True)
        port = agents[n]["port"] if n in agents else free_port()
        cfg = os.path.join(d, "serve.toml")
        with open(cfg, "w") as f:
            f.write(f'[policy]\nspec = "{spec}"\n[node]\nbackend = "sim"\nsim_gpus = {args.gpus}\n'
                    f'[api]\nsocket = "{d}/api.sock"\n[metrics]\nlisten = "127.0.0.1:{port}"\n'
                    f'[output]\ndir = "{d}/out"\n'
                    f'[fleet]\netcd = {json.dumps(endpoints)}\ndomain = "row-1"\nnode = "{n}"\n'
                    f'reserve_w = {reserve}\nlease_ttl = "10s"\nmargin = "3s"\n')
        p = subprocess.Popen([binary, "serve", "--config", cfg, "--quiet"], stdout=subprocess.DEVNULL,
                             stderr=open(os.path.join(d, "serve.log"), "a"))
        agents[n] = {"port": port, "proc": p}
        procs.append(p)

    def caps_of(n):
        a = agents[n]
        if a["proc"].poll() is not None:
            return reserve, "dead"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{a['port']}/metrics", timeout=0.5) as r:
                text = r.read().decode()
        except OSError:
            return None, "unreachable"
        total, seen = 0.0, False
        for line in text.splitlines():
            if line.startswith("tokwatt_gpu_power_cap_requested_watts{"):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
        return (total if seen else None), "live"

    try:
        write_budget(budget)
        start_coordinator("c1")
        time.sleep(1.0)
        start_coordinator("c2")
        for n in names:
            start_agent(n)
        for n in names:
            wait_http(f"http://127.0.0.1:{agents[n]['port']}/metrics", 120)
        t0 = time.time()
        events = []
        schedule = [
            (0.20, "kill the leading coordinator", lambda: kill_leader()),
            (0.35, "kill etcd member m0", lambda: etcd.kill(0)),
            (0.45, "kill -9 agent " + names[len(names) // 2], lambda: agents[names[len(names) // 2]]["proc"].kill()),
            (0.55, "restart etcd member m0", lambda: etcd.restart(0)),
            (0.60, "restart agent " + names[len(names) // 2], lambda: start_agent(names[len(names) // 2])),
            (0.70, f"lower the budget to {lowered:.0f} W", lambda: (write_budget(lowered), budget_now.append(lowered))),
        ]
        budget_now = [budget]

        def kill_leader():
            view = subprocess.run(["etcdctl", "--endpoints", ",".join(endpoints), "get",
                                   "/tokwatt/fleet/row-1/leader", "--print-value-only"],
                                  capture_output=True, text=True, env={**os.environ, "ETCDCTL_API": "3"})
            leader = view.stdout.strip()
            for name, p in coordinators:
                if name == leader:
                    p.kill()
                    return leader
            return None

        samples = []
        over = []
        lowered_at = None
        while time.time() - t0 < args.duration:
            second = time.time() - t0
            while schedule and second >= schedule[0][0] * args.duration:
                _, what, act = schedule.pop(0)
                act()
                events.append((round(second, 1), what))
                if "lower" in what:
                    lowered_at = second
                print(f"[{second:6.1f} s] {what}", flush=True)
            caps = [caps_of(n) for n in names]
            known = [c for c, _ in caps if c is not None]
            total = sum(known)
            missing = sum(1 for c, _ in caps if c is None)
            limit = budget if lowered_at is None else budget_now[-1]
            samples.append({"t": round(second, 2), "caps_w": total, "budget_w": limit, "unreachable": missing})
            # Until the cuts after a lowering land, the old budget bounds the sum.
            if total > budget + 1e-6 or (lowered_at is not None and total > limit + 1e-6 and second - lowered_at > 10):
                over.append(samples[-1])
            time.sleep(max(0.0, 1.0 - (time.time() - t0 - second)))
        settled = None
        if lowered_at is not None:
            after = [s for s in samples if s["t"] >= lowered_at]
            last_over = max((s["t"] for s in after if s["caps_w"] > lowered + 1e-6), default=lowered_at)
            settled = round(last_over - lowered_at, 1)
        peak = max(samples, key=lambda s: s["caps_w"] / budget)
        result = {
            "simulated": True,
            "nodes": args.nodes, "gpus_per_node": args.gpus,
            "budget_w": budget, "lowered_budget_w": lowered, "reserve_w": reserve,
            "seconds_sampled": len(samples),
            "seconds_over_budget": len(over),
            "peak_caps_w": peak["caps_w"], "peak_at_s": peak["t"],
            "within_lowered_budget_after_s": settled,
            "events": events,
        }
        with open(os.path.join(out, "fleet-scale-run.json"), "w") as f:
            json.dump({**result, "samples": samples}, f, indent=1)
        print(json.dumps(result, indent=1))
        print(f"simulator output; samples in {os.path.join(out, 'fleet-scale-run.json')}")
        return 1 if over else 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        etcd.stop()


if __name__ == "__main__":
    sys.exit(main())
