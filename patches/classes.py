"""ulacache's stand-ins for SGLang 0.5.23's HiSparse leaf classes (pool, allocator, coordinator).

They keep HiSparse's constructor signatures and every method SGLang calls (see
``docs/sglang-notes.md``), and adapt those calls to the core:

- pool (``sglang_pool.py``): ``kv_buffer[layer]`` rows are the core's GPU pool of the layer's
  selection group; writes and the prefill page table are translated per group;
- allocator (``sglang_allocator.py``): SGLang's paged allocator for logical addresses, rows
  placed and freed in the core;
- coordinator (``sglang_coordinator.py``): staging, decode placement and the per-layer
  ``swap_in_selected_pages``.

Each class is written once for both modes: the pool chooses the mode from the launch plan
(``launch.py``: ``--ulacache-config``, the model's top-k sharing, the stripe width) and builds
the core (:class:`ulacache.core.Core`) the other two call. The sizing hook (``sglang_sizing.py``:
ulacache's tables in SGLang's per-token cell, both modes; TP striping and the buffer in TP mode,
from the same launch plan) and TP mode's sharded top-k hook (``sglang_tp_support.py``, a no-op
in DP mode) are registered with the others.

This module is what the plugin imports: the three classes and the extra hooks they need.
"""

from __future__ import annotations

from typing import Any

from .launch import building, layer_groups_from_skip, plan_launch, sglang_options
from .sglang_allocator import ADMISSION_HOOKS, UlaCacheTokenToKVPoolAllocator
from .sglang_coordinator import UlaCacheCoordinator
from .sglang_dcp import DCP_HOOKS
from .sglang_index_stripe import STRIPE_HOOKS
from .sglang_pool import UlaCacheDSATokenToKVPool
from .sglang_sizing import SIZING_HOOKS
from .sglang_tp_support import TP_HOOKS

__all__ = ["UlaCacheDSATokenToKVPool", "UlaCacheTokenToKVPoolAllocator", "UlaCacheCoordinator",
           "EXTRA_HOOKS", "layer_groups_from_skip", "sglang_options"]


def _forward_extend_around(original_fn, self, *args, **kwargs):
    """Tell a ulacache pool which layer the prefill page table it translates next belongs to,
    and whether this batch runs through its prefill stage (``dsa_backend.py:2164``
    ``forward_extend(q, k, v, layer, forward_batch, ...)`` reads the pool's key buffer at
    ``:2260`` and translates the page table at ``:2343``, both inside this call; a verify
    batch takes the coordinator's path at ``:2328`` and is never staged)."""
    layer = args[3] if len(args) > 3 else kwargs.get("layer")
    batch = args[4] if len(args) > 4 else kwargs.get("forward_batch")
    pool = getattr(self, "token_to_kv_pool", None)
    if not isinstance(pool, UlaCacheDSATokenToKVPool) or layer is None:
        return original_fn(self, *args, **kwargs)
    pool.current_layer_id = layer.layer_id
    if pool.ula_stage is None or batch is None or batch.forward_mode.is_target_verify() or \
            not pool.staged([int(n) for n in batch.seq_lens_cpu.tolist()]):
        return original_fn(self, *args, **kwargs)
    pool.staging = True
    try:
        return original_fn(self, *args, **kwargs)
    finally:
        pool.staging = False


def _parse_hisparse_config_around(original_fn, *args, **kwargs):
    """Size SGLang's logical space and indexer cache from ``cpu_ratio`` (one memory budget)."""
    cfg = original_fn(*args, **kwargs)
    cfg.host_to_device_ratio = sglang_options().host_to_device_ratio
    return cfg


def _build_dsa_kv_pool_around(original_fn, self, *args, **kwargs):
    """Build the pool with this configurator's launch plan (:func:`~.launch.plan_launch`, the
    same the sizing hook charged), which SGLang's call site cannot pass: under HiSparse it
    passes no ``skip_topk_layers`` (it would elide their index-K), so the plan's copy of the
    model's pattern makes shared layers join their anchor's selection group and get no
    index-K (as stock SGLang does without HiSparse; the sizing hook charges anchors only), and
    in TP mode the plan sizes the buffer exactly as charged. The coordinator cross-checks the
    groups against SGLang's ``shared_index_layers`` at start-up."""
    with building(plan_launch(self)):
        return original_fn(self, *args, **kwargs)


EXTRA_HOOKS: dict[str, tuple[Any, str]] = {
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsa_kv_pool":
        (_build_dsa_kv_pool_around, "around"),
    "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.forward_extend":
        (_forward_extend_around, "around"),
    "sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config":
        (_parse_hisparse_config_around, "around"),
    **SIZING_HOOKS,
    **ADMISSION_HOOKS,
    **TP_HOOKS,
    **STRIPE_HOOKS,
    **DCP_HOOKS,
}
"""Hooks the plugin registers with the class swaps when the ulacache backend is selected."""
