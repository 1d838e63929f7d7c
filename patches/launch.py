"""What one SGLang launch decides for ulacache, in one typed record: :class:`LaunchPlan`.

Two SGLang seams need the same decisions at different times: the sizing hook (inside
``DefaultPoolConfigurator.__init__``) charges the pool's memory, and the pool (built later by
``KVCacheConfigurator._build_dsa_kv_pool``) allocates it. Both compute their plan with
:func:`plan_launch` from the same configurator, so what is charged is what is allocated,
without the hooks handing state to each other:

* the ``--ulacache-config`` options (:func:`sglang_options`, from SGLang's published server args);
* the model's top-k sharing pattern (``dsa_layer_skips_topk``) over this worker's layers, which
  makes the selection groups (:func:`layer_groups_from_skip`);
* the stripe width (SGLang's attention-TP group in modes ``"tp"`` and ``"dcp"``, else 1), top-k,
  draft tokens and ``--max-running-requests``, which size TP mode's buffer
  (:meth:`LaunchPlan.buffer_slots`; mode ``"dcp"`` has none).

SGLang's pool call site passes no ulacache argument, so the pool-building hook scopes the plan
around that one call (:func:`building`); a pool built anywhere else takes it as
``ulacache_plan`` or builds it from its own arguments (:meth:`LaunchPlan.standalone`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from dataclasses import dataclass

from ulacache.config import SGLangOptions
from ulacache.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_TOP_K = 2048
"""Top-k of DeepSeek-V3.2 / GLM-5.x (``index_topk``), used to size the buffer when the model
config is not reachable; the coordinator checks the real value at start-up."""

TP_SIZES = (2, 4, 8)
"""Legal stripe widths: ``P`` must divide SGLang's 64-token page (so ``loc % P == pos % P``
and owners follow positions) and the core's ``tp_size`` is at most 8."""


@functools.lru_cache(maxsize=8)
def _parse_options(raw: str | None) -> SGLangOptions:
    from ulacache.patches.server_args import parse_ulacache_config

    return SGLangOptions.from_dict(parse_ulacache_config(raw))


def sglang_options() -> SGLangOptions:
    """The ``--ulacache-config`` of this launch; defaults only when SGLang has published no
    server args (tests, tools). A bad value raises :class:`~ulacache.errors.ConfigError` naming
    the key and its legal values: start-up stops instead of serving with settings nobody asked
    for. Parsed once per distinct value (the top-k hook asks on every indexer call)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except (ImportError, ValueError):  # "Global server args is not set yet!"
        logger.debug("ulacache: no SGLang server args published; default --ulacache-config")
        return SGLangOptions()
    raw = getattr(args, "ulacache_config", None)
    if raw is None or isinstance(raw, str):
        return _parse_options(raw)
    from ulacache.patches.server_args import parse_ulacache_config

    return SGLangOptions.from_dict(parse_ulacache_config(raw))  # a dict: not hashable


def tp_group():
    """The ranks that stripe one address space: SGLang's ``get_dp_tp_group()`` (the
    attention-TP group with attention DP, else the whole TP group)."""
    from sglang.srt.layers.dp_attention import get_dp_tp_group

    return get_dp_tp_group()


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


def max_running_requests() -> int | None:
    """SGLang's ``--max-running-requests`` of this launch (``None``: not given)."""
    try:
        from sglang.srt.runtime_context import get_schedule

        given = get_schedule().max_running_requests
    except (ImportError, ValueError, AttributeError):  # nothing published (tests, tools)
        return None
    return int(given) if given else None


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


def layer_groups_from_skip(skip_topk_layers, layer_num: int,
                           start_layer: int = 0) -> list[list[int]]:
    """Selection groups (global layer ids): a layer that skips top-k reuses the previous layer's
    selection, so it joins that layer's group. ``skip_topk_layers``: one flag per layer of the
    pool, or ``None`` (every layer its own group)."""
    if skip_topk_layers is not None and len(skip_topk_layers) != layer_num:
        logger.warning("ulacache: the model's top-k sharing pattern covers %d layers, the pool"
                       " %d; one selection group per layer", len(skip_topk_layers), layer_num)
        skip_topk_layers = None
    groups: list[list[int]] = []
    for i in range(layer_num):
        layer = start_layer + i
        if skip_topk_layers is not None and skip_topk_layers[i] and groups:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


