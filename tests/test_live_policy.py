"""Live speculation control and per-step telemetry through the real stack (issue: replica control).

Each test pushes its own policy (versions are wall-clock milliseconds, so later pushes win)
and reads the replica's step records back through the admin routes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from adaspec.policy import SpecConfig, SpecPolicy
from testkit.clients import (MODEL, URL, acceptance_after_off, complete, drafted_depth, policy_of, push_policy,
                             replica_status, replica_steps, set_controller)
from testkit.metrics import check_acceptance_agrees_with_vllm, counter_sum
from testkit.prompts import LOOPING, PROMPTS, REPETITIVE
from testkit.waits import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def controller_paused(server):
    """These tests set policies by hand; the adaptive controller would override them."""
    import httpx

    with httpx.Client(base_url=URL, timeout=60) as c:
        assert set_controller(c, "pause")["paused"]
        yield
        set_controller(c, "resume")


ADASPEC = str(Path(sys.executable).parent / "adaspec")


def _applied_version(acks: list[dict]) -> int:
    assert acks and all(a["status"] == "applied" for a in acks), acks
    return acks[0]["version_in_force"]


class InFlight:
    """One greedy `ignore_eos` completion sent from a thread; `.result` once it has returned."""

    def __init__(self, client, max_tokens: int, prompt: str = REPETITIVE):
        self.result: dict | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(client, prompt, max_tokens))
        self._thread.start()

    def _run(self, client, prompt: str, max_tokens: int) -> None:
        try:
            # ignore_eos: identical greedy sequences would otherwise all stop at the same EOS.
            self.result = complete(client, prompt, max_tokens=max_tokens, ignore_eos=True)
        except BaseException as e:  # surfaced by join()
            self.error = e

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> dict:
        self._thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _running_in_engine(client, n: int) -> bool:
    return replica_status(client)[0]["running"] >= n


def test_chain4_steps_draft_four_tokens(client):
    version = _applied_version(push_policy(client, "chain4"))
    complete(client, REPETITIVE, max_tokens=48)
    steps = replica_steps(client, version)
    assert steps, "no steps recorded under the new policy"
    assert {s["config"] for s in steps} == {"chain4"}
    assert max(drafted_depth(s) for s in steps) == 4


def test_off_takes_effect_at_the_next_step_while_requests_flow(client):
    _applied_version(push_policy(client, "chain4"))
    start = time.time()
    # Under chain4 a step adds at most 5 tokens, so 1024 tokens take at least 205 steps; the
    # switch below is pushed a few polls after the first drafting step. (256 tokens, 52 steps,
    # once ended before the switch on a CI machine whose steps were fast.)
    request = InFlight(client, max_tokens=1024)
    wait_until(lambda: [s for s in replica_steps(client, since=start) if s["config"] == "chain4" and s["num_drafts"] > 0],
               "a decode step of the request drafting under chain4")
    acks = push_policy(client, "off")
    returned_at = time.time()
    version = _applied_version(acks)
    assert request.running, "the request finished before the switch; it must be longer"
    assert request.join()["usage"]["completion_tokens"] == 1024  # the request was not disturbed

    after = replica_steps(client, since=returned_at)
    # Still running when the switch returned, so the rest of its tokens came one per step.
    assert len(after) >= 10, f"only {len(after)} steps after the switch"
    # Every step that started after apply_policy returned runs the new policy...
    assert {s["policy_version"] for s in after} == {version}
    assert {s["config"] for s in after} == {"off"}
    # ...and after the one step that verifies drafts made under chain4, nothing is drafted.
    assert all(s["num_drafts"] == 0 for s in after[1:])


def test_prompt_lookup_drafts_as_well_right_after_off(client):
    """No stale drafter state (issue 51, item 3) for prompt lookup, which keeps none: the
    n-gram match reads the request's tokens, all of them, whatever ran before."""
    throughout, after_off = acceptance_after_off(client, LOOPING)
    print(f"\n[ngram] tokens per chain4 step: {throughout:.2f} throughout, {after_off:.2f} after off")
    assert throughout >= 2.0, throughout
    assert after_off >= 0.8 * throughout, (throughout, after_off)


