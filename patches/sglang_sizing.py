"""Sizing under SGLang 0.5.23: ulacache's own device memory inside SGLang's KV budget.

SGLang sizes the pool from one budget: ``DefaultPoolConfigurator`` computes the per-token
``_cell_size`` (latent row of every layer + index-K x ``host_to_device_ratio``) and a
``_fixed_overhead_bytes``, then ``max_total_num_tokens = (available - fixed) // cell``. It
knows nothing of ulacache, so one AROUND hook on ``DefaultPoolConfigurator.__init__``
(:func:`pool_configurator_init_around`) adds what the ulacache pool will allocate besides:

* both modes: ulacache's tables (mapping, owners, free stacks, claim tables, PB-LRU state and,
  in TP mode, the buffers' maps, sized by the buffer), per token and fixed, from
  :func:`ulacache.sizing.table_bytes_per_slot` (the formula the core's start-up check uses) for
  the selection groups the pool will build (SGLang's own top-k sharing pattern);
* both modes: the coordinator's graph-stable output rows, ``int32 [R x steps, top_k]`` per
  selection group plus ``int64 [R x steps]`` row ids (``sglang_coordinator``), fixed, for
  ``R`` request slots: SGLang's own ceiling of ``max_num_reqs`` (``--max-running-requests``
  per attention-DP worker when given, else 4,096, the most its estimate picks) plus its
  padding row;
* DP mode: the pool's tail page (64 rows per layer beyond SGLang's padding page);
* TP mode: ``ceil(latent / P)`` per token instead of the latent (each rank holds ``N / P`` own
  rows of the ``N`` global GPU tokens) and the rows per layer around them (sink page, scratch,
  ``B`` buffer rows, padding to a page) as fixed overhead. Index-K stays charged in full
  (replicated on every rank), or with ``stripe_index_k`` ``1/P`` of it per token and three
  pages per indexer layer (:func:`striped_index_k_charge`);
* DCP mode: TP mode's charge with no buffer rows and the DP core's tables over the stripe.
  SGLang's ``N`` keeps TP mode's meaning (global GPU tokens); stock SGLang counts a DCP pool's
  tokens per rank and so charges index-K ``dcp_size`` times per token
  (``pool_configurator.py:399-409``), which is taken back first;
* modes DP and DCP with a prefill stage (``LaunchPlan.stage_tokens``, ``prefill_stage``): one
  layer's rows of it (:class:`ulacache.layout.PoolRows` over the stage: sink page, the staged
  rows, scratch, padding to a page; DCP: a rank's own share of the longest request), fixed;
* both modes, shared-index models (layers that reuse the previous layer's top-k, SGLang's
  ``dsa_layer_skips_topk``): the pool gives those layers no index-K (``sglang_pool`` passes the
  plan's flags; they never run the indexer, ``forward_mla.py:146-165``), so their share of the
  stock charge is taken back (:func:`elided_index_k_bytes`). Stock SGLang elides them too,
  except under HiSparse, whose seams ulacache uses (``pool_configurator.py:592-597``).

Draft workers (their stock pool has no ulacache tables) and non-MLA models are left alone.
Post-adjusting ``__init__`` leaves the EAGLE draft terms at their stock values.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ulacache.layout import PoolRows
from ulacache.sizing import coordinator_output_bytes, table_bytes_per_slot

from .launch import plan_launch, sglang_options

logger = logging.getLogger(__name__)


def pool_configurator_init_around(original_fn, self, kvc, *args, **kwargs):
    """AROUND ``DefaultPoolConfigurator.__init__``: add ulacache's device memory to
    ``self._cell_size`` (bytes per SGLang GPU token) and ``self._fixed_overhead_bytes`` (see
    the module docstring), from :func:`~.launch.plan_launch`: the pool-building hook builds
    the pool from the same plan, so it allocates exactly what was charged."""
    original_fn(self, kvc, *args, **kwargs)
    if getattr(kvc, "is_draft_worker", False) or not getattr(kvc, "use_mla_backend", False):
        return
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

    plan = plan_launch(kvc)  # what the pool will build from (the pool-building hook's plan)
    opts, P, B = plan.options, plan.tp_size, plan.buffer_slots
    layers = int(kvc.layer_info.num_effective_layers)
    page = int(getattr(kvc, "pool_page_size", None) or 64)
    row = calculate_mla_kv_cache_dim(model_config=kvc.model_config,
                                     kv_cache_dtype=kvc.kv_cache_dtype) * \
        torch._utils._element_size(kvc.kv_cache_dtype)
    stock_cell = self._cell_size
    if opts.mode == "dcp":  # stock counts per-rank tokens under DCP: index-K x dcp_size
        self._cell_size -= (dcp_size() - 1) * self._compute_dsa_indexer_cell_size(
            kvc=kvc, num_layers=layers)
    elided = elided_index_k_bytes(self, kvc, plan.skip_topk_layers, layers)
    self._cell_size -= elided
    index_fixed = 0
    if P > 1 and opts.stripe_index_k:
        index_cell, index_fixed = striped_index_k_charge(self, kvc, layers, elided, P,
                                                         opts.host_to_device_ratio, page)
        self._cell_size -= index_cell
    if P > 1:
        latent = row * layers
        self._cell_size -= latent - math.ceil(latent / P)
        # rows per layer beside the N / P own rows (PoolRows: sink page, scratch, B buffer rows,
        # padding to a whole page); the stock latent, its padding page included, is gone
        rows_bytes = PoolRows.most_beside_slots(page, B) * layers * row
    else:
        # rows per layer beside the N the stock cell charges (PoolRows), less the stock pool's
        # own padding page, which stock SGLang does not charge either: the tail page
        rows_bytes = (PoolRows.most_beside_slots(page) - page) * layers * row
    groups = plan.layer_groups(layers, int(getattr(kvc.layer_info, "start_layer", 0) or 0))
    per_token, fixed = table_bytes_per_slot(
        len(groups), ratio=opts.host_to_device_ratio, page_size=page, n_buckets=opts.n_buckets,
        policy=opts.policy, tp_size=P, buffer_slots=B, layers=layers,
        call_entries=opts.call_entries, prefetch=opts.prefetch.enabled,  # tables and scratch
        deferred_moves="shared_groups" in opts.prefetch.sources, dcp=opts.mode == "dcp")
    outputs = coordinator_output_bytes(len(groups), request_slots(kvc, plan.max_running_requests),
                                       plan.top_k, plan.draft_tokens,
                                       draft_prefetch="draft" in opts.prefetch.sources)
    stage = stage_bytes(page, plan.stage_tokens, row)
    self._cell_size += per_token
    self._fixed_overhead_bytes += fixed + rows_bytes + outputs + stage + index_fixed
    logger.info(
        "ulacache sizing (%s, %d rank(s)): %d selection group(s) over %d layers; cell %d -> %d B "
        "per GPU token (ulacache tables %d B%s); fixed overhead +%.1f MiB (tables %.1f MiB, %s "
        "%.1f MiB, coordinator output rows %.1f MiB, prefill stage %d tokens %.1f MiB)",
        opts.mode, P, len(groups), layers,
        stock_cell, self._cell_size, per_token, ", latent 1/P" if P > 1 else "",
        (fixed + rows_bytes + outputs + stage) / 2**20, fixed / 2**20,
        f"{B} buffer rows + sink, scratch, padding per layer" if P > 1 else "tail page",
        rows_bytes / 2**20, outputs / 2**20, plan.stage_tokens, stage / 2**20)


def striped_index_k_charge(configurator, kvc, layers: int, elided: int, P: int, ratio: int,
                           page: int) -> tuple[int, int]:
    """``(cell bytes taken back, fixed bytes added)`` for index-K striped by page
    (``stripe_index_k``, :mod:`~.sglang_index_stripe`): a rank stores ``ceil(pages / P) + 2``
    of the ``pages`` (SGLang's ``IndexKeyCache`` count over ``N x ratio`` logical tokens) per
    indexer layer, so the cell charges ``ceil(index / P)`` of the stock ``index`` bytes per
    token and the fixed overhead three pages per indexer layer (the ceiling, the trash and
    zero pages; SGLang's own extra page is inside the ceiling's slack)."""
    size = configurator._compute_dsa_indexer_cell_size
    index = size(kvc=kvc, num_layers=layers) - elided
    per_layer_token = size(kvc=kvc, num_layers=1) // ratio  # 132 B (GLM-5, DeepSeek-V3.2)
    indexer_layers = index // (per_layer_token * ratio) if per_layer_token else 0
    return index - math.ceil(index / P), 3 * page * per_layer_token * indexer_layers


def stage_bytes(page: int, stage_tokens: int, row_bytes: int) -> int:
    """Device bytes of a prefill stage of ``stage_tokens`` rows (one layer, laid out as
    :class:`PoolRows`); 0 without one."""
    return PoolRows(page, stage_tokens).total * row_bytes if stage_tokens else 0


def elided_index_k_bytes(configurator, kvc, skip_topk_layers, layers: int) -> int:
    """Bytes per GPU token of index-K the stock cell charges for layers the pool builds
    without it: the shared-index layers of ``skip_topk_layers`` (per layer of this worker;
    ``None``: none). Stock SGLang 0.5.23 charges every layer under HiSparse
    (``pool_configurator.py:592-597``); a charge that already counts anchors only (a later
    SGLang) is left alone, so nothing is taken back twice."""
    skipped = sum(bool(s) for s in skip_topk_layers or ())
    if not skipped:
        return 0
    size = configurator._compute_dsa_indexer_cell_size
    one = size(kvc=kvc, num_layers=1)
    if size(kvc=kvc, num_layers=layers) != layers * one:
        return 0
    return skipped * one


MAX_ESTIMATED_REQUESTS = 4096
"""SGLang 0.5.23's ceiling on its own ``max_num_reqs`` estimate without
``--max-running-requests`` (``kv_cache_configurator.py:3123-3132``)."""


def request_slots(kvc, max_running_requests: int | None) -> int:
    """Rows of SGLang's ``req_to_token`` this worker will have, at most (sizing runs before
    SGLang settles ``max_num_reqs``): the per-worker share of ``--max-running-requests`` when
    given, else SGLang's estimate ceiling; plus the padding row 0."""
    if max_running_requests:
        return max(1, int(max_running_requests) //
                   max(1, int(getattr(kvc, "attn_dp_size", 1) or 1))) + 1
    return MAX_ESTIMATED_REQUESTS + 1


