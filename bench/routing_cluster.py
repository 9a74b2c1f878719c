"""The speculation-aware router against Ray Serve's power-of-two router, measured on a real
two-node Ray cluster on this machine (bench.loopback_cluster), with the same trace for both.

Each round deploys `configs/app-cluster.yaml` (two native-engine replicas, one per node, the
controller on) with `routing` set to one router, and sends the trace: a burst of long
requests at the start (they occupy part of the fleet) and a Poisson stream of short chat
(ShareGPT) and code (HumanEval) requests, half each. Rounds alternate the routers in ABBA
order so drift hits both alike. Printed and written (JSON, a Markdown table, a PNG): mean
and p99 TTFT and TPOT of the short requests per round, and the spec_aware / power_of_two
ratios of the medians over rounds.

Requests are greedy with `ignore_eos` (bench.client): a synthetic regime that favours
speculation (README); the ratio compares routers, not speculation settings.

    python -m bench.routing_cluster --out bench/results/routing-cluster [--rounds 2]
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

from adaspec.datasets import load_prompts
from bench import machine
from bench.client import arrivals_until, run_load
from bench.loopback_cluster import LoopbackCluster, NodeSpec
from bench.metrics import summarize
from bench.serve_process import REPO, ServeProcess
from serve_app import admin_client

URL = "http://127.0.0.1:8003"  # configs/app-cluster.yaml's http_options
MODEL = "smollm2-135m-instruct"
ROUTERS = ("spec_aware", "power_of_two")


def config_with_router(routing: str, directory: Path) -> Path:
    doc = yaml.safe_load((REPO / "configs" / "app-cluster.yaml").read_text())
    doc["applications"][0]["args"]["routing"] = routing
    path = directory / f"app-cluster-{routing}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


async def trace(rate: float, duration_s: float, burst: int, seed: int) -> tuple[list, list]:
    """The burst's results and the short requests' results."""
    short = [p for pair in zip(load_prompts("sharegpt", 150, seed=seed), load_prompts("humaneval", 150, seed=seed))
             for p in pair]
    offsets = arrivals_until(rate, duration_s, seed)
    long_prompts = load_prompts("sharegpt", burst, seed=seed + 1)
    long_run = run_load(URL, MODEL, long_prompts, [0.0] * burst, max_tokens=192, progress=False)
    short_run = run_load(URL, MODEL, short[:len(offsets)], offsets, max_tokens=48, progress=False)
    return tuple(await asyncio.gather(long_run, short_run))


def one_round(routing: str, workdir: Path, env: dict[str, str], args) -> dict:
    """Deploy with `routing` on the running cluster (`env`: how to join it), send the trace."""
    proc = ServeProcess(config_with_router(routing, workdir), URL, workdir / f"serve-{routing}.log", env=env)
    proc.start()
    try:
        proc.wait_ready(MODEL, timeout_s=600)
        deadline = time.monotonic() + 300
        while len(admin_client.status(URL)) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("two replicas not up after 300 s")
            time.sleep(2)
        asyncio.run(run_load(URL, MODEL, load_prompts("humaneval", 4, seed=99), [0.0] * 4, 16, progress=False))
        burst, short = asyncio.run(trace(args.rate, args.duration, args.burst, args.seed))
    finally:
        proc.stop()
    m = summarize(short, slo_ttft_s=5.0, slo_tpot_s=0.5)
    return {"routing": routing, "completed": m.completed, "errors": m.errors + sum(1 for r in burst if not r.ok),
            "ttft_mean_s": m.ttft_s.mean, "ttft_p99_s": m.ttft_s.p99, "tpot_mean_s": m.tpot_s.mean,
            "tpot_p99_s": m.tpot_s.p99}


METRICS = ("ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s")


def ratios(rounds: list[dict]) -> dict[str, dict]:
    """Per metric: median over rounds per router, and spec_aware / power_of_two with the
    range of per-pair ratios (round i of each router paired in order)."""
    out = {}
    for metric in METRICS:
        by = {r: [x[metric] for x in rounds if x["routing"] == r and x[metric] is not None] for r in ROUTERS}
        pairs = [a / b for a, b in zip(by["spec_aware"], by["power_of_two"]) if b]
        med = {r: statistics.median(v) if v else None for r, v in by.items()}
        out[metric] = {**med, "ratio": (med["spec_aware"] / med["power_of_two"]) if all(med.values()) else None,
                       "pair_ratios": pairs}
    return out


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(result, indent=2))
    lines = ["| metric | spec_aware | power_of_two | ratio | per-pair ratios |", "|---|---|---|---|---|"]
    for metric, row in result["summary"].items():
        pairs = ", ".join(f"{p:.2f}" for p in row["pair_ratios"])
        ratio = f"{row['ratio']:.2f}" if row["ratio"] else "-"
        lines.append(f"| {metric} | {row['spec_aware']:.3f} | {row['power_of_two']:.3f} | {ratio} | {pairs} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(METRICS))
    for i, router in enumerate(ROUTERS):
        ax.bar([x + 0.4 * i for x in xs], [result["summary"][m][router] for m in METRICS], width=0.4, label=router)
    ax.set_xticks([x + 0.2 for x in xs], METRICS)
    ax.set_ylabel("seconds (median over rounds)")
    ax.set_title("two replicas on a two-node loopback Ray cluster")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "routing.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for routing.json, table.md (Markdown) and routing.png")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per router (ABBA order)")
    parser.add_argument("--rate", type=float, default=0.6, help="short requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of short-request arrivals per round")
    parser.add_argument("--burst", type=int, default=4, help="long requests (192 tokens) sent at the start")
    parser.add_argument("--seed", type=int, default=0, help="prompts and arrival times (the same every round)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="routing-cluster-"))
    nodes = [NodeSpec("head", num_cpus=1), NodeSpec("worker1", num_cpus=1)]
    cluster = LoopbackCluster(nodes, 6390, workdir / "logs", env={"ADASPEC_CONTROLLER_DIR": str(workdir / "ctl")})
    before = machine.describe()
    cluster.start()
    order = [ROUTERS[(i + i // 2) % 2] for i in range(2 * args.rounds)]  # A B B A ...
    rounds = []
    try:
        for i, routing in enumerate(order):
            print(f"round {i + 1}/{len(order)}: {routing}", flush=True)
            rounds.append(one_round(routing, workdir, cluster.join_env(), args))
            print(f"  {rounds[-1]}", flush=True)
    finally:
        left = cluster.stop()
        if left:
            print(f"left behind: {left}")
    result = {"settings": vars(args) | {"out": str(args.out)}, "machine": before, "machine_at_end": machine.at_end(before),
              "rounds": rounds, "summary": ratios(rounds)}
    write(args.out, result)


if __name__ == "__main__":
    main()
