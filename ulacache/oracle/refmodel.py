"""A small DSA-MLA reference model in pure torch: the oracle for tests and the driver for benches.

It has the data flow of DeepSeek-V3.2 / GLM-5 sparse attention, with random weights:

- every layer turns its normed input into one **latent KV row** per token (``kv_a`` projection to
  ``kv_lora_rank + qk_rope_dim``, RMSNorm on the NoPE part, RoPE on the rope part at the token's
  position), packed in the geometry's row layout (bf16 or FP8-with-scale) and written to a
  pluggable :class:`LatentStore`;
- the first layer of each **selection group** runs a lightning-style indexer,
  ``score(j) = sum_h w_h * relu(q_h . k_j)``, and picks the top-k past positions; the other layers
  of the group reuse that selection;
- attention is absorbed sparse MLA over the selected rows only, read back from the store:
  ``q_latent . c_kv + q_rope . k_rope``, softmax over the selected set, ``attn @ c_kv``, then the
  per-head value up-projection and the output projection, added to a residual stream;
- a final norm and LM head give next-token logits.

TP with decode context parallelism (:class:`AttnShard`): each rank attends all heads over the
selected rows it owns (position ``p`` on rank ``p mod P``), returns the partial output and its
log-sum-exp, and the ranks merge the partials (:func:`merge_partials`); the result equals the
resident attention up to float reassociation of the softmax sum.

There are no MLPs and no q-LoRA: they do not touch the KV cache. Compute is float32 on CPU.
Index keys live in the model (they are GPU-resident in the real system), never in the store.

Top-k convention (also what :func:`select_topk` implements): candidates are positions
``0 .. pos`` (the current token included); higher score first, ties to the earlier position; the
chosen positions are returned **sorted ascending**, then ``-1`` padding up to ``index_topk``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, runtime_checkable

import torch

from ulacache.errors import AddressError, ConfigError, ShapeError, UnknownRequest
from ulacache.oracle.rowpack import pack_rows, row_bytes, unpack_rows

logger = logging.getLogger(__name__)

__all__ = [
    "ModelGeometry",
    "LatentStore",
    "ResidentStore",
    "DecodeOutput",
    "DSAMLAModel",
    "rms_norm",
    "apply_rope",
    "indexer_scores",
    "IndexShard",
    "AttnShard",
    "select_topk",
    "sparse_mla_attention",
    "sparse_mla_attention_lse",
    "merge_partials",
]

_LARGE_PARAMS = 200_000_000  # refuse to build real-size weights by accident (GBs of RAM)


@dataclass(frozen=True)
class ModelGeometry:
    """Shapes of a DSA-MLA model and its KV row layout.

    ``layers_per_indexer`` is the size of a selection group: 1 = one indexer per layer
    (DeepSeek-V3.2), 4 = one indexer shared by 4 consecutive layers (GLM-5.2 ``index_topk_freq``:
    layer ``l`` runs the indexer iff ``l % 4 == 0``). ``fp8_block`` is the NoPE values per FP8
    scale (128 in FlashMLA; tiny geometries use less).
    """

    n_layers: int
    hidden: int
    n_heads: int
    kv_lora_rank: int
    qk_rope_dim: int
    qk_nope_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    layers_per_indexer: int = 1
    vocab: int = 256
    layout: str = "bf16"
    fp8_block: int = 128
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "kv_lora_rank", "qk_rope_dim", "qk_nope_dim",
                     "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
                     "layers_per_indexer", "vocab", "fp8_block"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.layout not in ("bf16", "fp8"):
            raise ConfigError(f"layout must be 'bf16' or 'fp8', got {self.layout!r}")
        if self.layout == "fp8" and self.kv_lora_rank % self.fp8_block:
            raise ConfigError(f"fp8 layout needs kv_lora_rank ({self.kv_lora_rank}) to be a "
                              f"multiple of fp8_block ({self.fp8_block})")
        if self.qk_rope_dim % 2 or self.qk_rope_dim > self.index_head_dim:
            raise ConfigError("qk_rope_dim must be even and <= index_head_dim (the indexer "
                              f"ropes its first qk_rope_dim dims); got {self.qk_rope_dim}, "
                              f"index_head_dim {self.index_head_dim}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def latent_dim(self) -> int:
        """Dims of one latent row: ``kv_lora_rank + qk_rope_dim`` (576 for the real models)."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one packed latent row (1152 bf16 / 656 fp8 for the real models)."""
        return row_bytes(self.layout, self.kv_lora_rank, self.qk_rope_dim, self.fp8_block)

    @property
    def index_key_bytes(self) -> int:
        """Bytes of one indexer key as SGLang stores it: fp8 values + one fp32 scale per 128."""
        return self.index_head_dim + 4 * math.ceil(self.index_head_dim / 128)

    @property
    def n_groups(self) -> int:
        """Number of selection groups (indexers)."""
        return math.ceil(self.n_layers / self.layers_per_indexer)

    def selection_groups(self) -> list[list[int]]:
        """Layer indices of each selection group, in order; the first layer runs the indexer."""
        step = self.layers_per_indexer
        return [list(range(s, min(s + step, self.n_layers))) for s in range(0, self.n_layers, step)]

    def group_of(self, layer: int) -> int:
        """Selection group index of ``layer``."""
        return layer // self.layers_per_indexer

    # ---- presets -------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, layout: str = "bf16", layers_per_indexer: int = 1) -> ModelGeometry:
        """CI geometry: 4 layers, hidden 64, rank 64 + rope 16, top-k 32 (fp8 block 32)."""
        return cls(n_layers=4, hidden=64, n_heads=4, kv_lora_rank=64, qk_rope_dim=16,
                   qk_nope_dim=32, v_head_dim=32, index_n_heads=2, index_head_dim=16,
                   index_topk=32, layers_per_indexer=layers_per_indexer, vocab=256,
                   layout=layout, fp8_block=32)

    @classmethod
    def glm5(cls, layout: str = "fp8", layers_per_indexer: int = 1) -> ModelGeometry:
        """GLM-5 (``glm_moe_dsa``); ``layers_per_indexer=4`` gives the GLM-5.2 IndexShare shape."""
        return cls(n_layers=78, hidden=6144, n_heads=64, kv_lora_rank=512, qk_rope_dim=64,
                   qk_nope_dim=192, v_head_dim=256, index_n_heads=32, index_head_dim=128,
                   index_topk=2048, layers_per_indexer=layers_per_indexer, vocab=154880,
                   layout=layout)

    @classmethod
    def deepseek_v32(cls, layout: str = "fp8") -> ModelGeometry:
        """DeepSeek-V3.2: 61 layers, one indexer per layer."""
        return cls(n_layers=61, hidden=7168, n_heads=128, kv_lora_rank=512, qk_rope_dim=64,
                   qk_nope_dim=128, v_head_dim=128, index_n_heads=64, index_head_dim=128,
                   index_topk=2048, layers_per_indexer=1, vocab=129280, layout=layout)


