"""DCP TP mode: each rank attends over its own stripe of a TP group's address space.

Address ``t`` lives on rank ``t mod P`` at local position ``t // P``, as in the buffered TP
mode (:mod:`ulacache.tp`), but no rank ever reads a peer's row: each rank attends *all* heads
over the selections it owns and returns a partial output with its log-sum-exp; the ranks merge
the partials (:func:`ulacache.oracle.refmodel.merge_partials`; SGLang:
``cp_lse_ag_out_rs_mla``). This is SGLang's decode context parallelism (``--dcp-size``,
docs/tp-over-dcp.md) with ulacache's tiers under each rank's stripe. So a rank is the DP core
over its ``ceil(n / P)`` local positions; there is no buffer, no gate and no peer gather, and
the per-step access exchanges nothing (each rank promotes the rows it owns).

What stays collective: host-checked calls (validate on, and ``write`` / ``read``) agree on one
verdict before any rank mutates (:func:`ulacache.striping.agree_verdict`), so every rank raises the
same typed error or none does; ``read`` (tests and tools) gathers rows from their owners.
Every rank passes the same global addresses to every call (SPMD), and an address a rank does
not own is padding there: never counted, never an error.
"""

from __future__ import annotations

import logging

import torch

from .address import local_position, owner_rank
from .config import UlaCacheConfig
from .errors import AddressError, ShapeError
from .group import check_distinct, count_distinct, distinct_addresses
from .pools import resolve_device
from .space import AddressSpace
from .striping import StripedSpace, owned_counts

logger = logging.getLogger(__name__)


