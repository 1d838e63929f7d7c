"""Prefill longer than the GPU pool: a prefill's selections served in rounds.

A prefill chunk of ``n`` query tokens selects up to ``n x top_k`` rows of its request's history
(the chunk's own tokens included); their union can be the whole history, far more than the GPU
pool. Instead of requiring the pool to hold the whole request, the queries are served in
consecutive *sub-batches*, each of whose distinct selections fit one fresh round of the address
space (:meth:`ulacache.core.Core.round_fits`: DP, the GPU pool; TP, each rank's own pool and
its buffer). Each sub-batch starts a round (rows the previous sub-batch pinned become
evictable again) and runs the ordinary access, which promotes what it selects from the CPU
tier and spills PB-LRU victims there, so rows that spilled in an earlier chunk come back
through the same path decode uses. Attention of a query reads only its own sub-batch's rows,
so outputs are those of a resident run (``tests/test_prefill.py``).

What a pool must then hold (the capacity rule ``bench/capacity.py`` calls "chunked"): one
chunk's new rows (placed together; ``UlaCache.extend``), one query's selections (``top_k``:
the smallest sub-batch) and one decode step's selections; not the request.
"""

from __future__ import annotations

import torch

from .errors import CapacityExhausted, ShapeError


def round_spans(space, addrs: torch.Tensor) -> list[tuple[int, int]]:
    """Split the query rows of ``addrs`` (``int [n, k]`` selected addresses, ``-1`` padding)
    into consecutive spans ``[(start, end), ...]`` covering ``0 .. n``, each as long as one
    round of ``space`` can serve (the longest prefix whose distinct addresses
    ``space.round_fits``: found by doubling, then bisection, so ``O(log n)`` checks per span).
    One span when the whole table fits. Host-side; every TP rank passes the same ``addrs`` and
    gets the same spans.

    Raises :class:`CapacityExhausted` when a single query's selections do not fit a round (the
    pool is smaller than ``top_k``), :class:`ShapeError` on a non-2-D table.
    """
    if not isinstance(addrs, torch.Tensor) or addrs.dim() != 2:
        raise ShapeError("round_spans: addrs must be an int tensor [n, k]")
    n = addrs.shape[0]
    spans: list[tuple[int, int]] = []
    start = 0
    while start < n:
        if not space.round_fits(addrs[start:start + 1]):
            raise CapacityExhausted(
                f"query {start}'s {addrs.shape[1]} selections do not fit one round of the GPU "
                "pool (TP: or the buffer); the pool must hold at least top-k rows")
        good, bad = start + 1, None  # ends known to fit / not to fit
        while good < n:  # doubling
            end = min(n, start + 2 * (good - start))
            if space.round_fits(addrs[start:end]):
                good = end
            else:
                bad = end
                break
        while bad is not None and bad - good > 1:  # bisection between good and bad
            mid = (good + bad) // 2
            if space.round_fits(addrs[start:mid]):
                good = mid
            else:
                bad = mid
        spans.append((start, good))
        start = good
    return spans
