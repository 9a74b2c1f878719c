"""scripts/gpu-check.sh (scripts/gpu_check.py), the one command to run on a GPU machine, checked
here without one: its steps name tests and modules that exist, its pytest runs do without
conftest.py's Ray, and on a machine without CUDA it runs the CPU steps and exits 3, saying so."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402  (scripts/ is not a package)


def test_every_step_names_tests_and_modules_that_exist():
    for check in gpu_check.CHECKS:
        for node in check.tests:
            path, _, name = node.partition("::")
            assert (REPO / path).is_file(), node
            if name:
                functions = {n.name for n in ast.walk(ast.parse((REPO / path).read_text()))
                             if isinstance(n, ast.FunctionDef)}
                assert name in functions, node
        if check.argv:
            assert check.argv[0] == "-m" and (REPO / (check.argv[1].replace(".", "/") + ".py")).is_file(), check.argv


def test_the_fixture_plugin_imports_torch_and_pytest_only():
    """gpu_check's pytest runs load testkit.torch_threads without conftest.py: on a GPU machine
    with torch alone, the plugin must not pull in Ray or httpx."""
    code = ("import sys, testkit.torch_threads; bad = {'ray', 'httpx', 'vllm'} & set(sys.modules); "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_list_says_what_runs_here():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--list"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for check in gpu_check.CHECKS:
        assert check.name in out.stdout


@pytest.mark.skipif(gpu_check.cuda_device() is not None, reason="checks the run without a CUDA device")
def test_without_cuda_the_cpu_steps_run_and_it_exits_3(tmp_path, monkeypatch, capsys):
    checks = (gpu_check.Check("policies (CPU)", needs=("pytest",), cuda=False,
                              tests=("tests/test_policy.py::test_equal_configs_compare_and_hash_alike",)),
              gpu_check.Check("a CUDA step", needs=("torch",), cuda=True, argv=("-c", "pass")),
              gpu_check.Check("a step whose module is missing", needs=("no_such_module_here",), cuda=False,
                              argv=("-c", "pass")))
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    assert gpu_check.main(["--out", str(tmp_path)]) == 3
    printed = capsys.readouterr().out
    assert "NO CUDA DEVICE" in printed
    steps = {s["name"]: s for s in json.loads((tmp_path / "summary.json").read_text())["steps"]}
    assert steps["policies (CPU)"]["status"] == "passed" and steps["policies (CPU)"]["detail"].startswith("1 passed")
    assert steps["a CUDA step"] == {**steps["a CUDA step"], "status": "skipped", "detail": "no CUDA device"}
    assert steps["a step whose module is missing"]["detail"] == "needs no_such_module_here"
    assert "| policies (CPU) | PASSED |" in (tmp_path / "summary.md").read_text()
    # --cpu-only: the same CPU steps, and success.
    assert gpu_check.main(["--out", str(tmp_path / "cpu"), "--cpu-only"]) == 0
