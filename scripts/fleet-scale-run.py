#!/usr/bin/env python3
"""The fleet on one machine: a 3-member etcd cluster on loopback, two `tokwatt fleet
coordinate` replicas and N real `tokwatt serve` agents on the simulator (8 GPUs each by
default), each node with its own demand (heavy, light, rising, falling load). Every
figure it prints is simulator output.

It runs up to four arms, one after another, on the same nodes, demand and seeds:

  faults  the fleet under faults on a schedule, checked every second: the sum of every
          agent's power caps in force (read from its /metrics over its API socket, which
          a network partition does not cut) against the budget in force. Faults: the
          leading coordinator killed, an etcd member killed and restarted, a node cut
          off from etcd (its own network namespace, the link taken down), the leading
          coordinator cut off, a node whose link flaps, an agent killed with SIGKILL and
          restarted, nodes whose clocks run fast and slow (libfaketime), a slow-clock
          node cut off, and the budget lowered.
  fleet   the fleet without faults: the `cap-search` policy on every node, under the
          allowance the coordinators grant.
  static  an equal static split: every GPU capped at its share of the budget.
  local   each node left to its local policy (`cap-search`) within its equal share.

  stops   issue 40's faults, agents that stop running while their GPUs keep the caps
          they had: an agent paused (SIGSTOP) for 20 s and for 60 s, killed and
          restarted 30 s later, killed at start five times (a crash loop), failing at
          start (a bad config), and a node rebooted. Every node runs the `static`
          policy at 700 W (every node wants its maximum) beside its fence (`tokwatt
          fence`, the Kubernetes sidecar), and the coordinator's stranded watts and
          the time until they are freed are recorded.

The last three are compared on fleet tokens per joule and on served demand (tokens
served over tokens asked for), over the same window of every node's run.

Every agent's simulated GPUs keep their settings in a file outside the agent process
(`[node] sim_driver`), as a real driver keeps a cap after the process that set it
stopped: the caps in force are read from there every second, so a paused, dead or
restarting agent is counted at what its GPUs really hold. In the fleet arms every node
runs its fence beside it and declares it (`[fleet.fence]`); its boot unit
(`tokwatt sim-driver boot-reserve`) puts a rebooted node at its reserve.

    python3 scripts/fleet-scale-run.py --nodes 125            # issue 31's run
    python3 scripts/fleet-scale-run.py --nodes 4 --duration 90   # a quick one

Needs etcd (Debian's etcd-server) and a built tokwatt (cargo build --release -p tokwatt).
The partitions need root and `ip` (iproute2); the skewed clocks need libfaketime (Debian's
faketime). Without them those faults are skipped with the reason (or the run fails where
--require-all is given). Exits non-zero if any second's caps passed the budget in force.
"""

import argparse
import base64
import concurrent.futures
import csv
import glob
import http.client
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
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
DOMAIN = "row-1"
# The fence applies the reserve when the agent's heartbeat is this old, within this long.
FENCE_STALL_S, FENCE_RESTORE_S = 3, 2
STRANDED_METRIC = "tokwatt_fleet_node_stranded_watts"
BRIDGE_IP = "10.77.0.1"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, what, patience=30.0):
    end = time.time() + patience
    while time.time() < end:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} within {patience:.0f} s: no")


def metric_values(text, name):
    """[(labels, value)] of every sample of `name` in a Prometheus text exposition."""
    found = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name):]
        labels = {}
        if rest.startswith("{"):
            body, _, rest = rest[1:].partition("}")
            for part in body.split(","):
                key, _, value = part.partition("=")
                if key:
                    labels[key.strip()] = value.strip().strip('"')
        if not rest.startswith(" "):
            continue  # another metric whose name starts with this one
        try:
            found.append((labels, float(rest.split()[0])))
        except (ValueError, IndexError):
            continue
    return found


def driver_caps(path, patience=0.2):
    """The sum of the power caps a node's simulated driver holds (None: no driver file
    yet, or none that reads). Its writers change its lines in place, each in one write
    and without a lock (tokwatt_sim::driver), so a read may catch one half written: every
    line but the last `]}` must match its check, `"N/CRC"` (zlib's CRC-32 of the line up
    to that slash), else the file is read again."""

    def whole(line):
        slash = line.rfind(b"/")
        return slash > 0 and line[slash + 1:slash + 9] == b"%08x" % zlib.crc32(line[:slash + 1])

    deadline = time.monotonic() + patience
    while True:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            if data.endswith(b"]}\n") and all(whole(line) for line in data.split(b"\n")[:-2]):
                return sum(board["power_cap_w"] for board in json.loads(data)["boards"])
        except (ValueError, KeyError, TypeError):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.002)


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def get_unix(path, url, timeout=0.8):
    conn = UnixHTTPConnection(path, timeout)
    try:
        conn.request("GET", url)
        response = conn.getresponse()
        if response.status != 200:
            raise OSError(f"{url}: HTTP {response.status}")
        return response.read().decode()
    finally:
        conn.close()


