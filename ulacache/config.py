"""Typed, validated configuration (msgspec structs, as SGLang's own server args).

Every field is checked strictly on every construction (Python keyword arguments, a dict, or
JSON): ``1.5``, ``true``, ``"100"`` or ``null`` for an integer, ``"no"`` for a boolean, ``NaN``
or ``Infinity`` anywhere are refused, and the error names the key and its legal values. Keys that
nothing reads are refused too, so a setting cannot be believed to do something it does not.
"""

# No ``from __future__ import annotations``: msgspec reads the annotations at runtime.
import typing
from typing import Annotated, Any, Literal, Optional

import msgspec
from msgspec import Meta

from .errors import ConfigError
from .layout import RowLayout
from .pblru import DEFAULT_BUCKETS, POLICIES

# Row ids handed to attention are int32 and SGLang adds a page of offset: keep them in range.
MAX_GPU_SLOTS = 2**31 - 2**17
CALL_FLOOR = 8192
"""Entries a call can always take beyond the pools' size (:attr:`UlaCacheConfig.call_capacity`):
small pools still serve calls with padding and duplicates in one piece."""
MAX_CPU_SLOTS = 2**40

AccessPath = Literal["auto", "torch", "fused"]  # ulacache.group.ACCESS_PATHS
PolicyName = Literal[tuple(POLICIES)]  # type: ignore[valid-type]  # one registry: pblru.POLICIES
Layers = Annotated[int, Meta(ge=1, le=4096)]
Buckets = Annotated[int, Meta(ge=2, le=4096)]


