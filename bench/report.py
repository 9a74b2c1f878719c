"""report.md and the plots of a sweep, from its results.json (bench/sweep.py).

Verdicts compare mean TPOT (seconds per output token after the first; lower is better) and
are stated as speed ratios, reference TPOT / adaptive TPOT, so >1 means adaptive is faster.
A sweep run in 2+ rounds gets them with 95% bootstrap intervals and calls each goal met,
missed or inconclusive (bench/verdicts.py: the oracle picked on held-out rounds, adaptive
against off at every point, against every static policy on the geometric mean; on the
phase-change trace against the best single static policy, goal >= 1.2). Every sweep also
gets the verdicts on the means alone (the only ones for single-round sweeps):
- vs the oracle: at each (dataset, rate), the best non-adaptive policy there. Goal >= 0.97.
- vs the best single static policy: the non-adaptive policy with the lowest geometric mean
  of mean TPOT over the whole sweep (every dataset and rate). Goal: adaptive's geometric
  mean beats every static policy's (ratio > 1).

    adaspec sweep --report-only --out DIR   # rewrite DIR/report.md and the PNGs from DIR/results.json
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.client import RequestMix  # noqa: E402
from bench.compare import bootstrap_ratio, mean  # noqa: E402
from bench.policies import ADAPTIVE  # noqa: E402
from bench.verdicts import pooled_mean, split_rounds, sweep_verdicts, switching_ceiling  # noqa: E402

ORACLE_GOAL = 0.97
PHASE_GOAL = 1.2  # adaptive over the best single static policy on the phase-change trace


def rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


def cells(doc: dict) -> dict[tuple[str, float], dict[str, dict]]:
    """(dataset, rate) -> policy -> metrics; a cell run in several rounds gets the mean over
    its rounds of mean TPOT, p99 TPOT and output tokens/s."""
    runs: dict[tuple[str, float], dict[str, list[dict]]] = {}
    for run in doc["runs"]:
        runs.setdefault((run["dataset"], float(run["rate"])), {}).setdefault(run["policy"], []).append(
            run["result"]["metrics"])
    return {k: {p: _mean_of_rounds(ms) for p, ms in row.items()} for k, row in runs.items()}


def _mean_of_rounds(metrics: list[dict]) -> dict:
    def avg(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return {**metrics[0], "output_throughput": avg([m["output_throughput"] for m in metrics]),
            "tpot_s": {"mean": avg([m["tpot_s"]["mean"] for m in metrics]),
                       "p99": avg([m["tpot_s"]["p99"] for m in metrics])}}


def round_tpots(doc: dict) -> dict[tuple[str, float], dict[str, list[list[float]]]]:
    """(dataset, rate) -> policy -> per round, the TPOT (s) of each request; empty for
    sweeps written before per-request TPOTs were kept."""
    out: dict[tuple[str, float], dict[str, dict[int, list[float]]]] = {}
    for run in doc["runs"]:
        if "tpots_s" in run:
            out.setdefault((run["dataset"], float(run["rate"])), {}).setdefault(run["policy"], {})[
                run.get("round", 0)] = run["tpots_s"]
    return {k: {p: [rounds[i] for i in sorted(rounds)] for p, rounds in row.items()} for k, row in out.items()}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def verdicts(tpot: dict[tuple[str, float], dict[str, float]], adaptive: str = ADAPTIVE) -> dict:
    """tpot: (dataset, rate) -> policy -> mean TPOT (s). Points missing a policy's number are
    left out of that policy's comparisons."""
    statics = sorted({p for row in tpot.values() for p in row if p != adaptive})
    points = sorted(k for k, row in tpot.items() if row.get(adaptive) is not None)
    complete = [k for k in points if all(tpot[k].get(p) is not None for p in statics)]
    geo = {p: geomean([tpot[k][p] for k in complete]) for p in statics + [adaptive]} if complete else {}
    best_static = min(statics, key=geo.get) if geo and statics else None
    per_point = []
    for k in points:
        row = tpot[k]
        candidates = {p: row[p] for p in statics if row.get(p) is not None}
        oracle = min(candidates, key=candidates.get) if candidates else None
        per_point.append({
            "dataset": k[0], "rate": k[1], "adaptive_tpot_s": row[adaptive], "oracle": oracle,
            "oracle_tpot_s": candidates.get(oracle),
            "vs_oracle": candidates[oracle] / row[adaptive] if oracle else None,
            "vs_best_static": (row[best_static] / row[adaptive]) if best_static and row.get(best_static) else None,
            "meets_oracle_goal": bool(oracle) and candidates[oracle] / row[adaptive] >= ORACLE_GOAL})
    overall = {p: geo[p] / geo[adaptive] for p in statics} if geo else {}
    return {"points": per_point, "geomean_tpot_s": geo, "best_static": best_static,
            "adaptive_vs_static_geomean": overall,
            "goal_oracle_every_point": bool(per_point) and all(p["meets_oracle_goal"] for p in per_point),
            "goal_beats_every_static": bool(overall) and all(r > 1.0 for r in overall.values()),
            "points_in_geomean": len(complete)}


