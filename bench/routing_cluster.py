"""The speculation-aware router against Ray Serve's power-of-two router, measured on a real
multi-node Ray cluster on this machine (testkit.loopback_cluster: one node per replica), with
the same trace for both, and the simulator's prediction for the same fleet beside it.

Each round deploys `configs/app-cluster.yaml` (native-engine replicas, one per node, the
controller on) with `--replicas` replicas and `routing` set to one router, and sends the
trace:
- load: a burst of `--burst` long requests (greedy, `ignore_eos`, `--long-tokens` tokens) at
  the start and again half-way: they occupy part of the fleet;
- measured: a Poisson stream of chat (ShareGPT) and code (HumanEval) requests, alternating,
  sampled as served traffic is (bench.client.realistic_mix: `--greedy-share` greedy, the
  rest at T=0.7 / top_p 0.9, all stopping at EOS or `--max-tokens`).
Rounds alternate the routers in ABBA order so drift hits both alike.

Every ratio (spec_aware / power_of_two; below 1: spec_aware better) of mean and p99 TTFT,
TPOT and end-to-end latency of the measured requests comes with a 95% two-stage bootstrap
interval over rounds and requests (bench.compare) and a verdict: better, worse or
inconclusive. Then `adaspec simulate`'s model of the same fleet (the step-time and
acceptance models the cluster's controller learned during the rounds, its checkpoint; the
same replicas, rate and mean lengths; the adaptive controller on) predicts the end-to-end
ratios, printed beside the measured ones. Written: routing.json, table.md, routing.png.

    python -m bench.routing_cluster --out bench/results/routing-cluster-3 [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from prepare.datasets import load_prompts
from bench import machine
from bench.client import SYNTHETIC, arrivals_until, realistic_mix, run_load
from bench.compare import bootstrap_ratio, mean, p99
from bench.metrics import tpot_s
from serve_app import admin_client
from testkit.loopback_cluster import LoopbackCluster, NodeSpec
from testkit.serve_process import REPO, ServeProcess

URL = "http://127.0.0.1:8003"  # configs/app-cluster.yaml's http_options
MODEL = "smollm2-135m-instruct"
ROUTERS = ("spec_aware", "power_of_two")
METRICS = ("ttft", "tpot", "e2e")  # seconds each, per measured request
SIMULATED_SEEDS = (0, 1, 2)


def cluster_config(routing: str, replicas: int, directory: Path) -> Path:
    doc = yaml.safe_load((REPO / "configs" / "app-cluster.yaml").read_text())
    args = doc["applications"][0]["args"]
    args["routing"], args["num_replicas"] = routing, replicas
    path = directory / f"app-cluster-{routing}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def trace(args) -> tuple[list, list]:
    """The long requests' results and the measured requests' results."""
    offsets = arrivals_until(args.rate, args.duration, args.seed)
    half = len(offsets) // 2 + 1
    chat, code = load_prompts("sharegpt", half, seed=args.seed), load_prompts("humaneval", half, seed=args.seed)
    mixed = [p for pair in zip(chat, code) for p in pair]
    sampling = realistic_mix(len(offsets), args.seed, args.greedy_share)
    long_prompts = load_prompts("sharegpt", 2 * args.burst, seed=args.seed + 1)
    long_offsets = [0.0] * args.burst + [args.duration / 2] * args.burst
    long_run = run_load(URL, MODEL, long_prompts, long_offsets, max_tokens=args.long_tokens, progress=False,
                        sampling=[SYNTHETIC] * len(long_prompts))
    measured = run_load(URL, MODEL, mixed[:len(offsets)], offsets, max_tokens=args.max_tokens, progress=False,
                        sampling=sampling)
    return tuple(await asyncio.gather(long_run, measured))


def wait_for_replicas(count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(admin_client.status(URL)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} replicas not up after {timeout_s:.0f} s")
        time.sleep(2)


def one_round(routing: str, workdir: Path, env: dict[str, str], args) -> dict:
    """Deploy with `routing` on the running cluster (`env`: how to join it), send the trace."""
    proc = ServeProcess(cluster_config(routing, args.replicas, workdir), URL, workdir / f"serve-{routing}.log", env=env)
    proc.start()
    try:
        proc.wait_ready(MODEL, timeout_s=600)
        wait_for_replicas(args.replicas, 300)
        asyncio.run(run_load(URL, MODEL, load_prompts("humaneval", 2 * args.replicas, seed=99),
                             [0.0] * 2 * args.replicas, 16, progress=False))
        started = time.time()
        long, measured = asyncio.run(trace(args))
        landed = sorted((sum(1 for q in r.requests if q.arrival_time >= started) for r in admin_client.status(URL)),
                        reverse=True)
    finally:
        proc.stop()
    ok = [r for r in measured if r.ok]
    return {
        "routing": routing, "completed": len(ok), "errors": len(measured) - len(ok) + sum(1 for r in long if not r.ok),
        "requests_per_replica": landed,
        "ttft": [r.ttft_s for r in ok],
        "tpot": [t for r in ok if (t := tpot_s(r)) is not None],
        "e2e": [r.e2e_s for r in ok],
        "output_tokens": [r.output_tokens for r in ok],
        "prompt_tokens": [r.prompt_tokens for r in ok],
    }


def summary(rounds: list[dict], resamples: int) -> dict[str, dict]:
    """Per metric and statistic: spec_aware / power_of_two with its 95% interval, the verdict,
    each router's value over all its rounds, and the ratio of each ABBA pair of rounds."""
    out = {}
    for metric in METRICS:
        by = {r: [x[metric] for x in rounds if x["routing"] == r] for r in ROUTERS}
        for name, stat in (("mean", mean), ("p99", p99)):
            interval = bootstrap_ratio(by["spec_aware"], by["power_of_two"], stat, resamples=resamples)
            pooled = {r: stat([v for rnd in by[r] for v in rnd]) for r in ROUTERS}
            pairs = [stat(a) / stat(b) for a, b in zip(by["spec_aware"], by["power_of_two"]) if a and b]
            out[f"{metric}_{name}_s"] = {**pooled, "ratio": interval.ratio, "low": interval.low,
                                         "high": interval.high, "verdict": interval.verdict(), "pair_ratios": pairs}
    return out


