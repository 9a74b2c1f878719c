"""The `one_torch_thread` fixture, as a pytest plugin that imports torch only: tests/conftest.py
loads it, and scripts/gpu_check.py loads it alone (`-p testkit.torch_threads`, with
--noconftest), because conftest.py imports Ray and httpx for the real-stack tests and a GPU
machine with torch alone may have neither."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_torch_thread():
    """Native-engine tests run torch on one thread: steadier timings, a core left for the rest."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
