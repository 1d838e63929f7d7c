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

from .errors import AddressError, CapacityExhausted, ShapeError


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


class PrefillStage:
    """A one-layer staging buffer for a prefill's selected rows: the other way to serve a
    prefill longer than the GPU pool, and the one the SGLang seam uses (modes DP and DCP).

    Each layer of a prefill gathers the distinct rows its selection table names (every query's
    top-k, any number of queries) into ``storage``, from whichever tier holds each row, and the
    table is rewritten to staging rows; the attention kernel then reads ``storage`` instead of
    the pool. Nothing of the address space changes: no promotion, no eviction, so a prefill
    never pushes a running request's rows out of the GPU pool, and it moves each selected
    CPU-resident row once per layer (host to device), where rounds (:func:`round_spans`) may
    promote a row again after a later span evicted it. The cost is memory, ``capacity`` rows
    of one layer (a longest request: 203K x 656 B = 133 MB for GLM-5 FP8); the capacity rule
    becomes "the GPU pool holds a chunk's new rows and a decode step's selections, the stage one
    prefill batch's tokens". Over a DCP rank's stripe (:class:`ulacache.stripe.StripeAddressSpace`)
    a stage holds only the rows that rank attends (its own tokens: ``1 / P`` of a batch, so
    ~17 MB per GPU for GLM-5's longest request on 8 ranks); peers' selections come back ``-1``,
    as from the pool, and validate's verdicts are agreed across the ranks.

    ``storage``: ``uint8 [1, row_base + capacity + 1, row_bytes]`` (last row scratch; rows
    below ``row_base`` are the engine's, e.g. SGLang's sink page) on the space's device, or
    ``None`` to allocate it. ``staged_rows`` / ``staged_from_cpu`` count rows gathered (every
    layer; kept on the device).
    """

    def __init__(self, space, capacity: int, storage: torch.Tensor | None = None,
                 row_base: int = 0):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ShapeError(f"PrefillStage: capacity must be a positive row count, got "
                             f"{capacity!r}")
        rb = space.config.row_layout.row_bytes
        want = row_base + capacity + 1
        if storage is None:
            storage = torch.zeros((1, want, rb), dtype=torch.uint8, device=space.device)
        if storage.dtype != torch.uint8 or storage.dim() != 3 or storage.shape[0] != 1 or \
                storage.shape[1] < want or storage.shape[2] != rb:
            raise ShapeError(f"PrefillStage: storage must be uint8 [1, >= {want}, {rb}], got "
                             f"{storage.dtype} {tuple(storage.shape)}")
        self.space, self.capacity, self.row_base = space, capacity, row_base
        self.storage = storage
        # rows gathered and of which from the CPU tier, every layer: on the device, so staging
        # reads nothing back (staged_rows / staged_from_cpu read it)
        self._staged = torch.zeros(2, dtype=torch.int64, device=storage.device)

    def fits(self, seq_lens: list[int]) -> bool:
        """Whether a prefill batch of requests reaching these lengths can be staged whatever
        it selects: the rows it may stage (:meth:`~ulacache.space.AddressSpace.stage_rows`:
        every token; DCP, a rank's own share) fit the stage. Host-side, from lengths alone."""
        return self.space.stage_rows(seq_lens) <= self.capacity

    @property
    def staged_rows(self) -> int:
        """Rows gathered so far, every layer (a host read)."""
        return int(self._staged[0])

    @property
    def staged_from_cpu(self) -> int:
        """Of which from the CPU tier (a host read)."""
        return int(self._staged[1])

    def stage(self, layer: int, table: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Gather ``layer``'s rows of the distinct addresses in ``table`` (any shape; entries
        below ``first``, ``-1`` included, are padding) into the stage; ``int64`` (table's
        shape) rows of ``storage`` (``row_base + i`` for the ``i``-th distinct address in
        ascending order), ``-1`` at padding.

        With the space's validate on: :class:`CapacityExhausted` before anything moves when
        the distinct addresses outnumber the stage, :class:`AddressError` for an address out
        of range or not live (host reads). Off (production), nothing is read back to the host:
        such entries, and distinct addresses past the stage's capacity, come back ``-1``
        (attention skips them), never another token's row; the engine's admission keeps a
        batch within the stage (``PrefillStage.fits``).

        Temporaries stay ``O(capacity + piece)`` whatever the table's size (a prefill chunk of
        8K queries at top-k 2048 is 2^24 entries): the distinct addresses come from the space
        (:meth:`~ulacache.space.AddressSpace.distinct`: its claim table; a TP space merges its
        ranks' own lists), ascending, and the table is translated in pieces of the space's
        ``call_capacity`` entries by a binary search of them (no table over the addresses)."""
        space = self.space
        n = space.n_logical
        piece = space.config.call_capacity
        found, n_distinct, bad = space.distinct(table, self.capacity, first)
        if space.validate and found.device.type != "meta":  # meta: a rehearsal, shapes only
            def check():
                if int(bad):
                    raise AddressError(f"stage: {int(bad)} table entries out of range [0, {n})")
                if int(n_distinct) > self.capacity:
                    raise CapacityExhausted(f"a prefill layer selects {int(n_distinct)} "
                                            f"distinct rows; the prefill stage holds "
                                            f"{self.capacity}")
            # DCP: each rank counts only the rows it attends, so the ranks agree on one verdict
            space.verdict(check)
        dst = self.row_base + torch.arange(self.capacity, device=found.device)
        from_cpu, gathered = space.gather(layer, found, self.storage,
                                          torch.where(found >= 0, dst, -1))
        # ascending with n in place of the -1 padding: searchable
        keys = torch.where(found >= 0, found, n)
        rows_of = torch.where(gathered, dst, -1)  # the i-th distinct address's stage row
        out = torch.empty(table.shape, dtype=torch.int64, device=found.device)
        for src, rows in zip(table.reshape(-1).split(piece), out.view(-1).split(piece)):
            src = src.to(found.device, torch.int64)
            keep = (src >= first) & (src < n)
            at = torch.searchsorted(keys, torch.where(keep, src, n)).clamp_(max=self.capacity - 1)
            hit = keep & (keys[at] == src)
            rows.copy_(torch.where(hit, rows_of[at], -1))
        self._staged += torch.stack((gathered.sum(), from_cpu)).to(self._staged.device)
        return out
