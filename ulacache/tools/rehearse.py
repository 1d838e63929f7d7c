"""``ulacache rehearse``: a launch rehearsal at production geometry, before renting 8 GPUs.

It builds what ``python -m sglang.launch_server --kv-backend ulacache`` builds on one GPU, through
the real code, on the ``meta`` device (tensors with shapes and no memory) under a byte ledger
(:class:`ulacache.tools.ledger.Ledger`):

1. SGLang 0.5.23's server arguments, parsed by the plugin's ``UlaServerArgs`` with
   ``--kv-backend ulacache`` (the plugin's hooks registered and applied as a launch does), and
   published;
2. SGLang's ``DefaultPoolConfigurator`` with ulacache's sizing hook, given the KV budget SGLang
   would measure (``mem_fraction_static x HBM - weights / GPUs``), picks the pool's token count;
3. ulacache's pool, allocator and coordinator over SGLang's ``ReqToTokenPool`` at that count (TP
   mode: every rank of the attention-TP group, each in its own thread over in-process peers on
   the meta device, so every collective runs);
4. the worst-case calls SGLang makes: the largest chunked prefill (its ``[1, T x top_k]``
   page table through every layer: an access of its distinct addresses, then a
   translation), a full decode batch, a speculative verify batch (with draft tokens), a
   finish and an abort.

Per GPU it reports SGLang's budget, what the sizing hook charged, every allocation ulacache made
at start-up (by owner and name), the transient peak of each call above that, and the headroom
left in the memory SGLang leaves outside its static pool (``(1 - mem_fraction_static) x HBM``);
exit status 1 names the allocation that does not fit.

What it does not count: SGLang's own activations, CUDA graphs and NCCL buffers (they share that
headroom; the report says how much is left for them), the caching allocator's rounding, and any
memory outside torch's allocator. Kernels are not launched (meta tensors have no data; a kernel
allocates nothing), so a value read on the meta device is answered 0 and listed in the report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import types
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from ulacache.errors import UlaCacheError
from ulacache.ipc import Peers

from .capacity import CONTEXT_LEN, GB, MODELS, PLATFORMS, WEIGHTS_GB
from .ledger import Ledger, reachable_storages

log = logging.getLogger(__name__)

CHUNKED_PREFILL = {"h200": 8192, "b300": 16384}
"""SGLang 0.5.23's default ``--chunked-prefill-size`` on these GPUs
(``sglang/srt/arg_groups/memory_hook.py``)."""
MODEL_KEYS = {"glm-5": "glm5", "deepseek-v3.2": "dsv32"}
MODEL_TYPES = {"glm5": "glm_moe_dsa", "dsv32": "deepseek_v32"}
ARCHITECTURES = {"glm5": "GlmMoeDsaForCausalLM", "dsv32": "DeepseekV32ForCausalLM"}
PAGE = 64
KV_DTYPES = {"fp8": (torch.float8_e4m3fn, "fp8_e4m3"), "bf16": (torch.bfloat16, "bfloat16")}
DEFAULT_RUNNING = 64
"""``--max-running-requests`` per attention worker when not given (the TP buffer needs one)."""


@dataclass(frozen=True)
class Plan:
    """One rehearsal: the launch flags that change what ulacache allocates."""

    model: str  # glm-5 | deepseek-v3.2
    gpu: str  # h200 | b300
    gpus: int = 8
    # dp (attention DP, one address space per GPU) | tp (striped over gpus, buffered) | dcp
    # (striped under SGLang's --dcp-size: no buffer)
    mode: str = "dp"
    ulacache_config: dict = field(default_factory=dict)
    draft_tokens: int = 0
    chunked_prefill_size: int | None = None
    max_running_requests: int | None = None  # SGLang's flag: over all DP workers
    mem_fraction_static: float | None = None  # default: the platform's (bench/capacity.py)
    prefill_layers: int = 0  # 0: the prefill's page table goes through every layer
    host_gb: float | None = None  # host memory for the CPU tier per GPU (default: platform's)
    max_total_tokens: int | None = None  # SGLang's cap on the pool's GPU tokens
    layout: str = "fp8"  # KV cache dtype: fp8 (SGLang's fp8_e4m3) | bf16

    @property
    def kv_dtype(self) -> tuple[torch.dtype, str]:
        """``(torch dtype, SGLang's --kv-cache-dtype)`` of the latent KV."""
        if self.layout not in KV_DTYPES:
            raise ValueError(f"layout must be one of {sorted(KV_DTYPES)}, got {self.layout!r}")
        return KV_DTYPES[self.layout]

    @property
    def mem_fraction(self) -> float:
        """``--mem-fraction-static``: given, else the platform's static share of HBM that
        ``bench/capacity.py`` assumes (0.85 on H200; 272 of 288 GB on B300)."""
        plat = PLATFORMS[self.gpu]
        return self.mem_fraction_static or plat.static_gb / plat.hbm_gb

    @property
    def key(self) -> str:
        return MODEL_KEYS[self.model]

    @property
    def chunk(self) -> int:
        """Tokens of the largest prefill chunk one worker runs (DP attention splits SGLang's
        chunk over the workers)."""
        c = self.chunked_prefill_size or CHUNKED_PREFILL[self.gpu]
        return c // self.gpus if self.mode == "dp" else c

    @property
    def running_flag(self) -> int:
        per_worker = DEFAULT_RUNNING
        return self.max_running_requests or per_worker * (self.gpus if self.mode == "dp" else 1)

    @property
    def running(self) -> int:
        """Requests per attention worker."""
        return max(1, self.running_flag // (self.gpus if self.mode == "dp" else 1))

    def argv(self, model_dir: str) -> list[str]:
        cfg = dict(self.ulacache_config)
        cfg.setdefault("mode", self.mode)
        a = ["--model-path", model_dir, "--device", "cpu", "--kv-backend", "ulacache",
             "--ulacache-config", json.dumps(cfg), "--tp-size", str(self.gpus),
             "--max-running-requests", str(self.running_flag),
             "--chunked-prefill-size", str(self.chunked_prefill_size or
                                           CHUNKED_PREFILL[self.gpu]),
             "--mem-fraction-static", f"{self.mem_fraction:.4f}",
             "--kv-cache-dtype", self.kv_dtype[1]]
        if self.max_total_tokens:
            a += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.mode == "dp":
            a += ["--dp-size", str(self.gpus), "--enable-dp-attention"]
        if self.mode == "dcp":
            a += ["--dcp-size", str(self.gpus)]
        if self.draft_tokens:
            a += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps",
                  str(self.draft_tokens - 1 or 1), "--speculative-eagle-topk", "1",
                  "--speculative-num-draft-tokens", str(self.draft_tokens)]
        return a


class RehearsalFailed(Exception):
    """An allocation does not fit; the message names it."""


# ---------------------------------------------------------------------------------------------
# SGLang's side, as a launch sets it up
# ---------------------------------------------------------------------------------------------
def install_plugin() -> None:
    """Register and apply the plugin's hooks (CLI, class swaps, sizing) as ``load_plugins()``
    does in a launch that selected ``--kv-backend ulacache``."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from ulacache.patches import plugin

    plugin.register_cli_hooks()
    plugin.register_class_swaps()
    HookRegistry.apply_hooks()
    plugin.verify()


def publish_args(plan: Plan, model_dir: str):
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(plan.argv(model_dir))
    sa.resolve_once()
    publish(sa, role="scheduler")
    return sa


def hf_config(plan: Plan):
    """The model's Hugging Face config (transformers' own class for its ``model_type``) with the
    geometry of :class:`ulacache.oracle.refmodel.ModelGeometry`: what SGLang reads to size and
    build the pools."""
    from transformers import CONFIG_MAPPING

    g = MODELS[plan.key][1]()
    return CONFIG_MAPPING[MODEL_TYPES[plan.key]](
        architectures=[ARCHITECTURES[plan.key]], num_hidden_layers=g.n_layers,
        hidden_size=g.hidden, num_attention_heads=g.n_heads, kv_lora_rank=g.kv_lora_rank,
        qk_rope_head_dim=g.qk_rope_dim, qk_nope_head_dim=g.qk_nope_dim, v_head_dim=g.v_head_dim,
        index_n_heads=g.index_n_heads, index_head_dim=g.index_head_dim, index_topk=g.index_topk,
        vocab_size=g.vocab, max_position_embeddings=CONTEXT_LEN[plan.key])


def configurator_view(plan: Plan, sa):
    """The fields of SGLang's ``KVCacheConfigurator`` that ``DefaultPoolConfigurator`` and the
    sizing hook read, for this model on one GPU (all layers on it: no pipeline parallelism)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    g = MODELS[plan.key][1]()
    hf = hf_config(plan)
    mc = types.SimpleNamespace(hf_config=hf, hf_text_config=hf, kv_lora_rank=g.kv_lora_rank,
                               qk_rope_head_dim=g.qk_rope_dim, num_hidden_layers=g.n_layers,
                               context_len=CONTEXT_LEN[plan.key], linear_attn_registry_result=None)
    spec = SpeculativeAlgorithm.EAGLE if plan.draft_tokens else SpeculativeAlgorithm.NONE
    return types.SimpleNamespace(
        model_config=mc, kv_cache_dtype=plan.kv_dtype[0], kv_cache_dtype_str=plan.kv_dtype[1],
        use_mla_backend=True, pool_page_size=PAGE, server_args=sa, is_draft_worker=False,
        pp_size=1, mambaish_config=None, spec_algorithm=spec,
        attn_dp_size=plan.gpus if plan.mode == "dp" else 1,
        # EAGLE/MTP: one next-n layer (both models' num_nextn_predict_layers), whose stock
        # draft pool SGLang charges in the target's cell and builds itself (not rehearsed)
        spec_aux_config=types.SimpleNamespace(
            eagle_draft_num_layers=1 if plan.draft_tokens else None, draft_model_config=None,
            dflash_draft_num_layers=None),
        fused_entry_bytes=lambda kind: None,
        layer_info=types.SimpleNamespace(start_layer=0, end_layer=g.n_layers,
                                         num_effective_layers=g.n_layers))


