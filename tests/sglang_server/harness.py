"""A real SGLang 0.5.23 HTTP server on this CPU-only machine, for tests (never product code).

:class:`Server` starts ``python -m sglang.launch_server --device cpu`` on 127.0.0.1 with a
tiny random-weight model (:func:`write_model`: ``config.json`` only, ``--load-format dummy``,
``--skip-tokenizer-init``), the CPU stand-ins of ``site/`` on its ``PYTHONPATH`` (they load in
every process the server spawns, through ``site/sitecustomize.py``), waits for
``/health_generate``, and always stops what it started: its own process group, SIGTERM then
SIGKILL, and a check that no process of the group is left.

Requests go through ``/generate`` with ``input_ids`` and greedy sampling (:meth:`Server.generate`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SITE = Path(__file__).resolve().parent / "site"
ROOT = Path(__file__).resolve().parents[2]

BASE_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",  # SGLang's CPU engine (srt/utils/common.py is_cpu)
    # SGLang's own torch routes for the DSA indexer: fp8 MQA logits (dsa/utils.py), unfused
    # top-k (dsa_topk_backend.py:269 requires it with --dsa-topk-backend torch), no JIT top-k v2
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
    "SGLANG_DSA_FUSE_TOPK": "0",
    "SGLANG_OPT_USE_TOPK_V2": "0",
    "TORCHDYNAMO_DISABLE": "1",  # @torch.compile helpers run eagerly (same tokens, 3x faster)
    # harness options of cpu_stand_ins.py: weights whose outputs depend on the KV cache
    # (SGLang's dummy init makes the next token a function of the last token only), and a
    # top-k tie-break independent of the batch's widest row
    "ULA_CPU_DUMMY_INIT": "contextful",
    "ULA_CPU_STABLE_TOPK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}
BASE_FLAGS = ["--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init",
              "--disable-cuda-graph", "--host", "127.0.0.1", "--page-size", "64",
              "--log-level", "info"]
DSA_FLAGS = [  # the DSA backend's sparse MLA (flash_mla stand-in) in prefill and decode, a bf16
    # pool (the top-k transform is then paged: attention reads pool rows), torch top-k
    "--attention-backend", "dsa", "--kv-cache-dtype", "bfloat16",
    "--dsa-prefill-backend", "flashmla_sparse", "--dsa-decode-backend", "flashmla_sparse",
    "--dsa-topk-backend", "torch"]

_DSA = {  # a tiny random-weight DeepSeek-V3.2 (the shape SGLang's DSA code needs, at width 256)
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "torch_dtype": "bfloat16", "vocab_size": 1024, "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
    "v_head_dim": 64, "index_topk": 64, "index_head_dim": 128, "index_n_heads": 4,
    "max_position_embeddings": 4096, "rope_theta": 10000,
    # the CPU rope factory asserts deepseek_yarn (rotary_embedding/factory.py:478)
    "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "bos_token_id": 0,
    "eos_token_id": 1,
}
MODELS = {
    "DeepseekV32ForCausalLM": _DSA,
    # GLM-5's architecture (transformers' own glm_moe_dsa config; interleaved rope, indexer too)
    "GlmMoeDsaForCausalLM": {**_DSA, "architectures": ["GlmMoeDsaForCausalLM"],
                             "model_type": "glm_moe_dsa", "rms_norm_eps": 1e-5,
                             "indexer_rope_interleave": True, "rope_interleave": True},
    # not a sparse-attention model: --kv-backend ulacache must refuse it
    "LlamaForCausalLM": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                         "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024,
                         "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                         "torch_dtype": "bfloat16", "rope_theta": 10000.0, "hidden_act": "silu",
                         "tie_word_embeddings": False},
}
INDEX_TOPK = _DSA["index_topk"]


def write_model(directory: Path, architecture: str) -> Path:
    """A model directory holding only ``config.json`` (``--load-format dummy`` draws the
    weights; ``--skip-tokenizer-init``: requests carry ``input_ids``)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(MODELS[architecture], indent=1))
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """The server exited, refused a request, or did not become healthy; carries its log tail."""


