"""Overload: what a running adaspec server does when offered more than it can serve.

    python -m bench.overload [--loads 0.5,1,2] [--seconds 240] [--url http://127.0.0.1:8000] [--out DIR]

1. Saturation: 3 x max batch requests sent at once (the soak's probe, bench/soak.py); the rate
   they complete at is the saturation rate (requests/s).
2. For each load (a share of that rate): Poisson arrivals for `--seconds`, realistic requests
   (half greedy, half T=0.7 / top_p 0.9, all stopping at EOS, ShareGPT test-split prompts).
   Requests beyond the replica's bound (Serve's max_ongoing_requests + max_queued_requests,
   from the app config) should get HTTP 429 at once; the rest should be served.
3. Report per load: sent, served, refused (429), other errors; goodput (requests/s and output
   tokens/s completed in the second half of the window, when the queue has filled); e2e
   latency p50/p99 of the served; how long a refusal took. The question: is goodput at twice
   the saturation rate within 10% of the peak, and is the p99 of admitted requests bounded
   (by about the bound / saturation rate) instead of growing with the run?
JSON, a markdown table and a PNG plot in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path


from bench import machine
from bench.client import RequestResult, arrivals_until, realistic_mix, run_load
from bench.metrics import stat
from bench.soak import probe_saturation


def summarize(results: list[RequestResult], seconds: float, offered_rps: float) -> dict:
    """One load's row. Goodput counts requests served that finished in the window's second
    half (seconds after the first arrival), per second of that half."""
    served = [r for r in results if r.ok]
    refused = [r for r in results if r.error.startswith("RateLimitError")]
    failed = [r for r in results if not r.ok and r not in refused]
    half = [r for r in served if seconds / 2 <= r.sent_at + r.e2e_s < seconds]
    e2e = stat([r.e2e_s for r in served])
    return {
        "offered_rps": offered_rps, "sent": len(results), "served": len(served), "refused_429": len(refused),
        "other_errors": len(failed), "error_kinds": sorted({r.error[:120] for r in failed}),
        "goodput_rps": len(half) / (seconds / 2),
        "goodput_tokens_per_s": sum(r.output_tokens for r in half) / (seconds / 2),
        "p50_e2e_s": e2e.p50, "p99_e2e_s": e2e.p99, "max_e2e_s": max((r.e2e_s for r in served), default=None),
        "p99_refusal_s": stat([r.e2e_s for r in refused]).p99,
    }


def plot(rows: list[dict], saturation: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [r["offered_rps"] / saturation for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(loads, [r["goodput_rps"] for r in rows], "o-", label="goodput (served/s)")
    ax1.plot(loads, [r["offered_rps"] for r in rows], "k:", label="offered")
    ax1.axhline(saturation, color="grey", linestyle="--", label="saturation probe")
    ax1.set_xlabel("offered load (x saturation)")
    ax1.set_ylabel("requests/s")
    ax1.legend(fontsize=8)
    ax2.plot(loads, [r["p99_e2e_s"] for r in rows], "o-", label="p99 e2e of served")
    ax2.plot(loads, [r["p50_e2e_s"] for r in rows], "s-", label="p50 e2e of served")
    ax2.set_xlabel("offered load (x saturation)")
    ax2.set_ylabel("seconds")
    ax2.legend(fontsize=8)
    fig.suptitle("adaspec under overload: goodput and latency of admitted requests")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--token", default=None, help="admin token, if the app has one")
    parser.add_argument("--loads", default="0.5,1,2", help="shares of the saturation rate, comma-separated")
    parser.add_argument("--seconds", type=float, default=240.0, help="arrival window per load (seconds)")
    parser.add_argument("--max-tokens", type=int, default=64, help="cap on output tokens per request")
    parser.add_argument("--out", default="bench/results/overload")
    args = parser.parse_args(argv)
    try:
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        parser.error(f"--loads: comma-separated numbers, got {args.loads!r}")
    if not loads or any(not 0 < x <= 5 for x in loads):
        parser.error("--loads: each a share of the saturation rate in (0, 5]")
    if args.seconds < 30:
        parser.error("--seconds: at least 30 (goodput is measured over the second half)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start_machine = machine.describe()

    probe = probe_saturation(args.url, args.token, args.max_tokens)
    model, prompts, max_batch, sat = probe.model, probe.prompts, probe.max_batch, probe.rate
    print(f"[overload] saturation {sat:.2f} req/s; loads {loads}, {args.seconds:g} s each", flush=True)

    rows = []
    for i, load in enumerate(loads):
        offsets = arrivals_until(load * sat, args.seconds, seed=10 + i)
        chosen = [prompts[j % len(prompts)] for j in range(len(offsets))]
        t0 = time.monotonic()
        results = asyncio.run(run_load(args.url, model, chosen, offsets, args.max_tokens,
                                       sampling=realistic_mix(len(offsets), seed=20 + i)))
        row = {"load": load, **summarize(results, args.seconds, load * sat), "wall_s": time.monotonic() - t0}
        rows.append(row)
        print(f"[overload] {load:g}x: sent {row['sent']}, served {row['served']}, 429 {row['refused_429']}, "
              f"other errors {row['other_errors']}; goodput {row['goodput_rps']:.2f} req/s; "
              f"p99 e2e {row['p99_e2e_s']:.1f} s", flush=True)

    peak = max(r["goodput_rps"] for r in rows)
    top = max(rows, key=lambda r: r["load"])
    doc = {
        "command": f"python -m bench.overload --loads {args.loads} --seconds {args.seconds:g} "
                   f"--max-tokens {args.max_tokens}",
        "machine": {**start_machine, **machine.at_end(start_machine)}, "saturation_rps": sat,
        "sampling": "half greedy, half T=0.7 top_p 0.9; all stop at EOS", "rows": rows,
        "peak_goodput_rps": peak, "highest_load": top["load"],
        "goodput_at_highest_load_over_peak": top["goodput_rps"] / peak if peak else None,
    }
    (out / "overload.json").write_text(json.dumps(doc, indent=2))
    plot(rows, sat, out / "overload.png")
    lines = [f"# Overload: {args.loads} x saturation, {args.seconds:g} s each", "", f"`{doc['command']}`", "",
             f"saturation {sat:.2f} req/s ({3 * max_batch} requests at once, {args.max_tokens} tokens at most); "
             f"goodput at {top['load']:g}x over peak: {doc['goodput_at_highest_load_over_peak']:.2f}", "",
             "| load | offered req/s | sent | served | 429 | other errors | goodput req/s | goodput tok/s "
             "| p50 e2e s | p99 e2e s | max e2e s | p99 429 s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines += [f"| {r['load']:g}x | {r['offered_rps']:.2f} | {r['sent']} | {r['served']} | {r['refused_429']} "
              f"| {r['other_errors']} | {r['goodput_rps']:.2f} | {r['goodput_tokens_per_s']:.1f} "
              f"| {fmt(r['p50_e2e_s'])} | {fmt(r['p99_e2e_s'])} | {fmt(r['max_e2e_s'])} | {fmt(r['p99_refusal_s'])} |"
              for r in rows]
    (out / "README.md").write_text("\n".join(lines) + "\n\n![overload](overload.png)\n")
    print("\n".join(lines))
    return 0 if not any(r["other_errors"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
