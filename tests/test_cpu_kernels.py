"""adaspec's CPU kernels (native_engine/cpu_kernels.py) against torch's.

The decode-attention kernel (native_engine/decode_attention.py): every grouped-query layout
and head size it takes, rows of uneven length read from strided cache views, a negative check
that the comparison notices a wrong length, clear errors, one-token passes whose mask is not a
prefix left to torch, and an engine whose decode steps run it decoding exactly as
recomputation from scratch; in bfloat16, the same output as float32 on the widened values,
rounded. The panel matmul: against F.linear for 1-257 rows (every count of rows past the last
block of six), the weight's layout read as documented; in bfloat16, against float32 arithmetic
on the same values, rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from native_engine import cpu_kernels, decode_attention
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.drafters import NgramDrafter
from native_engine.kv_cache import KVCache
from native_engine.attention import prefix_lengths
from native_engine.model import build_model
from native_engine.tree import DraftTree, attention_mask, batch_tree_inputs
from native_engine.requests import SamplingParams
from native_engine.testing import reference_greedy, tiny_args
from adaspec.policy import SpecPolicy

pytestmark = pytest.mark.skipif(not cpu_kernels.load(),
                                reason="the kernels need an x86 CPU with AVX2 and a C++ compiler")


def _case(B: int, H: int, Hkv: int, Dh: int, S: int, seed: int = 0):
    """q [B, H, Dh]; keys/values [B, Hkv, S, Dh] as views of a larger cache (other strides
    than their own shape's); per-row lengths 1..S with both ends present."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, B + 1, Hkv, S + 37, Dh, generator=gen)
    keys, values = cache[0, 1:, :, :S], cache[1, 1:, :, :S]
    q = torch.randn(B, H, Dh, generator=gen)
    lengths = torch.randint(1, S + 1, (B,), generator=gen)
    lengths[0], lengths[-1] = 1, S
    return q, keys, values, lengths


def _torch_attention(q, keys, values, lengths):
    B, H, Dh = q.shape
    mask = (torch.arange(keys.shape[2])[None, :] < lengths[:, None]).view(B, 1, 1, -1)
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask,
                                         enable_gqa=H != keys.shape[1])
    return out.reshape(B, H * Dh)


@pytest.mark.parametrize("H,Hkv,Dh", [(4, 4, 16), (9, 3, 64), (8, 2, 128), (14, 2, 64), (10, 2, 32)])
def test_the_kernel_matches_torch_attention(H, Hkv, Dh):
    q, keys, values, lengths = _case(B=5, H=H, Hkv=Hkv, Dh=Dh, S=203)
    got = decode_attention.decode_attention(q, keys, values, lengths)
    torch.testing.assert_close(got, _torch_attention(q, keys, values, lengths), rtol=1e-5, atol=1e-5)


def _tree_case(B: int, T: int, S: int, seed: int):
    """A verify pass: per sequence a random tree of up to T - 1 nodes (the rest pads) after a
    prefix of 1..S - T keys. Returns the pass's bool mask [B, 1, T, S] (native_engine.tree)
    and the real tokens per sequence (root and nodes; the rest are pads)."""
    gen = torch.Generator().manual_seed(seed)
    trees = []
    for b in range(B):
        n = T - 1 if b == 0 else int(torch.randint(0, T, (), generator=gen))  # the first sets T
        parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(n)]
        trees.append(DraftTree(list(range(n)), parents))
    lengths = torch.randint(1, S - T + 1, (B,), generator=gen)
    lengths[0] = S - T
    _, _, _, block = batch_tree_inputs(trees, [0] * B, lengths.tolist())
    # Pads see only themselves, as in the engine's verify pass: their queries start late.
    real = [len(t) + 1 for t in trees]
    return attention_mask(block, lengths, S, real), real


