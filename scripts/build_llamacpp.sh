#!/usr/bin/env bash
# Build llama.cpp, the peer `specdec bench --peer llamacpp` measures against, in a temp folder.
#
#   scripts/build_llamacpp.sh [DIR]                # DIR, else $LLAMACPP_DIR, else /tmp/specdec-llamacpp
#   scripts/build_llamacpp.sh --source-only [DIR]  # download + extract only: prints the source dir
#
# --source-only is for llama.cpp's own Python converter (convert_hf_to_gguf.py and its gguf-py, which
# tests/formats/test_gguf_families.py runs): no cmake, no 10-minute build; the last line printed is the
# llama.cpp source directory.
#
# llama.cpp is not a dependency of specdec: its source comes from the newest `llama-cpp-python`
# sdist on the package index (which vendors it under vendor/llama.cpp), fetched with
# `pip download` (nothing is installed into any project environment). It is built with cmake in
# Release, with native CPU flags (GGML_NATIVE=ON), static, without networking (no CURL/OpenSSL),
# only the tools the benchmark needs. Idempotent: every step already done is skipped.
# Pin a version with LLAMA_CPP_PYTHON_VERSION=0.3.36. The last line printed is the bin directory.
set -euo pipefail

SOURCE_ONLY=0
ARGS=()
for a in "$@"; do
  case $a in
    --source-only) SOURCE_ONLY=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "build_llamacpp: unknown option $a (use --source-only or a directory)" >&2; exit 2 ;;
    *) ARGS+=("$a") ;;
  esac
done
ROOT=${ARGS[0]:-${LLAMACPP_DIR:-/tmp/specdec-llamacpp}}
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}
TOOLS=(llama-bench llama-completion llama-simple llama-speculative llama-speculative-simple llama-tokenize
       llama-quantize)
# LLAMACPP_TOOLS="llama-quantize": build only those (CI's slow stage needs only the quantizer)
if [ -n "${LLAMACPP_TOOLS:-}" ]; then read -r -a TOOLS <<< "$LLAMACPP_TOOLS"; fi
SRC=$ROOT/src
BUILD=$ROOT/build
BIN=$BUILD/bin
REQ=llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}

log() { echo "build_llamacpp: $*" >&2; }

all_built() {
  local t
  for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}

# pip for `pip download`: the interpreter's own, else a throwaway venv under $ROOT
pip_cmd() {
  if "$PY" -m pip --version >/dev/null 2>&1; then
    echo "$PY -m pip"
  else
    [ -x "$ROOT/venv/bin/pip" ] || "$PY" -m venv "$ROOT/venv" >&2
    echo "$ROOT/venv/bin/pip"
  fi
}

download_sdist() {
  mkdir -p "$ROOT/sdist"
  if ! ls "$ROOT"/sdist/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    log "downloading the $REQ sdist"
    $(pip_cmd) download --no-deps --no-binary=:all: --disable-pip-version-check -q "$REQ" -d "$ROOT/sdist" >&2
  fi
  ls "$ROOT"/sdist/llama_cpp_python-*.tar.gz | sort -V | tail -n 1
}

extract() {
  local sdist=$1
  if [ ! -f "$SRC/.extracted" ]; then
    log "extracting $(basename "$sdist")"
    rm -rf "$SRC" && mkdir -p "$SRC"
    tar -xzf "$sdist" -C "$SRC" --strip-components=1
    basename "$sdist" > "$SRC/.extracted"
  fi
  [ -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ] || { log "no vendor/llama.cpp in $sdist"; exit 1; }
}

# cmake >= 3.14 (llama.cpp's minimum): the system's, else one from the package index in a throwaway venv
find_cmake() {
  local have
  have=$(cmake --version 2>/dev/null | awk 'NR == 1 {print $3}')
  if [ -n "$have" ] && [ "$(printf '3.14\n%s\n' "$have" | sort -V | head -n 1)" = 3.14 ]; then
    echo cmake
    return
  fi
  if [ ! -x "$ROOT/venv/bin/cmake" ]; then
    log "cmake missing or too old: installing it into the throwaway venv $ROOT/venv"
    [ -x "$ROOT/venv/bin/pip" ] || "$PY" -m venv "$ROOT/venv" >&2
    "$ROOT/venv/bin/pip" install -q --disable-pip-version-check cmake >&2
  fi
  echo "$ROOT/venv/bin/cmake"
}

configure() {
  local cmake=$1 gen=()
  [ -f "$BUILD/CMakeCache.txt" ] && return
  command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
  log "configuring in $BUILD"
  "$cmake" -S "$SRC/vendor/llama.cpp" -B "$BUILD" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON >"$ROOT/configure.log" 2>&1 \
    || { log "cmake configure failed: see $ROOT/configure.log"; rm -f "$BUILD/CMakeCache.txt"; exit 1; }
}

build() {
  local cmake=$1
  log "building ${TOOLS[*]} with -j$JOBS (log: $ROOT/build.log)"
  local t0=$SECONDS
  "$cmake" --build "$BUILD" --config Release -j "$JOBS" --target "${TOOLS[@]}" >"$ROOT/build.log" 2>&1 \
    || { tail -n 20 "$ROOT/build.log" >&2; log "build failed: see $ROOT/build.log"; exit 1; }
  log "built in $((SECONDS - t0)) s"
}

record_version() {
  local sdist=$1 commit
  commit=$(git -C "$SRC/vendor/llama.cpp" rev-parse HEAD 2>/dev/null || echo unknown)
  printf 'sdist=%s\nllama.cpp commit=%s\n' "$(basename "$sdist")" "$commit" > "$ROOT/VERSION"
}

main() {
  mkdir -p "$ROOT"
  if [ "$SOURCE_ONLY" = 1 ]; then
    local src_sdist
    src_sdist=$(download_sdist)
    extract "$src_sdist"
    echo "$SRC/vendor/llama.cpp"
    return
  fi
  if ! all_built; then
    local sdist cmake
    sdist=$(download_sdist)
    extract "$sdist"
    cmake=$(find_cmake)
    configure "$cmake"
    build "$cmake"
    record_version "$sdist"
    all_built || { log "some of ${TOOLS[*]} are missing in $BIN after the build"; exit 1; }
  fi
  [ -f "$ROOT/VERSION" ] && sed 's/^/build_llamacpp: /' "$ROOT/VERSION" >&2
  echo "$BIN"
}

main