class Network:
    """A bridge and one network namespace per process that may be cut off. etcd listens
    on the bridge's address as well as on loopback."""

    def __init__(self, tag):
        self.bridge = f"twb{tag}"[:15]
        self.names = {}
        self.up = False

    @staticmethod
    def available():
        if os.geteuid() != 0:
            return "not root"
        if not shutil.which("ip"):
            return "`ip` (iproute2) is not installed"
        probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        if probe.returncode != 0:
            return f"`ip netns` fails: {probe.stderr.strip()}"
        return None

    def start(self):
        self.run("ip", "link", "add", self.bridge, "type", "bridge")
        self.up = True
        self.run("ip", "addr", "add", f"{BRIDGE_IP}/16", "dev", self.bridge)
        self.run("ip", "link", "set", self.bridge, "up")

    def add(self, who):
        """A namespace for `who`; returns the command prefix that runs a process in it."""
        k = len(self.names)
        ns, host_end, ns_end = f"{self.bridge}-{k}", f"{self.bridge}h{k}"[:15], f"{self.bridge}n{k}"[:15]
        address = f"10.77.{1 + k // 250}.{2 + k % 250}"
        self.run("ip", "netns", "add", ns)
        self.run("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        self.run("ip", "link", "set", ns_end, "netns", ns)
        self.run("ip", "link", "set", host_end, "master", self.bridge)
        self.run("ip", "link", "set", host_end, "up")
        self.run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/16", "dev", ns_end)
        self.run("ip", "netns", "exec", ns, "ip", "link", "set", ns_end, "up")
        self.run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        self.names[who] = (ns, host_end)
        return ["ip", "netns", "exec", ns]

    def cut(self, who):
        self.run("ip", "link", "set", self.names[who][1], "down")

    def heal(self, who):
        self.run("ip", "link", "set", self.names[who][1], "up")

    def stop(self):
        for ns, host_end in self.names.values():
            subprocess.run(["ip", "link", "del", host_end], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.names = {}
        if self.up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            self.up = False

    @staticmethod
    def run(*cmd):
        subprocess.run(cmd, check=True, capture_output=True)


class Etcd:
    def __init__(self, root, bridged, members=3):
        self.root = root
        self.bridged = bridged
        self.members = [
            {"name": f"m{i}", "client": free_port(), "peer": free_port(), "proc": None}
            for i in range(members)
        ]
        self.initial = ",".join(f"{m['name']}=http://127.0.0.1:{m['peer']}" for m in self.members)
        for i in range(members):
            self.start(i, "new")
        for m in self.members:
            wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{m['client']}/health", timeout=1),
                     f"etcd {m['name']} healthy")

    def start(self, i, state):
        m = self.members[i]
        listen = [f"http://127.0.0.1:{m['client']}"]
        if self.bridged:
            listen.append(f"http://{BRIDGE_IP}:{m['client']}")
        peer = f"http://127.0.0.1:{m['peer']}"
        log = open(os.path.join(self.root, f"{m['name']}.log"), "a")
        m["proc"] = subprocess.Popen(
            ["etcd", "--name", m["name"], "--data-dir", os.path.join(self.root, m["name"]),
             "--listen-client-urls", ",".join(listen), "--advertise-client-urls", listen[0],
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", self.initial, "--initial-cluster-state", state,
             "--heartbeat-interval", "100", "--election-timeout", "1000"],
            stdout=subprocess.DEVNULL, stderr=log)

    def kill(self, i):
        self.members[i]["proc"].kill()
        self.members[i]["proc"].wait()

    def restart(self, i):
        self.start(i, "existing")

    def endpoints(self, host="127.0.0.1"):
        return [f"http://{host}:{m['client']}" for m in self.members]

    def get(self, key):
        """A key's value through etcd's JSON gateway, from the first member that answers."""
        body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
        for endpoint in self.endpoints():
            try:
                request = urllib.request.Request(f"{endpoint}/v3/kv/range", data=body)
                with urllib.request.urlopen(request, timeout=0.5) as r:
                    kvs = json.loads(r.read()).get("kvs", [])
                    return base64.b64decode(kvs[0]["value"]).decode() if kvs else None
            except OSError:
                continue
        return None

    def stop(self):
        for m in self.members:
            if m["proc"] and m["proc"].poll() is None:
                m["proc"].kill()
                m["proc"].wait()


# Demand per GPU, requests a second of 256 tokens (llama-3-8b on a simulated H200 serves
# ~66 a second at 700 W, batch 512). Heavy load needs more than the equal share of the
# budget (at 450 W a GPU, 52 a second are still served: the first runs used that, and
# watts had no reason to move); light load needs less than the reserve.
HEAVY_RPS, LIGHT_RPS = 60.0, 10.0


def demand_kind(i):
    return ["heavy", "heavy", "light", "light", "heavy", "light", "light", "heavy", "rising", "falling"][i % 10]


def scenario_text(kind, shift_s):
    phases = {
        "heavy": [(0, HEAVY_RPS)],
        "light": [(0, LIGHT_RPS)],
        "rising": [(0, LIGHT_RPS), (shift_s, HEAVY_RPS)],
        "falling": [(0, HEAVY_RPS), (shift_s, LIGHT_RPS)],
    }[kind]
    text = (f'description = "{kind} load"\nmodel = "llama-3-8b"\ncontext_tokens = 1024\n'
            'output_tokens = 256\nbatch_size_max = 512\ninitial_batch_size = 512\nqueue_max = 2048\n')
    for start, rps in phases:
        text += f"[[phases]]\nstart_s = {start}\narrival_rps = {rps}\n"
    return text


class Arm:
    """One run of N agents (and, in fleet mode, etcd and two coordinators)."""

    def __init__(self, args, binary, name, root, network):
        self.args, self.binary, self.name = args, binary, name
        self.root = os.path.join(root, name)
        os.makedirs(self.root)
        self.network = network
        self.fleet = name in ("faults", "fleet", "stops")
        self.procs = []
        self.agents = {}
        self.fences = {}
        self.coordinators = {}
        self.coordinator_metrics = {}
        self.names = [f"node-{i:03d}" for i in range(args.nodes)]
        self.share = args.share_w * args.gpus
        self.reserve = args.reserve_w * args.gpus
        self.budget = self.share * args.nodes
        self.budget_now = self.budget
        self.etcd = None
        self.skewed = {}
        self.cache = os.path.join(root, "plugin-cache")

    # --- processes

    def prefix(self, who):
        if self.network and who in self.network.names:
            return ["ip", "netns", "exec", self.network.names[who][0]]
        return []

    def endpoints_for(self, who):
        host = BRIDGE_IP if self.network and who in self.network.names else "127.0.0.1"
        return self.etcd.endpoints(host)

    def write_budget(self, watts):
        path = os.path.join(self.root, "budget.toml")
        with open(path, "w") as f:
            f.write(f'domain = "{DOMAIN}"\nbudget_w = {watts}\n')
            for n in self.names:
                # Every node runs its fence and its boot unit: counted at its reserve when silent.
                f.write(f'[[nodes]]\nnode = "{n}"\nreserve_w = {self.reserve}\nmax_w = {700.0 * self.args.gpus}\n'
                        f'default_w = {700.0 * self.args.gpus}\nfenced = true\n')
        subprocess.run([self.binary, "fleet", "budget", *sum((["--etcd", e] for e in self.etcd.endpoints()), []),
                        "--file", path], check=True, stdout=subprocess.DEVNULL)
        self.budget_now = watts

    def start_coordinator(self, name):
        flags = sum((["--etcd", e] for e in self.endpoints_for(name)), [])
        port = self.coordinator_metrics.setdefault(name, free_port())
        p = subprocess.Popen([*self.prefix(name), self.binary, "fleet", "coordinate", *flags, "--domain", DOMAIN,
                              "--name", name, "--ttl", "5s", "--period", "1s", "--metrics", f"127.0.0.1:{port}"],
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.root, f"{name}.log"), "a"))
        self.coordinators[name] = p
        self.procs.append(p)

    def leader(self):
        return self.etcd.get(f"/tokwatt/fleet/{DOMAIN}/leader")

    def driver(self, n):
        return os.path.join(self.root, n, "driver.json")

    def start_fence(self, n):
        """The node's fence (the Kubernetes sidecar): it applies the reserve to the
        node's simulated driver when the agent's heartbeat stalls."""
        d = os.path.join(self.root, n)
        os.makedirs(d, exist_ok=True)
        p = subprocess.Popen([*self.prefix(n), self.binary, "fence", "--heartbeat", os.path.join(d, "heartbeat"),
                              "--status", os.path.join(d, "fence.json"), "--stall", f"{FENCE_STALL_S}s",
                              "--reserve", str(self.reserve), "--sim-driver", self.driver(n)],
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "fence.log"), "a"))
        self.fences[n] = p
        self.procs.append(p)

    def start_agent(self, n, bad_config=False):
        d = os.path.join(self.root, n)
        os.makedirs(d, exist_ok=True)
        i = self.names.index(n)
        scenario = os.path.join(d, "scenario.toml")
        with open(scenario, "w") as f:
            f.write(scenario_text(demand_kind(i), self.args.shift))
        policy = {"static": "static.toml", "stops": "static-700.toml"}.get(self.name, "cap-search.toml")
        spec = os.path.join(self.root, policy)
        text = (f'[policy]\nspec = "{spec}"\ncache_dir = "{self.cache}"\nseed = {1000 + i}\n'
                f'[node]\nbackend = "sim"\nsim_gpus = {self.args.gpus}\nsim_scenario = "{scenario}"\n'
                f'sim_driver = "{self.driver(n)}"\n'
                f'[api]\nsocket = "{d}/api.sock"\n[output]\ndir = "{d}/out"\n')
        if self.name == "local":
            text += f"[guardrails]\npower_cap_max_w = {self.args.share_w}\n"
        if self.fleet:
            text += (f'[fleet]\netcd = {json.dumps(self.endpoints_for(n))}\ndomain = "{DOMAIN}"\nnode = "{n}"\n'
                     f'reserve_w = {self.reserve}\nlease_ttl = "10s"\nmargin = "3s"\n'
                     f'[fleet.fence]\nkind = "heartbeat"\nheartbeat = "{d}/heartbeat"\nstatus = "{d}/fence.json"\n'
                     f'restore_s = {FENCE_RESTORE_S}\ncovers_reboot = true\n')
            if n not in self.fences:
                self.start_fence(n)
        if bad_config:
            # A bad ConfigMap: the agent fails at start, before it knows its reserve.
            text += "[node.nonsense]\nkey = 1\n"
        cfg = os.path.join(d, "serve.toml")
        with open(cfg, "w") as f:
            f.write(text)
        env = dict(os.environ)
        if n in self.skewed:
            env.update(LD_PRELOAD=FAKETIME_LIB, FAKETIME=self.skewed[n], FAKETIME_NO_CACHE="1")
        p = subprocess.Popen([*self.prefix(n), self.binary, "serve", "--config", cfg, "--quiet"],
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "serve.log"), "a"), env=env)
        self.agents[n] = {"proc": p, "socket": os.path.join(d, "api.sock"), "dir": d}
        self.procs.append(p)

    def metrics(self, n):
        return get_unix(self.agents[n]["socket"], "/metrics")

    def caps_of(self, n):
        """(caps in force, state) of one node, read from its simulated driver: what its
        GPUs hold, whether its agent runs, is paused, dead or starting."""
        a = self.agents[n]
        caps = driver_caps(self.driver(n))
        if a["proc"].poll() is not None:
            state = "dead"
        elif a.get("paused"):
            state = "paused"
        else:
            state = "live"
        if caps is None:
            # No driver file yet: the node's GPUs were never touched, at their defaults.
            caps = 700.0 * self.args.gpus
        return caps, state

    def leader_metrics(self):
        """The leading coordinator's /metrics text (None: none read)."""
        for port in self.coordinator_metrics.values():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            if any(v == 1.0 for _, v in metric_values(text, "tokwatt_fleet_coordinator_leading")):
                return text
        return None

    def leader_rounds_and_grants(self):
        """The leader's rounds, grants written and failed rounds, from one scrape (None
        each: unread)."""
        text = self.leader_metrics() or ""
        found = [metric_values(text, f"tokwatt_fleet_coordinator_{name}_total")
                 for name in ("rounds", "grants_written", "round_errors")]
        return tuple(sum(v for _, v in values) if values else None for values in found)

    def stranded(self):
        """The leader's stranded watts, node by node, from its metrics (None: unread)."""
        text = self.leader_metrics()
        if text is not None:
            per_node = {}
            for labels, value in metric_values(text, STRANDED_METRIC):
                node = labels.get("node")
                if node:
                    per_node[node] = per_node.get(node, 0.0) + value
            return per_node
        return None

    def serving(self, n):
        """Whether the agent answers with its GPUs' caps (it has ticked)."""
        try:
            return "tokwatt_gpu_power_cap_requested_watts{" in self.metrics(n)
        except OSError:
            return False

    def gauge(self, n, name):
        try:
            for line in self.metrics(n).splitlines():
                if line.startswith(name + " "):
                    return float(line.split(" ")[1])
        except OSError:
            pass
        return None

    def start(self):
        for file, watts in (("static.toml", self.args.share_w), ("static-700.toml", 700.0)):
            with open(os.path.join(self.root, file), "w") as f:
                f.write(f'name = "static"\nplugin = "policy_static.wasm"\nknobs = ["power-cap"]\ntick_ms = 1000\n'
                        f'[params]\npower_cap_w = "{watts}"\n')
        with open(os.path.join(REPO, "policies", "cap-search.toml")) as f:
            spec = f.read()
        if self.name == "local":
            # A policy may only narrow the node's rules: its own ceiling comes down too.
            spec = spec.replace("power_cap_max_w = 700.0", f"power_cap_max_w = {self.args.share_w}")
        with open(os.path.join(self.root, "cap-search.toml"), "w") as f:
            f.write(spec)
        if self.fleet:
            self.etcd = Etcd(self.root, bridged=self.network is not None)
            if self.network and self.name == "faults":
                for who in ("c1", "c2", *self.fault_nodes()):
                    self.network.add(who)
            if self.name == "faults" and self.args.skew:
                slow, fast = self.skew_nodes()
                self.skewed = {slow: "-2h x0.97", fast: "+3h x1.03"}
            self.write_budget(self.budget)
            self.start_coordinator("c1")
            wait_for(lambda: self.leader() == "c1", "coordinator c1 leading", 30)
            self.start_coordinator("c2")
        # One agent first compiles the policies into the shared cache; the rest load it.
        first = self.names[0]
        self.start_agent(first)
        wait_for(lambda: self.serving(first), f"{first} serving", 120)
        for n in self.names[1:]:
            self.start_agent(n)
        for n in self.names:
            wait_for(lambda: self.serving(n), f"{n} serving", 180)
        if self.fleet:
            # Each node's boot unit (tokwatt-reserve.service): a reboot puts it at its reserve.
            for n in self.names:
                subprocess.run([self.binary, "sim-driver", "boot-reserve", self.driver(n), "--watts", str(self.reserve)],
                               check=True, stdout=subprocess.DEVNULL)

    # Five distinct nodes take the node faults; the ones cut off, flapping or skewed slow
    # carry heavy load (a grant above their reserve, which a cut must take back).
    FAULT_NODES_LARGE = {"cut": 1, "flapping": 4, "slow": 7, "fast": 3, "killed": 10}
    FAULT_NODES_SMALL = {"cut": 1, "flapping": 4, "slow": 0, "fast": 3, "killed": 2}

    def fault_node(self, role):
        table = self.FAULT_NODES_LARGE if len(self.names) >= 11 else self.FAULT_NODES_SMALL
        return self.names[table[role]]

    def fault_nodes(self):
        """cut off, flapping, slow clock (also cut off): each in its own namespace."""
        return [self.fault_node(r) for r in ("cut", "flapping", "slow")]

    def skew_nodes(self):
        return self.fault_node("slow"), self.fault_node("fast")

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.etcd:
            self.etcd.stop()

    # --- measurements

    def sample(self, pool):
        caps = list(pool.map(self.caps_of, self.names))
        known = [c for c, _ in caps if c is not None]
        return sum(known), sum(1 for c, _ in caps if c is None)

    def pause(self, n):
        self.agents[n]["proc"].send_signal(signal.SIGSTOP)
        self.agents[n]["paused"] = True

    def resume(self, n):
        self.agents[n]["proc"].send_signal(signal.SIGCONT)
        self.agents[n]["paused"] = False

    def kill(self, n):
        self.agents[n]["proc"].kill()
        self.agents[n]["proc"].wait()

    def reboot(self, n):
        """The node goes down (agent and fence with it); the driver comes back at the
        board defaults and its boot unit applies the reserve."""
        self.kill(n)
        fence = self.fences.pop(n)
        fence.kill()
        fence.wait()
        subprocess.run([self.binary, "sim-driver", "reboot", self.driver(n)], check=True,
                       stdout=subprocess.DEVNULL)

    def totals(self, start_s, end_s, exclude=()):
        """Tokens, energy and tokens asked for over [start_s, end_s) of every node's own run
        (its trace), the nodes in `exclude` left out."""
        tokens = energy = demanded = turned_away = waiting = 0.0
        per_kind = {}
        for i, n in enumerate(self.names):
            if n in exclude:
                continue
            node = [0.0, 0.0, 0.0]
            last_queue = {}
            for path in sorted(glob.glob(os.path.join(self.agents[n]["dir"], "out", "*", "trace*.csv"))):
                with open(path) as f:
                    for row in csv.DictReader(f):
                        t = float(row["time_s"])
                        if start_s <= t < end_s:
                            node[0] += float(row["tokens"])
                            node[1] += float(row["energy_j"])
                            node[2] += float(row["tokens_demanded"] or 0)
                            turned_away += float(row["requests_turned_away"] or 0)
                            last_queue[row["gpu"]] = float(row["queue_depth"])
            waiting += sum(last_queue.values())
            tokens, energy, demanded = tokens + node[0], energy + node[1], demanded + node[2]
            k = per_kind.setdefault(demand_kind(i), [0.0, 0.0, 0.0])
            for j in range(3):
                k[j] += node[j]
        return {
            "tokens": tokens, "energy_j": energy, "tokens_demanded": demanded,
            "requests_turned_away": turned_away,
            # Requests still waiting when the window closed: demand taken but not served.
            "requests_waiting_at_end": waiting,
            "tokens_per_joule": tokens / energy if energy else None,
            "served_fraction": tokens / demanded if demanded else None,
            "per_demand": {kind: {"tokens_per_joule": v[0] / v[1] if v[1] else None,
                                  "served_fraction": v[0] / v[2] if v[2] else None}
                           for kind, v in sorted(per_kind.items())},
        }


