"""ulacache's stand-in for SGLang's ``HiSparseDSATokenToKVPool``, one class for both modes:
``kv_buffer`` rows are the core's GPU rows.

The launch plan (:mod:`ulacache.patches.launch`) chooses the mode, once, at construction:

* ``"dp"``: the core is an :class:`~ulacache.space.AddressSpace` over SGLang's ``N`` GPU tokens;
* ``"tp"``: the ``P`` ranks of SGLang's attention-TP group (``get_dp_tp_group()``) stripe one
  address space (token ``t`` on rank ``t mod P`` at ``t // P``,
  :class:`~ulacache.tp.TPAddressSpace`); each rank holds ``G = N / P`` own GPU rows and a
  buffer of ``B`` rows of copies of peers' rows, in tensors its peers can map (POSIX shared
  memory on CPU, CUDA IPC on GPU). Every rank computes the same latent rows, so the owner
  stores its own tokens and every other rank its copy in the buffer slot the placement gave it.
* ``"dcp"``: the same stripe under SGLang's decode context parallelism (``--dcp-size P``, the
  attention-TP group): each rank attends all heads over its own rows and SGLang merges the
  partial outputs by log-sum-exp (:class:`~ulacache.stripe.StripeAddressSpace`). No buffer and
  nothing shared: the rows are a plain local tensor, as in DP mode; writes of peers' tokens
  land in the sink, and every row a rank returns is one of its own (``-1`` elsewhere).
  ``N`` keeps TP mode's meaning (the group's GPU tokens; a rank holds ``N / P``), so the
  allocator and index-K are TP mode's; the pool sets SGLang's ``dcp_replicated`` so that its
  write kernel takes ulacache's rows as they are (``memory_pool.py:4918-4941``).

From then on the pool, the allocator and the coordinator call only the core's declared
interface (:class:`ulacache.core.Core`). One tensor per selection group ``[L_g, R, 1,
kv_cache_dim]``, rows laid out by :class:`ulacache.layout.PoolRows` (``ula_rows``)::

    [0, P)                     padding sink (SGLang's page 0; dummy writes land here)
    [P, P + G)                 own GPU slot (row - P) of the layer's selection group
    P + G                      the core's scratch row
    [P + G + 1, ... + B)       TP: buffer slot, a copy of a peer's row
    [..., R)                   padding to a multiple of 64 rows (FlashMLA views 64-row pages)

Writes and the prefill page table are translated per selection group; SGLang's paged allocator
hands out the logical addresses, so the core keeps no ledger.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, unwrap_write_loc

from ulacache.config import SGLangOptions, UlaCacheConfig
from ulacache.core import Core
from ulacache.errors import ConfigError, StaleSelectionError
from ulacache.layout import PoolRows, RowLayout
from ulacache.prefill import PrefillStage
from ulacache.space import AddressSpace
from ulacache.streams import capturing
from ulacache.stripe import StripeAddressSpace
from ulacache.tp import TPAddressSpace

from . import sglang_tp_support as tps
from .launch import (
    TP_SIZES,
    LaunchPlan,
    chunked_prefill_size,
    layer_groups_from_skip,
    plan_being_built,
    sglang_options,
    tp_group,
)

logger = logging.getLogger(__name__)


def make_tp_peers(grp, device):
    """The peers of ``grp`` (a GroupCoordinator): :class:`~ulacache.ipc.ShmPeers` on CPU,
    :class:`~ulacache.ipc.CudaIpcPeers` on CUDA (handles and agreement over the gloo
    ``cpu_group``, per-step all-gathers on the device group). Collective: every rank
    constructs them together."""
    from ulacache.ipc import CudaIpcPeers, ShmPeers

    dev = torch.device(device)
    if dev.type == "cuda":
        return CudaIpcPeers(grp.cpu_group, device=dev,
                            collective=lambda out, inp: tps.all_gather_into(grp, out, inp))
    return ShmPeers(grp.cpu_group)


def require_dcp_group(grp) -> None:
    """Mode ``"dcp"``: SGLang's DCP group must be the striping group (``--dcp-size`` equal to
    the attention-TP size, DCP rank = the rank in it), or the partial outputs SGLang merges
    would not be the stripes ulacache serves."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    size, rank = int(par.attn_dcp_size), int(par.attn_dcp_rank)
    if size != int(grp.world_size) or rank != int(grp.rank_in_group):
        raise ConfigError(
            f"ulacache mode 'dcp' stripes over the attention-TP group ({grp.world_size} "
            f"ranks, this one {grp.rank_in_group}); SGLang's DCP group has {size} ranks (this "
            f"one {rank}): launch with --dcp-size equal to the attention-TP size")