# ---------------------------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------------------------
class MirrorPeers(Peers):
    """Rank ``rank`` of a symmetric group of ``size`` ranks whose peers mirror it: under SGLang's
    lockstep (SPMD) schedulers every rank makes the same calls with the same shapes, and on the
    meta device there are no values to differ, so one rank's allocations are every rank's.
    ``all_gather`` returns ``[size, *shape]`` (allocated, as the real collective's output is);
    ``open_peers`` the local tensor for every rank (a peer's memory is mapped, not allocated on
    this GPU)."""

    backend = "mirror"

    def __init__(self, size: int, rank: int = 0, device: str = "meta") -> None:
        super().__init__()
        self.size, self.rank, self.device = size, rank, torch.device(device)
        self.generation = 1
        self._tensors: dict[str, torch.Tensor] = {}

    def alloc_shared(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype, device=self.device)
        self._tensors[name] = t
        return t

    def open_peers(self, name: str) -> list[torch.Tensor]:
        return [self._tensors[name]] * self.size

    def barrier(self) -> None:
        return None

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(0).expand(self.size, *t.shape).contiguous()

    def _release(self) -> None:
        self._tensors.clear()


class MirrorTPGroup:
    """SGLang's ``GroupCoordinator`` surface the TP seam uses (``world_size``,
    ``rank_in_group``, ``all_gather_into_tensor``), over :class:`MirrorPeers`."""

    def __init__(self, peers: MirrorPeers) -> None:
        self.peers = peers
        self.world_size, self.rank_in_group = peers.size, peers.rank
        self.cpu_group = self.device_group = None

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        out.view(self.world_size, -1).copy_(self.peers.all_gather(inp.reshape(-1)))


