"""Exact indexer top-k, unsharded and sharded across a TP group.

In TP mode the ``P`` ranks of a group stripe every request's token history (address ``t`` lives on
rank ``t mod P``, :mod:`ulacache.address`), and the indexer keys are striped the same way, so a
rank can score only the tokens it owns. The global top-k is assembled in three steps:

1. :func:`local_candidates`: each rank encodes its eligible columns as unique int64 **order
   keys** and keeps its local top-``k`` keys (``8 * k`` bytes per batch row);
2. the TP group's all-gather stacks the ``P`` candidate tensors (``[P, bs, k]``);
3. :func:`merge_candidates`: every rank takes the top-``k`` of the ``P * k`` keys and decodes them.

Exactness: a column in the global top-``k`` has fewer than ``k`` columns above it globally, hence
fewer than ``k`` above it on its own rank, so it is among that rank's local top-``k``. The order
keys are unique per eligible column (they embed the position), so neither step depends on
``torch.topk``'s unspecified tie order, and every rank computes the same result, **identical to
the unsharded** :func:`topk_reference` (= :func:`ulacache.oracle.refmodel.select_topk`),
tie-breaking included. Nothing here needs ``j % P`` striping: any partition of the columns into
disjoint rank-owned sets gives the same answer (:func:`shard_columns` builds the ``j % P`` one).

Order (the reference's, a stable descending sort): higher score first, ties to the earlier
(smaller) position. Only columns ``0 <= j < lengths[b]`` are eligible; an eligible ``-inf`` still
beats every ineligible column. NaN follows ``torch.sort``: a NaN score (any sign or payload)
ranks above ``+inf``, NaNs tie among themselves (earlier position wins). ``-0.0`` ties with
``0.0``. Output: int64 ``[bs, k]``, the chosen positions sorted ascending, then ``-1`` padding
where fewer than ``k`` columns are eligible.

Order key of an eligible column with score ``s`` (float32; fp16/bf16 widen exactly) and position
``j`` (``0 <= j < 2**32``)::

    key = ord32(s) * 2**32 + (2**32 - 1 - j)        # int64, unique per position

where ``ord32`` is the sign-flip bit trick (IEEE bits as int32, negatives with their 31 magnitude
bits inverted) after mapping ``-0.0 -> 0.0`` and every NaN to ``2**31 - 1`` (above ``+inf``).
Ineligible columns get :data:`MASKED_KEY` (``int64`` min), below every eligible key, and decode to
``-1``. float64 scores are refused by the key path (narrowing to float32 could merge distinct
scores and change the answer).

The device path (everything but :func:`topk_reference` and :func:`exchange_cost`) has fixed output
shapes that depend only on the input shapes and ``k``, and issues no host synchronisation
(no ``.item()``, ``.tolist()``, ``nonzero``, boolean indexing), so it can be captured in a CUDA
graph. Argument checks read only shapes, dtypes and devices (host metadata); values are not
checked (that would sync): positions must be ``< 2**32`` and distinct within a row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from ulacache.errors import ShapeError

__all__ = [
    "MASKED_KEY",
    "CANDIDATE_BYTES",
    "INDEX_KEY_BYTES",
    "topk_reference",
    "order_keys",
    "decode_keys",
    "topk_exact",
    "shard_columns",
    "local_candidates",
    "merge_candidates",
    "sharded_topk",
    "ExchangeCost",
    "exchange_cost",
]

MASKED_KEY = torch.iinfo(torch.int64).min
"""Order key of an ineligible column: below every eligible key; decodes to position ``-1``."""
CANDIDATE_BYTES = 8
"""Bytes per exchanged candidate: one int64 order key (score order + position)."""
INDEX_KEY_BYTES = 132
"""Bytes of one indexer key per token per layer (128 fp8 values + one fp32 scale), as SGLang
stores it for DeepSeek-V3.2 / GLM-5 (``ModelGeometry.index_key_bytes``)."""

_LOW = (1 << 32) - 1  # low-word mask; also the tie-break flip constant
_NAN_ORD = (1 << 31) - 1  # ord32 of NaN: above ord32(+inf) = 0x7F800000, as torch.sort ranks NaN
_KEY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tiebreak(x: torch.Tensor) -> torch.Tensor:
    # 2**32-1 - j: a smaller position gets a larger low word, so it wins a score tie. An involution:
    # the same map decodes the position from the low word.
    return _LOW - x


# ---- reference -------------------------------------------------------------------------------

def topk_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Reference top-``k``: the semantics of :func:`ulacache.oracle.refmodel.select_topk`.

    ``scores`` float ``[bs, L]`` (any float dtype), ``lengths`` integer ``[bs]`` (columns
    ``j < lengths[b]`` are eligible; lengths may be ``<= 0`` or ``> L``), ``k >= 0``. Returns int64
    ``[bs, k]``: chosen positions ascending, then ``-1``. A stable descending sort, so ties go to
    the earlier position and NaN ranks first (``torch.sort``'s NaN order). Host-side oracle for
    tests (a full stable sort per row; it issues no sync either).
    """
    bs, width = _check_scores(scores, lengths, k, key_path=False)
    valid = torch.arange(width, device=scores.device)[None, :] < lengths[:, None]
    masked = torch.where(valid, scores, torch.full_like(scores, -math.inf))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : min(k, width)]
    # masked columns sort after every eligible one (eligible -inf included: stable, smaller j)
    chosen = torch.where(order < lengths[:, None], order, torch.full_like(order, -1))
    if chosen.shape[1] < k:
        chosen = torch.cat((chosen, chosen.new_full((bs, k - chosen.shape[1]), -1)), dim=1)
    return _ascending(chosen)


