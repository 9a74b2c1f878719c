"""Where the time of one native decode step goes, against the memory-bandwidth limit.

For each dtype (float32, and bfloat16 where oneDNN runs it), the default model at batch 1 with
no speculation, greedy: the median step time over `--steps` decode steps, then a
torch.profiler profile of as many more, its ops grouped into
- matmuls (the linears: oneDNN's packed matmul, a BLAS gemv, adaspec's panel kernel, or compiled, MKL's packed sgemm),
- attention (scaled_dot_product_attention, and adaspec's attention kernels: write_and_attend, decode_attention, tree_attention),
- other ops (RMSNorm, RoPE, KV-cache writes, activations, residual adds, views, copies),
- outside any op: Python, the engine's scheduling, sampling (the profiled step's wall time
  minus the ops' own time);
and the limit: the weight bytes a step reads / the machine's read bandwidth (a sum over a
large tensor, best of 5; the copy bandwidth that bench.native_engine's roofline uses counts
a write too). The matmuls' own bandwidth (weight bytes / matmul time) says how far the
kernels are from streaming at that rate; the rest of the step is overhead a faster kernel
would not remove. The profiler adds a little time to every op: the shares come from the
profiled steps, the step time from the unprofiled ones.

Then, with both dtypes loaded, `--rounds` interleaved rounds of `--steps` steps each give
bfloat16's decode speed against float32's with a 95% bootstrap interval, called met, missed or
inconclusive against issue 19's goal of 1.6x.

`--compile-decode` adds an engine per dtype whose one-token pass is compiled
(NativeEngine.compile_decode; about a minute each), profiled the same way (the inductor
graph's fused kernels count as "other ops") and timed in the same interleaved rounds: compiled
against eager per dtype, and bfloat16 against float32 compiled too. Compiled engines run
inductor's C++ wrapper, which calls the graph's matmuls unseen by the profiler: their
"matmul" is the eager lm_head only, the graph's matmuls count as "other ops".

Prints a table, writes {out}/step_profile.json and step_profile.png (step_profile_compiled.*
with --compile-decode). Not a test; about two minutes on an idle machine (six with
--compile-decode).

    .venv/bin/python -m bench.step_profile [--threads 2] [--steps 30] [--rounds 6] [--compile-decode]
        [--out bench/results/native-cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench import machine
from bench.compare import bootstrap_ratio
from bench.native_engine import streamed_weight_bytes
from native_engine.dtype_choice import cpu_has_bf16
from native_engine.engine import EngineConfig, NativeEngine
from native_engine.requests import SamplingParams

MODEL = "smollm2-135m-instruct"
PROMPT = "Write a long story about a dragon who learns to read, told by the dragon."
MATMUL_OPS = {"mkldnn::_linear_pointwise", "mkl::_mkl_linear", "adaspec::panel_matmul", "adaspec::panel_matmul_bf16",
              "aten::mm", "aten::addmm", "aten::bmm", "aten::mv", "aten::addmv", "aten::dot"}
# adaspec's attention kernels (native_engine/decode_attention.py), write_and_attend the one a decode step calls.
ATTENTION_OPS = {"adaspec::decode_attention", "adaspec::tree_attention", "adaspec::write_and_attend"}
PARTS = ("matmul", "attention", "other ops", "outside ops")
BF16_GOAL = 1.6  # issue 19: batch-1 decode in bfloat16 at least 1.6x float32's tokens/s


def part_of(op: str) -> str:
    if op in MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in op or op in ATTENTION_OPS:
        return "attention"
    return "other ops"


def load(dtype: torch.dtype) -> NativeEngine:
    return NativeEngine.from_pretrained(MODEL, drafter="none", dtype=dtype,
                                        config=EngineConfig(max_batch_size=1, max_seq_len=1024))


def step_times(engine: NativeEngine, steps: int, request_id: str, batch: int = 1, prompt: str = PROMPT
               ) -> list[float]:
    """Seconds per decode step of `steps` steps of `batch` fresh requests of `prompt` (after
    prefill and warm-up); the requests are left running for whoever steps next."""
    for i in range(batch):
        engine.add_request(request_id if batch == 1 else f"{request_id}-{i}", prompt,
                           SamplingParams(max_tokens=2 * steps + 20, temperature=0.0, ignore_eos=True))
    for _ in range(5):  # prefill and warm-up
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def finish(engine: NativeEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def median_step_ms(engine: NativeEngine, steps: int, request_id: str, batch: int = 1, prompt: str = PROMPT
                   ) -> float:
    """Median decode step (milliseconds) of `step_times`, the requests then run to the end."""
    times = step_times(engine, steps, request_id, batch, prompt)
    finish(engine)
    return 1000 * statistics.median(times)


def profile_dtype(engine: NativeEngine, steps: int) -> dict:
    """Median unprofiled step (ms) and the profiled steps' time per part (ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    dtype = engine.model.lm_head.weight.dtype
    times = step_times(engine, steps, "profiled")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled_s = time.perf_counter() - t
    parts = dict.fromkeys(PARTS, 0.0)
    ops = []
    for evt in prof.key_averages():
        self_ms = evt.self_cpu_time_total / 1000 / steps
        parts[part_of(evt.key)] += self_ms
        ops.append({"op": evt.key, "calls_per_step": evt.count / steps, "self_ms_per_step": self_ms})
    parts["outside ops"] = max(1000 * profiled_s / steps - sum(parts.values()), 0.0)
    ops.sort(key=lambda o: -o["self_ms_per_step"])
    weights = streamed_weight_bytes(engine.model)
    finish(engine)
    return {"dtype": str(dtype).removeprefix("torch."), "step_ms": 1000 * statistics.median(times),
            "profiled_step_ms": 1000 * profiled_s / steps, "parts_ms": parts, "weight_bytes": weights,
            "ops_per_step": sum(o["calls_per_step"] for o in ops), "top_ops": ops[:12],
            "linear_choice": str(engine.model.linear_choice)}


