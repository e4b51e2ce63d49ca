#!/usr/bin/env python3
"""Checks deploy/grafana/tokwatt-dashboard.json: it parses; panels have unique ids, sit
on the 24-column grid without overlapping, and query the dashboard's Prometheus
datasource; the panels the operators need are there; every PromQL expression (panels,
variables, annotations), with Grafana's variables filled in, parses (`promtool check
rules` on a rules file made of them) and names only metrics tokwatt exports or the
recording rules of deploy/prometheus/tokwatt.rules.yml.

usage: check_grafana.py [DASHBOARD]
"""

import argparse
import json
import re
import tempfile
from pathlib import Path

import deploycheck as dc

# Every family an operator looks at must be on some panel.
REQUIRED_METRICS = [
    "tokwatt_gpu_tokens_total", "tokwatt_gpu_energy_joules_total", "tokwatt_gpu_power_watts",
    "tokwatt_gpu_power_cap_requested_watts", "tokwatt_gpu_power_cap_enforced_watts",
    "tokwatt_gpu_sm_clock_hertz", "tokwatt_gpu_sm_clock_max_requested_hertz", "tokwatt_gpu_batch_size",
    "tokwatt_gpu_tpot_p99_seconds", "tokwatt_policy_decide_duration_seconds_bucket",
    "tokwatt_tick_lateness_seconds_bucket", "tokwatt_policy_traps_total", "tokwatt_policy_fallback_ticks_total",
    "tokwatt_policy_swaps_total", "tokwatt_policy_rollbacks_total", "tokwatt_gpu_clock_event_active",
    "tokwatt_paused", "tokwatt_policy_info", "tokwatt_gpu_slo_violation_ticks_total",
]


def fill_variables(expr):
    """Grafana's variables replaced by values PromQL accepts: durations and regexes."""
    expr = re.sub(r"\$(__rate_interval|__interval|__range)\b|\$\{(__rate_interval|__interval|__range)\}", "5m", expr)
    return re.sub(r"\$\{?\w+\}?", ".+", expr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dashboard", nargs="?", default=str(dc.REPO / "deploy/grafana/tokwatt-dashboard.json"))
    dc.common_arguments(parser)
    args = parser.parse_args()
    report = dc.Report("grafana")
    path = Path(args.dashboard)
    try:
        dashboard = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        report.fail(f"{path}: not JSON: {error}")
        report.finish()
    import yaml

    rules = yaml.safe_load((dc.REPO / "deploy/prometheus/tokwatt.rules.yml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    exported, labels = dc.exported_metrics()

    for key in ("title", "uid", "panels", "templating", "schemaVersion"):
        report.check(key in dashboard, f"{path.name}: no {key!r}")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    report.check(variables.get("datasource", {}).get("type") == "datasource", "a datasource variable named datasource (Prometheus), so the dashboard imports anywhere")

    expressions = []  # (where, expr)
    panels = dashboard.get("panels", [])
    flat = []
    for panel in panels:
        flat.append(panel)
        flat.extend(panel.get("panels", []))
    ids = [p.get("id") for p in flat]
    report.check(len(ids) == len(set(ids)) and None not in ids, f"panel ids must be unique and set: {ids}")
    cells = {}
    for panel in flat:
        where = f"panel {panel.get('id')} {panel.get('title')!r}"
        grid = panel.get("gridPos", {})
        if not report.check(all(isinstance(grid.get(k), int) for k in "hwxy"), f"{where}: gridPos needs integers h, w, x, y"):
            continue
        report.check(grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, f"{where}: wider than the 24-column grid")
        for row in range(grid["y"], grid["y"] + grid["h"]):
            for column in range(grid["x"], grid["x"] + grid["w"]):
                other = cells.setdefault((row, column), where)
                if other != where:
                    report.fail(f"{where} overlaps {other}")
                    break
            else:
                continue
            break
        if panel.get("type") == "row":
            continue
        report.check(panel.get("title"), f"{where}: no title")
        report.check(panel.get("datasource", {}).get("uid") == "${datasource}", f"{where}: query the ${{datasource}} variable")
        targets = panel.get("targets", [])
        report.check(targets, f"{where}: no queries")
        ref_ids = [t.get("refId") for t in targets]
        report.check(len(ref_ids) == len(set(ref_ids)), f"{where}: duplicate refIds {ref_ids}")
        for target in targets:
            if report.check(target.get("expr"), f"{where}: a query without expr"):
                expressions.append((f"{where} {target.get('refId')}", target["expr"]))
    for name, variable in variables.items():
        query = variable.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)", query or "")
        if variable.get("type") == "query" and report.check(match, f"variable {name}: expected label_values(metric, label), got {query!r}"):
            expressions.append((f"variable {name}", match.group(1)))
            report.check(match.group(2) in labels, f"variable {name}: label {match.group(2)!r} is set by no tokwatt metric")
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            expressions.append((f"annotation {annotation.get('name')!r}", annotation["expr"]))

    used = set()
    for where, expr in expressions:
        filled = fill_variables(expr)
        dc.check_promql_names(report, where, filled, exported, labels, recorded)
        used |= dc.promql_names(filled)[0]
    missing = [m for m in REQUIRED_METRICS if m not in used]
    report.check(not missing, f"no panel shows {missing}")
    # The energy itself, not only ratios and power: what the GPUs used over the time range.
    energy = [where for where, expr in expressions
              if re.search(r"increase\(\s*tokwatt_gpu_energy_joules_total\b[^)]*\[\$\{?__range\}?\]", expr)]
    report.check(energy, "no panel shows the energy used over the time range (increase(tokwatt_gpu_energy_joules_total[$__range]))")

    tool = dc.tool("promtool", report, "the dashboard's PromQL (apt-get install prometheus)")
    if tool:
        as_rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:expression_{n}", "expr": fill_variables(expr)} for n, (_, expr) in enumerate(expressions)]}]}
        with tempfile.TemporaryDirectory() as scratch:
            dc.promtool_check_rules(report, tool, yaml.safe_dump(as_rules), "the dashboard's expressions", scratch)
    report.finish()


if __name__ == "__main__":
    main()
