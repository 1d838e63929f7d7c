"""TP mode under SGLang 0.5.23: process-group helpers, the buffer-size rule, and the top-k
hook TP mode adds beside the class swaps.

Process groups. The ranks that stripe one address space are SGLang's ``get_dp_tp_group()``
(the attention-TP group with attention DP, else the whole TP group; research note §5). Its
``cpu_group`` (gloo) carries start-up exchanges (peer handles) and the allocator's agreement
(:func:`agree`); its device group carries the per-step collectives (:func:`all_gather_into`:
``GroupCoordinator.all_gather_into_tensor`` on CUDA, pynccl and graph-capturable; plain
``torch.distributed.all_gather_into_tensor`` on the gloo device group on CPU, where SGLang's
custom op has no CPU kernel).

Sizing (``1/P`` of the latent per token, the local buffer as fixed overhead, the buffers' maps)
is the sizing hook's (:mod:`ulacache.patches.sglang_sizing`), which serves both modes and uses
:func:`resolve_buffer_slots` and :data:`SIZED` from here.

Hook (registered with the class swaps, a no-op outside TP mode):

* AROUND ``DSAIndexerMetadata.topk_transform`` (:func:`topk_transform_around`, only with
  ``shard_indexer``): the paged decode/verify top-k becomes the exact sharded merge of
  :mod:`ulacache.indexer` (rank ``r`` ranks the columns ``j`` with ``j % P == r``, one
  all-gather of ``[T, K]`` int64 candidates, the same answer on every rank).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ulacache.config import SGLangOptions
from ulacache.errors import ConfigError
from ulacache.indexer import shard_columns, sharded_topk

logger = logging.getLogger(__name__)

TP_SIZES = (2, 4, 8)
"""Legal stripe widths: ``P`` must divide SGLang's 64-token page (so ``loc % P == pos % P``
and owners follow positions) and the core's ``tp_size`` is at most 8."""

DEFAULT_TOP_K = 2048
"""Top-k of DeepSeek-V3.2 / GLM-5.x (``index_topk``), used to size the buffer when the model
config is not reachable; the coordinator checks the real value at start-up."""

@dataclass(frozen=True)
class TPActive:
    """The TP pool of this process: its ``group`` (a GroupCoordinator) and whether the top-k
    hook shards the merge (``shard_indexer``)."""

    group: Any
    shard_indexer: bool


@dataclass(frozen=True)
class TPSizing:
    """What the sizing hook charged in this process: the TP pool allocates exactly this
    buffer when its group has ``tp_size`` ranks."""

    tp_size: int
    buffer_slots: int


ACTIVE: TPActive | None = None
"""Set by the TP pool of this process (the top-k hook reads it); ``None`` before."""

SIZED: TPSizing | None = None
"""Set by the sizing hook in TP mode (the TP pool reads it); ``None`` before."""


# -- process groups ------------------------------------------------------------------------
def tp_group():
    """The ranks that stripe one address space: SGLang's ``get_dp_tp_group()``."""
    from sglang.srt.layers.dp_attention import get_dp_tp_group

    return get_dp_tp_group()


def all_gather_into(grp, out: torch.Tensor, inp: torch.Tensor) -> None:
    """``out`` (flat ``[P * n]``) = every rank's flat ``inp`` ``[n]`` in rank order, on the
    group's device collective (graph-capturable on CUDA). On CPU, SGLang's custom op has no
    kernel: plain ``torch.distributed`` on the gloo device group; any other device (CUDA, the
    rehearsal's meta) through the group's own ``all_gather_into_tensor``."""
    if out.device.type != "cpu":
        grp.all_gather_into_tensor(out, inp)
    else:
        import torch.distributed as dist

        dist.all_gather_into_tensor(out, inp, group=grp.device_group)


def all_gather_stack(grp, t: torch.Tensor) -> torch.Tensor:
    """``[P, *t.shape]``: every rank's ``t`` (same shape and dtype on every rank)."""
    src = t.contiguous()
    out = torch.empty((grp.world_size, *src.shape), dtype=src.dtype, device=src.device)
    all_gather_into(grp, out.view(-1), src.view(-1))
    return out


