"""Client for adaspec's /admin HTTP routes (see serve_app/ingress.py), and the status table."""

from __future__ import annotations

import httpx
from pydantic import BaseModel, ConfigDict

from adaspec.telemetry import ReplicaTelemetry, summarize_acceptance


class AdminError(RuntimeError):
    """The admin route answered with an error, or could not be reached."""


class PolicyAckView(BaseModel):
    """A replica's answer to a policy push, as the admin route returns it."""

    model_config = ConfigDict(extra="ignore")

    replica_id: str
    status: str
    version_in_force: int
    policy_in_force: str
    message: str = ""


def _request(method: str, url: str, path: str, token: str | None, **kwargs) -> list:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.request(method, url.rstrip("/") + path, headers=headers, timeout=60, **kwargs)
    except httpx.HTTPError as e:
        raise AdminError(f"cannot reach {url}: {e}") from None
    if resp.status_code != 200:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = resp.text
        raise AdminError(f"{path}: HTTP {resp.status_code}: {message}")
    return resp.json()


def status(url: str, token: str | None = None) -> list[ReplicaTelemetry]:
    return [ReplicaTelemetry.model_validate(r) for r in _request("GET", url, "/admin/status", token)]


def set_policy(url: str, table: str, token: str | None = None, version: int | None = None) -> list[PolicyAckView]:
    body = {"table": table, "version": version}
    return [PolicyAckView.model_validate(a) for a in _request("POST", url, "/admin/policy", token, json=body)]


def format_status(reports: list[ReplicaTelemetry]) -> str:
    """A one-screen, human-readable view of every replica."""
    lines = []
    for r in reports:
        steps = r.steps
        acc = summarize_acceptance(steps)
        batch_sizes = sorted({s.batch_size for s in steps})
        step_ms = 1000 * sum(s.duration_s for s in steps) / len(steps) if steps else 0.0
        span = r.window_end - r.window_start
        lines += [
            f"replica {r.replica_id}  ({r.capabilities.engine}, {r.capabilities.draft_method}, "
            f"max k {r.capabilities.max_k}, max batch {r.capabilities.max_batch_size})",
            f"  policy v{r.policy.version}: {r.policy}",
            f"  window {span:.0f} s: {len(steps)} steps, {r.arrivals} arrivals "
            f"({r.arrival_rate:.2f} req/s), {r.finished} finished; now running {r.running}, "
            f"queued {r.queue_length}",
            f"  batch sizes seen: {_ranges(batch_sizes) or '-'}",
            f"  mean step time: {step_ms:.1f} ms",
            f"  acceptance per position: "
            + (" ".join(f"{p:.2f}" for p in acc.conditional_rate_per_pos) or "-")
            + f"  (rate {acc.acceptance_rate:.3f}, mean accepted length {acc.mean_accepted_length:.2f})",
        ]
    return "\n".join(lines) if lines else "no replicas"


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)
