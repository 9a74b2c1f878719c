"""Every test's time limit (testkit/time_limits.py, pyproject.toml's `timeout`): a test that
hangs fails, with every thread's stack, and the run goes on with the next test."""

from __future__ import annotations

import tomllib

from testkit.serve_process import REPO
from testkit.time_limits import SLOW_LIMIT_S, dump_after_s

INNER_TESTS = """
import threading
import time

import pytest


def test_hangs():
    done = threading.Event()
    threading.Thread(target=done.wait, name="helper-thread", daemon=True).start()
    time.sleep(30)


def test_after_the_hang():
    pass


@pytest.mark.slow
def test_slow_tier(request):
    assert request.node.get_closest_marker("timeout").args == (SLOW_LIMIT_S,)


@pytest.mark.slow
@pytest.mark.timeout(5)
def test_own_limit_wins(request):
    assert request.node.get_closest_marker("timeout").args == (5,)
"""


def test_a_hanging_test_fails_with_every_threads_stack_and_the_run_goes_on(pytester, monkeypatch):
    """A run in a process of its own under the project's timeout method, with a 1-s limit."""
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["timeout_method"] == "signal"  # "thread" would end the whole run at the hang
    pytester.makeini(f"[pytest]\ntimeout = 1\ntimeout_method = {ini['timeout_method']}\n"
                     "markers =\n    slow: a real-stack test\n")
    pytester.makeconftest('pytest_plugins = ["testkit.time_limits"]\n')
    pytester.makepyfile(test_inner=f"SLOW_LIMIT_S = {SLOW_LIMIT_S}\n" + INNER_TESTS)
    monkeypatch.setenv("PYTHONPATH", str(REPO))

    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")

    result.assert_outcomes(failed=1, passed=3)
    out = result.stdout.str()
    assert "Failed: Timeout (>1.0s) from pytest-timeout." in out, out
    assert "Stack of helper-thread" in out, out  # pytest-timeout: the other threads' stacks
    assert "Thread 0x" in out and "most recent call first" in out, out  # faulthandler, just before
    assert "in test_hangs" in out, out


def test_the_stacks_are_written_shortly_before_the_limit():
    assert dump_after_s(900) == 890
    assert dump_after_s(1) == 0.9