@runtime_checkable
class LatentStore(Protocol):
    """Where the model keeps latent rows. ulacache implements it; :class:`ResidentStore` is the
    fully-resident baseline."""

    def write(self, layer: int, req: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows`` (uint8 ``[n, row_bytes]``) at token ``positions`` (int64 ``[n]``) of
        request ``req`` in ``layer``."""
        ...

    def read_selected(self, layer: int, reqs: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        """Rows of ``topk`` (int64 ``[bs, k]`` positions, ``-1`` padding) of ``reqs`` (int64
        ``[bs]``) -> uint8 ``[bs, k, row_bytes]``. Padded entries may hold any bytes."""
        ...

    def begin_step(self) -> None:
        """Called once per scheduling round (each prefill / decode_step call), before any layer."""
        ...


class ResidentStore:
    """Every row of every request in plain CPU tensors (one growable buffer per layer and request).

    Parameters
    ----------
    row_bytes : bytes per row (``ModelGeometry.row_bytes``).
    """

    def __init__(self, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.steps = 0
        self._rows: dict[tuple[int, int], torch.Tensor] = {}  # (layer, req) -> uint8 [cap, rb]
        self._written: dict[tuple[int, int], torch.Tensor] = {}  # (layer, req) -> bool [cap]

    def write(self, layer: int, req: int, positions: torch.Tensor, rows: torch.Tensor) -> None:
        if rows.dtype != torch.uint8 or rows.shape != (positions.numel(), self.row_bytes):
            raise ShapeError(f"rows must be uint8 [{positions.numel()}, {self.row_bytes}], "
                             f"got {rows.dtype} {tuple(rows.shape)}")
        if positions.numel() == 0:
            return
        if int(positions.min()) < 0:
            raise AddressError(f"negative position written for request {req}")
        key = (layer, req)
        need = int(positions.max()) + 1
        buf = self._rows.get(key)
        if buf is None or buf.shape[0] < need:
            cap = max(need, 2 * (0 if buf is None else buf.shape[0]), 16)
            new = torch.zeros(cap, self.row_bytes, dtype=torch.uint8)
            mask = torch.zeros(cap, dtype=torch.bool)
            if buf is not None:
                new[: buf.shape[0]] = buf
                mask[: buf.shape[0]] = self._written[key]
            self._rows[key], self._written[key] = new, mask
        self._rows[key][positions] = rows
        self._written[key][positions] = True

    def read_selected(self, layer: int, reqs: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        bs, k = topk.shape
        out = torch.zeros(bs, k, self.row_bytes, dtype=torch.uint8)
        # One gather per distinct request: a prefill batch is n queries of a single request.
        for req in torch.unique(reqs).tolist():
            pos = topk[reqs == req]
            valid = pos >= 0
            if not bool(valid.any()):
                continue
            key = (layer, req)
            if key not in self._rows:
                raise UnknownRequest(f"no rows for request {req} in layer {layer}")
            written = self._written[key]
            p = pos[valid]
            if int(p.max()) >= written.shape[0] or not bool(written[p].all()):
                raise AddressError(f"request {req} layer {layer}: read of an unwritten position")
            got = self._rows[key][pos.clamp(min=0)]
            out[reqs == req] = torch.where(valid[..., None], got, torch.zeros((), dtype=got.dtype))
        return out

    def begin_step(self) -> None:
        self.steps += 1

    def free(self, req: int) -> None:
        """Drop every row of ``req`` (all layers)."""
        for key in [key for key in self._rows if key[1] == req]:
            del self._rows[key], self._written[key]

    def nbytes(self) -> int:
        """Bytes of written rows (not capacity)."""
        return sum(int(m.sum()) for m in self._written.values()) * self.row_bytes


class DecodeOutput(NamedTuple):
    """Result of :meth:`DSAMLAModel.decode_step` for a batch of ``bs`` requests."""

    logits: torch.Tensor  # float32 [bs, vocab]
    attn_out: torch.Tensor  # float32 [n_layers, bs, hidden]: attention output added per layer
    topk: torch.Tensor  # int64 [n_groups, bs, index_topk]: selected positions, -1 padded
    index_scores: list[torch.Tensor]  # per group float32 [bs, max_len]; -inf past each length


# ---- pure building blocks (also what tests check against brute force) -------------------------
def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, without a learned gain."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE. ``x`` float ``[n, ..., d]`` (d even), ``positions`` int64 ``[n]``."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = (positions.to(torch.float64)[:, None] * inv_freq).to(x.dtype)
    ang = ang.view(ang.shape[0], *([1] * (x.dim() - 2)), half)
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``score[b, j] = sum_h w[b, h] * relu(q[b, h] . keys[j])``.

    q float32 ``[bs, H, d]``, w float32 ``[bs, H]``, keys float32 ``[L, d]`` -> ``[bs, L]``.

    Each score is reduced on its own (elementwise products summed over ``d``, then over ``H``),
    not through a matmul whose blocking depends on ``L``: scoring any subset of the keys (a TP
    rank's shard) gives bit-identical values to the same columns of the full scores.
    """
    dots = (q[:, :, None, :] * keys[None, None, :, :]).sum(-1)
    return (w[:, :, None] * dots.relu()).sum(1)


def select_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` positions per row of ``scores`` (float ``[bs, L]``) among ``j < lengths[b]``.

    Higher score first, ties to the earlier position (stable sort, so deterministic). Returns
    int64 ``[bs, k]``: the chosen positions sorted ascending, then ``-1`` where ``lengths < k``.
    """
    bs, width = scores.shape
    cols = torch.arange(width)
    valid = cols[None, :] < lengths[:, None]
    masked = torch.where(valid, scores, torch.full_like(scores, -math.inf))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : min(k, width)]
    chosen = torch.where(order < lengths[:, None], order, torch.full_like(order, -1))
    if chosen.shape[1] < k:
        chosen = torch.cat((chosen, chosen.new_full((bs, k - chosen.shape[1]), -1)), dim=1)
    big = torch.iinfo(torch.int64).max
    asc = torch.sort(torch.where(chosen < 0, torch.full_like(chosen, big), chosen), dim=-1).values
    return torch.where(asc == big, torch.full_like(asc, -1), asc)


def sparse_mla_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                         valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed MLA over a selected set of latent rows.

    q_latent float32 ``[bs, H, R]``, q_rope ``[bs, H, E]``, latent ``[bs, k, R + E]`` (NoPE
    ``c_kv`` then roped ``k_rope``), valid bool ``[bs, k]`` -> float32 ``[bs, H, R]``
    (``softmax(scores) @ c_kv``). Invalid rows may hold garbage (even NaN): they are zeroed
    before use and masked out of the softmax.
    """
    r = q_latent.shape[-1]
    latent = torch.where(valid[..., None], latent, torch.zeros((), dtype=latent.dtype))
    c_kv, k_rope = latent[..., :r], latent[..., r:]
    s = (torch.einsum("bhr,bkr->bhk", q_latent, c_kv)
         + torch.einsum("bhe,bke->bhk", q_rope, k_rope)) * scale
    s = torch.where(valid[:, None, :], s, torch.full((), -math.inf))
    return torch.einsum("bhk,bkr->bhr", torch.softmax(s, dim=-1), c_kv)


def sparse_mla_attention_lse(q_latent: torch.Tensor, q_rope: torch.Tensor,
                             latent: torch.Tensor, valid: torch.Tensor, scale: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_mla_attention` over a subset of the selections, with its log-sum-exp.

    Same inputs; returns ``(out`` float32 ``[bs, H, R]``, ``lse`` float32 ``[bs, H])``: ``out``
    is the softmax-weighted ``c_kv`` over the valid rows only, ``lse`` the natural log of the
    sum of ``exp(score)`` over them. A query with no valid row gets ``out = 0`` and ``lse =
    -inf`` (its weight in :func:`merge_partials` is zero)."""
    r = q_latent.shape[-1]
    latent = torch.where(valid[..., None], latent, torch.zeros((), dtype=latent.dtype))
    c_kv, k_rope = latent[..., :r], latent[..., r:]
    s = (torch.einsum("bhr,bkr->bhk", q_latent, c_kv)
         + torch.einsum("bhe,bke->bhk", q_rope, k_rope)) * scale
    s = torch.where(valid[:, None, :], s, torch.full((), -math.inf))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("bhk,bkr->bhr", p, c_kv), lse


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Merge the ranks' partial attention outputs: ``outs`` float32 ``[P, bs, H, R]`` and
    ``lses`` ``[P, bs, H]`` (:func:`sparse_mla_attention_lse` over disjoint row sets) ->
    ``[bs, H, R]``, the attention over the union of the rows (SGLang's
    ``cp_lse_ag_out_rs_mla`` correction with a natural-log LSE). Rows of ranks with no valid
    selection (``lse = -inf``) weigh nothing; a query no rank served gets zeros."""
    top = lses.amax(0)
    w = torch.exp(lses - torch.where(torch.isfinite(top), top, 0.0))  # [P, bs, H], <= 1
    total = w.sum(0)
    merged = (w[..., None] * outs).sum(0)
    return torch.where(total[..., None] > 0, merged / total.clamp(min=1e-30)[..., None], 0.0)


class AttnShard(NamedTuple):
    """A TP rank's share of attention under decode context parallelism: it reads and attends
    only the selected positions ``p`` with ``p mod size == rank`` (the core's stripe: page
    size a multiple of ``size`` keeps an address's owner equal to its position's), and merges
    the ranks' partial outputs by their log-sum-exp through ``all_gather`` (``Tensor ->
    Tensor [size, ...]``)."""

    rank: int
    size: int
    all_gather: Callable[[torch.Tensor], torch.Tensor]

    def owns(self, positions: torch.Tensor) -> torch.Tensor:
        """Whether this rank attends the rows of ``positions`` (``-1``: no)."""
        return (positions >= 0) & (torch.remainder(positions, self.size) == self.rank)


class IndexShard(NamedTuple):
    """A TP rank's share of the indexer: it keeps the index keys of positions ``j`` with
    ``(j // page) mod size == rank`` (1/P of the replicated keys; ``page`` 1: by token, the
    core's striping; ``page`` > 1: by page, as ``stripe_index_k`` stripes SGLang's index-K when
    a request's pages cycle through the ranks), scores only those, and merges the ranks' local
    top-k through ``all_gather`` (``Tensor -> Tensor [size, ...]``)."""

    rank: int
    size: int
    all_gather: Callable[[torch.Tensor], torch.Tensor]
    page: int = 1

    def owns(self, positions: torch.Tensor) -> torch.Tensor:
        """Whether this rank keeps the keys of ``positions`` (bool, same shape)."""
        return torch.remainder(positions // self.page, self.size) == self.rank


@dataclass
class _LayerWeights:
    kv_a: torch.Tensor  # [hidden, R + E]
    q: torch.Tensor  # [hidden, H * (nope + E)]
    uk: torch.Tensor  # [H, nope, R]: absorbs the key up-projection into the query
    uv: torch.Tensor  # [H, R, v_head]
    o: torch.Tensor  # [H * v_head, hidden]
    index_q: torch.Tensor | None  # [hidden, index_H * index_d]; only on group leaders
    index_k: torch.Tensor | None  # [hidden, index_d]
    index_w: torch.Tensor | None  # [hidden, index_H]


class DSAMLAModel:
    """Deterministic random-weight DSA-MLA model over a pluggable :class:`LatentStore`.

    Parameters
    ----------
    geom : the shapes; real-size presets are refused unless ``allow_large`` (GBs of weights).
    seed : weights are drawn from ``torch.Generator().manual_seed(seed)`` in a fixed order.
    store : default store; every entry point also takes a ``store`` for that call.

    The model tracks each request's length and per-group index keys. Request ids are any ints.
    """

    def __init__(self, geom: ModelGeometry, seed: int = 0, store: LatentStore | None = None,
                 allow_large: bool = False) -> None:
        g = geom
        n_params = g.vocab * g.hidden * 2 + g.n_layers * (
            g.hidden * (g.latent_dim + g.n_heads * (g.qk_nope_dim + g.qk_rope_dim))
            + g.n_heads * g.kv_lora_rank * (g.qk_nope_dim + g.v_head_dim)
            + g.n_heads * g.v_head_dim * g.hidden)
        if n_params > _LARGE_PARAMS and not allow_large:
            raise ConfigError(f"{n_params:,} parameters: real-size geometries are for sizing "
                              "only; pass allow_large=True to build weights anyway")
        self.geom = g
        self.store: LatentStore = store if store is not None else ResidentStore(g.row_bytes)
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape: int, fan_in: int | None = None) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32)
            return w / math.sqrt(fan_in if fan_in is not None else shape[0])

        self.embed = rand(g.vocab, g.hidden, fan_in=1)
        self.layers: list[_LayerWeights] = []
        for layer in range(g.n_layers):
            leader = layer % g.layers_per_indexer == 0
            self.layers.append(_LayerWeights(
                kv_a=rand(g.hidden, g.latent_dim),
                q=rand(g.hidden, g.n_heads * (g.qk_nope_dim + g.qk_rope_dim)),
                uk=rand(g.n_heads, g.qk_nope_dim, g.kv_lora_rank, fan_in=g.qk_nope_dim),
                uv=rand(g.n_heads, g.kv_lora_rank, g.v_head_dim, fan_in=g.kv_lora_rank),
                o=rand(g.n_heads * g.v_head_dim, g.hidden),
                index_q=rand(g.hidden, g.index_n_heads * g.index_head_dim) if leader else None,
                index_k=rand(g.hidden, g.index_head_dim) if leader else None,
                index_w=rand(g.hidden, g.index_n_heads) if leader else None,
            ))
        self.lm_head = rand(g.hidden, g.vocab)
        # top-k of the indexer scores: TP mode swaps in the sharded merge (ulacache.indexer)
        self.select: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = select_topk
        self.index_shard: IndexShard | None = None  # TP: keep and score only own index keys
        self.attn_shard: AttnShard | None = None  # DCP: attend own rows, merge by LSE
        self._lengths: dict[int, int] = {}
        self._index_keys: dict[int, list[torch.Tensor]] = {}  # req -> per group float32 [len, d]
        logger.debug("DSAMLAModel: %s, seed %d, %d params", g, seed, n_params)

    # ---- per-request state ---------------------------------------------------------------------
    def length(self, req: int) -> int:
        """Tokens of ``req`` written so far (0 if unknown)."""
        return self._lengths.get(req, 0)

    def index_keys(self, req: int, group: int) -> torch.Tensor:
        """Index keys of ``req`` for selection group ``group``: float32 ``[length, index_d]``."""
        if req not in self._index_keys:
            raise UnknownRequest(f"request {req} has no history")
        return self._index_keys[req][group]

    def free(self, req: int) -> None:
        """Forget ``req``'s length and index keys (the store frees its rows on its own)."""
        if req not in self._lengths:
            raise UnknownRequest(f"request {req} has no history")
        del self._lengths[req], self._index_keys[req]

    # ---- entry points --------------------------------------------------------------------------
    def prefill(self, req: int, token_ids: torch.Tensor,
                store: LatentStore | None = None) -> torch.Tensor:
        """Append a prompt (or a prompt chunk) ``token_ids`` int64 ``[n]`` to ``req``.

        Rows for all ``n`` positions are written first in each layer, then every prompt position
        attends causally (its own top-k over ``0 .. pos``) in one batch. Returns float32
        ``[vocab]`` logits of the last position.
        """
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        n = token_ids.numel()
        if n == 0:
            raise ShapeError("prefill needs at least one token")
        start = self.length(req)
        reqs = torch.full((n,), req, dtype=torch.int64)
        out = self._forward([req], reqs, torch.arange(start, start + n), token_ids, store)
        return out.logits[-1]

    def decode_step(self, reqs: list[int], token_ids: torch.Tensor,
                    store: LatentStore | None = None) -> DecodeOutput:
        """One decode step: token ``token_ids[b]`` (int64 ``[bs]``) is appended to ``reqs[b]`` at
        position ``length(reqs[b])``; requests may have different lengths."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if not reqs or len(reqs) != token_ids.numel() or len(set(reqs)) != len(reqs):
            raise ShapeError(f"need one token per distinct request, got {len(reqs)} requests "
                             f"({len(set(reqs))} distinct) and {token_ids.numel()} tokens")
        for r in reqs:
            if r not in self._lengths:
                raise UnknownRequest(f"request {r} was never prefilled")
        positions = torch.tensor([self._lengths[r] for r in reqs], dtype=torch.int64)
        return self._forward(list(reqs), torch.tensor(reqs, dtype=torch.int64), positions,
                             token_ids, store)

    # ---- the forward pass ----------------------------------------------------------------------
    def _forward(self, uniq: list[int], reqs: torch.Tensor, positions: torch.Tensor,
                 token_ids: torch.Tensor, store: LatentStore | None) -> DecodeOutput:
        """Run ``n`` query tokens; query ``i`` belongs to ``reqs[i]`` at ``positions[i]``.

        ``uniq`` lists the distinct requests in order; each one's queries are contiguous and its
        positions continue its history. State (lengths, index keys) is committed only at the end.
        """
        g = self.geom
        if int(token_ids.min()) < 0 or int(token_ids.max()) >= g.vocab:
            raise ShapeError(f"token ids must be in [0, {g.vocab})")
        st = store if store is not None else self.store
        st.begin_step()
        n = token_ids.numel()
        sel = {r: reqs == r for r in uniq}
        new_keys: dict[int, list[torch.Tensor]] = {r: [] for r in uniq}
        h = self.embed[token_ids]
        attn_out = torch.empty(g.n_layers, n, g.hidden)
        topks: list[torch.Tensor] = []
        scores_out: list[torch.Tensor] = []
        scale = 1.0 / math.sqrt(g.qk_nope_dim + g.qk_rope_dim)
        topk = torch.empty(0)
        for layer, w in enumerate(self.layers):
            x = rms_norm(h)
            kv = x @ w.kv_a
            latent = torch.cat((rms_norm(kv[:, : g.kv_lora_rank]),
                                apply_rope(kv[:, g.kv_lora_rank:], positions, g.rope_theta)), -1)
            rows = pack_rows(latent, g.layout, g.qk_rope_dim, g.fp8_block)
            for r in uniq:  # the current token's row must be readable by its own attention
                st.write(layer, r, positions[sel[r]], rows[sel[r]])
            if w.index_q is not None:
                topk, scores = self._select(x, w, uniq, sel, positions, new_keys)
                topks.append(topk)
                scores_out.append(scores)
            q = (x @ w.q).view(n, g.n_heads, g.qk_nope_dim + g.qk_rope_dim)
            q_rope = apply_rope(q[..., g.qk_nope_dim:], positions, g.rope_theta)
            q_latent = torch.einsum("nhd,hdr->nhr", q[..., : g.qk_nope_dim], w.uk)
            attn = self.attn_shard
            valid = topk >= 0 if attn is None else attn.owns(topk)
            got = st.read_selected(layer, reqs, topk if attn is None else
                                   torch.where(valid, topk, -1))
            if got.dtype != torch.uint8 or got.shape != (n, g.index_topk, g.row_bytes):
                raise ShapeError(f"read_selected returned {got.dtype} {tuple(got.shape)}, "
                                 f"expected uint8 {(n, g.index_topk, g.row_bytes)}")
            sel_latent = unpack_rows(got, g.layout, g.kv_lora_rank, g.qk_rope_dim, g.fp8_block)
            if attn is None:
                o_lat = sparse_mla_attention(q_latent, q_rope, sel_latent, valid, scale)
            else:  # own rows' partial output, merged over the ranks
                part, lse = sparse_mla_attention_lse(q_latent, q_rope, sel_latent, valid, scale)
                o_lat = merge_partials(attn.all_gather(part.contiguous()),
                                       attn.all_gather(lse.contiguous()))
            o = torch.einsum("nhr,hrv->nhv", o_lat, w.uv).reshape(n, -1) @ w.o
            attn_out[layer] = o
            h = h + o
        logits = rms_norm(h) @ self.lm_head
        shard = self.index_shard
        for r in uniq:
            old = self._index_keys.get(r)
            if shard is not None:  # a TP rank keeps the keys of its own positions only
                own = shard.owns(positions[sel[r]])
                new_keys[r] = [k[own] for k in new_keys[r]]
            self._index_keys[r] = [k if old is None else torch.cat((old[i], k))
                                   for i, k in enumerate(new_keys[r])]
            self._lengths[r] = self.length(r) + int(sel[r].sum())
        return DecodeOutput(logits, attn_out, torch.stack(topks), scores_out)

    def _select(self, x: torch.Tensor, w: _LayerWeights, uniq: list[int],
                sel: dict[int, torch.Tensor], positions: torch.Tensor,
                new_keys: dict[int, list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer of a group leader: append the queries' keys, score, top-k (causal)."""
        g = self.geom
        e = g.qk_rope_dim
        n = x.shape[0]
        k_new = x @ w.index_k
        k_new = torch.cat((apply_rope(k_new[:, :e], positions, g.rope_theta), k_new[:, e:]), -1)
        q = (x @ w.index_q).view(n, g.index_n_heads, g.index_head_dim)
        q = torch.cat((apply_rope(q[..., :e], positions, g.rope_theta), q[..., e:]), -1)
        wts = x @ w.index_w
        width = int(positions.max()) + 1
        group = len(new_keys[uniq[0]])
        shard = self.index_shard
        # columns scored: every position, or a TP rank's own, ascending
        cols = torch.arange(width)
        if shard is not None:
            cols = cols[shard.owns(cols)]
        scores = torch.full((n, cols.numel()), -math.inf)
        for r in uniq:
            m = sel[r]
            old = self._index_keys.get(r)
            fresh = k_new[m]
            if shard is not None:
                fresh = fresh[shard.owns(positions[m])]
            keys = fresh if old is None else torch.cat((old[group], fresh))
            new_keys[r].append(k_new[m])
            s = indexer_scores(q[m], wts[m], keys)
            scores[m, : s.shape[1]] = s
        # A query at position p sees 0..p: later prompt positions of the same batch are masked.
        lengths = positions + 1
        scores = scores.masked_fill(cols[None, :] >= lengths[:, None], -math.inf)
        if shard is not None:
            from ulacache.indexer import sharded_topk

            return sharded_topk(scores, cols, lengths, g.index_topk, shard.all_gather), scores
        return self.select(scores, lengths, g.index_topk), scores