def _legal(tp: Any) -> str:
    """Human wording of the values a field annotation admits."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_legal(inner[0])}, or null"
    if origin is Annotated:
        base, metas = args[0], [m for m in args[1:] if isinstance(m, Meta)]
        bounds = [f">= {m.ge}" for m in metas if m.ge is not None]
        bounds += [f"<= {m.le}" for m in metas if m.le is not None]
        return f"{_legal(base)} {' and '.join(bounds)}".strip()
    if origin is tuple:
        return f"a list, each {_legal(args[0])}"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    return getattr(tp, "__name__", repr(tp))


class _Checked(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base: strict per-field validation on every construction, dict and JSON constructors.

    An unknown keyword in Python construction is a ``TypeError`` naming it (Python's rule for
    any call); ``from_dict`` and ``from_json`` refuse unknown keys with a :class:`ConfigError`
    listing the legal ones."""

    _what = "ulacache config"

    def __post_init__(self) -> None:
        for f in msgspec.structs.fields(self):
            value = getattr(self, f.name)
            try:
                typed = msgspec.convert(value, f.type, strict=True)
            except msgspec.ValidationError as e:
                raise ConfigError(f"{self._what} key {f.name!r}: {e} (got {value!r}); legal: "
                                  f"{_legal(f.type)}") from None
            if isinstance(typed, (_Checked, tuple)) and type(value) is not type(typed):
                # a nested section given as a JSON object, a tuple as a list: store it typed
                # (the nested struct's own checks run as it is built)
                if isinstance(typed, _Checked):
                    typed = type(typed).from_dict(value)
                msgspec.structs.force_setattr(self, f.name, typed)
        self._check()

    def _check(self) -> None:
        """Checks that involve several fields (subclasses)."""

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in msgspec.structs.fields(cls)]

    @classmethod
    def from_dict(cls, values: Any):
        """Build from a mapping of keys to values; unknown keys are refused by name."""
        if values is None:
            values = {}
        if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
            raise ConfigError(f"{cls._what} must be a JSON object with string keys, got "
                              f"{type(values).__name__}")
        unknown = sorted(set(values) - set(cls.keys()))
        if unknown:
            raise ConfigError(f"unknown {cls._what} key(s) {unknown}; legal keys: {cls.keys()}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes | None):
        """Build from a JSON object (``None`` or empty text: the defaults). Strict JSON:
        ``NaN`` and ``Infinity`` are not numbers here."""
        if text is None:
            return cls()
        if not isinstance(text, (str, bytes, bytearray)):
            raise ConfigError(f"{cls._what} must be JSON text, got {type(text).__name__}")
        if not text.strip():
            return cls()
        try:
            values = msgspec.json.decode(text)
        except msgspec.DecodeError as e:
            raise ConfigError(f"{cls._what} is not valid JSON ({e}): {text!r}") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{cls._what} must be a JSON object, got {text!r}")
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def replace(self, **changes: Any):
        return self.from_dict({**self.to_dict(), **changes})


PrefetchSource = Literal["previous_layer", "draft", "shared_groups"]  # prefetch.SOURCES
PREFETCH_SOURCES: tuple[str, ...] = typing.get_args(PrefetchSource)


class PrefetchConfig(_Checked, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Look-ahead prefetch (:mod:`ulacache.prefetch`; ``"prefetch": {...}`` in
    ``--ulacache-config``). ``sources``: prediction sources, each a hint for a group's next
    access (empty: prefetch off). ``fetch_cap``: rows one group may prefetch per step (OasisKV's
    per-layer cap). ``link_gbps`` with ``step_ms``: also cap the bytes every group prefetches per
    step at what the link moves in a step (GB/s x ms), split evenly over the groups."""

    _what = "ulacache prefetch config"

    sources: tuple[PrefetchSource, ...] = ()
    fetch_cap: Annotated[int, Meta(ge=0, le=1 << 24)] = 256
    link_gbps: Optional[Annotated[float, Meta(gt=0, le=1e4)]] = None
    step_ms: Optional[Annotated[float, Meta(gt=0, le=1e5)]] = None

    def _check(self) -> None:
        if len(set(self.sources)) != len(self.sources):
            raise ConfigError(f"{self._what} key 'sources' names a source twice: "
                              f"{list(self.sources)}")
        if (self.link_gbps is None) != (self.step_ms is None):
            raise ConfigError(f"{self._what} keys 'link_gbps' and 'step_ms' go together (the "
                              "link budget per step is their product)")

    @property
    def enabled(self) -> bool:
        return bool(self.sources)

    def rows_per_group(self, group_row_bytes: int, n_groups: int) -> int:
        """The per-group, per-step cap in rows: ``fetch_cap``, or less where the link budget
        (``link_gbps x step_ms``, split over ``n_groups`` groups of ``group_row_bytes`` per
        row, every layer of a group included) binds."""
        cap = self.fetch_cap
        if self.link_gbps is not None:
            per_step = self.link_gbps * 1e9 * self.step_ms * 1e-3
            cap = min(cap, int(per_step // (max(1, n_groups) * max(1, group_row_bytes))))
        return cap


class UlaCacheConfig(_Checked, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Sizes and policy of one rank's ulacache.

    Pools are per selection group: every group has ``gpu_slots`` GPU rows and ``cpu_slots`` CPU
    rows per layer on each rank. DP mode (``tp_size`` 1): one address space per rank, unique
    capacity ``gpu_slots + cpu_slots``. TP mode (``tp_size`` P > 1): the P ranks stripe one
    address space (address t on rank ``t mod P``), so the group holds ``P x (gpu_slots +
    cpu_slots)`` unique tokens; each rank adds ``buffer_slots`` GPU rows per layer for copies of
    peers' rows (design §2, the local buffer).
    """

    layout: Literal["fp8", "bf16", "tiny"] = "bf16"
    row_bytes: Optional[Annotated[int, Meta(ge=1, le=1 << 16)]] = None  # layout "tiny" only
    n_layers: Layers = 4
    layers_per_group: Layers = 1  # 1: one indexer per layer (DeepSeek-V3.2); 4: GLM-5.2 style
    gpu_slots: Annotated[int, Meta(ge=1, le=MAX_GPU_SLOTS)] = 1024
    cpu_slots: Annotated[int, Meta(ge=0, le=MAX_CPU_SLOTS)] = 4096
    page_size: Annotated[int, Meta(ge=1, le=1 << 16)] = 64  # SGLang: 64-token pages; 1 = tokens
    max_requests: Annotated[int, Meta(ge=1, le=1 << 24)] = 256
    n_buckets: Buckets = DEFAULT_BUCKETS  # PB-LRU recent buckets (n_b)
    policy: PolicyName = "pblru"  # exact LRU ("lru") is the baseline
    validate: bool = True  # host-side input checks outside graph capture (they sync the GPU)
    tp_size: Annotated[int, Meta(ge=1, le=8)] = 1  # ranks striping one address space (TP mode)
    buffer_slots: Annotated[int, Meta(ge=0, le=MAX_GPU_SLOTS)] = 0  # TP: local buffer rows
    shard_indexer: bool = True  # TP: indexer keys striped like the latent (else replicated)
    # TP: how a rank attends peers' rows. "buffer": copies them into its local buffer and
    # attends its heads over every selection; "dcp": attends all heads over its own rows only
    # and the ranks merge partial outputs by log-sum-exp (decode context parallelism, no
    # buffer: ulacache.stripe)
    tp_attention: Literal["buffer", "dcp"] = "buffer"
    access_path: AccessPath = "auto"  # fused Triton kernels on CUDA, torch reference elsewhere
    shadows: bool = True  # promoted rows keep their CPU copy: evicting them copies nothing
    # entries one kernel call takes (its scratch is allocated once for this many); larger calls
    # (prefill page tables) run in chunks of this size in one round. null: call_capacity's rule
    call_entries: Optional[Annotated[int, Meta(ge=128, le=1 << 31)]] = None

    def _check(self) -> None:
        if self.tp_attention == "dcp":
            if self.tp_size < 2 or self.buffer_slots:
                raise ConfigError("ulacache config key 'tp_attention' 'dcp' needs 'tp_size' > 1 "
                                  "and no 'buffer_slots' (each rank attends its own rows only)")
        elif self.tp_size > 1 and self.buffer_slots < 1:
            raise ConfigError("ulacache config key 'buffer_slots' must be >= 1 when 'tp_size' > "
                              "1 (peers' rows are read through the local buffer)")
        if self.tp_size == 1 and self.buffer_slots:
            raise ConfigError("ulacache config key 'buffer_slots' is only for TP mode "
                              "('tp_size' > 1)")
        if self.page_size % self.tp_size:
            raise ConfigError(f"ulacache config key 'tp_size' ({self.tp_size}) must divide "
                              f"'page_size' ({self.page_size}), so that every page stripes "
                              "evenly over the ranks")
        if self.layout != "tiny" and self.row_bytes is not None:
            raise ConfigError(f"ulacache config key 'row_bytes' is only for layout 'tiny'; "
                              f"layout {self.layout!r} fixes it ({self.row_layout.row_bytes} B)")
        if self.n_layers % self.layers_per_group:
            raise ConfigError(f"ulacache config key 'layers_per_group' ({self.layers_per_group}) "
                              f"must divide 'n_layers' ({self.n_layers})")

    @property
    def call_capacity(self) -> int:
        """Entries (addresses) one access / place / release call handles at once, and the size
        its scratch is allocated with, once, at construction: ``call_entries``, else
        ``gpu_slots + CALL_FLOOR`` (DP) or ``buffer_slots + CALL_FLOOR`` (TP). A decode step's
        selections are at most ``gpu_slots`` (DP: the engine refuses a GPU pool smaller than
        one step's selections) or ``buffer_slots`` (TP: every selection may be a peer's), so a
        step is always one call; a prefill page table of ``T x top-k`` entries, and in TP a
        prefill's distinct addresses (up to ``gpu_slots + buffer_slots``), run as several
        calls in one round. TP leaves the own pool out: the scratch (the gates' plan is per
        group) stays a fixed cost, not one per GPU token. DCP TP (``tp_attention`` ``"dcp"``)
        accesses own rows only, as DP does: ``gpu_slots + CALL_FLOOR``.
        """
        if self.call_entries:
            return self.call_entries
        return (self.buffer_slots if self.buffered_tp else self.gpu_slots) + CALL_FLOOR

    @property
    def buffered_tp(self) -> bool:
        """TP mode with a local buffer of peers' rows (``tp_attention`` ``"buffer"``)."""
        return self.tp_size > 1 and self.tp_attention == "buffer"

    @property
    def row_layout(self) -> RowLayout:
        return RowLayout.named(self.layout, self.row_bytes)

    @property
    def n_groups(self) -> int:
        return self.n_layers // self.layers_per_group

    @property
    def unique_capacity(self) -> int:
        """Tokens the address space holds: exclusive tiers, so GPU + CPU slots, on each of the
        ``tp_size`` ranks that stripe it."""
        return (self.gpu_slots + self.cpu_slots) * self.tp_size

    def charge(self, tokens: int) -> int:
        """Capacity a request of ``tokens`` tokens takes: in TP mode a rank holds at most
        ``ceil(tokens / P)`` of them (pages stripe evenly), so ``P`` times that is charged."""
        return -(-tokens // self.tp_size) * self.tp_size

    @property
    def n_logical_pages(self) -> int:
        """Logical pages: enough for full capacity plus one partial page per request."""
        return -(-self.unique_capacity // self.page_size) + self.max_requests


class SGLangOptions(_Checked, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """ulacache's settings under SGLang (``--ulacache-config '{...}'``). The GPU pool size comes
    from SGLang's memory budget; the CPU pool is ``cpu_ratio`` times it (exclusive tiers, so a
    rank holds ``(1 + cpu_ratio) x`` the GPU pool's tokens); the indexer cache is sized for all
    of them.

    ``mode``: ``"dp"``, one address space per attention-DP rank; ``"tp"``, the ranks of one
    attention-TP group stripe one address space (token ``t`` on rank ``t mod P``), each holding
    ``1/P`` of the latent rows plus a local buffer of ``buffer_slots`` rows per layer for copies
    of peers' rows. ``buffer_slots`` (TP only; per rank, per selection group, per layer):
    ``null`` derives it as ``max_running_requests x draft tokens x (top_k + 1)`` (every selection
    of one step may be a peer's row; start-up refuses TP mode when ``--max-running-requests`` is
    unset). ``shard_indexer`` (TP only): merge the decode/verify top-k exactly across the group
    (each rank ranks the columns ``j`` with ``j mod P == rank``) over replicated indexer keys.
    ``stripe_index_k`` (TP only, exclusive with it): each rank stores the indexer keys of its
    own pages only (page ``l`` on rank ``l mod P``, SGLang's page interleave), scores them with
    SGLang's kernels and the group merges the top-k exactly (docs/index-stripe.md).
    ``"dcp"``: the same stripe under SGLang's decode context parallelism (``--dcp-size P``):
    each rank attends all heads over its own rows and SGLang merges the partial outputs by
    log-sum-exp, so there is no buffer (:mod:`ulacache.stripe`; docs/tp-over-dcp.md);
    ``stripe_index_k`` applies as in mode ``"tp"``, ``prefill_stage`` as in mode ``"dp"``
    (each rank stages the rows it attends, its own share).
    """

    _what = "--ulacache-config"

    mode: Literal["dp", "tp", "dcp"] = "dp"
    cpu_ratio: Annotated[int, Meta(ge=0, le=1024)] = 4
    n_buckets: Buckets = DEFAULT_BUCKETS
    policy: PolicyName = "pblru"
    validate: bool = False  # host-side checks on every step (debugging; syncs the GPU)
    buffer_slots: Optional[Annotated[int, Meta(ge=1, le=MAX_GPU_SLOTS)]] = None  # TP only
    shard_indexer: bool = False  # TP only: exact sharded top-k merge (index-K replicated)
    # TP only: index-K striped by page (1/P per rank, patches/sglang_index_stripe.py); the
    # decode / verify top-k is then merged exactly across the group
    stripe_index_k: bool = False
    access_path: AccessPath = "auto"  # "torch" forces the reference path (debugging)
    shadows: bool = True  # evictions of promoted rows remap to their CPU copy (no write-back)
    # entries per kernel call (UlaCacheConfig.call_entries; null: GPU pool + buffer + 8192)
    call_entries: Optional[Annotated[int, Meta(ge=128, le=1 << 31)]] = None
    # DP and DCP: tokens of the one-layer prefill stage (ulacache.prefill.PrefillStage) that
    # serves a prefill batch longer than the GPU pool (DCP: each rank stages its own share,
    # ceil(tokens / P) rows); null: the model's context length; 0: none (every prefill batch,
    # prefix included, must fit the GPU pool: DCP, each rank's share its own pool)
    prefill_stage: Optional[Annotated[int, Meta(ge=0, le=1 << 30)]] = None
    # look-ahead prefetch on a side stream (ulacache.prefetch), read by the coordinator
    # (patches/sglang_coordinator.py); off by default
    prefetch: PrefetchConfig = PrefetchConfig()

    def _check(self) -> None:
        if self.mode != "tp":
            for key, value in (("buffer_slots", self.buffer_slots is not None),
                               ("shard_indexer", self.shard_indexer),
                               ("stripe_index_k", self.stripe_index_k and self.mode == "dp")):
                if value:
                    raise ConfigError(f"--ulacache-config key {key!r} is only for mode 'tp'"
                                      f"{' or dcp' if key == 'stripe_index_k' else ''} "
                                      f"(got mode {self.mode!r})")
        if self.mode != "tp":
            return
        if self.stripe_index_k and self.shard_indexer:
            raise ConfigError("--ulacache-config keys 'stripe_index_k' and 'shard_indexer' are "
                              "exclusive: striped index-K already merges the top-k exactly "
                              "across the group (shard_indexer merges over replicated keys)")
        elif self.prefill_stage:
            raise ConfigError("--ulacache-config key 'prefill_stage' is only for modes 'dp' and "
                              "'dcp' (a buffered TP stage would gather peers' rows; mode 'tp' "
                              "prefill batches must fit each rank's pool and buffer)")

    @property
    def host_to_device_ratio(self) -> int:
        """Logical tokens per GPU slot, in HiSparse's terms (sizes the indexer cache)."""
        return 1 + self.cpu_ratio


def validate_sglang_config(values: dict[str, Any]) -> SGLangOptions:
    """Validate the parsed ``--ulacache-config`` JSON object (called by the SGLang plugin)."""
    return SGLangOptions.from_dict(values)
