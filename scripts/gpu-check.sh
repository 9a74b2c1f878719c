#!/usr/bin/env bash
# The one command to run on a GPU machine (docs/configuration.md, "On a GPU machine"): a
# Python with torch (CUDA), pytest and numpy; no vLLM, no Ray, no model weights (random weights
# of real shapes), nothing to install. About 10 minutes on one H100.
#   scripts/gpu-check.sh                 # or PYTHON=/path/to/python scripts/gpu-check.sh
#   scripts/gpu-check.sh --list          # the steps and whether each can run here
#   scripts/gpu-check.sh --cpu-only      # the CPU steps alone, on a machine without a GPU
# Steps (scripts/gpu_check.py): adaspec's policy and controller tests (CPU); the native engine's
# tests on CUDA; CUDA graphs of a verify step captured at k = 0, 1, 2, 4, 8, replayed against
# the eager pass and timed (bench.cuda_graph_step); verify step time on Llama-3 8B / 1B shapes
# (bench.tree_step_time). Each step runs if what it needs is importable, else the summary says
# why not. Writes bench/results/gpu-check-<date>/ (summary.md, summary.json, a log per step).
# Exit status: 0 no step failed; 1 a step failed; 3 no CUDA device (the CPU steps ran).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" scripts/gpu_check.py "$@"
