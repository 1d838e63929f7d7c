"""``--kv-backend`` and ``--ulacache-config`` for SGLang 0.5.23, in "field mode".

SGLang assembles ``ServerArgs`` as a ``msgspec`` Struct at import time and generates its CLI from
the fields, so a plugin cannot add a flag to the stock class. Instead :class:`UlaServerArgs`
subclasses it with two real fields in namespace ``memory``; the plugin (``patches/plugin.py``)
REPLACEs ``sglang.srt.server_args.ServerArgs`` and ``Engine.server_args_class`` with it. The
fields then show in ``--help``, parse with ``choices``, survive pickling to spawned children,
appear in ``get_memory()`` and are accepted by ``Engine(kv_backend=...)``.

Validation happens at two points:

* :meth:`UlaServerArgs.__post_init__` (every construction: CLI, ``Engine(**kw)``, unpickling):
  choice of backend, JSON shape of ``ulacache_config``, combinations that can be judged from raw
  inputs; it turns ``enable_hisparse`` on for ``ulacache`` and ``hisparse`` (HiSparse's
  ``enable_hisparse`` is not resolvable, so it must be set before resolution starts).
* :func:`validate_hisparse_around` (AROUND
  ``sglang.srt.arg_groups.hisparse_hook.validate_hisparse``, run by SGLang's post-process pass
  once the model config is known): the model must be a DSA model the ulacache pool path
  supports; HiSparse's own checks then run with error messages that
  name the ulacache backend and the legal combinations.

This module imports SGLang at import time: import it only where SGLang is installed.
Do not add ``from __future__ import annotations`` here: SGLang reads the field annotations.
"""

import json
import logging
import os
from typing import Any, Optional

from sglang.srt import server_args as _sglang_server_args
from sglang.srt.arg_groups.arg_utils import NS, A, Arg

from ulacache.errors import ConfigError

logger = logging.getLogger(__name__)

KV_BACKENDS = ("default", "hisparse", "ulacache")
"""Legal values of ``--kv-backend``."""

HISPARSE_BACKENDS = ("hisparse", "ulacache")
"""Backends that run on SGLang's HiSparse code paths (``enable_hisparse=True``)."""

ENV_KV_BACKEND = "ULACACHE_KV_BACKEND"
"""Environment variable through which the selected backend reaches spawned SGLang processes.

SGLang calls ``load_plugins()`` before it parses arguments (launcher) or as the first statement
of a child process (scheduler, DP controller, detokenizer), so ``register()`` cannot read the
record. :meth:`UlaServerArgs.__post_init__` therefore exports the choice here; children spawned
afterwards inherit it and ``register()`` installs the class swaps only when it says ``ulacache``.
"""

# DSA architectures whose KV pool is not built by ``KVCacheConfigurator._build_dsa_kv_pool``
# (GLM-5.3-Flash is hybrid linear attention + DSA, "mambaish"), so the HiSparse pool class that
# ulacache replaces is never constructed for them.
_ULACACHE_UNSUPPORTED_DSA_ARCHS = frozenset(
    {"Glm5NextForConditionalGeneration", "Glm5NextForConditionalGenerationNextN"}
)

