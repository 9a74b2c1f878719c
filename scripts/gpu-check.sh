#!/usr/bin/env bash
# One-command GPU check (issue 20), for a machine with an NVIDIA GPU and a Python that has
# torch with CUDA, pytest, numpy, scipy, transformers and matplotlib: no vLLM, no model
# weights (random weights of real shapes). About 5 minutes on one H200.
#   scripts/gpu-check.sh                 # or PYTHON=/path/to/python scripts/gpu-check.sh
# 1. the native engine's tests on CUDA (tests/test_native_cuda.py, the CUDA case of
#    tests/test_native_model.py): float32 greedy output of every speculation shape equals the
#    target's own decoding; bfloat16 runs and agrees on most tokens;
# 2. python -m bench.tree_step_time on random-weight Llama-3-8B and Llama-3.2-1B shapes
#    (bfloat16): verify-pass step time against batch size and tree size.
# Writes bench/results/gpu-check-<date>/ (pytest.log, tree-step-time/result.json + png).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
out=bench/results/gpu-check-$(date -u +%Y%m%d-%H%M)
mkdir -p "$out"
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
PYEOF
echo "[gpu-check] native-engine tests on CUDA -> $out/pytest.log"
tests_rc=0
"$PY" -m pytest -q -p no:cacheprovider tests/test_native_cuda.py "tests/test_native_model.py::test_cuda_bfloat16_matches_cpu" \
    > "$out/pytest.log" 2>&1 || tests_rc=$?
tail -n 15 "$out/pytest.log"
echo "[gpu-check] tree step time on Llama-3 8B / 1B shapes -> $out/tree-step-time"
"$PY" -m bench.tree_step_time --models llama3-8b,llama3-1b --device cuda --dtype bfloat16 \
    --batches 1,4,16,64 --nodes 0,3,7,15,31,63 --repeats 10 --out "$out/tree-step-time"
echo "[gpu-check] done: $out (tests exit code $tests_rc)"
exit "$tests_rc"
