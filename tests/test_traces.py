"""Tests of the selection-trace format, recorder and statistics."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from ulacache import traces

FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "fixtures")
# recorded with SmolLM2, k=64 (see fixtures/README.md); the smallest first
FIXTURES = [
    p for p in (os.path.join(FIXTURE_DIR, n)
                for n in ("typing-py-1024-k64.trace.npz", "gpl3-2048-k64.trace.npz"))
    if os.path.isfile(p)
]
HAVE_POLICY_SIM = importlib.util.find_spec("ulacache.policy_sim") is not None


def _write(path, sel, pos, **meta_over):
    meta = {"format": traces.FORMAT_NAME, "version": traces.FORMAT_VERSION,
            "n_tokens": int(pos[-1]) + 1, "k": sel.shape[2], "steps": sel.shape[1],
            "layers": sel.shape[0], "text_file": "synthetic"}
    meta.update(meta_over)
    np.savez(path, selections=sel, positions=pos, meta=np.array(json.dumps(meta)))
    return path


def _synthetic(tmp_path):
    # 1 layer, k=2, positions 2,3,4,6 (6 is not consecutive with 4)
    sel = np.array([[[0, 2], [0, 3], [3, 4], [5, 6]]], dtype=np.int32)
    pos = np.array([2, 3, 4, 6], dtype=np.int32)
    return _write(tmp_path / "s.trace.npz", sel, pos, n_tokens=7)


def test_load_and_stats_of_synthetic_trace(tmp_path):
    tr = traces.load_trace(str(_synthetic(tmp_path)))
    assert (tr.layers, tr.steps, tr.k) == (1, 4, 2)
    st = traces.trace_stats(tr, pool_sizes=())
    # overlaps over consecutive pairs (2,3) and (3,4): {0}, {3} -> (1 + 1) / 2 / k
    assert st["overlap"]["mean"] == pytest.approx(0.5)
    # distances: 2,0, 3,0, 1,0, 1,0
    assert st["distance"]["p50"] == pytest.approx(0.5)
    assert st["frac_pos0"] == pytest.approx(2 / 8)
    text = traces.format_stats(st)
    assert "overlap" in text and "p99" in text
    steps = [t.tolist() for t in tr.layer_steps(0)]
    assert steps == [[0, 2], [0, 3], [3, 4], [5, 6]]


def test_padding_is_dropped_in_layer_steps(tmp_path):
    sel = np.array([[[0, -1, -1], [0, 1, -1], [0, 1, 2]]], dtype=np.int32)
    pos = np.array([0, 1, 2], dtype=np.int32)
    tr = traces.load_trace(str(_write(tmp_path / "p.npz", sel, pos)))
    assert [t.numel() for t in tr.layer_steps(0)] == [1, 2, 3]
    assert traces.trace_stats(tr, pool_sizes=())["frac_pos0"] == pytest.approx(3 / 6)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s, p, m: (s, p, {**m, "format": "other"}), "not a ulacache"),
        (lambda s, p, m: (s, p, {**m, "version": 99}), "unsupported trace version"),
        (lambda s, p, m: (s, p, {**m, "steps": 5}), "disagree with meta"),
        (lambda s, p, m: (s.astype(np.int64), p, m), "int32"),
        (lambda s, p, m: (s, p[::-1].copy(), m), "positions must increase"),
        (lambda s, p, m: (s + 5, p, m), "out of range"),
    ],
)
def test_load_rejects_bad_files(tmp_path, mutate, match):
    sel = np.array([[[0, 2], [0, 3], [3, 4], [5, 6]]], dtype=np.int32)
    pos = np.array([2, 3, 4, 6], dtype=np.int32)
    meta = {"format": traces.FORMAT_NAME, "version": traces.FORMAT_VERSION, "n_tokens": 7,
            "k": 2, "steps": 4, "layers": 1}
    s, p, m = mutate(sel, pos, meta)
    path = tmp_path / "bad.npz"
    np.savez(path, selections=s, positions=p, meta=np.array(json.dumps(m)))
    with pytest.raises(traces.TraceFormatError, match=match):
        traces.load_trace(str(path))


def test_load_rejects_non_trace_files(tmp_path):
    p = tmp_path / "x.npz"
    p.write_bytes(b"not a zip")
    with pytest.raises(traces.TraceFormatError, match="not a readable"):
        traces.load_trace(str(p))
    np.savez(tmp_path / "y.npz", selections=np.zeros((1, 1, 1), np.int32))
    with pytest.raises(traces.TraceFormatError, match="missing arrays"):
        traces.load_trace(str(tmp_path / "y.npz"))


@pytest.mark.skipif(not FIXTURES, reason="no recorded fixtures")
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


@pytest.mark.skipif(not FIXTURES, reason="no recorded fixtures")
@pytest.mark.skipif(not HAVE_POLICY_SIM, reason="ulacache.policy_sim not written yet")
def test_fixture_hit_rates():
    tr = traces.load_trace(FIXTURES[0])
    st = traces.trace_stats(tr, pool_sizes=(256, 1024), hit_layers=(0, 20))
    assert set(st["hit_rate"]) == {"lru", "pblru"} and st["hit_layers"] == [0, 20]
    for by_size in st["hit_rate"].values():
        assert len(by_size[256]["per_layer"]) == 2
        small, big = by_size[256]["mean"], by_size[1024]["mean"]
        assert 0.0 < small <= big <= 1.0
    assert "hit rate" in traces.format_stats(st)


def test_hit_rates_need_policy_sim_or_say_so(tmp_path):
    tr = traces.load_trace(str(_synthetic(tmp_path)))
    if HAVE_POLICY_SIM:
        st = traces.trace_stats(tr, pool_sizes=(2,), policies=("lru",))
        assert 0.0 <= st["hit_rate"]["lru"][2]["mean"] <= 1.0
    else:
        with pytest.raises(ImportError, match="simulate_hit_rate"):
            traces.trace_stats(tr, pool_sizes=(2,))


def test_record_trace_end_to_end(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from ulacache import smollm

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