@dataclass(frozen=True)
class LaunchPlan:
    """ulacache's decisions for one worker's pool (see the module docstring).

    ``skip_topk_layers``: per layer of the worker, whether it reuses the previous layer's top-k
    (``None``: no sharing known); ``tp_size``: ranks striping one address space (1 in mode
    ``"dp"``); ``max_running_requests``: SGLang's flag (``None``: not given)."""

    options: SGLangOptions
    skip_topk_layers: tuple[bool, ...] | None = None
    top_k: int = DEFAULT_TOP_K
    draft_tokens: int = 0
    max_running_requests: int | None = None
    tp_size: int = 1
    stage_tokens: int = 0  # rows of a rank's prefill stage (0: none; :func:`stage_tokens`)

    def __post_init__(self):
        if (self.tp_size > 1) != self.striped or (self.striped and self.tp_size not in TP_SIZES):
            raise ConfigError(
                f"ulacache {self.options.mode.upper()} mode over {self.tp_size} rank(s): modes "
                f"'tp' and 'dcp' stripe over the attention-TP group, whose size must be one of "
                f"{TP_SIZES}; mode 'dp' runs one address space per rank")

    @property
    def striped(self) -> bool:
        """Whether the ranks of the attention-TP group stripe one address space (modes
        ``"tp"`` and ``"dcp"``)."""
        return self.options.mode in ("tp", "dcp")

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def buffer_slots(self) -> int:
        """TP mode's local buffer rows per rank, group and layer (0 in modes DP and DCP);
        raises :class:`ConfigError` when TP mode cannot size it."""
        if self.options.mode != "tp":
            return 0
        return resolve_buffer_slots(self.options, self.max_running_requests, self.top_k,
                                    self.draft_tokens)

    def layer_groups(self, layer_num: int, start_layer: int = 0) -> list[list[int]]:
        """The selection groups (global layer ids) of a pool of these layers."""
        return layer_groups_from_skip(self.skip_topk_layers, layer_num, start_layer)

    @classmethod
    def standalone(cls, options: SGLangOptions, *, tp_size: int = 1,
                   top_k: int | None = None, max_running_requests: int | None = None,
                   skip_topk_layers=None) -> LaunchPlan:
        """A plan from explicit arguments (tests, tools, a pool built outside SGLang's call
        site): draft tokens from SGLang's published spec when there is one."""
        return cls(options=options, top_k=int(top_k or DEFAULT_TOP_K),
                   skip_topk_layers=None if skip_topk_layers is None
                   else tuple(bool(s) for s in skip_topk_layers),
                   draft_tokens=draft_tokens(), max_running_requests=max_running_requests,
                   tp_size=tp_size, stage_tokens=stage_tokens(options, None, tp_size))


def model_skip_flags(kvc) -> tuple[bool, ...] | None:
    """Per layer of this worker (``layer_info.start_layer .. end_layer``): whether it reuses the
    previous layer's top-k (SGLang's ``dsa_layer_skips_topk``); ``None`` for a draft worker or
    a model that is not DSA (every layer its own selection group)."""
    from sglang.srt.configs.model_config import dsa_layer_skips_topk, is_deepseek_dsa

    cfg = kvc.model_config.hf_config
    if getattr(kvc, "is_draft_worker", False) or not is_deepseek_dsa(cfg):
        return None
    info = kvc.layer_info
    return tuple(bool(dsa_layer_skips_topk(cfg, layer))
                 for layer in range(info.start_layer, info.end_layer))


def plan_launch(kvc) -> LaunchPlan:
    """The plan of the worker SGLang's ``KVCacheConfigurator`` ``kvc`` configures: what the
    sizing hook charges and the pool allocates (the same function, the same inputs)."""
    opts = sglang_options()
    top_k = getattr(getattr(kvc.model_config, "hf_text_config", None), "index_topk", None)
    tp_size = int(tp_group().world_size) if opts.mode in ("tp", "dcp") else 1
    return LaunchPlan(options=opts, skip_topk_layers=model_skip_flags(kvc),
                      top_k=int(top_k or DEFAULT_TOP_K), draft_tokens=draft_tokens(),
                      max_running_requests=max_running_requests(), tp_size=tp_size,
                      stage_tokens=stage_tokens(
                          opts, getattr(kvc.model_config, "context_len", None), tp_size))


def stage_tokens(opts: SGLangOptions, context_len: int | None, tp_size: int = 1) -> int:
    """Rows of a rank's prefill stage for prefill batches of ``prefill_stage`` tokens, or when
    null the model's context length (one longest request; 0 when unknown, as for a pool built
    outside SGLang's call site). DP: that many; DCP: a rank's own share of one request that
    long, ``ceil(tokens / tp_size)`` (:meth:`ulacache.stripe.StripeAddressSpace.stage_rows`);
    TP: 0 (a buffered rank's stage would gather its peers' rows: not built)."""
    if opts.mode == "tp":
        return 0
    tokens = opts.prefill_stage if opts.prefill_stage is not None else int(context_len or 0)
    return -(-tokens // tp_size) if opts.mode == "dcp" else tokens


def chunked_prefill_size() -> int | None:
    """SGLang's ``--chunked-prefill-size`` as its scheduler reads it (``get_schedule()``,
    ``scheduler.py:1352``; resolved by ``arg_groups/memory_hook.py``), else the published
    server args'; ``None``: unknown, or chunked prefill off (``<= 0``)."""
    size = None
    try:
        from sglang.srt.runtime_context import get_schedule, get_server_args

        for source in (get_schedule, get_server_args):
            try:
                size = getattr(source(), "chunked_prefill_size", None)
            except (ValueError, KeyError, AttributeError):  # not published in this process
                continue
            if size is not None:
                break
    except ImportError:
        return None
    return int(size) if size is not None and int(size) > 0 else None


_BUILDING: contextvars.ContextVar[LaunchPlan | None] = contextvars.ContextVar(
    "ulacache_building_pool", default=None)


@contextlib.contextmanager
def building(plan: LaunchPlan):
    """The plan of the pool SGLang builds inside this block (its call site passes none)."""
    token = _BUILDING.set(plan)
    try:
        yield plan
    finally:
        _BUILDING.reset(token)


def plan_being_built() -> LaunchPlan | None:
    """The plan :func:`building` scoped around this pool's construction, if any."""
    return _BUILDING.get()
