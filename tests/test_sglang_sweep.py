"""bench/sglang_sweep.py without a GPU: the commands it builds (docs/sglang.md flags), the health
wait, result parsing against sglang.bench_serving's record keys, the peak ratios, and one whole
sweep against a stand-in ``python`` (a tiny HTTP server for ``sglang.launch_server``, a JSONL
writer for ``sglang.bench_serving``) to exercise process start, health, parsing and stop."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from ulacache.config import validate_sglang_config
from ulacache.errors import ConfigError

_SPEC = importlib.util.spec_from_file_location(
    "sglang_sweep", Path(__file__).resolve().parents[1] / "bench" / "sglang_sweep.py")
sw = importlib.util.module_from_spec(_SPEC)
sys.modules["sglang_sweep"] = sw
_SPEC.loader.exec_module(sw)


def _flag(cmd, name):
    """Value after ``name`` in ``cmd`` (exactly one occurrence)."""
    assert cmd.count(name) == 1, (name, cmd)
    return cmd[cmd.index(name) + 1]


def _record(**over):
    """A bench_serving JSONL record with exactly the keys of serving.py's ``result`` dict."""
    rec = {
        "tag": "x", "backend": "sglang", "dataset_name": "random", "request_rate": "inf",
        "max_concurrency": 16, "sharegpt_output_len": None, "random_input_len": 4096,
        "random_output_len": 1024, "random_range_ratio": 0.0, "server_info": None,
        "duration": 12.5, "completed": 64, "total_input_tokens": 262144,
        "total_input_text_tokens": 262144, "total_input_vision_tokens": 0,
        "total_output_tokens": 65536, "total_output_tokens_retokenized": 65500,
        "request_throughput": 5.12, "input_throughput": 20971.5, "output_throughput": 5242.9,
        "total_throughput": 26214.4,
        "mean_e2e_latency_ms": 3000.0, "median_e2e_latency_ms": 2900.0,
        "std_e2e_latency_ms": 100.0, "p90_e2e_latency_ms": 3100.0,
        "p95_e2e_latency_ms": 3150.0, "p99_e2e_latency_ms": 3200.0,
        "mean_ttft_ms": 300.0, "median_ttft_ms": 280.0, "std_ttft_ms": 20.0,
        "p90_ttft_ms": 320.0, "p95_ttft_ms": 330.0, "p99_ttft_ms": 350.0,
        "mean_tpot_ms": 2.6, "median_tpot_ms": 2.5, "std_tpot_ms": 0.1, "p90_tpot_ms": 2.7,
        "p95_tpot_ms": 2.8, "p99_tpot_ms": 2.9,
        "mean_itl_ms": 2.6, "median_itl_ms": 2.5, "std_itl_ms": 0.2, "p90_itl_ms": 2.8,
        "p95_itl_ms": 2.9, "p99_itl_ms": 4.0,
        "concurrency": 15.8, "accept_length": None, "max_output_tokens_per_s": 6000.0,
        "max_concurrent_requests": 16,
    }
    rec.update(over)
    return rec


# --- command construction -------------------------------------------------------------------------


