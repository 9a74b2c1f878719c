#!/usr/bin/env bash
# Build suffix decoding (vLLM's `speculative_config.method: suffix`) into the venv: only the
# `arctic_inference.suffix_decoding` module of arctic-inference 0.3.0, compiled from its sdist.
# adaspec refuses `speculation.method: suffix` for now: vLLM 0.32's proposer asserts a fixed
# k per step (docs/field-notes.md); this script is how the module was built for that finding,
# and what a fix would start from.
#   VENV=.venv scripts/build-suffix-decoding.sh
#
# Why not `pip install arctic-inference`: it ships only as an sdist whose build requires
# torch 2.10-2.11 and protobuf 5.29 in an isolated environment (vLLM 0.26's stack), and the
# installed package registers a `vllm.general_plugins` entry point that patches vLLM at start,
# written for vLLM 0.26 (docs/field-notes.md). vLLM 0.32 needs one import from it,
# `arctic_inference.suffix_decoding.SuffixDecodingCache`: a C++ suffix tree (nanobind) and a
# Python wrapper. That is what this builds, and nothing else (no plugin).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
VERSION=0.3.0
SHA256=7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36
NANOBIND=2.9.2
PY="$VENV/bin/python"

if "$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache" 2>/dev/null; then
  echo "[suffix] arctic_inference.suffix_decoding already importable"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
# --no-build-isolation: reading the sdist's metadata imports torch, which the venv has.
"$PY" -m pip download --quiet --no-deps --no-build-isolation -d "$work" "arctic-inference==$VERSION"
sdist="$work/arctic_inference-$VERSION.tar.gz"
echo "$SHA256  $sdist" | sha256sum -c --quiet
tar xzf "$sdist" -C "$work"
src="$work/arctic_inference-$VERSION"
"$PY" -m pip install --quiet --target "$work/build-deps" "nanobind==$NANOBIND"
mkdir -p "$work/build"
PYTHONPATH="$work/build-deps" cmake -S "$src/csrc/suffix_decoding" -B "$work/build" \
  -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" -DCMAKE_BUILD_TYPE=Release > "$work/cmake.log"
PYTHONPATH="$work/build-deps" cmake --build "$work/build" -j "$(nproc)" >> "$work/cmake.log" \
  || { tail -30 "$work/cmake.log"; exit 1; }

site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dest="$site/arctic_inference"
mkdir -p "$dest/suffix_decoding"
[ -f "$dest/__init__.py" ] || echo "# arctic-inference $VERSION: only suffix_decoding (scripts/build-suffix-decoding.sh)" > "$dest/__init__.py"
cp "$src/arctic_inference/suffix_decoding/__init__.py" "$src/arctic_inference/suffix_decoding/cache.py" \
  "$dest/suffix_decoding/"
cp "$work"/build/_C*.so "$dest/suffix_decoding/"
cp "$src/LICENSE" "$dest/LICENSE"
"$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(max_tree_depth=8)"
echo "[suffix] built arctic_inference.suffix_decoding $VERSION into $dest in $(( $(date +%s) - start )) s"
