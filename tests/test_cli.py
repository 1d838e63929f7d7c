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
        (["replay", TYPING_TRACE, "--requests", "4", "--gpu-slots", "10"],
         ["--gpu-slots is for --mode tp", "--hisparse-slots"]),
        (["replay", TYPING_TRACE, "--requests", "900", "--steps", "100"],
         ["900 requests", "at most 860"]),
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
    """The default replay: ulacache and HiSparse at equal GPU rows, each compared row with its
    winner, launches per step, and the capacity section's GLM-5 rows."""
    rc, out, _ = _run(["replay", "--steps", "8", "--layers", "1", "--requests", "2", "--json"],
                      capsys)
    assert rc == 0
    doc = json.loads(out)
    assert doc["trace"] == str(cli.bundled_trace())
    assert [r["policy"] for r in doc["results"]] == ["pblru"]
    (ula,), hs = doc["results"], doc["hisparse"]
    assert ula["steps"] == 8 and ula["requests"] == 2 and ula["groups"] == 1
    assert ula["gpu_slots"] == hs["gpu_slots"] == doc["equal_gpu_rows_per_layer"] == 2 * 192
    rows = {r["metric"]: r for r in doc["rows"]}
    assert set(rows) == {"GPU hit rate", "misses (rows CPU -> GPU)", "H2D KB", "D2H KB",
                         "PCIe KB, both directions", "kernel launches"}
    hit = rows["GPU hit rate"]
    assert hit["ulacache"] == ula["hit_rate"] and hit["hisparse"] == hs["hit_rate"]
    assert hit["winner"] == ("ulacache" if ula["hit_rate"] > hs["hit_rate"] else "HiSparse")
    misses = rows["misses (rows CPU -> GPU)"]
    assert misses["ulacache"] == ula["misses"] / 8 and misses["hisparse"] == hs["misses"] / 8
    lu = doc["launches"]["ulacache"]
    c = lu["counts"][lu["path"]]
    assert lu["per_step"] == c["round"] + 1 * (c["place"] + c["access"])
    assert doc["launches"]["hisparse"]["per_step"] == 1 + 1
    assert rows["kernel launches"]["ulacache"] == lu["per_step"]
    cap = doc["capacity"]
    assert cap["model"] == "GLM-5" and {r["platform"] for r in cap["rows"]} == {"h200", "b300"}
    assert all(set(r["max_requests"]) == {"32768", "131072"} for r in cap["rows"])
    # shadows on / off / on with the CPU tier at HiSparse's host rows: same GPU rows, and
    # the roomier tier writes back no more than the smallest one that fits
    from ulacache.tools.replay import live_tokens
    from ulacache.tools.traces import load_trace

    sh = doc["shadows"]
    tokens = live_tokens(load_trace(cli.bundled_trace()), 2, 8)
    assert sh["cpu_slots"] == {"on": ula["cpu_slots"], "off": ula["cpu_slots"],
                               "equal_host": tokens}
    assert ula["cpu_slots"] == tokens - ula["gpu_slots"] + 64 and sh["rows_identical"]
    e = sh["eviction_d2h_over_h2d"]
    assert e["equal_host"] <= e["on"] <= e["off"]
    assert sh["equal_host"]["backup_d2h_bytes"] == sh["on"]["backup_d2h_bytes"]


def test_replay_report_names_a_winner_per_row(capsys):
    rc, out, _ = _run(["replay", TYPING_TRACE, "--steps", "8", "--layers", "2",
                       "--requests", "2"], capsys)
    assert rc == 0 and out.startswith("ulacache vs SGLang HiSparse at the same GPU memory")
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("per decode step"))
    for line in lines[i + 1: i + 7]:
        assert line.split("   ")[-1].split(":")[0] in ("ulacache", "HiSparse", "tie"), line
    assert "2 requests x (H 128 + 64 reserved) = 384; ulacache's shared pool: the same 384" in out
    assert "What the memory buys on a real deployment: GLM-5" in out
    assert "8xH200: most unique history" in out and "8xB300: most unique history" in out
    assert "In short: at the same GPU memory ulacache has" in out
    assert "sched ms/step" not in out  # PB-LRU vs exact LRU only with --compare-lru


