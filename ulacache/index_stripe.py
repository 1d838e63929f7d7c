"""Index-K striped by page across a TP group: ownership, each rank's decode metadata, the exact
merge of the ranks' top-k, and the prefill gather.

A DSA model keeps every token's indexer key (index-K: 128 FP8 values and an fp32 scale, 132 B
per token per layer) on the GPU. Replicated on every TP rank it binds capacity (issue 21);
striped, each rank holds ``1/P`` of it and scores only its own pages, and the global top-k is
the exact merge of the ranks' candidates (:mod:`ulacache.indexer`), so SGLang's scoring
kernels run unchanged over per-rank page tables.

Ownership is SGLang's own (``sglang/srt/mem_cache/page_interleave.py``,
``PageInterleavePlacement``; ``mem_cache/allocator/page_interleave.py``): logical page
``l = loc // page_size`` lives on rank ``l % P`` at local page ``l // P``. It is read off the
page ids, never assumed from a request's page order, so any class choice is correct. The
per-rank tables are ``ceil(W / P)`` pages wide: enough when each request's pages cycle through
the classes, as SGLang's classed allocator hands them out (a chain's ``k``-th page from class
``(b + k) % P``); :meth:`PageStripe.check_balanced` checks it on the host, and in production a
page past the width is dropped, never written out of bounds.

Per rank and batch row, from a request page table ``real`` (``int [rows, W]`` global page ids,
column ``j`` the request's ``j``-th page: SGLang's ``page_table_1[:, ::64] // 64``) and the
rows' token counts (:meth:`PageStripe.view`):

- ``table int32 [rows, ceil(W/P)]``: local page ids of the pages this rank owns, in request
  order (the block table SGLang's paged MQA-logits kernel reads);
- ``lengths int32 [rows]``: the tokens in those pages (the kernel's context lengths: every
  owned page but a request's last is full, so the valid local columns are ``[0, length)``);
- ``positions int64 [rows, ceil(W/P) * page]``: each local column's request position,
  ``page * j + c % page`` for the request's page ``j`` held at local index ``c // page``,
  ``-1`` where no token is.

Top-k (:func:`striped_topk`): local candidates (8 B per row per candidate), one all-gather,
the merge; identical on every rank to the unsharded top-k over replicated keys, ties to the
earlier position (:mod:`ulacache.indexer`'s order). It takes a whole row's logits: a caller
that scores in chunks merges after the last one (no collective inside per-chunk work).

Device paths are fixed-shape with no host sync (capturable); ``check_balanced`` and
:meth:`PageStripe.assemble`'s default width read values on the host (prefill runs eagerly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import ShapeError
from .indexer import local_candidates, merge_candidates

__all__ = ["PageStripe", "StripeView", "striped_topk"]

AllGather = Callable[[torch.Tensor], torch.Tensor]
"""``t -> [P, *t.shape]``, row ``r`` rank ``r``'s ``t`` (:meth:`ulacache.ipc.Peers.all_gather`)."""


class StripeView(NamedTuple):
    """One rank's decode metadata for a batch (see the module doc)."""

    table: torch.Tensor  # int32 [rows, Wl]: local page ids, 0 where none
    lengths: torch.Tensor  # int32 [rows]: tokens in this rank's pages
    pages: torch.Tensor  # int64 [rows, Wl]: the request page index j of each, -1 where none
    positions: torch.Tensor  # int64 [rows, Wl * page]: request position per local column