def _named(roots: dict[str, object]) -> dict[int, str]:
    """Storage key -> the attribute path it was first reached at, through objects of ulacache
    and SGLang (lists, tuples, dicts followed; peers not)."""
    return {key: path for key, (path, _) in reachable_storages(
        roots, modules=("ulacache", "sglang"), stop=(Peers,), max_depth=12).items()}


def _pattern(path: str) -> str:
    """``pool.core.groups[12].loc`` -> ``pool.core.groups[*].loc``: one line per kind."""
    import re

    return re.sub(r"\[\d+\]", "[*]", path)


RETAINED_LIMIT = 1 << 20
"""Bytes ulacache's code may leave allocated after a call returns (SGLang's own allocations,
e.g. its paged allocator's free-page list, are not counted); anything larger is state growing
with the calls, e.g. scratch regrown to a call's size."""


def owner(name: str) -> str:
    """Whose memory an allocation is: ``host`` (the CPU tier: host memory on a GPU),
    ``request table`` (SGLang's ``req_to_token``, allocated outside the KV budget), ``KV rows``
    (latent and index-K rows, what SGLang's cell is made of; in TP mode the rank's own stripe
    and its buffer) or ``ulacache`` (tables, policy state, scratch, output rows)."""
    if name.endswith((".pools.cpu", ".pools.cpu_free_host", ".pools.cpu_free")):
        return "host"
    if "req_to_token" in name:
        return "request table"
    if name.startswith(("pool.index_key_cache", "pool._group_buffers", "pool.kv_buffer")):
        return "KV rows"
    return "ulacache"


