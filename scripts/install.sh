#!/usr/bin/env bash
# Create .venv with adaspec, the CPU vLLM engine and the test tools, then prepare the
# embedded model. Idempotent: a second run with an unchanged lock file does nothing.
#   PYTHON=python3.11 VENV=.venv scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
LOCK=requirements/cpu-lock.txt
# torch 2.13.0+cpu is not on PyPI; PyTorch's CPU index has it. Machines whose pip already
# finds it locally (a wheel folder, a mirror) do without the index.
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
stamp="$VENV/.adaspec-installed"
want=$(cat pyproject.toml "$LOCK" | sha256sum | cut -d' ' -f1)

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  start=$(date +%s)
  echo "[install] installing adaspec[cpu,test] into $VENV (a few minutes the first time)"
  "${PIP[@]}" install --quiet --upgrade pip
  index=()
  if curl -s -m 5 -o /dev/null "$TORCH_INDEX/torch/"; then index=(--extra-index-url "$TORCH_INDEX"); fi
  "${PIP[@]}" install --quiet -e ".[cpu,test]" -c "$LOCK" "${index[@]}"
  # PyPI's torchvision/torchaudio/torchcodec, pulled in beside torch 2.13.0+cpu, break
  # `import transformers` and `import vllm` (operator torchvision::nms does not exist).
  "${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -c "import vllm, transformers, xgboost, ray.serve.llm" 2>/dev/null \
    || { echo "[install] import check failed"; exit 1; }
  echo "$want" > "$stamp"
  echo "[install] done in $(( $(date +%s) - start )) s"
fi

"$VENV/bin/adaspec" prepare-models

# adaspec's CPU kernels (native_engine/cpu_kernels.py) are C++ built on first use (about 35 s,
# then cached); built here, that stays out of the first native replica's start-up.
"$VENV/bin/python" -c "
from native_engine import cpu_kernels
print('[install] CPU kernels:', 'ready' if cpu_kernels.load() else 'not available here (torch\'s kernels instead)')"

# Prometheus for the dashboard test (tests/test_dashboard.py scrapes a running app with it):
# Debian's package, unpacked into the venv (no root service, no apt install), when the
# machine has apt. The binary is self-contained. Without it that test skips and says why.
if [ ! -x "$VENV/bin/prometheus" ] && ! command -v prometheus >/dev/null && command -v apt-get >/dev/null; then
  scripts/fetch_prometheus.sh "$VENV" || echo "[install] Prometheus not installed (the dashboard test will skip)"
fi
