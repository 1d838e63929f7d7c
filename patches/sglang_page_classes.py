"""SGLang's paged allocator with a request's ``k``-th page always drawn from class ``k mod P``
(issue 21, item 1): the logical allocator of modes ``"tp"`` and ``"dcp"`` with striped
index-K (``stripe_index_k``).

Index-K striped by page stores logical page ``l`` on rank ``l mod P``
(:class:`ulacache.index_stripe.PageStripe`, SGLang's page interleave). Any allocation order is
correct, but a plain paged allocator hands pages out in free-list order, so a request's pages
can bunch on one rank: the ranks' scoring work is unbalanced and each rank's decode table
and logits must be as wide as the replicated table (``W`` pages) to be safe. Here class ``r``
(the pages ``l`` with ``l mod P == r``: rank ``r``'s) has its own free list and the page at
request position ``k`` (tokens ``64 k .. 64 k + 63``) always comes from class ``k mod P``, so

* each rank stores exactly the pages ``k = r, r + P, ...`` of every request: its local table
  is ``real[:, r::P] // P`` and ``ceil(W / P)`` pages wide (the issue's formula), and the
  logits each rank scores and ranks for its top-k candidates shrink ``P``-fold;
* the class of every draw is a function of positions the scheduler already holds on the host
  (``prefix_lens_cpu``, ``seq_lens_cpu``), so allocation needs no host sync; a fixed rotation
  (base 0 for every request, where SGLang's ``PageInterleavePoolAllocator`` keeps a per-chain
  base on radix-tree nodes) is what makes that possible without that plumbing, and a shared
  prefix keeps its classes since positions are shared with it;
* a freed segment (``free_segment``: a request's pages from a page-aligned position) returns
  each page to its class by position, again without a host sync.

The cost of the fixed rotation: class 0 serves every request's first page, so classes drain
unevenly, by at most one page per live request and class. ``available_size`` therefore
reports ``P x page x`` the emptiest class's free pages (what every class can still serve),
and :meth:`request_slot_reserve` asks SGLang's admission (``schedule_policy.py:850-928``) for
``P`` pages per request, the most a request's class rounding can take beyond that share
(SGLang's own classed allocator asks the same, ``allocator/page_interleave.py``). ulacache
launches without the radix cache, so the skew is bounded by the running requests' pages (at
most 64 pages a class at ``--max-running-requests 64``: 0.2% of a GLM-5 8xH200 class).

Refused: a bare ``alloc`` (no position to class it by; ulacache's seams never call it).
"""

from __future__ import annotations

import torch
from sglang.kernels.ops.memory.allocator import alloc_decode_kernel, alloc_extend_kernel
from sglang.srt.mem_cache.allocator.paged import (
    PagedTokenToKVPoolAllocator,
    alloc_decode_naive,
    alloc_extend_naive,
)
from sglang.srt.utils import next_power_of_2

from ulacache.errors import ConfigError


