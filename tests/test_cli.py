"""Tests of the ``ulacache`` command line: every refusal is one line ``ulacache: error: ...``
on stderr with exit status 2 and no traceback; valid runs of ``replay`` and ``trace stats``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from ulacache.tools import cli, smollm, traces

FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "fixtures")
TYPING_TRACE = os.path.join(FIXTURE_DIR, "typing-py-1024-k64.trace.npz")  # 30 x 960, k=64


def _run(argv, capsys) -> tuple[int, str, list[str]]:
    """``cli.main(argv)`` in-process: (exit status, stdout, stderr lines)."""
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse's error path
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err.splitlines()


def _assert_refused(result, *needles):
    rc, out, err = result
    assert rc == 2, (rc, out, err)
    assert len(err) == 1 and err[0].startswith("ulacache: error: "), err
    assert "Traceback" not in err[0] and out == ""
    for needle in needles:
        assert str(needle) in err[0], (needle, err[0])


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if anything loads the SmolLM2 weights."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(smollm.SmolLM2, "from_gguf", refuse)


@pytest.mark.parametrize(
    "argv, option",
    [
        (["replay", "--steps", "0"], "--steps"),
        (["replay", "--steps", "-3"], "--steps"),
        (["replay", "--steps", "ten"], "--steps"),
        (["replay", "--requests", "-1"], "--requests"),
        (["replay", "--requests", "0"], "--requests"),
        (["replay", "--gpu-slots", "0"], "--gpu-slots"),
        (["replay", "--cpu-slots", "-1"], "--cpu-slots"),
        (["replay", "--layers", "-1"], "--layers"),
        (["replay", "--buckets", "1"], "--buckets"),
        (["replay", "--layout", "fp4"], "--layout"),
        (["trace", "record", "t.txt", "-o", "o.npz", "--k", "0"], "--k"),
        (["trace", "record", "t.txt", "-o", "o.npz", "--max-tokens", "0"], "--max-tokens"),
        (["trace", "record", "t.txt", "-o", "o.npz", "--start", "-1"], "--start"),
        (["trace", "record", "t.txt"], "-o"),
        (["trace", "stats", "t.npz", "--pool-sizes", "0,128"], "--pool-sizes"),
        (["trace", "stats", "t.npz", "--pool-sizes", "128,,256"], "--pool-sizes"),
        (["trace", "stats", "t.npz", "--pool-sizes", "big"], "--pool-sizes"),
        (["trace", "stats", "t.npz", "--hit-layers", "-1"], "--hit-layers"),
        (["trace"], "required"),
        ([], "required"),
    ],
)
def test_bad_options_are_refused_by_the_parser(capsys, argv, option):
    _assert_refused(_run(argv, capsys), option)


def _corrupt_traces(tmp_path) -> dict[str, str]:
    data = open(TYPING_TRACE, "rb").read()
    files = {"empty": b"", "truncated": data[: len(data) // 2], "not-zip": b"hello " * 50}
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10  # inside the deflated selections: a CRC or zlib error
    files["bit-flipped"] = bytes(flipped)
    paths = {}
    for name, blob in files.items():
        paths[name] = str(tmp_path / f"{name}.npz")
        open(paths[name], "wb").write(blob)
    paths["bad-meta"] = str(tmp_path / "bad-meta.npz")
    with np.load(TYPING_TRACE) as z:
        np.savez(paths["bad-meta"], selections=z["selections"], positions=z["positions"],
                 meta=np.array('{"format": "ulacache-selection-trace", "version": 1, "k": "64"}'))
    paths["missing"] = str(tmp_path / "missing.npz")
    return paths


@pytest.mark.parametrize("command", [["replay"], ["trace", "stats"]])
def test_unreadable_traces_are_refused_with_the_file_name(tmp_path, capsys, command):
    for name, path in _corrupt_traces(tmp_path).items():
        result = _run([*command, path], capsys)
        _assert_refused(result, path)
        assert name != "bad-meta" or "meta" in result[2][0]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["replay", TYPING_TRACE, "--steps", "961"], ["--steps 961", "960 steps"]),
        (["replay", TYPING_TRACE, "--layers", "31"], ["--layers 31", "30 layers"]),
        (["replay", TYPING_TRACE, "--requests", "4", "--gpu-slots", "10"], ["gpu_slots"]),
        (["trace", "stats", TYPING_TRACE, "--hit-layers", "31"], ["--hit-layers 31"]),
    ],
)
def test_options_the_trace_cannot_satisfy_are_refused(capsys, argv, needles):
    _assert_refused(_run(argv, capsys), *needles)


def test_record_refuses_bad_inputs_before_loading_the_model(tmp_path, capsys, no_model):
    good = tmp_path / "good.txt"
    good.write_text("word " * 100)
    texts = {"empty": b"", "tiny": b"two words", "binary": b"\x7fELF\0\0\0" * 64,
             "latin-1": "na\u00efve caf\u00e9 ".encode("latin-1") * 20}
    out = str(tmp_path / "o.npz")
    for name, blob in texts.items():
        (tmp_path / name).write_bytes(blob)
        _assert_refused(_run(["trace", "record", tmp_path / name, "-o", out], capsys), name)
    _assert_refused(_run(["trace", "record", tmp_path / "none.txt", "-o", out], capsys),
                    "does not exist")
    _assert_refused(_run(["trace", "record", good, "-o", tmp_path / "no" / "o.npz"], capsys),
                    "does not exist")
    _assert_refused(_run(["trace", "record", good, "-o", tmp_path], capsys), "is a directory")
    _assert_refused(_run(["trace", "record", good, "-o", out, "--max-tokens", "64"], capsys),
                    "start must be in")
    assert not os.path.exists(out)


def test_verbose_logs_the_traceback(tmp_path, capsys, caplog):
    empty = tmp_path / "e.npz"
    empty.write_bytes(b"")
    with caplog.at_level(logging.DEBUG, logger="ulacache"):
        _assert_refused(_run(["-v", "trace", "stats", empty], capsys), empty)
    (record,) = [r for r in caplog.records if r.exc_info]
    assert record.levelno == logging.DEBUG and "trace stats failed" in record.getMessage()
    assert record.exc_info[0] is traces.TraceFormatError


def test_real_process_exit_status_and_single_line(tmp_path):
    empty = tmp_path / "e.npz"
    empty.write_bytes(b"")
    for argv, needle in ((["replay", "--steps", "0"], "--steps"),
                         (["trace", "stats", str(empty)], str(empty))):
        p = subprocess.run([sys.executable, "-m", "ulacache.tools.cli", *argv],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p
        assert p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
        assert p.stderr.startswith("ulacache: error: ") and needle in p.stderr
        assert "Traceback" not in p.stderr


def test_stats_prints_misses_and_pblru_vs_lru(capsys):
    # 1 layer x 2 policies x 1 pool size of the 960-step fixture
    rc, out, _ = _run(["trace", "stats", TYPING_TRACE, "--pool-sizes", "256",
                       "--hit-layers", "1"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("trace: typing.py") and "layers [0]" in out
    i = lines.index("misses, GPU slots per layer (total over layers [0])")
    assert [row.split()[0] for row in lines[i + 2: i + 4]] == ["lru", "pblru"]
    assert lines[i + 4].startswith("PB-LRU misses vs exact LRU: 256: ")
    assert lines[i + 4].endswith("%")


def test_replay_json_on_the_bundled_trace(capsys):
    rc, out, _ = _run(["replay", "--steps", "8", "--layers", "1", "--requests", "2", "--json"],
                      capsys)
    assert rc == 0
    doc = json.loads(out)
    assert doc["trace"] == str(cli.bundled_trace())
    assert [r["policy"] for r in doc["results"]] == ["pblru", "lru"]
    assert all(r["steps"] == 8 and r["requests"] == 2 and r["groups"] == 1
               for r in doc["results"])


def test_replay_table_on_a_fixture(capsys):
    rc, out, _ = _run(["replay", TYPING_TRACE, "--steps", "8", "--layers", "2",
                       "--requests", "1"], capsys)
    assert rc == 0 and out.startswith("trace typing.py") and "exact LRU" in out


def test_replay_tp_json_on_the_bundled_trace(capsys):
    """``--mode tp``: per-rank gate shares add up, a rank owns its 1/P of the selections,
    every pool row is unique and the buffer's copies are the only duplicates."""
    rc, out, _ = _run(["replay", "--mode", "tp", "--tp-size", "4", "--steps", "8", "--layers",
                       "2", "--requests", "2", "--json"], capsys)
    assert rc == 0
    doc = json.loads(out)
    assert doc["mode"] == "tp" and doc["tp_size"] == 4 and len(doc["ranks"]) == 4
    for r in doc["ranks"]:
        assert r["selected"] == r["buffer_hits"] + r["own_rows"] + r["peer_fetches"]
        assert 0.15 < r["own_rows_share"] < 0.35 and r["peer_fetches"] > 0
        assert r["unique_rows"] > 0 and 0 < r["unique_share"] < 1
    rc, out, _ = _run(["replay", "--mode", "tp", "--tp-size", "2", "--steps", "4", "--layers",
                       "1", "--requests", "1"], capsys)
    assert rc == 0 and "paper's accounting" in out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--tp-size", "2"], "--mode tp"),
    (["--mode", "tp", "--tp-size", "3"], "tp_size"),
    (["--mode", "tp", "--tp-size", "1"], "buffer_slots"),
])
def test_replay_tp_options_are_refused(capsys, argv, needle):
    _assert_refused(_run(["replay", "--steps", "4", *argv], capsys), needle)
