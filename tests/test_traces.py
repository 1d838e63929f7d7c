"""Tests of the selection-trace format (validation of every kind of bad file), the recorder's
input checks, the statistics and their report."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from ulacache.tools import traces
from ulacache.tools.cli import bundled_trace

FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "fixtures")
TYPING_TRACE = os.path.join(FIXTURE_DIR, "typing-py-1024-k64.trace.npz")
# recorded with SmolLM2, k=64 (see fixtures/README.md); the smallest first
FIXTURES = [TYPING_TRACE, str(bundled_trace())]

# 1 layer, k=2, positions 2,3,4,6 (6 is not consecutive with 4)
SYN_SEL = np.array([[[0, 2], [0, 3], [3, 4], [5, 6]]], dtype=np.int32)
SYN_POS = np.array([2, 3, 4, 6], dtype=np.int32)
SYN_META = {"format": traces.FORMAT_NAME, "version": 1, "n_tokens": 7,  # no draft arrays
            "k": 2, "steps": 4, "layers": 1}


def _write(path, sel, pos, **meta_over):
    meta = {"format": traces.FORMAT_NAME, "version": 1,
            "n_tokens": int(pos[-1]) + 1, "k": sel.shape[2], "steps": sel.shape[1],
            "layers": sel.shape[0], "text_file": "synthetic"}
    meta.update(meta_over)
    np.savez(path, selections=sel, positions=pos, meta=np.array(json.dumps(meta)))
    return path


def _synthetic(tmp_path):
    return _write(tmp_path / "s.trace.npz", SYN_SEL, SYN_POS, n_tokens=7)


def test_load_and_stats_of_synthetic_trace(tmp_path):
    tr = traces.load_trace(str(_synthetic(tmp_path)))
    assert (tr.layers, tr.steps, tr.k) == (1, 4, 2)
    st = traces.trace_stats(tr, pool_sizes=())
    # overlaps over consecutive pairs (2,3) and (3,4): {0}, {3} -> (1 + 1) / 2 / k
    assert st["overlap"]["mean"] == pytest.approx(0.5)
    # distances: 2,0, 3,0, 1,0, 1,0
    assert st["distance"]["p50"] == pytest.approx(0.5)
    assert st["frac_pos0"] == pytest.approx(2 / 8)
    assert "hit_rate" in st and not st["hit_rate"] and "misses" not in st
    text = traces.format_stats(st)
    assert "overlap" in text and "p99" in text and "misses" not in text
    assert [t.tolist() for t in tr.layer_selections(0)] == SYN_SEL[0].tolist()


# the synthetic trace with drafts: step t's draft (token 9 after position 2, 5 after 3, ...)
SYN_DTOK = np.array([9, 5, -1, 4], dtype=np.int32)
SYN_ACC = np.array([1, 0, 0, 0], dtype=np.int8)
SYN_DSEL = np.array([[[0, 3], [4, 3], [-1, -1], [6, 7]]], dtype=np.int32)


def _write_v2(path, dtok=SYN_DTOK, acc=SYN_ACC, dsel=SYN_DSEL, drop=(), **meta_over):
    meta = {**SYN_META, "version": 2, **meta_over}
    arrays = dict(selections=SYN_SEL, positions=SYN_POS, draft_tokens=dtok, draft_accepted=acc,
                  draft_selections=dsel, meta=np.array(json.dumps(meta)))
    np.savez(path, **{k: v for k, v in arrays.items() if k not in drop})
    return str(path)


def test_version_2_drafts_load_and_their_prediction_is_measured(tmp_path):
    tr = traces.load_trace(_write_v2(tmp_path / "d.npz"))
    assert tr.meta.version == 2 and tr.draft_tokens.tolist() == SYN_DTOK.tolist()
    st = traces.trace_stats(tr, pool_sizes=())["draft"]
    # steps with a draft and a consecutive next step: 0 (pos 2->3) and 1 (3->4)
    # step 0: draft {0, 3} vs next {0, 3}: 2/2; step 1: draft {3, 4} vs next {3, 4}: 2/2
    # the current selection: {0, 2} vs {0, 3}: 1/2; {0, 3} vs {3, 4}: 1/2
    assert st["coverage"] == pytest.approx(3 / 4) and st["acceptance"] == pytest.approx(1 / 3)
    assert st["predicts"] == pytest.approx(1.0) and st["current"] == pytest.approx(0.5)
    assert st["predicts_rejected"] == pytest.approx(1.0)  # step 1 only
    assert "drafts (prompt lookup)" in traces.format_stats(traces.trace_stats(tr, pool_sizes=()))
    assert traces.trace_stats(traces.load_trace(_synthetic(tmp_path)), pool_sizes=())[
        "draft"] is None  # version 1: no drafts


@pytest.mark.parametrize("kw, match", [
    (dict(drop=("draft_selections",)), "lacks arrays"),
    (dict(dtok=SYN_DTOK.astype(np.int64)), "must be int32, int8, int32"),
    (dict(acc=SYN_ACC[:3]), "disagree with the selections"),
    (dict(acc=np.array([0, 0, 1, 0], dtype=np.int8)), "1 only with a draft"),
    (dict(acc=np.array([2, 0, 0, 0], dtype=np.int8)), "accepted flags 0/1"),
    (dict(dtok=np.array([9, 5, -2, 4], dtype=np.int32)), "draft tokens must be >= -1"),
    (dict(dsel=np.array([[[0, 4], [4, 3], [-1, -1], [6, 7]]], dtype=np.int32)),
     "draft selection is out of range"),  # 4 > position 2 + 1
    (dict(dsel=np.array([[[0, 3], [4, 3], [0, -1], [6, 7]]], dtype=np.int32)),
     "all -1 without a draft"),
])
def test_version_2_rejects_bad_draft_arrays(tmp_path, kw, match):
    with pytest.raises(traces.TraceFormatError, match=match):
        traces.load_trace(_write_v2(tmp_path / "bad.npz", **kw))


def test_ngram_drafts_propose_the_most_recent_continuation():
    ids = [1, 2, 3, 1, 2, 4, 1, 2, 9, 5]
    got = traces.ngram_drafts(ids, max_n=3).tolist()
    # t=3 (..., 1): "1" seen ending at 0 -> 2; t=4 ("1 2"): seen ending at 1 -> 3;
    # t=6 ("1"): most recent "1" ended at 3 -> 2; t=7 ("4 1 2" new; "1 2" ended at 4) -> 4;
    # t=9 ("5" never seen) -> -1
    assert got == [-1, -1, -1, 2, 3, -1, 2, 4, -1, -1]
    assert traces.ngram_drafts([], 3).size == 0


def test_layer_selections_keep_padding(tmp_path):
    sel = np.array([[[0, -1, -1], [0, 1, -1], [0, 1, 2]]], dtype=np.int32)
    pos = np.array([0, 1, 2], dtype=np.int32)
    tr = traces.load_trace(_write(tmp_path / "p.npz", sel, pos))  # a Path works too
    rows = tr.layer_selections(0)
    assert [r.tolist() for r in rows] == sel[0].tolist() and str(rows[0].dtype) == "torch.int64"
    assert [int((r >= 0).sum()) for r in rows] == [1, 2, 3]
    assert traces.trace_stats(tr, pool_sizes=())["frac_pos0"] == pytest.approx(3 / 6)


def _meta(**over):
    return np.array(json.dumps({**SYN_META, **over}))


@pytest.mark.parametrize(
    "arrays, match",
    [
        ({"meta": _meta(format="other")}, "not a ulacache"),
        ({"meta": _meta(version=99)}, "unsupported trace version"),
        ({"meta": _meta(version=True)}, "unsupported trace version"),
        ({"meta": _meta(steps=5)}, "disagree with meta"),
        ({"meta": _meta(k="2")}, "'k' must be an integer"),
        ({"meta": _meta(steps=-1)}, "'steps' must be an integer"),
        ({"meta": _meta(layers=True)}, "'layers' must be an integer"),
        ({"meta": _meta(layers=1.0)}, "'layers' must be an integer"),
        ({"meta": _meta(n_tokens=2**40)}, "'n_tokens' must be an integer"),
        ({"meta": _meta(k=None)}, "'k' must be an integer"),
        ({"meta": np.array(json.dumps({k: v for k, v in SYN_META.items() if k != "k"}))},
         "lacks key 'k'"),
        ({"meta": np.array("{not json")}, "meta is not valid JSON"),
        ({"meta": np.array("[" * 100_000)}, "meta is not valid JSON"),  # too deep to parse
        ({"meta": np.array(json.dumps([1, 2]))}, "not a JSON object"),
        ({"meta": np.array("7")}, "not a JSON object"),
        ({"meta": np.array([json.dumps(SYN_META)])}, "0-d unicode array"),
        ({"meta": np.array(7)}, "0-d unicode array"),
        ({"meta": np.array(json.dumps(SYN_META).encode())}, "0-d unicode array"),
        ({"selections": SYN_SEL.astype(np.int64)}, "int32"),
        ({"positions": SYN_POS.astype(np.float32)}, "int32"),
        ({"selections": SYN_SEL[:, :3]}, "disagree with meta"),
        ({"selections": SYN_SEL[0]}, "disagree with meta"),
        ({"positions": SYN_POS[:3]}, "disagree with meta"),
        ({"positions": SYN_POS[::-1].copy()}, "positions must increase"),
        ({"positions": np.array([2, 3, 3, 6], np.int32)}, "positions must increase"),
        ({"positions": SYN_POS + 1}, "positions must increase"),  # last one >= n_tokens
        ({"positions": SYN_POS - 3, "meta": _meta()}, "positions must increase"),  # < 0
        ({"selections": SYN_SEL + 5}, "out of range"),
        ({"selections": SYN_SEL - 3}, "out of range"),
    ],
)
def test_load_rejects_inconsistent_files(tmp_path, arrays, match):
    full = {"selections": SYN_SEL, "positions": SYN_POS, "meta": _meta(), **arrays}
    path = tmp_path / "bad.npz"
    np.savez(path, **full)
    with pytest.raises(traces.TraceFormatError, match=match) as info:
        traces.load_trace(str(path))
    assert str(info.value).startswith(f"{path}: ")


def test_load_rejects_non_trace_files(tmp_path):
    def refused(path, match):
        with pytest.raises(traces.TraceFormatError, match=match) as info:
            traces.load_trace(str(path))
        assert str(info.value).startswith(f"{path}: ")

    refused(tmp_path / "missing.npz", "no such trace file")
    refused(tmp_path, "is a directory")
    (tmp_path / "empty.npz").write_bytes(b"")
    refused(tmp_path / "empty.npz", "the file is empty")
    (tmp_path / "x.npz").write_bytes(b"not a zip")
    refused(tmp_path / "x.npz", "not a zip archive")
    np.save(tmp_path / "a.npy", SYN_SEL)
    refused(tmp_path / "a.npy", "single .npy array")
    np.savez(tmp_path / "y.npz", selections=np.zeros((1, 1, 1), np.int32))
    refused(tmp_path / "y.npz", "missing arrays")
    # pickled arrays: never unpickled (allow_pickle=False), refused
    np.savez(tmp_path / "o.npz", selections=np.array([None, 1], dtype=object),
             positions=SYN_POS, meta=_meta())
    refused(tmp_path / "o.npz", "not a readable trace")
    np.savez(tmp_path / "om.npz", selections=SYN_SEL, positions=SYN_POS,
             meta=np.array({"k": 2}, dtype=object))
    refused(tmp_path / "om.npz", "not a readable trace")


def _check_corruptions(tmp_path, data: bytes, offsets, original: traces.Trace) -> int:
    """Truncate and bit-flip ``data`` at ``offsets``: every load either raises
    TraceFormatError or (a flip in a field the reader ignores) returns the original arrays.
    Returns how many were refused."""
    refused = 0
    path = tmp_path / "c.npz"
    for i in offsets:
        flipped = bytearray(data)
        flipped[i] ^= 1 << (i % 8)
        for mode, blob in (("truncated", data[:i]), ("flipped", bytes(flipped))):
            path.write_bytes(blob)
            try:
                tr = traces.load_trace(str(path))
            except traces.TraceFormatError as e:
                assert str(path) in str(e)
                refused += 1
                continue
            assert mode == "flipped", f"a trace truncated to {i} bytes loaded"
            np.testing.assert_array_equal(tr.selections, original.selections)
            np.testing.assert_array_equal(tr.positions, original.positions)
            assert tr.meta.raw == original.meta.raw
    return refused


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed], ids=["stored", "deflated"])
def test_every_truncation_and_bit_flip_of_a_small_trace_is_refused_cleanly(tmp_path, save):
    # zip CRCs, zlib streams, npy headers and JSON all get hit: at every offset of the file
    rng = np.random.default_rng(0)
    sel = np.sort(rng.integers(0, 3, (2, 6, 4)), axis=-1).astype(np.int32)
    pos = np.arange(3, 9, dtype=np.int32)
    meta = {**SYN_META, "n_tokens": 9, "k": 4, "steps": 6, "layers": 2}
    buf = io.BytesIO()
    save(buf, selections=sel, positions=pos, meta=np.array(json.dumps(meta)))
    data = buf.getvalue()
    (tmp_path / "ok.npz").write_bytes(data)
    original = traces.load_trace(str(tmp_path / "ok.npz"))
    refused = _check_corruptions(tmp_path, data, range(len(data)), original)
    assert refused > 1.5 * len(data)  # all truncations and most flips


def test_truncations_and_bit_flips_of_a_recorded_trace_are_refused_cleanly(tmp_path):
    data = open(TYPING_TRACE, "rb").read()
    original = traces.load_trace(TYPING_TRACE)
    offsets = [0, 1, 3, 17, 30, 64, 200, 1000, 4096, len(data) // 3, len(data) // 2,
               len(data) - 4096, len(data) - 300, len(data) - 100, len(data) - 22,
               len(data) - 1]
    assert _check_corruptions(tmp_path, data, offsets, original) >= len(offsets) + 8


@pytest.mark.parametrize("path", FIXTURES, ids=os.path.basename)
def test_recorded_fixture_is_valid_and_local(path):
    tr = traces.load_trace(path)
    m = tr.meta.raw
    assert m["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(m["gguf_sha256"]) == 64
    assert tr.layers == 30 and tr.k == 64 and tr.steps == m["n_tokens"] - m["start"]
    assert np.all(tr.selections >= 0)  # start = k: every step has k real picks
    st = traces.trace_stats(tr, pool_sizes=())
    # real attention is local in time: consecutive selections overlap heavily, and many
    # picks are recent, while some reach far back
    assert 0.4 < st["overlap"]["mean"] < 0.95
    assert st["distance"]["p10"] < 16 < st["distance"]["p90"]
    assert 0.0 < st["frac_pos0"] < 0.1


def test_fixture_hit_rates():
    # 2 layers x 2 policies x 2 pool sizes of the 960-step fixture: ~8 simulations
    tr = traces.load_trace(TYPING_TRACE)
    st = traces.trace_stats(tr, pool_sizes=(256, 1024), hit_layers=(0, 20))
    assert set(st["hit_rate"]) == {"lru", "pblru"} and st["hit_layers"] == [0, 20]
    for policy, by_size in st["hit_rate"].items():
        assert len(by_size[256]["per_layer"]) == 2
        small, big = by_size[256]["mean"], by_size[1024]["mean"]
        assert 0.0 < small <= big <= 1.0
        misses = st["misses"][policy]
        assert misses[256] >= misses[1024] >= 0 and misses[256] > 0
    text = traces.format_stats(st)
    assert "hit rate" in text and "misses, GPU slots" in text
    assert "PB-LRU misses vs exact LRU: 256: " in text


def test_hit_rates_and_misses_of_synthetic_trace(tmp_path):
    tr = traces.load_trace(str(_synthetic(tmp_path)))
    # a pool that holds every token: every selected row is already on the GPU
    st = traces.trace_stats(tr, pool_sizes=(1, 8))
    assert st["hit_layers"] == [0]
    for policy in ("lru", "pblru"):
        assert st["hit_rate"][policy][8]["mean"] == 1.0 and st["misses"][policy][8] == 0
        assert st["misses"][policy][1] > 0
        assert st["hit_rate"][policy][1]["mean"] < 1.0
    text = traces.format_stats(st)
    assert "PB-LRU misses vs exact LRU: 1: " in text and "8: +0.0%" in text
    only_lru = traces.trace_stats(tr, pool_sizes=(8,), policies=("lru",))
    assert set(only_lru["misses"]) == {"lru"}
    assert "PB-LRU misses vs" not in traces.format_stats(only_lru)


def test_format_stats_misses_table_and_relative_difference(tmp_path):
    st = traces.trace_stats(traces.load_trace(str(_synthetic(tmp_path))), pool_sizes=())
    rate = {"mean": 0.9, "min": 0.8, "max": 1.0, "per_layer": [0.8, 1.0]}
    st.update(hit_layers=[0], layers=1,
              hit_rate={p: {128: rate, 256: rate, 512: rate} for p in ("lru", "pblru")},
              misses={"lru": {128: 1000, 256: 500, 512: 0},
                      "pblru": {128: 1001, 256: 499, 512: 3}})
    lines = traces.format_stats(st).splitlines()
    i = lines.index("misses, GPU slots per layer (total over all layers)")
    assert lines[i + 1].split() == ["policy", "128", "256", "512"]
    assert lines[i + 2].split() == ["lru", "1000", "500", "0"]
    assert lines[i + 3].split() == ["pblru", "1001", "499", "3"]
    assert lines[i + 4] == "PB-LRU misses vs exact LRU: 128: +0.1%  256: -0.2%  512: n/a (LRU 0)"


@pytest.mark.parametrize(
    "kw, match",
    [({"pool_sizes": (0,)}, "pool sizes"), ({"pool_sizes": (-4, 8)}, "pool sizes"),
     ({"pool_sizes": (2.5,)}, "pool sizes"), ({"pool_sizes": (8,), "hit_layers": (1,)},
                                               "hit_layers"),
     ({"pool_sizes": (8,), "hit_layers": ()}, "hit_layers"),
     ({"pool_sizes": (8,), "policies": ()}, "policies")],
)
def test_trace_stats_rejects_bad_arguments(tmp_path, kw, match):
    tr = traces.load_trace(str(_synthetic(tmp_path)))
    with pytest.raises(ValueError, match=match):
        traces.trace_stats(tr, **kw)


# ---------------------------------------------------------------- record input checks

LONG_TEXT = "word " * 40  # 200 bytes


def _text(tmp_path, content, name="t.txt"):
    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(p)


@pytest.mark.parametrize(
    "content, kw, match",
    [
        (None, {}, "does not exist"),
        (b"", {}, "is empty"),
        (b" \n\t\n", {}, "only whitespace"),
        (b"abc\0def" * 40, {}, "binary"),
        ("caf\u00e9 ".encode("latin-1") * 40, {}, "not UTF-8"),
        (b"\x89PNG\r\n\x1a\n" + b"\xff" * 200, {}, "not UTF-8"),
        ("tiny text", {}, "too short: 9 bytes"),
        ("x" * 64, {}, "too short: 64 bytes"),  # one step needs k + 1 = 65 tokens
        ("x" * 20, {"k": 8, "start": 20}, "start=20"),
        (LONG_TEXT, {"k": 0}, "k must be >= 1"),
        (LONG_TEXT, {"max_tokens": 0}, "max_tokens must be >= 1"),
        (LONG_TEXT, {"start": -1}, "start must be in"),
        (LONG_TEXT, {"k": 64, "max_tokens": 64}, "start must be in"),
    ],
)
def test_check_record_inputs_refuses_bad_text(tmp_path, content, kw, match):
    text = str(tmp_path / "missing.txt") if content is None else _text(tmp_path, content)
    with pytest.raises(ValueError, match=match):
        traces.check_record_inputs(text, str(tmp_path / "out.npz"), **kw)


def test_check_record_inputs_refuses_bad_output(tmp_path, monkeypatch):
    text = _text(tmp_path, LONG_TEXT)
    check = traces.check_record_inputs
    with pytest.raises(ValueError, match="is a directory"):
        check(text, str(tmp_path), k=8)
    with pytest.raises(ValueError, match="does not exist"):
        check(text, str(tmp_path / "no" / "out.npz"), k=8)
    with pytest.raises(ValueError, match="does not exist"):  # parent is a file
        check(text, os.path.join(text, "out.npz"), k=8)
    with pytest.raises(ValueError, match="is the input text"):
        check(text, text, k=8)
    with pytest.raises(ValueError, match="is a directory"):
        check(str(tmp_path), str(tmp_path / "o.npz"), k=8)

    def read_only(*args, **kwargs):  # as a read-only file system answers (also under root)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(traces.tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(ValueError, match="not writable: Permission denied"):
        check(text, str(tmp_path / "out.npz"), k=8)


def test_check_record_inputs_accepts_and_returns_text(tmp_path):
    text = _text(tmp_path, b"line one\r\nline two\rthree " + b"x" * 100)
    out = tmp_path / "out.npz"
    assert traces.check_record_inputs(text, str(out), k=8).startswith("line one\nline two\nthree")
    assert not out.exists() and os.listdir(tmp_path) == ["t.txt"]  # the write check cleans up
    # an existing output is overwritten, not refused; 9 bytes give at most 9 tokens > start=8
    out.write_bytes(b"old")
    assert traces.check_record_inputs(_text(tmp_path, "123456789", "n.txt"), str(out), k=8)


def test_record_trace_refuses_before_loading_the_model(tmp_path, monkeypatch):
    from ulacache.tools import smollm

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(smollm.SmolLM2, "from_gguf", no_model)
    with pytest.raises(ValueError, match="too short"):
        traces.record_trace(_text(tmp_path, "tiny"), str(tmp_path / "o.npz"), progress=False)
    with pytest.raises(ValueError, match="binary"):
        traces.record_trace(_text(tmp_path, b"\0" * 500), str(tmp_path / "o.npz"))
    with pytest.raises(ValueError, match="does not exist"):
        traces.record_trace(_text(tmp_path, LONG_TEXT), str(tmp_path / "d" / "o.npz"), k=8)


def test_record_trace_refuses_a_text_that_tokenizes_too_short(tmp_path):
    class FewTokens:  # passes the byte bound, then gives 10 tokens
        def tokenize(self, text):
            return list(range(10))

        def forward(self, *args, **kwargs):
            raise AssertionError("no forward pass for a text without steps")

    out = tmp_path / "o.npz"
    with pytest.raises(ValueError, match="gives 10 tokens"):
        traces.record_trace(_text(tmp_path, LONG_TEXT), str(out), k=16, model=FewTokens())
    assert not out.exists()


def test_record_trace_end_to_end(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from ulacache.tools import smollm

    try:
        model = smollm.SmolLM2.from_gguf()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 GGUF not available: {exc}")
    src = "/usr/share/common-licenses/Apache-2.0"
    if not os.path.isfile(src):
        pytest.skip(f"{src} not present")
    out = tmp_path / "a.trace.npz"
    meta = traces.record_trace(src, str(out), max_tokens=256, k=32, model=model, progress=False)
    assert (meta.n_tokens, meta.k, meta.steps, meta.layers) == (256, 32, 256 - 32, 30)
    assert os.listdir(tmp_path) == ["a.trace.npz"]  # no temporary file left behind
    tr = traces.load_trace(str(out))
    assert tr.positions[0] == 32 and tr.positions[-1] == 255
    assert tr.meta.raw["text_head"] == open(src, encoding="utf-8").read()[:200]
    assert tr.meta.raw["text_file"] == "Apache-2.0" and len(tr.meta.raw["text_sha256"]) == 64
    # the recorded selection equals the model's own top-k for the same pass
    ids = model.tokenize(open(src, encoding="utf-8").read())[:256]
    sel = model.forward(ids, select_k=32, logits="none").selections
    np.testing.assert_array_equal(tr.selections[3], sel[3][32:].numpy())
    st = traces.trace_stats(tr, pool_sizes=())
    assert 0.3 < st["overlap"]["mean"] < 1.0
    # version 2: drafts from the text so far; an accepted draft selects what the next step does
    assert tr.meta.version == 2 and tr.draft_tokens is not None
    np.testing.assert_array_equal(tr.draft_tokens, traces.ngram_drafts(ids)[32:])
    acc = np.flatnonzero(tr.draft_accepted[:-1])
    assert acc.size > 10 and (tr.draft_tokens[acc] == np.array(ids)[33:][acc]).all()
    np.testing.assert_array_equal(tr.draft_selections[:, acc], tr.selections[:, acc + 1])
    assert 0.0 < st["draft"]["acceptance"] < 1.0
