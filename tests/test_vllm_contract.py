"""The vLLM contract: what adaspec relies on in vLLM 0.32, pinned against its own classes and
source, with no engine started (issue 49, item 4).

adaspec reaches into vLLM in a few places: the control channel is a utility call that the
engine core dispatches by attribute name; AdaspecScheduler (serve_app/vllm_scheduler.py)
replaces the scheduler's batch-size -> k lookup and reads its outputs and spec-decode stats;
serve_app/config.py accepts the drafting methods whose drafter drafts the k it is asked for;
serve_app/builder.py picks the model runner by which one drafts that k. An upgrade that
changes any of these fails a test here whose message says what changed and what to revisit.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import queue
import textwrap
import typing
from types import SimpleNamespace

import pytest

from serve_app.builder import V2_MODEL_RUNNER_ENV
from serve_app.config import MTP_ALIAS_SUFFIX, REFUSED_METHODS, DraftMethod

VLLM_VERSION = "0.32"


def _source(obj) -> str:
    return textwrap.dedent(inspect.getsource(obj))


def _reads_name(func, name: str) -> bool:
    """Whether `func`'s body reads the variable `name` (its parameter list aside)."""
    (tree,) = ast.parse(_source(func)).body
    return any(isinstance(n, ast.Name) and n.id == name for stmt in tree.body for n in ast.walk(stmt))


def test_installed_vllm_is_the_one_this_contract_was_read_from():
    import vllm

    assert vllm.__version__.startswith(VLLM_VERSION), (
        f"vLLM {vllm.__version__} is installed; this contract was read from {VLLM_VERSION}: re-read each item "
        f"below against the new source and update VLLM_VERSION")


# ---------------------------------------------------------------------- the control channel
class _Scheduler:
    """A stand-in for AdaspecScheduler's control entry point: a callable, truthy object."""

    def __init__(self):
        self.calls = []

    def __bool__(self) -> bool:
        return True

    def __call__(self, command: str, payload: str) -> str:
        self.calls.append((command, payload))
        return f"done {command}"


def test_engine_core_dispatches_utility_calls_by_attribute_name():
    """serve_app/vllm_engine.py calls `call_utility_async("scheduler", command, payload)`; the
    engine core must answer it with `getattr(self, "scheduler")(command, payload)`."""
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

    core = SimpleNamespace(shutdown_state=EngineShutdownState.RUNNING, output_queue=queue.Queue(),
                           scheduler=_Scheduler(),
                           _convert_msgspec_args=EngineCoreProc._convert_msgspec_args,
                           _invoke_utility_method=EngineCoreProc._invoke_utility_method)
    core._reject_utility_in_shutdown = lambda *a: EngineCoreProc._reject_utility_in_shutdown(core, *a)
    EngineCoreProc._handle_client_request(core, EngineCoreRequestType.UTILITY,
                                          (0, 7, "scheduler", ("apply_policy", "{}")))
    client, outputs = core.output_queue.get_nowait()
    out = outputs.utility_output
    assert core.scheduler.calls == [("apply_policy", "{}")], (
        "EngineCoreProc._handle_client_request no longer calls getattr(self, method_name)(*args) for a "
        "UTILITY request: adaspec's control channel (call_utility_async('scheduler', ...)) needs another route")
    assert (client, out.call_id, out.failure_message) == (0, 7, None), out.failure_message
    assert out.result.result == "done apply_policy", "the utility call's return value no longer reaches the client"
    source = _source(EngineCoreProc._handle_client_request)
    assert "getattr(self, method_name)" in source and "and method(" in source, (
        "the utility dispatch changed shape: it evaluates the attribute's truth before calling it "
        "(AdaspecScheduler.__bool__ exists for that); re-read EngineCoreProc._handle_client_request")


