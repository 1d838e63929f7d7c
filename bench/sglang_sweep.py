"""Serving throughput sweep: ulacache (DP8, TP8) against SGLang's HiSparse, on real hardware.

NEEDS A GPU NODE (8x H200 or 8x B300) with SGLang 0.5.23 and ulacache installed; nothing here
was run end to end on such a node. What is tested on CPU (``tests/test_sglang_sweep.py``): the
commands built, the health wait, process start/stop against a stand-in server, and the parsing of
``sglang.bench_serving``'s JSONL records.

For every configuration it launches ``python -m sglang.launch_server`` once (the flags of
docs/sglang.md, "Launch commands (DP8)" / "(TP8)", for the chosen hardware and model), waits for
``GET /health_generate`` to answer 200 (a clear error with the server log's tail if the process
dies or the wait times out), runs ``python -m sglang.bench_serving`` once per concurrency of the
sweep with the same dataset arguments and seed for every configuration (so the same prompts),
stops the server (SIGTERM to its process group, SIGKILL after a timeout) and writes:

- ``results.csv``: one row per (configuration, concurrency), bench_serving's metrics;
- ``results.md``: the table and the peak output-throughput ratios ulacache / HiSparse per mode;
- ``throughput.png``: output tokens/s against concurrency (only if matplotlib is importable);
- ``summary.json`` (and stdout with ``--json``); per run: server log, bench log, bench JSONL.

Configurations (``--configs``, comma separated): ``hisparse-dp`` (``--kv-backend hisparse
--hisparse-config``, attention DP), ``ulacache-dp`` (``--attn-dp-size``, ``{"mode": "dp"}``),
``ulacache-tp`` (``{"mode": "tp"}``, ``SGLANG_DSA_TOPK_BROADCAST=1``), ``hisparse-tp`` (HiSparse
under pure TP: replicates the KV on every rank). The ratio for a ulacache mode uses the HiSparse
run of the same mode when there is one, else the other HiSparse run (named in the output).

    python bench/sglang_sweep.py --dry-run                          # print every command
    python bench/sglang_sweep.py --model-path zai-org/GLM-5.1-FP8 --hardware h200 \\
        --concurrency 16,32,64,128,256,512 --random-input-len 32768 --random-output-len 1024
    python bench/sglang_sweep.py --configs hisparse-dp,ulacache-dp --json
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

# --- launch flags (docs/sglang.md) ---------------------------------------------------------------

HARDWARE = {
    # cpu_ratio: ulacache's CPU pool (x the GPU pool); HiSparse's host_to_device_ratio is
    # 1 + cpu_ratio (the same host memory). mrr_dp / mrr_tp: --max-running-requests.
    "h200": {"mem_fraction_static": 0.85, "cpu_ratio": 4, "mrr_dp": 512,
             "mrr_tp": {"glm": 64, "deepseek": 64}},
    "b300": {"mem_fraction_static": 0.88, "cpu_ratio": 3, "mrr_dp": 1024,
             "mrr_tp": {"glm": 64, "deepseek": 128}},
}
MTP_FLAGS = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
             "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]
HISPARSE_TOP_K = 2048
HISPARSE_DEVICE_BUFFER = 4096
CONFIG_NAMES = ("hisparse-dp", "ulacache-dp", "ulacache-tp", "hisparse-tp")
DEFAULT_CONFIGS = ("hisparse-dp", "ulacache-dp", "ulacache-tp")
TP_ENV = {"SGLANG_DSA_TOPK_BROADCAST": "1"}

# --- bench_serving's JSONL record (sglang/benchmark/serving.py, 0.5.23, ``result`` dict) ------

BENCH_KEYS = (
    "backend", "dataset_name", "max_concurrency", "duration", "completed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput",
    "output_throughput", "total_throughput",
    "mean_e2e_latency_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "concurrency",
)
"""Keys taken from every record; a record lacking one is refused (a changed bench_serving)."""
OPTIONAL_BENCH_KEYS = ("tag", "accept_length", "max_output_tokens_per_s",
                       "max_concurrent_requests")
CSV_FIELDS = ("config", "backend_kind", "mode", "bench_concurrency") + BENCH_KEYS + \
    OPTIONAL_BENCH_KEYS


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """One server launch. ``backend`` ``hisparse`` or ``ulacache``; ``mode`` ``dp`` (attention
    DP over all ``tp`` ranks) or ``tp`` (one attention-TP group)."""

    name: str
    backend: str
    mode: str
    model_path: str
    tp: int = 8
    hardware: str = "h200"
    host: str = "127.0.0.1"
    port: int = 30000
    cpu_ratio: int | None = None  # None: the hardware's
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    mtp: bool | None = None  # None: docs' choice (GLM on B300)
    shard_indexer: bool | None = None  # ulacache TP; None: docs' choice (DeepSeek on H200)
    python: str = "python"
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in ("hisparse", "ulacache"):
            raise ValueError(f"backend must be 'hisparse' or 'ulacache', got {self.backend!r}")
        if self.mode not in ("dp", "tp"):
            raise ValueError(f"mode must be 'dp' or 'tp', got {self.mode!r}")
        if self.hardware not in HARDWARE:
            raise ValueError(f"hardware must be one of {sorted(HARDWARE)}, got "
                             f"{self.hardware!r}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")

    @property
    def family(self) -> str:
        return "glm" if "glm" in self.model_path.lower() else "deepseek"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def resolved(self) -> dict[str, Any]:
        """The settings after the hardware/model defaults of docs/sglang.md."""
        hw = HARDWARE[self.hardware]
        mrr = self.max_running_requests
        if mrr is None:
            mrr = hw["mrr_dp"] if self.mode == "dp" else hw["mrr_tp"][self.family]
        mtp = self.mtp if self.mtp is not None else (
            self.hardware == "b300" and self.family == "glm")
        shard = self.shard_indexer if self.shard_indexer is not None else (
            self.mode == "tp" and self.hardware == "h200" and self.family == "deepseek")
        return {
            "cpu_ratio": hw["cpu_ratio"] if self.cpu_ratio is None else self.cpu_ratio,
            "mem_fraction_static": (hw["mem_fraction_static"] if self.mem_fraction_static
                                    is None else self.mem_fraction_static),
            "max_running_requests": mrr, "mtp": mtp,
            "shard_indexer": bool(shard and self.backend == "ulacache" and self.mode == "tp"),
        }


def make_config(name: str, **kw: Any) -> ServerConfig:
    """``hisparse-dp`` / ``ulacache-dp`` / ``ulacache-tp`` / ``hisparse-tp`` -> config."""
    if name not in CONFIG_NAMES:
        raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIG_NAMES)}")
    backend, mode = name.split("-")
    return ServerConfig(name=name, backend=backend, mode=mode, **kw)


def ulacache_config(cfg: ServerConfig) -> dict[str, Any]:
    """The ``--ulacache-config`` object (checked by ``ulacache.config.validate_sglang_config``)."""
    r = cfg.resolved()
    out: dict[str, Any] = {"mode": cfg.mode, "cpu_ratio": r["cpu_ratio"]}
    if r["shard_indexer"]:
        out["shard_indexer"] = True
    return out


def hisparse_config(cfg: ServerConfig) -> dict[str, Any]:
    """The ``--hisparse-config`` object: the same host memory as ulacache's ``cpu_ratio``."""
    return {"top_k": HISPARSE_TOP_K, "device_buffer_size": HISPARSE_DEVICE_BUFFER,
            "host_to_device_ratio": 1 + cfg.resolved()["cpu_ratio"]}


