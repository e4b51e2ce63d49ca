#!/usr/bin/env python3
"""Checks a systemd unit of tokwatt's, by its role.

- agent (deploy/systemd/tokwatt.service): the keys the agent needs (restore after every
  stop, socket and state folders, the NVIDIA devices, CAP_SYS_ADMIN and nothing more),
  systemd's watchdog as the node's fence (Type=notify, NotifyAccess=main, WatchdogSec=),
  its paths against the config;
- reserve (deploy/systemd/tokwatt-reserve.service): the boot unit of a fleet node, a
  oneshot `tokwatt fence --once --reserve W` ordered before the agent, with CAP_SYS_ADMIN
  and nothing more;
- coordinator (deploy/systemd/tokwatt-coordinator.service): `tokwatt fleet coordinate`
  with no privilege at all (no capability, no device, not root), network only, SIGTERM
  to stop (it resigns), and its etcd TLS files from /etc/tokwatt/etcd/.

Both: the tokwatt command lines against the built binary's --help (nested subcommands
too), and `systemd-analyze verify` (run on a copy whose /usr/bin/tokwatt is the built
binary, so that the executable check means something; any warning about the unit fails).

usage: check_systemd.py [UNIT] [--role agent|coordinator|reserve] [--config SERVE_TOML] [--tokwatt BIN] [--pending SUB]
"""

import argparse
import shlex
import subprocess
import tempfile
import tomllib
from pathlib import Path

import deploycheck as dc

INSTALLED_BINARY = "/usr/bin/tokwatt"


def parse_unit(path):
    """{section: [(key, value, line)]}: duplicates kept (DeviceAllow= repeats), line
    continuations joined, comments dropped. Raises ValueError on a malformed line."""
    sections = {}
    current = None
    pending = ""
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            if not pending:
                start = number
            pending += line[:-1] + " "
            continue
        if pending:
            line, pending = pending + line, ""
        else:
            start = number
        if line.startswith("["):
            if not line.endswith("]"):
                raise ValueError(f"{path}:{start}: malformed section header {line!r}")
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        if current is None:
            raise ValueError(f"{path}:{start}: a key before any [Section]")
        if "=" not in line:
            raise ValueError(f"{path}:{start}: not a Key=value line: {line!r}")
        key, value = line.split("=", 1)
        sections[current].append((key.strip(), value.strip(), start))
    return sections


def values(sections, section, key):
    return [value for k, value, _ in sections.get(section, []) if k == key]


def one(report, sections, section, key):
    found = values(sections, section, key)
    report.check(len(found) == 1, f"[{section}] {key}= must be set once (found {found})")
    return found[-1] if found else None


def exec_argv(report, key, line):
    """The argv of an Exec*= line (prefixes stripped), or None where it does not run the
    installed binary."""
    argv = shlex.split(line.lstrip("-@:+!"))
    if report.check(argv and argv[0] == INSTALLED_BINARY, f"{key}={line}: expected {INSTALLED_BINARY}"):
        return argv
    return None


def check_sets_gpu_settings(report, sections, service):
    """A unit that changes GPU settings through NVML: it keeps CAP_SYS_ADMIN and nothing
    else, and sees the GPUs' device nodes."""
    report.check(
        one(report, sections, service, "CapabilityBoundingSet") == "CAP_SYS_ADMIN",
        "CapabilityBoundingSet=CAP_SYS_ADMIN: NVML's setters need it and nothing else",
    )
    report.check(
        values(sections, service, "PrivateDevices") in ([], ["no"], ["false"]),
        "PrivateDevices= must stay off: it hides /dev/nvidia*, and NVML cannot open the GPUs",
    )


