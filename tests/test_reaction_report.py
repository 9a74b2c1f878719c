"""bench/reaction.py's report from a synthetic results.json (no server): the numbers it
states are the ones in the file."""

from __future__ import annotations

import json

from bench import reaction


def _doc() -> dict:
    def cell(speed: float, error: float = 0.05) -> dict:
        return {"tokens_per_s": speed, "step_error": error, "step_error_unscaled": 4 * error, "step_scale": 1.2}

    def static(best: str, speed: float) -> dict:
        return {c: cell(speed if c == best else speed / 2) for c in reaction.CONFIGS}

    results = []
    for r, (fwd_s, rev_after) in enumerate([(0.8, "chain1"), (1.5, "off"), (3.0, "chain1")]):
        results.append({"round": r, "reactions": {
            "forward": {"direction": "forward", "before": "off", "after": "chain4", "seconds": fwd_s},
            "reverse": {"direction": "reverse", "before": "chain4", "after": rev_after, "seconds": 0.5}},
            "static": {"forward": static("chain4", 160.0), "reverse": static("chain1", 100.0)},
            "loaded": {"off": cell(40.0, 0.1), "chain4": cell(90.0, 0.3)}})
    return {"url": "http://x", "rounds": 3, "seconds_per_static": 8.0, "period_s": 1.0,
            "machine": {"cpu": "test cpu", "cores": 2, "date_utc": "2026-12-07 00:00:00"}, "results": results}


def test_summary_states_periods_and_the_choice_against_the_best_static(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps(_doc()))
    s = reaction.summary(_doc())
    assert s["forward"]["periods"] == [0.8, 1.5, 3.0]
    assert s["forward"]["chosen_over_best"] == [1.0, 1.0, 1.0]
    assert s["reverse"]["chosen_over_best"] == [1.0, 0.5, 1.0]  # round 2 chose off at half the best's speed
    text = reaction.write_report(tmp_path).read_text()
    assert "- forward: within 2 periods in 2 of 3 rounds (max 3.00)" in text
    assert "| reverse | 2 | 0.50 | off | chain1 (100.0 tok/s) | 0.500 |" in text
    errors = reaction.step_errors(_doc())
    assert errors["forward, machine loaded"] == [(0.1, 0.4), (0.3, 1.2)] * 3
    assert "| forward, machine loaded | 6 | 20.0% (30.0%) | 80.0% (120.0%) |" in text
    assert (tmp_path / "reaction.png").stat().st_size > 0
