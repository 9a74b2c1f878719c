"""The phase-change run: one trace whose workload and rate change, under every policy.

A trace is `DATASET:RATE:SECONDS,...`, e.g. `sharegpt:0.5:45,humaneval:0.5:45,humaneval:1.5:45,
sharegpt:0.5:45`: each segment sends that dataset's test prompts (cycled when the segment
needs more than the split has) at Poisson arrivals of that rate for that long. Every policy
runs the same trace (same prompts, same arrival times). For the adaptive run, the
controller's *settle time* after each change is the time from the segment's start to the
last policy change inside the segment (0 when it changed nothing; a value close to the
segment's length means it never settled). Each segment is also scored per policy (mean TPOT
of the requests sent in it), so the cost of adapting shows next to the static policies.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import asdict, dataclass

from bench.client import RequestResult, arrivals_until
from adaspec.datasets import Prompt
from prepare.datasets import load_prompts
from bench.harness import BenchSettings, bench_prompts
from bench.metrics import tpot_s
from bench.policies import apply_policy, interleaved
from bench.replica_probe import PolicyChange


@dataclass(frozen=True)
class Segment:
    dataset: str
    rate: float  # requests per second
    duration_s: float


def parse_trace(text: str) -> list[Segment]:
    segments = []
    for part in text.split(","):
        try:
            dataset, rate, seconds = part.strip().split(":")
            segments.append(Segment(dataset, float(rate), float(seconds)))
        except ValueError:
            raise ValueError(f"bad trace segment {part.strip()!r}: expected DATASET:RATE:SECONDS") from None
        if not (0 < segments[-1].rate < float("inf")) or segments[-1].duration_s <= 0:
            raise ValueError(f"bad trace segment {part.strip()!r}: rate and seconds must be positive and finite")
    return segments


def trace_workload(segments: list[Segment], seed: int, burstiness: float = 1.0
                   ) -> tuple[list[Prompt], list[float], list[float]]:
    """Prompts, their send offsets (seconds) and the segments' start offsets."""
    pools = {d: load_prompts(d, None, seed, split="test") for d in {s.dataset for s in segments}}
    cursor = dict.fromkeys(pools, 0)
    prompts, offsets, starts, t0 = [], [], [], 0.0
    for i, seg in enumerate(segments):
        starts.append(t0)
        for off in arrivals_until(seg.rate, seg.duration_s, seed + i, burstiness):
            pool = pools[seg.dataset]
            prompts.append(pool[cursor[seg.dataset] % len(pool)])
            cursor[seg.dataset] += 1
            offsets.append(t0 + off)
        t0 += seg.duration_s
    return prompts, offsets, starts


def settle_times(changes: list[PolicyChange], starts: list[float], end: float) -> list[dict]:
    """Per segment: policy changes inside it and the seconds until the last one."""
    out = []
    for i, start in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else end
        inside = [c for c in changes if start <= c.t < stop]
        out.append({"segment": i, "changes": len(inside),
                    "settle_s": (max(c.t for c in inside) - start) if inside else 0.0,
                    "segment_s": stop - start, "configs": [str(c.config) for c in inside]})
    return out


def segment_tpots(requests: list[RequestResult], starts: list[float], end: float) -> list[list[float]]:
    """The TPOTs (seconds) of the requests sent in each segment."""
    out = []
    for i, start in enumerate(starts):
        stop = starts[i + 1] if i + 1 < len(starts) else end
        out.append([t for r in requests if r.ok and start <= r.sent_at < stop and (t := tpot_s(r)) is not None])
    return out


