"""Logical addresses: page allocation and owner / local-position math.

A logical address ``t`` names one token's history entry for its whole life; data moves never
change it. Addresses come in pages of ``page_size`` tokens (SGLang: 64; ``1`` = token-granular)
and a request's position ``p`` lives at ``pages[p // P] * P + p % P``.

TP striping (design §2): address ``t`` lives on rank ``t mod P`` at local position ``t // P``;
DP mode is ``P = 1``.
"""

from __future__ import annotations

import torch

from .errors import CapacityExhausted, DoubleFreeError


def owner_rank(addrs: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Rank holding each address under round-robin striping (``t mod P``)."""
    return torch.remainder(addrs, tp_size)


def local_position(addrs: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Position of each address in its owner rank's local space (``t // P``)."""
    return torch.div(addrs, tp_size, rounding_mode="floor")


class PageAllocator:
    """Free list of logical pages (host side: admission and free are control-plane work).

    O(1) per page: a Python list used as a stack plus a used-flag per page to catch double
    frees. Pages are handed out lowest id first on a fresh allocator.
    """

    def __init__(self, n_pages: int, page_size: int):
        self.n_pages, self.page_size = n_pages, page_size
        self._free = list(range(n_pages - 1, -1, -1))
        self._used = bytearray(n_pages)

    @property
    def n_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CapacityExhausted(f"{n} logical pages wanted, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        bad = [p for p in pages if not (0 <= p < self.n_pages) or not self._used[p]]
        if bad or len(set(pages)) != len(pages):
            raise DoubleFreeError(f"pages not allocated (double free?): {bad[:8] or pages[:8]}")
        for p in pages:
            self._used[p] = 0
        self._free.extend(reversed(pages))

    def used_pages(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self._used), dtype=torch.uint8).bool()

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "page free twice"
        assert all(not self._used[p] for p in free), "free page marked used"
        assert sum(self._used) + len(free) == self.n_pages, "pages lost"


def addresses_of(pages: list[int] | torch.Tensor, page_size: int, start: int, stop: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """``int64 [stop - start]`` addresses of positions ``[start, stop)`` of a request."""
    pos = torch.arange(start, stop, dtype=torch.int64)
    table = torch.as_tensor(pages, dtype=torch.int64)
    return (table[pos // page_size] * page_size + pos % page_size).to(device)
