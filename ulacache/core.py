"""The interface an engine seam calls, declared once: :class:`Core`.

Both address spaces implement it: :class:`ulacache.space.AddressSpace` (one GPU, DP) and
:class:`ulacache.tp.TPAddressSpace` (one rank of a TP group striping one address space). The
SGLang seam chooses the class once, at construction, and from then on calls only these names,
so the two real differences between the modes live in the core, where they are unit-tested:

* what a round can hold: :meth:`Core.prefill_fits` (DP: the batch fits the GPU pool; TP: each
  rank's own share its pool, its peers' share its buffer), :meth:`Core.round_fits` (the same
  question of a set of selected addresses: a prefill split into rounds) and
  :meth:`Core.check_step_capacity` (one decode step's selections);
* cross-rank agreement: TP's mutating calls are collectives that reach the same verdict on
  every rank (see :mod:`ulacache.tp`), :meth:`Core.agree` lets the engine agree on its own
  yes/no (e.g. whether its logical allocation succeeded) and :meth:`Core.verdict` on a
  host-side check's error; DP's are local.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .config import UlaCacheConfig
from .health import CounterMonitor


@runtime_checkable
class Core(Protocol):
    """What both address spaces provide (shapes and semantics: their own docstrings)."""

    config: UlaCacheConfig
    groups: list
    layer_to_group: dict[int, int]
    n_logical: int

    @property
    def validate(self) -> bool: ...

    @property
    def round_serial(self) -> int: ...

    @property
    def health(self) -> CounterMonitor: ...

    def set_stream(self, stream) -> None: ...

    def prefill_fits(self, seq_lens: list[int]) -> bool: ...

    def round_fits(self, addrs: torch.Tensor) -> bool: ...

    def check_step_capacity(self, requests: int, steps: int, top_k: int) -> None: ...

    def agree(self, ok: bool) -> bool: ...

    def verdict(self, check) -> None: ...

    def stage_rows(self, seq_lens: list[int]) -> int: ...

    def begin_round(self) -> None: ...

    def check_place(self, addrs: torch.Tensor) -> None: ...

    def place(self, addrs: torch.Tensor) -> torch.Tensor: ...

    def release(self, addrs: torch.Tensor) -> None: ...

    def write(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None: ...

    def read(self, layer: int, addrs: torch.Tensor) -> torch.Tensor: ...

    def plan(self, group: int, addrs: torch.Tensor, out: torch.Tensor | None = None
             ) -> torch.Tensor: ...

    def load(self, layer: int) -> None: ...

    def gather(self, layer: int, addrs: torch.Tensor, dst: torch.Tensor,
               dst_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def access(self, group: int, addrs: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor: ...

    def distinct(self, table: torch.Tensor, size: int, first: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def access_distinct(self, group: int, table: torch.Tensor, first: int = 0) -> None: ...

    def prefetch(self, group: int, addrs: torch.Tensor, budget: torch.Tensor) -> None: ...

    def use_prefetch_tables(self) -> None: ...

    def translate(self, group: int, addrs: torch.Tensor) -> torch.Tensor: ...

    def counters(self) -> list[dict[str, int]]: ...

    def check_integrity(self, live: torch.Tensor | None = None) -> None: ...
