"""The policies a sweep compares, by name, and the profiled batch-size table.

Names: `off`, `chainK`, `adaptive` (the controller on), `table:profiled` (built from an
`adaspec profile` run, below) and `table:"1-2:chain4,3+:off"` (any explicit table).

`table:profiled` is the baseline of Su et al. (2023), "The synergy of speculative decoding
and batching": profile once offline, then for each batch size pick the k that maximizes
tokens per second, mean accepted length(k) / step time(k, batch). Acceptance comes from the
profile's own prompts and step times from its k x batch grid, as a careful user would
measure them before deploying; the table never changes afterwards.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from adaspec.policy import PolicyError, SpecConfig, SpecPolicy
from adaspec.telemetry import StepRecord, read_profile, summarize_acceptance

ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class NamedPolicy:
    name: str  # as given on the command line
    table: str | None  # the table pushed to the replicas; None for `adaptive`

    @property
    def adaptive(self) -> bool:
        return self.table is None

    @property
    def max_depth(self) -> int:
        return 0 if self.table is None else SpecPolicy.parse(self.table).max_depth


def profiled_table(steps: list[StepRecord], grid: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> str:
    """The best k per batch-size bucket (grid point b covers the sizes after the previous
    point up to b; the last bucket is open-ended). Only pure decode steps count for step
    time; buckets without data for some k leave that k out."""
    by_config: dict[SpecConfig, list[StepRecord]] = defaultdict(list)
    for s in steps:
        by_config[s.config].append(s)
    accepted_length = {c: summarize_acceptance(ss).mean_accepted_length for c, ss in by_config.items()}
    table = [SpecConfig.off()]  # [batch size] -> config; index 0 unused
    lo = 1
    for hi in grid:
        # A bucket the profile never reached keeps its smaller neighbour's choice.
        best, best_speed = table[-1], 0.0
        for config, ss in by_config.items():
            durations = [s.duration_s for s in ss
                         if lo <= s.batch_size <= hi and s.num_decode_reqs and not s.prefill_tokens]
            if not durations:
                continue
            speed = accepted_length[config] / (sum(durations) / len(durations))  # tokens/s per sequence
            if speed > best_speed:
                best, best_speed = config, speed
        table += [best] * (hi - lo + 1)
        lo = hi + 1
    return str(SpecPolicy.from_table(table))  # the last bucket open-ended


def resolve(names: list[str], profile_path: Path | None) -> list[NamedPolicy]:
    """NamedPolicy per name; raises PolicyError naming the bad one."""
    out = []
    for name in names:
        if name == ADAPTIVE:
            out.append(NamedPolicy(name, None))
        elif name == "table:profiled":
            if profile_path is None or not Path(profile_path).is_file():
                raise PolicyError(f"table:profiled needs a profile's steps.jsonl (--profile), not found: {profile_path}")
            out.append(NamedPolicy(name, profiled_table(read_profile(profile_path)[1])))
        elif name.startswith("table:"):
            out.append(NamedPolicy(name, str(SpecPolicy.parse(name[len("table:"):].strip("\"'")))))
        else:
            out.append(NamedPolicy(name, str(SpecPolicy.uniform(SpecConfig.parse(name)))))
    if len({p.name for p in out}) != len(out):
        raise PolicyError("a policy is named twice")
    return out


def interleaved(policies: list[NamedPolicy], round_index: int) -> list[NamedPolicy]:
    """Round r's order: rotated by r and reversed every other round, so that no policy
    always runs first, last, or right after the same neighbour (drift hits all alike)."""
    n = len(policies)
    rotated = [policies[(i + round_index) % n] for i in range(n)]
    return rotated[::-1] if round_index % 2 else rotated