# ---- order keys ------------------------------------------------------------------------------

def order_keys(scores: torch.Tensor, positions: torch.Tensor,
               lengths: torch.Tensor) -> torch.Tensor:
    """Unique int64 order keys of ``scores`` float32/fp16/bf16 ``[bs, n]`` at ``positions`` int64
    ``[n]``, or ``[bs, n]`` when each row's columns are other positions (page striping,
    :mod:`ulacache.index_stripe`); ``-1`` = padding column, never eligible.

    Column ``i`` of row ``b`` is eligible iff ``0 <= positions[(b,) i] < lengths[b]``. Returns int64
    ``[bs, n]``: eligible keys compare exactly as the reference order (higher score, then smaller
    position), ineligible columns hold :data:`MASKED_KEY`. Graph-safe.
    """
    s = scores.to(torch.float32)  # exact for fp16 / bf16
    # -0.0 ties with 0.0 in torch.sort, but its bits would order it below
    s = torch.where(s == 0, torch.zeros_like(s), s)
    bits = s.view(torch.int32)
    ord32 = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # sign-flip: int order == float order
    ord32 = torch.where(torch.isnan(s), torch.full_like(ord32, _NAN_ORD), ord32)
    pos = positions.to(torch.int64)
    pos = pos[None, :] if pos.dim() == 1 else pos
    key = ord32.to(torch.int64) * (1 << 32) + _tiebreak(pos)
    eligible = (pos >= 0) & (pos < lengths.to(torch.int64)[:, None])
    return torch.where(eligible, key, torch.full_like(key, MASKED_KEY))


def decode_keys(keys: torch.Tensor) -> torch.Tensor:
    """Positions (int64, same shape) of order keys; :data:`MASKED_KEY` decodes to ``-1``."""
    pos = _tiebreak(keys & _LOW)
    return torch.where(keys == MASKED_KEY, torch.full_like(pos, -1), pos)


def _ascending(pos: torch.Tensor) -> torch.Tensor:
    """Sort int64 positions ascending per row with ``-1`` entries moved to the end."""
    big = torch.iinfo(torch.int64).max
    asc = torch.sort(torch.where(pos < 0, torch.full_like(pos, big), pos), dim=-1).values
    return torch.where(asc == big, torch.full_like(asc, -1), asc)


