"""The tensors of one selection group, as one typed record: what the fused kernels take.

:class:`ulacache.group.SelectionGroup` owns its state and its torch path; the fused engine
(:mod:`ulacache.kernels.fused_access`, :mod:`ulacache.kernels.fused_release`) gets this record
instead of the group, so the kernels see plain tensors with declared shapes and no private
field of another class. The tensors are allocated once, at the group's construction, and never
rebound (a captured CUDA graph holds their addresses), so the record stays valid for the
group's life.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .pblru import ReplacementPolicy


@dataclass(frozen=True)
class GroupTables:
    """One selection group's state (``N`` = ``n_logical`` addresses, ``G`` GPU and ``C`` CPU
    slots, ``L`` layers; the extra last entry of each table is a scratch entry masked writes
    land in).

    Attributes
    ----------
    loc : ``int32 [N + 1]``: address -> slot (``[0, G)`` GPU, ``G + c`` CPU slot ``c``),
        ``-1`` unmapped.
    claim : ``int32 [N + 1]``: per-call dedup scratch (first position naming an address),
        reset to its sentinel after every call; may be shared by the groups of a space.
    gpu_owner : ``int32 [G + 1]``: GPU slot -> address, ``-1`` free. (CPU slots have no
        reverse map: ``check_integrity`` derives it from ``loc`` and ``shadow``.)
    shadow : ``int32 [G + 1]``: GPU slot -> CPU slot of its row's shadow, ``-1`` none (row
        born on the GPU, or slot free), ``-2`` none (row has been in the CPU tier).
    shadows : whether promotions keep shadows (``ulacache.group.SelectionGroup``).
    reclaim_cursor : ``int64 []``: the GPU slot the next reclaim of shadows scans from.
    counters : ``int64 [len(COUNTERS)]``: the group's counters (``ulacache.group.COUNTERS``).
    gpu, cpu : ``uint8 [L, G + 1, row_bytes]``, ``[L, C + 1, row_bytes]``: the tiers' rows.
    cpu_free : ``int32 [C + 1]``: the CPU free stack; ``cpu_top``: ``int64 []``, its height.
    policy : the GPU tier's replacement policy (PB-LRU for the fused path).
    """

    loc: torch.Tensor
    claim: torch.Tensor
    gpu_owner: torch.Tensor
    shadow: torch.Tensor
    shadows: bool
    reclaim_cursor: torch.Tensor
    counters: torch.Tensor
    gpu: torch.Tensor
    cpu: torch.Tensor
    cpu_free: torch.Tensor
    cpu_top: torch.Tensor
    policy: ReplacementPolicy
    n_logical: int
    gpu_slots: int
    cpu_slots: int
    max_call: int
    device: torch.device
