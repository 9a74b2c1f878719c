"""The native engine's compiled decode pass (native_engine/compiled_decode.py): torch.compile
(inductor) on a tiny random model, prepared for serving as a replica prepares it.

What must hold: greedy output identical to the model's own greedy decoding (eager) with
requests of uneven lengths joining and leaving (the masked one-token passes) and with
speculation (chains and trees: compiled one-token passes, compiled verify passes at batch 1,
eager ones at wider batches); three graphs compiled at warm-up and none after, whatever the
key lengths, batch sizes, token counts and cache rows. The real-stack
check is tests/test_native_serving.py (configs/app-tree.yaml compiles its decode pass)."""

from __future__ import annotations

import pytest
import torch

from adaspec.policy import SpecPolicy
from native_engine import cpu_kernels
from native_engine.drafters import NgramDrafter
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.cpu_linear import CpuLinear, compiled_matmul_path
from native_engine.model import build_model
from native_engine.requests import SamplingParams
from native_engine.testing import reference_greedy, tiny_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def compiled():
    """An engine whose target runs its one-token passes compiled, and the graphs it compiled.
    Compiled on one thread, as the tests run (one_torch_thread): a compiled graph is kept for
    the thread count it was compiled under."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # init_std 0.15 makes a random model repeat itself, so n-gram drafts get accepted.
    model = build_model(tiny_args(vocab_size=64), seed=1, init_std=0.15).prepare_for_serving()
    # Eager, passes of up to 2 rows take the one-token matmul path and wider ones the packed
    # path (the route is measured per machine; fixed here): the warm-up's two rows sit inside
    # that range and the tests' three rows outside it, so a graph guarded on that branch would
    # recompile at three rows.
    for m in model.modules():
        if isinstance(m, CpuLinear):
            m.use(("gemv", "gemv", "gemv", "packed"))
    engine = NativeEngine(model, NgramDrafter(max_n=3, min_n=1), EngineConfig(max_batch_size=3, max_seq_len=160))
    before = _graphs_compiled()
    seconds = engine.compile_decode()
    print(f"\ncompile_decode: {seconds:.1f} s, {_graphs_compiled() - before} graphs")
    torch.set_num_threads(threads)
    return engine, _graphs_compiled() - before


@pytest.fixture(scope="module")
def eager_model():
    return build_model(tiny_args(vocab_size=64), seed=1, init_std=0.15)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (5, 11, 3, 8, 17)]


@pytest.mark.parametrize("policy", ["off", "chain3", "tree3x2x1"])
def test_compiled_decode_equals_eager_greedy_and_never_recompiles(compiled, eager_model, policy):
    engine, warm_up_graphs = compiled
    assert warm_up_graphs == 3  # one row; the batch size symbolic; one row, the token count symbolic
    engine.apply_policy(SpecPolicy.parse(policy, version=engine.policy.version + 1))
    prompts, max_tokens = _prompts(), [40, 25, 48, 12, 33]
    before = _graphs_compiled()
    compiled_shapes = []  # [rows, tokens] of each pass the compiled graph ran
    run_compiled = engine.model.compiled_decode
    engine.model.compiled_decode = lambda tokens, *rest: (compiled_shapes.append(tuple(tokens.shape)),
                                                          run_compiled(tokens, *rest))[1]
    engine.drain()
    outputs = [[] for _ in prompts]
    try:
        # Five requests through three rows (uneven lengths, rows refilled as requests
        # finish), then the first alone: a batch of one, whose verify passes run compiled.
        for batch in (range(len(prompts)), [0]):
            alone_from = len(compiled_shapes)
            for i in batch:
                outputs[i] = []
                engine.add_request(f"{policy}-{i}", prompts[i], SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
            while engine.has_unfinished():
                for out in engine.step():
                    outputs[int(out.request_id.split("-")[1])] += out.new_token_ids
    finally:
        engine.model.compiled_decode = run_compiled
    for prompt, n, out in zip(prompts, max_tokens, outputs):
        assert out == reference_greedy(eager_model, prompt, n)
    assert _graphs_compiled() == before, "a key length, batch size, token count or mask recompiled the decode pass"
    assert (1, 1) in compiled_shapes and (3, 1) in compiled_shapes
    if policy != "off":  # verify passes of several token counts ran compiled at batch 1
        assert any(s.num_drafts for s in engine.drain().steps)
        alone = compiled_shapes[alone_from:]  # one prefill of several tokens, then decode passes
        assert sum(rows == 1 and tokens > 1 for rows, tokens in alone) > 1, alone


def test_compile_decode_refuses_a_busy_engine(compiled):
    engine, _ = compiled
    engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before the engine takes requests"):
        engine.compile_decode()
    while engine.has_unfinished():
        engine.step()


def test_autotuned_compile_uses_inductors_gemm_kernels_and_gives_the_eager_greedy_tokens(eager_model):
    """compile_decode(autotune=True) (the app's compile_autotune): inductor generates its own
    C++ GEMM kernels for the model's matmuls (timing them against the library's where both
    apply: at these tiny shapes only its own do), and the tokens stay the eager model's."""
    from torch._dynamo.utils import counters

    model = build_model(tiny_args(vocab_size=64), seed=1, init_std=0.15).prepare_for_serving()
    engine = NativeEngine(model, NgramDrafter(max_n=3, min_n=1), EngineConfig(max_batch_size=2, max_seq_len=160),
                          SpecPolicy.parse("chain3"))
    templated = counters["inductor"]["cpp_templated_kernel_counter"]
    engine.compile_decode(autotune=True)
    assert counters["inductor"]["cpp_templated_kernel_counter"] > templated, "no GEMM kernel of inductor's own"
    prompts = _prompts()[:2]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out == reference_greedy(eager_model, prompt, 24)


