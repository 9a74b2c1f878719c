"""The panel kernel's prefetch, side by side (ad hoc, 2026-12-05): the next panel prefetched by
the first block of six rows only (commit 5be3fba) against spread over all of a pass's blocks
(the current kernel). SmolLM2's linears (30 layers + lm_head, 538 MB), ms per pass of M rows,
the two kernels interleaved, median of the repetitions after the first; outputs compared.

    PYTHONPATH=. .venv/bin/python experiments/ab_prefetch.py [M,M,...] [repetitions]
"""

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load as build

from native_engine import cpu_kernels
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.cpu_linear import CpuLinear

torch.set_num_threads(2)
assert cpu_kernels.load(), "the CPU kernels do not build here"
old = subprocess.run(["git", "show", "5be3fba:native_engine/csrc/panel_matmul.cpp"], capture_output=True, text=True,
                     check=True).stdout.replace("(adaspec, m)", "(adaspec_old, m)").replace("(adaspec, CPU, m)",
                                                                                        "(adaspec_old, CPU, m)")
source = Path(tempfile.mkdtemp()) / "panel_matmul_old.cpp"
source.write_text(old)
build("adaspec_old_kernels", sources=[str(source)], is_python_module=False,
      extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"])

MS = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else (1, 2, 4, 8, 12, 16, 32, 64)
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 15
base = NativeEngine.from_pretrained("smollm2-135m-instruct", config=EngineConfig(max_batch_size=1, max_seq_len=256))
weights = [m.weight_panels for m in base.model.modules() if isinstance(m, CpuLinear) and m.weight_panels is not None]
print(f"{len(weights)} weights, {sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB", flush=True)
ops = {"old": torch.ops.adaspec_old.panel_matmul, "new": torch.ops.adaspec.panel_matmul}
for M in MS:
    xs = {w.shape[1]: torch.randn(M, w.shape[1]) for w in weights}
    for w in weights:
        torch.testing.assert_close(ops["new"](xs[w.shape[1]], w), ops["old"](xs[w.shape[1]], w))
    times = {k: [] for k in ops}
    for rep in range(REPS):
        for name in (("old", "new") if rep % 2 else ("new", "old")):
            start = time.perf_counter()
            for w in weights:
                ops[name](xs[w.shape[1]], w)
            times[name].append(time.perf_counter() - start)
    o, n = statistics.median(times["old"][1:]), statistics.median(times["new"][1:])
    print(f"M={M:3d} first block only {1e3 * o:6.1f} ms  spread {1e3 * n:6.1f} ms  ratio {o / n:.3f}", flush=True)
