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


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own hook, which names the groups its way
def pytest_collection_modifyitems(config, items):
    # Files holding `slow` tests first, the most first: with `-n auto` the longest work (the xdist_group of
    # tests/test_workflow.py, the other slow tests) then starts at once instead of last, so the workers finish
    # together (--no-loadscope-reorder keeps this order).  Each file keeps its own order.
    slow = collections.Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])
    _name_xdist_groups(config, items)

    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _name_xdist_groups(config, items):
    """`--dist loadgroup` sends the tests of one xdist_group to one worker by the suffix ``@<group>`` of their node
    ids.  pytest-xdist 3.8 writes it to ``item._nodeid``, which pytest 9.2's structured node ids no longer read
    (pytest-xdist#1386, open): the same suffix on the id itself, where xdist did not get it there."""
    if not getattr(config.option, "loadgroup", False):  # set on the workers of --dist loadgroup
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # a pytest before 9.2: xdist's own suffix works
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")
