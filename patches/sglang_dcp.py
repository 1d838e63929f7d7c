"""Mode ``"dcp"`` under SGLang 0.5.23: ulacache's stripe under SGLang's decode context
parallelism (``--dcp-size P``) on the sm_90 FlashMLA path (docs/tp-over-dcp.md).

Under DSA DCP every target-model attention call (decode, verify and extend:
``forward_mla.py:121-131`` ``is_dcp_mla_decode_phase``) runs ``attn_mqa_for_dcp_decode``, a
RadixAttention over ``num_local_heads x P`` heads (``deepseek_v2.py:2193-2204``; the queries
are gathered or projected for all heads, ``forward_mla.py:665-671``), expects ``(out, lse)``
back (``forward_mla.py:755``) and merges the ranks' partial outputs by their log-sum-exp
(``forward_mla.py:802-837``; for ``current_attention_backend`` "dsa" the merge takes a base-2
LSE, ``forward_mla.py:91-92``). Stock SGLang does this only on the Blackwell ``trtllm`` DSA
backends, which never call the HiSparse coordinator (``dsa_backend.py:2567-2582``), and
refuses HiSparse under DCP (``model_overrides/deepseek_v2.py:21-22``). ulacache's pool returns
each rank's own rows already (``-1`` for peers' selections: :class:`ulacache.stripe.
StripeAddressSpace`), so the sm_90 ``flashmla_kv`` path needs only:

* AROUND ``_dsa_dcp_overrides`` (:func:`dsa_dcp_overrides_around`): for ulacache mode
  ``"dcp"``, SGLang's own refusals except HiSparse (the pool ulacache swaps in is its own), and
  ``flashmla_kv`` as the DSA prefill and decode backend when unset;
* AROUND ``DeepseekSparseAttnBackend.__init__`` (:func:`backend_init_around`): FlashMLA's
  padded head count and its schedule metadata (``dsa_backend.py:588-594``, ``:4151``) from the
  ``num_local_heads x P`` heads the DCP layer runs, not the local heads;
* AROUND ``DeepseekSparseAttnBackend._forward_flashmla_kv`` (:func:`flashmla_kv_around`): for a
  DCP layer, the same FlashMLA sparse decode kernel over the rank's own rows, returning its
  output and the LSE FlashMLA computes anyway (``softmax_lse``, natural log, ``+inf`` for a
  query with no own row, which SGLang's merge weighs zero: ``dcp_kernels.py:288-290``) in
  base 2.

Not run here: SGLang refuses a DCP group on CPU (``parallel_state.py:2656-2663``) and FlashMLA
needs sm_90, so these hooks are tested against a torch reference of the FlashMLA call
(``tests/test_sglang_dcp.py``), not in a launch.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ulacache.errors import ConfigError

logger = logging.getLogger(__name__)

DCP_BACKEND = "flashmla_kv"
"""The one DSA backend whose DCP branch ulacache provides (sm_90 FlashMLA, fp8 KV)."""

LOG2_E = 1.0 / math.log(2.0)


def _ulacache_dcp(cfg: Any) -> bool:
    """Whether this launch is ``--kv-backend ulacache`` in mode ``"dcp"``."""
    return getattr(cfg, "kv_backend", "default") == "ulacache" and \
        sglang_options_of(cfg).mode == "dcp"


def sglang_options_of(cfg: Any):
    """The ``--ulacache-config`` of a server-args record or view (its own field, not the
    published args: the overrides run before SGLang publishes them)."""
    from ulacache.config import SGLangOptions

    from .server_args import parse_ulacache_config

    return SGLangOptions.from_dict(parse_ulacache_config(getattr(cfg, "ulacache_config", None)))


def dsa_dcp_overrides_around(original_fn, cfg, *args, **kwargs):
    """AROUND ``model_overrides/deepseek_v2._dsa_dcp_overrides``: ulacache mode ``"dcp"`` keeps
    SGLang's DCP refusals but HiSparse's (ulacache's pool runs on the HiSparse seams) and
    takes ``flashmla_kv`` for both DSA phases when unset; any other explicit DSA backend is
    refused (``trtllm`` bypasses the coordinator; the others have no DCP branch)."""
    if getattr(cfg, "dcp_size", 1) <= 1 or not _ulacache_dcp(cfg):
        return original_fn(cfg, *args, **kwargs)
    if getattr(cfg, "enable_hierarchical_cache", False):
        raise ConfigError("--kv-backend ulacache mode 'dcp' cannot be combined with HiCache "
                          "(--enable-hierarchical-cache): ulacache's CPU tier is the host cache")
    if getattr(cfg, "disaggregation_mode", "null") != "null":
        raise ConfigError("--kv-backend ulacache mode 'dcp' does not support PD "
                          "disaggregation")
    chosen = {name: getattr(cfg, name, None)
              for name in ("dsa_prefill_backend", "dsa_decode_backend")}
    wrong = {k: v for k, v in chosen.items() if v not in (None, DCP_BACKEND)}
    if wrong:
        raise ConfigError(
            "--kv-backend ulacache mode 'dcp' runs the FlashMLA DCP branch only: "
            + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in wrong.items())
            + f" is not supported; leave them unset or pass {DCP_BACKEND}")
    overrides = {k: DCP_BACKEND for k, v in chosen.items() if v is None}
    if getattr(cfg, "dcp_replicate_q_proj", None) is None and \
            getattr(cfg, "dcp_comm_backend", None) in ("a2a", "fi_a2a"):
        overrides["dcp_replicate_q_proj"] = True  # SGLang's own choice for DSA DCP
    return overrides


def flashmla_heads(num_heads: int) -> int:
    """FlashMLA decode's padded head count for ``num_heads`` query heads (64 or 128; more
    are left as they are), as SGLang pads local heads (``dsa_backend.py:588-594``)."""
    return 64 if num_heads <= 64 else 128 if num_heads <= 128 else num_heads


def _is_ulacache_dcp_backend(backend) -> bool:
    pool = getattr(backend, "token_to_kv_pool", None)
    return int(getattr(backend, "dcp_size", 1) or 1) > 1 and \
        getattr(getattr(pool, "ula_options", None), "mode", None) == "dcp"


def backend_init_around(original_fn, self, *args, **kwargs):
    """AROUND ``DeepseekSparseAttnBackend.__init__``: under ulacache mode ``"dcp"`` the DCP
    layer runs ``num_dcp_q_heads`` query heads, so FlashMLA's head padding and schedule
    metadata are sized for them (the stock sizes for the local heads would not fit the
    gathered queries)."""
    original_fn(self, *args, **kwargs)
    if _is_ulacache_dcp_backend(self):
        self.flashmla_kv_num_q_heads = flashmla_heads(int(self.num_dcp_q_heads))
        logger.info("ulacache DCP: FlashMLA decode over %d query heads (padded to %d), rank "
                    "%d of %d", self.num_dcp_q_heads, self.flashmla_kv_num_q_heads,
                    self.dcp_rank, self.dcp_size)


def flashmla_kv_around(original_fn, self, q_all, kv_cache, v_head_dim, sm_scale, layer,
                       metadata, page_table_1):
    """AROUND ``DeepseekSparseAttnBackend._forward_flashmla_kv``: for a DCP layer of a ulacache
    ``"dcp"`` pool, ``(out [T, 1, H x P, v_head_dim], lse float32 [T, H x P] base 2)`` over
    the rank's own rows (``page_table_1``: the coordinator's or the prefill translation's
    rows, ``-1`` where a selection is a peer's). Any other call is SGLang's own."""
    if not _is_ulacache_dcp_backend(self) or \
            int(layer.tp_q_head_num) != int(self.num_dcp_q_heads):
        return original_fn(self, q_all, kv_cache, v_head_dim, sm_scale, layer, metadata,
                           page_table_1)
    return partial_flashmla_kv(self, q_all, kv_cache, v_head_dim, sm_scale, layer, metadata,
                               page_table_1)


def partial_flashmla_kv(backend, q_all, kv_cache, v_head_dim, sm_scale, layer, metadata,
                        page_table_1):
    """FlashMLA's sparse decode kernel over this rank's rows with its LSE (see
    :func:`flashmla_kv_around`). The stock call (``dsa_backend.py:3309-3371``) with the
    heads padded to ``flashmla_kv_num_q_heads`` and the LSE kept: ``softmax_lse`` is
    ``[T, heads, 1]`` natural log; SGLang's DSA merge takes base 2."""
    import torch
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_with_kvcache

    heads = int(layer.tp_q_head_num)
    q = q_all.view(-1, 1, heads, layer.head_dim)
    padded = int(backend.flashmla_kv_num_q_heads)
    if padded != heads:
        q_in = q.new_zeros(q.shape[0], 1, padded, q.shape[3])
        q_in[:, :, :heads] = q
    else:
        q_in = q
    page = int(backend.physical_page_size)
    if page != 64:
        raise ConfigError(f"FlashMLA's sparse decode reads 64-row pages; the pool's are {page}")
    cache = kv_cache.view(-1, page, 1, backend.kv_cache_dim)
    if not backend.dsa_kv_cache_store_fp8:
        raise ConfigError("ulacache mode 'dcp' needs --kv-cache-dtype fp8_e4m3 (FlashMLA's "
                          "sparse decode reads fp8 rows)")
    if page_table_1.shape[-1] != backend.dsa_index_topk:
        raise ConfigError(f"FlashMLA's sparse decode takes exactly top-k "
                          f"({backend.dsa_index_topk}) indices per query, got "
                          f"{page_table_1.shape[-1]}")
    out, lse = flash_mla_with_kvcache(
        q=q_in, k_cache=cache, cache_seqlens=metadata.dsa_cache_seqlens_int32,
        head_dim_v=v_head_dim,
        tile_scheduler_metadata=metadata.flashmla_metadata.flashmla_metadata,
        num_splits=metadata.flashmla_metadata.num_splits, softmax_scale=sm_scale,
        indices=page_table_1.unsqueeze(1),
        block_table=torch.empty((q.shape[0], 0), dtype=torch.int32, device=q.device),
        is_fp8_kvcache=True, kv_format=backend.flashmla_kv_format)
    return out[:, :, :heads], (lse[:, :heads, 0].float() * LOG2_E).contiguous()


DCP_HOOKS: dict[str, tuple[Any, str]] = {
    "sglang.srt.arg_groups.model_overrides.deepseek_v2._dsa_dcp_overrides":
        (dsa_dcp_overrides_around, "around"),
    "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.__init__":
        (backend_init_around, "around"),
    "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend._forward_flashmla_kv":
        (flashmla_kv_around, "around"),
}
"""Registered with the class swaps (``classes.EXTRA_HOOKS``); no-ops outside mode ``"dcp"``."""