def run_faults(arm, args):
    """The fleet under faults; returns (result, seconds over the budget)."""
    d = args.duration
    net = arm.network
    cut, flapping, slow = arm.fault_nodes() if net else (None, None, None)
    killed = arm.fault_node("killed")
    events, reactions, over, samples = [], {}, [], []
    state = {"lowered_at": None, "killed_leader": None, "cut_leader": None}

    def kill_leader():
        leader = arm.leader()
        state["killed_leader"] = (leader, time.time())
        if leader in arm.coordinators:
            arm.coordinators[leader].kill()
        return f"kill -9 the leading coordinator ({leader})"

    def restart_killed_leader():
        name = state["killed_leader"][0]
        if name:
            arm.start_coordinator(name)
        return f"restart coordinator {name}"

    def cut_leader():
        leader = arm.leader()
        state["cut_leader"] = (leader, time.time())
        net.cut(leader)
        return f"cut the leading coordinator ({leader}) off"

    def heal_leader():
        net.heal(state["cut_leader"][0])
        return f"heal coordinator {state['cut_leader'][0]}"

    def cut_node(n):
        net.cut(n)
        state[f"cut:{n}"] = time.time()
        return f"cut {n} off from etcd"

    def heal_node(n):
        net.heal(n)
        state[f"healed:{n}"] = time.time()
        return f"heal {n}"

    def flap(n, until):
        def act():
            t = time.time() - t0
            if t < until:
                down = int(t / 1.5) % 2 == 0
                (net.cut if down else net.heal)(n)
                schedule.append((t + 1.5, None, act))
                schedule.sort(key=lambda e: e[0])
            else:
                net.heal(n)
        return act

    def lower():
        arm.write_budget(arm.budget * args.lower_to)
        state["lowered_at"] = time.time() - t0
        return f"lower the budget to {arm.budget_now:.0f} W"

    schedule = [
        (0.12 * d, "kill", kill_leader),
        (0.20 * d, "restart", restart_killed_leader),
        (0.25 * d, "etcd", lambda: (arm.etcd.kill(0), "kill etcd member m0")[1]),
        (0.40 * d, "etcd", lambda: (arm.etcd.restart(0), "restart etcd member m0")[1]),
        (0.45 * d, "agent", lambda: (arm.agents[killed]["proc"].kill(), f"kill -9 agent {killed}")[1]),
        (0.55 * d, "agent", lambda: (arm.start_agent(killed), f"restart agent {killed}")[1]),
        (0.72 * d, "lower", lower),
    ]
    if net:
        schedule += [
            (0.15 * d, "cut", lambda: cut_node(cut)),
            (0.15 * d + 25, "heal", lambda: heal_node(cut)),
            (0.32 * d, "cut-leader", cut_leader),
            (0.32 * d + 20, "heal-leader", heal_leader),
            (0.48 * d, "flap", lambda: (flap(flapping, 0.48 * d + 20)(), f"{flapping}'s link flaps (1.5 s down, 1.5 s up) for 20 s")[1]),
        ]
        if args.skew:
            schedule += [
                (0.60 * d, "cut", lambda: cut_node(slow) + " (its clock runs 3 % slow)"),
                (0.60 * d + 20, "heal", lambda: heal_node(slow)),
            ]
    schedule.sort(key=lambda e: e[0])
    t0 = time.time()
    last_leader = arm.leader()
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        while time.time() - t0 < d:
            second = time.time() - t0
            while schedule and second >= schedule[0][0]:
                _, kind, act = schedule.pop(0)
                what = act()
                if what:
                    events.append((round(second, 1), what))
                    print(f"[faults {second:6.1f} s] {what}", flush=True)
            total, missing = arm.sample(pool)
            leader = arm.leader()
            if leader and leader != last_leader:
                for key in ("killed_leader", "cut_leader"):
                    if state[key] and state[key][0] == last_leader and f"takeover:{key}" not in reactions:
                        reactions[f"takeover:{key}"] = round(time.time() - state[key][1], 1)
                last_leader = leader
            for n in (cut, slow):
                if n and f"cut:{n}" in state and f"reserve:{n}" not in reactions:
                    allowance = arm.gauge(n, "tokwatt_fleet_allowance_watts")
                    if allowance is not None and allowance <= arm.reserve + 0.5:
                        reactions[f"reserve:{n}"] = round(time.time() - state[f"cut:{n}"], 1)
                if n and f"cut:{n}" in state and f"expired:{n}" not in reactions:
                    if arm.etcd.get(f"/tokwatt/fleet/{DOMAIN}/nodes/{n}") is None:
                        reactions[f"expired:{n}"] = round(time.time() - state[f"cut:{n}"], 1)
                if n and f"healed:{n}" in state and f"rejoin:{n}" not in reactions:
                    if arm.gauge(n, "tokwatt_fleet_granted") == 1.0:
                        reactions[f"rejoin:{n}"] = round(time.time() - state[f"healed:{n}"], 1)
            limit = arm.budget_now
            sample = {"t": round(second, 2), "caps_w": total, "budget_w": limit, "unreadable": missing}
            samples.append(sample)
            lowered = state["lowered_at"]
            # Until the cuts after a lowering land, the budget before it bounds the sum.
            if total > arm.budget + 1e-6 or (lowered is not None and second - lowered > 10 and total > limit + 1e-6):
                over.append(sample)
            time.sleep(max(0.0, 1.0 - (time.time() - t0 - second)))
    lowered = state["lowered_at"]
    settled = None
    if lowered is not None:
        after = [s for s in samples if s["t"] >= lowered]
        last_over = max((s["t"] for s in after if s["caps_w"] > arm.budget_now + 1e-6), default=lowered)
        settled = round(last_over - lowered, 1)
    peak = max(samples, key=lambda s: s["caps_w"] / s["budget_w"])
    result = {
        "budget_w": arm.budget, "lowered_budget_w": arm.budget_now, "reserve_w": arm.reserve,
        "seconds_sampled": len(samples), "seconds_over_budget": len(over),
        "seconds_with_unreadable_nodes": sum(1 for s in samples if s["unreadable"]),
        "peak_caps_w": peak["caps_w"], "peak_at_s": peak["t"],
        "within_lowered_budget_after_s": settled,
        "reactions_s": reactions, "events": events,
        "skewed_clocks": arm.skewed,
    }
    with open(os.path.join(arm.root, "samples.json"), "w") as f:
        json.dump(samples, f)
    return result, over


