"""bench/cuda_graph_step.py, the CUDA-graph part of scripts/gpu-check.sh, on this CPU: the static
verify step it captures computes what the model's own forward computes, and without a CUDA
device the check says so and exits 2 (the capture itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from bench.cuda_graph_step import VerifyStep, main
from native_engine.kv_cache import KVCache
from native_engine.model import build_model
from native_engine.testing import tiny_args
from native_engine.tree import attention_mask, tree_mask


@pytest.mark.parametrize("batch,k", [(1, 0), (3, 2), (2, 4)])
def test_the_static_verify_step_equals_the_models_forward(batch, k):
    model = build_model(tiny_args(), dtype=torch.float32)
    context, T = 5, 1 + k
    step = VerifyStep(model, batch, k, context, seed=1)
    with torch.inference_mode():
        got = step.run()
        cache = KVCache.allocate(model.args.n_layers, batch, model.args.n_kv_heads, context + T, model.args.head_dim,
                                 dtype=model.cache_dtype())
        block = tree_mask([i - 1 for i in range(k)]).expand(batch, T, T)
        mask = attention_mask(block, torch.full((batch,), context), context + T)
        hidden = model(step.tokens, step.positions, mask, cache, 0, step.positions, context + T)
        want = model.logits(hidden)
    assert got.shape == (batch, T, model.args.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The pass wrote its keys and values where the forward writes them.
    torch.testing.assert_close(step.cache.k[:, :, :, context:context + T], cache.k[:, :, :, context:context + T],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a CUDA device")
def test_without_cuda_it_says_so_and_exits_2(capsys):
    assert main(["--model", "tiny", "--batches", "1", "--ks", "0"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
