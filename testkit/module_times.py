"""Where a run's time goes, by test module: setup, call and teardown of every test summed per
module and printed at the end, slowest first. CI's budget (issue 47: under 40 minutes) is
spent module by module, and `--durations` names single phases only. A pytest plugin:
tests/conftest.py loads it."""

from __future__ import annotations

from collections import defaultdict

import pytest

SHOWN = 20  # modules listed; the rest are summed in one line

_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    ranked = sorted(_seconds.items(), key=lambda kv: kv[1], reverse=True)
    terminalreporter.write_sep("=", f"time by test module (setup + call + teardown), {sum(_seconds.values()):.0f} s in all")
    for module, seconds in ranked[:SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
    rest = ranked[SHOWN:]
    if rest:
        terminalreporter.write_line(f"{sum(s for _, s in rest):8.1f} s  the other {len(rest)} modules")