def server_command(cfg: ServerConfig) -> list[str]:
    """``python -m sglang.launch_server ...`` for one configuration (docs/sglang.md flags)."""
    r = cfg.resolved()
    cmd = [cfg.python, "-m", "sglang.launch_server", "--model-path", cfg.model_path,
           "--tp", str(cfg.tp)]
    if cfg.mode == "dp":
        cmd += ["--attn-dp-size", str(cfg.tp)]
    cmd += ["--kv-cache-dtype", "fp8_e4m3",
            "--dsa-decode-backend", "flashmla_kv", "--dsa-prefill-backend", "flashmla_kv",
            "--disable-radix-cache", "--mem-fraction-static", str(r["mem_fraction_static"]),
            "--max-running-requests", str(r["max_running_requests"])]
    if cfg.mode == "tp":
        cmd += ["--cuda-graph-max-bs-decode", str(r["max_running_requests"])]
    if r["mtp"]:
        cmd += MTP_FLAGS
    if cfg.backend == "ulacache":
        cmd += ["--kv-backend", "ulacache", "--ulacache-config",
                json.dumps(ulacache_config(cfg))]
    else:
        cmd += ["--kv-backend", "hisparse", "--hisparse-config",
                json.dumps(hisparse_config(cfg))]
    cmd += ["--host", cfg.host, "--port", str(cfg.port), *cfg.extra_args]
    return cmd


