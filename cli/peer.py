"""`adaspec peer`: adaspec against plain vLLM and Ray Serve LLM, started side by side and
alternated (bench/peer.py); writes results.json, README.md (the report) and peer.png."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cli.arguments import UsageError, name_list, positive, split_list

PEERS = ("vllm", "vllm-ngram", "ray-serve-llm", "adaspec:off", "adaspec:chain", "adaspec:adaptive")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peer", help="adaspec against plain vLLM and Ray Serve LLM, alternated")
    p.add_argument("--config", default="configs/app.yaml", help="the adaspec app to start (its first application)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help="comma-separated, of: " + ", ".join(PEERS) + " (vllm-ngram and adaspec:chain at --k)")
    p.add_argument("--loads", default="stream,0.5,2,inf",
                   help="`stream` (one request at a time), Poisson rates in req/s, `inf` (all at once)")
    p.add_argument("--k", type=int, default=4, help="static speculation length of vllm-ngram and adaspec:chain")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per rate or burst cell")
    p.add_argument("--stream-prompts", type=int, default=4, help="requests per `stream` cell")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on output tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (new prompts each)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts, arrival times and sampling of each round")
    p.add_argument("--report-only", action="store_true", help="rewrite README.md and peer.png from results.json")
    p.add_argument("--out", required=True, help="folder for results.json, README.md (the report) and peer.png")
    p.set_defaults(func=run)


def parse_loads(text: str) -> list[str]:
    loads = split_list(text, "--loads")
    for load in loads:
        if load in ("stream", "inf"):
            continue
        try:
            ok = float(load) > 0
        except ValueError:
            ok = False
        if not ok:
            raise UsageError(f"--loads: {load!r} is not `stream`, `inf` or a positive rate")
    return loads


def run(args: argparse.Namespace) -> int:
    from bench.peer import PeerBenchmark, PeerSettings, write_report

    out = Path(args.out)
    if args.report_only:
        if not (out / "results.json").is_file():
            raise UsageError(f"--out: no results.json in {out}")
        print(write_report(out))
        return 0
    if not Path(args.config).is_file():
        raise UsageError(f"--config: no such file {args.config!r}")
    for flag in ("k", "num_prompts", "stream_prompts", "max_tokens", "rounds"):
        positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    settings = PeerSettings(config=args.config, loads=parse_loads(args.loads), k=args.k,
                            peers=name_list(args.peers, "--peers", PEERS), num_prompts=args.num_prompts,
                            stream_prompts=args.stream_prompts, max_tokens=args.max_tokens, rounds=args.rounds,
                            seed=args.seed, out=str(out))
    PeerBenchmark(settings, ["adaspec", *sys.argv[1:]]).run()
    print(write_report(out))
    return 0
