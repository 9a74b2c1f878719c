"""Soak: a running adaspec server under steady load for minutes, controller on.

    python -m bench.soak --minutes 10 --load 0.8 [--url http://127.0.0.1:8000] [--out DIR]

1. Saturation: 3 x max batch requests sent at once (realistic mix: half greedy, half T=0.7,
   every one stopping at EOS, ShareGPT test-split prompts); the rate they complete at is the
   saturation rate (requests/s).
2. Soak: Poisson arrivals at `--load` x that rate for `--minutes`. Every 10 s the resident
   memory of every adaspec and engine process (Serve replicas, the controller actor, vLLM's
   engine core and worker) and the policy version in force are sampled.
3. Report: errors, latency, each process's memory at the end against its value after the
   first minute (warm-up), policy changes. JSON, a markdown table and a PNG plot in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from prepare.datasets import load_prompts
from bench import machine
from bench.client import arrivals_until, realistic_mix, run_load
from serve_app import admin_client

SAMPLE_EVERY_S = 10.0
WARMUP_S = 60.0
# Processes whose memory is watched, by the name Ray / vLLM give them.
WATCHED = ("ray::ServeReplica", "ray::ControllerActor", "VLLM::EngineCore", "VLLM::Worker")


def watched_processes() -> dict[int, tuple[str, psutil.Process]]:
    """pid -> (name, process) for every watched process on this machine. A Ray worker's
    title changes with the method it runs, so the name is cut at the actor's own name."""
    found = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        title = " ".join(p.info["cmdline"] or []) or p.info["name"] or ""
        if title.startswith(WATCHED):
            found[p.pid] = (title.split()[0].split(".")[0][:60], p)
    return found


class Sampler(threading.Thread):
    """Every SAMPLE_EVERY_S seconds: resident MiB per watched process, policy version in force."""

    def __init__(self, url: str, token: str | None):
        super().__init__(daemon=True)
        self.url, self.token = url, token
        self.stop = threading.Event()
        self.samples: list[dict] = []
        self.names: dict[int, str] = {}
        self.start_time = time.monotonic()

    def run(self) -> None:
        while not self.stop.is_set():
            rss = {}
            for pid, (name, p) in watched_processes().items():
                name = self.names.setdefault(pid, f"{name} ({pid})")  # the name first seen
                try:
                    rss[name] = p.memory_info().rss / 2**20
                except psutil.Error:
                    pass
            try:
                versions = [r.policy.version for r in admin_client.status(self.url, token=self.token)]
            except Exception:  # noqa: BLE001 - a sample without it
                versions = []
            self.samples.append({"t_s": time.monotonic() - self.start_time, "rss_mib": rss, "policy_versions": versions})
            self.stop.wait(SAMPLE_EVERY_S)


def saturation_rate(url: str, model: str, prompts, max_tokens: int, n: int) -> float:
    """Requests/s completed when n requests arrive at once."""
    results = asyncio.run(run_load(url, model, prompts[:n], [0.0] * n, max_tokens, progress=False,
                                   sampling=realistic_mix(n, seed=1)))
    ok = [r for r in results if r.ok]
    span = max(r.sent_at + r.e2e_s for r in ok) - min(r.sent_at for r in ok)
    return len(ok) / span


@dataclass(frozen=True)
class Saturation:
    """What a load benchmark learns of a running server before it starts."""

    model: str
    prompts: list  # ShareGPT test-split prompts (adaspec.datasets.Prompt), seeded order
    max_batch: int  # the replica's engine batch (requests)
    rate: float  # requests/s completed with 3 x max_batch sent at once


def probe_saturation(url: str, token: str | None, max_tokens: int) -> Saturation:
    (model,) = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    replicas = admin_client.status(url, token=token)
    max_batch = replicas[0].info.capabilities.max_batch_size if replicas[0].info else 32
    prompts = load_prompts("sharegpt", None, seed=0, split="test")
    return Saturation(model, prompts, max_batch, saturation_rate(url, model, prompts, max_tokens, 3 * max_batch))


