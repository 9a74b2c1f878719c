"""The one fixture of tests/conftest.py that the tests scripts/gpu_check.py runs use, as a
pytest plugin (`-p gpu_check_fixtures`): those tests run with --noconftest, because
conftest.py imports Ray and httpx for the real-stack tests, and a GPU machine with torch alone
may have neither. Keep it the same as conftest's."""

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
