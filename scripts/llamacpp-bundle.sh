#!/usr/bin/env bash
# Gather what the llama.cpp check needs, on a machine WITHOUT a GPU, into one folder that
# travels to the GPU machine (which has no network):
#
#   scripts/llamacpp-bundle.sh [DIR]     # default DIR: dist-llamacpp/ (git-ignored)
#   (copy DIR to the GPU machine: it carries tokwatt itself, see below)
#   DIR/llamacpp-check.sh OUT            # there: CUDA build, model, server, load, tokwatt
#
# The engine's source is the llama.cpp tree that the `llama-cpp-python` source package
# ships under vendor/llama.cpp (issue 42 asks for that source, not a git checkout). It is
# packed without the folders neither the server nor gguf-py need (models/ docs/ tests/
# benches/ media/ examples/: about 10.5 MB compressed); the vocab-only
# models/ggml-vocab-llama-bpe.gguf travels beside it, for the random-weight model's
# tokenizer. The release `tokwatt` travels gzipped (tokwatt.gz, ~10 MB instead of 32: the
# device call carries at most 64 MiB with the checkout) with the two specs the check runs
# and their plugins beside them (specs/), so DIR alone is enough. The test's CPU server (scripts/llamacpp/build-cpu.sh) is built from the same
# folder.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dist="${1:-$root/dist-llamacpp}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

download="$(mktemp -d)"
trap 'rm -rf "$download"' EXIT
# `--no-binary llama-cpp-python`, not `:all:`: the source package is what we want, and
# `:all:` would also compile its build backend's own dependencies (ninja, cmake) from source
# just to read its metadata, minutes on two cores.
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
  "llama-cpp-python==$version" -d "$download" \
  || { echo "pip could not fetch llama-cpp-python==$version (is PyPI reachable?)" >&2; exit 1; }
sdist="$download/llama_cpp_python-$version.tar.gz"
[[ -f "$sdist" ]] || { echo "pip fetched no $sdist: $(ls "$download")" >&2; exit 1; }

tar xzf "$sdist" -C "$download"
tree="$download/llama_cpp_python-$version/vendor/llama.cpp"
[[ -f "$tree/tools/server/server.cpp" && -d "$tree/gguf-py/gguf" ]] \
  || { echo "$sdist has no llama.cpp server or gguf-py under vendor/llama.cpp" >&2; exit 1; }
vocab="$tree/models/ggml-vocab-llama-bpe.gguf"
[[ -f "$vocab" ]] || { echo "$sdist has no models/ggml-vocab-llama-bpe.gguf" >&2; exit 1; }

rm -rf "$dist"
mkdir -p "$dist"
cp "$vocab" "$dist/"
tar czf "$dist/llama.cpp-src.tgz" -C "$tree/.." \
  --exclude=llama.cpp/models --exclude=llama.cpp/docs --exclude=llama.cpp/tests \
  --exclude=llama.cpp/benches --exclude=llama.cpp/media --exclude=llama.cpp/examples \
  llama.cpp
echo "llama-cpp-python $version" > "$dist/SOURCE"
cp "$root"/scripts/llamacpp/{make_model.py,loadgen.py,llamacpp-check.sh,build-server.sh} "$dist/"
(cd "$root" && cargo build --release -p tokwatt)
strip -o "$download/tokwatt" "$root/target/release/tokwatt"
gzip -9 -c "$download/tokwatt" > "$dist/tokwatt.gz"
mkdir -p "$dist/specs"
for spec in static cap-and-batch; do
  cp "$root/policies/$spec.toml" "$dist/specs/"
  cp "$root/target/plugins/wasm32-wasip2/plugin/policy_${spec//-/_}.wasm" "$dist/specs/"
done
chmod +x "$dist"/*.sh
du -sh "$dist"/* | sed 's/^/  /'
echo "bundle in $dist: run $dist/llamacpp-check.sh OUT on the GPU machine"
