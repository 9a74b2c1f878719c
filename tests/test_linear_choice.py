"""The matmul path of a CPU model's linears is measured per token count, not assumed, and so is
the dtype of `dtype: auto`; each measurement is cached per machine and model
(native_engine/linear_choice.py, native_engine/dtype_choice.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from native_engine import cpu_kernels, dtype_choice, linear_choice, machine_cache
from native_engine.attention import causal_mask
from native_engine.cpu_linear import CpuLinear
from native_engine.linear_choice import PATHS, TOKEN_COUNTS, LinearChoice
from native_engine.kv_cache import KVCache
from native_engine.model import build_model
from native_engine.testing import tiny_args

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN: one path only")]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADASPEC_CACHE_DIR", str(tmp_path))


class SlowPathClock:
    """A clock that only the slowed path moves: each call of it costs one second, everything
    else nothing, so which path is faster does not depend on the machine."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def slowed(self, method):
        def slow(linear, *args):
            self.now += 1.0
            return method(linear, *args)
        return slow


def _linears(model) -> list[CpuLinear]:
    return [m for m in model.modules() if isinstance(m, CpuLinear)]


def _skip_without_kernels(path: str) -> None:
    if path == "panels" and not cpu_kernels.load():
        pytest.skip("adaspec's CPU kernels need an x86 CPU with AVX2 and a C++ compiler")


@pytest.mark.parametrize("fast", PATHS)
def test_the_fastest_path_is_chosen_when_the_others_are_made_slow(monkeypatch, fast):
    _skip_without_kernels(fast)
    model = build_model(tiny_args(), seed=1).prepare_for_serving()
    clock = SlowPathClock()
    for path in PATHS:
        if path != fast:
            method = getattr(CpuLinear, f"_{path}")
            monkeypatch.setattr(CpuLinear, f"_{path}", clock.slowed(method))
    choice = linear_choice.measure(model, _linears(model), clock)
    assert choice.path_by_tokens == dict.fromkeys(TOKEN_COUNTS, fast), choice
    assert all(choice.times_ms[fast][t] < choice.times_ms[p][t] for t in TOKEN_COUNTS for p in PATHS if p != fast)


def test_a_path_that_wins_only_at_some_token_counts_gets_only_those():
    """Passes of r rows take the winner at the smallest timed count >= r; above the largest,
    the packed layout; the [out, in] copy exists only where a route uses it."""
    choice = LinearChoice({1: "gemv", 2: "linear", 3: "linear", 4: "packed", 8: "packed"})
    route = choice.route()
    assert route[1:4] == ("gemv", "linear", "linear") and set(route[4:]) == {"packed"}
    assert str(choice) == "matmul path by tokens per pass 1: gemv, 2-3: linear, 4+: packed (measured)"
    linear = CpuLinear(torch.nn.Linear(16, 24, bias=False))
    linear.use(route)
    assert linear.weight_out_in is not None and torch.equal(linear.weight_out_in, linear.weight)
    calls = []
    for path in PATHS:
        method = getattr(linear, f"_{path}")
        setattr(linear, f"_{path}", lambda *a, path=path, method=method: calls.append(path) or method(*a))
    with torch.no_grad():
        for rows in (1, 2, 3, 4, 9, 40):
            linear(torch.randn(rows, 16))
    assert calls == ["gemv", "linear", "linear", "packed", "packed", "packed"]
    linear.use(LinearChoice(dict.fromkeys(TOKEN_COUNTS, "gemv")).route())
    assert linear.weight_out_in is None


def test_bfloat16_decode_steps_and_verify_passes_take_one_path():
    """In bfloat16 a path that wins only at some token counts does not get them: every pass
    but a prefill takes the path of least time summed over the counts up to STEP_TOKENS (a
    token's logits must not depend on the pass that computes it; see linear_choice's
    docstring); prefills keep the fastest per count, and a prefill's linears take it."""
    wide = 2 * linear_choice.STEP_TOKENS
    choice = LinearChoice({1: "panels", 2: "panels", 4: "packed", wide: "packed"},
                          {"panels": {1: 1.0, 2: 1.0, 4: 9.0, wide: 99.0}, "packed": {1: 2.0, 2: 2.0, 4: 3.0, wide: 3.0}})
    steps = linear_choice.one_path(choice)
    assert choice.route()[1] == "panels" and set(steps.route()) == {"packed"}
    assert steps.prefill_route() == choice.route() and steps.route() != choice.route()
    assert str(steps).startswith("matmul path of decode steps and verify passes packed, of prefills by tokens 1-2: panels")
    # the wide count does not vote: panels is faster up to STEP_TOKENS
    choice.times_ms["panels"][4] = 2.0
    assert set(linear_choice.one_path(choice).route()) == {"panels"}

    model = build_model(tiny_args(), dtype=torch.bfloat16, seed=1).prepare_for_serving()
    assert {len(set(m.route)) for m in _linears(model)} == {1}
    linear = _linears(model)[0]
    linear.use(("gemv",) * 4, ("linear",) * 4)
    calls = []
    for path in ("gemv", "linear"):
        method = getattr(linear, f"_{path}")
        setattr(linear, f"_{path}", lambda *a, path=path, method=method: calls.append(path) or method(*a))
    tokens = torch.tensor([[5, 1, 4]])
    with torch.no_grad():
        model(tokens, torch.arange(3)[None], causal_mask(torch.tensor([3]), 3))
        cache = KVCache.allocate(model.args.n_layers, 1, model.args.n_kv_heads, 16, model.args.head_dim,
                                 model.cache_dtype())
        model(tokens, torch.arange(3)[None], None, cache, prompt_lengths=(3,))
    assert calls == ["gemv", "linear"]  # a pass, then a prefill