@pytest.mark.parametrize("hardware", ["h200", "b300"])
@pytest.mark.parametrize("model", ["zai-org/GLM-5.1-FP8", "deepseek-ai/DeepSeek-V3.2"])
def test_three_configs_carry_the_docs_flags(hardware, model):
    hw = sw.HARDWARE[hardware]
    his, dp, tp = (sw.make_config(n, model_path=model, hardware=hardware)
                   for n in ("hisparse-dp", "ulacache-dp", "ulacache-tp"))
    for cfg in (his, dp, tp):
        cmd = sw.server_command(cfg)
        assert cmd[1:3] == ["-m", "sglang.launch_server"]
        assert _flag(cmd, "--model-path") == model
        assert _flag(cmd, "--tp") == "8"
        assert _flag(cmd, "--kv-cache-dtype") == "fp8_e4m3"
        assert _flag(cmd, "--dsa-decode-backend") == "flashmla_kv"
        assert _flag(cmd, "--dsa-prefill-backend") == "flashmla_kv"
        assert "--disable-radix-cache" in cmd
        assert float(_flag(cmd, "--mem-fraction-static")) == hw["mem_fraction_static"]
        assert _flag(cmd, "--port") == "30000"
        mtp = hardware == "b300" and "GLM" in model
        assert ("--speculative-algorithm" in cmd) == mtp
        if mtp:
            assert _flag(cmd, "--speculative-num-draft-tokens") == "3"
            assert _flag(cmd, "--speculative-eagle-topk") == "1"
    # HiSparse peer: DP layout, same host memory as cpu_ratio
    cmd = sw.server_command(his)
    assert _flag(cmd, "--kv-backend") == "hisparse" and "--ulacache-config" not in cmd
    assert json.loads(_flag(cmd, "--hisparse-config")) == {
        "top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 1 + hw["cpu_ratio"]}
    assert _flag(cmd, "--attn-dp-size") == "8"
    assert sw.server_env(his) == {}
    # ulacache DP8
    cmd = sw.server_command(dp)
    assert _flag(cmd, "--kv-backend") == "ulacache" and "--hisparse-config" not in cmd
    assert _flag(cmd, "--attn-dp-size") == "8"
    assert _flag(cmd, "--max-running-requests") == str(hw["mrr_dp"])
    assert "--cuda-graph-max-bs-decode" not in cmd
    conf = json.loads(_flag(cmd, "--ulacache-config"))
    assert conf == {"mode": "dp", "cpu_ratio": hw["cpu_ratio"]}
    assert validate_sglang_config(conf).mode == "dp"
    assert sw.server_env(dp) == {}
    # ulacache TP8
    cmd = sw.server_command(tp)
    assert "--attn-dp-size" not in cmd
    mrr = str(hw["mrr_tp"]["glm" if "GLM" in model else "deepseek"])
    assert _flag(cmd, "--max-running-requests") == mrr
    assert _flag(cmd, "--cuda-graph-max-bs-decode") == mrr
    conf = json.loads(_flag(cmd, "--ulacache-config"))
    assert conf["mode"] == "tp" and conf["cpu_ratio"] == hw["cpu_ratio"]
    assert conf.get("shard_indexer", False) == (hardware == "h200" and "DeepSeek" in model)
    opts = validate_sglang_config(conf)
    assert opts.mode == "tp" and opts.cpu_ratio == hw["cpu_ratio"]
    assert sw.server_env(tp) == {"SGLANG_DSA_TOPK_BROADCAST": "1"}


def test_hisparse_tp_and_overrides():
    cfg = sw.make_config("hisparse-tp", model_path="m", cpu_ratio=2, max_running_requests=32,
                         mtp=True, shard_indexer=True, extra_args=("--foo", "1"), port=31000)
    cmd = sw.server_command(cfg)
    assert "--attn-dp-size" not in cmd and "--ulacache-config" not in cmd
    assert json.loads(_flag(cmd, "--hisparse-config"))["host_to_device_ratio"] == 3
    assert _flag(cmd, "--max-running-requests") == "32"
    assert "--speculative-algorithm" in cmd and cmd[-2:] == ["--foo", "1"]
    assert sw.server_env(cfg) == {"SGLANG_DSA_TOPK_BROADCAST": "1"}
    # shard_indexer is a ulacache TP key only: never in a DP config (validate refuses it there)
    dp = sw.make_config("ulacache-dp", model_path="deepseek", shard_indexer=True)
    assert "shard_indexer" not in sw.ulacache_config(dp)
    with pytest.raises(ConfigError):
        validate_sglang_config({"mode": "dp", "shard_indexer": True})
    with pytest.raises(ValueError, match="unknown configuration"):
        sw.make_config("ulacache-pp", model_path="m")


def test_bench_command_same_dataset_for_every_config():
    bench = sw.BenchOptions(random_input_len=8192, random_output_len=512, seed=7)
    cmds = {n: sw.bench_command(sw.make_config(n, model_path="m"), bench, 32, f"/o/{n}.jsonl")
            for n in sw.DEFAULT_CONFIGS}
    for n, cmd in cmds.items():
        assert cmd[1:3] == ["-m", "sglang.bench_serving"]
        assert _flag(cmd, "--backend") == "sglang"
        assert _flag(cmd, "--max-concurrency") == "32"
        assert _flag(cmd, "--num-prompts") == "128"  # max(64, 4 x 32)
        assert _flag(cmd, "--output-file") == f"/o/{n}.jsonl"
        assert _flag(cmd, "--tag") == f"{n}-c32"
    strip = {"--output-file", "--tag"}

    def dataset_part(cmd):
        return [x for i, x in enumerate(cmd) if x not in strip and cmd[i - 1] not in strip]

    assert len({tuple(dataset_part(c)) for c in cmds.values()}) == 1
    c = next(iter(cmds.values()))
    assert (_flag(c, "--dataset-name"), _flag(c, "--random-input-len"),
            _flag(c, "--random-output-len"), _flag(c, "--seed")) == ("random", "8192", "512", "7")
    sharegpt = sw.bench_command(sw.make_config("ulacache-dp", model_path="m"),
                                sw.BenchOptions(dataset_name="sharegpt", dataset_path="/d.json",
                                                num_prompts=10), 4, "o")
    assert _flag(sharegpt, "--dataset-path") == "/d.json" and "--random-input-len" not in sharegpt
    assert _flag(sharegpt, "--num-prompts") == "10"


def test_bench_flags_exist_in_sglang_source():
    """Every flag bench_command and server_command emit that SGLang owns is in its source tree
    (bench flags in benchmark/serving.py); skipped where the source is absent."""
    spec = importlib.util.find_spec("sglang")
    roots = [Path("/tmp/sgl/src/sglang")] + ([Path(spec.origin).parent] if spec else [])
    src = next((r / "benchmark" / "serving.py" for r in roots
                if (r / "benchmark" / "serving.py").exists()), None)
    if src is None:
        pytest.skip("sglang source not available")
    text = src.read_text()
    cmd = sw.bench_command(sw.make_config("ulacache-dp", model_path="m"), sw.BenchOptions(), 8,
                           "o")
    for flag in (x for x in cmd if x.startswith("--")):
        assert f'"{flag}"' in text, flag


def test_dry_run_prints_every_command(capsys, tmp_path):
    rc = sw.main(["--dry-run", "--concurrency", "8,16", "--out-dir", str(tmp_path / "o"),
                  "--python", "python"])
    out = capsys.readouterr().out
    assert rc == 0 and not (tmp_path / "o").exists()  # nothing created
    lines = out.splitlines()
    servers = [x for x in lines if "sglang.launch_server" in x]
    benches = [x for x in lines if "sglang.bench_serving" in x]
    assert len(servers) == 3 and len(benches) == 6
    assert servers[2].startswith("SGLANG_DSA_TOPK_BROADCAST=1 python -m sglang.launch_server")
    assert not servers[0].startswith("SGLANG") and not servers[1].startswith("SGLANG")
    assert "--ulacache-config '{\"mode\": \"dp\", \"cpu_ratio\": 4}'" in servers[1]
    assert "--hisparse-config '{" in servers[0]
    assert "GET http://127.0.0.1:30000/health_generate" in out

    rc = sw.main(["--dry-run", "--json", "--concurrency", "8", "--configs", "ulacache-tp",
                  "--model-path", "deepseek-ai/DeepSeek-V3.2", "--out-dir", str(tmp_path)])
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert [p["config"] for p in plan] == ["ulacache-tp"]
    assert plan[0]["env"] == {"SGLANG_DSA_TOPK_BROADCAST": "1"}
    conf = json.loads(_flag(plan[0]["server"], "--ulacache-config"))
    assert conf == {"mode": "tp", "cpu_ratio": 4, "shard_indexer": True}
    validate_sglang_config(conf)
    with pytest.raises(SystemExit):
        sw.main(["--dry-run", "--configs", "nope"])
    with pytest.raises(SystemExit):
        sw.main(["--dry-run", "--concurrency", "0"])


# --- health ---------------------------------------------------------------------------------------


class FakeProc:
    def __init__(self, dies_after=None, code=1):
        self.polls, self.dies_after, self.code = 0, dies_after, code

    def poll(self):
        self.polls += 1
        if self.dies_after is not None and self.polls > self.dies_after:
            return self.code
        return None


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_wait_healthy_succeeds_after_n_polls():
    clock, calls = FakeClock(), []

    def get(url, timeout):
        calls.append(url)
        if len(calls) < 3:
            raise ConnectionRefusedError("refused")
        if len(calls) < 5:
            return 503
        return 200

    waited = sw.wait_healthy("http://h:1/health_generate", FakeProc(), timeout=100, poll=2,
                             get=get, clock=clock, sleep=clock.sleep)
    assert len(calls) == 5 and waited == 8.0


def test_wait_healthy_process_died_reports_log_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("\n".join(f"line {i}" for i in range(100)) + "\nCUDA out of memory\n")
    clock = FakeClock()

    def get(url, timeout):
        raise ConnectionRefusedError("refused")

    with pytest.raises(sw.ServerError) as e:
        sw.wait_healthy("http://h:1/health", FakeProc(dies_after=2, code=-9), timeout=100,
                        poll=1, get=get, clock=clock, sleep=clock.sleep, log_path=log)
    msg = str(e.value)
    assert "exited with code -9" in msg and "CUDA out of memory" in msg and "line 99" in msg
    assert "line 10\n" not in msg  # only the tail
    assert "ConnectionRefusedError" in msg


def test_wait_healthy_timeout():
    clock = FakeClock()
    with pytest.raises(sw.ServerError, match=r"not healthy after 30 s .*HTTP 503"):
        sw.wait_healthy("http://h:1/health", FakeProc(), timeout=30, poll=7,
                        get=lambda u, t: 503, clock=clock, sleep=clock.sleep, log_path=None)
    assert clock.t == 30.0  # the last sleep is cut to the deadline


# --- parsing and ratios ---------------------------------------------------------------------------


def test_parse_bench_output_keys(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps(_record()) + "\n\n" + json.dumps(_record(max_concurrency=32,
                                                                   output_throughput=9000.5)))
    rows = sw.parse_bench_output(p)
    assert [r["max_concurrency"] for r in rows] == [16, 32]
    assert rows[1]["output_throughput"] == 9000.5
    r = rows[0]
    assert set(r) == set(sw.BENCH_KEYS) | set(sw.OPTIONAL_BENCH_KEYS)
    assert (r["completed"], r["request_throughput"], r["median_ttft_ms"], r["p99_tpot_ms"],
            r["p99_itl_ms"], r["tag"]) == (64, 5.12, 280.0, 2.9, 4.0, "x")
    assert sw.parse_bench_output([json.dumps(_record())]) == [r]  # lines, too
    rec = _record()
    del rec["tag"], rec["accept_length"]
    assert sw.parse_bench_output([json.dumps(rec)])[0]["tag"] is None
    del rec["p99_itl_ms"]
    with pytest.raises(ValueError, match="p99_itl_ms"):
        sw.parse_bench_output([json.dumps(rec)])
    with pytest.raises(ValueError, match="not JSON"):
        sw.parse_bench_output(["{oops"])


def _sglang_serving_source():
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        return None
    path = Path(spec.origin).parent / "benchmark" / "serving.py"
    return path.read_text() if path.exists() else None


@pytest.mark.sglang
def test_parsed_keys_are_sglangs():
    """The keys parse_bench_output requires are keys of bench_serving's record (0.5.23 moved the
    code to sglang.benchmark.serving; sglang.bench_serving re-exports it)."""
    pytest.importorskip("sglang")
    text = _sglang_serving_source()
    assert text is not None, "sglang/benchmark/serving.py not found"
    for key in sw.BENCH_KEYS + sw.OPTIONAL_BENCH_KEYS:
        assert f'"{key}": ' in text, key
    # and the test record above has exactly the record's keys
    start = text.index("        result = {\n")
    body = text[start:text.index("        }\n", start)]
    assert set(re.findall(r'^\s+"(\w+)": ', body, re.M)) == set(_record())


def _row(config, c, tput):
    backend, mode = config.split("-")
    return {"config": config, "backend_kind": backend, "mode": mode, "bench_concurrency": c,
            "output_throughput": tput}


def test_peak_ratio():
    rows = [_row("hisparse-dp", 16, 1000.0), _row("hisparse-dp", 64, 2500.0),
            _row("hisparse-dp", 256, 2000.0),
            _row("ulacache-dp", 16, 1100.0), _row("ulacache-dp", 64, 3000.0),
            _row("ulacache-dp", 256, 3750.0),
            _row("ulacache-tp", 16, 900.0), _row("ulacache-tp", 64, float("nan")),
            _row("ulacache-tp", 256, None)]
    r = sw.peak_ratio(rows)
    assert set(r) == {"dp", "tp"}
    assert r["dp"]["ratio"] == pytest.approx(1.5)
    assert (r["dp"]["ulacache_concurrency"], r["dp"]["hisparse_concurrency"]) == (256, 64)
    # no HiSparse TP run: TP is compared with the HiSparse DP run, which is named
    assert r["tp"]["hisparse_config"] == "hisparse-dp"
    assert r["tp"]["ratio"] == pytest.approx(900 / 2500)
    # a HiSparse run of the same mode is preferred
    r = sw.peak_ratio(rows + [_row("hisparse-tp", 16, 450.0)])
    assert r["tp"]["hisparse_config"] == "hisparse-tp" and r["tp"]["ratio"] == pytest.approx(2)
    # no HiSparse at all, or a zero peak: no ratio
    assert sw.peak_ratio([_row("ulacache-dp", 8, 10.0)])["dp"]["ratio"] is None
    assert sw.peak_ratio([_row("ulacache-dp", 8, 10.0),
                          _row("hisparse-dp", 8, 0.0)])["dp"]["ratio"] is None
    assert sw.peak_ratio([]) == {}
    md = sw.render_markdown(rows, sw.peak_ratio(rows), [{"config": "x", "concurrency": 4,
                                                          "error": "boom\nmore"}])
    assert "| dp | ulacache-dp | 3750.0 (256) | hisparse-dp | 2500.0 (64) | 1.500 |" in md
    assert "- x (concurrency 4): boom" in md


# --- one whole sweep against a stand-in python ----------------------------------------------------

FAKE_PYTHON = textwrap.dedent('''\
    import http.server, json, os, sys, time
    argv = sys.argv[1:]
    def flag(name):
        return argv[argv.index(name) + 1]
    if argv[:2] == ["-m", "sglang.launch_server"]:
        if os.environ.get("FAKE_SERVER_CRASH"):
            print("fatal: CUDA out of memory", flush=True)
            sys.exit(3)
        print("env TOPK", os.environ.get("SGLANG_DSA_TOPK_BROADCAST"), flush=True)
        time.sleep(0.3)
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health_generate" else 404)
                self.end_headers()
            def log_message(self, *a):
                pass
        http.server.HTTPServer((flag("--host"), int(flag("--port"))), H).serve_forever()
    elif argv[:2] == ["-m", "sglang.bench_serving"]:
        c = int(flag("--max-concurrency"))
        rec = json.loads(os.environ["FAKE_RECORD"])
        rec.update(max_concurrency=c, tag=flag("--tag"),
                   output_throughput=c * (2.0 if "ulacache" in flag("--tag") else 1.0))
        with open(flag("--output-file"), "a") as f:
            f.write(json.dumps(rec) + "\\n")
    else:
        sys.exit("unexpected " + " ".join(argv))
''')


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    script = tmp_path / "fake_python.py"
    script.write_text(FAKE_PYTHON)
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    exe.chmod(0o755)
    monkeypatch.setenv("FAKE_RECORD", json.dumps(_record()))
    return str(exe)


def test_whole_sweep_against_a_stand_in(fake_python, tmp_path, capsys):
    out = tmp_path / "out"
    rc = sw.main(["--python", fake_python, "--port", str(_free_port()), "--concurrency", "4,8",
                  "--out-dir", str(out), "--health-poll", "0.1", "--health-timeout", "30",
                  "--stop-timeout", "5", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0, summary["failures"]
    assert [(r["config"], r["bench_concurrency"]) for r in summary["rows"]] == [
        (n, c) for n in sw.DEFAULT_CONFIGS for c in (4, 8)]
    assert summary["peak_ratio"]["dp"]["ratio"] == pytest.approx(2.0)
    assert summary["peak_ratio"]["tp"]["hisparse_config"] == "hisparse-dp"
    assert (out / "ulacache-tp.server.log").read_text().startswith("env TOPK 1")
    assert (out / "ulacache-dp.server.log").read_text().startswith("env TOPK None")
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 7 and csv_lines[0].startswith("config,backend_kind,mode,")
    assert "| dp | ulacache-dp |" in (out / "results.md").read_text()
    if importlib.util.find_spec("matplotlib"):
        assert (out / "throughput.png").stat().st_size > 0


def test_sweep_reports_a_crashed_server(fake_python, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SERVER_CRASH", "1")
    out = tmp_path / "out"
    rc = sw.main(["--python", fake_python, "--port", str(_free_port()), "--concurrency", "4",
                  "--configs", "ulacache-dp", "--out-dir", str(out), "--health-poll", "0.1",
                  "--health-timeout", "30", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 1 and summary["rows"] == []
    (fail,) = summary["failures"]
    assert "exited with code 3" in fail["error"] and "CUDA out of memory" in fail["error"]


def test_stop_server_kills_the_group(tmp_path):
    """A server ignoring SIGTERM is SIGKILLed with its children after the timeout."""
    import subprocess

    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            f"p = subprocess.Popen([{sys.executable!r}, '-c', 'import time; time.sleep(60)']);"
            "print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            start_new_session=True, text=True)
    child = int(proc.stdout.readline())
    rc = sw.stop_server(proc, timeout=0.5)
    assert rc == -9
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        import time

        time.sleep(0.05)
    else:
        pytest.fail("child survived")