def _top_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` keys per row of int64 ``[bs, n]`` -> ``[bs, k]``, padded with MASKED_KEY when
    ``n < k``. Keys are unique except MASKED_KEY, which all decode alike, so topk's tie order is
    irrelevant; unsorted output (callers sort positions, or the merge re-ranks)."""
    if keys.shape[1] < k:
        keys = torch.cat((keys, keys.new_full((keys.shape[0], k - keys.shape[1]), MASKED_KEY)), 1)
    return torch.topk(keys, k, dim=-1, largest=True, sorted=False).values


def topk_exact(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Fast exact unsharded top-``k``: one ``torch.topk`` over unique order keys, then a sort of
    ``k`` positions per row.

    ``scores`` float32/fp16/bf16 ``[bs, L]``, ``lengths`` integer ``[bs]``, ``k >= 0`` -> int64
    ``[bs, k]``, equal to :func:`topk_reference`. Graph-safe (fixed shapes, no sync).
    """
    _check_scores(scores, lengths, k, key_path=True)
    positions = torch.arange(scores.shape[1], device=scores.device)
    return _ascending(decode_keys(_top_keys(order_keys(scores, positions, lengths), k)))


# ---- sharded ---------------------------------------------------------------------------------

def shard_columns(scores: torch.Tensor, rank: int,
                  tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns of ``scores`` ``[bs, L]`` that ``rank`` owns under ``j % tp_size`` striping.

    Returns ``(local_scores [bs, ceil(L/P)], local_positions int64 [ceil(L/P)])``: local column
    ``i`` is global column ``rank + i * P``; columns past ``L`` (ranks ``>= L % P`` when ``P`` does
    not divide ``L``) have position ``-1`` (never eligible) and score ``-inf``. For tests and for
    engines that compute full scores; a sharded engine scores its own keys directly.
    """
    if scores.dim() != 2:
        raise ShapeError(f"scores must be [bs, L], got shape {tuple(scores.shape)}")
    if not (isinstance(tp_size, int) and tp_size >= 1):
        raise ShapeError(f"tp_size must be a positive int, got {tp_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < tp_size):
        raise ShapeError(f"rank must be in [0, {tp_size}), got {rank!r}")
    bs, width = scores.shape
    n_local = -(-width // tp_size)
    padded = torch.nn.functional.pad(scores, (0, n_local * tp_size - width), value=-math.inf)
    local = padded.reshape(bs, n_local, tp_size)[:, :, rank].contiguous()
    pos = torch.arange(n_local, device=scores.device) * tp_size + rank
    return local, torch.where(pos < width, pos, torch.full_like(pos, -1))


def local_candidates(local_scores: torch.Tensor, local_positions: torch.Tensor,
                     lengths: torch.Tensor, k: int) -> torch.Tensor:
    """A rank's top-``k`` candidates: int64 order keys ``[bs, k]`` (unsorted; :data:`MASKED_KEY`
    where the rank has fewer than ``k`` eligible columns).

    ``local_scores`` float32/fp16/bf16 ``[bs, n]`` of the rank's columns, ``local_positions``
    int64 ``[n]`` (or ``[bs, n]``, per row) their global positions (``-1`` = padding),
    ``lengths`` integer ``[bs]`` global.
    The payload to all-gather is this tensor: ``CANDIDATE_BYTES * k`` (8k) bytes per batch row,
    fixed shape. ``k`` must be the global ``k`` (a smaller local ``k`` loses exactness when one
    rank holds most of the winners). Graph-safe.
    """
    _check_scores(local_scores, lengths, k, key_path=True)
    if local_positions.shape not in ((local_scores.shape[1],), local_scores.shape) or \
            local_positions.dtype.is_floating_point:
        raise ShapeError(f"local_positions must be integer [{local_scores.shape[1]}] or "
                         f"{list(local_scores.shape)}, got {local_positions.dtype} "
                         f"{tuple(local_positions.shape)}")
    if local_positions.device != local_scores.device:
        raise ShapeError(f"local_positions on {local_positions.device}, scores on "
                         f"{local_scores.device}")
    return _top_keys(order_keys(local_scores, local_positions, lengths), k)


def merge_candidates(gathered: torch.Tensor, k: int, *, by_score: bool = False) -> torch.Tensor:
    """Global top-``k`` from all ranks' candidates: ``gathered`` int64 ``[P, bs, k_local]``
    (``k <= k_local``; the stacked outputs of :func:`local_candidates`) -> int64 ``[bs, k]``,
    positions ascending then ``-1``; equal to :func:`topk_reference` on the full scores, on every
    rank, whatever the order of the ``P`` slices. Graph-safe.

    ``by_score``: the same positions in score order instead (higher score first, a tie to the
    earlier position, then ``-1``), the order ``torch.topk(sorted=True)`` gives on distinct
    scores. A consumer that sums over the selection in the order given (SGLang's torch sparse
    attention) rounds alike only when handed the same order.
    """
    if gathered.dim() != 3 or gathered.dtype != torch.int64:
        raise ShapeError(f"gathered must be int64 [P, bs, k], got {gathered.dtype} "
                         f"{tuple(gathered.shape)}")
    if not (isinstance(k, int) and 0 <= k <= gathered.shape[2]):
        raise ShapeError(f"k must be an int in [0, {gathered.shape[2]}] (the candidates per rank),"
                         f" got {k!r}")
    n_ranks, bs, k_local = gathered.shape
    flat = gathered.permute(1, 0, 2).reshape(bs, n_ranks * k_local)
    if by_score:  # descending keys = descending score, then ascending position; masked last
        return decode_keys(torch.topk(flat, k, dim=-1, largest=True, sorted=True).values)
    return _ascending(decode_keys(_top_keys(flat, k)))


def sharded_topk(local_scores: torch.Tensor, local_positions: torch.Tensor,
                 lengths: torch.Tensor, k: int,
                 all_gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One rank's view of the exact sharded top-``k``: local candidates, ``all_gather`` (the TP
    group's collective, ``Tensor[bs, k] -> Tensor[P, bs, k]``), merge. Returns int64 ``[bs, k]``,
    the same on every rank and equal to :func:`topk_reference` on the unsharded scores.
    Graph-safe when ``all_gather`` is (NCCL all-gather into a fixed buffer is).
    """
    cand = local_candidates(local_scores, local_positions, lengths, k)
    gathered = all_gather(cand)
    if gathered.dim() != 3 or gathered.shape[1:] != cand.shape:
        raise ShapeError(f"all_gather must return [P, {cand.shape[0]}, {k}], got "
                         f"{tuple(gathered.shape)}")
    return merge_candidates(gathered, k)


# ---- cost ------------------------------------------------------------------------------------

class ExchangeCost(NamedTuple):
    """Cost of one sharded top-k call and the index-key memory sharding saves, per rank.

    ``payload_bytes``: this rank's candidate tensor (``bs * 8k``); ``send_bytes`` /
    ``recv_bytes``: link traffic per rank of an all-gather, ``(P - 1) * payload_bytes`` each (ring
    or direct; bandwidth-optimal); ``gathered_bytes``: the all-gather output buffer
    (``P * payload_bytes``). ``key_bytes_replicated`` / ``key_bytes_sharded``: indexer-key bytes per
    token per layer held by one rank with every key replicated vs striped (``132 / P``);
    ``key_bytes_saved`` is their difference.
    """

    payload_bytes: int
    send_bytes: int
    recv_bytes: int
    gathered_bytes: int
    key_bytes_replicated: float
    key_bytes_sharded: float
    key_bytes_saved: float


def exchange_cost(bs: int, k: int, tp_size: int,
                  index_key_bytes: int = INDEX_KEY_BYTES) -> ExchangeCost:
    """:class:`ExchangeCost` for ``bs`` rows, top-``k``, ``tp_size`` ranks (pure function)."""
    for name, v, lo in (("bs", bs, 0), ("k", k, 0), ("tp_size", tp_size, 1),
                        ("index_key_bytes", index_key_bytes, 0)):
        if not isinstance(v, int) or v < lo:
            raise ShapeError(f"{name} must be an int >= {lo}, got {v!r}")
    payload = bs * k * CANDIDATE_BYTES
    sharded = index_key_bytes / tp_size
    return ExchangeCost(payload, (tp_size - 1) * payload, (tp_size - 1) * payload,
                        tp_size * payload, float(index_key_bytes), sharded,
                        index_key_bytes - sharded)


# ---- checks (host metadata only: shapes, dtypes, devices) ------------------------------------

def _check_scores(scores: torch.Tensor, lengths: torch.Tensor, k: int,
                  key_path: bool) -> tuple[int, int]:
    if scores.dim() != 2 or not scores.dtype.is_floating_point:
        raise ShapeError(f"scores must be float [bs, L], got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    if key_path and scores.dtype not in _KEY_DTYPES:
        raise ShapeError(f"scores must be float32, float16 or bfloat16 for exact order keys, got "
                         f"{scores.dtype} (narrowing could merge distinct scores)")
    bs = scores.shape[0]
    if (lengths.shape != (bs,) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool
            or lengths.is_complex()):
        raise ShapeError(f"lengths must be integer [{bs}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if lengths.device != scores.device:
        raise ShapeError(f"lengths on {lengths.device}, scores on {scores.device}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ShapeError(f"k must be an int >= 0, got {k!r}")
    return bs, scores.shape[1]
