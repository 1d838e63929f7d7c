"""Unique history capacity and admissible concurrency: SGLang resident, HiSparse, ulacache.

ACCOUNTING, NOT MEASUREMENT: every figure is arithmetic on the inputs below (row sizes, layer
counts, memory budgets, weight sizes); nothing is allocated or timed.

Systems, on P = 8 GPUs (per rank ``D`` bytes of GPU KV budget, ``H_host`` bytes of host budget;
``lat`` = latent bytes per token over all layers, ``idx`` = index-K bytes per token):

- **SGLang resident** (stock pool, SGLang's own cell ``lat + idx``): DP8 (attention data
  parallel, each rank its own requests) and TP8 (the MLA latent and the index keys replicated on
  every rank, so 1/P of the allocation is unique).
- **HiSparse** (stock, ``host_to_device_ratio`` x): a device pool of ``G`` slots sized by
  SGLang's cell ``lat + idx * x`` (index-K for every logical token on the GPU), an inclusive host
  mirror of ``x G`` tokens (every token's latent on the host), per-request device buffers of
  ``device_buffer_size + page`` slots carved from the device pool. Unique = ``x G``. Under pure
  TP8 every rank holds the same pools (replicated). SGLang 0.5.23 charges HiSparse nothing
  beyond that cell (no fixed overhead), so ``G`` is the pool a user gets.
- **ulacache DP** (exclusive tiers, ``cpu_ratio`` c): ``G`` GPU + ``c G`` CPU latent rows, each
  token in exactly one. SGLang's cell as the sizing hook makes it (``patches/sglang_sizing.py``):
  ``lat + idx * (1 + c) + T``, ``T`` = ulacache's own device tables per GPU slot (mapping,
  owners, free stacks, claim table, PB-LRU state: :func:`ulacache.sizing.table_bytes_per_slot`
  itself, 64 buckets, one selection group per layer: neither preset shares top-k); fixed: the
  tables' fixed bytes + the pool's tail page (``64 x lat``) + the coordinator's output rows
  (below) + the prefill stage (``prefill_stage`` null, the default: one layer of
  ``context_len`` rows, ``PoolRows`` layout). Unique = ``(1 + c) G``. One decode step's
  selections must fit the GPU pool: ``R x draft x (top_k + 1) <= G``. A prefill longer than
  the pool reads its selections from the stage, so the pool holds only a chunk's new tokens
  (SGLang's ``--chunked-prefill-size``, :attr:`Platform.chunk`). **ulacache DP (stage 0)**:
  the same without the stage; every prefill batch must fit the pool.
- **ulacache TP** (``patches/sglang_tp_support.py``): one address space striped over the 8
  ranks; per rank per global GPU token ``ceil(lat / P)`` plus index-K ``idx * (1 + c)``
  (replicated) or ``/ P`` (``stripe_index_k``: striped by page, three pages per indexer layer
  fixed) plus the rank's tables
  per global token (``table_bytes_per_slot`` in TP mode: its stripe's tables; nothing over
  the global addresses); fixed: the tables' fixed bytes (buffer maps,
  holders and PB-LRU state over ``B`` slots per group) + ``(B + 128) x lat`` (sink page,
  scratch, ``B`` buffer rows, padding to a page, per layer) + the coordinator's output rows (below),
  ``B = R x draft x (top_k + 1)`` rows (raised to a prefill's peer share ``S - ceil(S / P)``
  when that is larger, else the prefill is refused).
- **ulacache coordinator output rows** (both modes, fixed, as the sizing hook charges them):
  :func:`ulacache.sizing.coordinator_output_bytes` itself, ``groups x (R + 1) x steps x top_k x
  4 + (R + 1) x steps x 8`` bytes per rank (``int32 [top_k]`` per selection group and an
  ``int64`` id per row, ``steps = max(1, draft)``, ``R + 1`` request slots: padding row
  included). ``R`` is ``--max-running-requests`` per attention worker (per rank in DP8, per
  group in TP8): ``Inputs.running`` (``--running``, 64) in the capacity columns; in the
  concurrency columns the admitted count itself (a launch admitting ``R`` requests per worker
  needs ``--max-running-requests >= R``), so, like the TP buffer, the charge grows with ``R``.

Device memory SGLang does not charge (it comes out of the ``1 - mem_fraction_static``
headroom; ``uncharged_gpu_bytes`` in the JSON, per GPU, beyond what stock resident SGLang
allocates uncharged too): HiSparse's logical-to-device mapping (``int64`` per logical token) and
logical page list, and its coordinator's per-request-slot tables (per layer ``D + 64`` slots of
two ``int32`` maps and ``D`` ``int16`` LRU entries, a host map over the context length);
ulacache's logical page list (``int64`` per logical page).

Ratios (x, c) are integers, as the launch flags, within the host budget. Two prefill rules,
side by side (``prefill_rules`` in the JSON):

- *whole* (HiSparse, ulacache TP, ulacache DP with stage 0): the GPU pool holds one request of
  the longest length (its prefill is written there before HiSparse backs it up / ulacache
  spills it, and its attention may select any of its tokens in that round);
- *staged* (ulacache DP, the default): the pool holds a chunk and, in the capacity columns, one
  decode step of the longest requests the system is full of (``draft x (top_k + 1) x
  floor((1 + c) G / S) <= G``).

Capacity columns take the ratio with the most unique tokens under the system's rule; each
concurrency column takes the ratio that admits the most requests of that length (in the JSON).

Also printed: the paper's two capacity figures (UlaCache §2.2.1, Figure 2) recomputed:
12.5% unique at TP8, and HiSparse's 30.0M unique tokens in 53.3M slots (56.29%).

The table, plot and options: ``python bench/capacity.py`` (its command line); ``ulacache
replay`` prints the GLM-5 FP8 rows of 8xH200 and 8xB300 from :func:`run` too.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from functools import cache, cached_property

from ulacache.config import SGLangOptions
from ulacache.layout import PoolRows
from ulacache.oracle.refmodel import ModelGeometry
from ulacache.sizing import CPU_FREE_STACK_BYTES, coordinator_output_bytes, table_bytes_per_slot
from ulacache.striping import step_share_bound

logger = logging.getLogger(__name__)

GB = 10**9  # decimal: vendors' HBM sizes and the paper's host budgets are in GB
LENGTHS = (32768, 65536, 131072)  # 32K, 64K, 128K history tokens per request
PAGE = 64  # SGLang's DSA page size: pools are rounded down to whole pages
MAX_RATIO = 1024  # highest host_to_device_ratio / cpu_ratio tried (ulacache's config bound)
ULA = SGLangOptions()  # ulacache's defaults under SGLang: 64 PB-LRU buckets


@dataclass(frozen=True)
class Platform:
    """Per-GPU memory budgets (GB). ``static_gb`` is what SGLang's ``mem_fraction_static`` gives
    weights + KV pools; the rest of HBM is left to activations and CUDA graphs."""

    label: str
    hbm_gb: float
    static_gb: float
    host_gb: float  # host memory for KV per GPU
    # SGLang's default --chunked-prefill-size for this GPU memory (arg_groups/memory_hook.py:
    # 139-167: 8K below 160 GB, 16K above): a prefill chunk's new tokens, placed in the pool
    chunk: int = 8192
    gpus: int = 8


PLATFORMS = {
    # 0.85 x 141 GB: docs/sglang.md's H200 launch flag; host 128 GB/GPU (1 TB/node): the paper's
    # H200 CPU budget
    "h200": Platform("8xH200", 141.0, 0.85 * 141.0, 128.0),
    # 272 GB for model + cache and 192 GB/GPU of host (1.5 TB/node): the paper's B300 budgets
    "b300": Platform("8xB300", 288.0, 272.0, 192.0, chunk=16384),
}

# FP8 checkpoints at ~1 B/parameter, sharded evenly over 8 GPUs (the same for DP- and TP-
# attention; DP attention's replicated attention weights are ignored): GLM-5 744B, DeepSeek-V3.2
# 685B (671B + 14B MTP).
# glm52: GLM-5's geometry and weights with GLM-5.2-style top-k sharing (SHARING)
WEIGHTS_GB = {"glm5": 744 / 8, "dsv32": 685 / 8, "glm52": 744 / 8}
MODELS = {"glm5": ("GLM-5", ModelGeometry.glm5), "dsv32": ("DeepSeek-V3.2",
                                                           ModelGeometry.deepseek_v32),
          "glm52": ("GLM-5.2-style", ModelGeometry.glm5)}
# max_position_embeddings (SGLang's context_len): sizes the request slots' per-token tables
CONTEXT_LEN = {"glm5": 202752, "dsv32": 163840, "glm52": 202752}
SHARING = {"glm52": (4, 3)}
"""Top-k sharing of a preset, ``(index_topk_freq, index_skip_topk_offset)`` as in its config:
:func:`indexer_layers` runs the indexer; every other layer reuses the previous layer's top-k
(SGLang's ``dsa_layer_skips_topk``). GLM-5.2-style, freq 4 and offset 3: 21 of 78 layers."""
SYSTEMS = ("sglang_dp", "sglang_tp", "hisparse_dp", "hisparse_tp", "ulacache_dp",
           "ulacache_dp_whole", "ulacache_tp_repl", "ulacache_tp_shard", "ulacache_dcp_shard")
LABELS = {"sglang_dp": "SGLang DP8", "sglang_tp": "SGLang TP8", "hisparse_dp": "HiSparse DP8",
          "hisparse_tp": "HiSparse TP8", "ulacache_dp": "ulacache DP8",
          "ulacache_dp_whole": "ulacache DP8 (stage 0)",
          "ulacache_tp_repl": "ulacache TP8 (idx repl)",
          "ulacache_tp_shard": "ulacache TP8 (idx stripe)",
          "ulacache_dcp_shard": "ulacache TP8 DCP (idx stripe)"}
FP8_ONLY = ("ulacache_dcp_shard",)
"""Systems served with fp8 KV only: mode "dcp" attends through FlashMLA's fp8 sparse decode
(``patches/sglang_dcp.py``; ``patches/server_args.py`` refuses ``--kv-cache-dtype bfloat16``)."""
TP_SYSTEMS = ("ulacache_tp_repl", "ulacache_tp_shard", "ulacache_dcp_shard")
"""The striped systems: ``(shard index-K, DCP)`` of each below (:func:`_tp_kind`)."""


def _tp_kind(system: str) -> tuple[bool, bool]:
    """``(index-K striped by page, attention by DCP: no buffer)`` of a striped system."""
    return system != "ulacache_tp_repl", system == "ulacache_dcp_shard"


def indexer_layers(n_layers: int, sharing: tuple[int, int] | None = None) -> list[int]:
    """The layers that run the indexer: all without ``sharing``; with ``(freq, offset)``, the
    first ``offset`` layers and then every ``freq``-th (layer ``l >= offset`` iff
    ``(l - offset) % freq == freq - 1``), the rule by which transformers' ``glm_moe_dsa``
    config derives ``indexer_types`` (checked against it in ``tests/test_capacity.py``)."""
    if sharing is None:
        return list(range(n_layers))
    freq, offset = sharing
    return [la for la in range(n_layers) if la < offset or (la - offset) % freq == freq - 1]


@dataclass(frozen=True)
class Inputs:
    """One configuration: geometry and layout, budgets per GPU (bytes), HiSparse/TP knobs."""

    model: str
    layout: str  # "fp8" (656 B rows) or "bf16" (1152 B rows)
    platform: str
    kv_bytes: int  # D: GPU bytes per GPU for KV pools (static budget - weights)
    host_bytes: int  # host bytes per GPU for KV
    gpus: int = 8
    device_buffer: int = 4096  # HiSparse device_buffer_size (default 2 x top_k)
    draft_tokens: int = 1  # tokens per request per step (1: no speculative decoding)
    # --max-running-requests per attention worker (per rank in DP8, per group in TP8) in the
    # capacity columns: sizes the ulacache coordinator's output rows (both modes) and the TP
    # buffer; the concurrency columns charge the admitted count instead
    running: int = 64
    min_gpu_tokens: int = max(LENGTHS)  # capacity columns: the GPU pool must hold one request
    chunk: int = 8192  # SGLang's --chunked-prefill-size (Platform.chunk)

    @cached_property
    def stage_tokens(self) -> int:
        """Rows of ulacache's DP prefill stage: the model's context length (``prefill_stage``
        null, the default)."""
        return CONTEXT_LEN[self.model]

    @cached_property
    def stage_bytes(self) -> int:
        """Device bytes of the stage per rank: one layer, laid out as the pool's rows
        (``sglang_sizing.stage_bytes``)."""
        return PoolRows(PAGE, self.stage_tokens).total * self.row

    @cached_property
    def dcp_stage_bytes(self) -> int:
        """Device bytes of a DCP rank's prefill stage: its own share of the longest request,
        ``ceil(context_len / P)`` rows of one layer (``launch.stage_tokens``)."""
        return PoolRows(PAGE, -(-self.stage_tokens // self.gpus)).total * self.row

    @property
    def dcp_least_pool(self) -> int:
        """The least group pool ``N`` a DCP launch serves every prompt with: the stage is used
        when a chunk and a page fit each rank's own ``N / P`` slots (``usable_stage``); a pool
        holding one longest request needs no stage."""
        return min(self.min_gpu_tokens, self.gpus * (self.chunk + PAGE))

    @cached_property
    def geometry(self) -> ModelGeometry:
        return MODELS[self.model][1](layout=self.layout)

    @cached_property
    def row(self) -> int:
        """Latent bytes per token per layer (656 fp8 / 1152 bf16)."""
        return self.geometry.row_bytes

    @cached_property
    def lat(self) -> int:
        """Latent bytes per token over all layers."""
        return self.geometry.n_layers * self.row

    @cached_property
    def idx(self) -> int:
        """Index-K bytes per token over all layers (132 B each): what SGLang 0.5.23 allocates
        and charges under HiSparse, shared-index layers included (``pool_configurator.py:
        592-597``)."""
        return self.geometry.n_layers * self.geometry.index_key_bytes

    @cached_property
    def anchors(self) -> int:
        """Layers that run the indexer: :data:`SHARING`'s pattern, else one per selection group
        of the geometry (every layer for glm5 and dsv32)."""
        sharing = SHARING.get(self.model)
        return self.geometry.n_groups if sharing is None else \
            len(indexer_layers(self.layers, sharing))

    @cached_property
    def idx_anchors(self) -> int:
        """Index-K bytes per token of the indexer layers only: what resident SGLang (its
        elision of shared layers' index-K, off under HiSparse only) and ulacache (the pool
        passes the sharing flags, the sizing hook charges anchors) allocate."""
        return self.anchors * self.geometry.index_key_bytes

    @cached_property
    def top_k(self) -> int:
        return self.geometry.index_topk

    @cached_property
    def layers(self) -> int:
        return self.geometry.n_layers

    @cached_property
    def groups(self) -> int:
        """ulacache's selection groups: one per indexer layer, each with the shared layers
        after it (what ``layer_groups_from_skip`` builds from SGLang's pattern)."""
        return self.anchors


def _pages(n: float) -> int:
    """Tokens rounded down to whole pages (SGLang's ``calculate_pool_sizes``), never negative."""
    return max(0, int(n) // PAGE * PAGE)


# -- per-rank pools --------------------------------------------------------------------------
def resident_pool(inp: Inputs) -> int:
    """SGLang's resident pool per rank (tokens): ``D // (lat + idx)`` (index-K of the indexer
    layers only: stock SGLang elides the shared layers' without HiSparse)."""
    return _pages(inp.kv_bytes // (inp.lat + inp.idx_anchors))


def hisparse_pool(inp: Inputs, x: int) -> int:
    """HiSparse device pool G per rank (tokens) at ``host_to_device_ratio`` x: SGLang's cell
    ``lat + idx * x``, capped so the host mirror ``x G lat`` fits the host budget."""
    gpu = inp.kv_bytes // (inp.lat + inp.idx * x)
    host = inp.host_bytes // (x * inp.lat)
    return _pages(min(gpu, host))


@cache
def _tables(groups: int, ratio: int, tp_size: int = 1, buffer_slots: int = 0,
            layers: int = 0, dcp: bool = False) -> tuple[int, int]:
    """ulacache's table bytes ``(per GPU slot, fixed)`` per rank: the SGLang sizing hook's own
    call (:func:`ulacache.sizing.table_bytes_per_slot`, the defaults of ``--ulacache-config``)."""
    return table_bytes_per_slot(groups, ratio=ratio, page_size=PAGE, n_buckets=ULA.n_buckets,
                                policy=ULA.policy, tp_size=tp_size, buffer_slots=buffer_slots,
                                layers=layers, dcp=dcp)


def coordinator_outputs(inp: Inputs, running: int | None = None) -> int:
    """Bytes per rank of the ulacache coordinator's graph-stable output rows, as the sizing hook
    charges them: :func:`ulacache.sizing.coordinator_output_bytes` for every selection group
    over ``running + 1`` request slots (``--max-running-requests`` per worker + SGLang's padding
    row; ``running`` defaults to ``inp.running``)."""
    r = inp.running if running is None else running
    return coordinator_output_bytes(inp.groups, r + 1, inp.top_k, inp.draft_tokens)


def ulacache_dp_charge(inp: Inputs, c: int, running: int | None = None,
                       staged: bool = True) -> tuple[int, int]:
    """``(cell, fixed)`` SGLang's configurator has under the sizing hook in DP mode at
    ``cpu_ratio`` c (``patches/sglang_sizing.py``): cell ``lat + idx (1 + c)`` (index-K for every
    logical token) + the tables per GPU slot; fixed: the tables' fixed bytes + the tail page +
    the coordinator's output rows for ``running`` requests (:func:`coordinator_outputs`) + the
    prefill stage when ``staged`` (:attr:`Inputs.stage_bytes`; ``prefill_stage`` 0: none)."""
    per, fixed = _tables(inp.groups, 1 + c)
    return (inp.lat + inp.idx_anchors * (1 + c) + per,
            fixed + PAGE * inp.lat + coordinator_outputs(inp, running)
            + (inp.stage_bytes if staged else 0))


def ulacache_tp_charge(inp: Inputs, c: int, buffer_rows: int, shard_index: bool = False,
                       running: int | None = None, dcp: bool = False) -> tuple[int, int]:
    """``(cell, fixed)`` per rank under the sizing hook in TP mode, per global GPU token:
    ``ceil(lat / P)`` + index-K (``idx (1 + c)``; ``ceil(/ P)`` when striped by page,
    ``stripe_index_k``) + the rank's tables; fixed: the tables' fixed bytes + ``(B + 2 x page)``
    rows per layer (sink page, scratch, ``B`` buffer rows, padding to a page) + the
    coordinator's output rows for ``running`` requests (:func:`coordinator_outputs`) + striped:
    three index-K pages per indexer layer (``patches/sglang_sizing.striped_index_k_charge``).
    ``dcp`` (mode "dcp"): no buffer (``buffer_rows`` must be 0), the stripe's DP tables and the
    rank's prefill stage (:attr:`Inputs.dcp_stage_bytes`; ``prefill_stage`` null, the
    default)."""
    P = inp.gpus
    per, fixed = _tables(inp.groups, 1 + c, P, buffer_rows, inp.layers, dcp)
    index = inp.idx_anchors * (1 + c)
    cell = math.ceil(inp.lat / P) + (math.ceil(index / P) if shard_index else index) + per
    return cell, (fixed + (buffer_rows + 2 * PAGE) * inp.lat
                  + coordinator_outputs(inp, running)
                  + (3 * PAGE * inp.idx_anchors if shard_index else 0)
                  + (inp.dcp_stage_bytes if dcp else 0))


def host_rows(inp: Inputs) -> int:
    """CPU-tier token rows (all layers) the host holds for one rank: its budget over the row
    size and the row's CPU free-stack entries (one ``int32`` per selection group, host memory:
    ``ulacache.sizing.host_table_bytes``), less the CPU pool's scratch row (``TierPools``
    allocates ``C + 1`` rows per layer and stack entries per group; ``ulacache rehearse`` found
    a pool that missed it by 9 KB on 8xB300)."""
    return max(inp.host_bytes // (inp.lat + CPU_FREE_STACK_BYTES * inp.groups) - 1, 0)


def ulacache_dp_pool(inp: Inputs, c: int, running: int | None = None,
                     staged: bool = True) -> int:
    """ulacache GPU pool G per rank (tokens) at ``cpu_ratio`` c: SGLang's
    ``(D - fixed) // cell`` under the sizing hook (:func:`ulacache_dp_charge`, ``running``
    requests per rank, the stage when ``staged``), capped so the CPU tier ``c G lat`` fits the
    host."""
    cell, fixed = ulacache_dp_charge(inp, c, running, staged)
    gpu = max(inp.kv_bytes - fixed, 0) // cell
    host = host_rows(inp) // c if c else gpu
    return _pages(min(gpu, host))


def ulacache_dp_launch(inp: Inputs, c: int, staged: bool = True) -> tuple[int, int, bool]:
    """What a DP launch at ``cpu_ratio`` c gets: ``(G, running, host_bound)``. ``running`` is
    the ``--max-running-requests`` per worker it can pass: :attr:`Inputs.running`, or fewer,
    the most whose decode step fits the pool charged for their output rows (the coordinator
    refuses to start otherwise: ``Core.check_step_capacity``). ``host_bound``: the host caps
    the pool below SGLang's budget, so the launch must pass ``--max-total-tokens G`` (SGLang
    sizes the pool from the GPU budget alone)."""
    step = inp.draft_tokens * (inp.top_k + 1)

    def fits(r: int) -> bool:  # the pool shrinks as r grows: one crossing
        return step * r <= ulacache_dp_pool(inp, c, r, staged)

    lo, hi = 0, inp.running  # fits(lo) (an empty step fits any pool)
    if fits(hi):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    running = lo
    g = ulacache_dp_pool(inp, c, running, staged)
    cell, fixed = ulacache_dp_charge(inp, c, running, staged)
    return g, running, g < _pages(max(inp.kv_bytes - fixed, 0) // cell)


def ulacache_tp_pool(inp: Inputs, c: int, buffer_rows: int, shard_index: bool,
                     running: int | None = None, dcp: bool = False) -> int:
    """ulacache TP: N, the group's global GPU tokens (each rank owns N / P): SGLang's
    ``(D - fixed) // cell`` under the sizing hook (:func:`ulacache_tp_charge`, ``running``
    requests), capped so each rank's ``c N / P`` CPU rows fit its host."""
    cell, fixed = ulacache_tp_charge(inp, c, buffer_rows, shard_index, running, dcp)
    avail = inp.kv_bytes - fixed
    if avail <= 0:
        return 0
    n = avail // cell
    if c:
        n = min(n, inp.gpus * (host_rows(inp) // c))  # each rank's CPU rows: c N / P
    return _pages(n)


def tp_buffer_rows(inp: Inputs, requests: int, history: int = 0, dcp: bool = False) -> int:
    """TP local-buffer rows per layer per rank: one step's selections and new tokens may all be
    peers' (``R x draft x (top_k + 1)``), raised to a prefill's peer share when larger; 0
    under DCP (no rank reads a peer's row)."""
    if dcp:
        return 0
    step = requests * inp.draft_tokens * (inp.top_k + 1)
    return max(step, history - math.ceil(history / inp.gpus))


# -- one system: capacity and concurrency ------------------------------------------------------
@dataclass
class Point:
    """One system's figures, system-wide (all 8 GPUs). Slots are latent rows (all layers)."""

    ratio: int | None
    unique: int  # unique history tokens the system can hold
    gpu_slots: int  # latent token rows on GPUs (TP buffer rows included: they are copies)
    cpu_slots: int  # latent token rows in host memory
    gpu_bytes: int  # GPU bytes SGLang's sizing charges (latent, index-K, buffers, tables,
    #                 coordinator output rows)
    host_bytes: int
    pool: int = 0  # SGLang's max_total_num_tokens per rank (G; ulacache TP: N)
    # gpu_bytes by component, system-wide: latent, index_k, tables (ulacache's per-slot tables
    # and call scratch), fixed (the tables' fixed part, tail page, TP buffer rows, coordinator
    # output rows); they sum to gpu_bytes
    components: dict = field(default_factory=dict)
    cell: int = 0  # bytes per GPU token SGLang's configurator charges (0: resident)
    table_cell: int = 0  # of which ulacache's tables
    running: int | None = None  # ulacache: the --max-running-requests per worker it charges
    host_bound: bool = False  # ulacache: the pool is capped by the host (--max-total-tokens)


def _split(P: int, tokens: int, latent: int, index: int, tables: int, fixed: int) -> dict:
    """System-wide GPU bytes by component for ``tokens`` GPU tokens per rank at these bytes
    per token (``fixed`` per rank)."""
    return {"latent": P * tokens * latent, "index_k": P * tokens * index,
            "tables": P * tokens * tables, "fixed": P * fixed}


def _ratios(first: int, pool, min_pool: int, ok=None):
    """Ratios ``first, first + 1, ...`` whose GPU pool holds ``min_pool`` tokens (and pass
    ``ok(r)`` when given). A pool only shrinks as the ratio grows (more index-K per GPU token,
    less host per row), and ``ok`` must turn false for good too, so stop at the first that does
    not."""
    for r in range(first, MAX_RATIO + 1):
        if pool(r) < min_pool or (ok is not None and not ok(r)):
            return
        yield r


def _pick(first: int, unique, pool, min_pool: int, ok=None) -> int:
    """The ratio with the most unique tokens (lowest on ties) among those whose GPU pool holds
    ``min_pool`` tokens (one longest request's prefill, or a chunk) and pass ``ok``; ``first``
    when none does."""
    return max(_ratios(first, pool, min_pool, ok), key=lambda r: (unique(r), -r),
               default=first)


def _best(points):
    """The (requests, ratio) with most requests, lowest ratio on ties."""
    return max(points, key=lambda p: (p[0], -(p[1] or 0)), default=(0, None))


def _most_requests(ratios, bound, fits) -> tuple[int, int | None]:
    """The most requests ``R`` with ``fits(R, c)`` over ``c`` in ``ratios`` and the lowest ratio
    that admits them (the first ratio when none admits one; ``(0, None)`` when there is none).
    ``bound(c)`` is an upper bound on ``R`` at ``c``; ``fits(R, c)`` must only turn false as
    ``R`` grows (the charges grow with ``R``: buffer rows, output rows), so a binary search
    finds the largest ``R``."""
    best, best_c = 0, None
    for c in ratios:
        if best_c is None:
            best_c = c
        hi = bound(c)
        if hi <= best or not fits(best + 1, c):  # this ratio cannot beat the best so far
            continue
        lo = best + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid, c) else (lo, mid - 1)
        best, best_c = lo, c
    return best, best_c


def capacity(inp: Inputs, system: str) -> Point:
    """Unique history capacity of ``system`` (ratio chosen for the most unique tokens)."""
    P = inp.gpus
    if system in ("sglang_dp", "sglang_tp"):
        n = resident_pool(inp)
        unique = P * n if system == "sglang_dp" else n  # TP: every rank holds the same tokens
        idx = inp.idx_anchors
        return Point(None, unique, P * n, 0, P * n * (inp.lat + idx), 0, n,
                     _split(P, n, inp.lat, idx, 0, 0), inp.lat + idx)
    if system in ("hisparse_dp", "hisparse_tp"):
        x = _pick(1, lambda r: r * hisparse_pool(inp, r),
                  lambda r: hisparse_pool(inp, r), inp.min_gpu_tokens)
        g = hisparse_pool(inp, x)
        unique = (P if system == "hisparse_dp" else 1) * x * g
        return Point(x, unique, P * g, P * x * g, P * g * (inp.lat + inp.idx * x),
                     P * x * g * inp.lat, g, _split(P, g, inp.lat, inp.idx * x, 0, 0),
                     inp.lat + inp.idx * x)
    if system in ("ulacache_dp", "ulacache_dp_whole"):
        staged = system == "ulacache_dp"
        step = inp.draft_tokens * (inp.top_k + 1)

        def pool(r: int) -> int:
            return ulacache_dp_launch(inp, r, staged)[0]

        if staged:  # the pool holds a chunk, and one step of the requests it is full of
            c = _pick(0, lambda r: (1 + r) * pool(r), pool, inp.chunk,
                      lambda r: step * ((1 + r) * pool(r) // inp.min_gpu_tokens) <= pool(r))
        else:  # the pool holds one longest request's prefill
            c = _pick(0, lambda r: (1 + r) * pool(r), pool, inp.min_gpu_tokens)
        g, running, host_bound = ulacache_dp_launch(inp, c, staged)
        cell, fixed = ulacache_dp_charge(inp, c, running, staged)
        per = _tables(inp.groups, 1 + c)[0]
        return Point(c, P * (1 + c) * g, P * g, P * c * g, P * (g * cell + fixed),
                     P * c * g * inp.lat, g,
                     _split(P, g, inp.lat, inp.idx_anchors * (1 + c), per, fixed), cell, per,
                     running, host_bound)
    if system in TP_SYSTEMS:
        shard, dcp = _tp_kind(system)
        b = tp_buffer_rows(inp, inp.running, dcp=dcp)
        step = inp.running * inp.draft_tokens * (inp.top_k + 1)

        def pool_tp(r: int) -> int:
            return ulacache_tp_pool(inp, r, b, shard, dcp=dcp)
        # each rank's own pool (N / P rows) holds its share of one decode step with the
        # margin for uneven steps (check_step_capacity of both striped spaces refuses to
        # start otherwise)
        need = step_share_bound(step, P)
        # the pool holds one longest request's prefill; DCP: or a chunk, through the stage
        least = inp.dcp_least_pool if dcp else inp.min_gpu_tokens
        c = _pick(0, lambda r: (1 + r) * pool_tp(r), pool_tp, least,
                  ok=lambda r: pool_tp(r) // P >= need)
        n = pool_tp(c)
        cell, fixed = ulacache_tp_charge(inp, c, b, shard, dcp=dcp)
        per = _tables(inp.groups, 1 + c, P, b, inp.layers, dcp)[0]
        lat = math.ceil(inp.lat / P)
        host_bound = n < _pages(max(inp.kv_bytes - fixed, 0) // cell)
        return Point(c, (1 + c) * n, n + P * b, c * n, P * (n * cell + fixed), c * n * inp.lat,
                     n, _split(P, n, lat, cell - lat - per, per, fixed), cell, per,
                     inp.running, host_bound)
    raise ValueError(f"unknown system {system!r}")


def max_requests(inp: Inputs, system: str, history: int) -> tuple[int, int | None]:
    """Largest number of concurrent requests of ``history`` tokens each, system-wide, and the
    ratio that admits it. DP: per-rank admission x P (a request lives on one rank). ulacache is
    charged for the admitted count itself (``--max-running-requests`` >= it per worker: the
    output rows, and in TP the buffer), not for ``inp.running``."""
    P, S = inp.gpus, history
    if system in ("sglang_dp", "sglang_tp"):
        n = resident_pool(inp)
        return (n // S) * (P if system == "sglang_dp" else 1), None
    if system in ("hisparse_dp", "hisparse_tp"):
        scale = P if system == "hisparse_dp" else 1
        pts = []
        # the prefill lands in the device pool before the host backup: the pool holds S
        for x in _ratios(1, lambda r: hisparse_pool(inp, r), S):
            g = hisparse_pool(inp, x)
            r = min(x * g // S, g // (inp.device_buffer + PAGE))  # buffers from the device pool
            pts.append((scale * r, x))
        return _best(pts)
    step = inp.draft_tokens * (inp.top_k + 1)  # GPU rows one request's decode step selects
    if system in ("ulacache_dp", "ulacache_dp_whole"):
        # per rank, with R running requests per rank charged: a prefill's new tokens (staged:
        # a chunk; else the whole request) fit the GPU pool in its round, R requests' history
        # fits both tiers, one step's selections the pool
        staged = system == "ulacache_dp"
        least = min(inp.chunk, S) if staged else S

        def fits_dp(r: int, c: int) -> bool:
            g = ulacache_dp_pool(inp, c, r, staged)
            return g >= least and r * S <= (1 + c) * g and r * step <= g

        def pool0(c: int) -> int:  # the least charge (no running request): an upper bound
            return ulacache_dp_pool(inp, c, 0, staged)

        r, c = _most_requests(_ratios(0, pool0, least),
                              lambda c: min((1 + c) * pool0(c) // S, pool0(c) // step), fits_dp)
        return P * r, c
    if system in TP_SYSTEMS:
        shard, dcp = _tp_kind(system)

        # a prefill fits each rank's own pool in one round; DCP: or a chunk, through the stage
        least = min(S, P * (inp.chunk + PAGE)) if dcp else S

        def fits(r: int, c: int) -> bool:
            n = ulacache_tp_pool(inp, c, tp_buffer_rows(inp, r, S, dcp), shard, r, dcp)
            own = n // P
            return r * S <= (1 + c) * n and math.ceil(least / P) <= own and \
                own >= step_share_bound(r * step, P)

        def pool_tp0(c: int) -> int:  # the least charge (no running request): an upper bound
            return ulacache_tp_pool(inp, c, tp_buffer_rows(inp, 0, S, dcp), shard, 0, dcp)

        return _most_requests(_ratios(0, pool_tp0, least),
                              lambda c: (1 + c) * pool_tp0(c) // S, fits)
    raise ValueError(f"unknown system {system!r}")


# -- device memory SGLang does not charge ------------------------------------------------------
def sglang_request_slots(inp: Inputs, tokens: int) -> int:
    """Request slots per rank (``req_to_token`` rows) of a launch without
    ``--max-running-requests`` (SGLang 0.5.23 ``KVCacheConfigurator.resolve_max_num_reqs``):
    ``tokens / context_len x 512`` clamped to 2048..4096, at most ``tokens // 2``; + slot 0."""
    est = max(min(int(tokens / CONTEXT_LEN[inp.model] * 512), 4096), 2048)
    return min(est, tokens // 2) + 1


def uncharged(inp: Inputs, system: str, ratio: int | None, tokens: int) -> dict | None:
    """Device bytes per GPU that SGLang's sizing does not charge (they come out of the
    ``1 - mem_fraction_static`` headroom), beyond what stock resident SGLang leaves uncharged
    too (``req_to_token``, its page list over the device pool): ``fixed + per_request_slot x
    request slots``. ``None`` for resident SGLang.

    HiSparse (``allocator/hisparse.py``, ``HiSparseCoordinator.__init__``): the mapping
    ``full_to_hisparse_device_index_mapping`` ``int64 [x G + page + 1]`` and the logical page
    list ``int64 [x G / page]``; per request slot ``req_device_buffer_tokens`` and ``_token_locs``
    ``int32 [L, D + page]`` each, ``lru_slots`` ``int16 [L, D]``, ``req_to_device_buffer``
    ``int64 [D + page]``, ``req_to_host_pool`` ``int64 [context + 4 + page]`` and two
    ``int32 [top_k]`` outputs, at SGLang's default request slots. ulacache
    (``patches/sglang_allocator.py``): the logical page list ``int64 [(1 + c) G / page]``, and
    nothing per request slot: the coordinator's output rows are charged by the sizing hook
    (:func:`coordinator_outputs`; ``request_slots`` reports the ``running + 1`` it charges);
    the fused path's per-call scratch is charged with the tables (allocated once, sized by
    ``call_capacity``).
    ``tokens``: SGLang's ``max_total_num_tokens`` (G; ulacache TP: N)."""
    if system.startswith("sglang"):
        return None
    logical = ratio * tokens if system.startswith("hisparse") else (1 + ratio) * tokens
    fixed = 8 * (logical // PAGE)
    if system.startswith("hisparse"):
        D, L = inp.device_buffer, inp.layers
        fixed += 8 * (logical + PAGE + 1)
        per_slot = (2 * 4 * L * (D + PAGE) + 2 * L * D + 8 * (D + PAGE)
                    + 8 * (CONTEXT_LEN[inp.model] + 4 + PAGE) + 2 * 4 * inp.top_k)
        slots = sglang_request_slots(inp, tokens)
    else:
        per_slot, slots = 0, inp.running + 1  # output rows: charged (coordinator_outputs)
    return {"fixed": fixed, "per_request_slot": per_slot, "request_slots": slots,
            "total": fixed + per_slot * slots}


# -- the paper's two figures -------------------------------------------------------------------
def paper_checks(static_gb: float = 272.0, weights_gb: float = WEIGHTS_GB["glm5"],
                 host_gb: float = 192.0) -> dict:
    """UlaCache §2.2.1 / Figure 2, recomputed. The configuration, from the notes: 8xB300, DP,
    no speculative decoding, GLM-5.3 at GLM-5 geometry (78 layers), FP8 KV (656 B rows), 272 GB
    per GPU for model + cache, 192 GB of host per GPU.

    (a) TP8 resident: every rank stores every token, so unique / allocated = 1/P.
    (b) HiSparse: CPU slots = the host budget at latent bytes (192 GB / (78 x 656 B) per GPU);
    GPU slots = the GPU KV budget (272 GB - 93 GB of FP8 weights) at SGLang's resident cell
    (latent + index-K, 61,464 B per token); unique = CPU slots (the GPU holds copies). The other
    reading (index-K for all 30.0M logical tokens charged on the GPU) is computed too: it gives
    22.0M GPU slots and does not reproduce 23.3M."""
    P = 8
    inp = Inputs("glm5", "fp8", "b300", int((static_gb - weights_gb) * GB), int(host_gb * GB))
    tp = capacity(inp, "sglang_tp")
    cpu = P * (inp.host_bytes // inp.lat)
    gpu = P * resident_pool(inp)
    alt_gpu = P * _pages((inp.kv_bytes - (cpu // P) * inp.idx) // inp.lat)
    rounded = round(cpu / 1e6, 1) / (round(cpu / 1e6, 1) + round(gpu / 1e6, 1))
    return {
        "tp8_unique_fraction": {"computed": tp.unique / tp.gpu_slots, "paper": 0.125},
        "hisparse_fig2b": {
            "cpu_slots": cpu, "gpu_slots": gpu, "unique": cpu,
            "unique_fraction": cpu / (cpu + gpu),
            "unique_fraction_from_rounded_millions": rounded,
            "paper": {"cpu_slots_M": 30.0, "gpu_slots_M": 23.3, "total_M": 53.3,
                      "unique_fraction": 0.5629},
            "alt_reading_gpu_slots": alt_gpu,
            "inputs": {"static_gb": static_gb, "weights_gb": weights_gb, "host_gb": host_gb,
                       "latent_B_per_token": inp.lat, "index_B_per_token": inp.idx},
        },
    }



# -- driver --------------------------------------------------------------------------------------
def _kv_list(text: str) -> dict[str, float]:
    """``"h200=120,b300=272"`` -> ``{"h200": 120.0, "b300": 272.0}``."""
    out = {}
    for part in filter(None, text.split(",")):
        key, _, val = part.partition("=")
        out[key.strip()] = float(val)
    return out


def run(*, platforms: str = "h200,b300", models: str = "glm5,dsv32",
        layouts: str = "fp8,bf16", lengths: tuple[int, ...] = LENGTHS, static_gb: str = "",
        host_gb: str = "", weights_gb: str = "", device_buffer: int = 4096,
        draft_tokens: int = 1, running: int = 64, systems: tuple[str, ...] = SYSTEMS) -> dict:
    """Every (platform, model, layout, system) row, the assumptions and the paper checks.
    ``platforms`` / ``models`` / ``layouts``: comma lists (keys of :data:`PLATFORMS`,
    :data:`MODELS`, ``fp8`` / ``bf16``); ``static_gb`` / ``host_gb`` / ``weights_gb``:
    overrides such as ``"h200=125"``; the rest as :class:`Inputs`."""
    static = {k: p.static_gb for k, p in PLATFORMS.items()} | _kv_list(static_gb)
    host = {k: p.host_gb for k, p in PLATFORMS.items()} | _kv_list(host_gb)
    weights = dict(WEIGHTS_GB) | _kv_list(weights_gb)
    lengths = tuple(lengths)
    rows = []
    for plat in platforms.split(","):
        for model in models.split(","):
            for layout in layouts.split(","):
                kv_gb = static[plat] - weights[model]
                inp = Inputs(model, layout, plat, int(kv_gb * GB), int(host[plat] * GB),
                             device_buffer=device_buffer, draft_tokens=draft_tokens,
                             running=running, min_gpu_tokens=max(lengths),
                             chunk=PLATFORMS[plat].chunk)
                logger.debug("%s %s %s: KV budget %.2f GB/GPU, host %.0f GB/GPU", plat, model,
                            layout, kv_gb, host[plat])
                for system in systems:
                    if system in FP8_ONLY and layout != "fp8":
                        continue  # not served: no row (what ships only)
                    cap = capacity(inp, system)
                    conc = {S: max_requests(inp, system, S) for S in lengths}
                    slots = cap.gpu_slots + cap.cpu_slots
                    rows.append({
                        "platform": plat, "model": model, "layout": layout, "system": system,
                        "ratio": cap.ratio, "unique_tokens": cap.unique,
                        "gpu_latent_slots": cap.gpu_slots, "cpu_latent_slots": cap.cpu_slots,
                        "unique_fraction": cap.unique / slots if slots else 0.0,
                        "gpu_kv_bytes": cap.gpu_bytes, "host_kv_bytes": cap.host_bytes,
                        "tokens_per_gpu_gb": cap.unique / (inp.gpus * kv_gb),
                        # resident pools use no host memory: no per-host-byte figure
                        "tokens_per_host_gb": (cap.unique / (inp.gpus * host[plat])
                                               if cap.host_bytes else None),
                        "max_requests": {str(S): r for S, (r, _) in conc.items()},
                        "ratio_at": {str(S): x for S, (_, x) in conc.items()},
                        # per GPU, at the capacity ratio (HiSparse: SGLang's default request
                        # slots)
                        "uncharged_gpu_bytes": uncharged(inp, system, cap.ratio, cap.pool),
                        # what each unique token costs on the GPU, by component, and the
                        # tables' share of the per-GPU-token cell
                        "gpu_bytes_by_component": cap.components,
                        "gpu_bytes_per_unique_token": {
                            k: v / cap.unique for k, v in cap.components.items()},
                        "cell_bytes": cap.cell, "table_bytes_per_gpu_token": cap.table_cell,
                        # ulacache: the launch this column is (ulacache rehearse replays it):
                        # SGLang's pool per rank (TP: the group's N), --max-running-requests
                        # per worker, and whether --max-total-tokens must cap the pool
                        "pool_tokens": cap.pool, "running": cap.running,
                        "host_bound": cap.host_bound,
                        "tables_fraction_of_cell": (cap.table_cell / cap.cell if cap.cell
                                                    else 0.0),
                    })
    assumptions = {
        "accounting": "arithmetic on the stated inputs, not measurement",
        "gb": "1e9 bytes", "gpus": 8, "page": PAGE, "lengths": list(lengths),
        "static_gb_per_gpu": static, "host_gb_per_gpu": host, "weights_gb_per_gpu": weights,
        "device_buffer_size": device_buffer, "draft_tokens": draft_tokens,
        "running_requests": running, "index_key_B": 132,
        "latent_row_B": {"fp8": 656, "bf16": 1152},
        "ulacache_tables": {"source": "ulacache.sizing.table_bytes_per_slot (the SGLang sizing "
                            "hook's charge)", "n_buckets": ULA.n_buckets, "policy": ULA.policy,
                            "selection_groups": "one per indexer layer (every layer for glm5 "
                            "and dsv32; 21 for glm52, SGLang's dsa_layer_skips_topk pattern "
                            "of index_topk_freq 4, offset 3)"},
        "index_k": "HiSparse: every layer (SGLang 0.5.23 under HiSparse); resident SGLang and "
                   "ulacache: the indexer layers only",
        "ulacache_coordinator_outputs": {
            "source": "ulacache.sizing.coordinator_output_bytes (charged by the sizing hook)",
            "request_slots": "running + 1 in the capacity columns, admitted R + 1 per worker "
                             "in the concurrency columns"},
        "context_len": CONTEXT_LEN,
        "prefill_rules": {
            "whole": "the GPU pool holds one request of the longest length (its prefill in one "
                     "round): HiSparse, ulacache TP8, ulacache DP8 with prefill_stage 0",
            "staged": "ulacache DP8 (prefill_stage null, the default): the pool holds a chunk "
                      "(SGLang's --chunked-prefill-size) and one decode step of the requests "
                      "it is full of; a one-layer stage of context_len rows is charged",
            "chunk": {k: p.chunk for k, p in PLATFORMS.items()}},
    }
    return {"assumptions": assumptions, "paper_checks": paper_checks(), "rows": rows}