_KV_BACKEND_HELP = (
    "KV-cache backend for DSA sparse-attention (MLA) models (plugin ulacache). 'default': "
    "SGLang's normal pools (HiSparse still follows --enable-hisparse); 'hisparse': SGLang's "
    "HiSparse (same as --enable-hisparse); 'ulacache': one logical KV address space over shared "
    "GPU and CPU pools (turns on the HiSparse code paths; needs --disable-radix-cache)."
)
_ULACACHE_CONFIG_HELP = (
    "UlaCache settings as a JSON object, read only with --kv-backend ulacache; keys "
    "(ulacache.config.SGLangOptions): mode (dp|tp|dcp, default dp), cpu_ratio (CPU slots per GPU "
    "slot, 4), n_buckets (PB-LRU recent buckets, 64), policy (pblru|lru), validate (host "
    "checks every step, false), access_path (auto|torch|fused, auto: fused on CUDA), "
    "shadows (promoted rows keep their CPU copy so evicting them writes nothing back, true), "
    "call_entries (entries per kernel call, its scratch allocated once; default GPU pool + "
    "buffer + 8192: prefill page tables are translated in pieces of it), prefill_stage (modes "
    "dp and dcp: tokens of the one-layer stage a prefill longer than the GPU pool reads its "
    "selections from, dcp each rank its own share; default the model's context length, 0: "
    "none), prefetch (look-ahead prefetch: "
    "{\"sources\": [\"previous_layer\", \"draft\", \"shared_groups\"], \"fetch_cap\": rows "
    "per layer per step, \"link_gbps\" with \"step_ms\"}; draft needs EAGLE/MTP verify, "
    "shared_groups a model whose layers share top-k and mode dp; docs/prefetch.md); "
    "mode tp "
    "adds buffer_slots, shard_indexer (exact top-k merge over replicated index-K) and "
    "stripe_index_k (index-K striped by page: 1/P per rank, scored locally, merged exactly; "
    "docs/index-stripe.md). Example: "
    '\'{"mode": "dp", "cpu_ratio": 4}\'.'
)


def parse_ulacache_config(raw: Optional[str]) -> dict[str, Any]:
    """Parse the ``--ulacache-config`` string into a dict (``{}`` for ``None`` or empty).

    Only the JSON shape is checked here: a JSON object is required. The meaning of the keys is
    checked by ``ulacache.config`` when it offers a validator (see :func:`_validate_content`).

    Raises:
        ConfigError: not valid JSON, or valid JSON that is not an object.
    """
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, dict):  # Engine(ulacache_config={...}) from Python
        return dict(raw)
    try:
        value = json.loads(raw)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f'--ulacache-config must be a JSON object such as \'{{"mode": "dp"}}\', '
            f"but {raw!r} is not valid JSON: {exc}"
        ) from exc
    if not isinstance(value, dict):
        raise ConfigError(
            f'--ulacache-config must be a JSON object such as \'{{"mode": "dp"}}\', '
            f"got a JSON {type(value).__name__}: {raw!r}"
        )
    return value


def _validate_content(config: dict[str, Any]) -> None:
    """Hand the parsed settings to ``ulacache.config`` if it provides a validator.

    Looks up ``ulacache.config.validate_sglang_config(dict)``; absent module or function means
    "shape check only" (stage 1). Errors it raises propagate unchanged.
    """
    try:
        from ulacache import config as _ula_config  # noqa: PLC0415 - optional, lead-owned
    except ImportError:
        return
    validator = getattr(_ula_config, "validate_sglang_config", None)
    if callable(validator):
        validator(config)


def _illegal_raw_combinations(args: Any, config: dict[str, Any] | None = None) -> list[str]:
    """Combinations with ``--kv-backend`` that are wrong whatever the model (raw inputs)."""
    backend = args.kv_backend
    dcp_mode = backend == "ulacache" and (config or {}).get("mode") == "dcp"
    problems = []
    if args.ulacache_config not in (None, "") and backend != "ulacache":
        problems.append(
            f"--ulacache-config is only read with --kv-backend ulacache (got {backend})"
        )
    if backend == "default":
        return problems
    if getattr(args, "dcp_size", 1) and args.dcp_size > 1 and not dcp_mode:
        problems.append(f"--dcp-size {args.dcp_size} (HiSparse host pools have no DCP layout; "
                        "ulacache: only with --ulacache-config mode 'dcp')")
    if getattr(args, "enable_kv_cache_sharding", False):
        problems.append("--enable-kv-cache-sharding (HiSparse excludes KV sharding)")
    if backend == "ulacache" and getattr(args, "enable_mixed_chunk", False):
        problems.append(
            "--enable-mixed-chunk (a mixed batch runs the running requests' decode tokens in the "
            "prefill pass, whose every token must be GPU-resident in one round)"
        )
    if backend == "ulacache":
        problems += _ulacache_unsupported(args)
    if backend == "ulacache" and getattr(args, "use_ray", False):
        problems.append(
            "--use-ray (SGLang's Ray scheduler actor never calls load_plugins(), so the ulacache "
            "classes would not be installed in the schedulers)"
        )
    return problems