@dataclass(frozen=True)
class TPMembership:
    """This pool's place in its striping group (TP mode): SGLang's ``group``
    (GroupCoordinator-like: ``world_size``, ``rank_in_group``, ``cpu_group``) and the ``peers``
    its rows are shared through."""

    group: Any
    peers: Any

    @property
    def size(self) -> int:
        return int(self.group.world_size)

    @property
    def rank(self) -> int:
        return int(self.group.rank_in_group)


class UlaCacheDSATokenToKVPool(HiSparseDSATokenToKVPool):
    """DSA latent pool whose rows are ulacache's GPU rows, in either mode (see the module
    docstring).

    Extra keyword arguments (tests and tools; SGLang passes none, the pool-building hook scopes
    the launch plan around its call): ``ulacache_plan`` (a :class:`LaunchPlan`);
    ``ulacache_options`` (shorthand: a plan from these options and this call's arguments);
    ``ulacache_top_k`` (sizes TP mode's buffer in such a plan; default 2048); TP mode's
    ``ulacache_tp_group`` (default ``get_dp_tp_group()``) and ``ulacache_peers`` (a
    :class:`ulacache.ipc.Peers` of the group; default :func:`make_tp_peers`; ``ulacache
    rehearse`` passes in-process peers on the meta device).
    """

    def __init__(self, size: int, page_size: int, kv_lora_rank: int, dtype: torch.dtype,
                 qk_rope_head_dim: int, layer_num: int, device: str, index_head_dim: int,
                 enable_memory_saver: bool, kv_cache_dim: int, start_layer: int | None = None,
                 end_layer: int | None = None, index_kpool: int = 1,
                 index_kpool_compress: bool = False, tail_extra_slots: int = 0,
                 max_running_requests: int | None = None,
                 skip_topk_layers: list[bool] | None = None, host_to_device_ratio: int = 2,
                 ulacache_plan: LaunchPlan | None = None,
                 ulacache_options: SGLangOptions | None = None, ulacache_top_k: int | None = None,
                 ulacache_tp_group=None, ulacache_peers=None):
        base = ulacache_plan or plan_being_built()
        opts = ulacache_options or (base.options if base is not None else sglang_options())
        grp = None
        if opts.mode in ("tp", "dcp"):  # the one place the mode is chosen
            from .plugin import verify_tp

            verify_tp(opts.mode)  # a launch whose hooks did not take effect stops here, loudly
            tps.require_topk_agreement()
            grp = ulacache_tp_group or tp_group()
            P = int(grp.world_size)
            if opts.mode == "dcp" and ulacache_tp_group is None:
                require_dcp_group(grp)
            if P not in TP_SIZES or page_size % P or size % P:
                raise ConfigError(
                    f"ulacache {opts.mode.upper()} mode stripes over the attention-TP group: its "
                    f"size must be one "
                    f"of {TP_SIZES} and divide the page ({page_size}) and the pool ({size} "
                    f"tokens); got {P} ranks")
        P = 1 if grp is None else int(grp.world_size)
        plan = base if base is not None and ulacache_options is None else LaunchPlan.standalone(
            opts, tp_size=P, top_k=ulacache_top_k, max_running_requests=max_running_requests,
            skip_topk_layers=base.skip_topk_layers if base is not None else None)
        if plan.tp_size != P:
            raise ConfigError(f"ulacache: the launch plan stripes over {plan.tp_size} rank(s), "
                              f"the pool's group has {P}")
        self.ula_plan, self.ula_options = plan, opts
        # SGLang passes skip_topk_layers only when it elides the shared layers' index-K (never
        # under HiSparse); otherwise the plan carries the model's pattern. Either way the
        # shared layers get no index-K: they never run the indexer (forward_mla.py:146-165)
        # and nothing on the HiSparse / ulacache path reads it; the sizing hook charges
        # anchors only (sglang_sizing.elided_index_k_bytes)
        if skip_topk_layers is None and plan.skip_topk_layers is not None:
            skip_topk_layers = list(plan.skip_topk_layers)
        self.ula_groups = layer_groups_from_skip(skip_topk_layers, layer_num, start_layer or 0)
        self.ula_tp = None if grp is None else \
            TPMembership(grp, ulacache_peers or make_tp_peers(grp, device))
        self.ula_rows = PoolRows(page_size, size // P, plan.buffer_slots)  # for _create_buffers
        self.ula_buffered = opts.mode == "tp"  # peers' rows copied into a shared buffer
        super().__init__(size, page_size, kv_lora_rank, dtype, qk_rope_head_dim, layer_num,
                         device, index_head_dim, enable_memory_saver, kv_cache_dim,
                         start_layer=start_layer, end_layer=end_layer, index_kpool=index_kpool,
                         index_kpool_compress=index_kpool_compress,
                         tail_extra_slots=tail_extra_slots,
                         max_running_requests=max_running_requests,
                         skip_topk_layers=skip_topk_layers,
                         host_to_device_ratio=host_to_device_ratio)
        if opts.mode == "dcp":
            # SGLang's MLA write localizes global slots (slot % P, slot // P) unless the pool
            # says its rows are resolved; ulacache's translation already did it
            self.dcp_replicated = True
        ratio = int(host_to_device_ratio)
        cfg = self.core_config(ratio, max_running_requests)
        self.core: Core = self._build_core(cfg, n_logical=size * ratio + page_size)
        self._prefill_round = [-1] * len(self.ula_groups)  # round of each anchor's last access
        self.current_layer_id = self.start_layer  # set by the forward_extend hook
        self.ula_stage = self._build_stage()
        self.staging = False  # set by the forward_extend hook for a staged prefill batch
        rows, rb = self.ula_rows, cfg.row_layout.row_bytes
        logger.info(
            "ulacache pool (%s%s): %d selection group(s) x %d layers; GPU %d own slots + %d "
            "buffer rows, %d rows per layer x %d B (%.2f GiB); CPU %d slots (%.2f GiB pinned "
            "host); logical/indexer capacity %d tokens", plan.mode,
            f", rank {self.ula_tp.rank}/{P}" if self.ula_tp else "", len(self.ula_groups),
            layer_num, rows.gpu_slots, rows.buffer_slots, rows.total, rb,
            rows.total * layer_num * rb / 2**30, cfg.cpu_slots,
            cfg.cpu_slots * layer_num * rb / 2**30, size * ratio)

    def core_config(self, host_to_device_ratio: int,
                    max_running_requests: int | None) -> UlaCacheConfig:
        """The core's configuration for this pool: rows in SGLang's store format, the own GPU
        slots of ``ula_rows`` and ``(ratio - 1)`` times as many CPU slots per group and layer,
        the ``--ulacache-config`` options; TP mode adds ``tp_size``, ``buffer_slots`` and
        ``shard_indexer``."""
        row = RowLayout.of_size(self.kv_cache_dim * torch._utils._element_size(self.store_dtype))
        opts, rows = self.ula_options, self.ula_rows
        gpu_slots = rows.gpu_slots
        tp = {} if self.ula_tp is None else dict(
            tp_size=self.ula_plan.tp_size, buffer_slots=rows.buffer_slots,
            shard_indexer=opts.shard_indexer) if self.ula_buffered else dict(
            tp_size=self.ula_plan.tp_size, tp_attention="dcp")
        return UlaCacheConfig(
            layout=row.name, row_bytes=row.row_bytes if row.name == "tiny" else None,
            n_layers=self.layer_num, gpu_slots=gpu_slots,
            cpu_slots=(int(host_to_device_ratio) - 1) * gpu_slots, page_size=self.page_size,
            max_requests=max(1, max_running_requests or 1), n_buckets=opts.n_buckets,
            policy=opts.policy, validate=opts.validate, access_path=opts.access_path,
            call_entries=opts.call_entries, shadows=opts.shadows, **tp)

    def _create_index_key_cache(self):
        """SGLang's index-K store (``memory_pool.py:5387``), or with TP ``stripe_index_k``
        this rank's ``1/P`` of it (:class:`~.sglang_index_stripe.StripedIndexKeyCache`)."""
        if self.ula_tp is None or not self.ula_options.stripe_index_k:
            return super()._create_index_key_cache()
        from .sglang_index_stripe import StripedIndexKeyCache

        return StripedIndexKeyCache(self, self.index_buf_size, self.ula_tp.group)

    @property
    def page_classes(self) -> int:
        """Page classes the logical allocator must draw by position (index-K striped by page
        over the group's ``P`` ranks: a request's ``k``-th page from class ``k mod P``,
        :mod:`~.sglang_page_classes`); 0: any order."""
        return self.ula_tp.size if self.ula_tp is not None and \
            self.ula_options.stripe_index_k else 0

    def pages_cycle(self) -> None:
        """Told by a page-classed allocator: every request's pages cycle through the ranks, so
        the striped index-K's decode tables are ``ceil(W / P)`` pages wide."""
        self.index_key_cache.stripe.pages_cycle = True
        logger.info("ulacache: logical pages drawn by page class (a request's k-th page from "
                    "class k mod %d): index-K decode tables 1/%d as wide", self.page_classes,
                    self.page_classes)

    def _create_buffers(self) -> None:
        """One ``uint8 [L_g, R, row_bytes]`` tensor per selection group, so a group's layers
        move in one launch; ``kv_buffer[layer]`` is its ``[R, 1, kv_cache_dim]`` view in the
        store dtype. DP: in SGLang's memory-saver region and custom pool, with the prefill
        stage's one layer of rows when the plan has one (DP and DCP); TP: allocated by the
        peers, which can map it."""
        rb = self.kv_cache_dim * torch._utils._element_size(self.store_dtype)
        R = self.ula_rows.total
        self._ula_storage: list[tuple[str, torch.Tensor]] = []
        self._stage_storage = self._stage_buffer = None
        if not self.ula_buffered:  # DP and DCP: a local tensor (nothing for peers to map)
            saver = getattr(self, "memory_saver_adapter", None)
            pool = getattr(self, "custom_mem_pool", None)
            from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

            S = PoolRows(self.page_size, self.ula_plan.stage_tokens).total \
                if self.ula_plan.stage_tokens else 0
            with saver.region(GPU_MEMORY_TYPE_KV_CACHE) if saver is not None else nullcontext():
                with torch.cuda.use_mem_pool(pool) if pool else nullcontext():
                    for gi, g in enumerate(self.ula_groups):
                        self._ula_storage.append((f"kv_group{gi}", torch.zeros(
                            (len(g), R, rb), dtype=torch.uint8, device=self.device)))
                    if S:
                        self._stage_storage = torch.zeros((1, S, rb), dtype=torch.uint8,
                                                          device=self.device)
            if S:
                self._stage_buffer = self._stage_storage.view(self.store_dtype).view(
                    S, 1, self.kv_cache_dim)
        else:
            for gi, g in enumerate(self.ula_groups):
                name = f"kv_group{gi}"
                self._ula_storage.append(
                    (name, self.ula_tp.peers.alloc_shared(name, (len(g), R, rb), torch.uint8)))
        self._group_buffers = [t.view(self.store_dtype).view(t.shape[0], R, 1, self.kv_cache_dim)
                               for _, t in self._ula_storage]
        self.kv_buffer = [buf[i] for buf in self._group_buffers for i in range(buf.shape[0])]

    def _build_core(self, cfg: UlaCacheConfig, n_logical: int) -> Core:
        layer_ids = [[x - self.start_layer for x in g] for g in self.ula_groups]
        rows = self.ula_rows
        own = [t[:, rows.row_base: rows.row_base + rows.core_rows] for _, t in self._ula_storage]
        if self.ula_tp is None:
            return AddressSpace(cfg, self.device, n_logical=n_logical, layer_groups=layer_ids,
                                gpu_storage=own, row_base=rows.row_base)
        if not self.ula_buffered:
            return StripeAddressSpace(cfg, self.ula_tp.peers, n_logical=n_logical,
                                      layer_groups=layer_ids, gpu_storage=own,
                                      row_base=rows.row_base)
        return TPAddressSpace(cfg, self.ula_tp.peers, n_logical=n_logical,
                              layer_groups=layer_ids, storage=self._ula_storage,
                              row_offset=rows.row_base)

    def _build_stage(self) -> PrefillStage | None:
        """The prefill stage over the tensor :meth:`_create_buffers` allocated (``None``: mode
        ``"tp"``, or ``prefill_stage`` 0). DCP: this rank's, over its stripe, of its own share
        (:func:`~.launch.stage_tokens`); it stages the rows this rank attends and the ranks
        agree on its verdicts. Whether it may be used is :meth:`usable_stage`."""
        if self._stage_storage is None:
            return None
        self._stage_verdict: bool | None = None  # decided when the chunk size is known
        self._stage_unknown_noted = False  # the "chunk size unknown" warning, logged once
        return PrefillStage(self.core, self.ula_plan.stage_tokens, self._stage_storage,
                            row_base=self.page_size)

    def usable_stage(self) -> PrefillStage | None:
        """The prefill stage, when a staged batch's new tokens are sure to fit the pool:
        SGLang's resolved ``--chunked-prefill-size`` (read when first needed, since a launch
        resolves it after the pool is built) plus a page of rounding slack is at most the
        pool. ``None`` otherwise (chunked prefill off or not yet known: asked again next time;
        larger than the pool: off for good): every prefill batch must then fit the pool, as
        without a stage. DCP: the same rule against a rank's own pool, which is sound because
        a rank owns at most every token of a chunk, and cheap (a chunk of 8K against ~17K own
        slots per rank at GLM-5's 8xH200 launch). Every rank decides alike (the same chunk
        size and pool)."""
        stage = self.ula_stage
        if stage is None:
            return None
        if self._stage_verdict is None:
            chunk = chunked_prefill_size()
            G = self.core.config.gpu_slots
            if chunk is None:
                if not self._stage_unknown_noted:
                    self._stage_unknown_noted = True
                    logger.warning("ulacache: prefill stage unused while --chunked-prefill-size "
                                   "is off or unknown (a staged prefill places a whole chunk "
                                   "in the GPU pool of %d slots)", G)
                return None
            self._stage_verdict = chunk + self.page_size <= G
            if self._stage_verdict:
                logger.info("ulacache: prefill stage of %d rows (%.1f MiB, one layer): a "
                            "prefill batch longer than the GPU pool (%d slots; chunks of at "
                            "most %d) reads its selections from it", stage.capacity,
                            self._stage_storage.nbytes / 2**20, G, chunk)
            else:
                logger.warning("ulacache: prefill stage off: --chunked-prefill-size %d (+ a page "
                               "of rounding) exceeds the GPU pool (%d slots), which must hold a "
                               "staged prefill's chunk; every prefill batch must fit the pool",
                               chunk, G)
        return stage if self._stage_verdict else None

    def staged(self, seq_lens: list[int]) -> bool:
        """Whether a prefill batch of requests reaching these lengths is served through the
        stage: it has one and the batch does not fit one round of the pool. The allocator's
        admission and the forward_extend hook ask the same question of the same lengths."""
        return self.usable_stage() is not None and not self.core.prefill_fits(seq_lens)

    def get_key_buffer(self, layer_id: int):
        """``kv_buffer[layer]``, or while a staged prefill batch runs its attention, the stage
        (the page table :meth:`prefill_rows` returns then indexes it)."""
        if self.staging:
            return self._stage_buffer.view(self.dtype) if self.store_dtype != self.dtype \
                else self._stage_buffer
        return super().get_key_buffer(layer_id)

    def _clear_buffers(self) -> None:
        del self.kv_buffer, self._group_buffers, self._ula_storage
        self._stage_storage = self._stage_buffer = None

    def close_peers(self) -> None:
        """TP mode: release this rank's shared tensors (tests and shutdown; peers' mappings
        stay valid until their views die). DP mode: nothing shared."""
        if self.ula_tp is not None:
            self.ula_tp.peers.close()

    # -- translation ---------------------------------------------------------------------
    def register_mapping(self, full_to_hisparse_device_index_mapping: torch.Tensor) -> None:
        # The core keeps one mapping per selection group; a single table cannot describe them.
        self.full_to_hisparse_device_index_mapping = full_to_hisparse_device_index_mapping

    def group_index(self, layer_id: int) -> int:
        """The selection group of a global layer id."""
        return self.core.layer_to_group[layer_id - self.start_layer]

    def rows_of(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """``kv_buffer[layer]`` rows for writes of logical ``loc`` (int64, same shape): the GPU
        row of a resident address (TP: this rank's own row, or the buffer slot of its copy of
        a peer's token placed this round); row 0 (the sink) for padding (``-1``), the sink page
        and anything else. Pure: no side effect."""
        flat = loc.reshape(-1).to(torch.int64)
        ok = (flat >= self.page_size) & (flat < self.core.n_logical)
        rows = self.core.translate(self.group_index(layer_id), torch.where(ok, flat, -1))
        return torch.where(rows >= 0, rows.to(torch.int64), 0).view(loc.shape)

    def prefill_rows(self, layer_id: int, page_table: torch.Tensor) -> torch.Tensor:
        """Prefill page table of one layer (logical addresses, ``-1`` padded) -> its rows in
        ``kv_buffer[layer_id]``; ``-1`` stays ``-1`` and the sink page stays row 0.

        A staged batch (:meth:`staged`; the forward_extend hook sets ``staging``): every layer
        gathers the table's distinct rows into the stage, from either tier, and the table
        indexes the stage (:class:`ulacache.prefill.PrefillStage`); nothing in the pool moves.

        Otherwise it MUTATES on the group's anchor (first) layer: one access of the group on
        the table's *distinct* addresses (``core.access_distinct``: at most what the
        allocator's ``prefill_fits`` admitted, so a fixed-size call; TP: the ranks exchange
        those, not the table) promotes the selected rows that sit in the CPU tier, once per
        group and forward. Then every layer, the anchor included, translates the table
        without side effects. The group's other layers share the anchor's selection (SGLang's
        ``skip_topk``); a row that is not GPU-resident there means the anchor did not run
        this round: :class:`StaleSelectionError` with validate on, ``-1`` (never another
        token's row) with it off.

        The table (``T x top-k`` entries: 2^24 for an 8K chunk at top-k 2048) is read in
        pieces of the core's ``call_capacity`` entries, so no temporary grows with it.
        """
        if self.staging:  # a batch longer than the pool: its rows gathered, the pool as is
            rows = self.ula_stage.stage(layer_id - self.start_layer, page_table,
                                        first=self.page_size)
            sink = (page_table >= 0) & (page_table < self.page_size)
            return torch.where(sink, 0, rows).to(page_table.dtype)
        gi = self.group_index(layer_id)
        if layer_id - self.start_layer == self.core.groups[gi].layers[0]:
            self.core.access_distinct(gi, page_table, first=self.page_size)
            self._prefill_round[gi] = self.core.round_serial
        flat = page_table.reshape(-1)
        out = torch.empty_like(flat)
        piece = self.core.config.call_capacity
        for src, dst in zip(flat.split(piece), out.split(piece)):
            src = src.view(1, -1).to(torch.int64)
            sink = (src >= 0) & (src < self.page_size)
            slots = self._prefill_slots(gi, layer_id, torch.where(sink, -1, src))
            dst.copy_(torch.where(sink, 0, slots).view(-1))  # the core's rows, -1: none
        return out.view(page_table.shape)

    def _prefill_slots(self, gi: int, layer_id: int, addrs: torch.Tensor) -> torch.Tensor:
        """``kv_buffer`` rows (``int64 [1, m]``, ``-1``: none; the core adds ``row_base``) of
        one piece of a prefill table after its group's anchor access (checked with validate
        on: every live entry must be GPU-readable in this round)."""
        slots = self.core.translate(gi, addrs).to(torch.int64)
        if self.core.validate and not capturing(self.core.device):
            g = self.core.groups[gi]
            attended = addrs >= 0
            if self.ula_tp is not None and not self.ula_buffered:  # DCP: own rows only
                attended &= addrs % self.ula_tp.size == self.ula_tp.rank
            if self._prefill_round[gi] != self.core.round_serial or \
                    bool((attended & (slots < 0)).any()):
                raise StaleSelectionError(
                    f"layer {layer_id} shares selection group {gi}, whose anchor layer "
                    f"{g.layers[0] + self.start_layer} did not make these rows resident "
                    "in this round")
        return slots

    def translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        """SGLang's name (``dsa_backend.forward_extend``) for :meth:`prefill_rows` of the layer
        the ``forward_extend`` hook recorded. Not a pure translation: it promotes rows."""
        return self.prefill_rows(self.current_layer_id, compressed_indices)

    def _translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        return self.rows_of(self.current_layer_id, compressed_indices)

    def translate_loc_from_full_to_hisparse_device(self, full_indices: torch.Tensor):
        return self.rows_of(self.current_layer_id, full_indices)

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, layer_id_override=None):
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        DSATokenToKVPool.set_kv_buffer(self, layer, self.rows_of(layer_id, loc), cache_k,
                                       cache_v, layer_id_override=layer_id_override)

    def set_mla_kv_buffer(self, layer, loc_info, cache_k_nope, cache_k_rope,
                          layer_id_override=None):
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        DSATokenToKVPool.set_mla_kv_buffer(self, layer, self.rows_of(layer_id, loc),
                                           cache_k_nope, cache_k_rope,
                                           layer_id_override=layer_id_override)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        self.current_layer_id = layer.layer_id
        rows = self.translate_loc_to_hisparse_device(loc)
        return DSATokenToKVPool.get_mla_kv_buffer(self, layer, rows, dst_dtype)

    def transfer_values_on_device(self, dst_indices, src_indices) -> None:
        raise NotImplementedError("ulacache keeps speculative tokens in place; stock HiSparse's "
                                  "slot-to-slot commit copy is never needed")
