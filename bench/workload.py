"""Synthetic decode-step selections with temporal locality (for PB-LRU vs LRU benchmarks).

Model of one request's top-k per step (stated so results can be judged):

- each request has a long history (``history`` tokens, growing by one per step) in its own
  address range ``[r * stride, r * stride + history)``;
- the newest token is always selected;
- a fraction ``keep`` of the previous step's selection is selected again (consecutive-step
  overlap; real SmolLM2 traces show ~0.63-0.67 at k=64, public DSA notes report 0.8-0.9 at
  k=2048);
- the rest are fresh picks: half from the recent window (last ``window`` tokens), half
  uniform over the whole history (long-range retrieval).
"""

from __future__ import annotations

import torch


class LocalityWorkload:
    """Generates ``int64 [bs * k]`` address sets, one per decode step (distinct per request)."""

    def __init__(self, bs: int = 64, k: int = 2048, history: int = 131072, keep: float = 0.85,
                 window: int = 4096, seed: int = 0):
        self.bs, self.k, self.keep, self.window = bs, k, keep, window
        self.gen = torch.Generator().manual_seed(seed)
        self.stride = history * 2
        self.length = torch.full((bs,), history, dtype=torch.int64)
        self.base = torch.arange(bs, dtype=torch.int64) * self.stride
        self.prev = self._fresh(k)  # [bs, k] positions

    def _fresh(self, n: int) -> torch.Tensor:
        L = self.length.view(-1, 1)
        u = torch.rand(self.bs, n, generator=self.gen)
        half = torch.rand(self.bs, n, generator=self.gen) < 0.5
        recent = L - 1 - (u * min(self.window, int(L.min()))).long()
        anywhere = (u * L).long()
        return torch.where(half, recent, anywhere)

    def step(self) -> torch.Tensor:
        """Next step's selected addresses (``int64``, each request's entries distinct)."""
        self.length += 1
        keep_n = int(self.k * self.keep)
        order = torch.rand(self.bs, self.k, generator=self.gen).argsort(1)[:, :keep_n]
        kept = self.prev.gather(1, order)
        newest = (self.length - 1).view(-1, 1)
        fresh = self._fresh(self.k)  # over-draw, then dedupe by position per request
        cand = torch.cat([newest, kept, fresh], 1)
        # first occurrence wins; keep exactly k distinct positions per request
        srt, idx = cand.sort(dim=1, stable=True)
        dup = torch.zeros_like(srt, dtype=torch.bool)
        dup[:, 1:] = srt[:, 1:] == srt[:, :-1]
        first = torch.ones_like(dup).scatter_(1, idx, ~dup)
        rank = torch.cumsum(first, 1)
        pick = first & (rank <= self.k)
        sel = cand[pick].view(self.bs, self.k)
        self.prev = sel
        return (sel + self.base.view(-1, 1)).reshape(-1)
