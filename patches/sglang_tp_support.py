"""TP mode under SGLang 0.5.23: the device collectives of the striping group, the top-k
agreement check, and the top-k hook TP mode adds beside the class swaps.

Process groups. The ranks that stripe one address space are SGLang's ``get_dp_tp_group()``
(:func:`ulacache.patches.launch.tp_group`; research note §5). Its ``cpu_group`` (gloo) carries
start-up exchanges (peer handles) and the allocator's agreement (the peers' ``agree``); its
device group carries the per-step collectives (:func:`all_gather_into`:
``GroupCoordinator.all_gather_into_tensor`` on CUDA, pynccl and graph-capturable; plain
``torch.distributed.all_gather_into_tensor`` on the gloo device group on CPU, where SGLang's
custom op has no CPU kernel).

Sizing (``1/P`` of the latent per token, the local buffer as fixed overhead, the buffers' maps)
is the sizing hook's (:mod:`ulacache.patches.sglang_sizing`), from the launch plan
(:mod:`ulacache.patches.launch`) the pool builds from too.

Hook (registered with the class swaps, a no-op outside TP mode):

* AROUND ``DSAIndexerMetadata.topk_transform`` (:func:`topk_transform_around`, only with
  ``shard_indexer``): the paged decode/verify top-k becomes the exact sharded merge of
  :mod:`ulacache.indexer` (rank ``r`` ranks the columns ``j`` with ``j % P == r``, one
  all-gather of ``[T, K]`` int64 candidates, the same answer on every rank).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ulacache.errors import ConfigError
from ulacache.indexer import shard_columns, sharded_topk

from .launch import sglang_options, tp_group

logger = logging.getLogger(__name__)


# -- process groups ------------------------------------------------------------------------
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


def all_reduce_sum(grp, t: torch.Tensor) -> None:
    """``t`` (contiguous, integer) summed in place over the group: ``torch.distributed`` on
    the group's device group (NCCL on CUDA, gloo on CPU). Eager only (the prefill read of
    striped index-K); SGLang's own ``all_reduce`` may route to kernels made for activations."""
    import torch.distributed as dist

    dist.all_reduce(t, group=grp.device_group)


def all_gather_stack(grp, t: torch.Tensor) -> torch.Tensor:
    """``[P, *t.shape]``: every rank's ``t`` (same shape and dtype on every rank)."""
    src = t.contiguous()
    out = torch.empty((grp.world_size, *src.shape), dtype=src.dtype, device=src.device)
    all_gather_into(grp, out.view(-1), src.view(-1))
    return out


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


def sharding_group():
    """The group whose ranks merge the top-k (:func:`topk_transform_around`): SGLang's striping
    group when ``--ulacache-config`` says mode ``"tp"`` with ``shard_indexer``, else ``None``."""
    opts = sglang_options()
    return tp_group() if opts.mode == "tp" and opts.shard_indexer else None


def topk_transform_around(original_fn, self, logits, topk, *args, **kwargs):
    """AROUND ``DSAIndexerMetadata.topk_transform``: with TP ``shard_indexer``, the plain paged
    call (``_get_topk_paged``: unfused, no ``ks`` / offsets) becomes the sharded merge; every
    other call (ragged prefill chunks, whose chunking may differ across ranks) is untouched."""
    plain = not args and all(v is None for v in kwargs.values())
    grp = sharding_group() if plain and getattr(self, "force_unfused_topk", False) and \
        logits.dim() == 2 else None
    if grp is None:
        return original_fn(self, logits, topk, *args, **kwargs)
    return sharded_topk_positions(grp, logits, self.get_seqlens_expanded(), int(topk))


TP_HOOKS: dict[str, tuple[Any, str]] = {
    "sglang.srt.layers.attention.dsa.dsa_indexer_metadata.DSAIndexerMetadata.topk_transform":
        (topk_transform_around, "around"),
}
"""The hook only TP mode needs (``verify.TP_HOOK_TARGETS`` lists it with the sizing hook's
target, which TP mode cannot run without either)."""