@pytest.mark.parametrize("H,Hkv,Dh,T", [(9, 3, 64, 5), (4, 4, 16, 2), (14, 2, 64, 9), (8, 2, 128, 3)])
def test_the_tree_kernel_matches_torch_attention_under_the_tree_mask(H, Hkv, Dh, T):
    """Uneven prefixes and trees, pad rows, keys as strided views of a cache: as torch's
    attention over all S keys under the pass's mask; each sequence reads only its own keys.
    Pads (the engine drops their outputs) are not attended: zeros."""
    B, S = 6, 160
    mask, real = _tree_case(B, T, S, seed=T)
    gen = torch.Generator().manual_seed(H)
    cache = torch.randn(2, B + 1, Hkv, S + 11, Dh, generator=gen)
    keys, values = cache[0, 1:, :, :S], cache[1, 1:, :, :S]
    q = torch.randn(B, T, H, Dh, generator=gen)
    allowed = mask[:, 0].contiguous()
    counts = decode_attention.key_counts(allowed)
    assert counts[0] == S and bool((counts < S).any())
    got = decode_attention.tree_attention(q, keys, values, counts, allowed)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=H != Hkv)
    want = want.transpose(1, 2).reshape(B, T, H * Dh)
    is_real = torch.arange(T)[None, :] < torch.tensor(real)[:, None]
    assert not bool(is_real.all())  # the case has pads
    torch.testing.assert_close(got[is_real], want[is_real], rtol=1e-5, atol=1e-5)
    assert bool((got[~is_real] == 0).all())
    allowed[1, 0, 0] = not allowed[1, 0, 0]  # one key more or less for one query: noticed
    assert not torch.allclose(decode_attention.tree_attention(q, keys, values, counts, allowed)[1, 0], got[1, 0])


def test_the_tree_kernel_gives_zeros_to_a_query_with_no_key_and_refuses_bad_counts():
    q, keys, values = torch.randn(1, 2, 4, 16), torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16)
    allowed = torch.zeros(1, 2, 8, dtype=torch.bool)
    allowed[0, 0, :3] = True
    out = decode_attention.tree_attention(q, keys, values, torch.tensor([8]), allowed)
    assert bool((out[0, 1] == 0).all()) and bool(out[0, 0].abs().sum() > 0)
    with pytest.raises(RuntimeError, match="9 keys of 8"):
        decode_attention.tree_attention(q, keys, values, torch.tensor([9]), allowed)


@pytest.mark.parametrize("T", [1, 4])
def test_write_and_attend_writes_the_cache_then_attends_as_the_kernels_do(T):
    """One call per layer: the pass's keys and values land at their rows and positions (and
    nowhere else), and the output is the decode kernel's (T = 1) or the tree kernel's (a
    verify pass) over the cache so written; a write past the cache is refused."""
    B, H, Hkv, Dh, S = 3, 9, 3, 64, 48  # S a whole number of KEY_BLOCKs: the cache's max_len
    gen = torch.Generator().manual_seed(T)
    cache = KVCache.allocate(2, B + 2, Hkv, S, Dh)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    before = KVCache(cache.k.clone(), cache.v.clone())
    qkv = torch.randn(B, T, (H + 2 * Hkv) * Dh, generator=gen)  # strided views, as a layer's projection gives
    q, k, v = (x.view(B, T, -1, Dh) for x in qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1))
    starts = torch.tensor([5, 17, 30])
    write = starts[:, None] + torch.arange(T)[None, :]
    layer, row_start = 1, 1
    if T == 1:
        counts, allowed = write[:, 0] + 1, None
    else:  # every node sees its prefix and itself and the first node: a small tree per row
        key_len = int(write.max()) + 1
        allowed = torch.arange(key_len)[None, None, :] <= write[:, :, None]
        allowed &= (torch.arange(key_len)[None, None, :] < starts[:, None, None] + 1) | (
            torch.arange(key_len)[None, None, :] == write[:, :, None])
        allowed = allowed.contiguous()
        counts = decode_attention.key_counts(allowed)
    got = decode_attention.write_and_attend(q, k, v, cache, layer, row_start, write, counts, allowed)

    keys, values = before.update(layer, row_start, write, k, v, S)
    torch.testing.assert_close(cache.k, before.k, rtol=0, atol=0)  # the same writes, and only them
    torch.testing.assert_close(cache.v, before.v, rtol=0, atol=0)
    if T == 1:
        want = decode_attention.decode_attention(q[:, 0], keys, values, counts).view(B, 1, H * Dh)
    else:
        want = decode_attention.tree_attention(q, keys[:, :, :allowed.shape[-1]], values[:, :, :allowed.shape[-1]],
                                               counts, allowed)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Other layouts (heads not contiguous): the same writes and output.
    odd = q.transpose(1, 2).contiguous().transpose(1, 2)
    again = decode_attention.write_and_attend(odd, k.transpose(1, 2).contiguous().transpose(1, 2), v, cache, layer,
                                              row_start, write, counts, allowed)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    torch.testing.assert_close(cache.k, before.k, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="write position 48 outside the cache"):
        decode_attention.write_and_attend(q, k, v, cache, layer, row_start, write + S - int(write.max()), counts,
                                          allowed)
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_attention.write_and_attend(q, k, v, cache, layer, 3, write, counts, allowed)


