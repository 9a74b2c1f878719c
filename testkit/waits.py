"""Waiting for a condition, never for a fixed time: how long an engine step takes depends on
the machine and on what else runs on it.

A wait that runs out fails the test with its message (`pytest.fail`), well before the
per-test time limit (pyproject.toml's `timeout`) would: a deadline here is sized for a loaded
2-core machine and says what did not happen; the time limit is the backstop for a hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(probe: Callable[[], T], what: str, timeout_s: float = 120.0, interval_s: float = 0.25) -> T:
    """Call `probe` until it returns a truthy value and return that value; fail the test with
    `what` (the condition that did not happen) and the last value seen after `timeout_s`.

    `timeout_s` is a deadline for a condition that should hold, sized for a loaded 2-core
    machine, not a guess at speed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {timeout_s:.0f} s (last probe: {value!r})")
        time.sleep(interval_s)