def run_phase_change(sweep, trace: str) -> dict:
    """Run the trace under every policy of `sweep` (a bench.sweep.Sweep) on its deployment,
    `sweep.s.rounds` times: each round draws new prompts and arrival times (seed + round), the
    same for every policy in it, and runs the policies in an order rotated from round to round
    (bench/policies.interleaved). Per policy: per-round TPOTs (`rounds_tpots_s`) for the
    verdict's held-out rounds, and segment means over every round."""
    segments = parse_trace(trace)
    end = sum(s.duration_s for s in segments)
    rounds = max(sweep.s.rounds, 1)
    per_policy: dict[str, list[dict]] = {p.name: [] for p in sweep.policies}
    total, done = rounds * len(sweep.policies), 0
    for round_index in range(rounds):
        prompts, offsets, starts = trace_workload(segments, sweep.s.seed + round_index, sweep.s.burstiness)
        for policy in interleaved(sweep.policies, round_index):
            settings = BenchSettings(url=sweep.url, dataset="+".join(sorted({s.dataset for s in segments})),
                                     rate=len(prompts) / end, num_prompts=len(prompts),
                                     max_tokens=sweep.s.max_tokens, seed=sweep.s.seed + round_index,
                                     request_mix=sweep.s.request_mix, slo_ttft_s=sweep.s.slo_ttft_s,
                                     slo_tpot_s=sweep.s.slo_tpot_s, label=f"phase-{policy.name}")
            apply_policy(sweep.url, policy, sweep.start_table)
            result = asyncio.run(bench_prompts(settings, prompts, offsets, sweep.model, progress=False))
            requests = [RequestResult(**r) for r in result.requests]
            per_segment = segment_tpots(requests, starts, end)
            run = {"policy": policy.name, "round": round_index, "requests": len(prompts),
                   "metrics": result.metrics.model_dump(mode="json"),
                   "segment_tpot_s": [statistics.fmean(v) if v else None for v in per_segment],
                   "segment_tpots_s": per_segment,
                   "tpots_s": [t for r in requests if r.ok and (t := tpot_s(r)) is not None],
                   "telemetry": {"mean_k": result.telemetry.mean_k,
                                 "mean_accepted_length": result.telemetry.mean_accepted_length,
                                 "acceptance_rate": result.telemetry.acceptance_rate,
                                 "policies_seen": result.telemetry.policies_seen}}
            if policy.adaptive:
                run["settle"] = settle_times(result.telemetry.policy_changes, starts, end)
                run["timeline"] = [p.model_dump(mode="json") for p in result.telemetry.timeline]
                run["policy_changes"] = [c.model_dump(mode="json") for c in result.telemetry.policy_changes]
            per_policy[policy.name].append(run)
            done += 1
            sweep.log(f"[phase {done}/{total}] round {round_index + 1} {policy.name}: mean TPOT per segment "
                      + ", ".join("-" if t is None else f"{1000 * t:.0f} ms" for t in run["segment_tpot_s"]))
    return {"trace": trace, "segments": [asdict(s) for s in segments], "segment_starts_s": starts,
            "requests": sum(r["requests"] for r in per_policy[sweep.policies[0].name]), "rounds": rounds,
            "runs": {name: merge_rounds(runs) for name, runs in per_policy.items()}}


def merge_rounds(runs: list[dict]) -> dict:
    """One policy's phase-change result over its rounds: segment means over the rounds, every
    round's TPOTs (`rounds_tpots_s`, for held-out verdicts; `tpots_s` pooled), the adaptive
    run's settle times and timeline from its first round (each round's settle times in `per_round`)."""
    first = runs[0]
    segments = zip(*(r["segment_tpot_s"] for r in runs))
    merged = {"policy": first["policy"], "metrics": first["metrics"],
              "segment_tpot_s": [statistics.fmean(v) if (v := [t for t in seg if t is not None]) else None
                                 for seg in segments],
              "tpots_s": [t for r in runs for t in r["tpots_s"]],
              "rounds_tpots_s": [r["tpots_s"] for r in runs],
              "telemetry": first["telemetry"],
              "per_round": [{k: r[k] for k in ("round", "metrics", "segment_tpot_s", "segment_tpots_s", "telemetry", "settle")
                             if k in r}
                            for r in runs]}
    for key in ("settle", "timeline", "policy_changes"):
        if key in first:
            merged[key] = first[key]
    return merged
