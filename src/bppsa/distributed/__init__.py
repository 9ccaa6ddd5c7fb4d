"""BPPSA across the ranks of a torch.distributed process group.

:func:`rank_scan` (:mod:`.rank_scan`) is the piece every sequence-split computation needs: each rank holds the
summary of its contiguous chunk of an affine recurrence ``x -> M x + c`` (the chunk's product ``M`` and offset
``c``), and receives the *carry*, the state entering its chunk, computed from the summaries of the ranks before it
(or after it, with ``reverse=True``: back-propagation scans from the last rank).  docs/distributed.md has the
whole API, the strategies and how to launch several processes.  :class:`.groups.GroupRef` is how the layers
refer to their group without keeping it alive past ``destroy_process_group``.
"""
from .groups import GroupRef
from .rank_scan import (
    STRATEGIES,
    RankFailure,
    all_gather_ints,
    all_reduce_sum,
    compose,
    default_strategy,
    local_carries,
    rank_scan,
    recv_from,
    send_to,
)

__all__ = ["STRATEGIES", "GroupRef", "RankFailure", "all_gather_ints", "all_reduce_sum", "compose", "default_strategy",
           "local_carries", "rank_scan", "recv_from", "send_to"]