def interleaved_rounds(engines: dict[str, NativeEngine], steps: int, rounds: int) -> dict[str, list[list[float]]]:
    """Seconds per decode step of every engine in `rounds` interleaved rounds of `steps` steps
    each (the order alternating): {engine: [round's step times]}."""
    times: dict[str, list[list[float]]] = {name: [] for name in engines}
    for r in range(rounds):
        for name in engines if r % 2 == 0 else reversed(list(engines)):
            times[name].append(step_times(engines[name], steps, f"round{r}"))
            finish(engines[name])
        print(f"[step_profile] round {r + 1}/{rounds}: " + ", ".join(
            f"{n} {1000 * statistics.median(t[-1]):.1f} ms" for n, t in times.items()), flush=True)
    return times


def speedup(times: dict[str, list[list[float]]], slower: str, faster: str, goal: float | None = None) -> dict:
    """Decode speed of `faster` against `slower` from interleaved rounds: median step
    slower / faster with a 95% bootstrap interval over rounds and steps (bench/compare.py),
    and the verdict against `goal` if one is given."""
    interval = bootstrap_ratio(times[slower], times[faster], lambda v: float(np.median(v)))
    return {"of": faster, "against": slower, "rounds": len(times[faster]), "ratio": interval.ratio,
            "low": interval.low, "high": interval.high, "goal": goal,
            "verdict": interval.meets(goal) if goal is not None else None,
            "round_ratios": [statistics.median(a) / statistics.median(b) for a, b in zip(times[slower], times[faster])],
            "step_ms": {n: [1000 * statistics.median(t) for t in times[n]] for n in (slower, faster)}}


