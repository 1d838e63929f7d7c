"""``bench/prefetch_replay.py`` on a few steps of the bundled trace: the source table and the
admission table (naive hot against ulacache's cold admission) come out with their ratios, the
naive swap is undone, and bad arguments exit 2 in one line."""

from __future__ import annotations

import json

import pytest

from ulacache.pblru import PBLRU

from .helpers import load_bench


def test_source_and_admission_tables(capsys):
    pr = load_bench("prefetch_replay")
    admit = PBLRU.admit
    argv = ["--requests", "2", "--steps", "6", "--sources", "previous_layer", "--caps", "8",
            "--acceptance", "", "--admission", "256"]
    assert pr.main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert PBLRU.admit is admit  # the naive baseline never outlives its rows
    assert [r["sources"] for r in res["rows"]] == ["previous_layer"]
    adm = res["admission"]
    assert [r["admission"] for r in adm] == ["naive: most recent, uncapped",
                                             "ulacache: cold, uncapped", "ulacache: cold, cap 64"]
    assert all(r["gpu_slots"] == 256 and r["off_misses"] > 0 and r["h2d_ratio"] > 0 for r in adm)
    assert adm[0]["prefetched_rows"] > 0
    assert pr.main(argv) == 0
    out = capsys.readouterr().out
    assert "| previous_layer | 8 |" in out and "| 256 | naive: most recent, uncapped |" in out


def test_bad_lists_exit_2(capsys):
    pr = load_bench("prefetch_replay")
    assert pr.main(["--admission", "x"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_an_overflowing_row_is_reported_not_raised(monkeypatch):
    """A replay whose access overflowed (the naive insertion at a small pool) becomes a row
    that says so; any other error still raises."""
    pr = load_bench("prefetch_replay")
    calls = []

    def fake_replay(trace, prefetch=None, **kw):
        calls.append(prefetch)
        if prefetch is not None and PBLRU.admit is PBLRU.touch:
            raise RuntimeError("replay overflowed the pools; see the warnings above")
        return type("R", (), dict(misses=10, h2d_rows=10, critical_path_misses=5,
                                  prefetched_rows=3, prefetched_used=1))()

    monkeypatch.setattr(pr, "replay", fake_replay)
    rows = pr.admission(None, [384])
    assert [r["overflowed"] for r in rows] == [True, False, False] and len(calls) == 4
    assert "overflowed: prefetched rows pinned the pool" in pr.admission_markdown(rows)
    monkeypatch.setattr(pr, "replay", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError, match="x"):
        pr.admission(None, [384])
