"""Step-time model accuracy on held-out real engine steps (goal: MAPE <= 10%).

Fits the model on a random 80% of the steps of an `adaspec profile` run, five times with
different splits, and prints the mean absolute percentage error on the other 20%, overall
and per speculation config.

    adaspec profile --url http://127.0.0.1:8000 --out bench/results/profile-cpu
    python -m bench.step_time_accuracy bench/results/profile-cpu/steps.jsonl
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from adaspec.telemetry import read_profile
from controller.step_time import StepTimeModel, step_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", help="steps.jsonl from `adaspec profile`")
    parser.add_argument("--splits", type=int, default=5)
    args = parser.parse_args()

    model_id, steps = read_profile(args.steps)
    x = np.array([step_features(s) for s in steps])
    y = np.array([s.duration_s for s in steps])
    configs = np.array([str(s.config) for s in steps])
    overall, per_config = [], {}
    for seed in range(args.splits):
        test = np.random.default_rng(seed).random(len(y)) < 0.2
        model = StepTimeModel()
        model.x, model.y = x[~test].tolist(), y[~test].tolist()
        model.fit()
        err = np.abs(model.predict(x[test]) - y[test]) / y[test]
        overall.append(float(err.mean()))
        for c in sorted(set(configs[test])):
            per_config.setdefault(c, []).append(float(err[configs[test] == c].mean()))
    print(f"{model_id}: {len(y)} steps, model {model.report.kind}; held-out MAPE "
          f"{100 * statistics.fmean(overall):.1f}% (splits: {', '.join(f'{100 * e:.1f}%' for e in overall)})")
    for c, errs in per_config.items():
        print(f"  {c}: {100 * statistics.fmean(errs):.1f}%")


if __name__ == "__main__":
    main()
