"""How long the controller takes per replica decision (goal: under 10 ms).

Times `ControllerCore.report` (observe telemetry + search the policy) for a replica whose
deployment has a fitted step-time model, over many periods; prints median and p99.

    PYTHONPATH=. python experiments/decision_time.py [--profile steps.jsonl] [--max-batch 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from adaspec.policy import SpecPolicy
from controller.config import ControllerConfig
from controller.core import ControllerCore
from controller.simulate import SimReplica, SimulatedEngine, engine_from_profile
from controller.step_time import StepTimeModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", help="steps from `adaspec profile` (default: a prior roofline)")
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--max-k", type=int, default=4)
    parser.add_argument("--periods", type=int, default=300)
    args = parser.parse_args()

    engine = (engine_from_profile(args.profile, args.max_batch, args.max_k) if args.profile else
              SimulatedEngine.from_models(StepTimeModel(), [0.6] * args.max_k, args.max_batch, args.max_k))
    core = ControllerCore(ControllerConfig(enabled=True))
    replica = SimReplica("r0", engine, SpecPolicy.parse("chain2"), random.Random(0), 128, 200)
    rng, timings, decide_only = random.Random(1), [], []
    for period in range(args.periods):
        arrivals = sorted(period + rng.random() for _ in range(3))
        tel = replica.run_until(period + 1.0, arrivals).model_copy(update={"info": engine.info})
        start = time.perf_counter()
        policy = core.report(tel, now=period + 1.0).policy
        timings.append(time.perf_counter() - start)
        decide_only.append(core.replicas["r0"].decision.elapsed_s)
        if policy is not None:
            replica.set_policy(policy)
        if period % 50 == 0:
            core.refit()
    ms = sorted(1000 * t for t in timings[20:])
    search = sorted(1000 * t for t in decide_only[20:])
    print(f"per replica decision (observe + search), max batch {args.max_batch}, "
          f"{len(engine.configs)} configs: median {statistics.median(ms):.2f} ms, "
          f"p99 {ms[int(0.99 * (len(ms) - 1))]:.2f} ms; policy search alone: median "
          f"{statistics.median(search):.2f} ms (goal < 10 ms)")


if __name__ == "__main__":
    main()