def _ulacache_unsupported(args: Any) -> list[str]:
    """Deployments ulacache does not serve yet, whatever the mode: each would start and then
    fail (or serve wrong) at its first request, so they are refused before anything loads."""
    problems = []
    pd = str(getattr(args, "disaggregation_mode", "null") or "null")
    if pd != "null":
        # decode: disaggregation/decode.py reads the coordinator's mem_pool_host (a host
        # mirror ulacache's exclusive tiers do not have) and calls admit_request_direct;
        # prefill: the KV sender reads pool rows by SGLang's own slot ids
        problems.append(f"--disaggregation-mode {pd} (prefill/decode disaggregation is not "
                        "built: ulacache has no host mirror to hand over; serve colocated)")
    if int(getattr(args, "pp_size", 1) or 1) > 1:
        problems.append(f"--pp-size {args.pp_size} (pipeline stages are not built: the pool's "
                        "selection groups and the coordinator assume every layer on one rank)")
    if int(getattr(args, "attn_cp_size", 1) or 1) > 1:
        problems.append(f"--attn-cp-size {args.attn_cp_size} (context-parallel attention "
                        "splits a request's tokens across ranks; the address space does not)")
    if str(getattr(args, "speculative_algorithm", None) or "NONE").upper() == "NGRAM":
        # NGRAM verifies a tree of drafts; the HiSparse verify seam ulacache serves
        # (dsa_backend forward_extend, target_verify) takes [reqs, steps, k] linear drafts
        problems.append("--speculative-algorithm NGRAM (it drafts trees; ulacache verifies "
                        "linear drafts: EAGLE, EAGLE3 or MTP with --speculative-eagle-topk 1)")
    return problems


TP_LEGAL = (
    "mode 'tp': an attention-TP group of 2, 4 or 8 ranks (--tp, or --tp / --attn-dp-size with "
    "attention DP), SGLANG_DSA_TOPK_BROADCAST=1 in the environment"
)
"""The legal TP-mode combination, as error messages state it."""


DCP_LEGAL = (
    "mode 'dcp': --dcp-size equal to the attention-TP size (2, 4 or 8), --kv-cache-dtype "
    "fp8_e4m3, no speculative decoding, SGLANG_DSA_TOPK_BROADCAST=1 in the environment"
)
"""The legal DCP-mode combination, as error messages state it."""


def _illegal_dcp_combinations(args: Any, config: dict[str, Any]) -> list[str]:
    """Combinations ``--ulacache-config '{"mode": "dcp"}'`` cannot serve (raw inputs): mode
    ``"dcp"`` stripes over the attention-TP group (TP mode's rules) and attends through
    SGLang's DCP, whose group must be that same group (``--dcp-size`` = attention-TP size);
    its attention branch is FlashMLA's fp8 sparse decode (``patches/sglang_dcp.py``); a draft
    model's pools under DCP are not built."""
    if args.kv_backend != "ulacache" or config.get("mode") != "dcp":
        return []
    problems = _illegal_tp_combinations(args, {**config, "mode": "tp"})
    tp, adp = int(args.tp_size or 1), int(getattr(args, "attn_dp_size", 1) or 1)
    dcp = int(getattr(args, "dcp_size", 1) or 1)
    if dcp != tp // max(1, adp):
        problems.append(f"--dcp-size {dcp} with an attention-TP size of {tp // max(1, adp)} "
                        "(mode 'dcp' needs them equal)")
    dtype = str(getattr(args, "kv_cache_dtype", "auto") or "auto")
    if dtype not in ("fp8_e4m3", "auto"):
        problems.append(f"--kv-cache-dtype {dtype} (FlashMLA's sparse decode reads fp8_e4m3)")
    if str(getattr(args, "speculative_algorithm", None) or "NONE").upper() != "NONE":
        problems.append(f"--speculative-algorithm {args.speculative_algorithm} (a draft model's "
                        "pools under DCP are not built)")
    return problems


