"""The address-level core: one rank's logical address space over per-group tiered pools.

This is what an engine that allocates logical addresses itself (SGLang's paged allocator) calls;
:class:`ulacache.cache.UlaCache` adds a request ledger on top for engines that do not.

Typical use per scheduling round::

    space.begin_round()                        # policies advance; counters polled
    space.place(new_addrs)                     # new tokens: a GPU slot in every group
    space.write(layer, new_addrs, rows)        # their latent rows (tests and tools)
    rows = space.access(group, topk_addrs)     # int32 [bs, k] GPU rows for attention
    space.release(finished_addrs)              # rows leave both tiers

Every mutating call runs on the core stream (:mod:`ulacache.streams`).
"""

from __future__ import annotations

import logging

import torch

from .config import UlaCacheConfig
from .errors import CapacityExhausted, ConfigError, ShapeError
from .group import (
    COUNTERS,
    SelectionGroup,
    advance_policies,
    check_distinct,
    count_distinct,
    distinct_addresses,
    new_claim_table,
)
from .health import CounterMonitor
from .pblru import PBLRUArena
from .pools import allocate, free_bytes, resolve_device
from .sizing import host_table_bytes, table_bytes
from .streams import CoreStream

logger = logging.getLogger(__name__)


class AddressSpace:
    """Selection groups over one logical address space ``[0, n_logical)``.

    Parameters
    ----------
    config : sizes, row layout, policy, ``validate``.
    n_logical : addresses the engine may use (SGLang: its paged allocator's token count).
    layer_groups : global layer ids per selection group (default: ``layers_per_group``
        consecutive layers each; override for e.g. a last, shorter group).
    gpu_storage : one engine-owned ``uint8 [L_g, gpu_slots + 1, row_bytes]`` GPU pool per group.
    row_base : where slot 0 sits in the engine's tensor (SGLang: after its 64-row sink page):
        the rows :meth:`access`, :meth:`plan` and :meth:`translate` return are ``slot +
        row_base`` (the kernels add it), so the engine indexes its tensor with them directly.
        ``gpu_storage`` is the view of the slots themselves.
    """

    def __init__(self, config: UlaCacheConfig, device: torch.device | str = "cpu", *,
                 n_logical: int, layer_groups: list[list[int]] | None = None,
                 gpu_storage: list[torch.Tensor] | None = None, row_base: int = 0):
        self.config = config
        self.device = resolve_device(device)
        if isinstance(n_logical, bool) or not isinstance(n_logical, int) or n_logical < 1:
            raise ShapeError(f"n_logical must be a positive integer, got {n_logical!r}")
        self.n_logical = n_logical
        L = config.layers_per_group
        layer_groups = layer_groups or [list(range(g * L, (g + 1) * L))
                                        for g in range(config.n_groups)]
        if sorted(x for g in layer_groups for x in g) != list(range(config.n_layers)) or \
                not all(layer_groups):
            raise ShapeError(f"layer_groups {layer_groups} must partition the "
                             f"{config.n_layers} layers into non-empty groups")
        if gpu_storage is not None and len(gpu_storage) != len(layer_groups):
            raise ShapeError("gpu_storage needs one tensor per layer group")
        self._check_memory(layer_groups, engine_pools=gpu_storage is not None)
        # every group counts into its row of one table: one copy takes them all off the device
        self.counter_table = torch.zeros(len(layer_groups), len(COUNTERS), dtype=torch.int64,
                                         device=self.device)
        claim = new_claim_table(n_logical, self.device)  # dedup scratch, shared by the groups
        self.claim_table = claim
        # PB-LRU state of every group stacked in one arena: a round start is one fused launch
        self.policy_arena = PBLRUArena(len(layer_groups), config.gpu_slots, config.n_buckets,
                                       self.device) if config.policy == "pblru" else None
        self.groups: list[SelectionGroup] = []
        scratch = None  # the fused path's per-call scratch: the first group's, shared by all
        for i, layers in enumerate(layer_groups):
            g = SelectionGroup(layers, n_logical, config.gpu_slots, config.cpu_slots,
                               config.row_layout.row_bytes, self.device,
                               self.policy_arena.policies[i] if self.policy_arena
                               else config.policy, config.n_buckets, config.validate,
                               None if gpu_storage is None else gpu_storage[i],
                               counters=self.counter_table[i], claim=claim,
                               access_path=config.access_path,
                               max_call=config.call_capacity, scratch=scratch,
                               row_base=row_base, shadows=config.shadows)
            scratch = g.fused.shared_scratch if g.fused is not None else None
            self.groups.append(g)
        self.layer_to_group = {layer: gi for gi, g in enumerate(self.groups) for layer in g.layers}
        self.stream = CoreStream(self.device)
        self.health = CounterMonitor(self.counter_table)
        self.round_serial = 0  # host count of begin_round calls (stale-selection checks)
        logger.info("ulacache: %d selection group(s) over %d layers, %d GPU + %d CPU slots of "
                    "%d B per layer, %d logical addresses, policy %s", len(self.groups),
                    config.n_layers, config.gpu_slots, config.cpu_slots,
                    config.row_layout.row_bytes, n_logical, config.policy)

    def _check_memory(self, layer_groups: list[list[int]], engine_pools: bool) -> None:
        """Refuse, before allocating anything, a configuration whose pools and tables together
        exceed the free device or host memory (each allocation is checked again on its own).
        The tables are :func:`table_bytes`, the figure an engine's sizing charges too."""
        c, n = self.config, self.n_logical
        rb, G, C = c.row_layout.row_bytes, c.gpu_slots, c.cpu_slots
        layers = sum(len(g) for g in layer_groups)
        _, tables = table_bytes(len(layer_groups), n_logical=n, gpu_slots=G,
                                n_buckets=c.n_buckets, policy=c.policy,
                                call_entries=c.call_entries)
        # the host tier: host memory, or the meta device with the rest (ulacache rehearse)
        cpu = torch.device("meta" if self.device.type == "meta" else "cpu")
        parts = {  # (device, what) -> bytes
            (self.device, "the GPU pool"): 0 if engine_pools else layers * (G + 1) * rb,
            (cpu, "the CPU pool"): layers * (C + 1) * rb,
            (cpu, "the CPU free stacks"): host_table_bytes(len(layer_groups), C),
            (self.device, "the mapping tables, claim table and policy state"): tables,
        }
        for dev in {self.device, cpu}:
            mine = {what: b for (d, what), b in parts.items() if d == dev and b}
            need, avail = sum(mine.values()), free_bytes(dev)
            if avail is not None and need > avail:
                detail = ", ".join(f"{what} {b / 2**30:.2f} GiB" for what, b in mine.items())
                raise CapacityExhausted(
                    f"this configuration needs {need / 2**30:.2f} GiB of {dev} memory ({detail};"
                    f" {layers} layers x {G} GPU + {C} CPU slots of {rb} B, {n} addresses) but "
                    f"{avail / 2**30:.2f} GiB is available; lower gpu_slots / cpu_slots / the "
                    "layer count")

    @property
    def validate(self) -> bool:
        return self.config.validate

    def set_stream(self, stream) -> None:
        """Issue every core mutation on ``stream`` (the engine's forward / producer stream)."""
        self.stream.set(stream)

    # -- lookup ---------------------------------------------------------------------------
    def group(self, index: int) -> SelectionGroup:
        """Selection group ``index`` in ``[0, len(groups))`` (no negative indexing)."""
        if isinstance(index, bool) or not isinstance(index, int) or \
                not 0 <= index < len(self.groups):
            raise ShapeError(f"group must be an integer in [0, {len(self.groups)}), got "
                             f"{index!r}")
        return self.groups[index]

    def group_of(self, layer: int) -> SelectionGroup:
        if isinstance(layer, bool) or not isinstance(layer, int) or \
                layer not in self.layer_to_group:
            raise ShapeError(f"layer must be an integer in [0, {self.config.n_layers}), got "
                             f"{layer!r}")
        return self.groups[self.layer_to_group[layer]]

    def gpu_rows(self, layer: int) -> torch.Tensor:
        """The GPU pool of one layer, ``uint8 [gpu_slots + 1, row_bytes]`` (last row scratch)."""
        g = self.group_of(layer)
        return g.pools.gpu[g.layer_index[layer]]

    def checked_addresses(self, addrs: torch.Tensor, name: str) -> torch.Tensor:
        """Integer address tensors only (bool and float are refused, not truncated), on the
        device or in host memory (fine for control-plane calls), moved to the device."""
        if not isinstance(addrs, torch.Tensor) or addrs.dtype not in (torch.int32, torch.int64):
            got = addrs.dtype if isinstance(addrs, torch.Tensor) else type(addrs).__name__
            raise ShapeError(f"{name} must be an int32/int64 tensor, got {got}")
        if addrs.device not in (self.device, torch.device("cpu")):
            raise ShapeError(f"{name} must be on {self.device} or the CPU, got {addrs.device}")
        return addrs.to(self.device)

    # -- rounds ---------------------------------------------------------------------------
    def begin_round(self) -> None:
        """Start a scheduling round: every policy advances; overflow counters are polled."""
        with self.stream.scope():
            advance_policies([g.policy for g in self.groups], self.policy_arena,
                             self.groups[0].fused is not None)
            self.health.poll()
        self.round_serial += 1

    # -- what a round can hold (the engine's admission asks these) -------------------------
    def prefill_fits(self, seq_lens: list[int]) -> bool:
        """Whether a prefill batch of requests reaching these lengths (tokens, prefix
        included) can be GPU-resident in one round, as its sparse attention may select any of
        them: their sum fits the GPU pool. Host-side, from lengths alone."""
        return sum(seq_lens) <= self.config.gpu_slots

    def round_fits(self, addrs: torch.Tensor) -> bool:
        """Whether the distinct addresses of ``addrs`` (any shape, ``-1`` padding) can all be
        GPU-resident in one fresh round: at most ``gpu_slots`` of them. Host-side
        (synchronises): the question :func:`ulacache.prefill.round_spans` asks to split a
        prefill's selections into rounds."""
        flat = self.checked_addresses(addrs, "round_fits: addrs").reshape(-1)
        return flat[flat >= 0].unique().numel() <= self.config.gpu_slots

    def check_step_capacity(self, requests: int, steps: int, top_k: int) -> None:
        """Raise :class:`ConfigError` unless one decode step's selections, ``requests x steps``
        rows of ``top_k`` plus the new token each, fit the GPU pool."""
        worst = requests * steps * (top_k + 1)
        if self.config.gpu_slots < worst:
            raise ConfigError(
                f"the GPU pool ({self.config.gpu_slots} slots) must hold one step's selections: "
                f"({requests} requests x {steps} tokens) x (top-k {top_k} + 1) = {worst}")

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank of the engine: one rank here, so ``ok``."""
        return ok

    def verdict(self, check) -> None:
        """Run a host-side ``check`` (it raises a :class:`~ulacache.errors.UlaCacheError` or
        returns): one rank here, so its error is the engine's."""
        check()

    def stage_rows(self, seq_lens: list[int]) -> int:
        """Rows a prefill stage (:class:`ulacache.prefill.PrefillStage`) over this space needs
        for a batch of requests reaching these lengths, whatever they select: every token."""
        return sum(seq_lens)

    # -- placement and release --------------------------------------------------------------
    def check_room(self, n: int) -> None:
        """Raise :class:`CapacityExhausted` unless ``n`` new rows fit this round in every
        group (host-side; synchronises)."""
        for g in self.groups:
            g.check_place_room(n)

    def check_place(self, addrs: torch.Tensor) -> None:
        """Raise what :meth:`place` would raise with validate on, changing nothing."""
        addrs = self.checked_addresses(addrs, "place: addrs").reshape(-1)
        with self.stream.scope():
            for g in self.groups:
                g.check_place(addrs)

    def place(self, addrs: torch.Tensor) -> torch.Tensor:
        """Give new (unmapped, distinct) addresses a GPU slot in every group; ``int64 [n]``
        slots of the first group (``-1``: not placed). All-or-nothing when ``validate`` is on;
        off, overflow is masked and counted (see :mod:`ulacache.group`)."""
        addrs = self.checked_addresses(addrs, "place: addrs").reshape(-1)
        with self.stream.scope():
            if self.validate:  # every group accepts before any group changes
                for g in self.groups:
                    g.check_place(addrs)
            slots = [g.place(addrs) for g in self.groups]
        return slots[0]

    def release(self, addrs: torch.Tensor) -> None:
        """Drop the rows of these addresses in every group (unmapped entries are skipped)."""
        addrs = self.checked_addresses(addrs, "release: addrs").reshape(-1)
        with self.stream.scope():
            for g in self.groups:
                g.release(addrs)

    # -- data and access ----------------------------------------------------------------------
    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``uint8 [n, row_bytes]`` rows of one layer for live addresses (host-checked)."""
        g = self.group_of(layer)
        with self.stream.scope():
            g.write(layer, self.checked_addresses(addrs, "write: addrs"), rows)

    def read(self, layer: int, addrs: torch.Tensor) -> torch.Tensor:
        """``uint8 [n, row_bytes]`` rows of one layer, from whichever tier holds them."""
        g = self.group_of(layer)
        with self.stream.scope():
            return g.read(layer, self.checked_addresses(addrs, "read: addrs"))

    def gather(self, layer: int, addrs: torch.Tensor, dst: torch.Tensor,
               dst_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy one layer's rows of live ``addrs`` into ``dst uint8 [1, R + 1, row_bytes]`` at
        ``dst_rows`` from whichever tier holds them, changing nothing; ``(from_cpu, gathered)``
        (see :meth:`SelectionGroup.gather`)."""
        g = self.group_of(layer)
        with self.stream.scope():
            return g.gather(layer, self.checked_addresses(addrs, "gather: addrs"), dst,
                            dst_rows)

    def access(self, group: int, addrs: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``int32 [bs, k]`` GPU rows for selected addresses of one group (see
        :meth:`SelectionGroup.access`); every layer of the group reads the same rows."""
        g = self.group(group)
        with self.stream.scope():
            return g.access(addrs, out)

    def prefetch(self, group: int, addrs: torch.Tensor, budget: torch.Tensor) -> None:
        """Promote predicted rows of one group ahead of its access (see
        :meth:`SelectionGroup.prefetch`): a hint, never an error for what it names. Issued on
        the *caller's* stream, not the core stream: :class:`ulacache.prefetch.PrefetchEngine`
        calls it on its prefetch stream after that stream waited for the core's work, and makes
        the group's access wait for it (layer-local), so nothing else orders it."""
        self.group(group).prefetch(self.checked_addresses(addrs, "prefetch: addrs"), budget)

    def use_prefetch_tables(self) -> None:
        """Give every group one separate dedup table and fused scratch for prefetching, so a
        prefetch on its own stream never shares scratch with an access (8 B per logical
        address, once; :class:`ulacache.prefetch.PrefetchEngine` asks for it)."""
        claim = new_claim_table(self.n_logical, self.device)
        scratch = None
        for g in self.groups:
            g.use_prefetch_tables(claim, scratch)
            if g.fused_prefetch is not None:
                scratch = g.fused_prefetch.shared_scratch

    def use_move_list(self) -> None:
        """Let the groups of two or more layers run deferred accesses: one move list, ``int32
        [3, call_capacity]`` (12 B a call entry), shared by them, since a group's replays are
        joined before the next deferred access (:class:`ulacache.prefetch.PrefetchEngine`'s
        ``shared_groups`` source asks for it)."""
        shared = [g for g in self.groups if len(g.layers) > 1]
        if not shared:
            raise ConfigError("deferred accesses need a selection group of two or more layers "
                              "(a model whose layers share top-k); every group here has one")
        moves = allocate((3, self.config.call_capacity), torch.int32, self.device,
                         "the move list", fill=-1)
        for g in shared:
            g.use_move_list(moves)

    def access_deferred(self, group: int, addrs: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`access` moving only the group's anchor layer's bytes; the other layers'
        bytes move with :meth:`replay_layer` (see :meth:`SelectionGroup.access_deferred`)."""
        g = self.group(group)
        with self.stream.scope():
            return g.access_deferred(addrs, out)

    def replay_layer(self, group: int, li: int) -> None:
        """Layer ``li`` (``>= 1``, the group's order) of the group's last deferred access. Issued
        on the *caller's* stream (the prefetch stream, which the engine ordered after the
        access), as :meth:`prefetch` is."""
        self.group(group).replay_layer(li)

    def distinct(self, table: torch.Tensor, size: int, first: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`ulacache.group.distinct_addresses` of ``table`` through this space's claim
        table, in pieces of ``call_capacity``: ``(found`` ascending ``int64 [size]``, ``-1``
        after them, ``n_distinct, n_bad)``; fixed shapes, no sync."""
        return distinct_addresses(self.claim_table, table, size, first=first,
                                  piece=self.config.call_capacity)

    def access_distinct(self, group: int, table: torch.Tensor, first: int = 0) -> None:
        """One access of a group on the distinct addresses of a large ``table`` (any shape,
        ``-1`` and addresses below ``first`` are padding): a prefill page table of ``T x top-k``
        entries becomes at most ``gpu_slots`` distinct rows, all GPU-resident in this round
        (read their rows with :meth:`translate`, which has no side effects). The bound is
        what :meth:`prefill_fits` admits; beyond it rows stay put and are counted as
        ``access_overflow``, out-of-range entries as ``invalid`` (validate off). Validate on:
        :class:`AddressError` / :class:`CapacityExhausted` before anything changes. The
        access counts distinct rows (``accesses``, ``gpu_hits``, ``promotions``), not the
        table's entries."""
        table = self.checked_addresses(table, "access_distinct: table")
        g = self.group(group)
        size = min(self.config.gpu_slots, table.numel())  # a short table: a short access
        with self.stream.scope():
            found, n_distinct, bad = self.distinct(table, size, first)
            if self.validate:
                check_distinct(bad, n_distinct, self.config.gpu_slots, self.n_logical,
                               f"a GPU pool of {self.config.gpu_slots} slots")
            else:
                count_distinct(g.counters, bad, n_distinct, size)
            g.access(found.view(1, -1))

    def plan(self, group: int, addrs: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """DP mode: the access itself (every layer's rows are already in place); the same
        call as TP mode's :meth:`ulacache.tp.TPAddressSpace.plan`."""
        return self.access(group, addrs, out)

    def load(self, layer: int) -> None:
        """DP mode: nothing to move per layer (TP mode copies peers' rows here)."""
        self.group_of(layer)

    attn_rows = gpu_rows

    def translate(self, group: int, addrs: torch.Tensor) -> torch.Tensor:
        """GPU rows of addresses without side effects (``-1``: padding or not GPU-resident)."""
        g = self.group(group)
        with self.stream.scope():
            return g.translate(addrs)

    # -- observability and invariants ------------------------------------------------------
    def counters(self) -> list[dict[str, int]]:
        """Current counters of every group (host read: synchronises)."""
        return [dict(zip(COUNTERS, row)) for row in self.counter_table.tolist()]

    def check_integrity(self, live: torch.Tensor | None = None) -> None:
        """Assert every group's invariants; ``live`` (``bool [n_logical]``): the addresses the
        engine has allocated (mapped addresses must be among them)."""
        with self.stream.scope():
            for g in self.groups:
                g.check_integrity(live)

    def check_placed(self, live: torch.Tensor) -> None:
        """Assert every live address has a row in every group (engines that place every
        address they allocate: the ledger)."""
        live = live.to(self.device)
        for g in self.groups:
            assert bool((g.loc[: self.n_logical][live] >= 0).all()), "live address unmapped"