def test_the_comparison_notices_one_key_too_few():
    q, keys, values, lengths = _case(B=4, H=9, Hkv=3, Dh=64, S=40, seed=1)
    short = (lengths - 1).clamp(min=1)
    got = decode_attention.decode_attention(q, keys, values, short)
    assert not torch.allclose(got, _torch_attention(q, keys, values, lengths), rtol=1e-5, atol=1e-5)


def test_lengths_outside_the_cache_are_refused():
    q, keys, values, lengths = _case(B=2, H=4, Hkv=2, Dh=16, S=8)
    with pytest.raises(RuntimeError, match="9 keys of 8"):
        decode_attention.decode_attention(q, keys, values, torch.tensor([3, 9]))
    with pytest.raises(RuntimeError, match="0 keys of 8"):
        decode_attention.decode_attention(q, keys, values, torch.tensor([0, 8]))


def test_supports_float32_and_bfloat16_cpu_head_sizes_of_sixteen():
    assert decode_attention.supports(64, torch.float32, "cpu")
    assert decode_attention.supports(64, torch.bfloat16, "cpu")
    assert not decode_attention.supports(8, torch.float32, "cpu")
    assert not decode_attention.supports(64, torch.float16, "cpu")


@pytest.mark.parametrize("length", range(120, 137))
def test_a_token_attends_with_the_same_bits_in_a_decode_step_and_in_a_verify_pass(length):
    """What greedy output under speculation needs from attention: a verify pass's root reads
    one key more than a decode step (a pad's or a sibling's, masked for it), and a tree node
    reads its ancestors with a sibling's key between them, where the decode step after the
    accepted path was compacted reads them side by side. Both give the decode step's bits. (The
    softmax sum in eight lanes plus a tail added one by one gave other bits at lengths 8m + 6.)"""
    B, H, Hkv, Dh, S, L = 1, 9, 3, 64, 160, length
    gen = torch.Generator().manual_seed(length)
    cache = KVCache.allocate(1, B, Hkv, S, Dh)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    q, k, v = (torch.randn(B, 3, heads, Dh, generator=gen) for heads in (H, Hkv, Hkv))
    # root at L; node a (the root's child) at L + 1; node b (the root's other child) at L + 2
    allowed = torch.zeros(B, 3, L + 3, dtype=torch.bool)
    allowed[0, 0, :L + 1] = allowed[0, 1, :L + 2] = allowed[0, 2, :L + 1] = allowed[0, 2, L + 2] = True
    tree_cache = KVCache(cache.k.clone(), cache.v.clone())
    tree = decode_attention.write_and_attend(q, k, v, tree_cache, 0, 0, torch.arange(L, L + 3)[None],
                                             decode_attention.key_counts(allowed), allowed)

    def decode(t: int, at: int) -> torch.Tensor:  # token t of the pass, alone at position `at`
        return decode_attention.write_and_attend(q[:, t:t + 1].contiguous(), k[:, t:t + 1].contiguous(),
                                                 v[:, t:t + 1].contiguous(), cache, 0, 0, torch.tensor([[at]]),
                                                 torch.tensor([at + 1]))[0, 0]

    assert torch.equal(tree[0, 0], decode(0, L))
    assert torch.equal(tree[0, 2], decode(2, L + 1))  # b accepted: compacted next to the root
    assert not torch.equal(tree[0, 1], tree[0, 2])