def mean_tpot(doc: dict) -> dict[tuple[str, float], dict[str, float]]:
    return {k: {p: m["tpot_s"]["mean"] for p, m in row.items() if m["tpot_s"]["mean"] is not None}
            for k, row in cells(doc).items()}


# ---------------------------------------------------------------------------- plots
def plot_latency_vs_rate(doc: dict, path: Path) -> Path:
    table = cells(doc)
    datasets = sorted({d for d, _ in table})
    policies = list(doc["policies"])
    fig, axes = plt.subplots(2, len(datasets), figsize=(6 * len(datasets), 8), squeeze=False)
    for j, dataset in enumerate(datasets):
        rates = sorted(r for d, r in table if d == dataset)
        x = list(range(len(rates)))
        for p in policies:
            tp = [table[(dataset, r)].get(p, {}).get("tpot_s", {}).get("mean") for r in rates]
            thr = [table[(dataset, r)].get(p, {}).get("output_throughput") for r in rates]
            style = dict(marker="o", linewidth=2.5 if p == ADAPTIVE else 1.2, color="black" if p == ADAPTIVE else None)
            axes[0][j].plot(x, [None if v is None else 1000 * v for v in tp], label=p, **style)
            axes[1][j].plot(x, thr, label=p, **style)
        for row, ylabel in ((0, "mean TPOT (ms)"), (1, "output tokens/s")):
            ax = axes[row][j]
            ax.set_xticks(x, [rate_label(r) for r in rates])
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][j].set_title(dataset)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_adaptive_k(doc: dict, path: Path) -> Path:
    runs = [r for r in doc["runs"] if r["policy"] == ADAPTIVE]
    datasets = sorted({r["dataset"] for r in runs}) or ["-"]
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
    for j, dataset in enumerate(datasets):
        ax = axes[0][j]
        for r in sorted((r for r in runs if r["dataset"] == dataset), key=lambda r: r["rate"]):
            tl = r["result"]["telemetry"]["timeline"]
            ax.plot([p["t"] for p in tl], [p["mean_k"] for p in tl], label=f"rate {rate_label(r['rate'])}")
        ax.set_title(f"{dataset}: k chosen by the controller")
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("mean k per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_phase_change(phase: dict, path: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7))
    starts = phase["segment_starts_s"]
    adaptive = phase["runs"].get(ADAPTIVE)
    if adaptive:
        tl = adaptive["timeline"]
        top.plot([p["t"] for p in tl], [p["mean_k"] for p in tl], color="black", label="mean k (adaptive)")
        top.plot([p["t"] for p in tl], [p["mean_batch"] for p in tl], color="tab:blue", alpha=0.5, label="mean batch")
    for s, seg in zip(starts, phase["segments"]):
        top.axvline(s, color="gray", linestyle="--")
        top.text(s + 1, top.get_ylim()[1] * 0.9 if top.get_ylim()[1] else 1, f"{seg['dataset']}\n{seg['rate']:g}/s",
                 fontsize=8)
    top.set_xlabel("seconds into the trace")
    top.legend(fontsize=8, loc="upper right")
    top.grid(alpha=0.3)
    policies = list(phase["runs"])
    width = 0.8 / max(len(policies), 1)
    for i, p in enumerate(policies):
        vals = [0 if v is None else 1000 * v for v in phase["runs"][p]["segment_tpot_s"]]
        bottom.bar([s + i * width for s in range(len(vals))], vals, width, label=p,
                   color="black" if p == ADAPTIVE else None)
    bottom.set_xticks([s + 0.4 - width / 2 for s in range(len(starts))],
                      [f"{seg['dataset']} {seg['rate']:g}/s" for seg in phase["segments"]])
    bottom.set_ylabel("mean TPOT (ms)")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- report.md
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def results_table(doc: dict, dataset: str) -> list[str]:
    table = cells(doc)
    policies = list(doc["policies"])
    lines = ["| rate (req/s) | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
    for rate in sorted(r for d, r in table if d == dataset):
        row = table[(dataset, rate)]
        parts = []
        for p in policies:
            m = row.get(p)
            parts.append("-" if m is None else
                         f"{_ms(m['tpot_s']['mean'])} / {_ms(m['tpot_s']['p99'])} / {m['output_throughput']:.1f}")
        lines.append(f"| {rate_label(rate)} | " + " | ".join(parts) + " |")
    return lines


def acceptance_table(doc: dict) -> list[str]:
    policies = [p for p in doc["policies"] if p != "off"]
    lines = ["| dataset, rate | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
    rows: dict[tuple[str, float], dict[str, dict]] = {}
    for run in doc["runs"]:
        rows.setdefault((run["dataset"], float(run["rate"])), {})[run["policy"]] = run["result"]["telemetry"]
    for (d, r), row in sorted(rows.items()):
        parts = []
        for p in policies:
            t = row.get(p) or {}
            mal, k = t.get("mean_accepted_length"), t.get("mean_k")
            parts.append("-" if mal is None else f"{mal:.2f} (k {k:.1f})")
        lines.append(f"| {d} {rate_label(r)} | " + " | ".join(parts) + " |")
    return lines


def write_report(out: Path) -> Path:
    doc = json.loads((out / "results.json").read_text())
    grid = bool(doc["runs"])  # false: `--rates none`, the phase-change trace alone
    plots = ([plot_latency_vs_rate(doc, out / "latency_vs_rate.png"), plot_adaptive_k(doc, out / "adaptive_k.png")]
             if grid else [])
    if doc.get("phase_change"):
        plots.append(plot_phase_change(doc["phase_change"], out / "phase_change.png"))
    s, mach = doc["settings"], doc["machine"]
    lines = [
        "# adaspec sweep: does adaptation pay?", "",
        f"Command: `{doc['command']}`", "",
        f"Machine: {mach['cpu']}, {mach['cores']} cores, {mach['memory_gib']} GiB, {mach['platform']}; "
        f"load average at start {', '.join(f'{x:.1f}' for x in mach['loadavg_1_5_15'])}"
        + (f", at end {', '.join(f'{x:.1f}' for x in mach['loadavg_at_end'])}" if mach.get("loadavg_at_end") else "")
        + (f"; CPU steal {100 * mach['cpu_steal_fraction']:.0f}%" if mach.get("cpu_steal_fraction") is not None else "")
        + f"; run {mach['date_utc']} UTC.",
    ]
    if mach.get("busy_processes"):
        lines += ["", "Other processes busy at the start (timings are noisy; the interleaved order spreads it "
                  "over every policy): " + "; ".join(f"`{b}`" for b in mach["busy_processes"])]
    if mach.get("busy_processes_at_end"):
        lines += ["", "Busy at the end: " + "; ".join(f"`{b}`" for b in mach["busy_processes_at_end"])]
    # Sweeps from before `request_mix` existed ran every request greedy with ignore_eos.
    mix = RequestMix.model_validate(s.get("request_mix") or RequestMix.synthetic().model_dump())
    prompts = f"{s['num_prompts']} test-split prompts per run" if grid else "the phase-change trace below"
    lines += ["", f"Workload: {prompts}; requests: {mix.describe(s['max_tokens'])}; "
              f"Poisson arrivals (burstiness {s['burstiness']:g}), seed {s['seed']}; "
              f"every policy sees the same prompts at the same times, on one running deployment, in an "
              f"interleaved order. Cells: mean TPOT (ms) / p99 TPOT (ms) / output tokens/s.", ""]
    lines += ["Policies: " + "; ".join(f"`{p}` = `{t}`" if t else f"`{p}` = the controller"
                                       for p, t in doc["policies"].items())]
    for note in doc.get("notes", []):
        lines.append(f"- {note}")
    if grid:
        lines += grid_sections(doc, out)
    lines += phase_section(doc.get("phase_change")) + cross_check_section(doc.get("cross_check"))
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def grid_sections(doc: dict, out: Path) -> list[str]:
    """The rate x dataset grid's tables, verdicts (written to verdicts.json and, with rounds,
    verdicts-intervals.json) and acceptance."""
    v = verdicts(mean_tpot(doc))
    (out / "verdicts.json").write_text(json.dumps(v, indent=1))
    lines: list[str] = []
    for dataset in sorted({r["dataset"] for r in doc["runs"]}):
        lines += ["", f"## {dataset}", ""] + results_table(doc, dataset)
    tpots = round_tpots(doc)
    with_rounds = any(len(r) >= 2 for row in tpots.values() for r in row.values())
    interval_verdicts = sweep_verdicts(tpots) if with_rounds else None
    if interval_verdicts:
        lines += interval_section(interval_verdicts)
        (out / "verdicts-intervals.json").write_text(json.dumps(interval_verdicts, indent=1))
    lines += ["", "## Verdicts" + (" on the means alone (no intervals; context)" if with_rounds else ""), "",
              "Speed ratios (reference mean TPOT / adaptive mean TPOT; >1: adaptive faster). "
              f"Best single static policy over the whole sweep: `{v['best_static']}`. The oracle at a point "
              "is the smallest of several noisy measurements, so it is biased in its own favour (winner's "
              "curse): on a noisy machine a policy identical to the oracle would score below 1 too.", "",
              "| dataset | rate | oracle | adaptive / oracle | adaptive / best static | goal >= 0.97 |",
              "|---|---|---|---|---|---|"]
    for p in v["points"]:
        lines.append(f"| {p['dataset']} | {rate_label(p['rate'])} | {p['oracle']} ({_ms(p['oracle_tpot_s'])} ms; "
                     f"adaptive {_ms(p['adaptive_tpot_s'])} ms) | {_ratio(p['vs_oracle'])} | "
                     f"{_ratio(p['vs_best_static'])} | {'met' if p['meets_oracle_goal'] else 'MISSED'} |")
    lines += ["", f"Geometric mean of mean TPOT over the {v['points_in_geomean']} points: "
              + ", ".join(f"{p} {_ms(t)} ms" for p, t in v["geomean_tpot_s"].items()), "",
              "Adaptive vs each static policy over the whole sweep (ratio of geometric means): "
              + ", ".join(f"{p} {_ratio(r)}" for p, r in v["adaptive_vs_static_geomean"].items()), "",
              "Goals:",
              f"- adaptive >= {ORACLE_GOAL}x the oracle at every point: "
              + ("**met**" if v["goal_oracle_every_point"] else "**missed** at "
                 + ", ".join(f"{p['dataset']} {rate_label(p['rate'])} ({_ratio(p['vs_oracle'])} vs {p['oracle']})"
                             for p in v["points"] if not p["meets_oracle_goal"])),
              "- adaptive better than every single static policy over the whole sweep: "
              + ("**met**" if v["goal_beats_every_static"] else "**missed**: "
                 + ", ".join(f"{p} {_ratio(r)}" for p, r in v["adaptive_vs_static_geomean"].items() if r <= 1.0)),
              "", "## Acceptance (replica telemetry)", "",
              "Mean accepted length (tokens per verify step, bonus included) and mean k in force.", ""]
    return lines + acceptance_table(doc)


def _verdict(v: dict) -> str:
    return f"{v['ratio']:.3f} [{v['low']:.3f}, {v['high']:.3f}] **{v['verdict']}**"


def interval_section(v: dict) -> list[str]:
    """The verdicts with their 95% bootstrap intervals (bench/verdicts.py)."""
    lines = ["", "## Verdicts with 95% intervals", "",
             "Speed ratios: reference mean TPOT / adaptive mean TPOT (>1: adaptive faster), with a 95% "
             "two-stage bootstrap interval (rounds, then requests). A goal is met when the whole interval "
             "clears it, missed when the whole interval falls short, inconclusive otherwise. The oracle "
             "at a point is the static policy fastest on the selection rounds; it is scored against "
             "adaptive on the other rounds only.", "",
             "| dataset | rate | oracle (chosen on rounds) | adaptive / oracle (scored on rounds), goal >= 0.97 "
             "| adaptive / off, goal >= 0.97 |", "|---|---|---|---|---|"]
    for p in v["points"]:
        rounds = lambda r: ",".join(str(i + 1) for i in r)  # noqa: E731
        lines.append(f"| {p['dataset']} | {rate_label(p['rate'])} | {p['oracle']} ({rounds(p['selection_rounds'])}) "
                     f"| {_verdict(p['vs_oracle'])} ({rounds(p['scoring_rounds'])}) "
                     f"| {_verdict(p['vs_off']) if 'vs_off' in p else '-'} |")
    lines += ["", "Adaptive against each static policy, geometric mean over the points, every round "
              "(goal > 1):", "", "| static policy | static / adaptive |", "|---|---|"]
    lines += [f"| {name} | {_verdict(x)} |" for name, x in v["vs_static_geomean"].items()]
    g = v["goals"]
    lines += ["", "Goals:", f"- adaptive >= 0.97x the oracle at every point: **{g['oracle_every_point']}**",
              f"- nowhere more than 3% slower than off: **{g['off_every_point']}**",
              f"- adaptive better than every static policy (geometric mean): **{g['beats_every_static']}**"]
    return lines


def phase_goal(phase: dict, resamples: int = 2000) -> dict | None:
    """Adaptive against the best single static policy on the trace (lowest mean TPOT). With 2+
    rounds the best static is chosen on the selection rounds and scored on the others
    (bench/verdicts.split_rounds: no winner's curse), the interval a two-stage bootstrap over
    rounds then requests; with one round (older results), over that round's requests. Goal >= 1.2."""
    runs = phase["runs"]
    if ADAPTIVE not in runs or not runs[ADAPTIVE].get("tpots_s"):
        return None
    rounds = {p: r.get("rounds_tpots_s") or [r["tpots_s"]] for p, r in runs.items() if r.get("tpots_s")}
    statics = [p for p in rounds if p != ADAPTIVE]
    if not statics:
        return None
    n = len(rounds[ADAPTIVE])
    select, score = split_rounds(n) if n >= 2 else ([0], [0])
    best = min(statics, key=lambda p: pooled_mean([rounds[p][i] for i in select]))
    interval = bootstrap_ratio([rounds[best][i] for i in score], [rounds[ADAPTIVE][i] for i in score], mean,
                               resamples=resamples)
    cells, from_means = _segment_cells(phase, statics)
    return {"best_static": best, "ratio": interval.ratio, "low": interval.low, "high": interval.high,
            "goal": PHASE_GOAL, "verdict": interval.meets(PHASE_GOAL),
            "selection_rounds": [i + 1 for i in select], "scoring_rounds": [i + 1 for i in score],
            "ceiling": switching_ceiling(cells, best, score), "ceiling_from_means": from_means}


def _segment_cells(phase: dict, policies: list[str]) -> tuple[dict[str, list[list[list[float]]]], bool]:
    """(policy -> round -> segment -> TPOTs (seconds), whether any came from segment means).
    Results from before the per-segment TPOTs were kept stand each segment's mean in for the
    number of requests its rate and length give (the ceiling is then approximate)."""
    expected = [max(1, round(s["rate"] * s["duration_s"])) for s in phase["segments"]]
    cells, from_means = {}, False
    for p in policies:
        rounds = phase["runs"][p].get("per_round") or [phase["runs"][p]]
        from_means |= any("segment_tpots_s" not in r for r in rounds)
        cells[p] = [r["segment_tpots_s"] if "segment_tpots_s" in r else
                    [[] if m is None else [m] * n for m, n in zip(r["segment_tpot_s"], expected)] for r in rounds]
    return cells, from_means


def phase_section(phase: dict | None) -> list[str]:
    if not phase:
        return []
    segs = phase["segments"]
    lines = ["", "## Phase change", "", f"Trace `{phase['trace']}` ({phase['requests']} requests in "
             f"{phase.get('rounds', 1)} round(s): new prompts and arrival times each round, the same for every policy "
             "in a round). Mean TPOT (ms) of the requests sent in each segment, mean over the rounds:", "",
             "| policy | " + " | ".join(f"{s['dataset']} {s['rate']:g}/s" for s in segs) + " |",
             "|---" * (len(segs) + 1) + "|"]
    for name, run in phase["runs"].items():
        lines.append(f"| {name} | " + " | ".join(_ms(t) for t in run["segment_tpot_s"]) + " |")
    goal = phase_goal(phase)
    if goal:
        if goal["selection_rounds"] == goal["scoring_rounds"]:
            how = "one round: the interval is over the trace's requests and carries no drift between runs"
        else:
            how = (f"chosen on round(s) {', '.join(map(str, goal['selection_rounds']))}, scored on round(s) "
                   f"{', '.join(map(str, goal['scoring_rounds']))}, two-stage bootstrap over rounds then requests")
        lines += ["", f"Adaptive against the best single static policy on the whole trace (`{goal['best_static']}`; "
                  f"{how}), speed ratio (static mean TPOT / adaptive mean TPOT) with a 95% interval: "
                  f"{_verdict(goal)} (goal >= {PHASE_GOAL}).",
                  "", f"Ceiling on the same rounds: switching to each segment's best static policy, picked with "
                  f"hindsight, would have been {goal['ceiling']:.3f}x `{goal['best_static']}`"
                  + (" (approximate: this result kept segment means, not each request's TPOT)"
                     if goal["ceiling_from_means"] else "")
                  + (f": a goal of {PHASE_GOAL}x is out of reach on this trace for any policy that switches among "
                     "these statics." if goal["ceiling"] < PHASE_GOAL else ".")]
    adaptive = phase["runs"].get(ADAPTIVE)
    if adaptive:
        lines += ["", "Controller settle time after each change (segment start to its last policy change; "
                  "0 = no change needed; close to the segment's length = not settled):", "",
                  "| segment | policy changes | settle (s) | segment (s) | config of the first step under each new "
                  "version (a new table may differ only at other batch sizes) |", "|---|---|---|---|---|"]
        for st, seg in zip(adaptive["settle"], segs):
            lines.append(f"| {seg['dataset']} {seg['rate']:g}/s | {st['changes']} | {st['settle_s']:.1f} | "
                         f"{st['segment_s']:.0f} | {', '.join(st['configs']) or '-'} |")
    return lines


def cross_check_section(x: dict | None) -> list[str]:
    if not x:
        return []
    if "error" in x:
        return ["", "## Cross-check with vLLM's client", "", f"Failed: {x['error'][:500]}"]
    rounds = " / ".join(f"{a['output_throughput']:.1f} vs {v['output_throughput']:.1f}"
                        for a, v in zip(x["adaspec_rounds"], x["vllm_rounds"]))
    return ["", "## Cross-check with vLLM's client", "",
            f"ShareGPT, rate {rate_label(x['rate'])}, policy `{x['policy']}`, {x['num_prompts']} prompts x "
            f"{x['max_tokens']} tokens, against the same deployment, {x['rounds']} alternating rounds "
            f"(adaspec vs vLLM tokens/s per round: {rounds}): `adaspec bench` "
            f"{x['adaspec_output_throughput']:.1f} output tokens/s (mean TPOT {_ms(x['adaspec_mean_tpot_s'])} ms), "
            f"`vllm bench serve` {x['vllm_output_throughput']:.1f} tokens/s (mean TPOT "
            f"{_ms(x['vllm_mean_tpot_s'])} ms): ratio **{x['throughput_ratio']:.3f}** "
            f"({'within' if x['within_10pct'] else 'NOT within'} 10%).", "",
            f"vLLM command: `{x['vllm_command']}`"]

