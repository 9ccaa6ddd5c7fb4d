"""Latent Bounded Interfaces (LBI; Lee & Jyothi 2026, arXiv 2605.09204): a small language model whose regions
exchange only a rank-``r`` interface, and its dense twin.

The model (as the authors' public code builds it, ``models/native_region_interface.py``; written afresh here):

* ``E = tok(x) + pos``: the token embeddings, ``[B, T, d]``, read by *every* region;
* ``m_0 = W_0 · mean_t(E)``: the interface, one vector of ``r`` per sequence;
* region ``k`` (two causal Transformer blocks) reads ``E + P_k m_k`` (the same vector added at every position)
  and gives ``y_k``;
* after region ``k < K - 1``: ``m_{k+1} = LayerNorm(m_k + tanh(α_k) · H_k(mean_t(y_k)))``;
* the last region's token outputs feed the LM head: ``logits = W_out · LN_f(y_{K-1})``.

The authors' code also updates the interface after the last region (``m_K``), which nothing reads; it is left out
here, so every parameter has a gradient.

Mean-pooling over the whole sequence means that position ``t`` of region ``k >= 0`` sees tokens after ``t``
through ``m_k``: the model is not causal as a language model (:func:`prefix_cross_entropy` measures what it
scores when each position sees only its past).  Noted in ``docs/lbi.md``; the model is built as the paper's.

:class:`DenseLM` is the baseline: the same ``2K`` blocks, each region reading the previous region's token outputs
(dense hand-offs), no interface.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "DenseLM", "LBILM", "Region", "lm_loss", "prefix_cross_entropy"]


class Block(nn.Module):
    """A pre-LayerNorm causal Transformer block: ``x + attn(LN(x))``, then ``x + MLP(LN(x))``."""

    def __init__(self, d: int, heads: int, mlp: int = 4):
        super().__init__()
        if d % heads:
            raise ValueError(f"d={d} is not a multiple of heads={heads}")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, mlp * d), nn.Linear(mlp * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(B, T, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Region(nn.Module):
    """Region ``k``: ``y = blocks(E + P m)``; unless it is the last, ``m' = LN(m + tanh(α) · H(mean_t y))``."""

    def __init__(self, d: int, heads: int, r: int, blocks: int = 2, last: bool = False, alpha: float = 0.5):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.read = nn.Linear(r, d)  # P_k
        self.last = last
        if not last:
            self.head = nn.Linear(d, r)  # H_k
            self.alpha = nn.Parameter(torch.tensor(float(alpha)))
            self.norm = nn.LayerNorm(r)

    def forward(self, E: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = E + self.read(m).unsqueeze(1)
        for block in self.blocks:
            y = block(y)
        if self.last:
            return y, None
        return y, self.norm(m + torch.tanh(self.alpha) * self.head(y.mean(1)))

    def interface(self, E: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """``m_{k+1}`` alone (the map whose Jacobian the scan chains)."""
        return self.forward(E, m)[1]


class _Embed(nn.Module):
    def __init__(self, vocab: int, d: int, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(max_len, d))
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.pos.shape[0]:
            raise ValueError(f"sequence length {x.shape[1]} exceeds max_len={self.pos.shape[0]}")
        return self.tok(x) + self.pos[: x.shape[1]]


class _Head(nn.Module):
    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(y))


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) over every position of every sequence."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _check_sizes(vocab, d, heads, regions, max_len, r=None):
    for name, v in (("vocab", vocab), ("d", d), ("heads", heads), ("regions", regions), ("max_len", max_len)) + (
            (("r", r),) if r is not None else ()):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


class LBILM(nn.Module):
    """The LBI language model: ``regions`` regions of two blocks, a rank-``r`` interface between them."""

    def __init__(self, vocab: int, d: int, heads: int, regions: int, r: int, max_len: int):
        super().__init__()
        _check_sizes(vocab, d, heads, regions, max_len, r)
        self.r, self.K = r, regions
        self.embed = _Embed(vocab, d, max_len)
        self.m0 = nn.Linear(d, r)  # W_0
        self.regions = nn.ModuleList(Region(d, heads, r, last=k == regions - 1) for k in range(regions))
        self.head = _Head(d, vocab)

    def interfaces(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """``(E, [m_0, ..., m_{K-1}], y_{K-1})`` through the whole graph (for autograd and for tests)."""
        E = self.embed(x)
        m = self.m0(E.mean(1))
        ms = [m]
        for region in self.regions:
            y, m = region(E, m)
            if m is not None:
                ms.append(m)
        return E, ms, y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.interfaces(x)[2])


class DenseLM(nn.Module):
    """The dense baseline: the same ``2 · regions`` blocks, each region reading the previous one's token outputs."""

    def __init__(self, vocab: int, d: int, heads: int, regions: int, max_len: int):
        super().__init__()
        _check_sizes(vocab, d, heads, regions, max_len)
        self.K = regions
        self.embed = _Embed(vocab, d, max_len)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(2 * regions))
        self.head = _Head(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.embed(x)
        for block in self.blocks:
            y = block(y)
        return self.head(y)


@torch.no_grad()
def prefix_cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean cross-entropy where position ``t`` is scored by a forward over ``x[:, :t+1]`` alone: what the model
    scores when it cannot see past ``t`` (as at generation time).  For a causal model (:class:`DenseLM`) this is its
    ordinary loss; for :class:`LBILM` it differs, since the pooled interface reads the whole window."""
    T = x.shape[1]
    total = 0.0
    for t in range(T):
        logits = model(x[:, : t + 1])[:, t]
        total += float(F.cross_entropy(logits, y[:, t], reduction="sum"))
    return total / y.numel()