def rank_body(plan: Plan, n_tokens: int, model_config, launch,
              peers: MirrorPeers | None = None) -> dict:
    """Build this rank's pool, allocator and coordinator and drive the worst-case calls; the
    ledger of this thread accounts every meta-device byte. ``launch``: the launch plan the
    sizing hook charged (:func:`ulacache.patches.launch.plan_launch`), which SGLang's
    pool-building hook hands the pool too."""
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from ulacache.patches.classes import (
        UlaCacheCoordinator,
        UlaCacheDSATokenToKVPool,
        UlaCacheTokenToKVPoolAllocator,
    )
    g = MODELS[plan.key][1]()
    ratio = launch.options.host_to_device_ratio
    R, K, L = plan.running, g.index_topk, g.n_layers
    steps = max(1, plan.draft_tokens)
    kv_dtype = plan.kv_dtype[0]
    dim = calculate_mla_kv_cache_dim(model_config=model_config, kv_cache_dtype=kv_dtype)
    ledger = Ledger()
    out: dict = {"phases": {}}
    dev = "meta"
    with ledger:
        rtp = ReqToTokenPool(size=R, max_context_len=CONTEXT_LEN[plan.key], device=dev,
                             enable_memory_saver=False)
        extra = {}
        if peers is not None:
            extra = dict(ulacache_tp_group=MirrorTPGroup(peers), ulacache_peers=peers)
        pool = UlaCacheDSATokenToKVPool(
            n_tokens, page_size=PAGE, kv_lora_rank=g.kv_lora_rank, dtype=kv_dtype,
            qk_rope_head_dim=g.qk_rope_dim, layer_num=L, device=dev,
            index_head_dim=g.index_head_dim, enable_memory_saver=False, kv_cache_dim=dim,
            max_running_requests=R, tail_extra_slots=plan.draft_tokens,
            host_to_device_ratio=ratio, ulacache_plan=launch, **extra)
        alloc = UlaCacheTokenToKVPoolAllocator(n_tokens, page_size=PAGE,
                                               dtype=kv_dtype, device=dev,
                                               kvcache=pool, need_sort=False,
                                               host_to_device_ratio=ratio)
        coord = UlaCacheCoordinator(
            req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, top_k=K,
            device_buffer_size=0, device=dev, tp_group=None, host_to_device_ratio=ratio,
            num_draft_tokens=plan.draft_tokens)
        names = _named({"pool": pool, "alloc": alloc, "coord": coord, "rtp": rtp})
        persistent: Counter[str] = Counter()
        for a in ledger.live():
            persistent[_pattern(names.get(a.key, "unnamed (" + a.site + ")"))] += a.nbytes
        out["persistent"] = dict(persistent)
        out["config"] = {"gpu_slots": pool.core.config.gpu_slots,
                         "cpu_slots": pool.core.config.cpu_slots,
                         "call_capacity": pool.core.config.call_capacity,
                         "groups": len(pool.core.groups), "request_slots": R + 1,
                         "chunk_tokens": plan.chunk, "top_k": K, "steps": steps,
                         "prefill_layers": len(prefill_layers(plan, L))}
        drive(plan, out, ledger, pool, alloc, coord, R, K, L)
        out["access_path"] = "fused" if pool.core.groups[0].fused is not None else "torch"
        out["value_reads"] = dict(ledger.value_reads)
    return out


@contextlib.contextmanager
def _phase(out: dict, ledger: Ledger, name: str):
    ledger.mark()
    before = LAUNCHES[0]
    yield
    peak, sites = ledger.peak_since_mark()
    _, kept_sites = ledger.retained_since_mark()
    # SGLang's own bookkeeping (its paged allocator's free-page list) is stock behaviour, and so
    # is the page-classed allocator's (the same free pages kept per class, 8 B a page: a freed
    # page's id is held until it is drawn again, as in SGLang's list)
    ours = {k: v for k, v in kept_sites.items() if not k.startswith(FREE_LIST_SITES)}
    out["phases"][name] = {"peak": peak, "sites": dict(Counter(sites).most_common(6)),
                           "retained": sum(ours.values()),
                           "retained_sites": dict(Counter(ours).most_common(4)),
                           "fused_launches": LAUNCHES[0] - before}


