#!/usr/bin/env python3
"""Checks deploy/container/Containerfile, parsed by dockerfile-parse: a Rust builder stage
at rust-toolchain.toml's version with the wasm32-wasip2 target, a runtime stage; every
COPY source exists (in the repository, or is a product of the builder's cargo build);
USER, ENTRYPOINT and CMD set, CMD's tokwatt flags real, the plugin folder and the
metrics port consistent with the environment and the config. `docker build --check`
runs in addition only where a Docker daemon answers.

usage: check_container.py [CONTAINERFILE] [--tokwatt BIN] [--pending SUB]
"""

import argparse
import fnmatch
import io
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath

import deploycheck as dc

# What the builder's `cargo build --release -p tokwatt` leaves in target/ (host/crates/plugin-artifacts/build.rs
# puts the plugins in target/plugins whatever the profile), as (pattern, a file here
# that shows it is really produced, where this checkout has built it).
BUILD_PRODUCTS = [
    ("target/release/tokwatt", "target/debug/tokwatt"),
    ("target/plugins/wasm32-wasip2/plugin/*.wasm", None),
]


def parse(path):
    try:
        from dockerfile_parse import DockerfileParser
    except ImportError:
        return None
    parser = DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))
    return parser


def stages_of(structure, global_args):
    """[{name, base, workdir, instructions}] with ${ARG}s of the global ARGs substituted."""
    stages = []
    for item in structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "FROM":
            words = value.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            base = re.sub(r"\$\{(\w+)\}", lambda m: global_args.get(m.group(1), m.group(0)), words[0])
            stages.append({"name": name, "base": base, "workdir": "/", "items": []})
        elif stages:
            if instruction == "WORKDIR":
                stages[-1]["workdir"] = str(PurePosixPath(stages[-1]["workdir"]) / value)
            stages[-1]["items"].append(item)
    return stages


def copy_parts(value):
    """(flags, sources, destination) of a COPY's value, shell or JSON form."""
    flags = {}
    rest = value.strip()
    while (match := re.match(r"--([\w-]+)(?:=(\S*))?\s+", rest)):
        flags[match.group(1)] = match.group(2) or ""
        rest = rest[match.end():]
    words = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
    return flags, words[:-1], words[-1] if words else ""