def test_mixed_table_follows_the_running_batch_size(client):
    table = "1-1:chain4,2-2:chain2,3+:off"
    policy = SpecPolicy.parse(table)
    version = _applied_version(push_policy(client, table))
    # The shortest request joins two that the engine is already running, so it runs at batch 3
    # (off: one token a step) from its first step. The two long ones add at most 3 tokens a step
    # (chain2) until it arrives, so 512 tokens outlast its 48 steps even if it arrives 150 steps
    # late. (With 192 it once arrived so late in the full suite that it ran mostly alone.)
    long_ones = [InFlight(client, max_tokens=n) for n in (512, 768)]
    wait_until(lambda: _running_in_engine(client, 2), "two long requests running in the engine")
    short = InFlight(client, max_tokens=48)
    for r in (short, *long_ones):
        r.join()
    steps = replica_steps(client, version)
    assert len({s["batch_size"] for s in steps}) >= 2, "the batch size never changed"
    for s in steps:
        assert s["config"] == str(policy.config_for(s["batch_size"])), s
    # Drafts verified in a step were proposed under the previous step's config.
    for prev, cur in zip(steps, steps[1:]):
        assert drafted_depth(cur) <= SpecConfig.parse(prev["config"]).depth, (prev, cur)
    # Each finished request is recorded with the config that ran most of its steps: the
    # shortest ran at batch 3 (off) throughout, the longest finished alone.
    since = min(s["time"] for s in steps) - 30
    records = {r["output_tokens"]: r for r in replica_status(client)[0]["requests"] if r["finish_time"] > since}
    assert {48, 512, 768} <= set(records), records
    assert records[48]["config"] == "off", records
    assert records[48]["mean_batch"] > records[768]["mean_batch"]
    assert all(records[n]["finish_time"] - records[n]["arrival_time"] > 0 for n in (48, 512, 768))


def test_invalid_policies_are_rejected_and_the_old_one_stays(client):
    version = _applied_version(push_policy(client, "chain2"))
    for table, reason in [("chain8", "k <= 4"), ("tree2x2", "tree"), ("1-4:chain2", "covers")]:
        (ack,) = push_policy(client, table)
        assert ack["status"] == "rejected" and reason in ack["message"], ack
        assert ack["version_in_force"] == version
    (stale,) = push_policy(client, "chain1", version=version - 1)
    assert stale["status"] == "ignored_stale"
    resp = client.post("/admin/policy", json={"table": "1-2:chainX"})
    assert resp.status_code == 400 and "chainX" in resp.json()["error"]["message"]
    status = replica_status(client)[0]
    assert policy_of(status).version == version and str(policy_of(status)) == "1+:chain2"


def test_acceptance_agrees_with_vllm_counters(server, client):
    """Under chain4, vLLM really speculates with n-gram drafts (its draft-token counter grows)
    and the replica's step records count the same accepted tokens per position as vLLM's own
    counters."""
    _applied_version(push_policy(client, "chain4"))
    drafts = "ray_vllm_spec_decode_num_draft_tokens_total"
    before = counter_sum(server.metrics_text(), drafts)
    check_acceptance_agrees_with_vllm(server, client, lambda prompt: complete(client, prompt, max_tokens=40))
    complete(client, REPETITIVE, max_tokens=48)
    # Ray exports metrics periodically (every 10 s by default).
    wait_until(lambda: counter_sum(server.metrics_text(), drafts) > before, "vLLM's spec-decode draft counter growing")


def test_greedy_output_is_identical_under_every_policy(client):
    outputs = {}
    for table in ["off", "chain1", "chain4", "1-1:chain3,2+:chain1"]:
        _applied_version(push_policy(client, table))
        outputs[table] = [complete(client, p, max_tokens=40)["choices"][0]["text"] for p in PROMPTS]
    reference = outputs["off"]
    for table, texts in outputs.items():
        assert texts == reference, f"policy {table} changed greedy output"


