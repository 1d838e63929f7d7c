"""Real attention-selection traces: file format, recording and locality statistics.

A trace records, for every layer and decode step, the top-k key positions a DSA-like selector
picks. The selector is emulated with a real pretrained decoder (:mod:`ulacache.smollm`): for query
position ``t`` and layer ``l``, every key ``j <= t`` is scored by its attention probability summed
over all query heads (one score per past token per query, as the DSA indexer does), and the ``k``
best positions form that step's selection, shared by all heads. One causal pass gives the same
top-k as token-by-token decoding (checked: 99.997% of entries), so a trace of ``T`` steps costs one
forward pass.

File format ``ulacache-selection-trace`` version 1: a numpy ``.npz`` (no pickles) holding

- ``selections``: int32 ``[layers, steps, k]``, selected key positions per (layer, step), sorted
  ascending within a row, padded with -1 where the query has fewer than ``k`` keys;
- ``positions``: int32 ``[steps]``, the query position of each step (strictly increasing);
- ``meta``: 0-d unicode array, a JSON object (see :func:`record_trace` for its keys).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)

FORMAT_NAME = "ulacache-selection-trace"
FORMAT_VERSION = 1
SCORE_METHOD = (
    "one causal fp32 pass of {model}; for query position t and layer l each key j<=t is scored by "
    "its softmax attention probability summed over all {heads} query heads; the top-{k} keys are "
    "selected (one selection per layer per step, shared by all heads), sorted ascending"
)
DEFAULT_POOL_SIZES = (128, 256, 512, 1024)
DEFAULT_POLICIES = ("lru", "pblru")


class TraceFormatError(ValueError):
    """A trace file that is not a valid ``ulacache-selection-trace``."""


@dataclass
class TraceMeta:
    """Parsed ``meta`` JSON of a trace (all keys are kept in ``raw``)."""

    format: str
    version: int
    n_tokens: int
    k: int
    steps: int
    layers: int
    raw: dict = field(default_factory=dict)


@dataclass
class Trace:
    """A loaded trace.

    ``selections`` int32 ``[layers, steps, k]``; ``positions`` int32 ``[steps]``.
    """

    selections: np.ndarray
    positions: np.ndarray
    meta: TraceMeta

    @property
    def layers(self) -> int:
        return int(self.selections.shape[0])

    @property
    def steps(self) -> int:
        return int(self.selections.shape[1])

    @property
    def k(self) -> int:
        return int(self.selections.shape[2])

    def layer_steps(self, layer: int) -> Iterator[torch.Tensor]:
        """Per step of ``layer``, int64 ``[n]`` distinct selected positions (-1 padding dropped)."""
        rows = self.selections[layer]
        for row in rows:
            yield torch.from_numpy(row[row >= 0].astype(np.int64))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _ulacache_version() -> str:
    try:
        from importlib.metadata import version

        return version("ulacache")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def record_trace(text_path: str, out_path: str, *, max_tokens: int = 2048, k: int = 64,
                 start: int | None = None, model=None, progress: bool = True) -> TraceMeta:
    """Tokenize ``text_path``, run one causal pass and write a trace ``.npz`` to ``out_path``.

    ``max_tokens`` truncates the text; steps are query positions ``start .. n_tokens - 1`` with
    ``start`` defaulting to ``k`` (every step then has at least ``k + 1`` candidate keys, so no
    padding). ``model`` is a :class:`ulacache.smollm.SmolLM2` (loaded when None).
    ``progress`` logs timing at INFO level. Returns the metadata written.
    """
    from ulacache.smollm import MODEL_NAME, SmolLM2

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    t_begin = time.perf_counter()
    if model is None:
        model = SmolLM2.from_gguf()
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    ids = model.tokenize(text)[:max_tokens]
    n = len(ids)
    start = k if start is None else start
    if not 0 <= start < n:
        raise ValueError(f"start must be in [0, n_tokens={n}), got {start}")
    t0 = time.perf_counter()
    out = model.forward(ids, select_k=k, logits="none")
    if progress:
        logger.info("causal pass over %d tokens with top-%d selection: %.1f s",
                    n, k, time.perf_counter() - t0)
    sel = torch.stack(out.selections)[:, start:, :].to(torch.int32).numpy()  # [L, S, k]
    positions = np.arange(start, n, dtype=np.int32)
    cfg = model.config
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "model": MODEL_NAME,
        "gguf_file": os.path.basename(model.gguf_path),
        "gguf_sha256": _sha256(model.gguf_path),
        "text_file": os.path.basename(text_path),
        "text_sha256": _sha256(text_path),
        "text_head": text[:200],
        "n_tokens": n,
        "k": k,
        "start": start,
        "steps": int(positions.size),
        "layers": cfg.n_layers,
        "score": SCORE_METHOD.format(model=MODEL_NAME, heads=cfg.n_heads, k=k),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "ulacache_version": _ulacache_version(),
    }
    with open(out_path, "wb") as f:
        np.savez_compressed(f, selections=sel, positions=positions,
                            meta=np.array(json.dumps(meta, ensure_ascii=False)))
    if progress:
        logger.info("wrote %s (%d layers x %d steps x k=%d) in %.1f s", out_path,
                    sel.shape[0], sel.shape[1], k, time.perf_counter() - t_begin)
    return _parse_meta(meta)


def _parse_meta(meta: dict) -> TraceMeta:
    for key in ("format", "version", "n_tokens", "k", "steps", "layers"):
        if key not in meta:
            raise TraceFormatError(f"trace meta lacks key {key!r}")
    if meta["format"] != FORMAT_NAME:
        raise TraceFormatError(f"not a {FORMAT_NAME} file (format={meta['format']!r})")
    if meta["version"] != FORMAT_VERSION:
        raise TraceFormatError(
            f"unsupported trace version {meta['version']!r} (this build reads {FORMAT_VERSION})")
    return TraceMeta(meta["format"], int(meta["version"]), int(meta["n_tokens"]), int(meta["k"]),
                     int(meta["steps"]), int(meta["layers"]), dict(meta))


def load_trace(path: str) -> Trace:
    """Read and validate a trace file written by :func:`record_trace`."""
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = {"selections", "positions", "meta"} - set(z.files)
            if missing:
                raise TraceFormatError(f"{path}: missing arrays {sorted(missing)}")
            sel, pos = z["selections"], z["positions"]
            meta = json.loads(str(z["meta"][()]))
    except (OSError, ValueError) as e:
        if isinstance(e, TraceFormatError):
            raise
        raise TraceFormatError(f"{path}: not a readable trace .npz ({e})") from e
    m = _parse_meta(meta)
    if sel.dtype != np.int32 or pos.dtype != np.int32:
        raise TraceFormatError(f"{path}: arrays must be int32, got {sel.dtype} and {pos.dtype}")
    if sel.shape != (m.layers, m.steps, m.k) or pos.shape != (m.steps,):
        raise TraceFormatError(
            f"{path}: selections {sel.shape} / positions {pos.shape} disagree with meta "
            f"(layers={m.layers}, steps={m.steps}, k={m.k})")
    if m.steps and (np.any(np.diff(pos) <= 0) or pos[0] < 0 or pos[-1] >= m.n_tokens):
        raise TraceFormatError(f"{path}: positions must increase within [0, n_tokens)")
    if np.any(sel < -1) or np.any(sel > pos[None, :, None]):
        raise TraceFormatError(f"{path}: a selection is out of range (-1 or 0..query position)")
    return Trace(sel, pos, m)


def _percentiles(x: np.ndarray, qs: Sequence[int] = (10, 50, 90, 99)) -> dict[str, float]:
    if x.size == 0:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(x, q)) for q in qs}


def trace_stats(trace: Trace, pool_sizes: Sequence[int] = DEFAULT_POOL_SIZES,
                policies: Sequence[str] = DEFAULT_POLICIES,
                hit_layers: Sequence[int] | None = None) -> dict:
    """Locality figures of ``trace``.

    Returns a dict with ``overlap`` (mean |S_t ∩ S_{t-1}| / k over consecutive steps: ``mean`` and
    ``per_layer``), ``distance`` (percentiles of ``t - position`` over all valid picks),
    ``frac_pos0`` (fraction of picks that are position 0) and ``hit_rate``
    (``{policy: {n_slots: {"mean", "min", "max", "per_layer"}}}``) from
    :func:`ulacache.policy_sim.simulate_hit_rate`, run per layer on that layer's selections.
    Pass ``pool_sizes=()`` to skip the hit rates, or ``hit_layers`` to simulate only those layers
    (the simulation dominates the run time: about 1-2 s per layer, policy and pool size for 2K
    steps on 2 CPU cores); ``per_layer`` then follows the order of ``hit_layers``.
    """
    sel, pos = trace.selections, trace.positions
    L, S, k = sel.shape
    valid = sel >= 0
    consecutive = np.diff(pos) == 1  # [S-1]
    per_layer_overlap = []
    for layer in range(L):
        rows = sel[layer]
        member = np.zeros((S, int(trace.meta.n_tokens) + 1), dtype=bool)
        r_idx = np.repeat(np.arange(S), k)
        member[r_idx, np.where(rows >= 0, rows, trace.meta.n_tokens).ravel()] = True
        member[:, -1] = False
        inter = (member[1:] & member[:-1]).sum(axis=1)[consecutive]
        per_layer_overlap.append(float(inter.mean() / k) if inter.size else float("nan"))
    dist = (pos[None, :, None] - sel)[valid]
    picks = int(valid.sum())
    stats = {
        "layers": L, "steps": S, "k": k, "n_tokens": trace.meta.n_tokens,
        "text_file": trace.meta.raw.get("text_file"),
        "overlap": {"mean": float(np.nanmean(per_layer_overlap)) if L else float("nan"),
                    "per_layer": per_layer_overlap},
        "distance": {**_percentiles(dist), "mean": float(dist.mean()) if dist.size else
                     float("nan")},
        "frac_pos0": float((sel == 0).sum() / picks) if picks else float("nan"),
        "hit_rate": {},
    }
    if pool_sizes:
        try:
            from ulacache.policy_sim import simulate_hit_rate
        except ImportError as e:
            raise ImportError(
                "trace_stats hit rates need ulacache.policy_sim.simulate_hit_rate(policy_name, "
                f"n_slots, steps); it is not available ({e}). Pass pool_sizes=() to skip them."
            ) from e
        layer_ids = list(range(L)) if hit_layers is None else [int(x) for x in hit_layers]
        if not layer_ids or any(not 0 <= x < L for x in layer_ids):
            raise ValueError(f"hit_layers must be non-empty layer indices in [0, {L})")
        stats["hit_layers"] = layer_ids
        for policy in policies:
            by_size = {}
            for n_slots in pool_sizes:
                rates = [float(simulate_hit_rate(policy, int(n_slots), trace.layer_steps(layer)))
                         for layer in layer_ids]
                by_size[int(n_slots)] = {"mean": float(np.mean(rates)), "min": float(min(rates)),
                                         "max": float(max(rates)), "per_layer": rates}
            stats["hit_rate"][policy] = by_size
    return stats


def format_stats(stats: dict) -> str:
    """A short human-readable table of :func:`trace_stats` output."""
    d = stats["distance"]
    lines = [
        f"trace: {stats.get('text_file')}  tokens={stats['n_tokens']}  layers={stats['layers']}"
        f"  steps={stats['steps']}  k={stats['k']}",
        f"consecutive-step overlap |S_t & S_t-1|/k: mean {stats['overlap']['mean']:.3f}"
        f"  (layers min {np.nanmin(stats['overlap']['per_layer']):.3f}"
        f" / max {np.nanmax(stats['overlap']['per_layer']):.3f})",
        f"distance t - pos: p10 {d['p10']:.0f}  p50 {d['p50']:.0f}  p90 {d['p90']:.0f}"
        f"  p99 {d['p99']:.0f}  mean {d['mean']:.1f}",
        f"picks at position 0: {stats['frac_pos0']:.2%}",
    ]
    hr = stats.get("hit_rate") or {}
    if hr:
        sizes = sorted({s for by in hr.values() for s in by})
        layers = stats.get("hit_layers")
        which = f"layers {layers}" if layers and len(layers) < stats["layers"] else "all layers"
        lines.append(f"hit rate, GPU slots per layer (mean over {which} [min-max])")
        lines.append(f"{'policy':<8}" + "".join(f"{s:>20}" for s in sizes))
        for policy, by in hr.items():
            cells = "".join(
                f"{by[s]['mean']:>8.3f} [{by[s]['min']:.2f}-{by[s]['max']:.2f}]"
                if s in by else f"{'-':>20}" for s in sizes)
            lines.append(f"{policy:<8}{cells}")
    return "\n".join(lines)


def iter_layer_steps(trace: Trace, layer: int) -> Iterable[torch.Tensor]:
    """Alias of :meth:`Trace.layer_steps` for callers that prefer a function."""
    return trace.layer_steps(layer)
