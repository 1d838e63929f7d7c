"""The selection-locality generator of the decode sweep (``bench/decode_sweep.py``), calibrated on
a real top-k trace: the share of picks inside the recent window of ``k`` tokens, the chance that
position 0 (the sink) is picked, the step-to-step overlap ``|S_t & S_t-1| / k`` and the
normalised-position histogram of fresh picks older than the window. Scaling from the trace's
``k`` to another keeps the shares as shares of ``k``, the recent window ``window_ratio x k``
tokens wide, and fresh old picks' positions relative to the history length.

:class:`SelectionCache` memoises one generator stream per request (seeded by ``[seed, rid]``):
a request's selections depend on its position only, so every policy, tuning and concurrency
level of one seed reads the same selections, generated once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ulacache.tools.traces import Trace

HIST_BINS = 20


# -- locality generator -------------------------------------------------------------------
@dataclass
class LocalityModel:
    """Calibrated selection locality (shares are of k; the window is ``window_ratio x k``)."""

    recent_share: float  # picks with distance < window
    sink_prob: float  # P(position 0 picked) per step
    overlap: float  # target mean |S_t & S_t-1| / k
    keep_prob: float  # generator knob: P(a previous pick is kept), calibrated to ``overlap``
    old_hist: list[float] = field(default_factory=list)  # fresh old picks: pos / (p - W + 1)
    window_ratio: float = 1.0

    def to_dict(self) -> dict:
        return asdict(self)


def trace_targets(sel: np.ndarray, pos: np.ndarray, k: int, window_ratio: float = 1.0) -> dict:
    """Locality figures of selections ``sel`` int ``[layers, steps, k]`` (-1 padded) at query
    positions ``pos``: recent share, sink probability, overlap, fresh-old-pick histogram."""
    w = max(1, round(window_ratio * k))
    valid = sel >= 0
    dist = pos[None, :, None] - sel
    recent = float((valid & (dist < w)).sum() / valid.sum())
    sink = float((sel == 0).any(-1).mean())
    overlaps, fresh = [], []
    for layer in range(sel.shape[0]):
        prev = None
        for s in range(sel.shape[1]):
            row = sel[layer, s]
            row = row[row >= 0]
            p = int(pos[s])
            if prev is not None:
                overlaps.append(np.intersect1d(row, prev, assume_unique=True).size / k)
                old = row[(p - row >= w) & (row > 0)]
                old = old[~np.isin(old, prev)]
                if old.size and p - w + 1 > 0:
                    fresh.append(old / (p - w + 1))
            prev = row
    fresh_all = np.concatenate(fresh) if fresh else np.zeros(1)
    hist, _ = np.histogram(np.clip(fresh_all, 0, 1 - 1e-9), bins=HIST_BINS, range=(0, 1))
    return {"recent_share": recent, "sink_prob": sink, "overlap": float(np.mean(overlaps)),
            "old_hist": (hist / max(1, hist.sum())).tolist()}


class SelectionGen:
    """One request's selections: ``step(p)`` -> sorted unique positions in ``[0, p]``, ``k`` of
    them (all ``p + 1`` while ``p < k``). Previous picks kept with ``keep_prob`` (the sink
    excluded), the recent window topped up to its share (always the newest token), the sink
    (position 0) with ``sink_prob``, then fresh old picks in ``[1, p - W]`` from the histogram
    of normalised positions."""

    def __init__(self, model: LocalityModel, k: int, rng: np.random.Generator):
        self.m, self.k, self.rng = model, k, rng
        self.w = max(1, round(model.window_ratio * k))
        self.n_recent = min(k, max(1, round(model.recent_share * k)))
        self.cdf = np.cumsum(np.asarray(model.old_hist, dtype=np.float64))
        if self.cdf.size == 0 or self.cdf[-1] <= 0:
            self.cdf = np.linspace(1 / HIST_BINS, 1, HIST_BINS)
        self.cdf /= self.cdf[-1]
        self.prev = np.empty(0, dtype=np.int64)

    def _fill(self, chosen: np.ndarray, lo: int, hi: int, n: int, hist: bool) -> np.ndarray:
        """``n`` new positions in ``[lo, hi)`` not in ``chosen`` (uniform, or by the histogram)."""
        if n <= 0 or hi <= lo:
            return np.empty(0, dtype=np.int64)
        span = hi - lo
        free = span - int(((chosen >= lo) & (chosen < hi)).sum())
        n = min(n, free)
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        if free <= 2 * n:  # dense: exact draw without replacement
            cand = np.setdiff1d(np.arange(lo, hi), chosen, assume_unique=False)
            return self.rng.choice(cand, n, replace=False)
        out = np.empty(0, dtype=np.int64)
        for _ in range(8):
            m = 2 * (n - out.size) + 8
            if hist:
                b = np.searchsorted(self.cdf, self.rng.random(m), side="right")
                u = (np.minimum(b, HIST_BINS - 1) + self.rng.random(m)) / HIST_BINS
                cand = lo + np.minimum((u * span).astype(np.int64), span - 1)
            else:
                cand = self.rng.integers(lo, hi, m)
            cand = np.unique(cand)
            cand = cand[~np.isin(cand, chosen) & ~np.isin(cand, out)]
            self.rng.shuffle(cand)
            out = np.concatenate([out, cand[: n - out.size]])
            if out.size >= n:
                break
        if out.size < n:  # fall back to uniform fill
            rest = np.setdiff1d(np.arange(lo, hi), np.concatenate([chosen, out]))
            out = np.concatenate([out, self.rng.choice(rest, n - out.size, replace=False)])
        return out

    def step(self, p: int) -> np.ndarray:
        k = self.k
        if p + 1 <= k:
            self.prev = np.arange(p + 1, dtype=np.int64)
            return self.prev
        w_lo = max(0, p - self.w + 1)  # recent window [w_lo, p]
        prev = self.prev[self.prev > 0]  # the sink (position 0) has its own probability
        kept = prev[self.rng.random(prev.size) < self.m.keep_prob]
        chosen = np.union1d(kept, [p])
        n_rec_have = int((chosen >= w_lo).sum())
        chosen = np.union1d(chosen, self._fill(chosen, w_lo, p + 1,
                                               self.n_recent - n_rec_have, hist=False))
        if w_lo > 0 and self.rng.random() < self.m.sink_prob:
            chosen = np.union1d(chosen, [0])
        n_old = k - chosen.size
        if n_old > 0:
            chosen = np.union1d(chosen, self._fill(chosen, 1, w_lo, n_old, hist=True))
        if chosen.size < k:  # short old region: top up from the window
            chosen = np.union1d(chosen, self._fill(chosen, w_lo, p + 1, k - chosen.size, False))
        if chosen.size > k:  # too many kept: drop random entries (not the newest, not the sink)
            drop = self.rng.choice(np.flatnonzero((chosen != p) & (chosen != 0)),
                                   chosen.size - k, replace=False)
            chosen = np.delete(chosen, drop)
        self.prev = chosen.astype(np.int64)
        return self.prev


def generate(model: LocalityModel, k: int, positions: np.ndarray, seed: int) -> np.ndarray:
    """Selections ``[steps, k]`` (-1 padded) of one generator over ``positions``."""
    gen = SelectionGen(model, k, np.random.default_rng(seed))
    out = np.full((positions.size, k), -1, dtype=np.int64)
    for i, p in enumerate(positions):
        s = gen.step(int(p))
        out[i, : s.size] = s
    return out


def calibrate(trace: Trace, window_ratio: float = 1.0, layers: int = 8, iters: int = 4,
              seed: int = 0) -> LocalityModel:
    """Targets from ``layers`` evenly spaced layers of the real ``trace``; ``keep_prob`` is
    fitted so that the generator at the trace's own scale hits the overlap target."""
    idx = np.unique(np.linspace(0, trace.layers - 1, min(layers, trace.layers)).astype(int))
    sel, pos = trace.selections[idx].astype(np.int64), trace.positions.astype(np.int64)
    t = trace_targets(sel, pos, trace.k, window_ratio)
    m = LocalityModel(t["recent_share"], t["sink_prob"], t["overlap"], t["overlap"],
                      t["old_hist"], window_ratio)
    for i in range(iters):
        g = generate(m, trace.k, pos, seed + i)
        got = trace_targets(g[None], pos, trace.k, window_ratio)["overlap"]
        m.keep_prob = float(np.clip(m.keep_prob + (m.overlap - got), 0.0, 1.0))
    return m


