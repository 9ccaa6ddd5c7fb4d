"""A process group referred to without being kept alive.

``torch.distributed.destroy_process_group()`` drops torch's own references to a group; the group itself, and with
a gloo group its threads (the tcp loop and the workers), goes only with the last reference.  A layer that kept its
group, or the autograd graph of an output it returned (the split layers' context), would hold it past the
user's destroy, and its threads would still run while the interpreter shuts down, where a rank can abort
("terminate called without an active exception"; docs/distributed.md).  torch's registry holds every usable group
from ``init_process_group``/``new_group`` to ``destroy_process_group``, so a weak reference loses nothing.
"""
from __future__ import annotations

import weakref

__all__ = ["GroupRef"]


class GroupRef:
    """``ref()`` is the group while something else (torch's registry, the caller) holds it, else an error: a
    destroyed group is never replaced by the default one."""

    def __init__(self, group):
        self._ref = weakref.ref(group)

    def __call__(self):
        group = self._ref()
        if group is None:
            raise RuntimeError("bppsa.distributed: the process group was destroyed (destroy_process_group); a layer "
                               "or a backward that used it needs a live group")
        return group
