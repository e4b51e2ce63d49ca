#!/usr/bin/env bash
# Build llama.cpp's llama-server (that target alone) from a bundle's llama.cpp-src.tgz.
#
#   build-server.sh BUNDLE WORK cpu|cuda JOBS
#
# Unpacks into WORK/llama.cpp and builds into WORK/llama.cpp/build; prints the server's
# path last. CPU: -DGGML_CUDA=OFF (the CI test's tiny model); CUDA: for the H200/H100
# (sm_90). The tests and examples are not in the bundle, so they are switched off; curl
# is not needed (models are local files). Where WORK already holds a server built from
# the same source and kind, it is reused: the test builds it once.
set -euo pipefail
bundle="$1"; work="$2"; kind="$3"; jobs="$4"
src="$bundle/llama.cpp-src.tgz"
[[ -f "$src" ]] || { echo "no $src: make the bundle with scripts/llamacpp-bundle.sh" >&2; exit 2; }
case "$kind" in
  cpu) accel=(-DGGML_CUDA=OFF) ;;
  # The H100's and H200's architecture only: one target keeps the build inside a device call.
  cuda) accel=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90) ;;
  *) echo "kind must be cpu or cuda, not '$kind'" >&2; exit 2 ;;
esac
command -v cmake >/dev/null || { echo "cmake is not installed (apt-get install cmake)" >&2; exit 2; }
mkdir -p "$work"
stamp="$work/built-from"
# The source's name (llama-cpp-python's version, from the bundle), else the archive's
# checksum: a bundle made again from the same version reuses the build.
if [[ -f "$bundle/SOURCE" ]]; then want="$(cat "$bundle/SOURCE") $kind"; else want="$(cksum < "$src") $kind"; fi
server="$work/llama.cpp/build/bin/llama-server"
if [[ -x "$server" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "$server"
  exit 0
fi
rm -rf "$work/llama.cpp" "$stamp"
tar xzf "$src" -C "$work"
cd "$work/llama.cpp"
cmake -B build -DCMAKE_BUILD_TYPE=Release "${accel[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$work/cmake.log" 2>&1 \
  || { echo "cmake failed (see $work/cmake.log):" >&2; tail -20 "$work/cmake.log" >&2; exit 1; }
cmake --build build --target llama-server -j"$jobs" > "$work/build.log" 2>&1 \
  || { echo "building llama-server failed (see $work/build.log):" >&2; tail -30 "$work/build.log" >&2; exit 1; }
echo "$want" > "$stamp"
echo "$server"
