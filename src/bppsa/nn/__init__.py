"""BPPSA as a layer anyone can train with: ``bppsa.nn.RNN``, ``bppsa.nn.GRU`` and ``bppsa.nn.LSTM``, drop-ins for
torch.nn's.

::

    gru = bppsa.nn.GRU(12, 20, batch_first=True)      # or bppsa.nn.GRU.from_torch(torch_gru)
    out, h_n = gru(x, lengths=lengths)                  # padded batch [B, T, 12], lengths [B]
    loss(out, h_n).backward()                           # the backward is the BPPSA scan

Each cell is one class (:mod:`.cells`), each layer a custom op (:mod:`.ops`; the backward in :mod:`.backward`), so the
layers run under torch.compile(fullgraph=True).  docs/library.md lists the options, the refusals and the cost model.
"""
from .affine import affine_scan
from .modules import GRU, LSTM, RNN
from .sequential import Recorder, Sequential

__all__ = ["GRU", "LSTM", "RNN", "Recorder", "Sequential", "affine_scan"]
