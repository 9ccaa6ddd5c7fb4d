"""BPPSA as a layer anyone can train with: ``bppsa.nn.RNN`` and ``bppsa.nn.GRU``, drop-ins for torch.nn.RNN/GRU.

::

    gru = bppsa.nn.GRU(12, 20, batch_first=True)      # or bppsa.nn.GRU.from_torch(torch_gru)
    out, h_n = gru(x, lengths=lengths)                  # padded batch [B, T, 12], lengths [B]
    loss(out, h_n).backward()                           # the backward is the BPPSA scan

Each layer is a custom op (:mod:`.ops`; the math in :mod:`.backward`), so the layers run under
torch.compile(fullgraph=True).  docs/library.md lists the options, the refusals and the cost model.
"""
from .affine import affine_scan
from .modules import GRU, RNN

__all__ = ["GRU", "RNN", "affine_scan"]
