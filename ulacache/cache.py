"""The façade the engine (and the SGLang seams) call: one rank's ulacache in DP mode.

It owns the logical page allocator, the per-request ledger (admission charges a request's
tokens against unique capacity = GPU + CPU slots) and one :class:`SelectionGroup` per group of
layers that share a top-k selection.

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
from .errors import CapacityExhausted, DoubleFreeError, ShapeError, UnknownRequest
from .group import SelectionGroup
from .pools import resolve_device

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    """Ledger entry of one admitted request."""

    reserved: int  # tokens charged against unique capacity
    n_tokens: int = 0  # tokens allocated so far
    pages: list[int] = field(default_factory=list)


class UlaCache:
    """One rank's unified logical KV address space (DP mode).

    Typical use per scheduling round::

        cache.begin_round()                       # PB-LRU advances once per round
        addrs = cache.extend(rid, n)              # new tokens: logical addresses + GPU slots
        cache.write(addrs, layer, rows)           # their latent rows, per layer
        rows = cache.access(group, topk_addrs)    # int32 [bs, k] GPU rows for attention
    """

    def __init__(self, config: UlaCacheConfig, device: torch.device | str = "cpu", *,
                 layer_groups: list[list[int]] | None = None,
                 gpu_storage: list[torch.Tensor] | None = None, n_logical: int | None = None):
        """``layer_groups`` overrides the uniform ``layers_per_group`` split (e.g. GLM-5.2's
        last, shorter group); ``gpu_storage`` gives each group an engine-owned GPU pool
        (``uint8 [L_g, G + 1, row_bytes]``); ``n_logical`` sizes the address space when an
        engine allocates logical addresses itself (then the page allocator here is unused)."""
        self.config = config
        self.device = resolve_device(device)
        P = config.page_size
        self.pages = PageAllocator(config.n_logical_pages, P)
        self.n_logical = n_logical if n_logical is not None else config.n_logical_pages * P
        L = config.layers_per_group
        layer_groups = layer_groups or [list(range(g * L, (g + 1) * L))
                                        for g in range(config.n_groups)]
        if sorted(x for g in layer_groups for x in g) != list(range(config.n_layers)):
            raise ShapeError(f"layer_groups {layer_groups} must partition the "
                             f"{config.n_layers} layers")
        if gpu_storage is not None and len(gpu_storage) != len(layer_groups):
            raise ShapeError("gpu_storage needs one tensor per layer group")
        self.groups = [
            SelectionGroup(layers, self.n_logical, config.gpu_slots, config.cpu_slots,
                           config.row_layout.row_bytes, self.device, config.policy,
                           config.n_buckets, config.validate,
                           None if gpu_storage is None else gpu_storage[i])
            for i, layers in enumerate(layer_groups)
        ]
        self.layer_to_group = {layer: gi for gi, g in enumerate(self.groups) for layer in g.layers}
        self.requests: dict[Hashable, RequestState] = {}
        self.reserved_total = 0
        logger.info("ulacache: %d group(s) x %d layer(s), %d GPU + %d CPU slots of %d B per "
                    "layer, %d logical addresses", len(self.groups), L, config.gpu_slots,
                    config.cpu_slots, config.row_layout.row_bytes, self.n_logical)

    # -- admission -----------------------------------------------------------------------
    @property
    def free_capacity(self) -> int:
        """Tokens that can still be admitted (unique capacity not yet reserved)."""
        return self.config.unique_capacity - self.reserved_total

    def admit(self, rid: Hashable, tokens: int) -> None:
        """Charge ``tokens`` (prompt + decode budget) for a new request, or refuse it."""
        if rid in self.requests:
            raise ShapeError(f"request {rid!r} is already admitted")
        if tokens < 0:
            raise ShapeError("tokens must be >= 0")
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
        except KeyError:
            raise UnknownRequest(f"request {rid!r} is not admitted (or already freed)") from None

    # -- allocation of new tokens ----------------------------------------------------------
    def extend(self, rid: Hashable, n: int) -> torch.Tensor:
        """Allocate ``n`` new positions of ``rid`` and give each a GPU slot in every group.

        Returns ``int64 [n]`` logical addresses on the cache's device. Beyond the request's
        reservation the reservation grows if capacity is free, else :class:`CapacityExhausted`.
        Everything is checked before anything changes.
        """
        req = self._req(rid)
        if n < 0:
            raise ShapeError("n must be >= 0")
        grow = max(0, req.n_tokens + n - req.reserved)
        if grow > self.free_capacity:
            raise CapacityExhausted(f"request {rid!r} outgrows its reservation by {grow} tokens "
                                    f"and only {self.free_capacity} are free")
        P = self.config.page_size
        new_pages = -(-(req.n_tokens + n) // P) - len(req.pages)
        if new_pages > self.pages.n_free:
            raise CapacityExhausted(f"{new_pages} logical pages wanted, {self.pages.n_free} free")
        self.check_room(n)
        req.pages += self.pages.alloc(new_pages)
        req.reserved += grow
        self.reserved_total += grow
        addrs = addresses_of(req.pages, P, req.n_tokens, req.n_tokens + n, self.device)
        req.n_tokens += n
        for g in self.groups:
            g.place(addrs)
        return addrs

    # -- address-level API (engines that allocate logical addresses themselves) ----------------
    def check_room(self, n: int) -> None:
        """Raise :class:`CapacityExhausted` unless ``n`` new rows fit this round in every group."""
        for g in self.groups:
            g.check_place_room(n)

    def place(self, addrs: torch.Tensor) -> None:
        """Give new (unmapped, distinct) addresses a GPU slot in every group; all-or-nothing
        when ``validate`` is on. Without it (the decode path under SGLang) there is no host sync:
        the caller guarantees room, as the coordinator's start-up check does for decode."""
        addrs = addrs.reshape(-1).to(self.device, torch.int64)
        if self.config.validate:
            self.check_room(int((addrs >= 0).sum()))
        for g in self.groups:
            g.place(addrs)

    def release(self, addrs: torch.Tensor) -> None:
        """Drop the rows of these addresses in every group (unmapped entries are skipped)."""
        addrs = addrs.reshape(-1).to(self.device, torch.int64)
        for g in self.groups:
            g.release(addrs)

    def addresses(self, rid: Hashable, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Addresses of a request's positions (all allocated ones by default); ``-1`` stays."""
        req = self._req(rid)
        table = addresses_of(req.pages, self.config.page_size, 0, req.n_tokens, self.device)
        if positions is None:
            return table
        pos = positions.to(self.device, torch.int64)
        if bool(((pos >= req.n_tokens)).any()):
            raise ShapeError(f"position beyond request length {req.n_tokens}")
        return torch.where(pos >= 0, table[pos.clamp(min=0)], -1)

    # -- data and access -------------------------------------------------------------------
    def group_of(self, layer: int) -> SelectionGroup:
        try:
            return self.groups[self.layer_to_group[layer]]
        except KeyError:
            raise ShapeError(f"layer {layer} out of range [0, {self.config.n_layers})") from None

    def write(self, addrs: torch.Tensor, layer: int, rows: torch.Tensor) -> None:
        """Write ``uint8 [n, row_bytes]`` rows of one layer for live addresses."""
        self.group_of(layer).write(addrs.to(self.device), rows, layer)

    def read(self, addrs: torch.Tensor, layer: int) -> torch.Tensor:
        """``uint8 [n, row_bytes]`` rows of one layer, from whichever tier holds them."""
        return self.group_of(layer).read(addrs.to(self.device), layer)

    def access(self, group: int, addrs: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``int32 [bs, k]`` GPU rows for selected addresses of one group (see
        :meth:`SelectionGroup.access`); every layer of the group reads the same rows."""
        return self.groups[group].access(addrs, out)

    def gpu_rows(self, layer: int) -> torch.Tensor:
        """The GPU pool of one layer, ``uint8 [G + 1, row_bytes]`` (row G is scratch)."""
        g = self.group_of(layer)
        return g.pools.gpu[g.layer_index[layer]]

    def begin_round(self) -> None:
        """Start a scheduling round: PB-LRU advances in every group."""
        for g in self.groups:
            g.policy.advance()

    # -- end of a request ------------------------------------------------------------------
    def free(self, rid: Hashable) -> None:
        """Finish (or abort) a request: its rows leave both tiers, pages and reservation are
        returned. Freeing an unknown or already freed request raises."""
        if rid not in self.requests:
            raise DoubleFreeError(f"request {rid!r} is not admitted or was already freed")
        req = self.requests[rid]
        self.release(addresses_of(req.pages, self.config.page_size, 0, req.n_tokens))
        self.pages.free(req.pages)
        self.reserved_total -= req.reserved
        del self.requests[rid]

    abort = free  # mid-request abort releases exactly what finish does

    # -- observability and invariants ------------------------------------------------------
    def stats(self) -> dict[str, int]:
        out = {"requests": len(self.requests), "reserved_tokens": self.reserved_total,
               "unique_capacity": self.config.unique_capacity}
        for i, g in enumerate(self.groups):
            for k, v in g.counter_values().items():
                out[f"group{i}_{k}"] = v
        return out

    def live_mask(self) -> torch.Tensor:
        live = torch.zeros(self.n_logical, dtype=torch.bool, device=self.device)
        for req in self.requests.values():
            live[addresses_of(req.pages, self.config.page_size, 0, req.n_tokens,
                              self.device)] = True
        return live

    def check_integrity(self, live: torch.Tensor | None = None) -> None:
        """Assert every invariant of the ledger, the page allocator and each group.

        ``live``: ``bool [n_logical]`` of addresses an engine allocated itself (SGLang's paged
        allocator); mapped addresses must be live. Default: the addresses of admitted requests,
        each of which must also be mapped in every group.
        """
        if live is not None:
            for g in self.groups:
                g.check_integrity(live)
            return
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
        for g in self.groups:
            g.check_integrity(live)
            # every live address has exactly one row in every group (exclusive tiers)
            assert bool((g.loc[: self.n_logical][live] >= 0).all()), "live address unmapped"
