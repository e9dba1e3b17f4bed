"""Shared pytest setup: run from the repository root, skip hardware-bound tests cleanly."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    import torch

    # On small CPU machines one intra-op thread per process is faster than oversubscribed cores, and the
    # multi-process tests start several ranks side by side.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    has_sglang = importlib.util.find_spec("sglang") is not None
    for item in items:  # by marker: keywords also hold the names of the folders above the test
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none is available"))
        if item.get_closest_marker("sglang") and not has_sglang:
            item.add_marker(pytest.mark.skip(reason="needs the sglang package (requirements-gpu.txt); not installed"))