def server_env(cfg: ServerConfig) -> dict[str, str]:
    """Environment variables added for the server (TP mode: ``SGLANG_DSA_TOPK_BROADCAST=1``)."""
    return dict(TP_ENV) if cfg.mode == "tp" else {}


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """``sglang.bench_serving`` arguments shared by every configuration (same dataset)."""

    dataset_name: str = "random"
    dataset_path: str = ""
    random_input_len: int = 4096
    random_output_len: int = 1024
    random_range_ratio: float = 0.0
    num_prompts: int | None = None  # None: max(min_prompts, prompts_per_concurrency x c)
    prompts_per_concurrency: int = 4
    min_prompts: int = 64
    seed: int = 42
    warmup_requests: int = 1
    python: str = "python"
    extra_args: tuple[str, ...] = ()

    def prompts(self, concurrency: int) -> int:
        if self.num_prompts is not None:
            return self.num_prompts
        return max(self.min_prompts, self.prompts_per_concurrency * concurrency)


def bench_command(cfg: ServerConfig, bench: BenchOptions, concurrency: int,
                  output_file: str | os.PathLike) -> list[str]:
    """``python -m sglang.bench_serving ...`` for one concurrency against ``cfg``'s server."""
    cmd = [bench.python, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--host", cfg.host, "--port", str(cfg.port), "--model", cfg.model_path,
           "--dataset-name", bench.dataset_name]
    if bench.dataset_path:
        cmd += ["--dataset-path", bench.dataset_path]
    if bench.dataset_name.startswith("random"):
        cmd += ["--random-input-len", str(bench.random_input_len),
                "--random-output-len", str(bench.random_output_len),
                "--random-range-ratio", str(bench.random_range_ratio)]
    cmd += ["--num-prompts", str(bench.prompts(concurrency)),
            "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--seed", str(bench.seed), "--warmup-requests", str(bench.warmup_requests),
            "--output-file", str(output_file), "--tag", f"{cfg.name}-c{concurrency}",
            "--disable-tqdm", *bench.extra_args]
    return cmd


def shell_line(cmd: list[str], env: Mapping[str, str] | None = None) -> str:
    """One copy-pasteable shell line (env assignments first)."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(cmd)


# --- health --------------------------------------------------------------------------------------


class ServerError(RuntimeError):
    """The server died or never became healthy; the message carries its log's tail."""


