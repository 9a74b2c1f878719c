"""What of adaspec a GPU machine can check without vLLM (scripts/gpu-check.sh runs this): a
Python with torch (CUDA), pytest and numpy, and no way to install more. Each step runs if what
it needs is importable and says why not otherwise; a summary table ends the run.

Steps (CPU: runs anywhere; CUDA: needs a CUDA device):
  CPU   adaspec's policies and telemetry: tests/test_policy.py
  CPU   the controller's math and logic (acceptance, step-time model, policy search, routing,
        the core, its checkpoint, the fleet simulation): pure Python, no Ray, no vLLM
  CUDA  the native engine on CUDA: tests/test_native_cuda.py and the CUDA case of
        tests/test_native_model.py (float32 greedy output of every speculation shape equals the
        target's own decoding; bfloat16 agrees on most tokens)
  CUDA  CUDA graphs of a verify step at several k (python -m bench.cuda_graph_step): each
        (batch, k) captured, replayed against the eager pass, both timed
  CUDA  verify step time on Llama-3 8B / 1B shapes (python -m bench.tree_step_time)

The tests run with --noconftest: tests/conftest.py imports Ray and httpx for the real-stack
tests; the fixture these tests use comes from testkit/torch_threads.py, which imports torch only.

    python scripts/gpu_check.py                # everything; exit 3 if there is no CUDA device
    python scripts/gpu_check.py --cpu-only     # the CPU steps alone (a machine without a GPU)
    python scripts/gpu_check.py --list         # the steps and whether each can run here

Exit status: 0 no step failed (a step skipped for a missing module is in the table); 1 a step
failed; 3 no CUDA device, so the CUDA steps did not run (the CPU ones ran). Logs and results: bench/results/gpu-check-<UTC time>/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Check:
    """One step: a pytest run over `tests`, or a command (`argv`, run with this Python)."""

    name: str
    needs: tuple[str, ...]           # modules that must be importable
    cuda: bool                       # needs a CUDA device
    tests: tuple[str, ...] = ()      # pytest node ids, relative to the repository
    argv: tuple[str, ...] = ()       # a command instead: python <argv...>, {out} replaced by the step's folder


@dataclass
class Outcome:
    name: str
    status: str                      # passed | failed | skipped
    detail: str
    seconds: float = 0.0
    log: str | None = None


CONTROLLER_TESTS = ("tests/test_acceptance.py", "tests/test_routing.py", "tests/test_controller_math.py",
                    "tests/test_step_cost.py", "tests/test_controller_core.py", "tests/test_controller_checkpoint.py",
                    "tests/test_simulate_routing.py")
CHECKS = (
    Check("policies and telemetry (CPU)", needs=("pytest", "numpy"), cuda=False, tests=("tests/test_policy.py",)),
    Check("controller math and logic (CPU)", needs=("pytest", "numpy", "scipy", "xgboost", "torch"), cuda=False,
          tests=CONTROLLER_TESTS),
    Check("native engine on CUDA", needs=("pytest", "torch", "safetensors"), cuda=True,
          tests=("tests/test_native_cuda.py", "tests/test_native_model.py::test_cuda_bfloat16_matches_cpu")),
    Check("CUDA graphs of a verify step at k = 0, 1, 2, 4, 8", needs=("torch",), cuda=True,
          argv=("-m", "bench.cuda_graph_step", "--model", "llama3-1b", "--batches", "1,8,32,64",
                "--ks", "0,1,2,4,8", "--out", "{out}")),
    Check("verify step time on Llama-3 8B / 1B shapes", needs=("torch",), cuda=True,
          argv=("-m", "bench.tree_step_time", "--models", "llama3-8b,llama3-1b", "--device", "cuda",
                "--dtype", "bfloat16", "--batches", "1,4,16,64", "--nodes", "0,3,7,15,31,63", "--repeats", "10",
                "--out", "{out}")),
)


def missing_modules(names: tuple[str, ...]) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def cuda_device() -> str | None:
    """The first CUDA device's name, or None (no torch, or no device visible to it)."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def environment() -> dict:
    torch_version = None
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch_version = torch.__version__
    optional = ("numpy", "scipy", "xgboost", "pytest", "safetensors", "transformers", "matplotlib", "ray", "vllm")
    return {"python": platform.python_version(), "torch": torch_version, "cuda_device": cuda_device(),
            "modules": {m: importlib.util.find_spec(m) is not None for m in optional}}