class PositionClassedPageAllocator(PagedTokenToKVPoolAllocator):
    """Paged logical allocator over ``size`` tokens whose free pages are kept per class
    ``page mod classes``; the page at request position ``k`` is drawn from class
    ``k mod classes`` (module docstring). SGLang's interface: ``alloc_extend``,
    ``alloc_decode``, ``free``, ``free_segment``, free groups, ``available_size``,
    ``get_all_free_pages``, ``clear``.

    State: ``class_free[r]`` ``int64 [n_r]`` free page ids ``== r (mod classes)`` on the
    device, and with ``need_sort`` ``class_staged[r]`` freed pages waiting (merged and sorted
    when the class runs short, as SGLang's own staging). Page 0 is SGLang's padding page and is
    never handed out.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, device,
                 kvcache, need_sort: bool, classes: int):
        if isinstance(classes, bool) or not isinstance(classes, int) or classes < 2:
            raise ConfigError(f"a page-classed allocator needs at least 2 classes, got "
                              f"{classes!r}")
        self.classes = classes  # before the base constructor: it calls clear()
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    # -- state ------------------------------------------------------------------------------
    def clear(self) -> None:
        P = self.classes
        pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        # class r holds pages r, r + P, ... (page 0, the padding page, excluded)
        self.class_free: list[torch.Tensor] = [pages[(r - 1) % P::P].clone() for r in range(P)]
        self.class_staged: list[list[torch.Tensor]] = [[] for _ in range(P)]
        self.class_staged_n = [0] * P
        self.free_group = None
        self.free_page_ids_group = []
        # the base's flat lists stay empty: every path here goes through the classes
        self.free_pages = None
        self.release_pages = None
        self.staged_pages, self.num_staged_pages = [], 0

    def class_free_counts(self) -> list[int]:
        """Free pages per class (staged included)."""
        return [len(f) + n for f, n in zip(self.class_free, self.class_staged_n)]

    def available_size(self) -> int:
        """Tokens every class can still serve: ``classes x page x`` the emptiest class's free
        pages (a request of ``K`` pages draws at most ``ceil(K / classes)`` from each)."""
        return self.classes * self.page_size * min(self.class_free_counts())

    def aggregate_free_size(self) -> int:
        """All free tokens over the classes (not an admission figure: see
        :meth:`available_size`)."""
        return self.page_size * sum(self.class_free_counts())

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        """Tokens SGLang's admission reserves per request beyond its own: ``classes`` pages,
        what the class rounding of one request can take beyond its share of
        :meth:`available_size`."""
        return self.classes * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        return torch.cat([*self.class_free, *(t for s in self.class_staged for t in s)])

    def merge_and_sort_free(self) -> None:
        for r in range(self.classes):
            self._merge_class(r)

    def _merge_class(self, r: int) -> None:
        if self.class_staged[r]:
            self.class_free[r], _ = torch.sort(torch.cat([self.class_free[r],
                                                          *self.class_staged[r]]))
            self.class_staged[r], self.class_staged_n[r] = [], 0

    # -- draws -------------------------------------------------------------------------------
    def _draw(self, first_pages: list[int], n_pages: list[int]) -> torch.Tensor | None:
        """Pages for requests whose new pages are positions ``first .. first + n - 1``, in
        request then position order (the order SGLang's kernels consume a free list in):
        ``int64 [sum(n)]`` on the device, popped from their classes; ``None`` (nothing popped)
        when a class lacks pages. Host arithmetic on positions only: no host sync."""
        P = self.classes
        need = [0] * P
        index: list[torch.Tensor] = []  # per request: (class, rank within the class's draw)
        for first, n in zip(first_pages, n_pages):
            if n <= 0:
                continue
            k = torch.arange(first, first + n, dtype=torch.int64)
            cls = k % P
            start = torch.tensor(need, dtype=torch.int64)
            # the j-th page of class c in this request (k = first + (c - first) % P + j P) is
            # the (start[c] + j)-th draw of c
            index.append(torch.stack((cls, start[cls] + (k - first) // P)))
            for c in range(P):
                need[c] += (n - (c - first) % P + P - 1) // P
        for c in range(P):
            if need[c] > len(self.class_free[c]) and self.class_staged[c]:
                self._merge_class(c)
        if any(need[c] > len(self.class_free[c]) for c in range(P)):
            return None
        if not index:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        cls, rank = torch.cat(index, dim=1)
        offset = torch.tensor([0] + need[:-1], dtype=torch.int64).cumsum(0)
        taken = torch.cat([self.class_free[c][:need[c]] for c in range(P)])
        pages = taken[(offset[cls] + rank).to(self.device, non_blocking=True)]
        for c in range(P):
            self.class_free[c] = self.class_free[c][need[c]:]
        return pages

    def alloc(self, need_size: int):
        raise NotImplementedError(
            "ulacache's page-classed allocator draws a page by its request position "
            "(alloc_extend / alloc_decode); a bare alloc has none")

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                     extend_num_tokens: int, num_new_pages: int | None = None):
        """SGLang's ``alloc_extend`` (``allocator/paged.py``) with the new pages drawn by
        position: a request's pages ``ceil(prefix / page) .. ceil(seq / page) - 1``."""
        ps = self.page_size
        prefix = [int(x) for x in prefix_lens_cpu.reshape(-1).tolist()]
        seq = [int(x) for x in seq_lens_cpu.reshape(-1).tolist()]
        first = [-(-p // ps) for p in prefix]
        pages = self._draw(first, [-(-s // ps) - f for s, f in zip(seq, first)])
        if pages is None:
            return None
        out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
        if self.use_triton_kernels:
            bs = len(prefix)
            alloc_extend_kernel[(bs,)](prefix_lens, seq_lens, last_loc, pages, out,
                                       next_power_of_2(bs), ps)
        else:
            alloc_extend_naive(prefix_lens, seq_lens, last_loc, pages, out, ps, self.device)
        return out

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        """SGLang's ``alloc_decode``: a request whose new token starts page ``k`` gets a page of
        class ``k mod classes``, the others the slot after ``last_loc``."""
        ps = self.page_size
        seq = [int(x) for x in seq_lens_cpu.reshape(-1).tolist()]
        new = [(s - 1) // ps for s in seq if (s - 1) % ps == 0]
        pages = self._draw(new, [1] * len(new))
        if pages is None:
            return None
        bs = len(seq)
        out = torch.empty((bs,), dtype=torch.int64, device=self.device)
        if self.use_triton_kernels:
            alloc_decode_kernel[(bs,)](seq_lens, last_loc, pages, out, next_power_of_2(bs), ps)
        else:
            alloc_decode_naive(seq_lens, last_loc, pages, out, ps, len(new))
        return out

    # -- frees -------------------------------------------------------------------------------
    def _release_class(self, r: int, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        if self.need_sort:
            self.class_staged[r].append(pages)
            self.class_staged_n[r] += pages.numel()
        else:
            self.class_free[r] = torch.cat((pages, self.class_free[r]))

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        """Every base free path ends here (``free``, ``free_page_ids``, free groups): each page
        back to its class (``page mod classes``)."""
        pages = torch.cat(page_ids).to(torch.int64)
        if pages.device.type == "meta":  # a rehearsal: shapes only (a mask's count is data)
            parts = pages.tensor_split(self.classes)
        else:
            owner = pages % self.classes
            parts = [pages[owner == r] for r in range(self.classes)]
        for r, part in enumerate(parts):
            self._release_class(r, part)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """``kv_row[start_pos:]`` of one request (page-aligned, each page's tokens contiguous):
        its ``j``-th page is position ``start_pos / page + j``, so class ``r`` gets every
        ``classes``-th page from its first: fixed-shape slices, no host sync."""
        if free_index.numel() == 0:
            return
        ps, P = self.page_size, self.classes
        if start_pos % ps:
            raise ValueError(f"segment start {start_pos} is not page-aligned (page {ps})")
        reps = free_index[::ps].to(torch.int64) // ps
        if self.free_group is not None:
            self.free_page_ids_group.append(self._copy_for_free_group(reps))
            return
        k0 = start_pos // ps
        for r in range(P):
            self._release_class(r, reps[(r - k0) % P::P])

    def check_classes(self) -> None:
        """Host-side: every free page sits in its own class, once, and none is the padding
        page (raises ``AssertionError``; tests)."""
        for r in range(self.classes):
            merged = torch.cat([self.class_free[r], *self.class_staged[r]])
            assert bool((merged % self.classes == r).all()), f"a page of another class in {r}"
            assert bool((merged > 0).all()), "the padding page is free"
            assert merged.unique().numel() == merged.numel(), f"a page twice in class {r}"
