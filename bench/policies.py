"""The policies a sweep compares, by name, the profiled batch-size table, and how a sweep
puts a policy in force on a running deployment (`apply_policy`).

Names: `off`, `chainK`, `adaptive` (the controller on), `table:profiled` (built from an
`adaspec profile` run, below) and `table:"1-2:chain4,3+:off"` (any explicit table).

`table:profiled` is the baseline of Su et al. (2023), "The synergy of speculative decoding
and batching": profile once offline, then for each batch size pick the k that maximizes
tokens per second, mean accepted length(k) / step time(k, batch). Acceptance comes from the
profile's own prompts and step times from its k x batch grid, as a careful user would
measure them before deploying; the table never changes afterwards.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from adaspec.policy import PolicyError, SpecConfig, SpecPolicy
from adaspec.telemetry import StepRecord, read_profile, summarize_acceptance
from serve_app import admin_client

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


# How long `adaptive` may take to put its policy in force after a resume: it comes with the
# controller's reply to each replica's next report (controller.period_s, 1 s by default).
CONTROLLER_POLICY_WAIT_S = 15.0


def apply_policy(url: str, policy: NamedPolicy, start_table: str) -> None:
    """Pause the controller and push a static table; or, for `adaptive`, reset the replicas
    to the start table, resume, and return once every replica runs the controller's policy.

    Waiting for it: a static cell's load starts under its own table, and so does adaptive's.
    Without the wait the start table ran a burst's first steps, each seconds long at batch 32:
    in a sweep of 2026-12-06 (Xeon; "Where the burst's last percent went" in the git history
    of docs/benchmarks.md) the rounds whose adaptive burst began with one or two chain4 steps
    at batch 32 were 1.6% and 3.3% slower than `off`, the round that began under the
    controller's table 0.3%."""
    if policy.adaptive:
        admin_client.controller_action(url, "pause")
        _push(url, start_table)
        admin_client.controller_action(url, "resume")
        wait_for_controller_policy(url)
    else:
        admin_client.controller_action(url, "pause")
        _push(url, policy.table)


def wait_for_controller_policy(url: str, timeout_s: float = CONTROLLER_POLICY_WAIT_S) -> float:
    """Seconds until every replica the controller knows runs the policy it chose for it,
    as a report sent after this call began says (the view's `policy_in_force` equal to
    `chosen_policy`: a report from before may still show the previous cell's policy);
    0 without a controller. Raises AdminError after `timeout_s`."""
    start = time.monotonic()
    while True:
        view = admin_client.controller_view(url)
        waited = time.monotonic() - start
        if view is None:
            return 0.0
        if view.replicas and all(r.seconds_since_report < waited and r.chosen_policy is not None
                                 and r.policy_in_force == r.chosen_policy for r in view.replicas):
            return waited
        if waited > timeout_s:
            behind = [f"{r.replica_id}: runs {r.policy_in_force}, chosen {r.chosen_policy}" for r in view.replicas]
            raise admin_client.AdminError(f"the controller's policy not in force after {timeout_s:.0f} s "
                                          f"({'; '.join(behind) or 'no replica reported'})")
        time.sleep(0.2)


def _push(url: str, table: str) -> None:
    acks = admin_client.set_policy(url, table)
    bad = [a for a in acks if a.status != "applied"]
    if bad or not acks:
        raise admin_client.AdminError(f"policy {table} not applied: {bad or 'no replicas'}")