def simulated_ratios(checkpoint: Path, rounds: list[dict], args) -> dict | None:
    """The simulator's spec_aware / power_of_two end-to-end ratios for this fleet, from the
    models the cluster's controller learned (mean over SIMULATED_SEEDS); None without them."""
    from controller.checkpoint_file import CheckpointError
    from controller.config import ControllerConfig
    from controller.simulate import engine_from_checkpoint, simulate

    try:
        engine = engine_from_checkpoint(str(checkpoint), max_batch=8, max_k=4)
    except (CheckpointError, OSError) as e:
        print(f"no simulated prediction: {e}")
        return None
    output = statistics.fmean(t for r in rounds for t in r["output_tokens"])
    prompt = statistics.fmean(t for r in rounds for t in r["prompt_tokens"])
    # The long requests as extra arrivals of the mean length: the simulator has one length.
    rate = args.rate + 2 * args.burst * args.long_tokens / output / args.duration
    ratios: dict[str, list[float]] = {"e2e_mean_s": [], "e2e_p99_s": []}
    for seed in SIMULATED_SEEDS:
        res = {r: simulate(engine, args.replicas, 600.0, rate, controller=ControllerConfig(enabled=True),
                           seed=seed, output_tokens=round(output), prompt_tokens=round(prompt), warmup_s=30.0,
                           routing=r) for r in ROUTERS}
        ratios["e2e_mean_s"].append(res["spec_aware"].mean_latency_s / res["power_of_two"].mean_latency_s)
        ratios["e2e_p99_s"].append(res["spec_aware"].p99_latency_s / res["power_of_two"].p99_latency_s)
    return {"rate": rate, "output_tokens": output, "prompt_tokens": prompt, "seeds": list(SIMULATED_SEEDS),
            **{k: statistics.fmean(v) for k, v in ratios.items()}, "per_seed": ratios}


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(result, indent=2))
    sim = result.get("simulated") or {}
    lines = ["| metric | spec_aware | power_of_two | ratio [95% CI] | verdict | per-pair ratios | simulated ratio |",
             "|---|---|---|---|---|---|---|"]
    for metric, row in result["summary"].items():
        pairs = ", ".join(f"{p:.2f}" for p in row["pair_ratios"])
        predicted = f"{sim[metric]:.2f}" if metric in sim else ""
        lines.append(f"| {metric} | {row['spec_aware']:.3f} | {row['power_of_two']:.3f} | {row['ratio']:.3f} "
                     f"[{row['low']:.3f}, {row['high']:.3f}] | {row['verdict']} | {pairs} | {predicted} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    rows = [result["summary"][m] for m in names]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.errorbar(range(len(names)), [r["ratio"] for r in rows], fmt="o", capsize=4, label="measured, 95% CI",
                yerr=[[r["ratio"] - r["low"] for r in rows], [r["high"] - r["ratio"] for r in rows]])
    simulated = [(i, sim[m]) for i, m in enumerate(names) if m in sim]
    if simulated:
        ax.plot([i for i, _ in simulated], [v for _, v in simulated], "x", markersize=9, label="simulated")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("spec_aware / power_of_two")
    s = result["settings"]
    ax.set_title(f"{s['replicas']} replicas on a {s['replicas']}-node loopback Ray cluster, {s['rounds']} rounds each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "routing.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for routing.json, table.md (Markdown) and routing.png")
    parser.add_argument("--replicas", type=int, default=3, help="replicas, one per Ray node")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per router (ABBA order)")
    parser.add_argument("--rate", type=float, default=0.8, help="measured requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of measured arrivals per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of a measured request (it may stop earlier)")
    parser.add_argument("--greedy-share", type=float, default=0.5, help="share of measured requests decoded greedily")
    parser.add_argument("--burst", type=int, default=2, help="long requests sent at the start and again half-way")
    parser.add_argument("--long-tokens", type=int, default=256, help="tokens of each long request")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap draws per interval")
    parser.add_argument("--seed", type=int, default=0, help="prompts, sampling and arrival times (the same every round)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="routing-cluster-"))
    nodes = [NodeSpec("head", num_cpus=1)] + [NodeSpec(f"worker{i}", num_cpus=1) for i in range(1, args.replicas)]
    controller_dir = workdir / "ctl"
    cluster = LoopbackCluster(nodes, 6390, workdir / "logs", env={"ADASPEC_CONTROLLER_DIR": str(controller_dir)})
    before = machine.describe()
    cluster.start()
    order = [ROUTERS[(i + i // 2) % 2] for i in range(2 * args.rounds)]  # A B B A ...
    rounds = []
    try:
        for i, routing in enumerate(order):
            print(f"round {i + 1}/{len(order)}: {routing}", flush=True)
            rounds.append(one_round(routing, workdir, cluster.join_env(), args))
            r = rounds[-1]
            print(f"  {r['completed']} completed, {r['errors']} errors, requests per replica {r['requests_per_replica']}, "
                  f"mean e2e {statistics.fmean(r['e2e']):.2f} s", flush=True)
    finally:
        left = cluster.stop()
        if left:
            print(f"left behind: {left}")
    from controller.checkpoint_file import CHECKPOINT_FILE

    result = {"settings": vars(args) | {"out": str(args.out)}, "machine": before,
              "machine_at_end": machine.at_end(before), "rounds": rounds,
              "summary": summary(rounds, args.resamples),
              "simulated": simulated_ratios(controller_dir / CHECKPOINT_FILE, rounds, args)}
    write(args.out, result)


if __name__ == "__main__":
    main()