def test_cli_policy_set_and_status(client):
    run = lambda *args: subprocess.run([ADASPEC, *args], capture_output=True, text=True, timeout=120)
    table = "1-2:chain4,3-8:chain2,9+:off"
    res = run("policy", "set", "--url", URL, "--table", table, "--model", MODEL)
    assert res.returncode == 0, res.stderr
    assert "applied" in res.stdout and table in res.stdout
    complete(client, REPETITIVE, max_tokens=24)

    res = run("status", "--url", URL, "--json", "--model", MODEL)
    assert res.returncode == 0, res.stderr
    (report,) = json.loads(res.stdout)["replicas"]
    assert str(SpecPolicy.model_validate(report["policy"])) == table
    assert report["info"]["capabilities"]["max_k"] == 4 and report["steps"]
    # A model the app does not serve: the admin routes' 404, named.
    for command in (("status",), ("policy", "set", "--table", "off")):
        res = run(*command, "--url", URL, "--model", "no-such-model")
        assert res.returncode == 2 and "HTTP 404" in res.stderr and "no model 'no-such-model' in this app" in res.stderr, res.stderr

    res = run("status", "--url", URL)
    assert res.returncode == 0 and table in res.stdout and "acceptance per position" in res.stdout

    res = run("policy", "set", "--url", URL, "--table", "chain9")
    assert res.returncode == 1 and "rejected" in res.stdout
    res = run("policy", "set", "--url", URL, "--table", "bogus")
    assert res.returncode == 2 and "bogus" in res.stderr


def test_prometheus_exports_adaspec_metrics(server, client):
    _applied_version(push_policy(client, "chain3"))
    complete(client, REPETITIVE, max_tokens=32)
    pattern = re.compile(r"^ray_adaspec_spec_k{[^}]*} (\S+)$", re.M)

    def exported_k3() -> str | None:
        text = server.metrics_text()
        m = pattern.search(text)
        return text if m and float(m.group(1)) == 3.0 else None

    text = wait_until(exported_k3, "ray_adaspec_spec_k exported as 3 (Ray exports metrics periodically)")
    assert re.search(r"^ray_adaspec_step_seconds_count{[^}]*} [1-9]", text, re.M)
    # k is exported at every batch size up to the engine's max batch, each 3 under chain3.
    ks = {m.group(1): float(m.group(2)) for m in re.finditer(r'^ray_adaspec_spec_k{[^}]*batch="(\d+)"[^}]*} (\S+)$',
                                                              text, re.M)}
    assert ks and set(ks.values()) == {3.0} and "1" in ks, ks
    # Labelled as vLLM labels its series (model_name), with Serve's tags, so one dashboard
    # splits by model and deployment; vLLM's own series carry Serve's tags too.
    assert re.search(rf'^ray_adaspec_policy_version{{[^}}]*model_name="{MODEL}"[^}}]*}}', text, re.M)
    drafts = re.search(r"^ray_vllm_spec_decode_num_drafts_total{([^}]*)}", text, re.M)
    assert drafts, "vLLM's spec-decode counter not exported"
    for tag in ("deployment", "application", "replica", "model_name"):
        assert re.search(rf'\b{tag}="[^"]+"', drafts.group(1)), (tag, drafts.group(1))


# adaspec's own work in the engine core (its scheduler hooks: step records, shadow drafting;
# and the telemetry drains between steps), as a share of the engine's step time: the budget
# of issue 48 (adaspec held at a policy within 2% of vLLM running the same speculation).
ENGINE_OVERHEAD_BUDGET = 0.02


@pytest.mark.parametrize("table", ["off", "chain4"])
def test_adaspecs_work_in_the_engine_core_stays_within_budget(client, table):
    """StepRecord.overhead_s times adaspec's code inside vLLM's engine loop, step by step, in
    the same run as the steps themselves: the engine without adaspec's hooks would take
    duration_s - overhead_s. Four requests at once, so the per-sequence work (shadow
    drafting, request bookkeeping) is there."""
    version = _applied_version(push_policy(client, table))
    requests = [InFlight(client, max_tokens=96, prompt=p) for p in [*PROMPTS, "List the planets of the solar system:"]]
    for r in requests:
        r.join()
    steps = replica_steps(client, version)
    assert len(steps) >= 40, f"only {len(steps)} steps under {table}"
    assert all(s["overhead_s"] > 0 for s in steps), "a step without its overhead measured"
    share = sum(s["overhead_s"] for s in steps) / sum(s["duration_s"] for s in steps)
    print(f"\n[overhead] {table}: adaspec's share of {len(steps)} engine steps {share:.4f}")
    assert share < ENGINE_OVERHEAD_BUDGET, f"adaspec's work is {share:.1%} of the engine's step time under {table}"