# ---------------------------------------------------------------------- the scheduler
def test_dynamic_sd_lookup_is_built_from_the_table_and_indexed_by_batch_size():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    lookup = build_dynamic_sd_schedule_lookup([(1, 2, 4), (3, 8, 2)], vllm_max_batch_size=8,
                                              vllm_num_speculative_tokens=4)
    assert lookup[1] == lookup[2] == 4 and lookup[3] == lookup[8] == 2, (
        f"build_dynamic_sd_schedule_lookup no longer makes a dense list indexed by batch size: {lookup}")
    init = _source(Scheduler.__init__)
    assert "self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(" in init, (
        "Scheduler.__init__ no longer builds self.dynamic_sd_lookup from num_speculative_tokens_per_batch_size: "
        "AdaspecScheduler replaces that list to change k live")
    schedule = _source(Scheduler.schedule)
    assert "self.dynamic_sd_lookup[" in schedule and "len(num_scheduled_tokens)" in schedule, (
        "Scheduler.schedule no longer reads k as self.dynamic_sd_lookup[batch size]: a pushed policy "
        "would not take effect")
    assert "num_spec_tokens_to_schedule=num_spec_tokens_to_schedule" in schedule, (
        "Scheduler.schedule no longer passes its k to the workers in SchedulerOutput.num_spec_tokens_to_schedule")


def test_the_scheduler_fields_adaspec_reads_exist():
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    init = _source(Scheduler.__init__)
    for attr in ("requests", "num_spec_tokens", "scheduler_config", "vllm_config"):
        assert f"self.{attr}" in init or hasattr(Scheduler, attr), f"Scheduler no longer sets self.{attr}"
    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    for name in ("scheduled_spec_decode_tokens", "num_spec_tokens_to_schedule", "num_scheduled_tokens",
                 "total_num_scheduled_tokens"):
        assert name in fields, f"SchedulerOutput.{name} is gone; AdaspecScheduler's StepRecords read it"
    runner_fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    for name in ("sampled_token_ids", "req_id_to_index"):
        assert name in runner_fields, f"ModelRunnerOutput.{name} is gone; AdaspecScheduler reads it"
    request = _source(Request.__init__)
    for name in ("request_id", "num_prompt_tokens", "status", "num_computed_tokens", "arrival_time"):
        assert f"self.{name}" in request or hasattr(Request, name), f"Request.{name} is gone"
    assert hasattr(Request, "num_output_tokens"), "Request.num_output_tokens is gone"
    stats = {f.name for f in dataclasses.fields(SpecDecodingStats)}
    assert {"num_drafts", "num_draft_tokens_per_pos", "num_accepted_tokens_per_pos"} <= stats, (
        f"SpecDecodingStats lost a field adaspec's per-position acceptance reads: {sorted(stats)}")


def test_the_scheduler_methods_adaspec_overrides_keep_their_signatures():
    from vllm.v1.core.sched.scheduler import Scheduler

    def params(method):
        return list(inspect.signature(method).parameters)

    assert params(Scheduler.make_stats)[:2] == ["self", "spec_decoding_stats"], (
        f"Scheduler.make_stats{inspect.signature(Scheduler.make_stats)}: its first argument is no longer the "
        f"step's SpecDecodingStats, which AdaspecScheduler captures there")
    assert "self.make_stats(\n                spec_decoding_stats," in inspect.getsource(Scheduler.update_from_output), (
        "update_from_output no longer hands the step's spec_decoding_stats to make_stats")
    assert params(Scheduler._free_request)[:2] == ["self", "request"], "Scheduler._free_request(request) changed"
    assert params(Scheduler.update_from_output) == ["self", "scheduler_output", "model_runner_output"]
    assert params(Scheduler.schedule)[0] == "self"
    counts = Scheduler.get_request_counts(SimpleNamespace(running=[1, 2], waiting=[3], kv_holding_waiting=[4]))
    assert counts == (2, 2), f"get_request_counts no longer returns (running, waiting): {counts}"