def http_status(url: str, timeout: float) -> int:
    """GET ``url``; its HTTP status (``OSError`` when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (local URL)
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def log_tail(path: str | os.PathLike | None, lines: int = 40) -> str:
    if path is None:
        return "(no server log)"
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return f"(server log {path} unreadable: {e})"
    return "\n".join(text.splitlines()[-lines:]) or "(server log empty)"


def wait_healthy(url: str, proc: Any, timeout: float, poll: float = 5.0, *,
                 get: Callable[[str, float], int] = http_status,
                 log_path: str | os.PathLike | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 request_timeout: float = 30.0) -> float:
    """Poll ``GET url`` until it answers 200; return the seconds waited.

    ``proc`` is polled (``proc.poll()``) before every try: a process that has exited raises
    :class:`ServerError` with its exit code and the log's tail, as does ``timeout`` seconds
    without a 200. ``get(url, request_timeout)`` returns a status or raises ``OSError`` (not up
    yet); it, ``clock`` and ``sleep`` are injectable for tests."""
    start = clock()
    last = "no answer yet"
    while True:
        rc = proc.poll()
        if rc is not None:
            raise ServerError(f"server exited with code {rc} before {url} was healthy; "
                              f"last {last}; server log tail ({log_path}):\n{log_tail(log_path)}")
        try:
            status = get(url, request_timeout)
            if status == 200:
                return clock() - start
            last = f"HTTP {status}"
        except OSError as e:  # connection refused, timeouts (socket.timeout is an OSError)
            last = f"{type(e).__name__}: {e}"
        waited = clock() - start
        if waited >= timeout:
            raise ServerError(f"{url} not healthy after {waited:.0f} s (timeout {timeout:.0f} s);"
                              f" last {last}; server log tail ({log_path}):\n"
                              f"{log_tail(log_path)}")
        sleep(min(poll, max(0.0, timeout - waited)))


# --- process control -----------------------------------------------------------------------------


def start_server(cfg: ServerConfig, log_path: Path) -> subprocess.Popen:
    """Start the server in its own process group, stdout+stderr to ``log_path``."""
    env = {**os.environ, **server_env(cfg)}
    with open(log_path, "wb") as log:
        return subprocess.Popen(server_command(cfg), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> int | None:
    """SIGTERM the server's process group, SIGKILL it after ``timeout`` s; the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    # The group may outlive its leader (schedulers, detokenizer): always make sure it is gone.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    return proc.returncode


# --- results -------------------------------------------------------------------------------------


def parse_bench_output(source: str | os.PathLike | Iterable[str]) -> list[dict[str, Any]]:
    """bench_serving's ``--output-file`` JSONL (a path, or its lines) -> one dict per record with
    :data:`BENCH_KEYS` (required) and :data:`OPTIONAL_BENCH_KEYS` (``None`` when absent)."""
    if isinstance(source, (str, os.PathLike)):
        lines: Iterable[str] = Path(source).read_text().splitlines()
        where = str(source)
    else:
        lines, where = source, "<lines>"
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}:{n}: not JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{where}:{n}: not a JSON object")
        missing = [k for k in BENCH_KEYS if k not in rec]
        if missing:
            raise ValueError(f"{where}:{n}: bench_serving record lacks {missing} "
                             "(a different sglang.bench_serving version?)")
        row = {k: rec[k] for k in BENCH_KEYS}
        row.update({k: rec.get(k) for k in OPTIONAL_BENCH_KEYS})
        rows.append(row)
    return rows


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def peak_ratio(rows: Iterable[Mapping[str, Any]],
               metric: str = "output_throughput") -> dict[str, dict[str, Any]]:
    """Peak ``metric`` over the sweep per configuration, and per ulacache mode the ratio of its
    peak to HiSparse's (the HiSparse run of the same mode if present, else the other one).

    ``rows``: dicts with ``config``, ``backend_kind``, ``mode``, ``bench_concurrency`` and
    ``metric``. Returns ``{mode: {"ulacache_config", "ulacache_peak", "ulacache_concurrency",
    "hisparse_config", "hisparse_peak", "hisparse_concurrency", "ratio"}}`` for every ulacache
    mode present; ``ratio`` is ``None`` without a HiSparse peak (or a zero one)."""
    peaks: dict[str, dict[str, Any]] = {}
    for r in rows:
        v = r.get(metric)
        if not _finite(v):
            continue
        p = peaks.get(r["config"])
        if p is None or v > p["peak"]:
            peaks[r["config"]] = {"peak": v, "concurrency": r.get("bench_concurrency"),
                                  "backend": r["backend_kind"], "mode": r["mode"]}
    hisparse = {p["mode"]: (name, p) for name, p in peaks.items() if p["backend"] == "hisparse"}
    out: dict[str, dict[str, Any]] = {}
    for name, p in sorted(peaks.items()):
        if p["backend"] != "ulacache":
            continue
        base = hisparse.get(p["mode"]) or next(iter(sorted(hisparse.values(),
                                                           key=lambda t: t[0])), None)
        entry = {"ulacache_config": name, "ulacache_peak": p["peak"],
                 "ulacache_concurrency": p["concurrency"], "hisparse_config": None,
                 "hisparse_peak": None, "hisparse_concurrency": None, "ratio": None}
        if base is not None:
            bname, bp = base
            entry.update(hisparse_config=bname, hisparse_peak=bp["peak"],
                         hisparse_concurrency=bp["concurrency"],
                         ratio=p["peak"] / bp["peak"] if bp["peak"] > 0 else None)
        out[p["mode"]] = entry
    return out


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def render_markdown(rows: list[Mapping[str, Any]], ratios: Mapping[str, Mapping[str, Any]],
                    failures: list[Mapping[str, Any]], header: str = "") -> str:
    cols = [("config", "config"), ("bench_concurrency", "concurrency"),
            ("completed", "completed"), ("output_throughput", "output tok/s"),
            ("request_throughput", "req/s"), ("median_ttft_ms", "median TTFT ms"),
            ("p99_ttft_ms", "p99 TTFT ms"), ("median_tpot_ms", "median TPOT ms"),
            ("p99_tpot_ms", "p99 TPOT ms"), ("median_itl_ms", "median ITL ms"),
            ("p99_itl_ms", "p99 ITL ms")]
    out = io.StringIO()
    if header:
        out.write(header.rstrip() + "\n\n")
    out.write("| " + " | ".join(c[1] for c in cols) + " |\n")
    out.write("|" + "---|" * len(cols) + "\n")
    for r in rows:
        out.write("| " + " | ".join(_fmt(r.get(k), 2 if k == "request_throughput" else 1)
                                    for k, _ in cols) + " |\n")
    out.write("\nPeak output throughput (tokens/s), ulacache / HiSparse:\n\n")
    out.write("| mode | ulacache | peak (at c) | HiSparse | peak (at c) | ratio |\n")
    out.write("|---|---|---|---|---|---|\n")
    for mode, e in sorted(ratios.items()):
        out.write(f"| {mode} | {e['ulacache_config']} | {_fmt(e['ulacache_peak'])} "
                  f"({_fmt(e['ulacache_concurrency'])}) | {e['hisparse_config'] or '-'} | "
                  f"{_fmt(e['hisparse_peak'])} ({_fmt(e['hisparse_concurrency'])}) | "
                  f"{_fmt(e['ratio'], 3)} |\n")
    if failures:
        out.write("\nFailures:\n\n")
        for f in failures:
            first = str(f["error"]).splitlines()[0] if f["error"] else ""
            out.write(f"- {f['config']} (concurrency {f.get('concurrency', '-')}): {first}\n")
    return out.getvalue()