@pytest.mark.parametrize("T", [1, 3])
def test_write_and_attend_in_bfloat16_widens_then_rounds_the_output(T):
    """A bfloat16 pass over the float32 cache: the cache gets the widened keys and values
    (exactly), and the output is the float32 pass's on the same values, rounded to bfloat16."""
    B, H, Hkv, Dh, S = 2, 9, 3, 64, 32
    gen = torch.Generator().manual_seed(T)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * Dh, generator=gen).to(torch.bfloat16)
    q, k, v = (x.view(B, T, -1, Dh) for x in qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1))
    write = torch.tensor([[4], [9]]) + torch.arange(T)[None, :]
    allowed = None
    counts = write[:, -1] + 1
    if T > 1:  # a chain per row
        allowed = (torch.arange(S)[None, None, :] <= write[:, :, None]).contiguous()
        counts = decode_attention.key_counts(allowed)
    caches = [KVCache.allocate(1, B, Hkv, S, Dh) for _ in range(2)]
    for cache in caches:
        cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(0)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(1)))
    got = decode_attention.write_and_attend(q, k, v, caches[0], 0, 0, write, counts, allowed)
    want = decode_attention.write_and_attend(q.float(), k.float(), v.float(), caches[1], 0, 0, write, counts, allowed)
    assert got.dtype == torch.bfloat16 and caches[0].k.dtype == torch.float32
    torch.testing.assert_close(caches[0].k, caches[1].k, rtol=0, atol=0)
    torch.testing.assert_close(caches[0].v, caches[1].v, rtol=0, atol=0)
    assert torch.equal(got, want.to(torch.bfloat16))


def test_prefix_lengths_take_only_masks_that_are_a_prefix_per_row():
    assert prefix_lengths(None, 7, 3).tolist() == [7, 7, 7]
    keys = torch.arange(6)
    prefix = (keys[None, :] < torch.tensor([2, 6, 1])[:, None]).view(3, 1, 1, 6)
    assert prefix_lengths(prefix, 6, 3).tolist() == [2, 6, 1]
    additive = torch.zeros(3, 1, 1, 6).masked_fill(~prefix, float("-inf"))
    assert prefix_lengths(additive, 6, 3).tolist() == [2, 6, 1]
    hole = prefix.clone()
    hole[1, 0, 0, 3] = False  # a draft-tree node that does not see a sibling written before it
    assert prefix_lengths(hole, 6, 3) is None
    empty = prefix.clone()
    empty[2] = False
    assert prefix_lengths(empty, 6, 3) is None


def _one_token_pass(model, mask, key_len):
    """A one-token pass of 2 rows over a cache holding key_len - 1 random entries per row."""
    a = model.args
    cache = KVCache.allocate(a.n_layers, 2, a.n_kv_heads, 32, a.head_dim)
    gen = torch.Generator().manual_seed(4)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    write = torch.tensor([[key_len - 1], [key_len - 1]])
    with torch.no_grad():
        return model(torch.tensor([[5], [9]]), write, mask, cache, 0, write, key_len)


@pytest.mark.parametrize("hole", [False, True])
def test_one_token_passes_use_the_kernel_only_where_the_mask_is_a_prefix(monkeypatch, hole):
    model = build_model(tiny_args(vocab_size=64), seed=2)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    if hole:
        mask[0, 0, 0, 4:7] = False
    calls = []
    real = decode_attention.write_and_attend
    monkeypatch.setattr(decode_attention, "write_and_attend", lambda *a: calls.append(a[-1] is None) or real(*a))
    with_kernel = _one_token_pass(model, mask, 12)
    assert sum(calls) == (0 if hole else model.args.n_layers)  # calls without a tree mask
    model.decode_kernel = False
    torch.testing.assert_close(with_kernel, _one_token_pass(model, mask, 12), rtol=1e-5, atol=1e-5)