class SelectionCache:
    """One seed's selections of every request, generated once and shared by every run of that
    seed: ``get(rid, pos)`` -> the sorted positions request ``rid`` selects when its newest
    token is at ``pos`` (``SelectionGen`` stepped through every position since the request's
    first decode step, as a run does). Memory: ``int32`` arrays, about ``4 k`` bytes a step."""

    def __init__(self, model: LocalityModel, k: int, seed: int):
        self.model, self.k, self.seed = model, k, seed
        self._gens: dict[int, SelectionGen] = {}
        self._start: dict[int, int] = {}
        self._sels: dict[int, list[np.ndarray]] = {}

    def get(self, rid: int, pos: int) -> np.ndarray:
        if rid not in self._gens:
            self._gens[rid] = SelectionGen(self.model, self.k,
                                           np.random.default_rng([self.seed, rid]))
            self._start[rid], self._sels[rid] = pos, []
        i = pos - self._start[rid]
        sels = self._sels[rid]
        if i < 0:
            raise ValueError(f"request {rid}: position {pos} precedes its first step "
                             f"{self._start[rid]}")
        while len(sels) <= i:  # a run only steps forward, one position at a time
            sels.append(self._gens[rid].step(self._start[rid] + len(sels)).astype(np.int32))
        return sels[i].astype(np.int64)