def check_agent(report, sections, args):
    config = tomllib.loads(Path(args.config).read_text())
    service = "Service"
    report.check(
        one(report, sections, service, "Type") == "notify",
        "Type=notify: the agent says READY=1 and feeds systemd's watchdog (the node's fence)",
    )
    report.check(
        one(report, sections, service, "NotifyAccess") == "main",
        "NotifyAccess=main: only the agent's own process may feed its watchdog",
    )
    watchdog = one(report, sections, service, "WatchdogSec")
    report.check(
        watchdog not in (None, "", "0", "infinity"),
        "WatchdogSec= must be set: a hung or paused agent is aborted and restored at the reserve",
    )
    report.check(
        one(report, sections, service, "Restart") == "on-failure",
        "Restart=on-failure: a crashed agent comes back (after ExecStopPost restored the GPUs)",
    )
    report.check(
        one(report, sections, service, "RuntimeDirectory") == "tokwatt",
        "RuntimeDirectory=tokwatt: the control socket lives in /run/tokwatt",
    )
    report.check(
        one(report, sections, service, "StateDirectory") == "tokwatt",
        "StateDirectory=tokwatt: the state file and runs live in /var/lib/tokwatt",
    )
    check_sets_gpu_settings(report, sections, service)
    report.check(
        values(sections, service, "MemoryDenyWriteExecute") in ([], ["no"], ["false"]),
        "MemoryDenyWriteExecute= must stay off: wasmtime compiles plugins to machine code",
    )
    allowed = " ".join(values(sections, service, "DeviceAllow"))
    if values(sections, service, "DevicePolicy") in (["closed"], ["strict"]):
        for device in ("/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend"):
            report.check(
                device in allowed,
                f"DeviceAllow= must include {device} (DevicePolicy= would block NVML)",
            )

    # The paths the unit and the config share.
    state_file = config.get("state", {}).get("file")
    socket = config.get("api", {}).get("socket", "")
    report.check(
        socket.startswith("/run/tokwatt/"),
        f"the config's [api] socket {socket!r} is not in RuntimeDirectory /run/tokwatt",
    )
    writable = ["/var/lib/tokwatt", "/var/cache/tokwatt", "/run/tokwatt"]
    writable += " ".join(values(sections, service, "ReadWritePaths")).split()
    for name, path in (
        ("[state] file", state_file),
        ("[output] dir", config.get("output", {}).get("dir")),
    ):
        report.check(
            path is not None and any(path.startswith(folder) for folder in writable),
            f"the config's {name} {path!r} is not writable under ProtectSystem=strict "
            f"(writable: {', '.join(writable)})",
        )

    # The command lines: the installed binary, real subcommands and flags.
    exec_start = values(sections, service, "ExecStart")
    stop_post = values(sections, service, "ExecStopPost")
    report.check(len(exec_start) == 1, "ExecStart= must be set once")
    report.check(
        any(" restore" in line for line in stop_post),
        "ExecStopPost= must run `tokwatt restore`: settings come back even after a crash",
    )
    for key, lines in (("ExecStart", exec_start), ("ExecStopPost", stop_post)):
        for line in lines:
            argv = exec_argv(report, key, line)
            if argv is None:
                continue
            dc.check_tokwatt_command(report, f"{key}=", argv[1:], args.tokwatt, args.pending)
            if argv[1:2] == ["restore"]:
                given = argv[argv.index("--state-file") + 1] if "--state-file" in argv else None
                report.check(
                    given == state_file,
                    f"{key}= restores from {given!r} but the config's [state] file is "
                    f"{state_file!r}: name the same file",
                )
            if argv[1:2] == ["serve"]:
                report.check(
                    "--config" in argv, f"{key}= must pass --config /etc/tokwatt/serve.toml"
                )


ETCD_TLS_FOLDER = "/etc/tokwatt/etcd/"
NETWORK_FAMILIES = {"AF_UNIX", "AF_INET", "AF_INET6"}


def check_coordinator(report, sections, args):
    service = "Service"
    report.check(
        one(report, sections, service, "Type") in ("simple", "exec"),
        "Type= must be simple or exec: the coordinator does not notify systemd",
    )
    report.check(
        one(report, sections, service, "Restart") in ("always", "on-failure"),
        "Restart=always (or on-failure): a replica that stops comes back",
    )
    report.check(
        values(sections, service, "KillSignal") in ([], ["SIGTERM"]),
        "KillSignal= must stay SIGTERM: on it the replica resigns, so another leads at once",
    )
    # No privilege: not root, no capability, no device.
    user = values(sections, service, "User")
    report.check(
        values(sections, service, "DynamicUser") == ["yes"] or (user and user[-1] not in ("root", "0")),
        "DynamicUser=yes (or User= a user other than root): the coordinator needs no privilege",
    )
    report.check(
        values(sections, service, "CapabilityBoundingSet") == [""],
        "CapabilityBoundingSet= must be set once, empty: the coordinator needs no capabilities",
    )
    report.check(
        all(v == "" for v in values(sections, service, "AmbientCapabilities")),
        "AmbientCapabilities= must be empty: the coordinator needs no capabilities",
    )
    report.check(
        values(sections, service, "PrivateDevices") == ["yes"],
        "PrivateDevices=yes: the coordinator opens no device",
    )
    report.check(
        not values(sections, service, "DeviceAllow"),
        "no DeviceAllow=: the coordinator opens no device",
    )
    families = set(" ".join(values(sections, service, "RestrictAddressFamilies")).split())
    report.check(
        families and families <= NETWORK_FAMILIES,
        f"RestrictAddressFamilies= must allow the network only ({' '.join(sorted(NETWORK_FAMILIES))}), found {sorted(families)}",
    )
    report.check(
        not values(sections, service, "ExecStopPost"),
        "no ExecStopPost=: the coordinator holds no GPU setting to restore",
    )

    # Its TLS files: systemd's credentials loaded from /etc/tokwatt/etcd/, or files there.
    credentials = {}
    for value in values(sections, service, "LoadCredential"):
        name, _, source = value.partition(":")
        credentials[name] = source
        report.check(
            source.startswith(ETCD_TLS_FOLDER),
            f"LoadCredential={value}: the etcd TLS files live in {ETCD_TLS_FOLDER}",
        )

    def tls_file(path):
        for prefix in ("${CREDENTIALS_DIRECTORY}/", "$CREDENTIALS_DIRECTORY/", "%d/"):
            if path.startswith(prefix):
                name = path[len(prefix):]
                if name not in credentials:
                    return f"no LoadCredential={name}:… gives it"
                return None
        if not path.startswith(ETCD_TLS_FOLDER):
            return f"not in {ETCD_TLS_FOLDER} (nor a credential from there)"
        return None

    exec_start = values(sections, service, "ExecStart")
    if not report.check(len(exec_start) == 1, "ExecStart= must be set once"):
        return
    argv = exec_argv(report, "ExecStart", exec_start[0])
    if argv is None:
        return
    path = dc.check_tokwatt_command(report, "ExecStart=", argv[1:], args.tokwatt, args.pending)
    if path is not None:
        report.check(path == dc.COORDINATOR, f"ExecStart= must run `tokwatt fleet coordinate`, not `tokwatt {' '.join(path)}`")
    dc.check_coordinator_command(report, "ExecStart=", argv[1:], tls_file)


