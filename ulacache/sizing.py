"""Device bytes of the core's own tables (mapping, owners, free stacks, claim table, policy
state; TP: buffer maps and gate tables), as a function of the pool size: what an engine's
sizing charges per GPU slot (``patches/sglang_sizing.py``) and what
:meth:`ulacache.space.AddressSpace._check_memory` checks at start-up; one formula for both.
``tests/test_sizing.py`` holds it against the bytes real objects allocate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from .bufmap import map_bytes
from .config import CALL_FLOOR
from .errors import ConfigError
from .group import COUNTERS
from .pblru import DEFAULT_BUCKETS, HYPER, POLICIES, SUPER, WORD_BITS

__all__ = ["Affine", "TPTables", "table_bytes", "table_bytes_per_slot", "call_scratch_bytes",
           "coordinator_output_bytes", "host_table_bytes", "CPU_FREE_STACK_BYTES"]

CPU_FREE_STACK_BYTES = 4
"""Host bytes per CPU slot per selection group besides its rows: the slot's entry in the CPU
free stack (``int32``, :class:`ulacache.pools.TierPools`), which lives in host memory."""


def host_table_bytes(groups: int, cpu_slots: int) -> int:
    """Host bytes of one rank's tables besides the CPU pool's rows: the CPU free stacks,
    ``int32 [C + 1]`` per selection group."""
    return groups * CPU_FREE_STACK_BYTES * (cpu_slots + 1)


@dataclass(frozen=True)
class Affine:
    """A length or a byte count as an affine function of a pool's slot count ``x``:
    ``per * x + fixed`` (exact rationals; :func:`table_bytes` rounds up once at the end)."""

    per: Fraction = Fraction(0)
    fixed: Fraction = Fraction(0)

    @staticmethod
    def of(value: int | Affine) -> Affine:
        """An ``int`` is a constant (a table whose length does not grow with the pool)."""
        return value if isinstance(value, Affine) else Affine(Fraction(0), Fraction(value))

    def __add__(self, other: int | Affine) -> Affine:
        o = Affine.of(other)
        return Affine(self.per + o.per, self.fixed + o.fixed)

    __radd__ = __add__

    def __mul__(self, k: int | Fraction) -> Affine:
        return Affine(self.per * k, self.fixed * k)

    __rmul__ = __mul__

    def ceil_div(self, d: int) -> Affine:
        """An upper bound of ``ceil(value / d)`` wherever the value is an integer:
        ``(value + d - 1) / d``."""
        return Affine(self.per / d, (self.fixed + d - 1) / d)


# PB-LRU's byte tables (popcount int32 [256], select int64 [256, 8]): one read-only pair per
# device shared by every policy (ulacache.pblru._byte_tables), so charged once per rank.
BYTE_TABLE_BYTES = 256 * 4 + 256 * 8 * 8


def _policy_bytes(policy: str, n: Affine, n_buckets: int) -> Affine:
    """Device bytes of one replacement policy over ``n`` slots (every tensor its constructor
    allocates, :mod:`ulacache.pblru`)."""
    if policy == "lru":  # stamp int64 [n + 1], _ids int64 [n], round_t
        return 8 * (n + 1) + 8 * n + 8
    if policy != "pblru":
        raise ConfigError(f"no table sizes for policy {policy!r}; legal: {sorted(POLICIES)}")
    rows = n_buckets + 3  # free, cold, n_b recent, current
    supers = n.ceil_div(WORD_BITS * SUPER)  # n_super
    hypers = supers.ceil_div(HYPER)  # n_hyper
    words = SUPER * supers + SUPER  # n_words (whole superblocks) + a scratch superblock
    return (rows * words * (8 + 4)  # bits int64 and counts int32 [rows, n_words + 16]
            + rows * 4 * (supers + 1) + rows * 4 * (hypers + 1)  # super/hyper_counts int32
            + rows * 2 * 4  # row_counts int32 [rows, 2]
            + 2 * 2 * (n + 1)  # round_of, ring_of int16 [n + 1]
            + 3 * 8  # round_t, epoch_t, entered
            + 8 * n_buckets + 2 * 8)  # _ring int64 [n_b], _head int64 [2]


@dataclass(frozen=True)
class TPTables:
    """What a TP rank adds (:class:`ulacache.tp.TPAddressSpace`): ``n_global`` addresses of the
    whole group, ``buffer_slots`` rows per buffer, ``ranks`` peers, ``layers`` layers."""

    n_global: int | Affine
    buffer_slots: int
    ranks: int
    layers: int


def table_bytes(groups: int, *, n_logical: int | Affine, gpu_slots: int | Affine,
                n_buckets: int = DEFAULT_BUCKETS, policy: str = "pblru",
                tp: TPTables | None = None, call_scratch: bool = True,
                call_entries: int | None = None, prefetch: bool = False,
                deferred_moves: bool = False) -> tuple[int, int]:
    """Device bytes of one rank's ulacache tables, ``(per_slot, fixed)``: a pool of ``x`` slots
    takes at most ``per_slot * x + fixed`` bytes of device memory besides its row pools (the
    GPU pools, engine-owned under SGLang, and the pinned host CPU pools are not counted).

    Every length is an ``int`` or an :class:`Affine` in ``x`` (e.g. SGLang's ``n_logical =
    ratio * x + page_size``); with constants only, ``per_slot`` is 0 and ``fixed`` is the total
    (the start-up check, :meth:`AddressSpace._check_memory`). Word and superblock rounding is
    bounded from above, and the sums are rounded up once, so the figure is >= what is
    allocated and exceeds it by less than ``x`` bytes plus one superblock of policy words per
    bucket row (``tests/test_sizing.py`` measures both on real objects).

    Counted, per selection group (:class:`~ulacache.group.SelectionGroup`): the mapping ``loc
    int32 [n + 1]``, ``gpu_owner int32 [G + 1]``, the shadow table ``int32 [G + 1]``,
    ``cpu_top`` and the reclaim cursor (the CPU free stack is host memory,
    :func:`host_table_bytes`; there is no CPU reverse map), the policy over ``G`` slots (PB-LRU:
    ``int16`` stamps, 4 B a slot, and bucket bitmaps; its bucket tables may be stacked in one
    arena per address space: the same bytes); per rank: PB-LRU's byte tables (one pair per
    device, shared by every policy); per address space: the shared claim table ``int32 [n + 1]``
    and the counter table ``int64 [groups, 16]``. With ``tp`` (per group,
    :class:`~ulacache.buffer.LocalBuffer`): the map ``int32 [16 ceil(B / 4)]`` (a hash table
    sized by the buffer, :mod:`ulacache.bufmap`), ``holder int64 [B + 1]``, a policy over ``B``
    slots; per rank: the gate counters ``int64 [groups, 9]`` and the CUDA peer pointer tables
    ``int64 [layers, ranks]`` (nothing over the global addresses: the buffers dedup a call by
    sorting it, the fused gates in a hash sized by the call). The fused path's per-call
    scratch, allocated once for ``call_capacity`` entries (``G + CALL_FLOOR``, TP ``B +
    CALL_FLOOR``; ``call_entries`` when given): per address space 28 B an entry plus three ``int32``
    per-block counts, and 8 B per group (the stack pointer K3 hands K4); TP adds this rank's
    ``int32`` rows of a plan, one gates call's 32 B an entry and, per group, the gates' plan,
    12 B an entry (:func:`call_scratch_bytes`; ``call_scratch=False`` leaves it out: the torch
    path). ``prefetch`` (:class:`ulacache.prefetch.PrefetchEngine`): the prefetches' own claim
    table ``int32 [n + 1]``, their fused scratch (one access scratch of the same capacity,
    shared by the groups) and the per-group budgets ``int64 [groups]``. ``deferred_moves`` (the
    ``shared_groups`` source): the move list ``int32 [3, call_capacity]``, one per address
    space.
    Not counted: host mirrors of the counters.
    """
    n, G = Affine.of(n_logical), Affine.of(gpu_slots)
    group = (4 * (n + 1) + 4 * (G + 1) + 4 * (G + 1) + 8 + 8
             + _policy_bytes(policy, G, n_buckets))
    total = groups * group + 4 * (n + 1) + groups * len(COUNTERS) * 8
    if policy == "pblru":
        total = total + BYTE_TABLE_BYTES
    if tp is not None:
        from .tp import TP_COUNTERS  # tp imports this module

        B = tp.buffer_slots
        buffer = map_bytes(B) + 8 * (B + 1) + _policy_bytes(policy, Affine.of(B), n_buckets)
        total = (total + groups * buffer + groups * len(TP_COUNTERS) * 8
                 + tp.layers * tp.ranks * 8)
    cap = (G if tp is None else Affine.of(tp.buffer_slots)) + CALL_FLOOR \
        if call_entries is None else Affine.of(call_entries)
    if call_scratch:
        total = total + call_scratch_bytes(groups, cap, tp is not None)
    if prefetch:
        total = total + 4 * (n + 1) + 8 * groups
        if call_scratch:
            total = total + call_scratch_bytes(groups, cap, False)
    if deferred_moves:
        total = total + 12 * cap
    return math.ceil(total.per), math.ceil(total.fixed)


def call_scratch_bytes(groups: int, capacity: int | Affine, tp: bool) -> Affine:
    """Device bytes of the fused path's per-call scratch for calls of ``capacity`` entries
    (``kernels.fused_access.Scratch``, allocated once at construction): the address space's
    access scratch (local, phys, victim ``int64``, status ``int32``: 28 B an entry) with three
    ``int32`` counts per 128-entry block, and each group's ``int64`` stack-pointer snapshot;
    TP: this rank's ``int32`` rows of a plan, one gates call's scratch shared by the groups
    (status ``int32``, victim ``int64``, claim-hash index ``int32``, and the claim hash, two
    ``int32`` rows of twice the entries: 32 B an entry, the same per-block counts) and every
    group's plan (three ``int32``: 12 B an entry). Block rounding bounded from above."""
    blocks = Affine.of(capacity).ceil_div(128)
    entries = 128 * blocks
    total = 28 * entries + 12 * blocks + 8 * groups
    if tp:
        total = (total + 4 * Affine.of(capacity) + 32 * entries + 12 * blocks
                 + groups * 12 * entries)
    return total