def test_an_engine_decoding_with_the_kernel_equals_recomputation(monkeypatch):
    """Rows of uneven length join and finish while others decode: every one-token step of
    the engine attends with the kernel, and greedy output is the model's own (no cache)."""
    target = build_model(tiny_args(vocab_size=64), seed=1, init_std=0.15)
    calls = []
    real = decode_attention.write_and_attend

    def counted(*args):
        assert args[-1] is None  # one-token passes only: no tree mask
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(decode_attention, "write_and_attend", counted)
    engine = NativeEngine(target, NgramDrafter(max_n=3, min_n=1), EngineConfig(max_batch_size=3, max_seq_len=128),
                          SpecPolicy.parse("off"))
    assert target.uses_decode_kernel()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (4, 13, 7, 21)]
    max_tokens = [20, 9, 25, 12]
    outputs = {i: [] for i in range(len(prompts))}
    for i in range(3):
        engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=max_tokens[i]))
    for step in range(200):
        if step == 5:
            engine.add_request("3", prompts[3], SamplingParams(max_tokens=max_tokens[3]))
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.new_token_ids)
        if step > 5 and not engine.has_unfinished():
            break
    for i, prompt in enumerate(prompts):
        assert outputs[i] == reference_greedy(target, prompt, max_tokens[i]), i
    assert max(calls) == 3  # batches of three rows ran through the kernel


def _panels(w: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the kernel's [out / 16, in, 16]."""
    return w.t().reshape(w.shape[1], w.shape[0] // 16, 16).transpose(0, 1).contiguous()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 16, 17, 64, 257])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (16, 7), (48, 1536)])
def test_the_panel_matmul_matches_f_linear(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    got = torch.ops.adaspec.panel_matmul(x, _panels(w))
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)
    w[-1, -1] += 1.0  # the last output's last weight is read
    assert not torch.allclose(torch.ops.adaspec.panel_matmul(x, _panels(w))[:, -1], got[:, -1])
    x[-1, 0] += 1.0  # and the last row of x
    assert not torch.allclose(torch.ops.adaspec.panel_matmul(x, _panels(w))[-1], got[-1])


def _panels_bf16(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.adaspec.panel_pack_bf16(w)


# (960, 576) takes the loop of the CPU's best unit (AMX, AVX512-BF16 or AVX2); 7 inputs, odd,
# take the AVX2 loop on every CPU (panel_matmul.cpp).
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 16, 17, 33, 48, 50, 64])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (16, 7)])
def test_the_bfloat16_panel_matmul_is_float32_arithmetic_rounded_once(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    got = torch.ops.adaspec.panel_matmul_bf16(x, _panels_bf16(w))
    exact = F.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16
    # float32 sums in another order, then one rounding: at most one bfloat16 step apart, mostly none
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=1e-5)
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.95
    w[-1, -1] += 1.0  # the last output's last weight is read, from where the layout puts it
    assert not torch.equal(torch.ops.adaspec.panel_matmul_bf16(x, _panels_bf16(w))[:, -1], got[:, -1])
    w[7, 0] += 1.0  # and output 7 (the high half of a lane in the interleaved layout)
    changed = torch.ops.adaspec.panel_matmul_bf16(x, _panels_bf16(w)) != got
    assert changed[:, 7].any() and not changed[:, :7].any() and not changed[:, 8:-1].any()
    # each row's outputs are the same whatever rows share the pass (what greedy exactness needs)
    alone = torch.cat([torch.ops.adaspec.panel_matmul_bf16(x[i:i + 1], _panels_bf16(w)) for i in range(rows)])
    assert torch.equal(alone, torch.ops.adaspec.panel_matmul_bf16(x, _panels_bf16(w)))


def test_the_panel_matmul_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match=r"w \[N / 16, K, 16\]"):
        torch.ops.adaspec.panel_matmul(torch.randn(1, 12), torch.randn(4, 12))
    with pytest.raises(RuntimeError, match="float32 only"):
        torch.ops.adaspec.panel_matmul(torch.randn(1, 8).bfloat16(), torch.randn(1, 8, 16).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        torch.ops.adaspec.panel_matmul_bf16(torch.randn(1, 8), torch.randn(1, 8, 16))
