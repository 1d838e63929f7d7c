"""The request ledger: admission and logical pages for engines that do not allocate logical
addresses themselves (the reference model's driver, the trace replay, tests).

:class:`UlaCache` owns a logical page allocator and a per-request ledger (admission charges a
request's tokens against unique capacity = GPU + CPU slots, so a full system refuses a request
instead of failing it mid-decode) over an :class:`~ulacache.space.AddressSpace`, which holds the
data. Under SGLang the engine's own allocator plays this role and the address space is used
directly.

Region table of a request's positions::

    [0, n_tokens)            allocated addresses, each with one row per layer (once placed)
    [n_tokens, reserved)     charged at admission, not allocated yet (decode headroom)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Hashable

import torch

from .address import PageAllocator, addresses_of
from .config import UlaCacheConfig
from .errors import AddressError, CapacityExhausted, DoubleFreeError, ShapeError, UnknownRequest
from .space import AddressSpace

logger = logging.getLogger(__name__)


def _count(value, name: str) -> int:
    """A non-negative integer count (bool, float, NaN and negative values are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShapeError(f"{name} must be a non-negative integer, got {value!r}")
    if value < 0:
        raise ShapeError(f"{name} must be a non-negative integer, got {value}")
    return value


@dataclass
class RequestState:
    """Ledger entry of one admitted request."""

    reserved: int  # tokens charged against unique capacity
    n_tokens: int = 0  # tokens allocated so far
    pages: list[int] = field(default_factory=list)


class UlaCache:
    """One rank's request ledger over an address space (DP mode).

    Typical use per scheduling round::

        cache.space.begin_round()                   # policies advance once per round
        addrs = cache.extend(rid, n)                # new tokens: logical addresses + GPU slots
        cache.space.write(layer, addrs, rows)       # their latent rows, per layer
        rows = cache.space.access(group, topk)      # int32 [bs, k] GPU rows for attention
        cache.free(rid)                             # finish or abort
    """

    def __init__(self, config: UlaCacheConfig, device: torch.device | str = "cpu", *,
                 layer_groups: list[list[int]] | None = None, peers=None):
        self.config = config
        P = config.page_size
        # the address space first: it refuses sizes the memory cannot hold before the page
        # list (one Python int per page) is built
        n_logical = config.n_logical_pages * P
        if config.tp_size > 1:
            # TP mode: every rank runs this ledger with the same calls (SPMD), so every rank
            # hands out the same addresses; the striped space stores each rank's share
            if peers is None:
                raise ShapeError("TP mode (tp_size > 1) needs peers (ulacache.ipc)")
            if config.tp_attention == "dcp":  # each rank attends its own stripe
                from .stripe import StripeAddressSpace as Space
            else:  # each rank copies peers' rows into its buffer
                from .tp import TPAddressSpace as Space

            self.space = Space(config, peers, n_logical=n_logical, layer_groups=layer_groups)
        else:
            self.space = AddressSpace(config, device, n_logical=n_logical,
                                      layer_groups=layer_groups)
        self.pages = PageAllocator(config.n_logical_pages, P)
        self.device = self.space.device
        self.requests: dict[Hashable, RequestState] = {}
        self.reserved_total = 0

    # -- admission -----------------------------------------------------------------------
    @property
    def free_capacity(self) -> int:
        """Tokens that can still be admitted (unique capacity not yet reserved)."""
        return self.config.unique_capacity - self.reserved_total

    def admit(self, rid: Hashable, tokens: int) -> None:
        """Charge ``tokens`` (prompt + decode budget) for a new request, or refuse it."""
        try:
            hash(rid)
        except TypeError:
            raise ShapeError(f"request id must be hashable, got {type(rid).__name__}") from None
        tokens = self.config.charge(_count(tokens, "admit: tokens"))
        if rid in self.requests:
            raise ShapeError(f"request {rid!r} is already admitted")
        if len(self.requests) >= self.config.max_requests:
            raise CapacityExhausted(f"{self.config.max_requests} requests already admitted")
        if tokens > self.free_capacity:
            raise CapacityExhausted(f"request {rid!r} needs {tokens} tokens; {self.free_capacity}"
                                    f" of {self.config.unique_capacity} unique slots are free")
        self.requests[rid] = RequestState(reserved=tokens)
        self.reserved_total += tokens

    def _req(self, rid: Hashable) -> RequestState:
        try:
            return self.requests[rid]
        except (KeyError, TypeError):
            raise UnknownRequest(f"request {rid!r} is not admitted (or already freed)") from None

    # -- allocation of new tokens ----------------------------------------------------------
    def extend(self, rid: Hashable, n: int) -> torch.Tensor:
        """Allocate ``n`` new positions of ``rid`` and give each a GPU slot in every group.

        Returns ``int64 [n]`` logical addresses on the cache's device. Beyond the request's
        reservation the reservation grows if capacity is free, else :class:`CapacityExhausted`.
        Everything (room in every group included) is checked before anything changes.
        """
        self._req(rid)  # an unhashable or unknown id is refused before building the batch
        return self.extend_batch({rid: n})[0]

    def extend_batch(self, counts: dict[Hashable, int]) -> list[torch.Tensor]:
        """:meth:`extend` for several requests at once (one placement, as an engine places a
        decode batch's new tokens); all-or-nothing. Returns the addresses per request, in the
        order of ``counts``."""
        if not isinstance(counts, dict):
            raise ShapeError("extend_batch: counts must be a dict {request id: tokens}")
        P = self.config.page_size
        grow = pages = 0
        plan = []
        for rid, n in counts.items():
            req = self._req(rid)
            n = _count(n, "extend: n")
            g = max(0, self.config.charge(req.n_tokens + n) - req.reserved)
            grow += g
            pages += -(-(req.n_tokens + n) // P) - len(req.pages)
            plan.append((req, n, g))
        if grow > self.free_capacity:
            raise CapacityExhausted(f"requests outgrow their reservations by {grow} tokens and "
                                    f"only {self.free_capacity} are free")
        if pages > self.pages.n_free:
            raise CapacityExhausted(f"{pages} logical pages wanted, {self.pages.n_free} free")
        got = [self.pages.alloc(-(-(req.n_tokens + n) // P) - len(req.pages))
               for req, n, _ in plan]
        out = [addresses_of(req.pages + new, P, req.n_tokens, req.n_tokens + n, self.device)
               for (req, n, _), new in zip(plan, got)]
        addrs = torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)
        try:  # control plane: an exact host check of every group (and rank) is fine here
            self.space.check_place(addrs)
        except Exception:
            # the free list is a stack: give the pages back in reverse order of allocation so
            # that a refusal leaves the allocator exactly as it was (same hand-out order)
            for new in reversed(got):
                self.pages.free(new)
            raise
        for (req, n, g), new in zip(plan, got):
            req.pages += new
            req.reserved += g
            self.reserved_total += g
            req.n_tokens += n
        self.space.place(addrs)
        return out

    def addresses(self, rid: Hashable, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Addresses of a request's positions (all allocated ones by default); ``-1`` stays."""
        req = self._req(rid)
        table = addresses_of(req.pages, self.config.page_size, 0, req.n_tokens, self.device)
        if positions is None:
            return table
        if not isinstance(positions, torch.Tensor) or \
                positions.dtype not in (torch.int32, torch.int64):
            raise ShapeError("addresses: positions must be an int32/int64 tensor")
        pos = positions.to(self.device, torch.int64)
        if bool(((pos < -1) | (pos >= req.n_tokens)).any()):
            raise AddressError(f"addresses: positions must be -1 or in [0, {req.n_tokens}) for "
                               f"request {rid!r}")
        if req.n_tokens == 0:  # nothing allocated yet: only -1 padding can be asked for
            return torch.full_like(pos, -1)
        return torch.where(pos >= 0, table[pos.clamp(min=0)], -1)

    # -- end of a request ------------------------------------------------------------------
    def free(self, rid: Hashable) -> None:
        """Finish (or abort) a request: its rows leave both tiers, pages and reservation are
        returned. Freeing an unknown or already freed request raises."""
        try:
            req = self.requests[rid]
        except (KeyError, TypeError):
            raise DoubleFreeError(f"request {rid!r} is not admitted or was already freed") \
                from None
        self.space.release(addresses_of(req.pages, self.config.page_size, 0, req.n_tokens))
        self.pages.free(req.pages)
        self.reserved_total -= req.reserved
        del self.requests[rid]

    abort = free  # mid-request abort releases exactly what finish does

    # -- observability and invariants ------------------------------------------------------
    def stats(self) -> dict[str, int]:
        out = {"requests": len(self.requests), "reserved_tokens": self.reserved_total,
               "unique_capacity": self.config.unique_capacity}
        for i, counters in enumerate(self.space.counters()):
            for k, v in counters.items():
                out[f"group{i}_{k}"] = v
        return out

    def live_mask(self) -> torch.Tensor:
        """``bool [n_logical]``: the addresses of admitted requests."""
        live = torch.zeros(self.space.n_logical, dtype=torch.bool, device=self.device)
        for req in self.requests.values():
            live[addresses_of(req.pages, self.config.page_size, 0, req.n_tokens,
                              self.device)] = True
        return live

    def check_integrity(self) -> None:
        """Assert every invariant of the ledger, the page allocator and the address space; every
        allocated address must have one row in every group (exclusive tiers)."""
        self.pages.check_integrity()
        assert self.reserved_total == sum(r.reserved for r in self.requests.values())
        assert self.reserved_total <= self.config.unique_capacity, "over-admitted"
        P = self.config.page_size
        owned = [p for r in self.requests.values() for p in r.pages]
        assert len(owned) == len(set(owned)), "page owned by two requests"
        used = self.pages.used_pages()
        assert int(used.sum()) == len(owned) and all(used[p] for p in owned), "page ledger"
        for r in self.requests.values():
            assert r.n_tokens <= r.reserved and len(r.pages) == -(-r.n_tokens // P)
        live = self.live_mask()
        self.space.check_integrity(live)
        self.space.check_placed(live)