@dataclass(frozen=True)
class PageStripe:
    """Rank ``rank`` of ``ranks`` under page striping with pages of ``page_size`` tokens."""

    ranks: int
    rank: int
    page_size: int = 64

    def __post_init__(self) -> None:
        for name in ("ranks", "rank", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ShapeError(f"PageStripe {name} must be an int, got {v!r}")
        if self.ranks < 1 or not 0 <= self.rank < self.ranks or self.page_size < 1:
            raise ShapeError(f"PageStripe: rank {self.rank} of {self.ranks} ranks, page "
                             f"{self.page_size}: need 0 <= rank < ranks and page >= 1")

    # -- ownership (SGLang's PageInterleavePlacement) ------------------------------------------
    def owner(self, pages: torch.Tensor) -> torch.Tensor:
        """The rank holding each global page id."""
        return pages % self.ranks

    def local_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Each global page's page id on its owner."""
        return pages // self.ranks

    def local_rows(self, locs: torch.Tensor) -> torch.Tensor:
        """Each token slot's row in its owner's cache (``local_page * page + offset``)."""
        ps = self.page_size
        return (locs // (self.ranks * ps)) * ps + locs % ps

    def width(self, pages: int) -> int:
        """Local table width for request tables ``pages`` wide: ``ceil(pages / P)``."""
        return -(-int(pages) // self.ranks)

    # -- a rank's store (SGLang's paged index-K cache, 1/P of it) --------------------------------
    def stored_pages(self, pages: int) -> int:
        """Pages a rank stores of a cache of ``pages`` global pages (ids ``[0, pages)``): the
        most any rank owns, ``ceil(pages / P)``. The store adds two pages after them: a
        *trash* page (:meth:`write_rows` sends tokens of other ranks' pages there, so writes
        need no filter and no host sync) and a *zero* page (never written; what
        :meth:`read_table` gives for pages this rank does not hold)."""
        return self.width(pages)

    def write_rows(self, locs: torch.Tensor, pages: int) -> torch.Tensor:
        """Token rows in this rank's store (``stored_pages(pages) + 2`` pages) for writes of
        token slots ``locs`` (int, any shape): an owned token's row, every other token's row
        in the trash page (same offset). Same shape, int64; fixed-shape, no host sync."""
        ps = self.page_size
        loc = locs.to(torch.int64)
        trash = self.stored_pages(pages) * ps + loc % ps
        return torch.where(self.owner(loc // ps) == self.rank, self.local_rows(loc), trash)

    def read_table(self, table: torch.Tensor, live: torch.Tensor, pages: int) -> torch.Tensor:
        """This rank's page ids for a request page table ``table`` (int, global ids) where
        ``live`` (bool, same shape) marks entries to read: the local page where this rank owns
        it, the zero page (``stored_pages(pages) + 1``) everywhere else. Reading the table
        through it gives this rank's tokens and zeros for the others', so the ranks' reads
        summed are the replicated read (:meth:`assemble` without a host sync)."""
        pages_ = table.to(torch.int64)
        mine = live & (self.owner(pages_) == self.rank)
        return torch.where(mine, self.local_pages(pages_), self.stored_pages(pages) + 1)

    # -- decode ------------------------------------------------------------------------------
    def view(self, real: torch.Tensor, lengths: torch.Tensor,
             width: int | None = None) -> StripeView:
        """This rank's :class:`StripeView` of request page tables ``real int [rows, W]`` with
        ``lengths int [rows]`` tokens (pages past ``ceil(length / page)`` are padding).
        ``width``: local table width in pages, default ``ceil(W / P)`` (pages that cycle
        through the ranks); ``W`` serves any allocation order, balanced or not, at the
        replicated table's width (the kernel's work still follows the local lengths)."""
        if real.dim() != 2 or real.dtype.is_floating_point:
            raise ShapeError(f"real must be an int page table [rows, W], got {real.dtype} "
                             f"{tuple(real.shape)}")
        if lengths.shape != real.shape[:1] or lengths.dtype.is_floating_point:
            raise ShapeError(f"lengths must be int [{real.shape[0]}], got {lengths.dtype} "
                             f"{tuple(lengths.shape)}")
        rows, W = real.shape
        ps, dev = self.page_size, real.device
        Wl = self.width(W) if width is None else int(width)
        if Wl < 1:
            raise ShapeError(f"view: width must be >= 1 page, got {width!r}")
        pages = real.to(torch.int64)
        length = lengths.to(torch.int64)
        j = torch.arange(W, device=dev)
        owned = (j[None, :] < (length[:, None] + ps - 1) // ps) & (self.owner(pages) == self.rank)
        idx = torch.cumsum(owned, 1) - 1
        dest = torch.where(owned & (idx < Wl), idx, Wl)  # an overflow lands in a dropped column
        table = torch.zeros(rows, Wl + 1, dtype=torch.int32, device=dev).scatter_(
            1, dest, torch.where(owned, self.local_pages(pages), 0).to(torch.int32))[:, :Wl]
        page_of = torch.full((rows, Wl + 1), -1, dtype=torch.int64, device=dev).scatter_(
            1, dest, torch.where(owned, j[None, :].expand(rows, W), -1))[:, :Wl]
        tokens = torch.where(page_of >= 0,
                             (length[:, None] - ps * page_of).clamp(min=0, max=ps), 0)
        c = torch.arange(Wl * ps, device=dev)
        j_of = page_of[:, c // ps]
        positions = torch.where((j_of >= 0) & ((c % ps)[None, :] < tokens[:, c // ps]),
                                ps * j_of + (c % ps)[None, :], -1)
        return StripeView(table.contiguous(), tokens.sum(1).to(torch.int32),
                          page_of.contiguous(), positions)

    def check_balanced(self, real: torch.Tensor, lengths: torch.Tensor) -> None:
        """Host-side: raise :class:`ShapeError` if a row holds more pages of any one rank than
        the local tables are wide (its extra pages would be dropped from the scoring)."""
        pages = real.to(torch.int64)
        ps = self.page_size
        live = torch.arange(real.shape[1], device=real.device)[None, :] < \
            (lengths.to(torch.int64)[:, None] + ps - 1) // ps
        Wl = self.width(real.shape[1])
        for r in range(self.ranks):
            most = int((live & (self.owner(pages) == r)).sum(1).max()) if real.numel() else 0
            if most > Wl:
                raise ShapeError(f"a request holds {most} pages of rank {r}, more than the "
                                 f"{Wl} a local table of {real.shape[1]} pages / {self.ranks} "
                                 "ranks holds: its pages do not cycle through the ranks")

    # -- prefill -----------------------------------------------------------------------------
    def assemble(self, local_cache: torch.Tensor, pages: torch.Tensor, all_gather: AllGather,
                 width: int | None = None) -> torch.Tensor:
        """The rows of global ``pages`` (``int [n]``, e.g. a prefill batch's pages, in order)
        from every rank's ``local_cache`` (``[local pages, ...]``, this rank's), in one
        all-gather of ``[width, ...]`` per rank: what a replicated cache's ``cache[pages]``
        would give. ``width``: the most pages one rank holds among ``pages`` (default: counted
        on the host). Collective."""
        if pages.dim() != 1 or pages.dtype.is_floating_point:
            raise ShapeError(f"pages must be int [n], got {pages.dtype} {tuple(pages.shape)}")
        pages = pages.to(torch.int64)
        n, P = pages.numel(), self.ranks
        owner = self.owner(pages)
        onehot = owner[:, None] == torch.arange(P, device=pages.device)[None, :]
        slot = (torch.cumsum(onehot, 0) - 1).gather(1, owner[:, None]).squeeze(1)
        if width is None:
            width = int(onehot.sum(0).max()) if n else 0
        mine = (owner == self.rank) & (slot < width)
        send = torch.zeros((width + 1, *local_cache.shape[1:]), dtype=local_cache.dtype,
                           device=local_cache.device)
        send.index_copy_(0, torch.where(mine, slot, width).to(local_cache.device),
                         local_cache[torch.where(mine, self.local_pages(pages), 0)
                                     .to(local_cache.device)])
        got = all_gather(send[:width].contiguous())
        keep = slot < width
        out = got[owner, slot.clamp(max=max(width - 1, 0))] if width else \
            torch.zeros((n, *local_cache.shape[1:]), dtype=local_cache.dtype,
                        device=local_cache.device)
        return torch.where(keep.view(-1, *([1] * (out.dim() - 1))).to(out.device), out,
                           torch.zeros_like(out))


def striped_topk(local_logits: torch.Tensor, view: StripeView, lengths: torch.Tensor, k: int,
                 all_gather: AllGather, *, by_score: bool = False) -> torch.Tensor:
    """The exact global top-``k`` from this rank's logits over its own pages: ``local_logits``
    float32/fp16/bf16 ``[rows, >= Wl * page]`` (columns in ``view``'s local order; wider
    outputs, as SGLang's kernels give, are cut), ``lengths`` the rows' global token counts,
    ``all_gather`` the TP group's. Returns int64 ``[rows, k]``: positions ascending, then
    ``-1``; identical on every rank to :func:`ulacache.indexer.topk_exact` over the unsharded
    logits. Collective (one all-gather of ``int64 [rows, k]``); graph-safe. ``by_score``: the
    same positions in score order (:func:`ulacache.indexer.merge_candidates`)."""
    width = view.positions.shape[1]
    if local_logits.dim() != 2 or local_logits.shape[0] != view.positions.shape[0] or \
            local_logits.shape[1] < width:
        raise ShapeError(f"local_logits must be [{view.positions.shape[0]}, >= {width}], got "
                         f"{tuple(local_logits.shape)}")
    cand = local_candidates(local_logits[:, :width], view.positions, lengths, k)
    return merge_candidates(all_gather(cand), k, by_score=by_score)
