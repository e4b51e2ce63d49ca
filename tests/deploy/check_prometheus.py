#!/usr/bin/env python3
"""Checks deploy/prometheus/: `promtool check config` on prometheus.yml (a static node
list, which must pass as shipped: Debian's Prometheus refused the Kubernetes job it once
held) and on prometheus-kubernetes.yml (the DaemonSet's pods), with their rule files, `promtool check rules` and `promtool test rules` (tokwatt.rules.test.yml:
known counters, exact ratios) on tokwatt.rules.yml, and that every metric and label
the rules use is one tokwatt exports (tests/deploy/metric_names.txt).

Debian's promtool is built without Kubernetes service discovery; there
prometheus-kubernetes.yml's kubernetes_sd_configs blocks are checked here (role, keys, the meta labels relabelled)
and promtool checks the rest of the config with them replaced by a static target.

usage: check_prometheus.py [DIR] [--tokwatt BIN]
"""

import argparse
import subprocess
import tempfile
from pathlib import Path

import deploycheck as dc

KUBERNETES_SD_KEYS = {"role", "namespaces", "selectors", "api_server", "kubeconfig_file", "attach_metadata", "follow_redirects", "enable_http2", "tls_config", "authorization"}
POD_META_PREFIXES = ("__meta_kubernetes_pod_", "__meta_kubernetes_namespace")


def promtool(tool, *arguments):
    result = subprocess.run([tool, *arguments], capture_output=True, text=True, timeout=120)
    return result.returncode, (result.stdout + result.stderr).strip()


def check_kubernetes_sd(report, job):
    where = f"job {job.get('job_name')}"
    for block in job["kubernetes_sd_configs"]:
        unknown = set(block) - KUBERNETES_SD_KEYS
        report.check(not unknown, f"{where}: unknown kubernetes_sd_configs keys {sorted(unknown)}")
        report.check(block.get("role") == "pod", f"{where}: role must be pod (the DaemonSet's pods carry the scrape annotations)")
        names = block.get("namespaces", {}).get("names", [])
        report.check(isinstance(names, list) and all(isinstance(n, str) for n in names), f"{where}: namespaces.names must be a list of names")
    for rule in job.get("relabel_configs", []):
        for label in rule.get("source_labels", []):
            if label.startswith("__meta_"):
                report.check(label.startswith(POD_META_PREFIXES), f"{where}: {label} is not a pod-role meta label")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", nargs="?", default=str(dc.REPO / "deploy/prometheus"))
    dc.common_arguments(parser)
    args = parser.parse_args()
    report = dc.Report("prometheus")
    folder = Path(args.folder)
    config_path, rules_path = folder / "prometheus.yml", folder / "tokwatt.rules.yml"
    kubernetes_path = folder / "prometheus-kubernetes.yml"
    import yaml

    try:
        config = yaml.safe_load(config_path.read_text())
        kubernetes = yaml.safe_load(kubernetes_path.read_text())
        rules = yaml.safe_load(rules_path.read_text())
    except (OSError, yaml.YAMLError) as error:
        report.fail(f"cannot read the Prometheus files: {error}")
        report.finish()

    exported, labels = dc.exported_metrics()
    recorded = {rule["record"] for group in rules.get("groups", []) for rule in group.get("rules", []) if "record" in rule}
    for group in rules.get("groups", []):
        for rule in group.get("rules", []):
            dc.check_promql_names(report, f"{rules_path.name}: {rule.get('record') or rule.get('alert')}", rule.get("expr", ""), exported, labels, recorded)
    report.check(
        any(r.startswith("node") and "tokens_per_joule" in r for r in recorded) and any(r.startswith("policy") and "tokens_per_joule" in r for r in recorded),
        "tokwatt.rules.yml must record tokens per joule per node and per policy",
    )
    jobs = config.get("scrape_configs", [])
    report.check(any("static_configs" in j for j in jobs), "prometheus.yml needs a static job (a node list)")
    report.check(not any("kubernetes_sd_configs" in j for j in jobs), "prometheus.yml must load in every Prometheus build: keep kubernetes_sd_configs in prometheus-kubernetes.yml")
    pod_jobs = kubernetes.get("scrape_configs", [])
    report.check(any("kubernetes_sd_configs" in j for j in pod_jobs), "prometheus-kubernetes.yml needs a kubernetes_sd_configs job (the DaemonSet's pods)")
    for name, loaded in [(config_path.name, config), (kubernetes_path.name, kubernetes)]:
        report.check(str(rules_path.name) in loaded.get("rule_files", []), f"{name} must load {rules_path.name}")

    tool = dc.tool("promtool", report, "the Prometheus config and rules (apt-get install prometheus)")
    if tool is None:
        report.finish()
    code, said = promtool(tool, "check", "config", str(config_path))
    report.check(code == 0, f"promtool check config {config_path}:\n{said}")
    code, said = promtool(tool, "check", "config", str(kubernetes_path))
    if code != 0 and "field kubernetes_sd_configs not found" in said:
        print("note prometheus: this promtool has no Kubernetes service discovery (Debian's build); "
              "checking kubernetes_sd_configs here and the rest with promtool")
        with tempfile.TemporaryDirectory() as scratch:
            for job in pod_jobs:
                if "kubernetes_sd_configs" in job:
                    check_kubernetes_sd(report, job)
                    del job["kubernetes_sd_configs"]
                    job["static_configs"] = [{"targets": ["pod.example:9401"]}]
            kubernetes["rule_files"] = [str((folder / f).resolve()) for f in kubernetes.get("rule_files", [])]
            copy = Path(scratch) / "prometheus-kubernetes.yml"
            copy.write_text(yaml.safe_dump(kubernetes))
            code, said = promtool(tool, "check", "config", str(copy))
    report.check(code == 0, f"promtool check config {kubernetes_path}:\n{said}")
    code, said = promtool(tool, "check", "rules", str(rules_path))
    report.check(code == 0, f"promtool check rules {rules_path}:\n{said}")
    with tempfile.TemporaryDirectory() as scratch:
        test = Path(scratch) / "rules.test.yml"
        test.write_text((dc.HERE / "tokwatt.rules.test.yml").read_text().replace("RULES_FILE", str(rules_path.resolve())))
        code, said = promtool(tool, "test", "rules", str(test))
        report.check(code == 0, f"promtool test rules (tests/deploy/tokwatt.rules.test.yml):\n{said}")
    report.finish()


if __name__ == "__main__":
    main()