@dataclass
class Server:
    """One server process group. ``flags``: extra ``launch_server`` flags; ``env``: extra
    environment; ``python``: the interpreter of the SGLang venv (default: this one)."""

    model_dir: Path
    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    python: str = sys.executable
    dsa: bool = True  # the DSA backend flags (False: a model that is not DSA)
    port: int = 0
    proc: subprocess.Popen | None = None
    started_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [self.python, "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
                *BASE_FLAGS, *(DSA_FLAGS if self.dsa else []), "--port", str(self.port),
                *self.flags]

    def start(self) -> Server:
        self.port = self.port or free_port()
        env = {**os.environ, **BASE_ENV, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SITE), str(ROOT)] + [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep)
                                      if p])
        self.log_path = self.log_path or self.model_dir / f"server-{self.port}.log"
        log = open(self.log_path, "wb")
        self.started_s = time.monotonic()
        # a session of its own: stop() signals the whole group (scheduler, detokenizer, ...)
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     env=env, cwd=self.model_dir, start_new_session=True)
        log.close()
        logger.info("server pid %d on port %d: %s", self.proc.pid, self.port,
                    " ".join(self.command()))
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, timeout: float = 240.0) -> float:
        """Seconds from start to the first successful ``/health_generate``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with status {self.proc.returncode} before it "
                                  f"was healthy:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started_s
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise ServerError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def post(self, path: str, body: dict, timeout: float = 300.0) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, {"error": text}

    def get(self, path: str, timeout: float = 60.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def generate(self, input_ids: list[int], max_new_tokens: int = 8,
                 timeout: float = 300.0) -> dict:
        """Greedy tokens for one prompt (``ignore_eos``); the response dict (``output_ids``,
        ``meta_info``). Raises :class:`ServerError` on a non-200 answer."""
        status, out = self.post("/generate", {
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True},
        }, timeout)
        if status != 200:
            raise ServerError(f"/generate answered {status}: {out}")
        return out

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the group, SIGKILL after ``grace`` seconds, then wait until no process of
        the group is left."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # its own session: the group id is its pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(pgid):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.2)
            if not _group_alive(pgid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if _group_alive(pgid):
            raise ServerError(f"processes of group {pgid} survived SIGKILL")
        self.proc = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies of ours reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) succeeds for zombies too: look for a live member
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def run_launch(model_dir: Path, flags: list[str], env: dict[str, str] | None = None,
               python: str = sys.executable, timeout: float = 300.0, dsa: bool = True
               ) -> subprocess.CompletedProcess:
    """A launch expected to refuse before serving: the finished process (its own group,
    killed on timeout)."""
    srv = Server(model_dir, flags, env or {}, python=python, dsa=dsa, port=free_port())
    env_all = {**os.environ, **BASE_ENV, **srv.env}
    env_all["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)])
    p = subprocess.Popen(srv.command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env_all, cwd=model_dir, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.sglang_server.harness``: serve a tiny DSA model on this CPU with
    ulacache (or the stock pool) in the foreground, as the tests do (docs/serve-on-cpu.md)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tests.sglang_server.harness",
                                 description="serve a tiny random-weight DSA model on CPU")
    ap.add_argument("--model", choices=sorted(a for a in MODELS if a != "LlamaForCausalLM"),
                    default="DeepseekV32ForCausalLM")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ulacache-cpu-model"),
                    help="where config.json is written (default %(default)s)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--stock", action="store_true", help="SGLang's stock pool, not ulacache")
    ap.add_argument("--gpu-tokens", type=int, default=320,
                    help="ulacache's GPU pool in tokens (--max-total-tokens; default %(default)s)")
    ap.add_argument("--ulacache-config", default='{"cpu_ratio": 3}')
    ap.add_argument("extra", nargs=argparse.REMAINDER,
                    help="further launch_server flags, after --")
    a = ap.parse_args(argv)
    flags = ["--max-running-requests", "4", "--enable-metrics"]
    if a.stock:
        flags += ["--max-total-tokens", "4096"]
    else:
        flags += ["--kv-backend", "ulacache", "--disable-radix-cache", "--max-total-tokens",
                  str(a.gpu_tokens), "--ulacache-config", a.ulacache_config]
    flags += [f for f in a.extra if f != "--"]
    srv = Server(write_model(a.dir, a.model), flags, port=a.port)
    env = {**os.environ, **BASE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)] + [
        p for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p])
    print(" ".join(srv.command()), file=sys.stderr, flush=True)
    # foreground: the server's log on this terminal, Ctrl-C stops it
    return subprocess.call(srv.command(), env=env, cwd=srv.model_dir)


if __name__ == "__main__":
    sys.exit(main())