def check_reserve(report, sections, args):
    service = "Service"
    report.check(
        one(report, sections, service, "Type") == "oneshot",
        "Type=oneshot: the reserve is applied once at boot, then the unit is done",
    )
    report.check(
        "tokwatt.service" in " ".join(values(sections, "Unit", "Before")).split(),
        "Before=tokwatt.service: the reserve is in force before the agent starts",
    )
    report.check(
        "multi-user.target" in " ".join(values(sections, "Install", "WantedBy")).split(),
        "WantedBy=multi-user.target: the unit runs at every boot",
    )
    check_sets_gpu_settings(report, sections, service)
    exec_start = values(sections, service, "ExecStart")
    if not report.check(len(exec_start) == 1, "ExecStart= must be set once"):
        return
    argv = exec_argv(report, "ExecStart", exec_start[0])
    if argv is None:
        return
    path = dc.check_tokwatt_command(report, "ExecStart=", argv[1:], args.tokwatt, args.pending)
    if path is not None:
        report.check(path == ["fence"], f"ExecStart= must run `tokwatt fence`, not `tokwatt {' '.join(path)}`")
    report.check(
        "--once" in argv,
        "ExecStart= must run `tokwatt fence --once`: apply the reserve and exit",
    )
    reserve = argv[argv.index("--reserve") + 1] if "--reserve" in argv[:-1] else None
    try:
        reserve_ok = reserve is not None and float(reserve) > 0
    except ValueError:
        reserve_ok = False
    report.check(reserve_ok, f"ExecStart= must give --reserve W, the node's fleet.reserve_w (found {reserve!r})")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("unit", nargs="?", default=str(dc.REPO / "deploy/systemd/tokwatt.service"))
    parser.add_argument("--role", choices=["agent", "coordinator", "reserve"], default="agent")
    parser.add_argument("--config", default=str(dc.REPO / "deploy/serve.toml"))
    dc.common_arguments(parser)
    args = parser.parse_args()
    report = dc.Report(f"systemd {args.role}")
    unit = Path(args.unit)
    try:
        sections = parse_unit(unit)
    except (ValueError, OSError) as error:
        report.fail(str(error))
        report.finish()

    for section in ("Unit", "Service", "Install"):
        report.check(section in sections, f"{unit}: no [{section}] section")
    service = "Service"
    report.check(one(report, sections, service, "NoNewPrivileges") == "yes", "NoNewPrivileges=yes")
    report.check(
        one(report, sections, service, "ProtectSystem") == "strict", "ProtectSystem=strict"
    )
    report.check(
        one(report, sections, service, "ProtectHome") in ("yes", "read-only", "tmpfs"),
        "ProtectHome= must hide or protect /home",
    )
    if args.role == "agent":
        check_agent(report, sections, args)
    elif args.role == "reserve":
        check_reserve(report, sections, args)
    else:
        check_coordinator(report, sections, args)

    analyze = dc.tool("systemd-analyze", report, "systemd-analyze verify")
    if analyze and args.tokwatt:
        with tempfile.TemporaryDirectory() as scratch:
            copy = Path(scratch) / unit.name
            binary = str(Path(args.tokwatt).resolve())
            copy.write_text(unit.read_text().replace(INSTALLED_BINARY, binary))
            result = subprocess.run(
                [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=120
            )
            said = (result.stdout + result.stderr).strip()
            about_unit = [line for line in said.splitlines() if unit.name in line]
            report.check(
                result.returncode == 0 and not about_unit,
                f"systemd-analyze verify {unit} (exit {result.returncode}):\n{said}",
            )
    elif analyze:
        report.skip("systemd-analyze verify needs --tokwatt (the unit's executable)")
    report.finish()


if __name__ == "__main__":
    main()
