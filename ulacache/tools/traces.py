"""Real attention-selection traces: file format, recording and locality statistics.

A trace records, for every layer and decode step, the top-k key positions a DSA-like selector
picks. The selector is emulated with a real pretrained decoder (:mod:`ulacache.tools.smollm`):
for query position ``t`` and layer ``l``, every key ``j <= t`` is scored by its attention
probability summed over all query heads (one score per past token per query, as the DSA indexer
does), and the ``k`` best positions form that step's selection, shared by all heads. One causal
pass gives the same top-k as token-by-token decoding (checked: 99.997% of entries), so a trace of
``T`` steps costs one forward pass.

File format ``ulacache-selection-trace`` version 2: a numpy ``.npz`` (no pickles) holding

- ``selections``: int32 ``[layers, steps, k]``, selected key positions per (layer, step), sorted
  ascending within a row, padded with -1 where the query has fewer than ``k`` keys;
- ``positions``: int32 ``[steps]``, the query position of each step (strictly increasing);
- ``draft_tokens``: int32 ``[steps]``, the token a prompt-lookup (n-gram) draft proposes to
  follow the step's query position from the text so far (:func:`ngram_drafts`), ``-1``: none;
- ``draft_accepted``: int8 ``[steps]``, 1 where the draft equals the text's next token (its
  selection is then the next step's own);
- ``draft_selections``: int32 ``[layers, steps, k]``, the top-k the draft token selects at the
  next position (a speculative verify step would compute it), ``-1`` rows without a draft;
- ``meta``: 0-d unicode array, a JSON object (see :func:`record_trace` for its keys).

Version 1 files (no draft arrays) are read too; their :class:`Trace` has ``None`` draft fields.

:func:`load_trace` turns every way a file can be unreadable or inconsistent (missing, empty,
truncated, corrupt, not a zip, pickled arrays, malformed ``meta``, wrong dtypes or shapes,
selections out of range) into :class:`TraceFormatError` naming the file.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ulacache.pblru import POLICIES

logger = logging.getLogger(__name__)

FORMAT_NAME = "ulacache-selection-trace"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)  # version 1: no draft arrays
DRAFT_ARRAYS = ("draft_tokens", "draft_accepted", "draft_selections")
DRAFT_METHOD = (
    "prompt lookup over the text so far: the most recent earlier occurrence of the last n "
    "tokens (n = {max_n} .. 1, longest first) proposes the token that followed it; the draft "
    "token is run at the next position over the true prefix (one batched branch per step, "
    "SmolLM2.forward(draft_ids=...)) and its top-{k} recorded"
)
SCORE_METHOD = (
    "one causal fp32 pass of {model}; for query position t and layer l each key j<=t is scored by "
    "its softmax attention probability summed over all {heads} query heads; the top-{k} keys are "
    "selected (one selection per layer per step, shared by all heads), sorted ascending"
)
DEFAULT_POOL_SIZES = (128, 256, 512, 1024)
DEFAULT_POLICIES = tuple(sorted(POLICIES))  # every registered policy


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

    ``selections`` int32 ``[layers, steps, k]``; ``positions`` int32 ``[steps]``; version 2:
    ``draft_tokens`` int32 ``[steps]``, ``draft_accepted`` int8 ``[steps]`` and
    ``draft_selections`` int32 ``[layers, steps, k]`` (see the module docstring), else None.
    """

    selections: np.ndarray
    positions: np.ndarray
    meta: TraceMeta
    draft_tokens: np.ndarray | None = None
    draft_accepted: np.ndarray | None = None
    draft_selections: np.ndarray | None = None

    @property
    def layers(self) -> int:
        return int(self.selections.shape[0])

    @property
    def steps(self) -> int:
        return int(self.selections.shape[1])

    @property
    def k(self) -> int:
        return int(self.selections.shape[2])

    def layer_selections(self, layer: int) -> list[torch.Tensor]:
        """Per step of ``layer``, int64 ``[k]`` selected positions, ``-1`` padding kept."""
        return list(torch.from_numpy(self.selections[layer].astype(np.int64)))


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


