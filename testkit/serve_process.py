"""Run `serve run CONFIG` the way a user does, and stop it with everything it started
(used by `adaspec sweep` and by the tests' shared server).

`serve run` starts a local Ray cluster; Ray puts workers in their own process groups and
vLLM's engine processes outlive a killed worker (docs/field-notes.md), so a process group kill is
not enough. Everything `serve run` starts stays in its session, though: `stop()` ends the
session's processes and reports any engine process that survived the graceful shutdown.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
# Seconds from `serve run` to the first completion before `wait_ready` gives up: an engine
# start, its CPU compile included, takes 2-3 minutes on 2 cores, more beside another server.
# Below the slow tests' time limit (testkit/time_limits.py), which also covers the first test.
READY_TIMEOUT_S = 600


def _default_sigint() -> None:
    # A shell without job control starts background jobs with SIGINT ignored, and an
    # ignored signal stays ignored across exec: `serve run` would then never see Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def session_processes(sid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of session `sid`."""
    out = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) == sid:
                out.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return out


def live_engine_processes() -> list[str]:
    """Command lines of live vLLM engine processes on this machine."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            text = proc.info["name"] + " " + " ".join(proc.info["cmdline"] or [])
            if "VLLM::" in text and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(f"{proc.pid} {text.strip()}")
        except psutil.NoSuchProcess:
            continue
    return found


@dataclass(frozen=True)
class StartupProbe:
    """One try of `ServeProcess.wait_ready`: seconds after the start, and what GET /health,
    GET /admin/status and a 1-token completion answered (HTTP status, Retry-After)."""

    elapsed_s: float
    health: tuple[int | None, str | None]
    admin: tuple[int | None, str | None]
    completion: tuple[int | None, str | None]


class ServeProcess:
    def __init__(self, config: Path, url: str, log_path: Path, command: list[str] | None = None,
                 env: dict[str, str] | None = None, api_key: str | None = None):
        self.config = config
        self.extra_env = env or {}
        # The OpenAI routes' key, for an app that sets api_key(_env): the readiness completion sends it.
        self.api_key = api_key
        self.url = url
        self.log_path = log_path
        bindir = Path(sys.executable).parent
        self.command = command or [str(bindir / "serve"), "run", str(config)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        self.proc = subprocess.Popen(self.command, cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=_default_sigint)

    def start_ready(self, model: str, timeout_s: float = READY_TIMEOUT_S) -> float:
        """start() and wait_ready(); everything it started is stopped if that fails."""
        self.start()
        try:
            return self.wait_ready(model, timeout_s)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line[:400] for line in lines[-n:] if "Attempted to load weight" not in line)

    def wait_ready(self, model: str, timeout_s: float = READY_TIMEOUT_S, url: str | None = None) -> float:
        """Block until a 1-token completion succeeds (at `url`: another app of the same
        `serve run`; default this server's); return the seconds it took. Every try also asks
        GET /health and GET /admin/status: `self.startup` keeps what each answered
        (StartupProbe), so tests can check that readiness told the truth while starting."""
        base = url or self.url
        start = time.monotonic()
        body = {"model": model, "prompt": "Hi", "max_tokens": 1}
        self.startup: list[StartupProbe] = []
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`serve run` exited with {self.proc.returncode}:\n{self.log_tail()}")
            health, admin = self._probe("get", f"{base}/health"), self._probe("get", f"{base}/admin/status")
            key = {"headers": {"Authorization": f"Bearer {self.api_key}"}} if self.api_key else {}
            completion = self._probe("post", f"{base}/v1/completions", json=body, **key)
            self.startup.append(StartupProbe(time.monotonic() - start, health, admin, completion))
            if completion[0] == 200:
                # Pin this server's Ray session: other Ray instances may start later.
                self.session_dir = Path(os.path.realpath("/tmp/ray/session_latest"))
                return time.monotonic() - start
            time.sleep(3)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")

    def _probe(self, method: str, url: str, **kwargs) -> tuple[int | None, str | None]:
        """(HTTP status or None when nothing answered, its Retry-After header)."""
        try:
            resp = httpx.request(method, url, timeout=10, **kwargs)
        except httpx.HTTPError:
            return None, None
        return resp.status_code, resp.headers.get("retry-after")

    def _port(self, name: str) -> str:
        ports = glob.glob(str(self.session_dir / f"{name}_*"))
        assert ports, f"no {name} in {self.session_dir}"
        return Path(ports[0]).read_text().strip()

    def metrics_text(self) -> str:
        """Prometheus text from the Ray cluster's metrics export port."""
        return httpx.get(f"http://127.0.0.1:{self._port('metrics_export_port')}/metrics", timeout=10).text

    def gcs_address(self) -> str:
        """The address `ray.init(address=...)` joins this server's Ray cluster with."""
        from ray._private.services import get_node_ip_address

        return f"{get_node_ip_address()}:{self._port('gcs_server_port')}"

    def stop(self, grace_s: float = 60) -> list[str]:
        """Ctrl-C `serve run`, then kill what is left of its session.

        Returns the engine processes that were still alive after the graceful shutdown
        (they were killed too)."""
        if self.proc is None:
            return []
        sid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 20
        while session_processes(sid) and time.monotonic() < deadline:
            time.sleep(1)
        survivors = session_processes(sid)
        engines = [f"{p.pid} {p.name()}" for p in survivors if "VLLM" in p.name()]
        for p in survivors:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(survivors, timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
        self._log.close()
        return engines