def summarize(run: dict, read_gbs: float) -> dict:
    limit_ms = run["weight_bytes"] / read_gbs / 1e6
    matmul_ms = run["parts_ms"]["matmul"]
    return {"limit_ms": limit_ms, "fraction_of_limit": limit_ms / run["step_ms"],
            "matmul_gbs": run["weight_bytes"] / matmul_ms / 1e6 if matmul_ms else None,
            "shares": {p: ms / run["profiled_step_ms"] for p, ms in run["parts_ms"].items()}}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.8 + 0.8 * len(runs)))
    colors = {"matmul": "tab:blue", "attention": "tab:orange", "other ops": "tab:green", "outside ops": "tab:gray"}
    for i, run in enumerate(runs):
        left = 0.0
        scale = run["step_ms"] / run["profiled_step_ms"]  # parts drawn to the unprofiled step's length
        for part in PARTS:
            width = run["parts_ms"][part] * scale
            ax.barh(i, width, left=left, color=colors[part], label=part if i == 0 else None)
            left += width
        ax.plot([run["summary"]["limit_ms"]] * 2, [i - 0.4, i + 0.4], color="black", linewidth=2,
                label="weights / read bandwidth" if i == 0 else None)
    ax.set_yticks(range(len(runs)), [r["engine"] for r in runs])
    ax.set_xlabel("ms per batch-1 decode step")
    ax.set_title("Native engine decode step: where the time goes (SmolLM2-135M, no speculation)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=5, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed, then as many profiled")
    parser.add_argument("--rounds", type=int, default=6,
                        help="interleaved float32 / bfloat16 rounds of --steps steps for the speed ratio")
    parser.add_argument("--compile-decode", action="store_true",
                        help="compile each engine's one-token pass first (NativeEngine.compile_decode); "
                        "writes step_profile_compiled.json / .png")
    parser.add_argument("--autotune", action="store_true",
                        help="with --compile-decode: compile with inductor's GEMM autotuning (compile_autotune); "
                        "writes step_profile_autotune.json / .png")
    parser.add_argument("--out", default="bench/results/native-cpu")
    args = parser.parse_args()
    if args.autotune and not args.compile_decode:
        parser.error("--autotune tunes what --compile-decode compiles; pass both")
    torch.set_num_threads(args.threads)
    described = machine.describe()
    dtypes = [torch.float32]
    if cpu_has_bf16():
        dtypes.append(torch.bfloat16)
    engines = {str(dtype).removeprefix("torch."): load(dtype) for dtype in dtypes}
    compile_s = {}
    if args.compile_decode:  # the compiled engines beside the eager ones, measured in the same rounds
        for dtype in dtypes:
            name = f"{str(dtype).removeprefix('torch.')} compiled"
            engines[name] = load(dtype)
            compile_s[name] = engines[name].compile_decode(args.autotune)
            print(f"[step_profile] {name}: decode pass compiled in {compile_s[name]:.0f} s", flush=True)
    runs = []
    for name, engine in engines.items():
        print(f"[step_profile] {name}: {args.steps} steps timed, {args.steps} profiled", flush=True)
        runs.append({"engine": name, **profile_dtype(engine, args.steps)})
    speedups = []
    if args.rounds and len(engines) > 1:
        times = interleaved_rounds(engines, args.steps, args.rounds)
        for mode in ("", " compiled"):
            if f"bfloat16{mode}" in times:
                speedups.append(speedup(times, f"float32{mode}", f"bfloat16{mode}", BF16_GOAL))
        for dtype in dtypes if args.compile_decode else ():
            name = str(dtype).removeprefix("torch.")
            speedups.append(speedup(times, name, f"{name} compiled"))
    read_gbs = machine.read_bandwidth_gbs()
    for run in runs:
        run["summary"] = summarize(run, read_gbs)
    print(f"\nread bandwidth {read_gbs:.1f} GB/s; batch-1 decode step, no speculation, {args.threads} threads")
    print("| engine | step ms | limit ms (weights / bandwidth) | % of limit | matmul ms (GB/s) | attention ms | "
          "other ops ms | outside ops ms | ops per step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        s, p = run["summary"], run["parts_ms"]
        print(f"| {run['engine']} | {run['step_ms']:.1f} | {s['limit_ms']:.1f} ({run['weight_bytes'] / 1e6:.0f} MB) | "
              f"{100 * s['fraction_of_limit']:.0f}% | {p['matmul']:.1f} ({s['matmul_gbs'] or 0:.1f}) | "
              f"{p['attention']:.1f} | {p['other ops']:.1f} | {p['outside ops']:.1f} | {run['ops_per_step']:.0f} |")
    print("(parts from the profiled steps, which the profiler slows a little: "
          + ", ".join(f"{r['engine']} {r['profiled_step_ms']:.1f} ms" for r in runs) + ")")
    for sp in speedups:
        print(f"{sp['of']} / {sp['against']} decode speed, {sp['rounds']} interleaved rounds: {sp['ratio']:.2f}x "
              f"[{sp['low']:.2f}, {sp['high']:.2f}] (rounds: " + ", ".join(f"{r:.2f}" for r in sp["round_ratios"])
              + ")" + (f"; goal >= {sp['goal']}x: {sp['verdict']}" if sp["goal"] else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python -m bench.step_profile " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
           "machine": {**described, **machine.at_end(described)}, "model": MODEL, "threads": args.threads,
           "read_bandwidth_gbs": read_gbs, "compile_decode": args.compile_decode, "autotune": args.autotune,
           "compile_s": compile_s,
           "runs": runs, "speedups": speedups}
    name = "step_profile_autotune" if args.autotune else "step_profile_compiled" if args.compile_decode else "step_profile"
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    plot(runs, out / f"{name}.png")
    print(f"wrote {out / name}.json and {name}.png")


if __name__ == "__main__":
    main()
