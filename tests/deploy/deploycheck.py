"""Shared by the deployment checkers (tests/deploy/check_*.py): how a check reports,
the metric names the agent exports, PromQL names, and tokwatt command lines checked
against the built binary's own --help.

Exit codes of every checker: 0 all checks passed; 1 a check failed (each failure is
printed with the file and the fix); 77 every check that could run passed but a tool was
missing, so some were skipped (the reason is printed). The Rust test
(tests/all/deploy.rs) turns 77 into a failure when TOKWATT_REQUIRE_DEPLOY_TOOLS=1.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

SKIPPED = 77
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


class Report:
    """Collects failures and skips; `finish` prints them and exits with the code."""

    def __init__(self, name):
        self.name = name
        self.failures = []
        self.skips = []
        self.passed = 0

    def check(self, condition, message):
        if condition:
            self.passed += 1
        else:
            self.failures.append(message)
        return condition

    def fail(self, message):
        self.failures.append(message)

    def skip(self, message):
        self.skips.append(message)

    def finish(self):
        for message in self.failures:
            print(f"FAIL {self.name}: {message}")
        for message in self.skips:
            print(f"SKIP {self.name}: {message}")
        print(
            f"{self.name}: {self.passed} checks passed, {len(self.failures)} failed, "
            f"{len(self.skips)} skipped"
        )
        if self.failures:
            sys.exit(1)
        sys.exit(SKIPPED if self.skips else 0)


def tool(name, report, why):
    """The path of a command-line tool, or None with a skip recorded."""
    path = shutil.which(name)
    if path is None:
        report.skip(f"{name} is not installed, so {why} was not checked")
    return path


# ---- metric names ---------------------------------------------------------------------

METRIC_NAMES_FILE = HERE / "metric_names.txt"
# Labels Prometheus adds to every series (target labels; `le` of histogram buckets).
TARGET_LABELS = {"instance", "job", "le", "node", "namespace", "pod"}


def exported_metrics(path=METRIC_NAMES_FILE):
    """{sample name: family name} and the set of label names, from metric_names.txt."""
    samples = {}
    labels = set(TARGET_LABELS)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 3:
            raise ValueError(f"{path}:{number}: expected 'name type labels', got {line!r}")
        name, kind, label_list = parts
        if kind == "counter":
            if not name.endswith("_total"):
                raise ValueError(f"{path}:{number}: counter {name} must end in _total")
            samples[name] = name
        elif kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                samples[name + suffix] = name
        elif kind == "gauge":
            samples[name] = name
        else:
            raise ValueError(f"{path}:{number}: unknown type {kind!r}")
        if label_list != "-":
            labels.update(label_list.split(","))
    return samples, labels


# ---- PromQL ---------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*$")
_RANGE = re.compile(r"\[[^\]]*\]")


def promql_names(expr):
    """(metric-like names, label names) an expression uses. Names are every identifier
    outside strings, grouping clauses, ranges and label matchers that starts with
    `tokwatt_` or holds a colon (a recording rule); label names come from grouping
    clauses and matchers."""
    labels = set()
    for grouping in _GROUPING.findall(_STRING.sub('""', expr)):
        labels.update(label.strip() for label in grouping.split(",") if label.strip())
    # Label matchers: the identifier right before each operator, inside {...}.
    for braces in re.findall(r"\{([^}]*)\}", expr):
        for part in _STRING.split(braces):
            match = _MATCHER.search(part.split(",")[-1])
            if match:
                labels.add(match.group(1))
    bare = _STRING.sub('""', expr)
    bare = _GROUPING.sub("", bare)
    bare = _RANGE.sub("", bare)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    metrics = {
        name for name in _IDENT.findall(bare) if name.startswith("tokwatt_") or ":" in name
    }
    return metrics, labels


def check_promql_names(report, where, expr, exported, labels, recorded):
    """Every metric an expression names is exported (or recorded by a rule in
    `recorded`), and every label it groups or matches on is one the agent sets."""
    metrics, used_labels = promql_names(expr)
    for name in sorted(metrics):
        if ":" in name:
            report.check(
                name in recorded,
                f"{where}: {name} is not a recording rule in deploy/prometheus/tokwatt.rules.yml "
                f"(define it there or use the exported metric)",
            )
        else:
            report.check(
                name in exported,
                f"{where}: {name} is not a metric tokwatt exports "
                f"(tests/deploy/metric_names.txt lists them; a counter ends in _total, a "
                f"histogram is read through _bucket/_sum/_count)",
            )
    for label in sorted(used_labels):
        report.check(
            label in labels,
            f"{where}: label {label!r} is set by no tokwatt metric nor by Prometheus "
            f"(labels: {', '.join(sorted(labels))})",
        )


def promtool_check_rules(report, promtool, rules_yaml_text, what, scratch):
    """`promtool check rules` on the given rules file text; failure reported as `what`."""
    path = Path(scratch) / "rules.yml"
    path.write_text(rules_yaml_text)
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True
    )
    report.check(
        result.returncode == 0,
        f"{what}: promtool check rules failed:\n{result.stdout}{result.stderr}",
    )


# ---- tokwatt command lines ------------------------------------------------------------


def _help(binary, args):
    result = subprocess.run(
        [binary, *args, "--help"], capture_output=True, text=True, timeout=60
    )
    return result.returncode, result.stdout + result.stderr


def _subcommands(help_text):
    names = set()
    in_commands = False
    for line in help_text.splitlines():
        if line.strip() == "Commands:":
            in_commands = True
            continue
        if in_commands:
            if not line.startswith("  "):
                break
            names.add(line.split()[0])
    return names


def check_tokwatt_command(report, where, argv, binary, pending):
    """`argv` (after the program) names a real subcommand, at every level (`fleet
    coordinate`), and only the flags the innermost one has, as the built binary's --help
    lists them. A subcommand in `pending` (being written; its full path, like `fleet
    coordinate`) may be missing, with a note; once the binary has it, it is checked and
    must leave `pending`. Returns the subcommand's path (a list), or None where it was not
    checked."""
    if binary is None:
        report.skip(f"{where}: no tokwatt binary given (--tokwatt), flags not checked")
        return None
    if not argv:
        report.fail(f"{where}: no tokwatt subcommand given")
        return None
    path = []
    rest = list(argv)
    code, text = _help(binary, [])
    known = _subcommands(text)
    # Down the subcommands while the next word is one: the rest are its flags and values.
    while rest and not rest[0].startswith("-") and (known or not path):
        name = " ".join(path + [rest[0]])
        if rest[0] not in known:
            if name in pending:
                print(
                    f"note {report.name}: {where}: `tokwatt {name}` is not in this binary "
                    f"yet (pending); its flags are not checked"
                )
            else:
                parent = f"`tokwatt {' '.join(path)}`" if path else "tokwatt"
                report.fail(
                    f"{where}: `tokwatt {name}` is not a tokwatt subcommand "
                    f"({parent} has: {', '.join(sorted(known))})"
                )
            return None
        path.append(rest.pop(0))
        code, text = _help(binary, path)
        if not report.check(
            code == 0, f"{where}: `tokwatt {' '.join(path)} --help` failed: {text}"
        ):
            return None
        known = _subcommands(text)
    name = " ".join(path)
    report.check(
        name not in pending and path[0] not in pending,
        f"{where}: `tokwatt {name}` exists now: take it out of the pending list "
        f"(PENDING_SUBCOMMANDS in tests/all/deploy.rs) so its flags are checked",
    )
    if known:
        report.fail(
            f"{where}: `tokwatt {name}` needs a subcommand (it has: {', '.join(sorted(known))})"
        )
        return None
    # The options the help lists, each at the start of its line (a flag named in another
    # one's description, like etcd's --client-cert-auth, is not one of tokwatt's).
    flags = set(re.findall(r"^\s+(?:-[A-Za-z], )?(--[a-z][a-z0-9-]*)", text, re.M))
    for arg in rest:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            report.check(
                flag in flags,
                f"{where}: `tokwatt {name}` has no flag {flag} "
                f"(it has: {', '.join(sorted(flags))})",
            )
    return path


def flag_values(argv, flag):
    """Every value given to `flag` in `argv` (`--flag VALUE` or `--flag=VALUE`)."""
    found = []
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            found.append(argv[index + 1])
        elif arg.startswith(flag + "="):
            found.append(arg.split("=", 1)[1])
    return found


COORDINATOR = ["fleet", "coordinate"]


def check_coordinator_command(report, where, argv, files_under):
    """A `tokwatt fleet coordinate` command line: a domain, etcd endpoints of one scheme,
    https ones with a CA, a client certificate with its key, and every TLS file under one
    of `files_under` (a folder, or a function from a path to a problem or None)."""
    if not report.check(
        argv[:2] == COORDINATOR, f"{where}: expected `tokwatt fleet coordinate`, got {argv[:2]}"
    ):
        return
    report.check(len(flag_values(argv, "--domain")) == 1, f"{where}: --domain must be given once")
    endpoints = flag_values(argv, "--etcd")
    report.check(endpoints, f"{where}: --etcd must name etcd's client URLs")
    schemes = {url.split("://", 1)[0] for url in endpoints}
    report.check(
        schemes <= {"http", "https"} and len(schemes) <= 1,
        f"{where}: --etcd URLs must be all http:// or all https:// (found {sorted(schemes)})",
    )
    tls = {flag: flag_values(argv, flag) for flag in ("--etcd-ca", "--etcd-cert", "--etcd-key")}
    if "https" in schemes:
        report.check(tls["--etcd-ca"], f"{where}: https:// endpoints need --etcd-ca (the CA of etcd's certificate)")
    else:
        report.check(
            not any(tls.values()),
            f"{where}: TLS flags with http:// endpoints: use https:// or drop them",
        )
    report.check(
        bool(tls["--etcd-cert"]) == bool(tls["--etcd-key"]),
        f"{where}: --etcd-cert and --etcd-key go together",
    )
    for flag, values in tls.items():
        for value in values:
            problem = files_under(value)
            report.check(problem is None, f"{where}: {flag} {value}: {problem}")


def common_arguments(parser):
    parser.add_argument("--tokwatt", help="the built tokwatt binary, to check flags")
    parser.add_argument(
        "--pending",
        action="append",
        default=[],
        help="a subcommand being written, allowed to be missing from the binary",
    )
