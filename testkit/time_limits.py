"""Every test runs under a time limit (pytest-timeout), by tier, and a hang fails that one
test with every thread's stack while the run goes on. A pytest plugin: tests/conftest.py
loads it.

Tiers:
- a unit test: pyproject.toml's `timeout` (300 s). The slowest compile (torch.compile, the
  C++ kernels) or load the real model; the last test of a run also stops the shared server
  (up to 90 s: `ServeProcess.stop`).
- a real-stack test (`slow`): `SLOW_LIMIT_S`, 15 minutes, unless it carries its own
  `@pytest.mark.timeout`. pytest-timeout times setup, call and teardown together, so the
  first test of a session or module also pays for starting the server or app its fixtures
  share (2-3 minutes on 2 cores; `wait_ready` gives up after 10) and the last for stopping it.
  The waits inside tests (`testkit.waits.wait_until`) give up before the limit, with their
  message; the limit is the backstop for a hang.

`timeout_method = "signal"` (pyproject.toml): SIGALRM on the main thread fails the test where
it hangs, with the other threads' stacks, and the run goes on. (The "thread" method would dump
the stacks and then end the whole run with `os._exit`.) A signal's Python handler runs only
once the main thread is back in the interpreter, so a little before the alarm faulthandler
also writes every thread's stack, a thread stuck in C code included, to stderr: it shows under
the failed test's captured stderr.
"""

from __future__ import annotations

import faulthandler
import sys

import pytest

SLOW_LIMIT_S = 900


def dump_after_s(limit_s: float) -> float:
    """When faulthandler dumps the stacks: shortly before the limit (10 s; a tenth of short ones)."""
    return limit_s - min(10.0, limit_s / 10)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Real-stack tests get the slow tier unless they (or their module or class) set a limit."""
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_LIMIT_S))


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> None:
    """Arm faulthandler's dump of all threads, then let pytest-timeout set its alarm (this
    returns None, so pytest-timeout's own hook runs next)."""
    faulthandler.dump_traceback_later(dump_after_s(settings.timeout), file=sys.__stderr__)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    faulthandler.cancel_dump_traceback_later()
