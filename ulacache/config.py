"""One frozen, validated configuration for the core.

Errors name the legal values, so a wrong JSON option (``--kv-backend ulacache`` takes its
settings from one JSON object) says what to write instead.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .errors import ConfigError
from .layout import RowLayout


@dataclass(frozen=True)
class UlaCacheConfig:
    """Sizes and policy of one rank's ulacache.

    Pools are per selection group: every group has ``gpu_slots`` GPU rows and ``cpu_slots`` CPU
    rows per layer, so a token's unique capacity is ``gpu_slots + cpu_slots``.
    """

    mode: str = "dp"  # "dp": one address space per rank; "tp": striped over tp_size ranks
    tp_size: int = 1
    layout: str = "bf16"  # "fp8" | "bf16" | "tiny"
    row_bytes: int | None = None  # only for layout "tiny"
    n_layers: int = 4
    layers_per_group: int = 1  # 1: one indexer per layer (DeepSeek-V3.2); 4: GLM-5.2 style
    gpu_slots: int = 1024
    cpu_slots: int = 4096
    page_size: int = 64  # SGLang allocates logical addresses in 64-token pages; 1 = tokens
    max_requests: int = 256
    max_batch: int = 64
    top_k: int = 2048
    n_buckets: int = 64  # PB-LRU recent buckets (n_b): recency resolution in rounds
    policy: str = "pblru"  # "pblru" | "lru" (exact LRU, pool-wide scan; the baseline)
    validate: bool = True  # host-side input checks outside graph capture
    fetch_cap: int = 0  # lookahead prefetch rows per step (0 = off)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.mode in ("dp", "tp"), f"mode must be 'dp' or 'tp', got {self.mode!r}")
        need(self.tp_size >= 1, "tp_size must be >= 1")
        need(self.mode == "tp" or self.tp_size == 1,
             f"mode 'dp' takes tp_size 1 (got {self.tp_size}); use mode 'tp' to stripe ranks")
        need(self.mode == "dp", "mode 'tp' is not implemented in this release; legal: 'dp'")
        _ = self.row_layout  # validates layout / row_bytes
        need(self.layout == "tiny" or self.row_bytes is None,
             f"row_bytes is only for layout 'tiny'; layout {self.layout!r} fixes it")
        need(self.n_layers >= 1, "n_layers must be >= 1")
        need(self.layers_per_group >= 1 and self.n_layers % self.layers_per_group == 0,
             f"layers_per_group ({self.layers_per_group}) must divide n_layers ({self.n_layers})")
        need(self.gpu_slots >= 1, "gpu_slots must be >= 1")
        need(self.cpu_slots >= 0, "cpu_slots must be >= 0")
        need(self.page_size >= 1, "page_size must be >= 1 (1 = token-granular, 64 = SGLang)")
        need(self.max_requests >= 1 and self.max_batch >= 1, "max_requests/max_batch >= 1")
        need(self.top_k >= 1, "top_k must be >= 1")
        need(self.n_buckets >= 2, f"n_buckets must be >= 2 (got {self.n_buckets})")
        need(self.policy in ("pblru", "lru"),
             f"policy must be 'pblru' or 'lru' (exact LRU baseline), got {self.policy!r}")
        need(self.fetch_cap >= 0, "fetch_cap must be >= 0")

    @property
    def row_layout(self) -> RowLayout:
        return RowLayout.named(self.layout, self.row_bytes)

    @property
    def n_groups(self) -> int:
        return self.n_layers // self.layers_per_group

    @property
    def unique_capacity(self) -> int:
        """Tokens the rank can hold: exclusive tiers, so GPU + CPU slots."""
        return self.gpu_slots + self.cpu_slots

    @property
    def n_logical_pages(self) -> int:
        """Logical pages: enough for full capacity plus one partial page per request."""
        return -(-self.unique_capacity // self.page_size) + self.max_requests

    def replace(self, **changes: Any) -> UlaCacheConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> UlaCacheConfig:
        legal = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - legal)
        if unknown:
            raise ConfigError(f"unknown ulacache option(s) {unknown}; legal: {sorted(legal)}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | None) -> UlaCacheConfig:
        if not text:
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"ulacache config is not valid JSON: {e}") from e
        if not isinstance(values, dict):
            raise ConfigError("ulacache config must be a JSON object, e.g. "
                              '\'{"gpu_slots": 65536, "cpu_slots": 262144}\'')
        return cls.from_dict(values)


@dataclass(frozen=True)
class SGLangOptions:
    """ulacache's settings under SGLang (``--ulacache-config '{...}'``). The GPU pool size comes
    from SGLang's memory budget; the CPU pool is ``cpu_ratio`` times it (exclusive tiers, so a
    rank holds ``(1 + cpu_ratio) x`` the GPU pool's tokens); the indexer cache is sized for all
    of them."""

    mode: str = "dp"
    cpu_ratio: int = 4  # CPU slots per GPU slot; host memory = cpu_ratio x GPU latent bytes
    n_buckets: int = 64
    policy: str = "pblru"
    validate: bool = False  # host-side checks on every step (debugging; syncs the GPU)
    fetch_cap: int = 0  # lookahead prefetch rows per step (0 = off)
    buffer_slots: int = 0  # TP local buffer rows per rank (TP mode only)

    def __post_init__(self) -> None:
        if self.mode != "dp":
            raise ConfigError(f"ulacache mode {self.mode!r} is not available with SGLang yet; "
                              "legal: 'dp' (with --tp 1 per attention group, or --dp-attention)")
        if not isinstance(self.cpu_ratio, int) or self.cpu_ratio < 0:
            raise ConfigError(f"cpu_ratio must be an integer >= 0, got {self.cpu_ratio!r}")
        if self.n_buckets < 2:
            raise ConfigError("n_buckets must be >= 2")
        if self.policy not in ("pblru", "lru"):
            raise ConfigError(f"policy must be 'pblru' or 'lru', got {self.policy!r}")
        if self.fetch_cap < 0 or self.buffer_slots < 0:
            raise ConfigError("fetch_cap and buffer_slots must be >= 0")

    @property
    def host_to_device_ratio(self) -> int:
        """Logical tokens per GPU slot, in HiSparse's terms (sizes the indexer cache)."""
        return 1 + self.cpu_ratio

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> SGLangOptions:
        values = dict(values or {})
        legal = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - legal)
        if unknown:
            raise ConfigError(f"unknown --ulacache-config key(s) {unknown}; legal: {sorted(legal)}")
        return cls(**values)


def validate_sglang_config(values: dict[str, Any]) -> SGLangOptions:
    """Validate the parsed ``--ulacache-config`` JSON object (called by the SGLang plugin)."""
    return SGLangOptions.from_dict(values)
