"""Client for adaspec's /admin HTTP routes (see serve_app/ingress.py), and the status table."""

from __future__ import annotations

import httpx

from adaspec.policy import PolicyAck
from adaspec.telemetry import ReplicaTelemetry, summarize_acceptance
from controller.view import ControllerView

# HTTP client loggers that log one INFO line per request: the CLI and the benchmarks keep them
# at WARNING (the openai client runs on httpx2, the admin client on httpx).
QUIET_LOGGERS = ("httpx", "httpx2", "openai")


class AdminError(RuntimeError):
    """The admin route answered with an error, or could not be reached."""


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


def _model_query(model: str | None) -> dict:
    return {} if model is None else {"params": {"model": model}}


def status(url: str, token: str | None = None, model: str | None = None) -> list[ReplicaTelemetry]:
    """Every replica's telemetry (of `model` only, when given)."""
    reports = _request("GET", url, "/admin/status", token, **_model_query(model))
    return [ReplicaTelemetry.model_validate(r) for r in reports]


def set_policy(url: str, table: str, token: str | None = None, version: int | None = None,
               replica_id: str | None = None, model: str | None = None) -> list[PolicyAck]:
    body = {"table": table, "version": version, "replica_id": replica_id, "model": model}
    return [PolicyAck.model_validate(a) for a in _request("POST", url, "/admin/policy", token, json=body)]


def controller_view(url: str, token: str | None = None, model: str | None = None) -> ControllerView | None:
    """The controller's view (of `model`'s deployment and replicas, when given), or None when no
    controller runs."""
    try:
        return ControllerView.model_validate(_request("GET", url, "/admin/controller", token, **_model_query(model)))
    except AdminError as e:
        if "HTTP 404" in str(e):
            return None
        raise


def controller_action(url: str, action: str, token: str | None = None) -> ControllerView:
    return ControllerView.model_validate(_request("POST", url, "/admin/controller", token, json={"action": action}))


def _fmt(x: float | None, scale: float = 1.0, unit: str = "") -> str:
    return "-" if x is None else f"{scale * x:.1f}{unit}"


def format_controller(view: ControllerView | None) -> str:
    if view is None:
        return "controller: not running"
    lines = [f"controller: {'PAUSED' if view.paused else 'active'}; {view.decisions} decisions, "
             f"{view.policies_pushed} policies pushed"
             + ("; resumed from checkpoint" if view.restored_from_checkpoint else "")]
    for d in view.deployments:
        fit = d.step_time_model
        mape = f"{100 * fit.holdout_mape:.1f}%" if fit.holdout_mape is not None else "-"
        lines += [
            f"  deployment {d.key or d.model_id}: {d.replicas} replicas on {d.nodes} nodes, rate {d.arrival_rate:.2f} req/s, "
            f"batch {d.batch:.1f} in total",
            f"    pooled acceptance per position: {' '.join(f'{p:.2f}' for p in d.conditional_acceptance) or '-'}",
            f"    step-time model: {fit.kind}, {fit.samples} steps, held-out error {mape}",
        ]
    for r in view.replicas:
        lines += [
            f"  replica {r.replica_id} on node {r.node_id[:8] or '?'} ({r.node_ip}): rate {r.arrival_rate:.2f} req/s, "
            f"batch {r.mean_batch:.1f}, output {r.output_tokens:.0f} tokens/request",
            f"    acceptance per position: {' '.join(f'{p:.2f}' for p in r.conditional_acceptance)}",
            f"    in force: {r.policy_in_force}   chosen: {r.chosen_policy or '-'} "
            f"(decision {_fmt(r.decision_ms, unit=' ms')}{'; a trial' if r.exploring else ''})",
            f"    exploration {100 * r.exploration_share:.1f}% of recent steps; safety rule put off in place "
            f"{r.safety_overrides} times; workload changes seen {r.workload_changes}",
            f"    step time measured {_fmt(r.measured_step_s, 1000, ' ms')}, "
            f"predicted {_fmt(r.predicted_step_s, 1000, ' ms')} (x{r.step_scale:.2f} for this replica's "
            f"load; error before the steps ran {_fmt(r.step_error, 100, '%')}, "
            f"{_fmt(r.step_error_unscaled, 100, '%')} unscaled); predicted batch "
            f"{_fmt(r.operating_batch)}, latency {_fmt(r.predicted_latency_s, unit=' s')} "
            f"(measured {_fmt(r.measured_latency_s, unit=' s')})",
        ]
        for c in r.latency_fits:
            fit = c.fit
            lines.append(
                f"    latency fit {fit.config}: C1 {c.c1_s:.2f} s + B x C2 {c.c2_s:.3f} s "
                f"({fit.samples} requests, batch {fit.batch_lo:.1f}-{fit.batch_hi:.1f}, "
                f"error {100 * fit.relative_error:.0f}%); saturates at {_fmt(c.saturation_rate, unit=' req/s')}"
                + ("" if fit.config.is_off else f", slower than off beyond {_fmt(c.break_even_rate, unit=' req/s')}"))
    for d in view.dropped:
        lines.append(f"  dropped replica {d.replica_id} on node {d.node_id[:8] or '?'}: {d.reason}, "
                     f"{d.dropped_at - d.last_report:.1f} s after its last report")
    return "\n".join(lines)


def format_status(reports: list[ReplicaTelemetry]) -> str:
    """A one-screen, human-readable view of every replica."""
    lines = []
    for r in reports:
        steps = r.steps
        acc = summarize_acceptance(steps)
        batch_sizes = sorted({s.batch_size for s in steps})
        step_ms = 1000 * sum(s.duration_s for s in steps) / len(steps) if steps else 0.0
        span = r.window_end - r.window_start
        head = f"replica {r.replica_id} of {r.model_id}"
        if r.info is not None:
            caps = r.info.capabilities
            head += (f"  on node {r.info.node_id[:8]} ({r.info.node_ip})  ({caps.engine}, {caps.draft_method}, "
                     f"max k {caps.max_k}, max batch {caps.max_batch_size})")
        lines += [
            head,
            f"  policy v{r.policy.version}: {r.policy}",
            f"  window {span:.0f} s: {len(steps)} steps, {r.arrivals} arrivals "
            f"({r.arrival_rate:.2f} req/s), {r.finished} finished; now running {r.running}, "
            f"queued {r.queue_length}",
            f"  batch sizes seen: {_ranges(batch_sizes) or '-'}",
            f"  mean step time: {step_ms:.1f} ms",
            "  acceptance per position: "
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
