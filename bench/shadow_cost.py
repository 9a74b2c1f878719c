"""What the n-gram shadow (serve_app/ngram_shadow.py) costs per engine step, without an engine.

`NgramShadow.observe_step` is run as the scheduler runs it after each step, on `--batch`
requests whose histories start at `--history` tokens and grow by one token per step (as under
`off`, where every step drafts for every sequence): half loop (drafts found and accepted),
half random text (short matches, mostly rejected). Prints microseconds per step (median of
rounds) and per sequence. Run it on a quiet machine; it uses one core.

    python -m bench.shadow_cost [--batch 32 --history 1024 --steps 500 --rounds 5 --max-k 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from serve_app.ngram_shadow import NgramShadow


class _Request:
    """What the shadow reads of vLLM's Request."""

    def __init__(self, tokens: list[int]):
        self.all_token_ids = tokens
        self.num_output_tokens = 1


def _texts(batch: int, length: int, rng: random.Random) -> list[list[int]]:
    loop = [rng.randrange(1000, 30000) for _ in range(97)]
    return [[loop[i % len(loop)] for i in range(length)] if b % 2 == 0
            else [rng.randrange(1000, 1400) for _ in range(length)] for b in range(batch)]


def measure(batch: int, history: int, steps: int, max_k: int, seed: int = 0) -> float:
    """Seconds per step of observe_step over `steps` steps."""
    rng = random.Random(seed)
    full = _texts(batch, history + steps, rng)
    shadow = NgramShadow(max_k=max_k, min_n=2, max_n=4, max_model_len=history + steps + max_k + 8)
    ids = [str(b) for b in range(batch)]
    requests = {rid: _Request(full[b][:history]) for b, rid in enumerate(ids)}
    shadow.observe_step(ids, requests)  # the first sight of each request copies its history: not a step's cost
    start = time.perf_counter()
    for step in range(steps):
        for b, rid in enumerate(ids):
            requests[rid].all_token_ids.append(full[b][history + step])
        shadow.observe_step(ids, requests)
        shadow.take()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--history", type=int, default=1024, help="tokens per request at the start")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-k", type=int, default=4)
    args = parser.parse_args(argv)
    per_step = [measure(args.batch, args.history, args.steps, args.max_k, seed=r) for r in range(args.rounds)]
    med = statistics.median(per_step)
    print(f"ngram shadow: batch {args.batch}, {args.history}-{args.history + args.steps} token histories, "
          f"max_k {args.max_k}: {med * 1e6:.0f} us per step (median of {args.rounds}; "
          f"min {min(per_step) * 1e6:.0f}, max {max(per_step) * 1e6:.0f}), {med * 1e6 / args.batch:.1f} us per sequence")


if __name__ == "__main__":
    main()
