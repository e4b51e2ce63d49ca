#!/usr/bin/env python3
"""Checks the Kubernetes manifests: every object validated against the Kubernetes
OpenAPI schemas, offline and strictly, by kubernetes-validate; then what the schema
cannot say, by variant:

- privileged, observe-only, fleet (the agent's DaemonSets): the privileged variant has
  root with CAP_SYS_ADMIN (nothing more) and a host path for the state file, the
  observe-only variant has no privilege at all and a dry-run config; all see every GPU
  without requesting one, are probed and scraped on the metrics port, and carry a
  serve.toml that parses and uses only keys deploy/serve.toml documents (commented out
  or not); the fleet variant is the privileged one in a power domain, fenced: a `fence`
  container running `tokwatt fence` on the heartbeat and status the config names, in an
  emptyDir both containers mount at one path, with the config's reserve, and an init
  container applying that reserve (`tokwatt fence --once`) before the agent starts;
- coordinator (fleet-coordinator.yaml): a Deployment of two or more replicas kept on
  different nodes, with no privilege, running `tokwatt fleet coordinate` with its etcd
  TLS files from a Secret (and, given --etcd-manifest, etcd's own client URLs);
- etcd (etcd-statefulset.yaml): an odd StatefulSet of three or more members on
  different nodes behind a headless Service, whose --initial-cluster names every member
  at the address the Service gives it, TLS on when certificates are given, no privilege.

usage: check_kubernetes.py FILE --variant privileged|observe-only|fleet|coordinator|etcd
       [--etcd-manifest FILE] [--tokwatt BIN] [--pending SUB]
"""

import argparse
import re
import tomllib
from pathlib import Path

import deploycheck as dc

KUBERNETES_VERSIONS = ["1.29.0", None]  # None: kubernetes-validate's newest


def key_paths(table, prefix=""):
    """Every key of a TOML document as a dotted path; arrays of tables by their keys."""
    paths = set()
    for key, value in table.items():
        path = f"{prefix}{key}"
        paths.add(path)
        if isinstance(value, dict):
            paths |= key_paths(value, path + ".")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for entry in value:
                paths |= key_paths(entry, path + ".")
    return paths


def documented_keys(text):
    """Every key deploy/serve.toml documents: its own, and those of its commented-out
    tables (`# [fleet]` then `# key = …` lines), which an operator uncomments."""
    keys = key_paths(tomllib.loads(text))
    table = None
    for line in text.splitlines():
        header = re.match(r"^#\s*\[([a-z_.]+)\]\s*$", line)
        if header:
            table = header.group(1)
            parts = table.split(".")
            keys |= {".".join(parts[: i + 1]) for i in range(len(parts))}
            continue
        if re.match(r"^\[", line):
            table = None
            continue
        key = re.match(r"^#\s*([a-z_]+)\s*=", line)
        if key and table:
            keys.add(f"{table}.{key.group(1)}")
    return keys


def fence_invocation(container):
    """The argv after `tokwatt` where the container runs `tokwatt fence`, else None."""
    argv = container.get("command", [])[1:] + container.get("args", []) if container.get("command") else container.get("args", [])
    return argv if argv[:1] == ["fence"] else None


