"""The environment of the processes that start Ray for adaspec (`serve run`, `ray start`).

Ray starts every worker process (each Serve replica, the ingress, the controller actor, and
the vLLM engine-core and worker processes a replica spawns) at niceness 15, below everything
else on the node (the raylet's `worker_niceness`). On a node whose CPUs are busy, the
engine's CPU work then waits behind whatever runs at the default priority: Ray's own GCS and
raylet, a client or exporter on the same node, another server. A serving node wants the
opposite. The raylet reads the setting from its environment at start, so it must be set in
the process that starts Ray: `adaspec serve`, the KubeRay manifests and `adaspec peer` do.
The test suite's servers still start at Ray's default: under niceness 0 two real-stack tests
failed in CI (a profile cell whose three requests never ran at batch 3; two of twenty timed-out
non-streaming requests not aborted before they finished), not examined yet;
a user running `serve run` or `ray start` directly exports it themselves
(docs/configuration.md, "Ray's worker priority"). What it costs when left at 15:
docs/benchmarks.md, "adaspec against plain vLLM".
"""

from __future__ import annotations

from collections.abc import Mapping

WORKER_NICENESS_ENV = "RAY_worker_niceness"
RAY_ENV = {WORKER_NICENESS_ENV: "0"}


def with_ray_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with RAY_ENV added; a value `env` already has wins (a user's own choice)."""
    return {**RAY_ENV, **env}