FREE_LIST_SITES = ("sglang/", "patches/sglang_page_classes.py")
"""Call sites whose retained allocations are a logical allocator's free-page lists."""


def prefill_layers(plan: Plan, n_layers: int) -> list[int]:
    """The layers the rehearsed prefill runs through: all, or ``plan.prefill_layers`` evenly
    spaced ones, first and last included (every layer's call has the same shapes and frees its
    transients before the next; a prefill at 8192 tokens is ~90 translation pieces per layer)."""
    n = plan.prefill_layers
    if not n or n >= n_layers:
        return list(range(n_layers))
    return sorted({round(i * (n_layers - 1) / max(1, n - 1)) for i in range(n)})


def drive(plan: Plan, out: dict, ledger: Ledger, pool, alloc, coord, R: int, K: int, L: int
          ) -> None:
    """SGLang's worst-case calls, in the order a server makes them. Inputs SGLang owns (the
    indexer's top-k, the prefill page table) are made before each phase starts, so a phase's
    peak is ulacache's own. Writes run ulacache's part (``rows_of``, the row translation of
    ``set_mla_kv_buffer``); SGLang's quantizing copy into those rows is its own kernel."""
    dev = torch.device("meta")
    T = plan.chunk
    i64 = dict(dtype=torch.int64, device=dev)
    table = torch.empty(1, T * K, dtype=torch.int32, device=dev)

    def cpu(*v):
        return torch.tensor(v, dtype=torch.int64)

    req = types.SimpleNamespace(rid="rehearsal", hisparse_staging=False, req_pool_idx=1)
    with _phase(out, ledger, "prefill"):
        locs = alloc.alloc_extend(torch.zeros(1, **i64), cpu(0), torch.full((1,), T, **i64),
                                  cpu(T), torch.full((1,), -1, **i64), T)
        if locs is None:
            raise RehearsalFailed(f"a prefill chunk of {T} tokens is refused by the allocator")
        for layer in prefill_layers(plan, L):
            pool.rows_of(layer, locs)
            pool.current_layer_id = layer  # what the forward_extend hook records
            pool.translate_loc_to_hisparse_device(table)
        coord.admit_request_into_staging(req)
        coord.collect_ready_reqs()
        del locs  # SGLang keeps out_cache_loc in the batch; not ulacache's
    stage = pool.usable_stage()
    if stage is not None:  # DP: the same chunk at the end of the longest request the stage
        # holds, its table's selections gathered into the stage layer by layer
        P = stage.capacity - T
        with _phase(out, ledger, "staged prefill"):
            locs = alloc.alloc_extend(torch.full((1,), P, **i64), cpu(P),
                                      torch.full((1,), P + T, **i64), cpu(P + T),
                                      torch.full((1,), -1, **i64), T)
            if locs is None:
                raise RehearsalFailed(f"a staged prefill chunk of {T} tokens after {P} is "
                                      "refused by the allocator")
            pool.staging = True  # what the forward_extend hook sets for this batch
            try:
                for layer in prefill_layers(plan, L):
                    pool.rows_of(layer, locs)
                    pool.current_layer_id = layer
                    pool.get_key_buffer(layer)
                    pool.translate_loc_to_hisparse_device(table)
            finally:
                pool.staging = False
            del locs
    del table

    ri = torch.arange(R, **i64)
    seq = torch.full((R,), T + 1, **i64)
    seq_cpu = torch.full((R,), T + 1, dtype=torch.int64)
    topk = torch.empty(R, K, dtype=torch.int32, device=dev)
    with _phase(out, ledger, "decode"):
        new = alloc.alloc_decode(seq, seq_cpu, torch.full((R,), T - 1, **i64))
        coord.map_last_loc_to_buffer(seq, new, ri, seq_cpu, ri)
        coord.num_real_reqs.fill_(R)
        for layer in range(L):
            pool.rows_of(layer, new)
            coord.swap_in_selected_pages(ri, seq, topk, layer)
        del new
    del topk

    if plan.draft_tokens:
        S = plan.draft_tokens
        topk = torch.empty(R, S, K, dtype=torch.int32, device=dev)
        prefix = torch.full((R,), T + 1, **i64)
        accept = torch.zeros(R, S, **i64)
        with _phase(out, ledger, "verify"):
            locs = alloc.alloc_logical_only(prefix, seq_cpu, prefix + S, seq_cpu + S,
                                            torch.full((R,), T, **i64), R * S)
            batch = types.SimpleNamespace(out_cache_loc=locs, req_pool_indices=ri)
            coord.prepare_spec_verify(batch)
            coord.num_real_reqs.fill_(R)
            for layer in range(L):
                pool.rows_of(layer, locs)
                coord.swap_in_selected_pages(ri, prefix + S, topk, layer)
            coord.commit_spec_accept_tokens(batch=batch, accept_indices=accept)
            del locs, batch
        del topk

    row = torch.empty(T + 1, **i64)  # one request's req_to_token row
    with _phase(out, ledger, "finish"):
        coord.request_finished(req)
        alloc.free_segment(row[: T // PAGE * PAGE], start_pos=0)
    with _phase(out, ledger, "abort"):
        coord.retract_req(req)
        alloc.free(row)


LAUNCHES = [0]
"""Fused-kernel launches recorded so far while :func:`kernels_recorded` is on (one rank is
built, in this thread)."""


@contextlib.contextmanager
def kernels_recorded():
    """Fused-kernel launches counted in :data:`LAUNCHES` instead of run (meta tensors have no
    data; a kernel allocates no memory), as :mod:`ulacache.kernels.fused_compile` records
    them."""
    try:
        from ulacache.kernels import fused_access as fa
    except ImportError:
        yield
        return

    def record(kernel, grid, *args, **meta):
        LAUNCHES[0] += 1

    with fa.launches_recorded(record):
        yield


def sizing_group(plan: Plan):
    """The attention-TP group the sizing hook asks SGLang for (its size only), stated through
    SGLang's own ``get_parallel().override`` (no process group is built here); DP: none."""
    from sglang.srt.runtime_context import get_parallel

    if plan.mode not in ("tp", "dcp"):
        return contextlib.nullcontext()
    return get_parallel().override(tp_group=types.SimpleNamespace(world_size=plan.gpus,
                                                                  rank_in_group=0))


def build_and_drive(plan: Plan, n_tokens: int, kvc, launch) -> list[dict]:
    """The report of one rank: a DP worker (every worker is the same), or TP rank 0 with
    mirrored peers (:class:`MirrorPeers`; ranks differ by at most one owned token per request
    and page of a prefill)."""
    peers = MirrorPeers(plan.gpus) if plan.mode in ("tp", "dcp") else None
    return [rank_body(plan, n_tokens, kvc.model_config, launch, peers)]


# ---------------------------------------------------------------------------------------------
# the whole rehearsal
# ---------------------------------------------------------------------------------------------
def rehearse(plan: Plan) -> dict:
    """Run one rehearsal; the report as a dict (``ok``, per-GPU figures, ``fails``)."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator

    from ulacache.patches.launch import plan_launch

    if plan.mode in ("tp", "dcp"):  # their launch requirement (patches/server_args.py)
        os.environ["SGLANG_DSA_TOPK_BROADCAST"] = "1"
    install_plugin()
    # SGLang's model-specific argument pass wants a GPU for a DSA checkpoint; the arguments the
    # pools read are the flags below, and the model's config reaches the configurator directly
    sa = publish_args(plan, "dummy")
    plat = PLATFORMS[plan.gpu]
    hbm = int(plat.hbm_gb * GB)
    static = int(plan.mem_fraction * hbm)
    budget = static - int(WEIGHTS_GB[plan.key] * GB)
    headroom = hbm - static
    kvc = configurator_view(plan, sa)
    with sizing_group(plan):
        conf = DefaultPoolConfigurator(kvc)  # the sizing hook runs here
        launch = plan_launch(kvc)  # what the hook charged, and the pool-building hook passes
    n_tokens = conf.calculate_pool_sizes(budget, PAGE).max_total_num_tokens
    if plan.max_total_tokens and plan.max_total_tokens < n_tokens:
        # SGLang's user cap (kv_cache_configurator.py _apply_token_constraints, then
        # calculate_pool_sizes_from_max_tokens, which aligns to pages)
        n_tokens = conf.calculate_pool_sizes_from_max_tokens(plan.max_total_tokens,
                                                             PAGE).max_total_num_tokens
    charged = n_tokens * conf._cell_size + conf._fixed_overhead_bytes
    LAUNCHES[0] = 0
    try:
        with kernels_recorded():
            ranks = build_and_drive(plan, n_tokens, kvc, launch)
    except (UlaCacheError, RehearsalFailed) as exc:
        # a start-up check or the allocator refused: what a launch would stop on
        return {"plan": asdict(plan), "ok": False, "fails": [f"{type(exc).__name__}: {exc}"],
                "gpu_hbm": hbm, "static": static, "budget": budget, "headroom": headroom,
                "pool_tokens": n_tokens, "cell_bytes": conf._cell_size,
                "fixed_bytes": conf._fixed_overhead_bytes, "charged": charged}

    def device(r: dict) -> int:
        return sum(v for k, v in r["persistent"].items() if owner(k) in ("KV rows", "ulacache"))

    worst = max(ranks, key=device)
    by_owner: Counter[str] = Counter()
    for k, v in worst["persistent"].items():
        by_owner[owner(k)] += v
    on_device = by_owner["KV rows"] + by_owner["ulacache"]
    host_budget = int((plan.host_gb or plat.host_gb) * GB)
    phases = {name: max(r["phases"][name]["peak"] for r in ranks) for name in worst["phases"]}
    peak_phase = max(phases, key=phases.get)
    # Everything beyond SGLang's KV budget comes out of the memory outside the static pool:
    # start-up allocations over the budget (SGLang's own padding pages, uncharged in stock
    # SGLang too), the request table, then each call's transient peak.
    over = max(0, on_device - budget)
    left = headroom - over - by_owner["request table"] - phases[peak_phase]
    retained = {name: max(r["phases"][name]["retained"] for r in ranks)
                for name in worst["phases"]}
    fails = []
    for name, kept in retained.items():
        if kept > RETAINED_LIMIT:
            site, nbytes = max(worst["phases"][name]["retained_sites"].items(),
                               key=lambda kv: kv[1])
            fails.append(f"{name}: left {kept / 2**20:.1f} MiB allocated after it returned "
                         f"(largest: {site} {nbytes / 2**20:.1f} MiB): memory that grows with the "
                         "calls, charged nowhere (a captured graph may hold the old tensors)")
    if left < 0:
        site, nbytes = max(worst["phases"][peak_phase]["sites"].items(), key=lambda kv: kv[1],
                           default=("-", 0))
        fails.append(f"{peak_phase}: transient peak {phases[peak_phase] / GB:.2f} GB (largest: "
                     f"{site} {nbytes / GB:.2f} GB) + start-up allocations over the budget "
                     f"{over / GB:.2f} GB + request table {by_owner['request table'] / GB:.2f} GB"
                     f" exceed the {headroom / GB:.2f} GB outside the static pool")
    if by_owner["host"] > host_budget:
        fails.append(f"the CPU tier {by_owner['host'] / GB:.2f} GB exceeds the host budget "
                     f"{host_budget / GB:.2f} GB per GPU; lower cpu_ratio")
    return {
        "plan": asdict(plan), "ok": not fails, "fails": fails,
        "gpu_hbm": hbm, "static": static, "budget": budget, "headroom": headroom,
        "host_budget": host_budget,
        "pool_tokens": n_tokens, "cell_bytes": conf._cell_size,
        "fixed_bytes": conf._fixed_overhead_bytes, "charged": charged,
        "device_persistent": on_device, "by_owner": dict(by_owner),
        "allocations": {k: {"bytes": v, "owner": owner(k)} for k, v in
                        sorted(worst["persistent"].items(), key=lambda kv: -kv[1])},
        "transient": phases, "transient_peak": phases[peak_phase], "peak_phase": peak_phase,
        "retained": retained,
        "transient_sites": worst["phases"][peak_phase]["sites"],
        "fused_launches": {name: ph["fused_launches"] for name, ph in worst["phases"].items()},
        "over_budget": over, "headroom_left": left,
        "config": worst["config"], "access_path": worst["access_path"],
        "value_reads": worst["value_reads"], "ranks": len(ranks),
    }


def format_report(r: dict) -> str:
    p = r["plan"]
    if "allocations" not in r:
        return (f"ulacache rehearse: {p['model']} on {p['gpus']}x{p['gpu'].upper()}, mode "
                f"{p['mode']}: pool of {r['pool_tokens']:,} GPU tokens in a "
                f"{r['budget'] / GB:.2f} GB budget\n  DOES NOT START: " + "; ".join(r["fails"]))
    gb = lambda b: f"{b / GB:8.2f} GB"  # noqa: E731
    lines = [f"ulacache rehearse: {p['model']} on {p['gpus']}x{p['gpu'].upper()}, mode "
             f"{p['mode']}, draft tokens {p['draft_tokens']}, chunk {r['config']['chunk_tokens']}"
             f" tokens per worker (through {r['config']['prefill_layers']} of "
             f"{r['config']['groups']} groups' layers), {r['config']['request_slots'] - 1} "
             "requests per worker",
             f"  HBM {gb(r['gpu_hbm'])}; static pool (mem_fraction_static "
             f"{r['static'] / r['gpu_hbm']:.3f}) {gb(r['static'])}; SGLang's KV budget "
             f"{gb(r['budget'])}",
             f"  pool: {r['pool_tokens']:,} GPU tokens x {r['cell_bytes']:,} B cell + "
             f"{r['fixed_bytes'] / GB:.2f} GB fixed = {gb(r['charged'])} charged; "
             f"{r['config']['groups']} selection groups, gpu_slots "
             f"{r['config']['gpu_slots']:,} per group, call capacity "
             f"{r['config']['call_capacity']:,} entries",
             f"  start-up allocations per GPU ({r['access_path']} access path):"]
    allocs = list(r["allocations"].items())
    for name, a in allocs[:16]:
        lines.append(f"    {gb(a['bytes'])}  {name}  [{a['owner']}]")
    if allocs[16:]:
        lines.append(f"    {gb(sum(a['bytes'] for _, a in allocs[16:]))}  "
                     f"{len(allocs) - 16} more")
    o = r["by_owner"]
    lines.append(f"    device: {gb(r['device_persistent'])} (KV rows {o.get('KV rows', 0) / GB:.2f}"
                 f" GB + ulacache {o.get('ulacache', 0) / GB:.2f} GB) of the {r['budget'] / GB:.2f}"
                 f" GB budget: {(r['budget'] - r['device_persistent']) / GB:.2f} GB left; "
                 f"charged - allocated {(r['charged'] - r['device_persistent']) / 2**20:+.1f} MiB")
    lines.append(f"    host: {gb(o.get('host', 0))} CPU tier of the {r['host_budget'] / GB:.0f} GB "
                 f"host budget; SGLang's request table {o.get('request table', 0) / 2**20:.1f} MiB")
    lines.append("  transient peak per call, above the start-up allocations:")
    for name, b in r["transient"].items():
        lines.append(f"    {gb(b)}  {name} ({r['fused_launches'][name]} fused launches; left "
                     f"allocated after it: {r['retained'][name] / 2**20:.2f} MiB)")
    lines.append("    largest at the peak: " + "; ".join(
        f"{site} {b / GB:.2f} GB" for site, b in list(r["transient_sites"].items())[:3]))
    lines.append(f"  outside the static pool {gb(r['headroom'])}; minus start-up allocations "
                 f"over the budget {r['over_budget'] / 2**20:.1f} MiB, the request table and "
                 f"ulacache's peak ({r['peak_phase']}): {gb(r['headroom_left'])} left for "
                 "SGLang's activations, CUDA graphs and NCCL")
    if r["value_reads"]:
        lines.append(f"  value reads answered 0 on the meta device: {r['value_reads']}")
    lines.append("  OK" if r["ok"] else "  DOES NOT FIT: " + "; ".join(r["fails"]))
    return "\n".join(lines)


def main(args) -> int:
    cfg = json.loads(args.ulacache_config) if args.ulacache_config else {}
    plan = Plan(model=args.model, gpu=args.gpu, gpus=args.gpus, mode=args.mode,
                ulacache_config=cfg, draft_tokens=args.speculative_num_draft_tokens or 0,
                chunked_prefill_size=args.chunked_prefill_size,
                max_running_requests=args.max_running_requests,
                mem_fraction_static=args.mem_fraction_static,
                prefill_layers=args.prefill_layers, host_gb=args.host_gb,
                max_total_tokens=args.max_total_tokens, layout=args.layout)
    report = rehearse(plan)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0 if report["ok"] else 1