def memory_drift(samples: list[dict]) -> dict[str, dict]:
    """Per process: MiB after warm-up (first sample at or after WARMUP_S), at the end, change in %."""
    warm = next((s for s in samples if s["t_s"] >= WARMUP_S), samples[0])
    end = samples[-1]
    out = {}
    for name, mib in warm["rss_mib"].items():
        if name in end["rss_mib"]:
            out[name] = {"warm_mib": round(mib, 1), "end_mib": round(end["rss_mib"][name], 1),
                         "change_pct": round(100 * (end["rss_mib"][name] / mib - 1), 2)}
    return out


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in samples[-1]["rss_mib"]:
        points = [(s["t_s"] / 60, s["rss_mib"][name]) for s in samples if name in s["rss_mib"]]
        ax.plot(*zip(*points), label=name)
    ax.axvline(WARMUP_S / 60, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes into the soak")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title("adaspec soak: memory per process")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--token", default=None, help="admin token, if the app has one")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=0.8, help="share of the saturation rate")
    parser.add_argument("--max-tokens", type=int, default=64, help="cap on output tokens per request")
    parser.add_argument("--out", default="bench/results/soak")
    args = parser.parse_args(argv)
    if not 0 < args.load <= 1.5:
        parser.error("--load: a share of the saturation rate in (0, 1.5]")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start_machine = machine.describe()

    probe = probe_saturation(args.url, args.token, args.max_tokens)
    model, prompts, sat = probe.model, probe.prompts, probe.rate
    rate = args.load * sat
    print(f"[soak] saturation {sat:.2f} req/s; soaking at {rate:.2f} req/s ({args.load:.0%}) for {args.minutes} min",
          flush=True)

    offsets = arrivals_until(rate, args.minutes * 60, seed=2)
    chosen = [prompts[i % len(prompts)] for i in range(len(offsets))]
    sampler = Sampler(args.url, args.token)
    sampler.start()
    results = asyncio.run(run_load(args.url, model, chosen, offsets, args.max_tokens,
                                   sampling=realistic_mix(len(offsets), seed=3)))
    sampler.stop.set()
    sampler.join()

    ok = [r for r in results if r.ok]
    errors = sorted({r.error[:120] for r in results if not r.ok})
    e2e = sorted(r.e2e_s for r in ok)
    versions = [v for s in sampler.samples for v in s["policy_versions"]]
    drift = memory_drift(sampler.samples)
    doc = {
        "command": f"python -m bench.soak --minutes {args.minutes} --load {args.load} --max-tokens {args.max_tokens}",
        "machine": {**start_machine, **machine.at_end(start_machine)}, "saturation_rps": sat, "rate_rps": rate,
        "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok), "error_kinds": errors,
        "mean_e2e_s": statistics.fmean(e2e) if e2e else None, "p99_e2e_s": e2e[int(0.99 * (len(e2e) - 1))] if e2e else None,
        "policy_changes": len(set(versions)) - 1 if versions else None,
        "memory": drift, "max_memory_change_pct": max((abs(d["change_pct"]) for d in drift.values()), default=None),
        "samples": sampler.samples,
    }
    (out / "soak.json").write_text(json.dumps(doc, indent=2))
    plot(sampler.samples, out / "memory.png")
    lines = [f"# Soak: {args.minutes:g} minutes at {args.load:.0%} of saturation", "", f"`{doc['command']}`", "",
             f"saturation {sat:.2f} req/s, soak rate {rate:.2f} req/s; {len(results)} requests, "
             f"{doc['errors']} errors; mean e2e {doc['mean_e2e_s']:.2f} s, p99 {doc['p99_e2e_s']:.2f} s; "
             f"policy changes {doc['policy_changes']}", "",
             "| process | MiB after warm-up | MiB at end | change |", "|---|---|---|---|"]
    lines += [f"| {name} | {d['warm_mib']} | {d['end_mib']} | {d['change_pct']:+.2f}% |" for name, d in drift.items()]
    (out / "README.md").write_text("\n".join(lines) + "\n\n![memory](memory.png)\n")
    print("\n".join(lines))
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