def write_csv(rows: list[Mapping[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_FIELDS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in CSV_FIELDS})


def write_png(rows: list[Mapping[str, Any]], path: Path) -> bool:
    """Output tokens/s against concurrency, one line per configuration; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["bench_concurrency"], r["output_throughput"]) for r in rows
                     if r["config"] == name and _finite(r.get("output_throughput")))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency (requests)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("sglang.bench_serving: ulacache vs HiSparse")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- the sweep -----------------------------------------------------------------------------------


def run_sweep(configs: list[ServerConfig], bench: BenchOptions, concurrencies: list[int],
              out_dir: Path, *, health_timeout: float, health_poll: float,
              bench_timeout: float, stop_timeout: float, health_path: str = "/health_generate",
              log: Callable[[str], None] = print) -> tuple[list[dict], list[dict]]:
    """Launch, wait, bench every concurrency, stop; per configuration. (rows, failures)."""
    rows: list[dict] = []
    failures: list[dict] = []
    for cfg in configs:
        server_log = out_dir / f"{cfg.name}.server.log"
        log(f"[{cfg.name}] starting: {shell_line(server_command(cfg), server_env(cfg))}")
        proc = start_server(cfg, server_log)
        try:
            waited = wait_healthy(cfg.url + health_path, proc, health_timeout, health_poll,
                                  log_path=server_log)
            log(f"[{cfg.name}] healthy after {waited:.0f} s")
            for c in concurrencies:
                jsonl = out_dir / f"{cfg.name}.c{c}.jsonl"
                jsonl.unlink(missing_ok=True)  # bench_serving appends
                cmd = bench_command(cfg, bench, c, jsonl)
                log(f"[{cfg.name}] concurrency {c}: {shell_line(cmd)}")
                blog = out_dir / f"{cfg.name}.c{c}.bench.log"
                try:
                    with open(blog, "wb") as f:
                        res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, timeout=bench_timeout,
                                             check=False)
                    if res.returncode != 0:
                        raise RuntimeError(f"bench_serving exited {res.returncode}; log tail:\n"
                                           f"{log_tail(blog)}")
                    parsed = parse_bench_output(jsonl)
                    if not parsed:
                        raise RuntimeError(f"bench_serving wrote no record; log tail:\n"
                                           f"{log_tail(blog)}")
                except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
                    failures.append({"config": cfg.name, "concurrency": c, "error": str(e)})
                    log(f"[{cfg.name}] concurrency {c} FAILED: {e}")
                    if proc.poll() is not None:
                        raise ServerError(f"server exited with code {proc.returncode} during "
                                          f"the sweep; log tail:\n{log_tail(server_log)}"
                                          ) from None
                    continue
                rec = parsed[-1]
                rows.append({"config": cfg.name, "backend_kind": cfg.backend, "mode": cfg.mode,
                             "bench_concurrency": c, **rec})
                log(f"[{cfg.name}] concurrency {c}: {rec['output_throughput']:.1f} output "
                    f"tok/s, {rec['completed']} completed")
        except ServerError as e:
            failures.append({"config": cfg.name, "concurrency": None, "error": str(e)})
            log(f"[{cfg.name}] FAILED: {e}")
        finally:
            rc = stop_server(proc, stop_timeout)
            log(f"[{cfg.name}] stopped (exit code {rc})")
    return rows, failures


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in CONFIG_NAMES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {bad or text!r}; known: "
                                         f"{', '.join(CONFIG_NAMES)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="zai-org/GLM-5.1-FP8")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="h200",
                   help="launch-flag preset of docs/sglang.md (default h200)")
    p.add_argument("--tp", type=int, default=8, help="--tp (and --attn-dp-size in DP mode)")
    p.add_argument("--configs", type=_names, default=list(DEFAULT_CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIG_NAMES)} "
                        f"(default {','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--concurrency", type=_int_list, default=[16, 32, 64, 128, 256, 512],
                   help="comma-separated --max-concurrency values")
    p.add_argument("--cpu-ratio", type=int, default=None,
                   help="ulacache cpu_ratio (HiSparse host_to_device_ratio = 1 + it)")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--dp-max-running-requests", type=int, default=None)
    p.add_argument("--tp-max-running-requests", type=int, default=None,
                   help="also --cuda-graph-max-bs-decode in TP mode")
    p.add_argument("--mtp", choices=["auto", "on", "off"], default="auto",
                   help="EAGLE MTP flags (auto: GLM on B300, as docs/sglang.md)")
    p.add_argument("--shard-indexer", choices=["auto", "on", "off"], default="auto",
                   help="ulacache TP shard_indexer (auto: DeepSeek on H200, as docs/sglang.md)")
    p.add_argument("--server-args", default="",
                   help="extra launch_server arguments (one shell-quoted string)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--python", default=sys.executable,
                   help="interpreter for launch_server and bench_serving")
    p.add_argument("--dataset-name", default="random")
    p.add_argument("--dataset-path", default="")
    p.add_argument("--random-input-len", type=int, default=4096)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per run (default: max(--min-prompts, "
                        "--prompts-per-concurrency x concurrency))")
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--bench-args", default="",
                   help="extra bench_serving arguments (one shell-quoted string)")
    p.add_argument("--health-path", default="/health_generate",
                   choices=["/health_generate", "/health"])
    p.add_argument("--health-timeout", type=float, default=3600.0,
                   help="seconds to wait for the server (weights load + CUDA graphs)")
    p.add_argument("--health-poll", type=float, default=10.0)
    p.add_argument("--bench-timeout", type=float, default=7200.0,
                   help="seconds per bench_serving run")
    p.add_argument("--stop-timeout", type=float, default=120.0,
                   help="seconds after SIGTERM before SIGKILL")
    p.add_argument("--out-dir", default=None,
                   help="results folder (default bench/results/sglang_sweep-<time>)")
    p.add_argument("--dry-run", action="store_true", help="print every command; run nothing")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    return p


def configs_from_args(a: argparse.Namespace) -> list[ServerConfig]:
    tri = {"auto": None, "on": True, "off": False}
    extra = tuple(shlex.split(a.server_args))
    out = []
    for name in a.configs:
        mode = name.split("-")[1]
        out.append(make_config(
            name, model_path=a.model_path, tp=a.tp, hardware=a.hardware, host=a.host,
            port=a.port, cpu_ratio=a.cpu_ratio, mem_fraction_static=a.mem_fraction_static,
            max_running_requests=(a.dp_max_running_requests if mode == "dp"
                                  else a.tp_max_running_requests),
            mtp=tri[a.mtp], shard_indexer=tri[a.shard_indexer], python=a.python,
            extra_args=extra))
    return out


def bench_from_args(a: argparse.Namespace) -> BenchOptions:
    return BenchOptions(dataset_name=a.dataset_name, dataset_path=a.dataset_path,
                        random_input_len=a.random_input_len,
                        random_output_len=a.random_output_len,
                        random_range_ratio=a.random_range_ratio, num_prompts=a.num_prompts,
                        prompts_per_concurrency=a.prompts_per_concurrency,
                        min_prompts=a.min_prompts, seed=a.seed,
                        warmup_requests=a.warmup_requests, python=a.python,
                        extra_args=tuple(shlex.split(a.bench_args)))


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    configs = configs_from_args(a)
    bench = bench_from_args(a)
    out_dir = Path(a.out_dir or f"bench/results/sglang_sweep-{time.strftime('%Y%m%d-%H%M%S')}")

    if a.dry_run:
        plan = []
        for cfg in configs:
            plan.append({
                "config": cfg.name, "env": server_env(cfg), "server": server_command(cfg),
                "health": cfg.url + a.health_path,
                "bench": [bench_command(cfg, bench, c, out_dir / f"{cfg.name}.c{c}.jsonl")
                          for c in a.concurrency]})
        if a.json:
            print(json.dumps({"dry_run": True, "out_dir": str(out_dir), "plan": plan},
                             indent=2))
            return 0
        for step in plan:
            print(f"# {step['config']}")
            print(shell_line(step["server"], step["env"]))
            print(f"# wait for GET {step['health']} -> 200")
            for cmd in step["bench"]:
                print(shell_line(cmd))
            print("# stop: SIGTERM to the server's process group\n")
        return 0

    out_dir.mkdir(parents=True, exist_ok=True)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.json else \
        (lambda s: print(s, flush=True))
    rows, failures = run_sweep(configs, bench, a.concurrency, out_dir,
                               health_timeout=a.health_timeout, health_poll=a.health_poll,
                               bench_timeout=a.bench_timeout, stop_timeout=a.stop_timeout,
                               health_path=a.health_path, log=log)
    ratios = peak_ratio(rows)
    header = (f"# sglang_sweep: {a.model_path} on {a.hardware}, tp {a.tp}\n\n"
              f"dataset {a.dataset_name}"
              + (f" input {a.random_input_len} output {a.random_output_len}"
                 if a.dataset_name.startswith("random") else f" {a.dataset_path}")
              + f", seed {a.seed}; commands in summary.json")
    write_csv(rows, out_dir / "results.csv")
    (out_dir / "results.md").write_text(render_markdown(rows, ratios, failures, header))
    png = write_png(rows, out_dir / "throughput.png") if rows else False
    summary = {
        "model_path": a.model_path, "hardware": a.hardware, "tp": a.tp,
        "concurrency": a.concurrency, "out_dir": str(out_dir),
        "commands": {c.name: {"env": server_env(c), "server": server_command(c)}
                     for c in configs},
        "rows": rows, "peak_ratio": ratios, "failures": failures,
        "png": str(out_dir / "throughput.png") if png else None,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        print(render_markdown(rows, ratios, failures))
        print(f"results in {out_dir}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