def table_bytes_per_slot(groups: int, *, ratio: int, page_size: int,
                         n_buckets: int = DEFAULT_BUCKETS,
                         policy: str = "pblru", tp_size: int = 1, buffer_slots: int = 0,
                         layers: int = 0, call_scratch: bool = True,
                         call_entries: int | None = None, prefetch: bool = False,
                         deferred_moves: bool = False, dcp: bool = False) -> tuple[int, int]:
    """:func:`table_bytes` of the geometry an engine builds from its GPU token count ``x``
    (SGLang's ``max_total_num_tokens``): ``(per_slot, fixed)`` device bytes per rank.

    DP (``tp_size`` 1): an :class:`AddressSpace` with ``gpu_slots = x``, ``cpu_slots = (ratio -
    1) x`` and ``n_logical = ratio x + page_size`` (``ratio`` = logical tokens per GPU slot,
    ``1 + cpu_ratio``). TP (``tp_size`` P): ``x`` is the group's global GPU token count; each
    rank holds ``x / P`` own GPU slots, ``(ratio - 1) x / P`` CPU slots, a local address space
    over ``ceil((ratio x + page_size) / P)`` positions, and ``buffer_slots`` buffer rows per
    group over the global addresses (:class:`ulacache.tp.TPAddressSpace`; ``layers`` sizes its
    peer pointer tables). ``dcp`` (TP with ``tp_attention`` ``"dcp"``,
    :class:`ulacache.stripe.StripeAddressSpace`): the same stripe, no buffer: each rank's
    tables are the DP core's over its stripe.
    """
    buffered = tp_size > 1 and not dcp
    if tp_size < 1 or ratio < 1 or buffered != (buffer_slots > 0) or (dcp and tp_size < 2):
        raise ConfigError(f"table_bytes_per_slot: ratio {ratio} and tp_size {tp_size} must be "
                          f">= 1, with buffer_slots ({buffer_slots}) > 0 exactly in buffered "
                          f"TP mode (dcp: {dcp}, which needs tp_size >= 2)")
    P = Fraction(tp_size)
    x = Affine(Fraction(1))
    n_global = ratio * x + page_size
    tp = TPTables(n_global, buffer_slots, tp_size, layers) if buffered else None
    return table_bytes(groups, n_logical=n_global.ceil_div(tp_size),
                       gpu_slots=x * (1 / P),
                       n_buckets=n_buckets, policy=policy, tp=tp, call_scratch=call_scratch,
                       call_entries=call_entries, prefetch=prefetch,
                       deferred_moves=deferred_moves)


def coordinator_output_bytes(groups: int, slots: int, top_k: int, draft_tokens: int,
                             draft_prefetch: bool = False) -> int:
    """Device bytes of the SGLang coordinator's graph-stable outputs
    (``patches/sglang_coordinator.py``): ``int32 [slots x steps, top_k]`` rows per selection
    group and ``int64 [slots x steps]`` row ids, ``steps = max(1, draft_tokens)``; ``slots``
    counts SGLang's request slots including its padding row. ``draft_prefetch``: the draft
    source's buffers, ``int64 [slots, top_k]`` per group (:class:`ulacache.prefetch.
    DraftTokens`)."""
    rows = slots * max(1, int(draft_tokens))
    drafts = groups * slots * int(top_k) * 8 if draft_prefetch else 0
    return groups * rows * int(top_k) * 4 + rows * 8 + drafts