def ignored(relative, ignore_patterns):
    return any(
        relative == pattern or relative.startswith(pattern.rstrip("/") + "/") or fnmatch.fnmatch(relative, pattern)
        for pattern in ignore_patterns
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("containerfile", nargs="?", default=str(dc.REPO / "deploy/container/Containerfile"))
    parser.add_argument("--config", default=str(dc.REPO / "deploy/serve-observe-only.toml"))
    dc.common_arguments(parser)
    args = parser.parse_args()
    report = dc.Report("container")
    path = Path(args.containerfile)
    dockerfile = parse(path)
    if dockerfile is None:
        report.skip("dockerfile-parse is not installed (pip install dockerfile-parse): the Containerfile was not checked")
        report.finish()
    structure = dockerfile.structure
    global_args = {}
    for item in structure:
        if item["instruction"] == "FROM":
            break
        if item["instruction"] == "ARG" and "=" in item["value"]:
            key, _, default = item["value"].partition("=")
            global_args[key.strip()] = default.strip().strip('"')
    stages = stages_of(structure, global_args)
    unknown = [i["instruction"] for i in structure if i["instruction"] not in {
        "COMMENT", "ARG", "FROM", "WORKDIR", "RUN", "COPY", "ADD", "ENV", "USER", "EXPOSE",
        "ENTRYPOINT", "CMD", "LABEL", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "ONBUILD"}]
    report.check(not unknown, f"{path}: unknown instructions {unknown}")
    if not report.check(len(stages) >= 2, f"{path}: expected a builder stage and a runtime stage, found {len(stages)}"):
        report.finish()
    builder, runtime = stages[0], stages[-1]
    by_name = {stage["name"]: stage for stage in stages if stage["name"]}

    # The builder: the pinned Rust, the plugin target, the release build.
    channel = tomllib.loads((dc.REPO / "rust-toolchain.toml").read_text())["toolchain"]["channel"]
    report.check(
        global_args.get("RUST_VERSION") == channel,
        f"ARG RUST_VERSION={global_args.get('RUST_VERSION')} but rust-toolchain.toml pins {channel}: make them equal",
    )
    report.check(
        builder["base"].split("/")[-1].startswith(f"rust:{channel}"),
        f"the builder stage starts FROM {builder['base']}, not the rust:{channel} image",
    )
    runs = " ".join(i["value"] for i in builder["items"] if i["instruction"] == "RUN")
    report.check("rustup target add wasm32-wasip2" in runs, "the builder must add the wasm32-wasip2 target (the plugins)")
    report.check(
        re.search(r"cargo build\b[^&;]*--release[^&;]*-p tokwatt", runs) is not None,
        "the builder must run `cargo build --release ... -p tokwatt`",
    )
    context_copies = [copy_parts(i["value"]) for i in builder["items"] if i["instruction"] == "COPY"]
    report.check(
        any(not flags and sources == ["."] for flags, sources, _ in context_copies),
        "the builder must COPY the repository (`COPY . .`) to build it",
    )

    ignore_file = Path(str(path) + ".dockerignore")
    ignore_patterns = []
    if ignore_file.is_file():
        ignore_patterns = [line.strip() for line in ignore_file.read_text().splitlines() if line.strip() and not line.startswith("#")]

    # Every COPY source exists.
    destinations = {}
    for stage in stages:
        for item in stage["items"]:
            if item["instruction"] not in ("COPY", "ADD"):
                continue
            where = f"{path}:{item['startline'] + 1}"
            flags, sources, destination = copy_parts(item["value"])
            source_stage = flags.get("from")
            for source in sources:
                destinations[PurePosixPath(destination) / PurePosixPath(source).name if destination.endswith("/") else PurePosixPath(destination)] = source
                if source_stage is None:
                    if source == ".":
                        continue
                    report.check(not ignored(source, ignore_patterns), f"{where}: {source} is excluded by {ignore_file.name}")
                    report.check(any(dc.REPO.glob(source)), f"{where}: COPY {source}: no such file in the repository")
                    continue
                if not report.check(source_stage in by_name, f"{where}: --from={source_stage} is not an earlier stage"):
                    continue
                workdir = by_name[source_stage]["workdir"]
                relative = str(PurePosixPath(source).relative_to(workdir)) if source.startswith(workdir + "/") else None
                if not report.check(relative is not None, f"{where}: {source} is outside the builder's WORKDIR {workdir}"):
                    continue
                if relative.startswith("target/"):
                    products = [(pattern, local) for pattern, local in BUILD_PRODUCTS if fnmatch.fnmatch(relative, pattern) or fnmatch.fnmatch(pattern, relative)]
                    if report.check(products, f"{where}: {relative} is not something the builder's cargo build makes ({', '.join(p for p, _ in BUILD_PRODUCTS)})"):
                        local = products[0][1]
                        if local is not None and (dc.REPO / "target").is_dir():
                            report.check((dc.REPO / local).exists(), f"{where}: {relative}: this checkout's build has no {local}")
                        elif local is None and (dc.REPO / "target/plugins").is_dir():
                            report.check(any(dc.REPO.glob(relative)), f"{where}: {relative} matches no plugin this checkout built")
                else:
                    report.check(not ignored(relative, ignore_patterns), f"{where}: {relative} is excluded by {ignore_file.name}, so the builder never has it")
                    report.check(any(dc.REPO.glob(relative)), f"{where}: COPY --from={source_stage} {source}: {relative} is not in the repository")

    # The runtime stage: who it runs as, what it runs.
    def last(instruction):
        found = [i["value"] for i in runtime["items"] if i["instruction"] == instruction]
        return found[-1] if found else None

    user = last("USER")
    report.check(user is not None, "the runtime stage must set USER")
    report.check(user is None or user.split(":")[0] not in ("0", "root"), f"USER {user}: the image runs unprivileged by default (privileged deployments ask for root explicitly)")
    entrypoint = last("ENTRYPOINT")
    command = last("CMD")
    if report.check(entrypoint and entrypoint.startswith("["), "ENTRYPOINT must be set, in exec form (signals reach the agent, which restores the GPUs)"):
        entry = json.loads(entrypoint)
        report.check(PurePosixPath(entry[0]) in destinations, f"ENTRYPOINT {entry[0]} is not copied into the image")
        argv = entry[1:] + (json.loads(command) if command and command.startswith("[") else [])
        dc.check_tokwatt_command(report, "ENTRYPOINT+CMD", argv, args.tokwatt, args.pending)
        if "--config" in argv:
            config_path = argv[argv.index("--config") + 1]
            report.check(PurePosixPath(config_path) in destinations, f"CMD's --config {config_path} is not copied into the image")
    environment = dockerfile.envs
    plugins = [str(d.parent) for d, s in destinations.items() if s.endswith(".wasm")]
    report.check(
        environment.get("TOKWATT_PLUGIN_DIR") in plugins,
        f"ENV TOKWATT_PLUGIN_DIR={environment.get('TOKWATT_PLUGIN_DIR')} but the plugins are copied to {plugins}",
    )
    report.check(environment.get("NVIDIA_VISIBLE_DEVICES") == "all", "ENV NVIDIA_VISIBLE_DEVICES=all: the toolkit injects every GPU")
    report.check("utility" in environment.get("NVIDIA_DRIVER_CAPABILITIES", ""), "ENV NVIDIA_DRIVER_CAPABILITIES must include utility (libnvidia-ml)")
    listen = tomllib.loads(Path(args.config).read_text()).get("metrics", {}).get("listen", "")
    port = listen.rsplit(":", 1)[-1]
    report.check(port in (last("EXPOSE") or "").split(), f"EXPOSE must include the metrics port {port} ([metrics] listen)")

    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "info"], capture_output=True).returncode == 0:
        result = subprocess.run([docker, "build", "--check", "-f", str(path), str(dc.REPO)], capture_output=True, text=True)
        report.check(result.returncode == 0, f"docker build --check:\n{result.stdout}{result.stderr}")
    else:
        print("note container: no Docker daemon here, `docker build --check` not run (optional)")
    report.finish()


if __name__ == "__main__":
    main()
