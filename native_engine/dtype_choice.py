"""Which dtype a model decodes fastest in on this machine, float32 or bfloat16: measured.

Config `dtype: auto` for the native engine. bfloat16 halves the bytes a decode step streams,
but only pays on a CPU whose oneDNN runs bfloat16 matmuls natively (AVX512-BF16, AMX); on
others it is emulated and slower than float32. So on a CPU with oneDNN bfloat16 the model is
loaded in both dtypes and one-token forwards (a batch-1 decode step's work) are timed,
interleaved; the faster dtype is kept, cached per machine and model shape in
$ADASPEC_CACHE_DIR/dtype-choice.json like the matmul path (native_engine/machine_cache.py).
A CPU without oneDNN bfloat16 gets float32 and a GPU bfloat16, without measuring.

bfloat16 is not float32: its greedy output can differ from float32's, and under speculation
from its own output without speculation (docs/native-engine.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from native_engine import machine_cache
from native_engine.attention import causal_mask

CACHE = "dtype-choice.json"
REPS = 5  # timed forwards per dtype, after one warm-up each
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # "measured", "cached", or why nothing was measured
    times_ms: dict[str, float] = field(default_factory=dict)  # dtype name -> ms per one-token forward

    def __str__(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        if not self.times_ms:
            return f"{name} ({self.reason})"
        times = ", ".join(f"{k} {v:.1f} ms" for k, v in self.times_ms.items())
        return f"{name} ({self.reason}: one-token forward {times})"


def cpu_has_bf16() -> bool:
    """oneDNN runs bfloat16 matmuls natively on this CPU (AVX512-BF16, AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def choose(folder: str | Path, device: str = "cpu") -> DtypeChoice:
    """The dtype for the model in `folder` on `device`: cached, measured, or by rule."""
    from native_engine.model import ModelArgs, load_model

    if torch.device(device).type == "cuda":
        return DtypeChoice(torch.bfloat16, "a GPU")
    if not cpu_has_bf16():
        return DtypeChoice(torch.float32, "this CPU has no oneDNN bfloat16")
    args = ModelArgs.from_hf_config(json.loads((Path(folder) / "config.json").read_text()))
    key = machine_cache.machine_key() + "|" + machine_cache.model_key(args, "float32/bfloat16")
    known = machine_cache.read_cached(CACHE, key)
    if known is not None:
        return DtypeChoice(DTYPES[known["dtype"]], "cached", known["times_ms"])
    choice = measure({name: load_model(folder, dtype=dt, device=device).prepare_for_serving()
                      for name, dt in DTYPES.items()})
    machine_cache.write_cached(CACHE, key, {"dtype": str(choice.dtype).removeprefix("torch."),
                                            "times_ms": choice.times_ms})
    return choice


@torch.no_grad()
def measure(models: dict, clock=time.perf_counter) -> DtypeChoice:
    """Time one-token forwards of each model (dtype name -> prepared Transformer), interleaved;
    the fastest by its best time wins. `clock` gives seconds."""
    ids, pos, mask = torch.zeros((1, 1), dtype=torch.long), torch.zeros((1, 1), dtype=torch.long), \
        causal_mask(torch.tensor([1]), 1)
    best = {name: float("inf") for name in models}
    for rep in range(REPS + 1):
        for name in models if rep % 2 == 0 else reversed(list(models)):
            model = models[name]
            start = clock()
            model.logits(model(ids, pos, mask)[:, -1])
            if rep > 0:  # the first of each is a warm-up
                best[name] = min(best[name], clock() - start)
    fastest = min(best, key=best.get)
    return DtypeChoice(DTYPES[fastest], "measured", {name: 1e3 * t for name, t in best.items()})