def why_not(check: Check, device: str | None, cpu_only: bool) -> str | None:
    """Why `check` cannot run here, or None."""
    if check.cuda and cpu_only:
        return "--cpu-only"
    if check.cuda and device is None:
        return "no CUDA device"
    missing = missing_modules(check.needs)
    return f"needs {', '.join(missing)}" if missing else None


def _pytest_counts(junit: Path) -> dict[str, int]:
    suite = ET.parse(junit).getroot()
    suites = [suite] if suite.tag == "testsuite" else list(suite)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for key in counts:
            counts[key] += int(s.get(key, 0))
    return counts


def run_check(check: Check, out: Path) -> Outcome:
    folder = out / check.name.split(" (")[0].replace(" ", "-").replace(",", "").replace("/", "-").lower()
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "log.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "scripts"),
                                                        os.environ.get("PYTHONPATH", "")])}
    if check.tests:
        junit = folder / "junit.xml"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                "-p", "testkit.torch_threads", f"--junitxml={junit}", *check.tests]
    else:
        argv = [sys.executable, *(a.replace("{out}", str(folder)) for a in check.argv)]
    print(f"[gpu-check] {check.name}: {' '.join(argv[1:])}", flush=True)
    start = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.run(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - start
    tail = log.read_text().splitlines()[-12:]
    print("\n".join("    " + line for line in tail), flush=True)
    if check.tests and (folder / "junit.xml").exists():
        c = _pytest_counts(folder / "junit.xml")
        passed = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
        detail = f"{passed} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped"
    else:
        detail = f"exit status {rc}"
    shown = log.relative_to(REPO) if log.is_relative_to(REPO) else log
    return Outcome(check.name, "passed" if rc == 0 else "failed", detail, seconds, str(shown))


def summary(outcomes: list[Outcome], env: dict) -> str:
    device = env["cuda_device"] or "none"
    lines = [f"gpu-check: Python {env['python']}, torch {env['torch']}, CUDA device: {device}",
             "| step | result | detail | seconds | log |", "|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.name} | {o.status.upper()} | {o.detail} | {o.seconds:.0f} | {o.log or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-only", action="store_true", help="run the CPU steps only (exit 0 if they pass)")
    parser.add_argument("--list", action="store_true", help="print the steps and whether each can run here")
    parser.add_argument("--out", default=None, help="default: bench/results/gpu-check-<UTC time>")
    args = parser.parse_args(argv)
    env = environment()
    device = env["cuda_device"]
    if args.list:
        for check in CHECKS:
            reason = why_not(check, device, args.cpu_only)
            target = " ".join(check.tests) if check.tests else "python " + " ".join(check.argv)
            print(f"{'CUDA' if check.cuda else 'CPU '}  {check.name}: {'runs' if reason is None else 'skipped, ' + reason}"
                  f"\n      {target}")
        return 0
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"gpu-check-{time.strftime('%Y%m%d-%H%M', time.gmtime())}"
    out.mkdir(parents=True, exist_ok=True)
    print(f"[gpu-check] Python {env['python']}, torch {env['torch']}, CUDA device: {device or 'none'}; "
          f"results in {out}", flush=True)
    outcomes = []
    for check in CHECKS:
        reason = why_not(check, device, args.cpu_only)
        outcomes.append(Outcome(check.name, "skipped", reason) if reason else run_check(check, out))
    text = summary(outcomes, env)
    print("\n" + text)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({"environment": env, "steps": [asdict(o) for o in outcomes]},
                                                 indent=2))
    if any(o.status == "failed" for o in outcomes):
        print("[gpu-check] FAILED: see the logs above")
        return 1
    if device is None and not args.cpu_only:
        print("[gpu-check] NO CUDA DEVICE: only the CPU steps ran; run this on a machine whose torch sees a GPU")
        return 3
    skipped = [o.name for o in outcomes if o.status == "skipped"]
    print("[gpu-check] passed" + (f" ({len(skipped)} steps skipped: see the table)" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