def _text_problem(text_path: str) -> tuple[str | None, str]:
    """(problem or None, text): reads ``text_path`` as UTF-8 text with universal newlines."""
    try:
        with open(text_path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return f"text file {text_path} does not exist", ""
    except IsADirectoryError:
        return f"text file {text_path} is a directory", ""
    except OSError as e:
        return f"cannot read text file {text_path}: {e.strerror or e}", ""
    if not data:
        return f"text file {text_path} is empty", ""
    if b"\0" in data:
        return f"text file {text_path} looks binary (it contains NUL bytes)", ""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return (f"text file {text_path} is not UTF-8 text (byte {e.start}: {e.reason}); "
                "binary files cannot be recorded"), ""
    if not text.strip():
        return f"text file {text_path} holds only whitespace", ""
    # as open(..., encoding="utf-8") reads it (universal newlines), so tokens match old traces
    return None, text.replace("\r\n", "\n").replace("\r", "\n")


def check_record_inputs(text_path: str, out_path: str, *, k: int = 64, max_tokens: int = 2048,
                        start: int | None = None) -> str:
    """Check what :func:`record_trace` needs before the model loads (about 6 s); return the text.

    Raises ValueError, naming the file or option, for: ``k`` or ``max_tokens`` < 1, ``start``
    outside ``[0, max_tokens)``; a text file that is missing, unreadable, empty, whitespace only,
    binary (NUL bytes) or not UTF-8; a text too short to give one step; an output that is a
    directory, the text itself, in a missing directory, or not writable (a temporary file is
    created and removed next to it, which also catches read-only file systems).

    Length check: tokenizing needs the model, so this uses a bound that never refuses a text
    that would work: a byte-level BPE token covers at least one UTF-8 byte (no BOS is added), so
    a text of fewer than ``start + 1`` bytes cannot give the ``start + 1`` tokens one step needs.
    A longer text that still tokenizes to ``start`` tokens or fewer is refused by
    :func:`record_trace` right after tokenization.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    start = k if start is None else start
    if not 0 <= start < max_tokens:
        raise ValueError(f"start must be in [0, max_tokens={max_tokens}), got {start} (start "
                         "defaults to k; a step needs a query position below max_tokens)")
    problem, text = _text_problem(text_path)
    if problem:
        raise ValueError(problem)
    n_bytes = len(text.encode("utf-8"))
    if n_bytes <= start:
        raise ValueError(
            f"text file {text_path} is too short: {n_bytes} bytes give at most {n_bytes} tokens, "
            f"and one step needs more than start={start} tokens")
    if os.path.isdir(out_path):
        raise ValueError(f"output {out_path} is a directory")
    if os.path.exists(out_path) and os.path.samefile(out_path, text_path):
        raise ValueError(f"output {out_path} is the input text file")
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise ValueError(f"output directory {out_dir} does not exist")
    if os.path.exists(out_path) and not os.access(out_path, os.W_OK):
        raise ValueError(f"output {out_path} is not writable")
    try:
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".ulacache-write-check-"):
            pass
    except OSError as e:
        raise ValueError(f"output {out_path} is not writable: {e.strerror or e}") from e
    return text


def ngram_drafts(ids: Sequence[int], max_n: int = 3) -> np.ndarray:
    """Prompt-lookup drafts: ``int64 [T]``, entry ``t`` the token proposed to follow position
    ``t`` from ``ids[:t + 1]`` alone: for ``n = max_n .. 1`` (longest first), the most recent
    earlier occurrence of the last ``n`` tokens, ending at ``e < t``, proposes ``ids[e + 1]``;
    ``-1`` when no suffix recurs. One pass, a dict per ``n``."""
    ids = [int(x) for x in ids]
    out = np.full(len(ids), -1, dtype=np.int64)
    last: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
    for t in range(len(ids)):
        for n in range(max_n, 0, -1):
            if t + 1 >= n:
                e = last[n].get(tuple(ids[t + 1 - n: t + 1]))
                if e is not None:
                    out[t] = ids[e + 1]
                    break
        for n in range(1, max_n + 1):  # grams ending at t become visible to later positions
            if t + 1 >= n:
                last[n][tuple(ids[t + 1 - n: t + 1])] = t
    return out


def record_trace(text_path: str, out_path: str, *, max_tokens: int = 2048, k: int = 64,
                 start: int | None = None, model=None, progress: bool = True,
                 draft_n: int = 3) -> TraceMeta:
    """Tokenize ``text_path``, run one causal pass and write a trace ``.npz`` to ``out_path``.

    ``max_tokens`` truncates the text; steps are query positions ``start .. n_tokens - 1`` with
    ``start`` defaulting to ``k`` (every step then has at least ``k + 1`` candidate keys, so no
    padding). ``model`` is a :class:`ulacache.tools.smollm.SmolLM2` (loaded when None, after
    :func:`check_record_inputs` has accepted the inputs). The file is written to a temporary
    name and renamed, so a failed run leaves no partial trace. ``progress`` logs timing at INFO
    level. Returns the metadata written.
    """
    text = check_record_inputs(text_path, out_path, k=k, max_tokens=max_tokens, start=start)
    start = k if start is None else start
    from ulacache.tools.smollm import MODEL_NAME, SmolLM2

    t_begin = time.perf_counter()
    if model is None:
        model = SmolLM2.from_gguf()
    ids = model.tokenize(text)[:max_tokens]
    n = len(ids)
    if not start < n:
        raise ValueError(f"text file {text_path} gives {n} tokens (max_tokens={max_tokens}): "
                         f"no step after start={start}; use a longer text or a smaller --start/--k")
    t0 = time.perf_counter()
    drafts = ngram_drafts(ids, draft_n)
    out = model.forward(ids, select_k=k, logits="none", draft_ids=drafts)
    if progress:
        logger.info("causal pass over %d tokens with top-%d selection and %d draft branches: "
                    "%.1f s", n, k, int((drafts >= 0).sum()), time.perf_counter() - t0)
    sel = torch.stack(out.selections)[:, start:, :].to(torch.int32).numpy()  # [L, S, k]
    dsel = torch.stack(out.draft_selections)[:, start:, :].to(torch.int32).numpy()
    positions = np.arange(start, n, dtype=np.int32)
    nxt = np.array(ids[start + 1:] + [-2], dtype=np.int64)  # the text's next token (none last)
    dtok = drafts[start:].astype(np.int32)
    accepted = ((dtok >= 0) & (dtok == nxt)).astype(np.int8)
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
        "draft": DRAFT_METHOD.format(max_n=draft_n, k=k),
        "draft_steps": int((dtok >= 0).sum()),
        "draft_accepted": int(accepted.sum()),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "ulacache_version": _ulacache_version(),
    }
    out_dir = os.path.dirname(os.path.abspath(out_path))
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".ulacache-trace-", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, selections=sel, positions=positions, draft_tokens=dtok,
                                draft_accepted=accepted, draft_selections=dsel,
                                meta=np.array(json.dumps(meta, ensure_ascii=False)))
        os.replace(tmp, out_path)
    except BaseException:
        os.unlink(tmp)
        raise
    if progress:
        logger.info("wrote %s (%d layers x %d steps x k=%d) in %.1f s", out_path,
                    sel.shape[0], sel.shape[1], k, time.perf_counter() - t_begin)
    return _parse_meta(meta)


_META_INTS = ("n_tokens", "k", "steps", "layers")  # each in [1, 2**31): int32 positions


def _parse_meta(meta: object, where: str = "trace") -> TraceMeta:
    """Validate the decoded ``meta`` JSON; errors name ``where`` (the file)."""
    if not isinstance(meta, dict):
        raise TraceFormatError(f"{where}: meta is not a JSON object (got {type(meta).__name__})")
    for key in ("format", "version", *_META_INTS):
        if key not in meta:
            raise TraceFormatError(f"{where}: trace meta lacks key {key!r}")
    if meta["format"] != FORMAT_NAME:
        raise TraceFormatError(f"{where}: not a {FORMAT_NAME} file (format={meta['format']!r})")
    version = meta["version"]
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise TraceFormatError(
            f"{where}: unsupported trace version {version!r} (this build reads "
            f"{', '.join(map(str, READ_VERSIONS))})")
    for key in _META_INTS:
        v = meta[key]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v < 2**31:
            raise TraceFormatError(f"{where}: meta {key!r} must be an integer in [1, 2**31), "
                                   f"got {v!r}")
    return TraceMeta(meta["format"], int(version), meta["n_tokens"], meta["k"], meta["steps"],
                     meta["layers"], dict(meta))


# What numpy, zipfile and zlib raise on corrupt input (found by truncating and bit-flipping
# real traces at every offset, see tests/test_traces.py): BadZipFile (bad CRC, bad headers),
# zlib.error, EOFError, ValueError (npy header, pickles), NotImplementedError (compression
# method), RuntimeError (an "encrypted" flag), plus what a corrupt size or header may cause.
_READ_ERRORS = (OSError, ValueError, EOFError, KeyError, IndexError, TypeError, OverflowError,
                MemoryError, NotImplementedError, RuntimeError, struct.error,
                zipfile.BadZipFile, zlib.error)


def _describe(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or "no details"
    return f"{type(e).__name__}: {msg[:200]}"


def _read_npz(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The arrays of a trace ``.npz`` (selections, positions, meta, and the draft arrays
    present), or :class:`TraceFormatError` naming ``path``."""
    if not os.path.exists(path):
        raise TraceFormatError(f"{path}: no such trace file")
    if os.path.isdir(path):
        raise TraceFormatError(f"{path}: is a directory, not a trace file")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read the trace file ({_describe(e)})") from e
    if not magic:
        raise TraceFormatError(f"{path}: not a readable trace .npz (the file is empty)")
    if magic.startswith(b"\x93NUMPY"):
        raise TraceFormatError(f"{path}: not a readable trace .npz (a single .npy array)")
    if not magic.startswith(b"PK\x03\x04"):
        raise TraceFormatError(f"{path}: not a readable trace .npz (not a zip archive)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = {"selections", "positions", "meta"} - set(z.files)
            if missing:
                raise TraceFormatError(f"{path}: missing arrays {sorted(missing)}")
            drafts = {name: z[name] for name in DRAFT_ARRAYS if name in z.files}
            return z["selections"], z["positions"], z["meta"], drafts
    except TraceFormatError:
        raise
    except _READ_ERRORS as e:
        raise TraceFormatError(f"{path}: not a readable trace .npz, truncated or corrupt "
                               f"({_describe(e)})") from e


def load_trace(path: str | os.PathLike) -> Trace:
    """Read and validate a trace file written by :func:`record_trace`.

    Every problem with the file raises :class:`TraceFormatError` whose message starts with the
    path; no other exception escapes for bad file contents.
    """
    path = os.fspath(path)
    sel, pos, meta_arr, drafts = _read_npz(path)
    if meta_arr.shape != () or meta_arr.dtype.kind != "U":
        raise TraceFormatError(f"{path}: meta must be a 0-d unicode array holding JSON, got "
                               f"{meta_arr.dtype} of shape {meta_arr.shape}")
    try:
        meta = json.loads(str(meta_arr[()]))
    except (ValueError, RecursionError) as e:
        raise TraceFormatError(f"{path}: meta is not valid JSON ({_describe(e)})") from e
    m = _parse_meta(meta, path)
    if sel.dtype != np.int32 or pos.dtype != np.int32:
        raise TraceFormatError(f"{path}: arrays must be int32, got {sel.dtype} and {pos.dtype}")
    if sel.shape != (m.layers, m.steps, m.k) or pos.shape != (m.steps,):
        raise TraceFormatError(
            f"{path}: selections {sel.shape} / positions {pos.shape} disagree with meta "
            f"(layers={m.layers}, steps={m.steps}, k={m.k})")
    if np.any(np.diff(pos) <= 0) or pos[0] < 0 or pos[-1] >= m.n_tokens:
        raise TraceFormatError(
            f"{path}: positions must increase within [0, n_tokens={m.n_tokens})")
    if np.any(sel < -1) or np.any(sel > pos[None, :, None]):
        raise TraceFormatError(f"{path}: a selection is out of range (-1 or 0..query position)")
    if m.version == 1:
        return Trace(sel, pos, m)
    missing = [a for a in DRAFT_ARRAYS if a not in drafts]
    if missing:
        raise TraceFormatError(f"{path}: version 2 trace lacks arrays {missing}")
    dtok, acc, dsel = (drafts[a] for a in DRAFT_ARRAYS)
    if dtok.dtype != np.int32 or acc.dtype != np.int8 or dsel.dtype != np.int32:
        raise TraceFormatError(f"{path}: draft arrays must be int32, int8, int32, got "
                               f"{dtok.dtype}, {acc.dtype}, {dsel.dtype}")
    if dtok.shape != (m.steps,) or acc.shape != (m.steps,) or dsel.shape != sel.shape:
        raise TraceFormatError(f"{path}: draft arrays {dtok.shape} / {acc.shape} / {dsel.shape} "
                               f"disagree with the selections {sel.shape}")
    if np.any(dtok < -1) or np.any((acc != 0) & ((acc != 1) | (dtok < 0))):
        raise TraceFormatError(f"{path}: draft tokens must be >= -1 and accepted flags 0/1 "
                               "(1 only with a draft)")
    if np.any(dsel < -1) or np.any(dsel > pos[None, :, None] + 1) or \
            np.any((dtok < 0)[None, :, None] & (dsel != -1)):
        raise TraceFormatError(f"{path}: a draft selection is out of range (-1 or 0..query "
                               "position + 1; all -1 without a draft)")
    return Trace(sel, pos, m, dtok, acc, dsel)


def _percentiles(x: np.ndarray, qs: Sequence[int] = (10, 50, 90, 99)) -> dict[str, float]:
    if x.size == 0:
        return {f"p{q}": float("nan") for q in qs}
    return {f"p{q}": float(np.percentile(x, q)) for q in qs}


def trace_stats(trace: Trace, pool_sizes: Sequence[int] = DEFAULT_POOL_SIZES,
                policies: Sequence[str] = DEFAULT_POLICIES,
                hit_layers: Sequence[int] | None = None, progress: bool = False) -> dict:
    """Locality figures of ``trace``.

    Returns a dict with ``overlap`` (mean |S_t ∩ S_{t-1}| / k over consecutive steps: ``mean`` and
    ``per_layer``), ``distance`` (percentiles of ``t - position`` over all valid picks),
    ``frac_pos0`` (fraction of picks that are position 0) and ``hit_rate``
    (``{policy: {n_slots: {"mean", "min", "max", "per_layer"}}}``) from
    :func:`ulacache.tools.residency.simulate_trace` (the real selection-group code), run per
    layer on that layer's selections; ``misses`` (``{policy: {n_slots: total}}``) sums them.
    Pass ``pool_sizes=()`` to skip the hit rates, or ``hit_layers`` to simulate only those layers
    (the simulation dominates the run time: about 2-4 s per layer, policy and pool size for 2K
    steps on 2 CPU cores; ``progress`` shows a bar over those runs on stderr when tqdm is
    installed); ``per_layer`` then follows the order of ``hit_layers``. Raises
    ValueError, before any work, for a pool size < 1 or a layer index out of range.
    """
    sel, pos = trace.selections, trace.positions
    L, S, k = sel.shape
    if pool_sizes:  # validated before the work
        if any(isinstance(n, bool) or int(n) != n or n < 1 for n in pool_sizes):
            raise ValueError(f"pool sizes must be positive integers, got {list(pool_sizes)}")
        if not policies:
            raise ValueError("policies must not be empty when pool sizes are given")
        layer_ids = list(range(L)) if hit_layers is None else [int(x) for x in hit_layers]
        if not layer_ids or any(not 0 <= x < L for x in layer_ids):
            raise ValueError(f"hit_layers must be non-empty layer indices in [0, {L}), "
                             f"got {layer_ids}")
    valid = sel >= 0
    consecutive = np.diff(pos) == 1  # [S-1]
    per_layer_overlap = []
    for layer in range(L):
        member = _members(sel[layer], int(trace.meta.n_tokens))
        inter = (member[1:] & member[:-1]).sum(axis=1)[consecutive]
        per_layer_overlap.append(float(inter.mean() / k) if inter.size else float("nan"))
    dist = (pos[None, :, None] - sel)[valid]
    picks = int(valid.sum())
    draft = None if trace.draft_tokens is None else draft_stats(trace)
    stats = {
        "layers": L, "steps": S, "k": k, "n_tokens": trace.meta.n_tokens,
        "text_file": trace.meta.raw.get("text_file"),
        "overlap": {"mean": float(np.nanmean(per_layer_overlap)) if L else float("nan"),
                    "per_layer": per_layer_overlap},
        "distance": {**_percentiles(dist), "mean": float(dist.mean()) if dist.size else
                     float("nan")},
        "frac_pos0": float((sel == 0).sum() / picks) if picks else float("nan"),
        "draft": draft,
        "hit_rate": {},
    }
    if pool_sizes:
        from ulacache.tools.residency import simulate_trace

        stats["hit_layers"] = layer_ids
        stats["misses"] = {}
        from .progress import bar as _progress

        positions = [int(p) for p in pos]
        bar = _progress(progress, total=len(policies) * len(pool_sizes) * len(layer_ids),
                        desc="hit rates", unit="run")
        for policy in policies:
            by_size, misses = {}, {}
            for n_slots in pool_sizes:
                runs = []
                for layer in layer_ids:
                    runs.append(simulate_trace(trace.layer_selections(layer), positions, policy,
                                               int(n_slots), trace.meta.n_tokens))
                    bar.update(1)
                rates = [r.hit_rate for r in runs]
                by_size[int(n_slots)] = {"mean": float(np.mean(rates)), "min": float(min(rates)),
                                         "max": float(max(rates)), "per_layer": rates}
                misses[int(n_slots)] = sum(r.misses for r in runs)
            stats["hit_rate"][policy] = by_size
            stats["misses"][policy] = misses
        bar.close()
    return stats


def _members(rows: np.ndarray, width: int) -> np.ndarray:
    """``bool [steps, width]``: which positions each row (``-1`` padded) holds."""
    member = np.zeros((rows.shape[0], width + 1), dtype=bool)
    member[np.repeat(np.arange(rows.shape[0]), rows.shape[1]),
           np.where(rows >= 0, rows, width).ravel()] = True
    return member[:, :width]


def draft_stats(trace: Trace) -> dict:
    """How well a draft token's selection predicts the next step's (a version 2 trace):
    ``coverage`` (steps with a draft), ``acceptance`` (of those, the draft is the next token),
    and per layer the mean share of the next step's ``k`` selections that the draft selected
    (``predicts``: all drafted steps; ``predicts_rejected``: drafts that were wrong), beside the
    share the current step's own selection already holds (``current``: what a prefetch without
    drafts could use)."""
    sel, dsel, pos = trace.selections, trace.draft_selections, trace.positions
    L, S, k = sel.shape
    has = (trace.draft_tokens >= 0)[:-1] & (np.diff(pos) == 1)  # a draft and a next step
    rejected = has & (trace.draft_accepted[:-1] == 0)
    width = int(trace.meta.n_tokens) + 1
    pred, pred_rej, cur = [], [], []
    for layer in range(L):
        nxt = _members(sel[layer, 1:], width)
        hit_d = (_members(dsel[layer, :-1], width) & nxt).sum(1) / k
        hit_c = (_members(sel[layer, :-1], width) & nxt).sum(1) / k
        pred.append(float(hit_d[has].mean()) if has.any() else float("nan"))
        pred_rej.append(float(hit_d[rejected].mean()) if rejected.any() else float("nan"))
        cur.append(float(hit_c[has].mean()) if has.any() else float("nan"))
    drafted = int((trace.draft_tokens >= 0).sum())
    return {"coverage": drafted / S, "acceptance": (int(trace.draft_accepted.sum()) / drafted
                                                    if drafted else float("nan")),
            "predicts": float(np.nanmean(pred)), "predicts_rejected": float(np.nanmean(pred_rej)),
            "current": float(np.nanmean(cur)), "per_layer": {"predicts": pred,
                                                             "predicts_rejected": pred_rej,
                                                             "current": cur}}


def _rel(new: int, ref: int) -> str:
    """``new`` relative to ``ref`` as a signed percentage ("n/a" when ``ref`` is 0)."""
    if ref == 0:
        return "+0.0%" if new == 0 else "n/a (LRU 0)"
    return f"{(new - ref) / ref:+.1%}"


def format_stats(stats: dict) -> str:
    """A short human-readable report of :func:`trace_stats` output: locality figures, then, when
    hit rates were simulated, the hit-rate and misses tables per policy and pool size and, when
    both ``lru`` and ``pblru`` ran, PB-LRU's misses relative to exact LRU's per pool size."""
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
    dr = stats.get("draft")
    if dr:
        lines.append(
            f"drafts (prompt lookup): {dr['coverage']:.1%} of steps, {dr['acceptance']:.1%} "
            f"accepted; the next step's top-k selected by the draft token {dr['predicts']:.3f} "
            f"(rejected drafts {dr['predicts_rejected']:.3f}), by the current step "
            f"{dr['current']:.3f}")
    hr = stats.get("hit_rate") or {}
    if not hr:
        return "\n".join(lines)
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
    misses = stats.get("misses") or {}
    if misses:
        lines.append(f"misses, GPU slots per layer (total over {which})")
        lines.append(f"{'policy':<8}" + "".join(f"{s:>12}" for s in sizes))
        for policy, by in misses.items():
            lines.append(f"{policy:<8}" + "".join(
                f"{by[s]:>12d}" if s in by else f"{'-':>12}" for s in sizes))
        lru, pb = misses.get("lru"), misses.get("pblru")
        if lru and pb:
            cells = "  ".join(f"{s}: {_rel(pb[s], lru[s])}" for s in sizes
                              if s in lru and s in pb)
            lines.append(f"PB-LRU misses vs exact LRU: {cells}")
    return "\n".join(lines)
