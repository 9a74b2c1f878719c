"""The tests start the server the way `adaspec sweep` does: see adaspec/serve_process.py."""

from bench.serve_process import REPO, ServeProcess, live_engine_processes, session_processes

__all__ = ["REPO", "ServeProcess", "live_engine_processes", "session_processes"]