def _illegal_tp_combinations(args: Any, config: dict[str, Any]) -> list[str]:
    """Combinations ``--ulacache-config '{"mode": "tp"}'`` cannot serve (raw inputs).

    TP mode stripes one address space over the ranks that run one batch in lockstep
    (SGLang's ``get_dp_tp_group()``): their number ``P`` must divide the 64-token page (so a
    token's owner follows its position) and be at most 8; pipeline stages and attention
    context parallelism would split that group's work in ways the stripe does not model; and
    every rank must select the same top-k (SGLang's rank-0 broadcast of the indexer output).
    """
    if args.kv_backend != "ulacache" or config.get("mode") != "tp":
        return []
    tp, adp = int(args.tp_size or 1), int(getattr(args, "attn_dp_size", 1) or 1)
    problems = []  # --pp-size and --attn-cp-size > 1 are refused in every mode
    if adp > 1 and (tp % adp or tp // adp not in (2, 4, 8)):
        problems.append(f"--attn-dp-size {adp} with --tp {tp} (each attention-DP group's TP "
                        f"size --tp / --attn-dp-size must be 2, 4 or 8)")
    elif adp == 1 and tp not in (2, 4, 8):
        problems.append(f"--tp {tp} (TP mode stripes over 2, 4 or 8 ranks, a divisor of "
                        "SGLang's 64-token page; use mode 'dp' for --tp 1)")
    broadcast = os.environ.get("SGLANG_DSA_TOPK_BROADCAST", "").strip().lower()
    if broadcast not in ("1", "true", "yes", "y"):
        problems.append("SGLANG_DSA_TOPK_BROADCAST unset or false (every TP rank must select "
                        "the same top-k, prefill included; launch with "
                        "SGLANG_DSA_TOPK_BROADCAST=1)")
    return problems


class UlaServerArgs(_sglang_server_args.ServerArgs):
    """SGLang ``ServerArgs`` plus ``kv_backend`` and ``ulacache_config`` (namespace ``memory``)."""

    kv_backend: A[str, Arg(help=_KV_BACKEND_HELP, choices=list(KV_BACKENDS)), NS("memory")] = (
        "default"
    )
    ulacache_config: A[Optional[str], Arg(help=_ULACACHE_CONFIG_HELP), NS("memory")] = None

    def __post_init__(self):
        """Validate the two fields, turn on HiSparse paths, export the backend choice.

        Raises:
            ConfigError (a ``ValueError``): unknown backend, malformed ``ulacache_config``, or an
                illegal combination; the message names the legal values or combinations.
        """
        super().__post_init__()
        if self.kv_backend not in KV_BACKENDS:
            raise ConfigError(
                f"--kv-backend must be one of {', '.join(KV_BACKENDS)}; got {self.kv_backend!r}"
            )
        if isinstance(self.ulacache_config, dict):
            # Engine(ulacache_config={...}): keep the field a string so it pickles and prints
            # like a CLI value.
            self.ulacache_config = json.dumps(self.ulacache_config, sort_keys=True)
        config = parse_ulacache_config(self.ulacache_config)
        problems = _illegal_raw_combinations(self, config)
        tp_problems = _illegal_tp_combinations(self, config)
        dcp_problems = _illegal_dcp_combinations(self, config)
        if problems or tp_problems or dcp_problems:
            raise ConfigError(
                f"--kv-backend {self.kv_backend} cannot be combined with: "
                + "; ".join(problems + tp_problems + dcp_problems)
                + ". Legal: --kv-backend hisparse|ulacache with --dcp-size 1 (ulacache mode "
                "'dcp': the attention-TP size) and without "
                "--enable-kv-cache-sharding"
                + (", --enable-mixed-chunk, --use-ray, --disaggregation-mode, --pp-size > 1, "
                   "--attn-cp-size > 1 or --speculative-algorithm NGRAM; "
                   if self.kv_backend == "ulacache" else "; ")
                + "--ulacache-config only with --kv-backend ulacache"
                + (f"; {TP_LEGAL}" if tp_problems else "")
                + (f"; {DCP_LEGAL}" if dcp_problems else "") + "."
            )
        if self.kv_backend == "ulacache":
            _validate_content(config)
        if self.kv_backend in HISPARSE_BACKENDS and not self.enable_hisparse:
            self.enable_hisparse = True
            logger.debug("--kv-backend %s: enable_hisparse set to True", self.kv_backend)
        os.environ[ENV_KV_BACKEND] = self.kv_backend

    def ulacache_settings(self) -> dict[str, Any]:
        """The parsed ``--ulacache-config`` object (``{}`` when unset)."""
        return parse_ulacache_config(self.ulacache_config)


def kv_backend_of(record: Any) -> str:
    """``kv_backend`` of a record or view; ``"default"`` for records without the field."""
    return getattr(record, "kv_backend", "default") or "default"


def validate_hisparse_around(original_fn, server_args, *args, **kwargs):
    """AROUND hook for ``sglang.srt.arg_groups.hisparse_hook.validate_hisparse``.

    ``server_args`` is the ``ResolvedView`` SGLang's post-process pass hands in (model config
    resolvable through ``model_config_of``). For ``--kv-backend ulacache`` it first requires a
    DSA model whose pool goes through ``_build_dsa_kv_pool``, then runs HiSparse's checks,
    re-raising their bare assertions as ``ConfigError`` naming the backend.
    """
    backend = kv_backend_of(server_args)
    if backend != "ulacache":
        return original_fn(server_args, *args, **kwargs)
    if getattr(server_args, "enable_hisparse", False):
        _require_supported_model(server_args)
    try:
        return original_fn(server_args, *args, **kwargs)
    except (AssertionError, ValueError, NotImplementedError) as exc:
        raise ConfigError(
            f"--kv-backend ulacache runs on SGLang's HiSparse paths and inherits their "
            f"constraints: {str(exc).rstrip('. ') or type(exc).__name__}. Legal combination: "
            "a DSA model (DeepSeek-V3.2, GLM-5.x, ...), --disable-radix-cache, no "
            "--enable-mixed-chunk, speculative decoding only with --speculative-eagle-topk 1 "
            "and without --speculative-adaptive, --kv-cache-dtype bfloat16 (--dsa-*-backend "
            "flashmla_sparse) or fp8_e4m3 (flashmla_kv / flashinfer_sparse_mla)."
        ) from exc


def _require_supported_model(view: Any) -> None:
    """Raise ``ConfigError`` unless the model is a DSA model ulacache can serve."""
    from sglang.srt.arg_groups.model_override_base import model_config_of  # noqa: PLC0415
    from sglang.srt.configs.model_config import is_deepseek_dsa  # noqa: PLC0415

    hf_config = model_config_of(view).hf_config
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = archs[0] if archs else getattr(hf_config, "model_type", "?")
    if not is_deepseek_dsa(hf_config):
        raise ConfigError(
            f"--kv-backend ulacache needs a DSA (DeepSeek Sparse Attention) model, i.e. an "
            f"architecture such as DeepseekV32ForCausalLM or GlmMoeDsaForCausalLM with "
            f"'index_topk' in its config; got {arch}. DeepSeek-V4 and MiniMax-M3 sparse "
            "models are served by --kv-backend hisparse; other models by --kv-backend default."
        )
    if arch in _ULACACHE_UNSUPPORTED_DSA_ARCHS:
        raise ConfigError(
            f"--kv-backend ulacache does not support {arch}: its hybrid linear-attention KV pool "
            "is not built through the DSA pool path. Use --kv-backend hisparse or default."
        )