def test_async_scheduler_schedules_placeholders_at_the_steps_k():
    """Under async scheduling the drafts arrive a step late; AsyncScheduler keeps `k`
    placeholders per request so that they are scheduled for verification."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert issubclass(AsyncScheduler, Scheduler)
    assert "self._spec_token_placeholders" in _source(AsyncScheduler.__init__)
    update = _source(AsyncScheduler._update_after_schedule)
    assert "scheduler_output.num_spec_tokens_to_schedule" in update and "_spec_token_placeholders" in update, (
        "AsyncScheduler._update_after_schedule no longer sizes its draft placeholders by the step's "
        "num_spec_tokens_to_schedule: under async scheduling a live k would not be verified")
    assert "request.spec_token_ids = self._spec_token_placeholders" in update


def test_scheduler_config_honours_a_custom_scheduler_class():
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    get = SchedulerConfig.get_scheduler_cls
    assert get(SimpleNamespace(scheduler_cls="collections.OrderedDict", async_scheduling=True)).__name__ == \
        "OrderedDict", "SchedulerConfig.get_scheduler_cls no longer imports the scheduler_cls it is given"
    assert get(SimpleNamespace(scheduler_cls=None, async_scheduling=True)) is AsyncScheduler
    assert get(SimpleNamespace(scheduler_cls=None, async_scheduling=False)) is Scheduler


# ---------------------------------------------------------------------- model runners
@pytest.mark.parametrize("env,triton,v2", [(None, True, True), (None, False, False), ("0", True, False),
                                           ("1", True, True)])
def test_v2_model_runner_follows_triton_and_the_environment(monkeypatch, env, triton, v2):
    import vllm.config.vllm as vllm_config_module
    from vllm.config import VllmConfig

    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", triton)
    config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), watermark_config=None,
                             _get_v2_model_runner_unsupported_features=lambda: [])
    assert VllmConfig.use_v2_model_runner.fget(config) is v2, (
        f"VllmConfig.use_v2_model_runner with VLLM_USE_V2_MODEL_RUNNER={env} and Triton {triton} is no longer "
        f"{v2}: serve_app/builder.py's V2_MODEL_RUNNER_ENV sets that variable to pick the runner")


def test_v2_model_runner_refuses_custom_class_so_vllm_runs_v1():
    from vllm.config import VllmConfig

    assert '"custom_class"' in _source(VllmConfig._get_v2_model_runner_unsupported_features), (
        "Model Runner V2 now supports custom_class: re-read how it passes k to the proposer and revisit "
        "V2_MODEL_RUNNER_ENV['custom_class']")


# Which drafter drafts only the step's k (a lower k saves drafting work) and which always
# drafts max_k: docs/configuration.md, "Drafting methods", and serve_app/builder.py's
# V2_MODEL_RUNNER_ENV are built on these.
def test_v2_draft_model_and_multi_module_mtp_and_ngram_speculators_ignore_k():
    from vllm.v1.worker.gpu.spec_decode.multi_module_mtp.speculator import MultiModuleMTPSpeculator
    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    for cls, method in ((StandaloneARSpeculator, "draft_model"), (MultiModuleMTPSpeculator, "mtp"),
                        (NgramGPUSpeculator, "ngram")):
        assert not _reads_name(cls.propose, "num_speculative_tokens"), (
            f"V2's {cls.__name__}.propose now reads the k it is passed: it may draft only k. Re-measure, then "
            f"revisit V2_MODEL_RUNNER_ENV[{method!r}] in serve_app/builder.py and docs/configuration.md's table")
        assert method in V2_MODEL_RUNNER_ENV and V2_MODEL_RUNNER_ENV[method] == "0"
    assert "for step in range(1, self.num_speculative_steps)" in _source(StandaloneARSpeculator._multi_step_decode)
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert "draft_tokens[:, num_spec_tokens:] = -1" in _source(GPUModelRunner.sample_tokens), (
        "V2 no longer masks the drafts past the step's k")


def test_v2_eagle_and_mtp_speculator_drafts_only_k():
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
    from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import TargetDependentARSpeculator

    assert issubclass(EagleSpeculator, TargetDependentARSpeculator)
    assert issubclass(MTPSpeculator, TargetDependentARSpeculator)
    assert EagleSpeculator.propose is TargetDependentARSpeculator.propose, "V2's EagleSpeculator overrides propose"
    assert _reads_name(TargetDependentARSpeculator.propose, "num_speculative_tokens")  # and the check can see it
    source = _source(TargetDependentARSpeculator.propose)
    assert "if num_speculative_tokens <= 1:" in source, (
        "V2's EAGLE speculator no longer stops after the first draft for k <= 1: re-read whether it drafts "
        "only k, and whether eagle/eagle3 may keep vLLM's default runner (V2_MODEL_RUNNER_ENV)")
    for method in ("eagle", "eagle3"):
        assert method not in V2_MODEL_RUNNER_ENV


def test_v1_proposers_draft_only_k_but_the_gpu_ngram_one_asserts_max_k():
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.spec_decode.medusa import MedusaProposer
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer
    from vllm.v1.spec_decode.ngram_proposer_gpu import NgramProposerGPU

    base = _source(SpecDecodeBaseProposer.propose)
    assert "self.num_speculative_tokens = num_speculative_tokens" in base
    assert "for token_index in range(self.num_speculative_tokens - 1):" in base, (
        "V1's EAGLE / draft-model proposer no longer drafts num_speculative_tokens passes")
    assert "if self.num_speculative_tokens == 0:" in base, (
        "V1's proposer changed what it does for k = 0 (it ran one pass to keep the drafter's KV cache)")
    assert "assert num_speculative_tokens <= self.k" in _source(NgramProposer.propose)
    assert "assert num_speculative_tokens == self.k" in _source(NgramProposerGPU.propose), (
        "V1's GPU n-gram proposer no longer asserts max_k: it may run under V1 (V2_MODEL_RUNNER_ENV['ngram_gpu'], "
        "and the accelerator check in serve_app/config.py)")
    assert "assert num_speculative_tokens == self.num_speculative_tokens" in _source(MedusaProposer.propose), (
        "V1's Medusa proposer no longer asserts max_k: REFUSED_METHODS['medusa'] states a reason that changed")


def test_v1_runner_passes_k_to_every_drafter_but_custom_class():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    source = _source(GPUModelRunner.propose_draft_token_ids)
    start = source.index('spec_config.method == "custom_class"')
    branch = source[start:source.index("elif", start)]
    assert "num_spec_tokens_to_schedule" not in branch, (
        "V1 now passes the step's k to a custom_class proposer: update docs/configuration.md's table")
    assert source.count("num_spec_tokens_to_schedule,") + source.count(
        "num_speculative_tokens=num_spec_tokens_to_schedule") >= 5


# ---------------------------------------------------------------------- drafting methods
def _flat_literal(tp) -> set[str]:
    out: set[str] = set()
    for arg in typing.get_args(tp):
        out |= _flat_literal(arg) if typing.get_origin(arg) is typing.Literal else {arg}
    return out


def test_every_vllm_drafting_method_is_accepted_or_refused_with_a_reason():
    from vllm.config.speculative import MTPModelTypes, SpeculativeMethod

    vllm_methods = _flat_literal(SpeculativeMethod)
    accepted = set(typing.get_args(DraftMethod))
    aliases = {m for m in _flat_literal(MTPModelTypes) if m != "mtp"}
    assert all(a.endswith(MTP_ALIAS_SUFFIX) for a in aliases), (
        f"a new MTP alias does not end in {MTP_ALIAS_SUFFIX}: {sorted(aliases)}")
    assert accepted <= vllm_methods, f"vLLM no longer has {sorted(accepted - vllm_methods)}"
    unknown = vllm_methods - accepted - set(REFUSED_METHODS) - aliases
    assert not unknown, (f"vLLM {VLLM_VERSION}+ added drafting methods {sorted(unknown)}: read whether their "
                         f"drafter drafts k on demand, then accept them in DraftMethod or refuse them in "
                         f"REFUSED_METHODS with the reason")
    assert not set(REFUSED_METHODS) - vllm_methods, f"vLLM dropped {sorted(set(REFUSED_METHODS) - vllm_methods)}"


def test_vllm_renames_mtp_aliases_and_reads_custom_class_from_model():
    from vllm.config.speculative import SpeculativeConfig

    post_init = _source(SpeculativeConfig.__post_init__)
    assert 'self.method in get_args(MTPModelTypes) and self.method != "mtp"' in post_init, (
        "vLLM no longer renames model-specific MTP methods to mtp: serve_app/config.py refuses them saying so")
    assert "method='custom_class' requires 'model' to contain the" in post_init, (
        "custom_class no longer reads the proposer's import path from speculative_config.model "
        "(serve_app/builder.py passes proposer_class there)")
    assert SpeculativeConfig._is_custom_proposer_path("my_pkg.drafters.MyProposer")