def flag_value(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def privileged_for_nvml(report, what, container):
    """Root with CAP_SYS_ADMIN and nothing more (NVML's setters), the GPUs in view."""
    context = container.get("securityContext", {})
    capabilities = context.get("capabilities", {})
    report.check(not context.get("privileged"), f"{what}: privileged: true is more than NVML needs")
    report.check("ALL" in capabilities.get("drop", []), f"{what}: capabilities must drop ALL")
    report.check(
        set(capabilities.get("add", [])) == {"SYS_ADMIN"},
        f"{what}: capabilities.add must be exactly [SYS_ADMIN] (NVML's power-limit setter)",
    )
    report.check(context.get("runAsUser") == 0, f"{what}: runAsUser: 0 (NVML's setters want root)")
    report.check(context.get("readOnlyRootFilesystem") is True, f"{what}: readOnlyRootFilesystem: true")
    environment = {e["name"]: e.get("value") for e in container.get("env", [])}
    report.check(
        environment.get("NVIDIA_VISIBLE_DEVICES") == "all",
        f"{what}: env NVIDIA_VISIBLE_DEVICES=all: it must see every GPU the agent manages",
    )


def check_fence(report, pod, agent, config, args):
    """The fleet variant: the fence container and the reserve's init container."""
    fleet = config.get("fleet", {})
    fence = fleet.get("fence", {})
    reserve = fleet.get("reserve_w")
    if not report.check(
        fence.get("kind") == "heartbeat",
        "the fleet variant's config must set [fleet.fence] kind = \"heartbeat\" (the fence container watches it)",
    ):
        return

    def same_reserve(what, argv):
        given = flag_value(argv, "--reserve")
        try:
            equal = given is not None and float(given) == float(reserve)
        except (TypeError, ValueError):
            equal = False
        report.check(
            equal,
            f"{what}: --reserve {given} must be the config's fleet.reserve_w ({reserve})",
        )

    fences = [c for c in pod.get("containers", []) if c.get("name") == "fence"]
    if not report.check(len(fences) == 1, "the fleet variant needs one container named fence"):
        return
    container = fences[0]
    argv = fence_invocation(container)
    if not report.check(argv is not None, "container fence must run `tokwatt fence`"):
        return
    dc.check_tokwatt_command(report, "container fence", argv, args.tokwatt, args.pending)
    report.check("--once" not in argv, "container fence must keep running (no --once)")
    report.check(flag_value(argv, "--stall") is not None, "container fence must give --stall")
    same_reserve("container fence", argv)
    for flag, key in (("--heartbeat", "heartbeat"), ("--status", "status")):
        report.check(
            flag_value(argv, flag) == fence.get(key),
            f"container fence: {flag} {flag_value(argv, flag)} must be the config's fleet.fence.{key} ({fence.get(key)})",
        )
    privileged_for_nvml(report, "container fence", container)
    # The two files on one emptyDir, mounted at the same path in both containers.
    empty_dirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    for key in ("heartbeat", "status"):
        path = fence.get(key, "")
        shared = [
            m["mountPath"]
            for m in agent.get("volumeMounts", [])
            if m["name"] in empty_dirs
            and path.startswith(m["mountPath"].rstrip("/") + "/")
            and any(
                f["name"] == m["name"] and f["mountPath"] == m["mountPath"]
                for f in container.get("volumeMounts", [])
            )
        ]
        report.check(
            bool(shared),
            f"fleet.fence.{key} {path} must be on an emptyDir the agent and the fence container both mount at one path",
        )
    onces = [
        c for c in pod.get("initContainers", [])
        if (fence_invocation(c) or [])[:1] == ["fence"] and "--once" in fence_invocation(c)
    ]
    if report.check(
        len(onces) == 1,
        "the fleet variant needs an init container running `tokwatt fence --once`: the reserve before the agent starts",
    ):
        dc.check_tokwatt_command(report, f"init container {onces[0].get('name')}", fence_invocation(onces[0]), args.tokwatt, args.pending)
        same_reserve(f"init container {onces[0].get('name')}", fence_invocation(onces[0]))
        privileged_for_nvml(report, f"init container {onces[0].get('name')}", onces[0])


def check_daemonset(report, manifest, documents, args):
    daemonsets = [d for d in documents if isinstance(d, dict) and d.get("kind") == "DaemonSet"]
    config_maps = {d["metadata"]["name"]: d for d in documents if isinstance(d, dict) and d.get("kind") == "ConfigMap"}
    if not report.check(len(daemonsets) == 1, f"{manifest}: expected one DaemonSet, found {len(daemonsets)}"):
        report.finish()
    daemonset = daemonsets[0]
    spec = daemonset.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    template_labels = spec.get("template", {}).get("metadata", {}).get("labels", {})
    selector = spec.get("selector", {}).get("matchLabels", {})
    report.check(
        selector and all(template_labels.get(k) == v for k, v in selector.items()),
        "the DaemonSet's selector must match its pod template's labels",
    )
    containers = pod.get("containers", [])
    agents = [c for c in containers if c.get("name") == "tokwatt"]
    if not report.check(len(agents) == 1, "expected one container named tokwatt"):
        report.finish()
    agent = agents[0]

    # Every GPU of the node, none taken from the workloads.
    report.check(pod.get("runtimeClassName") == "nvidia", "runtimeClassName: nvidia (the NVIDIA runtime injects NVML and the GPUs)")
    environment = {e["name"]: e.get("value") for e in agent.get("env", [])}
    report.check(environment.get("NVIDIA_VISIBLE_DEVICES") == "all", "env NVIDIA_VISIBLE_DEVICES=all: the agent sees every GPU")
    for container in containers + pod.get("initContainers", []):
        for kind in ("requests", "limits"):
            report.check(
                "nvidia.com/gpu" not in container.get("resources", {}).get(kind, {}),
                f"container {container.get('name')}: must not request nvidia.com/gpu (it would take GPUs from the serving workloads)",
            )
    report.check(
        pod.get("nodeSelector") or pod.get("affinity", {}).get("nodeAffinity"),
        "a nodeSelector (or node affinity) must keep the DaemonSet on GPU nodes",
    )
    report.check(not pod.get("hostPID"), "hostPID is not needed: the agent reads only its own /proc entry")

    # Its config: parses, known keys, the right mode.
    config_volume_names = {v["name"]: v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v}
    config_text = None
    for name in config_volume_names.values():
        if report.check(name in config_maps, f"ConfigMap {name} is mounted but not in {manifest.name}"):
            config_text = config_maps[name].get("data", {}).get("serve.toml")
    if not report.check(config_text is not None, "a ConfigMap with serve.toml must be mounted"):
        report.finish()
    try:
        config = tomllib.loads(config_text)
    except tomllib.TOMLDecodeError as error:
        report.fail(f"the ConfigMap's serve.toml does not parse: {error}")
        report.finish()
    known = documented_keys(Path(args.example).read_text())
    unknown = sorted(key_paths(config) - known)
    report.check(not unknown, f"the ConfigMap's serve.toml has keys deploy/serve.toml does not know: {unknown}")
    report.check(
        (args.variant == "fleet") == ("fleet" in config),
        "the fleet variant, and only it, carries a [fleet] table"
        if args.variant == "fleet"
        else "a [fleet] table belongs in daemonset-fleet.yaml, with the fence container that covers the node",
    )
    dry_run = config.get("node", {}).get("dry_run")

    # Probes and scraping on the metrics port.
    listen_port = int(config.get("metrics", {}).get("listen", ":0").rsplit(":", 1)[-1])
    ports = {p.get("name"): p.get("containerPort") for p in agent.get("ports", [])}
    report.check(ports.get("metrics") == listen_port, f"a container port named metrics must be {listen_port} ([metrics] listen)")
    for probe in ("readinessProbe", "livenessProbe"):
        http = agent.get(probe, {}).get("httpGet", {})
        report.check(
            http.get("path") == "/metrics" and http.get("port") in ("metrics", listen_port),
            f"{probe} must GET /metrics on the metrics port",
        )
    annotations = spec.get("template", {}).get("metadata", {}).get("annotations", {})
    report.check(annotations.get("prometheus.io/scrape") == "true", "pod annotation prometheus.io/scrape: \"true\"")
    report.check(annotations.get("prometheus.io/port") == str(listen_port), f"pod annotation prometheus.io/port: \"{listen_port}\"")

    # The command line.
    argv = agent.get("command", [])[1:] + agent.get("args", []) if agent.get("command") else agent.get("args", [])
    dc.check_tokwatt_command(report, "container args", argv, args.tokwatt, args.pending)
    if "--config" in argv:
        config_path = argv[argv.index("--config") + 1]
        mounts = [m["mountPath"] for m in agent.get("volumeMounts", [])]
        report.check(
            any(config_path.startswith(m.rstrip("/") + "/") for m in mounts),
            f"--config {config_path} is on no mounted volume",
        )

    # Privileges.
    context = agent.get("securityContext", {})
    capabilities = context.get("capabilities", {})
    added = set(capabilities.get("add", []))
    host_paths = [v for v in pod.get("volumes", []) if "hostPath" in v]
    report.check(not context.get("privileged"), "privileged: true is more than NVML needs (CAP_SYS_ADMIN is enough)")
    report.check("ALL" in capabilities.get("drop", []), "capabilities must drop ALL (then add only what is needed)")
    report.check(context.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem: true")
    if args.variant in ("privileged", "fleet"):
        report.check(dry_run is False, "the privileged variant's config must set dry_run = false (else it needs no privileges)")
        report.check(added == {"SYS_ADMIN"}, f"capabilities.add must be exactly [SYS_ADMIN] (NVML's setters), not {sorted(added)}")
        report.check(context.get("runAsUser") == 0, "runAsUser: 0: NVML's setters want root with CAP_SYS_ADMIN")
        report.check(
            context.get("allowPrivilegeEscalation") is not False,
            "allowPrivilegeEscalation: false with CAP_SYS_ADMIN is refused by the API server",
        )
        state_file = config.get("state", {}).get("file", "")
        state_mounts = [
            m["mountPath"] for m in agent.get("volumeMounts", [])
            if m["name"] in {v["name"] for v in host_paths}
        ]
        report.check(
            any(state_file.startswith(m.rstrip("/") + "/") for m in state_mounts),
            f"the state file {state_file} must be on a hostPath volume, so a crashed pod's successor restores the GPUs",
        )
        report.check(pod.get("terminationGracePeriodSeconds", 30) >= 30, "terminationGracePeriodSeconds >= 30: time to restore the GPUs on SIGTERM")
    else:
        report.check(dry_run is True, "the observe-only variant's config must set dry_run = true")
        report.check(not added, f"the observe-only variant adds no capability (found {sorted(added)})")
        report.check(context.get("runAsNonRoot") is True, "runAsNonRoot: true")
        report.check(context.get("runAsUser", 0) != 0, "runAsUser must not be 0")
        report.check(context.get("allowPrivilegeEscalation") is False, "allowPrivilegeEscalation: false")
        report.check(not host_paths, f"no hostPath volumes in the observe-only variant (found {[v['name'] for v in host_paths]})")
        report.check(not pod.get("hostNetwork") and not pod.get("hostIPC"), "no hostNetwork or hostIPC")
    if args.variant == "fleet":
        check_fence(report, pod, agent, config, args)
    for init in pod.get("initContainers", []):
        if (fence_invocation(init) or [])[:1] == ["fence"]:
            continue  # the reserve's, checked above: NVML's setter needs SYS_ADMIN
        init_context = init.get("securityContext", {})
        report.check(
            init_context.get("runAsNonRoot") is True and "ALL" in init_context.get("capabilities", {}).get("drop", []),
            f"init container {init.get('name')} needs no privilege: runAsNonRoot and drop ALL",
        )


def one_kind(report, manifest, documents, kind):
    """The one object of `kind` in the manifest; None (with a failure) otherwise."""
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") == kind]
    if report.check(len(found) == 1, f"{manifest}: expected one {kind}, found {len(found)}"):
        return found[0]
    return None


def spread_across_nodes(report, what, pod, labels):
    """Required pod anti-affinity on the node's host name, selecting the pod's own labels:
    no two replicas on one node."""
    terms = (
        pod.get("affinity", {})
        .get("podAntiAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", [])
    )
    report.check(
        any(
            term.get("topologyKey") == "kubernetes.io/hostname"
            and term.get("labelSelector", {}).get("matchLabels")
            and all(
                labels.get(k) == v
                for k, v in term["labelSelector"]["matchLabels"].items()
            )
            for term in terms
        ),
        f"{what}: required podAntiAffinity on kubernetes.io/hostname selecting its own pods: "
        f"no two replicas on one node",
    )


def no_privilege(report, what, pod, container):
    """Non-root, nothing to escalate to, every capability dropped and none added, a
    read-only root, and nothing of the host's."""
    context = container.get("securityContext", {})
    pod_context = pod.get("securityContext", {})
    run_as_user = context.get("runAsUser", pod_context.get("runAsUser"))
    report.check(
        context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True,
        f"{what}: runAsNonRoot: true",
    )
    report.check(run_as_user not in (None, 0), f"{what}: runAsUser must be set, and not 0")
    report.check(not context.get("privileged"), f"{what}: must not be privileged")
    report.check(context.get("allowPrivilegeEscalation") is False, f"{what}: allowPrivilegeEscalation: false")
    report.check(context.get("readOnlyRootFilesystem") is True, f"{what}: readOnlyRootFilesystem: true")
    capabilities = context.get("capabilities", {})
    report.check("ALL" in capabilities.get("drop", []), f"{what}: capabilities must drop ALL")
    report.check(
        not capabilities.get("add"),
        f"{what}: adds no capability (found {sorted(capabilities.get('add', []))})",
    )
    host_paths = [v["name"] for v in pod.get("volumes", []) if "hostPath" in v]
    report.check(not host_paths, f"{what}: no hostPath volumes (found {host_paths})")
    report.check(
        not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC")),
        f"{what}: no hostNetwork, hostPID or hostIPC",
    )


def pod_labels_selected(report, what, spec):
    labels = spec.get("template", {}).get("metadata", {}).get("labels", {})
    selector = spec.get("selector", {}).get("matchLabels", {})
    report.check(
        selector and all(labels.get(k) == v for k, v in selector.items()),
        f"{what}: the selector must match its pod template's labels",
    )
    return labels


def arg_values(args, flag):
    """Values of `--flag=VALUE` (etcd's style) in a container's args."""
    return [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]


def etcd_client_urls(report, manifest, documents):
    """The client URL of every member of the etcd StatefulSet in `documents`, as it
    advertises them ($(POD_NAME) filled in); None where there is no one StatefulSet."""
    statefulset = one_kind(report, manifest, documents, "StatefulSet")
    if statefulset is None:
        return None
    containers = statefulset["spec"]["template"]["spec"].get("containers", [])
    args = containers[0].get("args", []) if containers else []
    advertised = arg_values(args, "--advertise-client-urls")
    if not report.check(len(advertised) == 1, f"{manifest}: etcd must set --advertise-client-urls once"):
        return None
    name = statefulset["metadata"]["name"]
    return [
        advertised[0].replace("$(POD_NAME)", f"{name}-{i}")
        for i in range(statefulset["spec"].get("replicas", 1))
    ]


def check_coordinator(report, manifest, documents, args):
    deployment = one_kind(report, manifest, documents, "Deployment")
    if deployment is None:
        return
    spec = deployment.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    labels = pod_labels_selected(report, "the Deployment", spec)
    report.check(
        spec.get("replicas", 1) >= 2,
        f"the Deployment must run 2 or more replicas (found {spec.get('replicas', 1)}): one leads, another takes over",
    )
    spread_across_nodes(report, "the Deployment", pod, labels)
    report.check(
        pod.get("automountServiceAccountToken") is False,
        "automountServiceAccountToken: false: the coordinator never talks to the Kubernetes API",
    )
    report.check(not pod.get("runtimeClassName"), "no runtimeClassName: the coordinator uses no GPU")
    containers = pod.get("containers", [])
    if not report.check(len(containers) == 1, "expected one container, the coordinator"):
        return
    container = containers[0]
    no_privilege(report, f"container {container.get('name')}", pod, container)
    for kind in ("requests", "limits"):
        report.check(
            "nvidia.com/gpu" not in container.get("resources", {}).get(kind, {}),
            "the coordinator must not request nvidia.com/gpu",
        )

    # Its command line, and its TLS files from a Secret mounted read-only.
    argv = container.get("args", [])
    report.check(
        not container.get("command"),
        "no command: the image's entrypoint is tokwatt, the args are its subcommand",
    )
    path = dc.check_tokwatt_command(report, "container args", argv, args.tokwatt, args.pending)
    if path is not None:
        report.check(path == dc.COORDINATOR, f"the container must run `tokwatt fleet coordinate`, not `tokwatt {' '.join(path)}`")
    secrets = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
    secret_mounts = [
        m["mountPath"].rstrip("/") + "/"
        for m in container.get("volumeMounts", [])
        if m.get("name") in secrets and m.get("readOnly") is True
    ]

    def tls_file(value):
        if any(value.startswith(mount) for mount in secret_mounts):
            return None
        return f"not on a Secret volume mounted read-only (mounted: {secret_mounts})"

    dc.check_coordinator_command(report, "container args", argv, tls_file)
    if args.etcd_manifest:
        import yaml  # there: main checked it

        etcd_manifest = Path(args.etcd_manifest)
        etcd_documents = [d for d in yaml.safe_load_all(etcd_manifest.read_text()) if d is not None]
        expected = etcd_client_urls(report, etcd_manifest.name, etcd_documents)
        if expected is not None:
            given = dc.flag_values(argv, "--etcd")
            report.check(
                sorted(given) == sorted(expected),
                f"--etcd must name every member of {etcd_manifest.name}: {expected} (found {given})",
            )


def check_etcd(report, manifest, documents):
    statefulset = one_kind(report, manifest, documents, "StatefulSet")
    if statefulset is None:
        return
    spec = statefulset.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    name = statefulset["metadata"]["name"]
    namespace = statefulset["metadata"].get("namespace", "default")
    labels = pod_labels_selected(report, "the StatefulSet", spec)
    replicas = spec.get("replicas", 1)
    report.check(
        replicas >= 3 and replicas % 2 == 1,
        f"etcd needs an odd number of members, 3 or more (found {replicas}): a quorum survives one lost",
    )
    spread_across_nodes(report, "the StatefulSet", pod, labels)
    report.check(
        spec.get("podManagementPolicy") == "Parallel",
        "podManagementPolicy: Parallel: no member is ready before a quorum has met, so they must start together",
    )

    # The headless Service that gives each member its name.
    services = {
        d["metadata"]["name"]: d
        for d in documents
        if isinstance(d, dict) and d.get("kind") == "Service"
    }
    service = services.get(spec.get("serviceName"))
    if report.check(service is not None, f"serviceName {spec.get('serviceName')!r} is not a Service in {manifest.name}"):
        service_spec = service.get("spec", {})
        report.check(service_spec.get("clusterIP") == "None", "the member Service must be headless (clusterIP: None)")
        report.check(
            service_spec.get("publishNotReadyAddresses") is True,
            "publishNotReadyAddresses: true: members must find each other before they are ready",
        )
        selector = service_spec.get("selector", {})
        report.check(
            selector and all(labels.get(k) == v for k, v in selector.items()),
            "the Service's selector must match the members' labels",
        )
        ports = {p.get("port") for p in service_spec.get("ports", [])}
        report.check({2379, 2380} <= ports, f"the Service must carry ports 2379 and 2380 (found {sorted(ports)})")

    containers = pod.get("containers", [])
    if not report.check(len(containers) == 1, "expected one container, etcd"):
        return
    container = containers[0]
    no_privilege(report, f"container {container.get('name')}", pod, container)
    args = container.get("args", [])
    environment = {e["name"]: e for e in container.get("env", [])}
    report.check(
        arg_values(args, "--name") == ["$(POD_NAME)"]
        and environment.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
        "--name=$(POD_NAME), with POD_NAME from metadata.name: each member is named as its pod",
    )

    # --initial-cluster: every member by its pod's name, at the address the Service gives it.
    tls = bool(arg_values(args, "--cert-file"))
    scheme = "https" if tls else "http"
    peer_scheme = "https" if arg_values(args, "--peer-cert-file") else "http"
    service_name = spec.get("serviceName")
    expected = ",".join(
        f"{name}-{i}={peer_scheme}://{name}-{i}.{service_name}.{namespace}.svc:2380"
        for i in range(replicas)
    )
    given = arg_values(args, "--initial-cluster")
    report.check(
        given == [expected],
        f"--initial-cluster must list the {replicas} members as the headless Service names them: {expected} (found {given})",
    )
    for flag, port, url_scheme in (
        ("--listen-client-urls", 2379, scheme),
        ("--advertise-client-urls", 2379, scheme),
        ("--listen-peer-urls", 2380, peer_scheme),
        ("--initial-advertise-peer-urls", 2380, peer_scheme),
    ):
        urls = arg_values(args, flag)
        report.check(
            len(urls) == 1 and urls[0].startswith(f"{url_scheme}://") and urls[0].endswith(f":{port}"),
            f"{flag} must be one {url_scheme}:// URL on port {port} (found {urls})",
        )
    advertised = arg_values(args, "--advertise-client-urls")
    report.check(
        advertised == [f"{scheme}://$(POD_NAME).{service_name}.{namespace}.svc:2379"],
        f"--advertise-client-urls must be the member's name under the Service: "
        f"{scheme}://$(POD_NAME).{service_name}.{namespace}.svc:2379 (found {advertised})",
    )
    if tls:
        report.check(
            "--client-cert-auth" in args and arg_values(args, "--trusted-ca-file"),
            "with TLS, --client-cert-auth and --trusted-ca-file: only clients with a certificate from the CA",
        )

    # The data on the claim, the certificates from a Secret.
    claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    data_dirs = arg_values(args, "--data-dir")
    data_mounts = [
        m["mountPath"].rstrip("/") + "/"
        for m in container.get("volumeMounts", [])
        if m.get("name") in claims
    ]
    report.check(
        len(data_dirs) == 1 and any((data_dirs[0] + "/").startswith(m) for m in data_mounts),
        f"--data-dir {data_dirs} must be on a volumeClaimTemplates volume (mounted: {data_mounts}): the data outlives the pod",
    )
    secrets = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
    secret_mounts = [
        m["mountPath"].rstrip("/") + "/"
        for m in container.get("volumeMounts", [])
        if m.get("name") in secrets
    ]
    for flag in ("--cert-file", "--key-file", "--trusted-ca-file", "--peer-cert-file", "--peer-key-file", "--peer-trusted-ca-file"):
        for value in arg_values(args, flag):
            report.check(
                any(value.startswith(m) for m in secret_mounts),
                f"{flag}={value} is on no Secret volume (mounted: {secret_mounts})",
            )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("manifest")
    parser.add_argument(
        "--variant", choices=["privileged", "observe-only", "fleet", "coordinator", "etcd"], required=True
    )
    parser.add_argument(
        "--etcd-manifest", help="the etcd StatefulSet the coordinator's --etcd must name"
    )
    parser.add_argument("--example", default=str(dc.REPO / "deploy/serve.toml"))
    dc.common_arguments(parser)
    args = parser.parse_args()
    report = dc.Report(f"kubernetes {args.variant}")
    manifest = Path(args.manifest)
    try:
        import yaml
    except ImportError:
        report.skip("PyYAML is not installed (pip install pyyaml): manifests not checked")
        report.finish()
    try:
        documents = [d for d in yaml.safe_load_all(manifest.read_text()) if d is not None]
    except yaml.YAMLError as error:
        report.fail(f"{manifest}: not YAML: {error}")
        report.finish()

    try:
        import kubernetes_validate
    except ImportError:
        kubernetes_validate = None
        report.skip(
            "kubernetes-validate is not installed (pip install kubernetes-validate): "
            "the manifests were not checked against the Kubernetes schemas"
        )
    for document in documents:
        if not report.check(isinstance(document, dict) and "kind" in document, f"{manifest}: a document without kind"):
            continue
        what = f"{manifest.name}: {document['kind']}/{document.get('metadata', {}).get('name')}"
        if kubernetes_validate is None:
            continue
        for version in KUBERNETES_VERSIONS:
            version = version or kubernetes_validate.latest_version()
            try:
                kubernetes_validate.validate(document, version, strict=True)
                report.passed += 1
            except kubernetes_validate.ValidationError as error:
                location = ".".join(str(p) for p in error.path)
                report.fail(f"{what}: invalid for Kubernetes {version} at {location}: {error.message}")
            except Exception as error:  # schema not found, bad apiVersion
                report.fail(f"{what}: cannot be validated for Kubernetes {version}: {error}")

    if args.variant in ("privileged", "observe-only", "fleet"):
        check_daemonset(report, manifest, documents, args)
    elif args.variant == "coordinator":
        check_coordinator(report, manifest, documents, args)
    else:
        check_etcd(report, manifest, documents)
    report.finish()


if __name__ == "__main__":
    main()