def _compiled_on(route: tuple[str, ...], seed: int, rows: int = 2) -> NativeEngine:
    """A tiny model's engine compiled with the given matmul route and inductor's Python
    wrapper, whose library calls a profiler sees (the C++ wrapper calls them unseen)."""
    model = build_model(tiny_args(vocab_size=64), seed=seed, init_std=0.15).prepare_for_serving()
    for m in model.modules():
        if isinstance(m, CpuLinear):
            m.use(route)
    engine = NativeEngine(model, None, EngineConfig(max_batch_size=rows, max_seq_len=160))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests run: another thread count would recompile, unfrozen
    engine.compile_decode(cpp_wrapper=False)
    torch.set_num_threads(threads)
    return engine


@pytest.fixture(scope="module")
def compiled_on_onednn(compiled):
    """A second model (other weights, the same shapes) compiled after `compiled`, its measured
    route putting every pass on oneDNN's prepacked matmul (as on the AMD EPYC it does)."""
    return _compiled_on(("packed", "packed"), seed=7)


def test_a_second_model_in_the_process_runs_its_own_weights(compiled_on_onednn):
    """Dynamo keeps graphs per code object and the module guards are skipped: without a code
    object per model, this model (other weights, same shapes) would run the first one's graph."""
    other = build_model(tiny_args(vocab_size=64), seed=7, init_std=0.15)
    prompt = _prompts()[0]
    out = compiled_on_onednn.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out == reference_greedy(other, prompt, 16)


def _matmul_ops_of_one_compiled_step(engine: NativeEngine, batch: int = 1) -> dict[str, int]:
    """The matmul ops (and their calls) a decode step of `batch` rows runs: the compiled
    one-row graph at batch 1, the symbolic-batch one above; the lm_head is eager and takes
    its own route."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(batch):
        engine.add_request(f"profiled{i}", _prompts()[1 + i], SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(3):  # prefill, then decode steps
        engine.step()
    calls = []
    run_compiled = engine.model.compiled_decode
    engine.model.compiled_decode = lambda *a: (calls.append(1), run_compiled(*a))[1]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
    finally:
        engine.model.compiled_decode = run_compiled
    while engine.has_unfinished():
        engine.step()
    assert calls, "the step did not run the compiled graph"
    return {e.key: e.count for e in prof.key_averages()
            if e.key in ("mkldnn::_linear_pointwise", "mkl::_mkl_linear", "adaspec::panel_matmul")}


def test_the_compiled_graph_calls_the_matmul_the_measured_route_chose(compiled_on_onednn):
    """Where one-token passes were measured fastest on oneDNN's prepacked matmul, the batch-1
    graph calls it; elsewhere inductor packs the weights itself (MKL's packed sgemm at a fixed
    row count, where torch has MKL)."""
    assert set(_matmul_ops_of_one_compiled_step(compiled_on_onednn)) == {"mkldnn::_linear_pointwise"}
    if torch._C.has_mkl:
        assert "mkl::_mkl_linear" in _matmul_ops_of_one_compiled_step(_compiled_on(("gemv", "gemv", "packed"), seed=3))


def test_a_graph_compiled_on_the_panels_route_calls_adaspecs_kernel_and_decodes_exactly():
    if not cpu_kernels.load():
        pytest.skip("adaspec's CPU kernels need an x86 CPU with AVX2 and a C++ compiler")
    # One and two rows on the kernel, wider passes on oneDNN: the graphs split at three rows.
    engine = _compiled_on(("panels", "panels", "panels", "packed"), seed=5, rows=3)
    before = _graphs_compiled()
    assert set(_matmul_ops_of_one_compiled_step(engine)) == {"adaspec::panel_matmul"}
    per_step = 4 * engine.model.args.n_layers + 1  # 4 matmuls a layer, and the eager lm_head
    assert _matmul_ops_of_one_compiled_step(engine, batch=2)["adaspec::panel_matmul"] == per_step
    # Three rows: inductor's graph (its oneDNN matmuls) and the lm_head on oneDNN too.
    assert "adaspec::panel_matmul" not in _matmul_ops_of_one_compiled_step(engine, batch=3)
    assert _graphs_compiled() == before, "the warm-up left a row count to compile mid-serving"
    prompt = _prompts()[2]
    out = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert out == reference_greedy(build_model(tiny_args(vocab_size=64), seed=5, init_std=0.15), prompt, 16)


def test_compiled_matmul_path_follows_the_one_token_route_packed_in_float32_only():
    linear = CpuLinear(torch.nn.Linear(16, 16, bias=False))
    if linear.packed is None:
        pytest.skip("no oneDNN in this torch build")
    linear.use(("packed", "packed"))
    assert compiled_matmul_path(linear, autotune=False) == "packed"
    assert compiled_matmul_path(linear, autotune=True) == "inductor"  # inductor times its own kernels
    linear.use(("gemv", "gemv", "packed"))  # wider passes packed, one token not
    assert compiled_matmul_path(linear, autotune=False) == "inductor"
    linear.use(("panels", "panels", "packed"))
    assert compiled_matmul_path(linear, autotune=False) == "panels"
    assert compiled_matmul_path(linear, autotune=True) == "inductor"
    bf16 = CpuLinear(torch.nn.Linear(16, 16, bias=False).to(torch.bfloat16))
    bf16.use(("packed", "packed"))
    assert compiled_matmul_path(bf16, autotune=False) == "inductor"  # inductor picks oneDNN in bf16 itself
    if cpu_kernels.load():
        bf16.use(("panels", "panels"))
        assert compiled_matmul_path(bf16, autotune=False) == "panels"
