#!/usr/bin/env python3
"""Checks the Kubernetes manifests: every object validated against the Kubernetes
OpenAPI schemas, offline and strictly, by kubernetes-validate; then what the schema
cannot say: the privileged variant has root with CAP_SYS_ADMIN (nothing more) and a
host path for the state file, the observe-only variant has no privilege at all and a
dry-run config; both see every GPU without requesting one, are probed and scraped on
the metrics port, and carry a serve.toml that parses and uses only keys of
deploy/serve.toml.

usage: check_kubernetes.py FILE --variant privileged|observe-only [--tokwatt BIN] [--pending SUB]
"""

import argparse
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("manifest")
    parser.add_argument("--variant", choices=["privileged", "observe-only"], required=True)
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
    known = key_paths(tomllib.loads(Path(args.example).read_text()))
    unknown = sorted(key_paths(config) - known)
    report.check(not unknown, f"the ConfigMap's serve.toml has keys deploy/serve.toml does not know: {unknown}")
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
    if args.variant == "privileged":
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
    for init in pod.get("initContainers", []):
        init_context = init.get("securityContext", {})
        report.check(
            init_context.get("runAsNonRoot") is True and "ALL" in init_context.get("capabilities", {}).get("drop", []),
            f"init container {init.get('name')} needs no privilege: runAsNonRoot and drop ALL",
        )
    report.finish()


if __name__ == "__main__":
    main()
