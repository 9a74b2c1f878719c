"""Write adaspec's Grafana dashboard (cluster/grafana/adaspec-dashboard.json) from the panel list below.

    python scripts/gen_dashboard.py           # rewrite the dashboard
    python scripts/gen_dashboard.py --check   # exit 1 if the file is out of date

Every query reads series the app exports through Ray's metrics agent (serve_app/metrics.py,
controller/metrics.py, serve_app/router.py, and vLLM's own): the speculation row, the
controller, routing, and serving latency in vLLM's names, so it reads vLLM and native
replicas alike. tests/test_cluster.py runs every query against a real Prometheus scraping a
running app; tests/test_docs_links.py checks the file is what this script writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "cluster" / "grafana" / "adaspec-dashboard.json"

M = 'model_name=~"$model_name"'  # the model picker
RATE = "[$__rate_interval]"


def _rate(metric: str, by: str = "model_name") -> str:
    return f"sum by ({by}) (rate({metric}{{{M}}}{RATE}))"


def _quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le, model_name) (rate({histogram}_bucket{{{M}}}{RATE})))"


# (row, [(title, unit, [(legend, PromQL)])])
ROWS = [
    ("Speculation", [
        ("Draft acceptance rate", "percentunit", [
            ("{{model_name}}", f"{_rate('ray_vllm_spec_decode_num_accepted_tokens_total')} / "
                               f"{_rate('ray_vllm_spec_decode_num_draft_tokens_total')}")]),
        ("Acceptance per draft position", "percentunit", [
            ("{{model_name}} position {{position}}",
             f"{_rate('ray_vllm_spec_decode_num_accepted_tokens_per_pos_total', 'model_name, position')} "
             f"/ ignoring(position) group_left {_rate('ray_vllm_spec_decode_num_drafts_total')}")]),
        ("Mean acceptance length (tokens per verify step, bonus included)", "none", [
            ("{{model_name}}", f"1 + {_rate('ray_vllm_spec_decode_num_accepted_tokens_total')} / "
                               f"{_rate('ray_vllm_spec_decode_num_drafts_total')}")]),
        ("k in force by batch size", "none", [
            ("{{model_name}} batch {{batch}}", f"max by (model_name, batch) (ray_adaspec_spec_k{{{M}}})")]),
        ("Policy version in force", "none", [
            ("{{replica}}", f"max by (model_name, replica) (ray_adaspec_policy_version{{{M}}})")]),
    ]),
    ("Controller", [
        ("Decisions and policy pushes", "ops", [
            ("decisions {{model_name}}", _rate("ray_adaspec_controller_decisions_total")),
            ("pushes {{model_name}}", _rate("ray_adaspec_controller_policy_pushes_total"))]),
        ("Exploration share of steps", "percentunit", [
            ("{{replica}}", f"max by (model_name, replica) (ray_adaspec_controller_exploration_share{{{M}}})")]),
        ("Safety rule: `off` put in place of the models' choice", "short", [
            ("{{model_name}}",
             f"sum by (model_name) (increase(ray_adaspec_controller_safety_overrides_total{{{M}}}{RATE}))")]),
        ("Step time: predicted and measured", "s", [
            ("{{source}} {{replica}}",
             f"max by (model_name, replica, source) (ray_adaspec_controller_step_seconds{{{M}}})")]),
    ]),
    ("Routing", [
        ("Router choices by mode", "ops", [
            ("{{deployment}} {{mode}}", "sum by (deployment, mode) (rate(ray_adaspec_router_choices_total" + RATE + "))")]),
    ]),
    ("Serving", [
        ("Time to first token", "s", [
            ("p50 {{model_name}}", _quantile(0.5, "ray_vllm_time_to_first_token_seconds")),
            ("p95 {{model_name}}", _quantile(0.95, "ray_vllm_time_to_first_token_seconds"))]),
        ("Time per output token", "s", [
            ("p50 {{model_name}}", _quantile(0.5, "ray_vllm_request_time_per_output_token_seconds")),
            ("p95 {{model_name}}", _quantile(0.95, "ray_vllm_request_time_per_output_token_seconds"))]),
        ("Requests running and waiting", "short", [
            ("running {{model_name}}", f"sum by (model_name) (ray_vllm_num_requests_running{{{M}}})"),
            ("waiting {{model_name}}", f"sum by (model_name) (ray_vllm_num_requests_waiting{{{M}}})")]),
        ("Engine step time", "s", [
            ("p50 {{model_name}}", _quantile(0.5, "ray_adaspec_step_seconds")),
            ("p95 {{model_name}}", _quantile(0.95, "ray_adaspec_step_seconds"))]),
    ]),
]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def dashboard() -> dict:
    panels, y, panel_id = [], 0, 1
    for row, row_panels in ROWS:
        panels.append({"type": "row", "title": row, "id": panel_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for i, (title, unit, targets) in enumerate(row_panels):
            panels.append({
                "type": "timeseries", "title": title, "id": panel_id, "datasource": DATASOURCE,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr,
                             "legendFormat": legend} for j, (legend, expr) in enumerate(targets)],
            })
            panel_id += 1
        y += 8 * ((len(row_panels) + 2) // 3)
    return {
        "title": "adaspec: speculative decoding", "uid": "adaspec", "schemaVersion": 39, "version": 1,
        "tags": ["adaspec", "vllm", "ray-serve"], "timezone": "browser", "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus", "query": "prometheus"},
            {"type": "query", "name": "model_name", "label": "model", "datasource": DATASOURCE,
             "query": "label_values(ray_adaspec_policy_version, model_name)", "refresh": 2,
             "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if DASHBOARD.read_text() != text:
            print(f"{DASHBOARD.relative_to(REPO)} is out of date: run python scripts/gen_dashboard.py")
            return 1
        return 0
    DASHBOARD.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD.write_text(text)
    print(f"wrote {DASHBOARD.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
