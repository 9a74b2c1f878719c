"""A real multi-node Ray cluster on one machine: a head and worker nodes started with
`ray start`, each a raylet of its own on loopback (cluster/README.md gives the same
commands by hand). Used by the cluster tests and the routing benchmark.

Each `ray start` runs in a session of its own, and every process it starts (GCS, raylet,
dashboard, agents, the workers that later run replicas) stays in that session, so `stop()`
ends exactly this cluster's processes; `ray stop` would end every Ray process on the
machine, another test server's included.

Token auth: a local `ray.init()` on this machine once wrote ~/.ray/auth_token, after which a
head started here requires the token and a process in the default mode fails with
`InvalidAuthToken`; so every process of the cluster, and every process that joins it
(`join_env()`), runs with the same RAY_AUTH_MODE, and `start()` makes the token first where
none exists yet (`ray get-auth-token --generate`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from testkit.serve_process import session_processes

AUTH_MODE = "token"


@dataclass(frozen=True)
class NodeSpec:
    """One raylet: logical CPUs (may exceed the physical ones) and custom resources."""

    name: str
    num_cpus: int = 1
    resources: dict[str, float] = field(default_factory=dict)


def ray_executable() -> str:
    found = Path(sys.executable).with_name("ray")
    return str(found) if found.exists() else (shutil.which("ray") or "ray")


class LoopbackCluster:
    def __init__(self, nodes: list[NodeSpec], port: int, log_dir: Path, env: dict[str, str] | None = None):
        """`nodes[0]` is the head; `port`: its GCS port on 127.0.0.1 (the next two ports are
        its dashboard's and Ray client's); `env`: set in every node's processes (actors see
        the environment of the raylet that starts them, not the caller's)."""
        self.nodes, self.port, self.log_dir = nodes, port, log_dir
        self.node_env = env or {}
        self.sessions: dict[str, int] = {}  # node name -> session id of its `ray start`

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def join_env(self) -> dict[str, str]:
        """What a process that joins this cluster (`serve run`, a driver) sets in its environment."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": AUTH_MODE, "RAY_USAGE_STATS_ENABLED": "0"}

    def _env(self, head: bool = False) -> dict[str, str]:
        env = {**os.environ, **self.node_env, **self.join_env()}
        if head:  # the head starts the cluster; it joins none
            env.pop("RAY_ADDRESS")
        return env

    def start(self, timeout_s: float = 120.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Token auth needs a token: on a machine where no `ray.init()` ever ran there is no
        # ~/.ray/auth_token yet, and `ray start --head` refuses to make one. Make it (as
        # `ray.init()` would), or keep the one there.
        subprocess.run([ray_executable(), "get-auth-token", "--generate"], env=self._env(head=True),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=120)
        try:
            for i, node in enumerate(self.nodes):
                self.start_node(node, head=i == 0)
            self.wait_for_nodes(len(self.nodes), timeout_s)
        except BaseException:
            self.stop()
            raise

    def start_node(self, node: NodeSpec, head: bool = False) -> None:
        cmd = [ray_executable(), "start", "--node-ip-address", "127.0.0.1", "--num-cpus", str(node.num_cpus),
               "--resources", json.dumps({f"node:{node.name}": 1, **node.resources}), "--disable-usage-stats"]
        if head:
            # Ports of their own, so this cluster runs beside another on the machine (a
            # `serve run` one with the default ports). The dashboard stays: Serve needs its agents.
            cmd += ["--head", "--port", str(self.port), "--dashboard-port", str(self.port + 1),
                    "--ray-client-server-port", str(self.port + 2), "--dashboard-host", "127.0.0.1"]
        else:
            cmd += ["--address", self.address]
        log = open(self.log_dir / f"ray-start-{node.name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env(head), start_new_session=True)
        self.sessions[node.name] = proc.pid  # the session id is the leader's pid
        if proc.wait(timeout=180) != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed; see {log.name}")

    def wait_for_nodes(self, count: int, timeout_s: float, exactly: bool = False) -> None:
        """Until `count` nodes are alive (at least `count`, unless `exactly`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = self.alive_nodes()
            if alive == count or (alive > count and not exactly):
                return
            time.sleep(1.0)
        raise TimeoutError(f"{count} Ray nodes not alive after {timeout_s:.0f} s")

    def alive_nodes(self) -> int:
        """Nodes the GCS lists as alive."""
        out = self.run_driver("print(sum(n['Alive'] for n in ray.nodes()))")
        try:
            return int(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return 0

    def metrics_targets(self) -> list[str]:
        """host:port of every live node's metrics export port (what Prometheus scrapes; Ray
        writes the same list to its session's prom_metrics_service_discovery.json)."""
        out = self.run_driver("for n in ray.nodes():\n"
                              "    if n['Alive']:\n"
                              "        print('target', f\"{n['NodeManagerAddress']}:{n['MetricsExportPort']}\")")
        return [line.split()[1] for line in out.splitlines() if line.startswith("target ")]

    def run_driver(self, script: str, cwd: Path | None = None) -> str:
        """Run `script` in a short-lived driver of its own, joined to this cluster (so the
        caller may be connected to another cluster, or to none); returns what it printed."""
        code = "import ray\nray.init(log_to_driver=False)\n" + script
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self._env(),
                              cwd=cwd, timeout=120).stdout

    def reset_nodes(self, nodes: list[NodeSpec], timeout_s: float = 120.0) -> None:
        """Back to exactly `nodes` (the head among them, unchanged): nodes started since are
        stopped, nodes killed since are started again; returns once the GCS agrees."""
        wanted = {node.name for node in nodes}
        self._end({name: sid for name, sid in self.sessions.items() if name not in wanted})
        for node in nodes:
            if node.name not in self.sessions:
                self.start_node(node)
        self.wait_for_nodes(len(nodes), timeout_s, exactly=True)

    def processes(self, node: str) -> list[psutil.Process]:
        return session_processes(self.sessions[node]) if node in self.sessions else []

    def kill_node(self, name: str) -> None:
        """SIGKILL every process of one node (raylet, its workers and replicas): a node lost."""
        for proc in self.processes(name):
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        self.sessions.pop(name, None)

    def stop(self) -> list[str]:
        """End every node, workers first, then the head; returns what survived a SIGKILL."""
        sessions = dict(self.sessions)
        self._end(sessions)
        self._forget_current_cluster()
        time.sleep(1.0)
        return [f"{p.pid} {' '.join(p.cmdline())}" for sid in sessions.values() for p in session_processes(sid)]

    def _end(self, sessions: dict[str, int]) -> None:
        """SIGTERM the nodes' processes, last started first (Ray's processes shut down
        cleanly on it), SIGKILL what is left after 15 s."""
        for name in reversed(list(sessions)):
            for proc in self.processes(name):
                try:
                    proc.terminate()
                except psutil.NoSuchProcess:
                    pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(self.processes(n) for n in sessions):
            time.sleep(0.5)
        for name in sessions:
            self.kill_node(name)

    def _forget_current_cluster(self) -> None:
        """`ray start --head` records its address in /tmp/ray/ray_current_cluster, and a later
        `ray.init()` with no address (Ray Serve LLM's builder calls one) joins the recorded
        cluster instead of starting a local one: after this cluster is gone it would wait
        for a dead GCS. Forget it, unless another cluster has recorded itself since."""
        record = Path("/tmp/ray/ray_current_cluster")
        try:
            if record.read_text().strip().endswith(f":{self.port}"):
                record.unlink()
        except OSError:
            pass