class StripeAddressSpace(StripedSpace):
    """This rank's stripe of a TP group's address space ``[0, n_logical)``, attended in place.

    Parameters
    ----------
    config : ``tp_size`` = P, ``tp_attention`` ``"dcp"``; ``gpu_slots`` / ``cpu_slots`` are
        this rank's (per group, per layer).
    peers : the group (:mod:`ulacache.ipc`; only ``rank``, ``size``, ``all_gather`` and
        ``agree`` are used: no shared memory, no peer pointers).
    n_logical : global addresses (SGLang: its allocator's token count).
    layer_groups, gpu_storage, row_base : as for :class:`~ulacache.space.AddressSpace`, over
        this rank's local positions.
    """

    def __init__(self, config: UlaCacheConfig, peers, *, n_logical: int,
                 layer_groups: list[list[int]] | None = None,
                 gpu_storage: list[torch.Tensor] | None = None, row_base: int = 0):
        if config.tp_attention != "dcp" or peers.size != config.tp_size:
            raise ShapeError(f"the stripe space needs tp_attention 'dcp' and a peer group of "
                             f"tp_size ranks; got {config.tp_attention!r} and {peers.size} "
                             f"peers for tp_size {config.tp_size}")
        if isinstance(n_logical, bool) or not isinstance(n_logical, int) or n_logical < 1:
            raise ShapeError(f"n_logical must be a positive integer, got {n_logical!r}")
        self.config, self.peers = config, peers
        self.P, self.rank = config.tp_size, peers.rank
        self.device = resolve_device(peers.device)
        self.n_logical = n_logical
        self.n_local = -(-n_logical // self.P)
        self.gpu_slots = config.gpu_slots
        self.local = AddressSpace(config, self.device, n_logical=self.n_local,
                                  layer_groups=layer_groups, gpu_storage=gpu_storage,
                                  row_base=row_base)
        self.groups = self.local.groups
        self.layer_to_group = self.local.layer_to_group
        self.row_base = row_base
        logger.info("ulacache DCP rank %d/%d: %d local positions of %d addresses, %d GPU + %d "
                    "CPU rows per layer, no buffer", self.rank, self.P, self.n_local,
                    n_logical, config.gpu_slots, config.cpu_slots)

    # -- lookup ---------------------------------------------------------------------------
    def attn_rows(self, layer: int) -> torch.Tensor:
        """This rank's GPU rows of ``layer``, ``uint8 [G + 1, row_bytes]`` (its own slots and the
        scratch row): the rows :meth:`plan` returns index it after subtracting ``row_base``."""
        return self.local.gpu_rows(layer)

    gpu_rows = attn_rows

    # -- rounds ---------------------------------------------------------------------------
    def begin_round(self) -> None:
        """Advance every policy. No fence: no rank reads another's rows."""
        self.local.begin_round()

    def prefill_fits(self, seq_lens: list[int]) -> bool:
        """Whether every rank's own share of requests reaching these lengths fits its GPU
        pool (the same answer on every rank, from lengths alone)."""
        return max(owned_counts(seq_lens, self.P)) <= self.gpu_slots

    def stage_rows(self, seq_lens: list[int]) -> int:
        """Rows each rank's prefill stage needs for a batch of requests reaching these lengths,
        whatever they select: the largest rank's own share (:func:`owned_counts`; a rank
        stages only the rows it attends). The same on every rank, from lengths alone."""
        return max(owned_counts(seq_lens, self.P))

    def round_fits(self, addrs: torch.Tensor) -> bool:
        """Whether every rank's own distinct addresses of ``addrs`` fit its GPU pool in one
        fresh round. Collective and host-side: the ranks may pass different tables (each its
        own selections: the model masks its peers' as padding), so they agree on one answer
        and split a prefill into the same rounds (:func:`ulacache.prefill.round_spans`)."""
        flat = self.local.checked_addresses(addrs, "round_fits: addrs").reshape(-1)
        distinct = flat[flat >= 0].unique()
        own = int((owner_rank(distinct, self.P) == self.rank).sum())
        return self.peers.agree(own <= self.gpu_slots)

    def check_step_capacity(self, requests: int, steps: int, top_k: int) -> None:
        """Raise :class:`ConfigError` unless each rank's pool holds its share of one decode
        step's selections with the margin :func:`ulacache.striping.step_share_bound` gives
        (a step whose selections fall more unevenly still would overflow: counted as
        ``access_overflow``, served as padding)."""
        self._check_step_share(requests, steps, top_k)

    # -- placement and release --------------------------------------------------------------
    def check_place(self, addrs: torch.Tensor) -> None:
        """Raise (on every rank) what :meth:`place` would raise, changing nothing."""
        flat, inrange, mine, lpos = self._split(addrs, "place: addrs")

        def check():
            self._check_range(flat, inrange, "place")
            if flat[inrange].unique().numel() != int(inrange.sum()):
                raise AddressError("place: duplicate addrs")
            self.local.check_place(lpos)
        self._agree(check)

    def place(self, addrs: torch.Tensor) -> torch.Tensor:
        """New global addresses (distinct, unmapped): each owner gives its own a GPU slot in
        every group. ``int64 [n]`` local slots of group 0 (``-1``: not this rank's, or not
        placed)."""
        if self.validate:
            self.check_place(addrs)
        flat, inrange, _, lpos = self._split(addrs, "place: addrs")
        with self.stream.scope():
            slots = self.local.place(lpos)
            self._count_out_of_range(self.groups, flat, inrange)
        return slots

    def release(self, addrs: torch.Tensor) -> None:
        """Drop these addresses: each owner frees its rows in both tiers."""
        flat, inrange, _, lpos = self._split(addrs, "release: addrs")
        if self.validate:
            def check():
                self._check_range(flat, inrange, "release")
                if flat[inrange].unique().numel() != int(inrange.sum()):
                    raise AddressError("release: duplicate addrs")
            self._agree(check)
        with self.stream.scope():
            self.local.release(lpos)
            self._count_out_of_range(self.groups, flat, inrange)

    # -- data (host-checked: tests and tools) -------------------------------------------------
    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of one layer for live addresses (every rank passes the same rows; each owner
        stores its own). Collective: the ranks agree on the verdict before any writes."""
        gi = self._group_of(layer)
        flat, inrange, _, lpos = self._split(addrs, "write: addrs")
        g = self.groups[gi]

        def check():
            self._check_range(flat, inrange, "write")
            g.check_write(layer, lpos, rows)
        self._agree(check)
        with self.stream.scope():
            g.write(layer, lpos, rows)

    def gather(self, layer: int, addrs: torch.Tensor, dst: torch.Tensor,
               dst_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's own rows of ``addrs`` into ``dst`` at ``dst_rows`` (a prefill stage of
        the rows this rank attends), from whichever tier holds them, changing nothing;
        ``(from_cpu, gathered)`` as :meth:`ulacache.space.AddressSpace.gather`."""
        gi = self._group_of(layer)
        flat, inrange, mine, lpos = self._split(addrs, "gather: addrs")
        if self.validate and self.device.type != "meta":
            g = self.groups[gi]

            def check():  # only the owner can tell whether an address is live: agree first
                self._check_range(flat, inrange, "gather")
                g.check_read(lpos)
            self._agree(check)
        return self.local.gather(layer, lpos, dst, torch.where(mine, dst_rows.reshape(-1), -1))

    # -- the per-step sparse access -------------------------------------------------------
    def access(self, group: int, addrs: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """``int32 [bs, k]`` rows of :meth:`attn_rows` for this rank's own selections (every
        CPU-resident one promoted), ``-1`` for its peers' and for padding (validate off: also
        invalid or overflowed ones). Exchanges nothing; validate on, the ranks agree on the
        verdict first. The fused path runs the DP kernels over the global addresses with the
        stripe (four launches, no host sync, graph-safe)."""
        g = self.local.group(group)
        if not isinstance(addrs, torch.Tensor) or addrs.dim() != 2:
            raise ShapeError("access: addrs must be an int tensor [bs, k]")
        if self.validate:
            flat, inrange, _, lpos = self._split(addrs, "access: addrs")

            def check():
                self._check_range(flat, inrange, "access")
                g.check_access(lpos.view(addrs.shape))
            self._agree(check)
        if g.fused is not None and addrs.numel() <= self.config.call_capacity:
            rows = out if out is not None and out.is_contiguous() else \
                torch.empty(addrs.shape, dtype=torch.int32, device=self.device)
            flat = self.local.checked_addresses(addrs, "access: addrs").reshape(-1)
            with self.stream.scope():
                g.fused.run(flat.contiguous(), place=False, out=rows, row_base=self.row_base,
                            stripe=(self.P, self.rank, self.n_logical), verdicts=False)
            if out is not None and rows is not out:
                out.copy_(rows)
                return out
            return rows
        flat, inrange, _, lpos = self._split(addrs, "access: addrs")
        with self.stream.scope():
            self._count_out_of_range([g], flat, inrange)
            return self.local.access(group, lpos.view(addrs.shape), out)

    plan = access  # the same call as the buffered TP mode's plan; nothing to load per layer

    def load(self, layer: int) -> None:
        """Nothing to move per layer (no rank reads a peer's rows)."""
        self._group_of(layer)

    def distinct(self, table: torch.Tensor, size: int, first: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's own distinct global addresses of ``table`` (the rows it attends):
        ``(found`` ascending ``int64 [size]``, ``-1`` after them, ``n_distinct, n_bad)``;
        fixed shapes, no sync, no exchange."""
        table = self.local.checked_addresses(table, "distinct: table")
        with self.stream.scope():
            return distinct_addresses(self.local.claim_table, table, size, first=first,
                                      piece=self.config.call_capacity,
                                      stripe=(self.P, self.rank, self.n_logical))

    def access_distinct(self, group: int, table: torch.Tensor, first: int = 0) -> None:
        """One access of this rank's own distinct addresses of a large ``table`` (a prefill
        page table; ``-1`` and addresses below ``first`` are padding), at most ``gpu_slots``
        (what :meth:`prefill_fits` admits); beyond, rows stay put and are counted as
        ``access_overflow`` (validate off) or every rank raises (validate on). Read the rows
        with :meth:`translate`."""
        size = min(self.gpu_slots, table.numel())
        found, n_distinct, bad = self.distinct(table, size, first)
        if self.validate:
            self._agree(lambda: check_distinct(bad, n_distinct, self.gpu_slots, self.n_logical,
                                               f"a GPU pool of {self.gpu_slots} own slots"))
        else:
            with self.stream.scope():
                count_distinct(self.groups[group].counters, bad, n_distinct, size)
        lpos = torch.where(found >= 0, local_position(found, self.P), -1)
        with self.stream.scope():
            self.local.access(group, lpos.view(1, -1))

    def translate(self, group: int, addrs: torch.Tensor) -> torch.Tensor:
        """Rows of :meth:`attn_rows` where own addresses are GPU-resident now (no side
        effects); ``-1`` elsewhere, peers' addresses included."""
        _, _, _, lpos = self._split(addrs, "translate: addrs")
        return self.local.translate(group, lpos).view(addrs.shape)

    # -- observability and invariants ------------------------------------------------------
    def counters(self) -> list[dict[str, int]]:
        """Per group: the DP core's counters of this rank's stripe."""
        return self.local.counters()

    def check_integrity(self, live: torch.Tensor | None = None) -> None:
        """This rank's DP invariants over its stripe. ``live``: ``bool [n_logical]`` of
        allocated global addresses."""
        self.local.check_integrity(None if live is None else self.local_live(live))
