"""Weights on 2 MB pages (native_engine/huge_pages.py): where the copies start, that they hold
the same values in the order given, that Linux really backs them with huge pages where it
can, and that a prepared model's panel copies sit in one region in the order a forward reads
them, with the same outputs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from native_engine import cpu_kernels, huge_pages
from native_engine.attention import causal_mask
from native_engine.cpu_linear import CpuLinear, gather_panels
from native_engine.model import build_model
from native_engine.testing import tiny_args


def test_empty_starts_on_a_huge_page_boundary():
    for numel, dtype in ((1, torch.float32), (3 << 20, torch.float32), (5 << 20, torch.bfloat16)):
        t = huge_pages.empty(numel, dtype)
        assert t.numel() == numel and t.dtype == dtype and t.data_ptr() % huge_pages.PAGE == 0


def test_gather_copies_in_order_into_one_region():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen) for shape in ((3, 5, 16), (7,), (2, 64, 16))]
    copies = huge_pages.gather(tensors)
    for t, c in zip(tensors, copies):
        assert c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
    ends = [c.data_ptr() + c.numel() * c.element_size() for c in copies]
    assert [c.data_ptr() for c in copies[1:]] == ends[:-1]  # one after another
    assert copies[0].untyped_storage().data_ptr() == copies[2].untyped_storage().data_ptr()


def _mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of this process's mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            if inside:
                break
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() not in ("always", "madvise"),
                    reason="Linux with transparent huge pages on (always or madvise)")
def test_the_region_is_advised_huge_and_the_allocators_memory_is_not():
    """The region carries the advice (VmFlags `hg`). Whether Linux then grants 2 MB pages depends
    on the free memory of the moment (in the full test suite, with its servers up, it granted
    none), so AnonHugePages is only reported."""
    t = huge_pages.gather([torch.ones(3 << 20)])[0]  # 12 MB
    region = _mapping(t.data_ptr())
    assert "hg" in region["VmFlags"].split(), region
    plain = torch.ones(3 << 20)
    assert "hg" not in _mapping(plain.data_ptr()).get("VmFlags", "").split()
    print("AnonHugePages of the region:", region.get("AnonHugePages"))


@pytest.mark.skipif(not cpu_kernels.load(), reason="the panel kernel needs an x86 CPU with AVX2 and a C++ compiler")
def test_a_models_panels_sit_in_forward_order_in_one_region_with_the_same_outputs():
    model = build_model(tiny_args(vocab_size=64), seed=3).eval()
    tokens, positions = torch.tensor([[5, 9, 2]]), torch.arange(3)[None]
    mask = causal_mask(torch.tensor([3]), 3)
    with torch.no_grad():
        want = model.logits(model(tokens, positions, mask))
    model.prepare_for_serving()
    linears = [m for layer in model.model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    linears.append(model.lm_head)
    assert all(isinstance(m, CpuLinear) for m in linears)
    for m in linears:
        m.use(("panels",) * 4)
    gather_panels(model)
    panels = [m.weight_panels for m in linears]
    assert panels[0].data_ptr() % huge_pages.PAGE == 0
    assert [p.data_ptr() for p in panels[1:]] == [p.data_ptr() + p.numel() * 4 for p in panels[:-1]]
    with torch.no_grad():
        got = model.logits(model(tokens, positions, mask))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