def test_preparing_a_model_applies_the_choice_and_a_restart_reads_it_from_the_cache(monkeypatch):
    model = build_model(tiny_args(), seed=1).prepare_for_serving()
    first = model.linear_choice
    assert first is not None and not first.cached
    assert {m.route for m in _linears(model)} == {first.route()}
    assert machine_cache.cache_file(linear_choice.CACHE).is_file()

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(linear_choice, "measure", no_measuring)
    again = build_model(tiny_args(), seed=2).prepare_for_serving()  # same shape and dtype, other weights
    assert again.linear_choice.cached and again.linear_choice.path_by_tokens == first.path_by_tokens
    assert str(again.linear_choice).endswith("(cached)")
    with pytest.raises(AssertionError, match="measured again"):  # another shape is measured
        build_model(tiny_args(vocab_size=50), seed=2).prepare_for_serving()


def test_every_path_gives_the_same_logits():
    model = build_model(tiny_args(), seed=3, init_std=0.1).prepare_for_serving()
    tokens = torch.tensor([[5, 1, 4]])
    pos = torch.arange(3)[None]

    out = {}
    with torch.no_grad():
        for path in linear_choice.paths_for(_linears(model)):
            for m in _linears(model):
                m.use((path,) * 4)
            out[path] = model.logits(model(tokens, pos, causal_mask(torch.tensor([3]), 3)))
    assert torch.allclose(out["gemv"], out["packed"], atol=1e-5)
    assert torch.allclose(out["gemv"], out["linear"], atol=1e-5)
    assert torch.allclose(out["gemv"], out["panels"], atol=1e-5)


def _tiny_folder(folder):
    """A tiny random Llama as an HF safetensors folder (config.json + model.safetensors)."""
    import json

    from safetensors.torch import save_file

    a = tiny_args()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": a.vocab_size, "hidden_size": a.dim,
        "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim, "intermediate_size": a.intermediate_size, "max_position_embeddings": a.max_position}))
    save_file({k: v.contiguous() for k, v in build_model(a, seed=4).state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def test_the_faster_dtype_is_chosen_when_the_other_is_made_slow():
    models = {name: build_model(tiny_args(), dtype=dt, seed=1).prepare_for_serving()
              for name, dt in dtype_choice.DTYPES.items()}
    for slow, fast in (("bfloat16", torch.float32), ("float32", torch.bfloat16)):
        clock = SlowPathClock()
        model = models[slow]
        model.forward = clock.slowed(type(model).forward).__get__(model)
        try:
            choice = dtype_choice.measure(models, clock)
        finally:
            del model.forward
        assert choice.dtype == fast and choice.reason == "measured", choice
        assert choice.times_ms[slow] > choice.times_ms[str(fast).removeprefix("torch.")]


@pytest.mark.skipif(not dtype_choice.cpu_has_bf16(), reason="this CPU has no oneDNN bfloat16: float32 by rule")
def test_auto_dtype_is_measured_once_then_cached_and_served(tmp_path, monkeypatch):
    from serve_app.native_adapter import NativeSettings, build_engine

    folder = _tiny_folder(tmp_path / "tiny")
    first = dtype_choice.choose(folder)
    assert first.reason == "measured" and set(first.times_ms) == {"float32", "bfloat16"}
    assert first.dtype == dtype_choice.DTYPES[min(first.times_ms, key=first.times_ms.get)]

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(dtype_choice, "measure", no_measuring)
    again = dtype_choice.choose(folder)
    assert (again.dtype, again.reason, again.times_ms) == (first.dtype, "cached", pytest.approx(first.times_ms))
    settings = NativeSettings(model_path=str(folder), draft_method="ngram", max_k=4, policy="off", dtype="auto",
                              max_batch_size=2, max_model_len=64, torch_threads=1)
    assert build_engine(settings).model.lm_head.weight.dtype == first.dtype


def test_a_cpu_without_bf16_runs_auto_in_float32(tmp_path, monkeypatch):
    monkeypatch.setattr(dtype_choice, "cpu_has_bf16", lambda: False)
    choice = dtype_choice.choose(_tiny_folder(tmp_path / "tiny"))
    assert choice.dtype == torch.float32 and "no oneDNN bfloat16" in choice.reason


def test_writers_of_the_cache_at_once_lose_no_entry(monkeypatch):
    """Two replicas caching different keys at once: the second waits for the first to have
    added its entry, so both are kept (read, add, replace under one lock)."""
    read_text = Path.read_text
    first_has_read, go_on = threading.Event(), threading.Event()

    def slow_first_read(path, *args, **kwargs):
        text = read_text(path, *args, **kwargs)
        if threading.current_thread().name == "first" and path.name == "entries.json":
            first_has_read.set()
            go_on.wait(10)
        return text

    machine_cache.write_cached("entries.json", "existing", {"v": 0})
    monkeypatch.setattr(Path, "read_text", slow_first_read)
    first = threading.Thread(target=machine_cache.write_cached, args=("entries.json", "a", {"v": 1}), name="first")
    second = threading.Thread(target=machine_cache.write_cached, args=("entries.json", "b", {"v": 2}), name="second")
    first.start()
    assert first_has_read.wait(10)
    second.start()
    second.join(0.5)  # under the lock the second cannot write while the first holds what it read
    assert second.is_alive()
    go_on.set()
    first.join(10)
    second.join(10)
    for key, value in (("existing", 0), ("a", 1), ("b", 2)):
        assert machine_cache.read_cached("entries.json", key)["v"] == value