def logical_token_capacity_around(original_fn, self, *args, **kwargs):
    """AROUND ``KVCacheConfigurator.logical_token_capacity`` (``kv_cache_configurator.py``,
    read by ``ModelRunner.logical_max_total_num_tokens``, which the scheduler takes as its
    ``max_total_num_tokens``): a ulacache pool of ``G`` GPU tokens holds ``G x
    host_to_device_ratio`` unique tokens (exclusive tiers; its logical allocator hands out that
    many addresses), and that is the capacity SGLang must admit against: its token usage,
    ``max_req_len`` and the queue-time clip of generation lengths. Stock SGLang reports ``G``,
    so with a pool smaller than a request's history every generation was clipped to 0 tokens
    and the usage read negative."""
    n = original_fn(self, *args, **kwargs)
    if getattr(self, "is_draft_worker", False) or not getattr(self, "use_mla_backend", False):
        return n
    opts = sglang_options()
    if opts.mode == "dcp":  # stock widens per-rank rows by dcp_size; ulacache's N is global
        n //= dcp_size()
    return n * opts.host_to_device_ratio


def dcp_size() -> int:
    """SGLang's ``attn_dcp_size`` of this worker (1 when nothing is published)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_dcp_size)
    except (ImportError, ValueError, AttributeError):
        return 1


SIZING_HOOKS: dict[str, tuple[Any, str]] = {
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__":
        (pool_configurator_init_around, "around"),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.logical_token_capacity":
        (logical_token_capacity_around, "around"),
}
"""Registered with the class swaps (``classes.EXTRA_HOOKS``), in both modes; TP mode also
requires it (``verify.TP_HOOK_TARGETS``)."""