def test_replay_compare_lru_times_both_policies_in_one_run(capsys):
    rc, out, _ = _run(["replay", TYPING_TRACE, "--steps", "8", "--layers", "2",
                       "--requests", "2", "--compare-lru", "--no-capacity"], capsys)
    assert rc == 0 and "What the memory buys" not in out
    assert "PB-LRU vs exact LRU:" in out and "policy time x" in out
    rc, out, _ = _run(["replay", TYPING_TRACE, "--steps", "8", "--layers", "1",
                       "--requests", "2", "--compare-lru", "--no-capacity", "--json"], capsys)
    doc = json.loads(out)
    assert [r["policy"] for r in doc["results"]] == ["pblru", "lru"] and doc["capacity"] is None


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
    (["--buffer-slots", "64"], "--mode tp"),
    (["--mode", "tp", "--tp-size", "3"], "--tp-size 2, 4 or 8"),
    (["--mode", "tp", "--tp-size", "1"], "--tp-size 2, 4 or 8"),
    (["--mode", "tp", "--tp-size", "2", "--policy", "lru"], "--policy is for --mode dp"),
    (["--mode", "tp", "--tp-size", "2", "--compare-lru"], "--compare-lru is for --mode dp"),
    (["--mode", "tp", "--tp-size", "2", "--hisparse-slots", "128"], "--hisparse-slots"),
])
def test_replay_tp_options_are_refused(capsys, argv, needle):
    _assert_refused(_run(["replay", "--steps", "4", *argv], capsys), needle)


def test_a_missing_trace_is_refused_before_torch_is_imported(tmp_path):
    """A new process: the refusal comes before ``import torch`` (seconds on a cold machine)."""
    code = ("import sys\nfrom ulacache.tools import cli\n"
            f"rc = cli.main(['replay', {str(tmp_path / 'none.npz')!r}])\n"
            "print('torch' in sys.modules, rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["False", "2"], p
    assert p.stderr.strip() == f"ulacache: error: trace {tmp_path / 'none.npz'} does not exist"


def test_launch_summary_says_when_the_fused_path_was_not_counted():
    """Without Triton only the torch path is counted, and the report says so."""
    from ulacache.tools import compare
    from ulacache.tools.launches import count_launches

    torch_only = {"torch": count_launches("torch", 3)}
    s = compare.launch_summary(torch_only, 3)
    c = torch_only["torch"]
    assert s["ulacache"]["path"] == "torch"
    assert s["ulacache"]["per_step"] == c["round"] + 3 * (c["place"] + c["access"])
    assert s["ulacache"]["release_extra"] == 3 * c["release"]
    assert "was not counted: Triton is not installed" in s["ulacache"]["how"]
    assert s["hisparse"]["per_step"] == 4


def test_compared_rows_name_the_better_side_and_ties():
    from ulacache.tools.compare import Row

    assert Row("GPU hit rate", 0.95, 0.90, True).verdict() == "ulacache: +5.0 points"
    assert Row("H2D KB", 200.0, 100.0, False).verdict() == "HiSparse: x2.00 less"
    assert Row("kernel launches", 9, 65, False, "launches").verdict() == "ulacache: x7.22 fewer"
    tie = Row("misses (rows CPU -> GPU)", 100.0, 100.4, False, "rows")
    assert tie.winner is None and tie.verdict() == "tie" and tie.to_dict()["winner"] is None
    assert Row("D2H KB", 0.0, 0.0, False).verdict() == "tie"
    assert Row("D2H KB", 0.0, 3.0, False).verdict() == "ulacache: none at all"
