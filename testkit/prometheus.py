"""A real Prometheus server for the dashboard test: Debian's `prometheus` binary (unpacked into
the venv by scripts/install.sh), started on loopback with a config of its own, scraping the
Ray nodes' metrics export ports; and the shipped Grafana dashboard's queries, ready to run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from testkit.apps import port_in_use
from testkit.serve_process import REPO
from testkit.waits import wait_until

DASHBOARD = REPO / "cluster" / "grafana" / "adaspec-dashboard.json"
PORT = 9099  # beside Prometheus' default 9090
SCRAPE_INTERVAL_S = 2


def prometheus_binary() -> str | None:
    """The venv's Prometheus (scripts/fetch_prometheus.sh), else one on PATH."""
    venv = Path(sys.executable).parent / "prometheus"
    return str(venv) if venv.exists() else shutil.which("prometheus")


@contextmanager
def prometheus_server(targets: list[str], workdir: Path) -> Iterator[str]:
    """Prometheus scraping `targets` (host:port) every SCRAPE_INTERVAL_S; yields its URL. Skips
    the test, saying why, where no Prometheus binary could be installed (no apt)."""
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("no prometheus binary: scripts/fetch_prometheus.sh installs Debian's package, which needs apt")
    if port_in_use(PORT):
        pytest.fail(f"port {PORT} (the test's Prometheus) is in use")
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [{"job_name": "ray", "static_configs": [{"targets": targets}]}],
    }))
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{PORT}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{PORT}"
    try:
        wait_until(lambda: _ready(url, proc), "Prometheus ready", 60)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _ready(url: str, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        pytest.fail(f"prometheus exited with {proc.returncode}")
    try:
        return httpx.get(f"{url}/-/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, expr: str) -> list[dict]:
    """The series an instant query returns (Prometheus' HTTP API); an invalid query fails the test."""
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def targets_up(url: str) -> dict[str, str]:
    """Scrape target -> its health ("up", "down", "unknown")."""
    active = httpx.get(f"{url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    return {t["scrapeUrl"]: t["health"] for t in active}


def dashboard_queries(rate_interval: str = "1m", model_name: str = ".*") -> dict[str, str]:
    """Every query of the shipped dashboard, by "panel title / legend", with Grafana's
    variables filled in as Grafana would for "All" models."""
    doc = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", rate_interval).replace("$model_name", model_name)
            out[f"{panel['title']} / {target['legendFormat']}"] = expr
    return out