def run_stops(arm, args):
    """Agents that stop running while their GPUs keep their caps (issue 40): returns
    (result, seconds over the budget)."""
    d = args.stops_duration
    a, b, c, dd, e = (arm.names[i] for i in range(5))
    events, over, samples = [], [], []
    stranded_log = {}
    schedule = []

    def at(t, what, act):
        schedule.append((t, what, act))
        schedule.sort(key=lambda x: x[0])

    def crash_loop(n, left):
        def act():
            arm.start_agent(n)
            def kill():
                arm.kill(n)
                if left > 1:
                    at(time.time() - t0 + 1.0, None, crash_loop(n, left - 1))
                else:
                    at(time.time() - t0 + 3.0, f"start agent {n} for good after its crash loop",
                       lambda: arm.start_agent(n))
            at(time.time() - t0 + 1.5, f"kill -9 agent {n} at start ({6 - left} of 5)", kill)
        return act

    def bad_start(n, tries):
        def act():
            arm.start_agent(n, bad_config=True)
            if tries > 1:
                at(time.time() - t0 + 5.0, f"start agent {n} again with its bad config", bad_start(n, tries - 1))
        return act

    def stop_cleanly(n):
        arm.agents[n]["proc"].send_signal(signal.SIGTERM)
        arm.agents[n]["proc"].wait(timeout=30)

    # When each fault starts: one after another (the figures read fault by fault), or,
    # with --stops-together, all at 15 s on their five nodes and the reboot after the
    # first pause (half the time: what .ci/run runs).
    start = ({"pause20": 15, "pause60": 15, "kill": 15, "crash": 15, "bad": 15, "reboot": 50}
             if args.stops_together else
             {"pause20": 15, "pause60": 45, "kill": 55, "crash": 100, "bad": 125, "reboot": 170})
    at(start["pause20"], f"pause agent {a} (SIGSTOP) for 20 s", lambda: arm.pause(a))
    at(start["pause20"] + 20, f"resume agent {a}", lambda: arm.resume(a))
    at(start["pause60"], f"pause agent {b} (SIGSTOP) for 60 s", lambda: arm.pause(b))
    at(start["pause60"] + 60, f"resume agent {b}", lambda: arm.resume(b))
    at(start["kill"], f"kill -9 agent {c}; nothing restarts it for 30 s", lambda: arm.kill(c))
    at(start["kill"] + 30, f"restart agent {c}", lambda: arm.start_agent(c))
    at(start["crash"], f"crash loop: agent {dd} stopped, then killed at start five times", lambda: (arm.kill(dd), crash_loop(dd, 5)()))
    at(start["bad"], f"agent {e} stopped, then started with a bad config three times, 5 s apart",
       lambda: (stop_cleanly(e), bad_start(e, 3)()))
    at(start["bad"] + 25, f"agent {e} started with its config fixed", lambda: arm.start_agent(e))
    at(start["reboot"], f"reboot node {a}: agent and fence gone, the driver at its board defaults, then its boot unit",
       lambda: arm.reboot(a))
    at(start["reboot"] + 15, f"node {a} booted: fence and agent started", lambda: (arm.start_fence(a), arm.start_agent(a)))
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        while time.time() - t0 < d:
            second = time.time() - t0
            while schedule and second >= schedule[0][0]:
                _, what, act = schedule.pop(0)
                act()
                if what:
                    events.append((round(second, 1), what))
                    print(f"[stops {second:6.1f} s] {what}", flush=True)
            total, missing = arm.sample(pool)
            stranded = arm.stranded()
            for node, watts in (stranded or {}).items():
                stranded_log.setdefault(node, []).append((round(second, 1), watts))
            sample = {"t": round(second, 2), "caps_w": total, "budget_w": arm.budget_now,
                      "unreadable": missing, "stranded_w": stranded}
            samples.append(sample)
            if total > arm.budget_now + 1e-6:
                over.append(sample)
            time.sleep(max(0.0, 1.0 - (time.time() - t0 - second)))
    # Per node: the most stranded at once, and each stretch of stranded watts (from the
    # first second they show to the first second they are gone).
    stretches = {}
    for node, log in stranded_log.items():
        runs, start, peak = [], None, 0.0
        for t, w in log:
            if w > 0.5 and start is None:
                start, peak = t, w
            elif w > 0.5:
                peak = max(peak, w)
            elif start is not None:
                runs.append({"from_s": start, "freed_after_s": round(t - start, 1), "peak_w": peak})
                start = None
        if start is not None:
            runs.append({"from_s": start, "freed_after_s": None, "peak_w": peak})
        if runs:
            stretches[node] = runs
    peak = max(samples, key=lambda s: s["caps_w"])
    result = {
        "budget_w": arm.budget, "reserve_w": arm.reserve, "default_w": 700.0 * args.gpus,
        "seconds_sampled": len(samples), "seconds_over_budget": len(over),
        "peak_caps_w": peak["caps_w"], "peak_at_s": peak["t"],
        "seconds_without_leader_metrics": sum(1 for s in samples if s["stranded_w"] is None),
        "stranded": stretches, "events": events,
    }
    with open(os.path.join(arm.root, "samples.json"), "w") as f:
        json.dump(samples, f)
    return result, over


