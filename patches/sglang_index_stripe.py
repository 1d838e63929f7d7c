"""Index-K striped by page across the TP group under SGLang 0.5.23 (``--ulacache-config`` mode
``"tp"`` with ``stripe_index_k``): each rank stores ``1/P`` of the indexer keys and scores only
its own pages with SGLang's kernels unchanged; the top-k is merged exactly across the group.

Ownership is SGLang's page interleave (:class:`ulacache.index_stripe.PageStripe`): logical page
``l`` on rank ``l % P`` at local page ``l // P``. It holds whatever order pages are handed out
in; ulacache's logical allocator draws a request's ``k``-th page from class ``k % P``
(:mod:`~.sglang_page_classes`), so each rank holds every ``P``-th page of every request and its
decode table, logits and top-k scan are ``ceil(W / P)`` pages wide (:attr:`IndexStripe.
pages_cycle`; without that allocator, the replicated table's width ``W``, which serves any
order).

Seams (paths under ``sglang/srt/``, SGLang 0.5.23):

* **storage** (:class:`StripedIndexKeyCache`, the pool's ``_create_index_key_cache``,
  ``mem_cache/memory_pool.py:5387``): per indexer layer ``ceil(pages / P) + 2`` pages of
  ``64 x 132`` B instead of ``pages``: the owned pages, a *trash* page (writes of other ranks'
  tokens land there, so no write needs a filter or a host sync) and a *zero* page (read for
  pages this rank does not own);
* **writes**: the fused store's ``_index_k_write_targets`` (``layers/attention/dsa/
  dsa_indexer.py:244``, used at ``:1038`` and ``:1843``; AROUND hook
  :func:`index_k_write_targets_around`) and the pool's ``set_index_k_scale_buffer`` fallback
  (``:1881`` -> ``memory_pool.py:5574`` -> ``IndexKeyCache.store_quantized``): token slots
  become :meth:`PageStripe.write_rows`;
* **decode / verify** (``Indexer._get_topk_paged``, ``dsa_indexer.py:1219-1461``; AROUND hook
  :func:`get_topk_paged_around`): the metadata it reads becomes a
  :class:`StripedIndexerMetadata`: ``get_page_table_64()`` (``:1252``) is the rank's local
  table, ``paged_mqa_ctx_lens_2d`` (``:1294-1311``) the rank's context lengths as ``[rows,
  1]``, ``paged_mqa_schedule_metadata`` ``None`` (recomputed from those lengths, ``:1316``),
  and ``topk_transform`` (called once per layer on every rank, ``:1450``) the exact merge
  :func:`ulacache.index_stripe.striped_topk` (one all-gather of ``int64 [rows, top-k]``). The
  dense variant (``_forward_cuda_k_only``, ``:1789-1798``) and the ragged prefill path never
  reach ``_get_topk_paged``, so they keep SGLang's metadata;
* **prefill** (``get_index_k_scale_buffer``, ``memory_pool.py:5562`` ->
  ``IndexKeyCache.get_k_and_scale``, read once per layer at ``dsa_indexer.py:1548``): each rank
  gathers the batch's keys through :meth:`PageStripe.read_table` (its own tokens, zeros for the
  others') with SGLang's own gather kernel, and one all-reduce (sum, as ``int32`` words: every
  word has one non-zero contributor) gives every rank the replicated bytes: no host sync and no
  scratch beyond the output SGLang allocates anyway.

Refused in one line: ``index_kpool`` != 1, ``index_init_tokens`` / ``index_local_tokens``
(``_mask_init_and_local_tokens`` assumes column == position), the cutedsl and aiter logits
backends, and what would read index-K by logical page elsewhere (``move_kv_cache``, the CPU
copies of retraction).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch
from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
from sglang.srt.mem_cache.index_key_cache import IndexKeyCache

from ulacache.errors import ConfigError, ShapeError
from ulacache.index_stripe import PageStripe, StripeView, striped_topk

from . import sglang_tp_support as tps

logger = logging.getLogger(__name__)


class IndexStripe:
    """One rank's share of the striped index-K: the ownership (``stripe``), the group the
    ranks exchange over, and the number of global pages the store is sized for."""

    def __init__(self, group, page_size: int, global_pages: int) -> None:
        self.group = group
        self.stripe = PageStripe(int(group.world_size), int(group.rank_in_group), page_size)
        self.global_pages = int(global_pages)
        # set by a page-classed allocator (sglang_page_classes): every request's k-th page on
        # rank k mod P, so decode tables are ceil(W / P) pages wide; else W (any order)
        self.pages_cycle = False
        self._cached: tuple | None = None  # (forward batch, metadata, layer, striped metadata)

    @property
    def stored_pages(self) -> int:
        """Pages this rank stores besides the trash and zero pages."""
        return self.stripe.stored_pages(self.global_pages)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return tps.all_gather_stack(self.group, t)

    def decode_metadata(self, metadata: DSAIndexerMetadata, forward_batch,
                        layer_id: int) -> StripedIndexerMetadata:
        """SGLang's paged-path metadata with this rank's table, context lengths and merge.
        Built once per forward (the first indexer layer) and reused by the later layers of the
        same forward; under CUDA-graph capture its ops are captured with that layer's and read
        the static buffers SGLang refills before each replay."""
        c = self._cached
        if c is not None and c[0] is forward_batch and c[1] is metadata.attn_metadata and \
                layer_id > c[2]:
            self._cached = (c[0], c[1], layer_id, c[3])
            return c[3]
        verify = forward_batch.forward_mode.is_target_verify() or \
            forward_batch.forward_mode.is_draft_extend_v2()
        table = metadata.get_page_table_64()
        ctx = metadata.paged_mqa_ctx_lens_2d
        lengths = (ctx if ctx is not None else metadata.get_seqlens_expanded() if verify
                   else metadata.get_seqlens_int32()).reshape(-1)
        if lengths.numel() != table.shape[0]:
            raise ShapeError(f"ulacache stripe_index_k: {lengths.numel()} context lengths for a "
                             f"page table of {table.shape[0]} rows ({forward_batch.forward_mode})")
        view = self.stripe.view(table, lengths,
                                width=None if self.pages_cycle else table.shape[1])
        base = {f.name: getattr(metadata, f.name) for f in fields(DSAIndexerMetadata)}
        base.update(paged_mqa_ctx_lens_2d=view.lengths.view(-1, 1),
                    paged_mqa_schedule_metadata=None)
        md = StripedIndexerMetadata(**base, stripe_view=view, stripe=self)
        self._cached = (forward_batch, metadata.attn_metadata, layer_id, md)
        return md


@dataclass(frozen=True)
class StripedIndexerMetadata(DSAIndexerMetadata):
    """``DSAIndexerMetadata`` of one rank's striped index-K (see the module docstring):
    ``stripe_view`` (:class:`~ulacache.index_stripe.StripeView` of the batch's page table) and
    the rank's :class:`IndexStripe`."""

    stripe_view: StripeView | None = None
    stripe: Any = None

    def get_page_table_64(self) -> torch.Tensor:
        return self.stripe_view.table

    def topk_transform(self, logits: torch.Tensor, topk: int, *args, **kwargs) -> torch.Tensor:
        """``int32 [rows, topk]``: the exact top-k of the whole request's logits, the same on
        every rank, in score order then ``-1``: the order SGLang's torch top-k hands the sparse
        attention (``torch.topk`` sorted, ``dsa_topk_backend.py:302``), so a kernel that sums
        in the given order rounds as over replicated keys. Collective."""
        if args or any(v is not None for v in kwargs.values()):
            raise ShapeError("ulacache stripe_index_k: the paged top-k takes logits and top-k "
                             f"only, got extra arguments {sorted(kwargs)}")
        lengths = self.get_seqlens_expanded()
        out = striped_topk(logits, self.stripe_view, lengths, int(topk),
                           self.stripe.all_gather, by_score=True)
        return out.to(torch.int32)


class StripedIndexKeyCache(IndexKeyCache):
    """SGLang's ``IndexKeyCache`` holding this rank's pages only (module docstring): buffers of
    ``stored_pages + 2`` pages, allocated by SGLang's own constructor (memory-saver region,
    custom pool) from an ``index_buf_size`` that gives that many pages."""

    def __init__(self, pool, index_buf_size: int, group) -> None:
        ps = int(pool.page_size)
        if int(getattr(pool, "index_kpool", 1)) != 1:
            raise ConfigError("ulacache stripe_index_k needs index_kpool 1 (whole pages per "
                              f"rank), got {pool.index_kpool}")
        global_pages = (int(index_buf_size) + ps + 1) // ps  # IndexKeyCache's own count
        self.stripe = IndexStripe(group, ps, global_pages)
        logger.info("ulacache: index-K striped by page over %d ranks: rank %d stores %d of %d "
                    "pages", self.stripe.stripe.ranks, self.stripe.stripe.rank,
                    self.stripe.stored_pages, global_pages)
        # IndexKeyCache allocates (size + page + 1) // page pages: ask for stored + 2
        super().__init__(pool, (self.stripe.stored_pages + 1) * ps - 1)

    def write_rows(self, loc: torch.Tensor) -> torch.Tensor:
        """Rows in this rank's store for token slots ``loc`` (owned, else trash), ``loc``'s
        dtype."""
        return self.stripe.stripe.write_rows(loc, self.stripe.global_pages).to(loc.dtype)

    def write_targets(self, layer_id: int, loc: torch.Tensor):
        """``_index_k_write_targets``'s answer for this store: every token at its row here."""
        return ((self.get_local_buffer(layer_id), self.write_rows(loc), None),)

    def store_quantized(self, layer_id, loc, index_k, index_k_scale) -> None:
        super().store_quantized(layer_id, self.write_rows(loc), index_k, index_k_scale)

    def get_k_and_scale(self, layer_id, seq_len_tensor, page_indices, seq_len_sum, max_seq_len):
        """SGLang's ragged read (``uint8 k [seq_len_sum, 128]``, ``scale [seq_len_sum, 4]``,
        requests concatenated) of a striped store: this rank's tokens gathered by SGLang's
        kernel through :meth:`PageStripe.read_table`, zeros for the others', then one
        all-reduce (sum of ``int32`` words) over the group. Collective."""
        ps = self.stripe.stripe.page_size
        lens = seq_len_tensor.to(torch.int64).reshape(-1)
        cols = torch.arange(page_indices.shape[1], device=page_indices.device)
        live = cols[None, :] < ((lens + ps - 1) // ps).to(page_indices.device)[:, None]
        local = self.stripe.stripe.read_table(page_indices, live, self.stripe.global_pages)
        k, scale = super().get_k_and_scale(layer_id, seq_len_tensor,
                                           local.to(page_indices.dtype), seq_len_sum,
                                           max_seq_len)
        for t in (k, scale):
            tps.all_reduce_sum(self.stripe.group, t.view(torch.int32))
        return k, scale

    def move(self, tgt_loc, src_loc) -> None:
        if tgt_loc.numel():
            raise NotImplementedError("ulacache stripe_index_k: moving index-K between logical "
                                      "slots would cross owners (speculative move_kv_cache)")

    def cpu_copy(self, indices):
        raise NotImplementedError("ulacache stripe_index_k: index-K CPU copies (retraction) "
                                  "are not supported; the latent's live in ulacache's tiers")

    def load_cpu_copy(self, index_k_cpu, indices) -> None:
        raise NotImplementedError("ulacache stripe_index_k: index-K CPU copies (retraction) "
                                  "are not supported")


def striped_store(pool) -> StripedIndexKeyCache | None:
    """``pool``'s striped index-K store, or ``None`` (any other pool)."""
    cache = getattr(pool, "index_key_cache", None)
    return cache if isinstance(cache, StripedIndexKeyCache) else None


def check_indexer(indexer) -> None:
    """Refuse an indexer whose paged path assumes local column == request position."""
    init = int(getattr(indexer, "num_init_tokens", 0) or 0)
    local = int(getattr(indexer, "num_local_tokens", 0) or 0)
    if init or local:
        raise ConfigError("ulacache stripe_index_k: index_init_tokens / index_local_tokens "
                          f"({init} / {local}) mask columns by position; set them to 0 or turn "
                          "stripe_index_k off")
    backend = getattr(indexer, "paged_mqa_logits_backend", None)
    for name in ("is_cutedsl", "is_aiter"):
        if backend is not None and getattr(backend, name)():
            raise ConfigError(f"ulacache stripe_index_k: the {name[3:]} paged MQA-logits "
                              "backend reads the replicated page table; use DeepGEMM")


# -- hooks ------------------------------------------------------------------------------------
def index_k_write_targets_around(original_fn, pool, layer_id, loc):
    """AROUND ``dsa_indexer._index_k_write_targets``: a striped store writes every token at its
    own row (:meth:`StripedIndexKeyCache.write_targets`); any other pool is untouched."""
    store = striped_store(pool)
    if store is None:
        return original_fn(pool, layer_id, loc)
    return store.write_targets(layer_id, loc)


def get_topk_paged_around(original_fn, self, forward_batch, layer_id, q_fp8, weights, metadata,
                          *args, **kwargs):
    """AROUND ``Indexer._get_topk_paged``: with a striped store, the paged decode / verify
    top-k reads this rank's pages through :class:`StripedIndexerMetadata`."""
    from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

    store = striped_store(get_token_to_kv_pool())
    if store is None:
        return original_fn(self, forward_batch, layer_id, q_fp8, weights, metadata,
                           *args, **kwargs)
    if not isinstance(metadata, DSAIndexerMetadata):
        raise ConfigError(f"ulacache stripe_index_k: unsupported indexer metadata "
                          f"{type(metadata).__name__} (index_kpool and DSV4 indexers)")
    if not getattr(self, "_ulacache_stripe_checked", False):  # its config is fixed: once
        check_indexer(self)
        self._ulacache_stripe_checked = True
    striped = store.stripe.decode_metadata(metadata, forward_batch, layer_id)
    return original_fn(self, forward_batch, layer_id, q_fp8, weights, striped, *args, **kwargs)


STRIPE_HOOKS: dict[str, tuple[Any, str]] = {
    "sglang.srt.layers.attention.dsa.dsa_indexer._index_k_write_targets":
        (index_k_write_targets_around, "around"),
    "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_paged":
        (get_topk_paged_around, "around"),
}
"""Registered with the class swaps; no-ops unless the pool's index-K store is striped."""
