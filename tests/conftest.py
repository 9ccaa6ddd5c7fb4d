import collections
import os

import pytest

# keep CPU tests deterministic and cheap on small CI machines: two threads, the CPU fast path's plans by rule
# (measured plans are tested on their own, tests/test_cpu_plan.py)
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("BPPSA_PLAN", "estimate")

import bppsa  # noqa: E402,F401 - before anything imports torch: its OpenMP settings (bppsa.process)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def repo_root():
    return ROOT


def pytest_collection_modifyitems(config, items):
    # Files holding `slow` tests first, the most first: with `-n auto` (whole files per worker, in this
    # order: --no-loadscope-reorder) the longest work then starts at once instead of last, so the workers
    # finish together.  Each file keeps its own order.
    slow = collections.Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])

    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