def stops_table(r):
    rows = [
        ("seconds sampled / over the budget", f"{r['seconds_sampled']} / {r['seconds_over_budget']}"),
        ("peak of the summed caps (read from the drivers)",
         f"{r['peak_caps_w']:.0f} W of {r['budget_w']:.0f} W at {r['peak_at_s']} s"),
    ]
    for node, runs in sorted(r["stranded"].items()):
        for run in runs:
            freed = f"freed after {run['freed_after_s']} s" if run["freed_after_s"] is not None else "not freed by the end"
            rows.append((f"{node}: stranded from {run['from_s']} s", f"up to {run['peak_w']:.0f} W, {freed}"))
    lines = ["| agents that stop (simulator) | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    lines += ["", "Events: " + "; ".join(f"{t} s {what}" for t, what in r["events"])]
    return "\n".join(lines)


def run_steady(arm, args):
    """An arm without faults: run, then sum every node's window. In the fleet, also how
    often grants change once settled: grants written per round after the warm-up."""
    churn, first = None, None
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        t0 = time.time()
        over = 0
        while time.time() - t0 < args.duration:
            second = time.time() - t0
            total, _ = arm.sample(pool)
            if arm.fleet and total > arm.budget + 1e-6:
                over += 1
            if arm.fleet and first is None and second >= args.warmup:
                first = arm.leader_rounds_and_grants()
            time.sleep(max(0.0, 1.0 - (time.time() - t0 - second)))
    if first and None not in first:
        rounds, grants, errors = arm.leader_rounds_and_grants()
        if rounds is not None and grants is not None and errors is not None:
            n = rounds - first[0]
            churn = {"rounds": n, "round_errors": errors - first[2],
                     "grants_written": grants - first[1],
                     "grants_per_round": (grants - first[1]) / max(n, 1),
                     "grant_changes_per_node_round": (grants - first[1]) / max(n, 1) / args.nodes}
    return over, churn


def faults_table(f):
    budget, lowered = f["budget_w"], f["lowered_budget_w"]
    r = f["reactions_s"]
    rows = [
        ("seconds sampled / over the budget in force", f"{f['seconds_sampled']} / {f['seconds_over_budget']}"),
        ("seconds with a node unreadable", f"{f['seconds_with_unreadable_nodes']}"),
        ("peak of the summed caps", f"{f['peak_caps_w']:.0f} W of {budget:.0f} W ({f['peak_caps_w'] / budget * 100:.1f} %)"),
        (f"within the lowered budget ({lowered:.0f} W) after", f"{f['within_lowered_budget_after_s']} s"),
    ]
    labels = {"takeover:killed_leader": "other coordinator leads after the leader's kill -9",
              "takeover:cut_leader": "other coordinator leads after the leader is cut off",
              "reserve": "cut-off node at its reserve, on its own clock, after",
              "expired": "cut-off node's lease gone from etcd after",
              "rejoin": "healed node granted again after"}
    for key, value in sorted(r.items()):
        kind, _, node = key.partition(":")
        label = labels.get(key) or f"{labels.get(kind, kind)} ({node})"
        rows.append((label, f"{value} s"))
    lines = ["| faults run (simulator) | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    lines += ["", "Events: " + "; ".join(f"{t} s {what}" for t, what in f["events"])]
    return "\n".join(lines)


def table(results, args):
    lines = [f"Simulator output: {args.nodes} nodes x {args.gpus} simulated H200, budget "
             f"{args.share_w:.0f} W a GPU on average, reserve {args.reserve_w:.0f} W a GPU, "
             f"window {args.warmup:.0f}-{args.duration:.0f} s of every node's run (a backlog from before the "
             "window drains in it, so served / asked may pass 100 %).", "",
             "| arm | tokens/J | tokens served | served / asked in the window | requests waiting at the end "
             "| turned away | tokens/J vs static | tokens served vs static |",
             "|---|---|---|---|---|---|---|---|"]
    base = results.get("static")
    for name in ("fleet", "static", "local"):
        r = results.get(name)
        if not r:
            continue
        t = r["totals"]
        rel = lambda k: f"{(t[k] / base['totals'][k] - 1) * 100:+.1f} %" if base and t[k] and base["totals"][k] else "-"
        lines.append(f"| {name} | {t['tokens_per_joule']:.2f} | {t['tokens'] / 1e6:.1f} M | "
                     f"{t['served_fraction'] * 100:.1f} % | {t['requests_waiting_at_end']:.0f} | "
                     f"{t['requests_turned_away']:.0f} | {rel('tokens_per_joule')} | {rel('tokens')} |")
    churn = (results.get("fleet") or {}).get("churn")
    if churn:
        lines += ["", f"Fleet grants after the warm-up: {churn['grants_written']:.0f} written in {churn['rounds']:.0f} "
                      f"rounds ({churn['grants_per_round']:.2f} a round, a grant changed on "
                      f"{churn['grant_changes_per_node_round'] * 100:.1f} % of node-rounds; "
                      f"{churn['round_errors']:.0f} rounds failed on the store)."]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=125)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds each arm runs")
    ap.add_argument("--stops-duration", type=float, default=240.0,
                    help="seconds the stops arm runs (its faults are on a fixed schedule: at least 200, or 90 "
                         "with --stops-together)")
    ap.add_argument("--stops-together", action="store_true",
                    help="the stops arm's faults all at once on their five nodes, the reboot after the first pause")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of each node's run left out of the comparison")
    ap.add_argument("--shift", type=float, default=90.0, help="when rising and falling nodes change load (s)")
    ap.add_argument("--share-w", type=float, default=450.0, help="the budget's watts a GPU on average")
    ap.add_argument("--reserve-w", type=float, default=300.0, help="each node's reserve, watts a GPU")
    ap.add_argument("--arms", default="faults,stops,fleet,static,local")
    ap.add_argument("--lower-to", type=float, default=0.7,
                    help="the faults run lowers the budget to this fraction of it (the reserves must fit)")
    ap.add_argument("--no-skew", dest="skew", action="store_false", help="no skewed clocks")
    ap.add_argument("--require-all", action="store_true", help="fail rather than skip a fault this machine cannot run")
    ap.add_argument("--tokwatt", default=None, help="the binary (default: target/release, else target/debug)")
    ap.add_argument("--out", default=None, help="where the table and samples go (default: a temporary folder)")
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(arms) - {"faults", "stops", "fleet", "static", "local"}
    if unknown:
        raise SystemExit(f"unknown arm(s) {sorted(unknown)}: choose from faults, stops, fleet, static, local")
    if "stops" in arms and args.nodes < 5:
        raise SystemExit("the stops arm needs 5 nodes or more (five agent faults on distinct nodes)")
    last_fault_ends = 75 if args.stops_together else 185
    if "stops" in arms and args.stops_duration < last_fault_ends + 15:
        raise SystemExit(f"--stops-duration must be at least {last_fault_ends + 15} s: its last fault ends at "
                         f"{last_fault_ends} s")
    binary = args.tokwatt or next(
        (p for p in (os.path.join(REPO, "target", k, "tokwatt") for k in ("release", "debug")) if os.path.exists(p)),
        None)
    if "faults" in arms and args.nodes < 5:
        raise SystemExit("the faults arm needs 5 nodes or more (five node faults on distinct nodes)")
    if args.lower_to * args.share_w < args.reserve_w:
        raise SystemExit(f"--lower-to {args.lower_to} puts the budget below the reserves: raise it")
    if not binary:
        raise SystemExit("no tokwatt binary: cargo build --release -p tokwatt, or pass --tokwatt")
    if not shutil.which("etcd") and ({"faults", "stops", "fleet"} & set(arms)):
        raise SystemExit("etcd is not installed (apt-get install etcd-server)")
    skipped = []
    why = Network.available()
    if why and "faults" in arms:
        skipped.append(f"network partitions: {why}")
    if args.skew and not os.path.exists(FAKETIME_LIB):
        args.skew = False
        skipped.append("skewed clocks: libfaketime is not installed (apt-get install faketime)")
    if skipped and args.require_all:
        raise SystemExit("cannot run every fault: " + "; ".join(skipped))
    for s in skipped:
        print(f"skipped: {s}", flush=True)
    root = tempfile.mkdtemp(prefix="tokwatt-fleet-")
    out = args.out or root
    os.makedirs(out, exist_ok=True)
    results, failed = {"simulated": True, "nodes": args.nodes, "gpus_per_node": args.gpus, "skipped": skipped}, False
    for name in arms:
        network = Network(str(os.getpid() % 100000)) if name == "faults" and not why else None
        arm = Arm(args, binary, name, root, network)
        started = time.time()
        try:
            if network:
                network.start()
            arm.start()
            print(f"[{name}] {args.nodes} agents serving after {time.time() - started:.0f} s", flush=True)
            if name == "faults":
                result, over = run_faults(arm, args)
                failed |= bool(over)
                results["faults"] = result
                print(json.dumps(result, indent=1), flush=True)
            elif name == "stops":
                result, over = run_stops(arm, args)
                failed |= bool(over)
                results["stops"] = result
                print(json.dumps(result, indent=1), flush=True)
            else:
                over, churn = run_steady(arm, args)
                failed |= bool(over)
                # A coordinator whose rounds fail writes no grant: the caps stay safe, but
                # the fleet is not running (the first 125-node run of issue 40: etcd
                # refused every round's transaction). That is a failed run, said loudly.
                if churn and 2 * churn["round_errors"] > churn["rounds"]:
                    print(f"[{name}] FAILED: the leading coordinator failed {churn['round_errors']:.0f} of its "
                          f"{churn['rounds']:.0f} rounds after the warm-up: see c1.log and c2.log "
                          f"under {arm.root}", flush=True)
                    failed = True
                results[name] = {"seconds_over_budget": over, "churn": churn,
                                 "totals": arm.totals(args.warmup, args.duration)}
        finally:
            arm.stop()
            if network:
                network.stop()
    text = table(results, args)
    if "stops" in results:
        text = stops_table(results["stops"]) + "\n\n" + text
    if "faults" in results:
        text = faults_table(results["faults"]) + "\n\n" + text
    results["table"] = text
    with open(os.path.join(out, "fleet-scale-run.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(text)
    print(f"simulator output; everything in {os.path.join(out, 'fleet-scale-run.json')}, logs in {root}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
