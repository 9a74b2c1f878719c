"""What several `adaspec` commands share: the comma-separated list flags, the usage error
that names a flag, and the flag groups (`--url`/`--token`/`--json`; the workload of `bench`
and `sweep`).

A flag's value is checked in the command's `run`, not by argparse, so a bad value is one
line, `adaspec: error: --flag: ...`, with exit status 2 (cli/main.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable


class UsageError(ValueError):
    """A flag with a bad value; the message names the flag."""


# ----------------------------------------------------------------------------- lists
def split_list(text: str, flag: str) -> list[str]:
    """Split at commas outside double quotes (a table:"1-2:chain4,3+:off" has commas); items
    stripped, empty ones dropped; none at all is an error."""
    items, quoted, cur = [], False, ""
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    items.append(cur.strip())
    items = [i for i in items if i]
    if not items:
        raise UsageError(f"{flag}: expected a comma-separated list, got {text!r}")
    return items


def name_list(text: str, flag: str, choices: tuple[str, ...] | None = None) -> list[str]:
    """Names, each one of `choices` when given."""
    names = split_list(text, flag)
    for n in names:
        if choices is not None and n not in choices:
            raise UsageError(f"{flag}: unknown {n!r}; choose from {', '.join(choices)}")
    return names


def _number_list(text: str, flag: str, parse: Callable[[str], float], kind: str,
                 valid: Callable[[float], bool], rule: str) -> list:
    """Comma-separated numbers (`kind`, for the message), at least one, each `valid`
    (else the error says `rule`)."""
    try:
        values = [parse(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated {kind}, got {text!r}") from None
    if not values or not all(valid(v) for v in values):
        raise UsageError(f"{flag}: {rule}, got {text!r}")
    return values


def int_list(text: str, flag: str) -> list[int]:
    """Non-negative integers (speculation lengths, batch sizes)."""
    return _number_list(text, flag, int, "integers", lambda v: v >= 0, "expected non-negative integers")


def probability_list(text: str, flag: str) -> list[float]:
    """Rates between 0 and 1 (acceptance rates)."""
    return _number_list(text, flag, float, "numbers", lambda v: 0.0 <= v <= 1.0, "expected rates between 0 and 1")


def rate_list(text: str, flag: str) -> list[float]:
    """Request rates: positive req/s, or inf (NaN is refused: nan > 0 is false)."""
    return _number_list(text, flag, float, "rates (req/s, or inf)", lambda v: v > 0, "rates must be positive (or inf)")


def positive(value: float, flag: str) -> None:
    if not value > 0:
        raise UsageError(f"{flag}: must be positive, got {value:g}")


# ----------------------------------------------------------------------------- flag groups
def add_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("ADASPEC_URL", "http://127.0.0.1:8000"),
                   help="adaspec HTTP endpoint (default $ADASPEC_URL or http://127.0.0.1:8000)")
    p.add_argument("--token", default=os.environ.get("ADASPEC_ADMIN_TOKEN"),
                   help="admin bearer token (default $ADASPEC_ADMIN_TOKEN)")
    p.add_argument("--json", action="store_true", help="print JSON")


def add_model(p: argparse.ArgumentParser) -> None:
    """--model: the admin routes' `model`, for an app that serves several."""
    p.add_argument("--model", default=None, help="the replicas of one model of the app only (default: every model's)")


def add_workload(p: argparse.ArgumentParser) -> None:
    """The flags of the requests `bench` and `sweep` send (read back by `request_mix`)."""
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1: Poisson)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="cap on output tokens per request (each also stops at EOS and at its dataset's reply length)")
    p.add_argument("--temperature", type=float, default=None,
                   help="every request at this temperature (default: a realistic mix, --greedy-share greedy, "
                        "the rest T=0.7 top_p 0.9)")
    p.add_argument("--top-p", type=float, default=0.9, help="top_p of sampled requests when --temperature is set")
    p.add_argument("--greedy-share", type=float, default=0.5, help="share of greedy requests in the realistic mix")
    p.add_argument("--ignore-eos", action="store_true",
                   help="synthetic: every request runs to exactly --max-tokens (reports say so)")
    p.add_argument("--seed", type=int, default=0, help="prompt order and arrival times")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput's TTFT SLO")
    p.add_argument("--slo-tpot-ms", type=float, default=250.0, help="goodput's TPOT SLO")


def request_mix(args: argparse.Namespace):
    """The workload flags as a RequestMix; a bad value is a usage error naming its flag."""
    from bench.client import RequestMix

    if args.temperature is not None and args.temperature < 0:
        raise UsageError(f"--temperature: must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p: must be in (0, 1], got {args.top_p}")
    if not 0 <= args.greedy_share <= 1:
        raise UsageError(f"--greedy-share: must be in [0, 1], got {args.greedy_share}")
    return RequestMix(temperature=args.temperature, top_p=args.top_p, greedy_share=args.greedy_share,
                      ignore_eos=args.ignore_eos)


def check_dataset(dataset: str, num_prompts: int, seed: int) -> None:
    """Load the prompts once before anything starts; a shortfall names the flag."""
    from adaspec.datasets import DatasetError
    from prepare.datasets import load_prompts

    try:
        load_prompts(dataset, num_prompts, seed, split="test")
    except DatasetError as e:
        raise UsageError(f"{'--num-prompts' if 'requested' in str(e) else '--dataset'}: {e}") from None