def agree(grp, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (an all-reduce MIN over the gloo ``cpu_group``): the
    allocator's decisions must be the same on every rank, or the lockstep schedulers diverge.
    A group with its own ``agree`` (``ulacache rehearse``'s in-process ranks) answers itself."""
    if hasattr(grp, "agree"):
        return grp.agree(ok)
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=grp.cpu_group)
    return bool(flag.item())


# -- sizes ---------------------------------------------------------------------------------
def resolve_buffer_slots(opts: SGLangOptions, max_running_requests: int | None, top_k: int,
                         draft_tokens: int) -> int:
    """Buffer rows per rank, per selection group, per layer: ``buffer_slots`` when given, else
    ``max_running_requests x max(1, draft_tokens) x (top_k + 1)`` (one step's selections and new
    tokens may all be peers' rows). Raises :class:`ConfigError` when neither is known."""
    if opts.buffer_slots is not None:
        return opts.buffer_slots
    if not max_running_requests:
        raise ConfigError(
            "--ulacache-config mode 'tp' sizes each rank's local buffer as "
            "max_running_requests x draft tokens x (top-k + 1), so it needs "
            "--max-running-requests; or set 'buffer_slots' in --ulacache-config")
    return int(max_running_requests) * max(1, int(draft_tokens)) * (int(top_k) + 1)


def draft_tokens() -> int:
    """Tokens per request per step under speculative decoding (0 without it)."""
    try:
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        if not getattr(spec, "speculative_algorithm", None):
            return 0
        return int(getattr(spec, "speculative_num_draft_tokens", 0) or 0)
    except (ImportError, ValueError, AttributeError):
        return 0


def require_topk_agreement() -> None:
    """Raise :class:`ConfigError` unless SGLang broadcasts the indexer's top-k from TP rank 0
    (``SGLANG_DSA_TOPK_BROADCAST=1``): every rank must plan the same addresses, on every path
    (the sharded merge covers paged decode/verify only, not the ragged prefill top-k)."""
    from sglang.srt.environ import envs

    if not envs.SGLANG_DSA_TOPK_BROADCAST.get():
        raise ConfigError(
            "--ulacache-config mode 'tp' needs SGLANG_DSA_TOPK_BROADCAST=1 in the launch "
            "environment: every TP rank must select the same top-k (prefill included), or the "
            "ranks' slot-table exchange would pair rows with the wrong tokens")


# -- hooks ---------------------------------------------------------------------------------
def sharded_topk_positions(grp, logits: torch.Tensor, lengths: torch.Tensor,
                           k: int) -> torch.Tensor:
    """``int32 [T, k]`` top-k positions of ``logits`` ``float [T, W]`` (columns ``j <
    lengths[t]`` eligible), this rank ranking its columns ``j % P == rank`` and the group
    merging exactly (:func:`ulacache.indexer.sharded_topk`): ascending, ``-1`` padded, the same
    on every rank whatever the other ranks' scores for columns they do not own."""
    P, r = grp.world_size, grp.rank_in_group
    local, positions = shard_columns(logits, r, P)
    out = sharded_topk(local, positions, lengths.to(torch.int64), k,
                       lambda cand: all_gather_stack(grp, cand))
    return out.to(torch.int32)


def topk_transform_around(original_fn, self, logits, topk, *args, **kwargs):
    """AROUND ``DSAIndexerMetadata.topk_transform``: with TP ``shard_indexer``, the plain paged
    call (``_get_topk_paged``: unfused, no ``ks`` / offsets) becomes the sharded merge; every
    other call (ragged prefill chunks, whose chunking may differ across ranks) is untouched."""
    active = ACTIVE
    grp = active.group if active is not None else None
    plain = not args and all(v is None for v in kwargs.values())
    if not (active is not None and active.shard_indexer and grp is not None and plain and
            getattr(self, "force_unfused_topk", False) and logits.dim() == 2):
        return original_fn(self, logits, topk, *args, **kwargs)
    return sharded_topk_positions(grp, logits, self.get_seqlens_expanded(), int(topk))


TP_HOOKS: dict[str, tuple[Any, str]] = {
    "sglang.srt.layers.attention.dsa.dsa_indexer_metadata.DSAIndexerMetadata.topk_transform":
        (topk_transform_around, "around"),
}
"""The hook only TP mode needs (``verify.TP_HOOK_TARGETS`` lists it with the sizing hook's
target, which TP mode cannot run without either)."""
