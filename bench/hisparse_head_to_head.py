"""Head to head on one GPU: SGLang 0.5.23's HiSparse swap-in kernel vs ulacache's access.

Both sides are driven with IDENTICAL selection streams (one seeded locality generator per
request, :class:`bench.decode_sweep.SelectionGen`, calibrated on the real SmolLM2 top-k trace:
recent window + sink + step-to-step reuse) and hold the SAME number of GPU rows per layer:

- HiSparse: the real ``load_cache_to_device_buffer`` (``kernels/jit/csrc/kvcacheio/
  hisparse.cuh``), built alone with nvcc against tvm-ffi (no sglang import, no sgl-kernel),
  ``batch x (H + 64)`` device rows (H = 2 x k slots + a reserved page whose first slot holds
  the newest token), an inclusive pinned host mirror of every token, LRU state kept across steps.
- ulacache: ``SelectionGroup.access`` over ONE shared pool of the same ``batch x (H + 64)`` GPU
  rows (PB-LRU, exclusive CPU tier, ``validate=False`` as in serving).

Per (batch, context) cell, per decode step and layer (one layer is run; every layer of a model
repeats it): GPU time of the swap-in / access call (CUDA events behind a ~2 ms ``_sleep`` so
host launch gaps are hidden, as under a CUDA graph; median over the timed steps),
bytes over PCIe (H2D: rows loaded; D2H: HiSparse's newest-token backup, ulacache's write-backs
and spills), GPU hit rate, and the time a pinned H2D copy of the same H2D bytes would take
(``h2d_copy_gbps`` measured in the same run, as bench/bandwidth.py does).

Validation, every step, both sides, byte for byte: each token's row is a function of its
(request, position) (:func:`encode_rows`); the rows the returned GPU locations point at are
compared with the rows that should be there. HiSparse's hit/miss decisions are also checked
slot for slot against :class:`ulacache.tools.hisparse.HiSparseBuffer` (the CPU model). On a
machine without CUDA, ``--cpu`` runs the same driver with the model standing in for the kernel
and ulacache's torch reference path (small sizes; what the tests run).

    python bench/hisparse_head_to_head.py --quick --json     # on the lent H200
    python bench/hisparse_head_to_head.py --cpu --batches 2 --contexts 600 --k 64 --h-slots 128

Carry (no registry on the lent machine): the sglang 0.5.23 and apache-tvm-ffi 0.1.11 wheels in
``.whl-hisparse/`` (NOT ``.whl/``: device_check.sh pip-installs everything there, and the
manylinux_2_34 sglang wheel may be refused). The script unpacks only the headers, the kernel
and tvm-ffi from them. On a machine with a registry::

    echo /.whl-hisparse/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 -d .whl-hisparse sglang==0.5.23 apache-tvm-ffi==0.1.11

and name ``.whl-hisparse`` (about 42 MB) in the run's carry. Without CUDA, or without those
wheels, nothing is measured: one line ``... not measured: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from decode_sweep import LocalityModel, SelectionGen  # noqa: E402

from ulacache.tools.hisparse import RESERVED_SLOTS, HiSparseBuffer  # noqa: E402

K = 2048  # top-k (DeepSeek-V3.2 / sglang default)
H_SLOTS = 4096  # sglang's device_buffer_size default: 2 x top_k
BLOCK = 960  # the kernel's block size (sglang default)
ROW_BYTES = 656  # FP8 MLA row: 512 + 16 + 128
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (32768, 65536, 131072)
QUICK_BATCHES = (1, 16, 64)
QUICK_CONTEXTS = (32768, 131072)
WHEEL_DIR = ROOT / ".whl-hisparse"
SGLANG_WHEEL = "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl"
TVM_FFI_WHEEL = "apache_tvm_ffi-0.1.11-*.whl"
# Locality calibrated on ulacache/tools/data/gpl3.trace.npz (decode_sweep.calibrate, defaults);
# --calibrate recomputes it.
DEFAULT_MODEL = LocalityModel(
    recent_share=0.5564378307711694, sink_prob=0.8751890120967742, overlap=0.6843984414397378,
    keep_prob=0.5930635006933941,
    old_hist=[0.01456, 0.01150, 0.01522, 0.01558, 0.01664, 0.01864, 0.01904, 0.01853, 0.02254,
              0.02560, 0.02830, 0.03186, 0.03603, 0.04600, 0.04703, 0.06312, 0.07506, 0.10356,
              0.15444, 0.23677])
ROW_FIELDS = ("system", "batch", "context", "steps", "gpu_rows", "row_bytes", "accesses",
              "hit_rate", "h2d_bytes_per_step_layer", "d2h_bytes_per_step_layer",
              "pcie_bytes_per_step_layer", "time_us_median", "time_us_mean", "h2d_floor_us",
              "x_floor", "valid", "mismatched_rows", "model_agrees")


EXIT_UNMEASURED = 2  # as bench/bandwidth.py: device_check reports it as "not measured"


def no_sources_message(wheel_dir: Path, missing: list[str] | None = None) -> str:
    what = f" (missing: {', '.join(missing)})" if missing else ""
    return (f"bench/hisparse_head_to_head.py: not measured: SGLang's kernel sources are not "
            f"carried: looked in {wheel_dir} for {SGLANG_WHEEL} and {TVM_FFI_WHEEL}{what}; the "
            "script's header gives the download command")


NO_CUDA_MESSAGE = ("bench/hisparse_head_to_head.py: not measured: no CUDA device (HiSparse's "
                   "kernel needs one; run it on the lent H200, or --cpu for the CPU stand-in)")


# -- (1) sources and the build command ------------------------------------------------------
@dataclass
class Sources:
    """Paths inside the unpacked wheels that the standalone build needs."""

    jit_include: Path  # sglang/kernels/jit/include (sgl_kernel/*.h, *.cuh)
    jit_csrc: Path  # sglang/kernels/jit/csrc (kvcacheio/hisparse.cuh)
    tvm_include: Path  # tvm_ffi/include (tvm/ffi/*, dlpack/)
    tvm_lib: Path  # tvm_ffi/lib (libtvm_ffi.so)
    tvm_site: Path  # the directory holding the tvm_ffi package (for sys.path)

    REQUIRED = ("jit_include/sgl_kernel/tensor.h", "jit_include/sgl_kernel/runtime.cuh",
                "jit_include/sgl_kernel/deepseek_v4/kvcacheio.cuh",
                "jit_csrc/kvcacheio/hisparse.cuh", "tvm_include/tvm/ffi/function.h",
                "tvm_include/dlpack/dlpack.h", "tvm_lib/libtvm_ffi.so",
                "tvm_site/tvm_ffi/__init__.py")

    def missing(self) -> list[str]:
        out = []
        for req in self.REQUIRED:
            attr, rel = req.split("/", 1)
            p = getattr(self, attr) / rel
            if not p.exists():
                out.append(str(p))
        return out


def sources_in(site: Path) -> Sources:
    """The paths under ``site``, a directory holding ``sglang/`` and ``tvm_ffi/`` (an unpacked
    pair of wheels, or a site-packages)."""
    site = Path(site)
    jit = site / "sglang" / "kernels" / "jit"
    return Sources(jit / "include", jit / "csrc", site / "tvm_ffi" / "include",
                   site / "tvm_ffi" / "lib", site)


def find_wheels(wheel_dir: Path) -> tuple[Path | None, Path | None]:
    """(sglang wheel, apache-tvm-ffi wheel) in ``wheel_dir``, None where absent."""
    wheel_dir = Path(wheel_dir)
    sg = sorted(wheel_dir.glob("sglang-0.5.23-*.whl")) if wheel_dir.is_dir() else []
    tv = sorted(wheel_dir.glob(TVM_FFI_WHEEL)) if wheel_dir.is_dir() else []
    return (sg[-1] if sg else None), (tv[-1] if tv else None)


def unpack(wheel_dir: Path, dest: Path) -> Sources | None:
    """Extract from the carried wheels only what the build needs (the sglang JIT headers and
    kernel sources; all of tvm-ffi) into ``dest``; None when a wheel is missing."""
    sg, tv = find_wheels(wheel_dir)
    if sg is None or tv is None:
        return None
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(sg) as z:
        z.extractall(dest, [n for n in z.namelist() if n.startswith("sglang/kernels/jit/")])
    with zipfile.ZipFile(tv) as z:
        z.extractall(dest, [n for n in z.namelist() if n.startswith("tvm_ffi/")])
    return sources_in(dest)


def template_args(k: int = K, h_slots: int = H_SLOTS, block: int = BLOCK) -> str:
    """``load_cache_to_device_buffer<BLOCK, TOPK, HOT, IsMLA, IsDsv4, 1, false, RecordPlan,
    SkipIO>`` as sglang's ``_jit_sparse_module`` instantiates it for MLA (production: no miss
    plan, real IO)."""
    return f"{block}, {k}, {h_slots}, true, false, 1, false, false, false"


def wrapper_source(k: int = K, h_slots: int = H_SLOTS, block: int = BLOCK) -> str:
    """The translation unit sglang's loader generates (``jit/utils/compile/spec.py``)."""
    return "\n".join([
        "#include <tvm/ffi/container/tensor.h>", "#include <tvm/ffi/dtype.h>",
        "#include <tvm/ffi/error.h>", "#include <tvm/ffi/extra/c_env_api.h>",
        "#include <tvm/ffi/function.h>", '#include "kvcacheio/hisparse.cuh"',
        "namespace sglang {",
        "TVM_FFI_DLL_EXPORT_TYPED_FUNC(load_cache_to_device_buffer, "
        f"(load_cache_to_device_buffer<{template_args(k, h_slots, block)}>));",
        "}  // namespace sglang", ""])


def build_command(src: Path, out: Path, srcs: Sources, cuda_home: str | Path,
                  arch: str = "90a") -> list[str]:
    """nvcc command line: sglang's loader flags (sm_90a, C++20, -O3, relaxed constexpr),
    linked against tvm-ffi and cudart (``CUDA_HOME`` must be the real toolkit root)."""
    cuda_home = Path(cuda_home)
    major = arch[:-1] if arch.endswith("a") else arch
    return [str(cuda_home / "bin" / "nvcc"), "-shared", "-Xcompiler", "-fPIC",
            f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-DSGL_CUDA_ARCH={major}0",
            "-std=c++20", "-O3", "--expt-relaxed-constexpr",
            f"-I{srcs.jit_include}", f"-I{srcs.jit_csrc}", f"-I{srcs.tvm_include}",
            f"-L{srcs.tvm_lib}", f"-Xlinker=-rpath,{srcs.tvm_lib}", "-ltvm_ffi",
            f"-L{cuda_home / 'lib64'}", "-lcudart", "-o", str(out), str(src)]


def cuda_home() -> str | None:
    """The real toolkit root: $CUDA_HOME, else /usr/local/cuda, else nvcc's grandparent."""
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").exists():
            return str(Path(cand).resolve())
    nvcc = shutil.which("nvcc")
    return str(Path(nvcc).resolve().parents[1]) if nvcc else None


def build_kernel(srcs: Sources, workdir: Path, k: int, h_slots: int, block: int = BLOCK):
    """Compile and load the kernel; returns the tvm-ffi function."""
    home = cuda_home()
    if home is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME to the toolkit root)")
    src, out = workdir / "hisparse_standalone.cu", workdir / "hisparse_standalone.so"
    src.write_text(wrapper_source(k, h_slots, block))
    cmd = build_command(src, out, srcs, home)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-4000:]}")
    log(f"built the HiSparse kernel in {time.perf_counter() - t0:.1f} s")
    if str(srcs.tvm_site) not in sys.path:
        sys.path.insert(0, str(srcs.tvm_site))
    import tvm_ffi

    return tvm_ffi.load_module(str(out)).load_cache_to_device_buffer


# -- (2) the selection stream ----------------------------------------------------------------
def selection_stream(batch: int, context: int, steps: int, k: int, seed: int,
                     model: LocalityModel = DEFAULT_MODEL) -> np.ndarray:
    """``int32 [steps, batch, k]`` token positions (-1 padded), fed unchanged to both sides.

    Request r decodes positions ``context + t`` (step t; ``seq_len = context + t + 1``); its
    generator is seeded by ``(seed, r)`` so a cell is reproducible and requests differ."""
    out = np.full((steps, batch, k), -1, dtype=np.int32)
    for r in range(batch):
        gen = SelectionGen(model, k, np.random.default_rng([seed, r]))
        for t in range(steps):
            s = gen.step(context + t)
            out[t, r, : s.size] = s
    return out


def newest_positions(context: int, steps: int) -> np.ndarray:
    return context + np.arange(steps, dtype=np.int64)


# -- (3) equal-memory sizing ---------------------------------------------------------------
@dataclass(frozen=True)
class Sizing:
    batch: int
    context: int
    steps: int
    k: int
    h_slots: int
    reserved: int
    row_bytes: int

    @property
    def stride(self) -> int:
        """Host rows (and logical addresses) per request: every token it will ever hold."""
        return self.context + self.steps + self.reserved

    @property
    def gpu_rows(self) -> int:
        """Device rows per layer, both sides: HiSparse's batch x (H + reserved)."""
        return self.batch * (self.h_slots + self.reserved)

    @property
    def host_rows(self) -> int:
        return self.batch * self.stride

    @property
    def gpu_bytes(self) -> int:
        return self.gpu_rows * self.row_bytes

    @property
    def host_bytes(self) -> int:
        return self.host_rows * self.row_bytes

    def check(self) -> None:
        if self.k > self.h_slots:
            raise ValueError(f"k {self.k} > H {self.h_slots}: one step's top-k must fit")
        if self.context + 1 <= self.h_slots:
            raise ValueError(f"context {self.context} fits the {self.h_slots}-slot buffer: the "
                             "kernel's fast path, nothing to compare")
        if self.batch * (self.k + 1) > self.gpu_rows:
            raise ValueError("one step's selections do not fit the shared pool")

    def to_dict(self) -> dict:
        return {**asdict(self), "stride": self.stride, "gpu_rows": self.gpu_rows,
                "host_rows": self.host_rows, "gpu_bytes": self.gpu_bytes,
                "host_bytes": self.host_bytes}


def sizing(batch: int, context: int, steps: int, k: int = K, h_slots: int = H_SLOTS,
           reserved: int = RESERVED_SLOTS, row_bytes: int = ROW_BYTES) -> Sizing:
    s = Sizing(batch, context, steps, k, h_slots, reserved, row_bytes)
    s.check()
    return s


# -- (5) rows that validate themselves ---------------------------------------------------------
def encode_rows(addrs: torch.Tensor, row_bytes: int, chunk: int = 1 << 16) -> torch.Tensor:
    """``uint8 [n, row_bytes]``: the row of each address (``request x stride + position``), on
    ``addrs``' device. Bytes 0-7: the address, little endian; then ``(a * 31 + 7 j) mod 256``.
    Equal rows <=> equal addresses."""
    addrs = addrs.reshape(-1).to(torch.int64)
    out = torch.empty(addrs.numel(), row_bytes, dtype=torch.uint8, device=addrs.device)
    j = torch.arange(row_bytes, device=addrs.device, dtype=torch.int64)
    shift = torch.clamp(j[:8] * 8, max=56)
    for i in range(0, addrs.numel(), chunk):
        a = addrs[i: i + chunk, None]
        body = (a * 31 + j * 7) & 0xFF
        body[:, :8] = (a >> shift) & 0xFF
        out[i: i + chunk] = body.to(torch.uint8)
    return out


def check_rows(pool: torch.Tensor, locs: torch.Tensor, addrs: torch.Tensor) -> int:
    """Rows of ``pool`` (``uint8 [N, row_bytes]``) at ``locs`` that differ from the encoded
    rows of ``addrs`` (same shape, ``-1`` padding skipped; a ``-1`` location for a real address
    counts as a mismatch)."""
    sel = addrs.reshape(-1) >= 0
    loc = locs.reshape(-1).to(torch.int64)[sel]
    want = addrs.reshape(-1).to(torch.int64)[sel]
    bad = int((loc < 0).sum())
    loc, want = loc[loc >= 0], want[loc >= 0]
    got = pool.index_select(0, loc)
    return bad + int((got != encode_rows(want, pool.shape[1])).any(1).sum())


# -- the two sides -------------------------------------------------------------------------
class HiSparseSide:
    """sglang's state tensors for one layer (``hisparse_coordinator.py:648-728``) and the
    per-step call; ``kernel`` None: the CPU model performs the same copies (stand-in)."""

    name = "hisparse"

    def __init__(self, sz: Sizing, device: torch.device, kernel=None, block: int = BLOCK):
        self.sz, self.dev, self.kernel, self.block = sz, device, kernel, block
        B, H, W = sz.batch, sz.h_slots, sz.h_slots + sz.reserved
        req = torch.arange(B, device=device, dtype=torch.int64)
        self.host = _pinned((sz.host_rows, sz.row_bytes)) if device.type == "cuda" else \
            torch.empty(sz.host_rows, sz.row_bytes, dtype=torch.uint8)
        chunk = max(1, (1 << 22) // sz.stride)  # fill the host mirror with every token's row
        for r0 in range(0, B, chunk):
            lo, hi = r0 * sz.stride, min(B, r0 + chunk) * sz.stride
            a = torch.arange(lo, hi, device=device)
            self.host[lo:hi].copy_(encode_rows(a, sz.row_bytes))
        self.host_locs = (req[:, None] * sz.stride
                          + torch.arange(sz.stride, device=device)[None]).contiguous()
        self.dev_locs = (req[:, None] * W + torch.arange(W, device=device)[None]).to(torch.int32)
        self.tokens = torch.full((B, W), -1, dtype=torch.int32, device=device)
        self.tokens[:, :H] = torch.arange(H, device=device, dtype=torch.int32)
        self.lru = torch.arange(H, dtype=torch.int16, device=device).repeat(B, 1).contiguous()
        self.buf = torch.zeros(sz.gpu_rows, sz.row_bytes, dtype=torch.uint8, device=device)
        staged = (req[:, None] * sz.stride + torch.arange(H, device=device)[None]).reshape(-1)
        self.buf.view(B, W, -1)[:, :H] = encode_rows(staged, sz.row_bytes).view(B, H, -1)
        self.req = req
        self.num_real = torch.tensor([B], dtype=torch.int32, device=device)
        self.out = torch.full((B, sz.k), -1, dtype=torch.int32, device=device)
        self.empty = torch.empty(0, device=device)
        self.models = [HiSparseBuffer(H) for _ in range(B)]

    def prepare(self, newest: int) -> tuple[int, int]:
        """The forward's part, untimed: the newest token's row into reserved slot H of every
        request (and backed up to the host mirror: B rows D2H). Returns (H2D, D2H) rows."""
        sz = self.sz
        a = self.req * sz.stride + newest
        self.buf[self.req * (sz.h_slots + sz.reserved) + sz.h_slots] = encode_rows(a, sz.row_bytes)
        return 0, sz.batch

    def step(self, sel_dev: torch.Tensor, sel_np: np.ndarray, newest: int) -> torch.Tensor:
        """The timed call: device locations ``int32 [B, k]``."""
        sz = self.sz
        seq = torch.full((sz.batch,), newest + 1, dtype=torch.int64, device=self.dev)
        if self.kernel is not None:
            self.kernel(sel_dev, self.tokens, self.host_locs, self.dev_locs, self.host,
                        self.empty, self.buf, self.empty, self.out, self.req, seq, self.lru,
                        self.num_real, 1, sz.row_bytes, self.empty, self.empty, self.empty)
            return self.out
        return self._model_step(sel_np, newest)

    def _model_step(self, sel_np: np.ndarray, newest: int) -> torch.Tensor:
        sz, W = self.sz, self.sz.h_slots + self.sz.reserved
        for r, m in enumerate(self.models):
            row = sel_np[r][sel_np[r] >= 0]
            m.step(row, newest)
            miss_slots = m.last_slots[np.isin(row, m.last_misses)]
            if miss_slots.size:  # host -> device rows, as the kernel's warps copy them
                dst = torch.from_numpy(r * W + miss_slots)
                src = torch.from_numpy(r * sz.stride + m.last_misses)
                self.buf[dst] = self.host[src]
            out = np.full(sz.k, -1, dtype=np.int64)
            out[: row.size] = r * W + m.last_slots
            self.out[r] = torch.from_numpy(out).to(torch.int32)
        return self.out

    def model_check(self, sel_np: np.ndarray, newest: int, locs: torch.Tensor) -> tuple[int, bool]:
        """Step the CPU models (kernel runs only); (their misses, kernel slots == model slots)."""
        if self.kernel is None:  # the models already ran as the stand-in
            return sum(int(m.last_misses.size) for m in self.models), True
        got = locs.cpu().numpy()
        W, misses, agree = self.sz.h_slots + self.sz.reserved, 0, True
        for r, m in enumerate(self.models):
            row = sel_np[r][sel_np[r] >= 0]
            m.step(row, newest)
            misses += int(m.last_misses.size)
            agree &= bool(np.array_equal(got[r, : row.size], r * W + m.last_slots))
        return misses, agree

    def pool(self) -> torch.Tensor:
        return self.buf


class UlaSide:
    """One ulacache selection group over the shared pool of ``gpu_rows`` rows (one layer)."""

    name = "ulacache"

    def __init__(self, sz: Sizing, device: torch.device, policy: str = "pblru"):
        from ulacache.group import SelectionGroup

        self.sz, self.dev = sz, device
        n_logical = sz.host_rows
        self.g = SelectionGroup([0], n_logical, sz.gpu_rows, n_logical + 1, sz.row_bytes,
                                device, policy, validate=False)
        # the prompts, placed position-major across requests (a round per half pool), rows
        # written as placed: the pool ends holding every request's most recent tokens
        pos = torch.arange(sz.context, device=device)
        addrs = (pos[:, None] + torch.arange(sz.batch, device=device)[None] * sz.stride)
        addrs = addrs.reshape(-1)
        chunk = max(1, sz.gpu_rows // 2)
        for i in range(0, addrs.numel(), chunk):
            a = addrs[i: i + chunk]
            self.g.policy.advance()
            self.g.place(a)
            self.g.write(0, a, encode_rows(a, sz.row_bytes))
        self.req = torch.arange(sz.batch, device=device, dtype=torch.int64)
        self.out = torch.empty(sz.batch, sz.k, dtype=torch.int32, device=device)

    def counters(self) -> dict[str, int]:
        return self.g.counter_values()

    def prepare(self, newest: int) -> tuple[int, int]:
        """Untimed: a new round, the newest tokens placed and written (spills are D2H)."""
        before = self.counters()
        self.g.policy.advance()
        a = self.req * self.sz.stride + newest
        self.g.place(a)
        self.g.write(0, a, encode_rows(a, self.sz.row_bytes))
        after = self.counters()
        return 0, after["spills"] - before["spills"]

    def addrs(self, sel_dev: torch.Tensor) -> torch.Tensor:
        a = sel_dev.to(torch.int64) + (self.req * self.sz.stride)[:, None]
        return torch.where(sel_dev >= 0, a, -1)

    def step(self, sel_dev: torch.Tensor, sel_np: np.ndarray, newest: int) -> torch.Tensor:
        return self.g.access(self._a, self.out)

    def pool(self) -> torch.Tensor:
        return self.g.pools.gpu[0]


def _pinned(shape: tuple[int, int]) -> torch.Tensor:
    """Exact-size pinned host memory (torch's caching allocator rounds up to a power of 2)."""
    try:
        from ulacache.kernels.pinned import pinned_empty

        return pinned_empty(shape, torch.uint8)
    except Exception:  # noqa: BLE001 - fall back to torch's pinning
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)


# -- (4) running a cell, result rows, table and JSON --------------------------------------------
@dataclass
class CellResult:
    system: str
    batch: int
    context: int
    steps: int
    gpu_rows: int
    row_bytes: int
    accesses: int = 0
    hit_rate: float = 0.0
    h2d_bytes_per_step_layer: float = 0.0
    d2h_bytes_per_step_layer: float = 0.0
    pcie_bytes_per_step_layer: float = 0.0
    time_us_median: float = 0.0
    time_us_mean: float = 0.0
    h2d_floor_us: float | None = None
    x_floor: float | None = None
    valid: bool = True
    mismatched_rows: int = 0
    model_agrees: bool | None = None
    times_us: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summarise(res: CellResult, accesses: int, misses: int, h2d_rows: int, d2h_rows: int,
              times_s: list[float], h2d_gbps: float | None) -> CellResult:
    """Fill the per-step-per-layer figures from totals over ``res.steps`` timed steps."""
    n = max(1, res.steps)
    res.accesses = accesses
    res.hit_rate = round((accesses - misses) / max(1, accesses), 6)
    res.h2d_bytes_per_step_layer = h2d_rows * res.row_bytes / n
    res.d2h_bytes_per_step_layer = d2h_rows * res.row_bytes / n
    res.pcie_bytes_per_step_layer = res.h2d_bytes_per_step_layer + res.d2h_bytes_per_step_layer
    res.times_us = [round(t * 1e6, 2) for t in times_s]
    if times_s:
        res.time_us_median = round(statistics.median(times_s) * 1e6, 2)
        res.time_us_mean = round(statistics.fmean(times_s) * 1e6, 2)
    if h2d_gbps:
        res.h2d_floor_us = round(res.h2d_bytes_per_step_layer / (h2d_gbps * 1e9) * 1e6, 2)
        res.x_floor = round(res.time_us_median / max(1e-9, res.h2d_floor_us), 3) \
            if res.h2d_floor_us else None
    return res


def _timer(device: torch.device):
    """``(start, stop) -> seconds`` callables: CUDA events on a GPU, perf_counter on the CPU."""
    if device.type == "cuda":
        def start():  # a ~2 ms sleep first keeps the GPU ahead of the host: launch gaps are
            torch.cuda._sleep(4_000_000)  # hidden, as under a CUDA graph (bench/bandwidth.py)
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e

        def stop(e):
            f = torch.cuda.Event(enable_timing=True)
            f.record()
            f.synchronize()
            return e.elapsed_time(f) * 1e-3
        return start, stop
    return time.perf_counter, lambda t0: time.perf_counter() - t0


def run_side(side, sz: Sizing, stream: np.ndarray, warmup: int,
             h2d_gbps: float | None) -> CellResult:
    """Drive one side through the stream; stats over the steps after ``warmup``; every step
    validated byte for byte."""
    dev = side.dev
    start, stop = _timer(dev)
    res = CellResult(side.name, sz.batch, sz.context, stream.shape[0] - warmup, sz.gpu_rows,
                     sz.row_bytes)
    acc = miss = h2d = d2h = 0
    times: list[float] = []
    agree = True
    for t, newest in enumerate(newest_positions(sz.context, stream.shape[0])):
        newest = int(newest)
        sel_np = stream[t]
        sel_dev = torch.from_numpy(sel_np).to(dev)
        _, back = side.prepare(newest)
        before = side.counters() if isinstance(side, UlaSide) else None
        if isinstance(side, UlaSide):
            side._a = side.addrs(sel_dev)
        t0 = start()
        locs = side.step(sel_dev, sel_np, newest)
        dt = stop(t0)
        addrs = torch.where(sel_dev >= 0, sel_dev.to(torch.int64)
                            + (torch.arange(sz.batch, device=dev) * sz.stride)[:, None], -1)
        bad = check_rows(side.pool(), locs, addrs)
        res.mismatched_rows += bad
        if isinstance(side, UlaSide):
            after = side.counters()
            a = after["accesses"] - before["accesses"]
            m = after["promotions"] - before["promotions"]
            wb = after["writebacks"] - before["writebacks"]
            res.mismatched_rows += after["access_overflow"] - before["access_overflow"]
        else:
            m, ok = side.model_check(sel_np, newest, locs)
            agree &= ok
            a, wb = int((sel_np >= 0).sum()), 0
        if t >= warmup:
            acc, miss, h2d, d2h = acc + a, miss + m, h2d + m, d2h + wb + back
            times.append(dt)
    res.valid = res.mismatched_rows == 0
    if side.name == "hisparse":
        res.model_agrees = agree
        res.valid &= agree
    return summarise(res, acc, miss, h2d, d2h, times, h2d_gbps)


def ratio_rows(rows: list[dict]) -> list[dict]:
    """Per cell: HiSparse / ulacache for time and PCIe bytes (both present and timed)."""
    by = {(r["batch"], r["context"], r["system"]): r for r in rows}
    out = []
    for (b, c, s), hs in sorted(by.items()):
        ula = by.get((b, c, "ulacache"))
        if s != "hisparse" or ula is None:
            continue
        out.append({"batch": b, "context": c,
                    "time_hisparse_over_ulacache": round(hs["time_us_median"] / max(
                        1e-9, ula["time_us_median"]), 3),
                    "pcie_hisparse_over_ulacache": round(hs["pcie_bytes_per_step_layer"] / max(
                        1e-9, ula["pcie_bytes_per_step_layer"]), 3)})
    return out


def format_table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"HiSparse swap-in kernel vs ulacache access, {result['device']}: k={cfg['k']}, "
             f"H={cfg['h_slots']} (+{cfg['reserved']} reserved), {cfg['row_bytes']} B rows, "
             f"{cfg['steps']} timed steps after {cfg['warmup']} warmup, seed {cfg['seed']}; per "
             "decode step and layer; equal GPU rows (batch x (H + reserved))",
             f"pinned H2D copy: {result['h2d_copy_gbps']} GB/s "
             f"({'kernel' if result['kernel'] else 'CPU stand-in: HiSparseBuffer model'})",
             f"{'system':<9}{'batch':>6}{'ctx':>8}{'GPU rows':>10}{'hit':>8}{'H2D KB':>9}"
             f"{'D2H KB':>8}{'PCIe KB':>9}{'med us':>9}{'floor us':>9}{'x floor':>8}  valid"]
    for r in result["rows"]:
        fl = "-" if r["h2d_floor_us"] is None else f"{r['h2d_floor_us']:.1f}"
        xf = "-" if r["x_floor"] is None else f"{r['x_floor']:.2f}"
        lines.append(f"{r['system']:<9}{r['batch']:>6}{r['context']:>8}{r['gpu_rows']:>10}"
                     f"{r['hit_rate']:>8.4f}{r['h2d_bytes_per_step_layer'] / 1024:>9.1f}"
                     f"{r['d2h_bytes_per_step_layer'] / 1024:>8.1f}"
                     f"{r['pcie_bytes_per_step_layer'] / 1024:>9.1f}{r['time_us_median']:>9.1f}"
                     f"{fl:>9}{xf:>8}  {'ok' if r['valid'] else 'MISMATCH'}")
    for q in result["ratios"]:
        lines.append(f"batch {q['batch']:>3} ctx {q['context']:>6}: HiSparse / ulacache time "
                     f"x{q['time_hisparse_over_ulacache']:.2f}, PCIe bytes "
                     f"x{q['pcie_hisparse_over_ulacache']:.2f}")
    for s in result["skipped"]:
        lines.append(f"skipped batch {s['batch']} ctx {s['context']}: {s['reason']}")
    return "\n".join(lines)


def measure_h2d_gbps(device: torch.device, nbytes: int = 256 << 20) -> float | None:
    if device.type != "cuda":
        return None
    host = _pinned((nbytes, 1)).view(-1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    start, stop = _timer(device)
    dst.copy_(host, non_blocking=True)
    ts = []
    for _ in range(10):
        t0 = start()
        dst.copy_(host, non_blocking=True)
        ts.append(stop(t0))
    return round(nbytes / statistics.median(ts) / 1e9, 2)


def run(args, device: torch.device, kernel) -> dict:
    h2d = measure_h2d_gbps(device)
    rows, skipped = [], []
    for ctx in args.contexts:
        for b in args.batches:
            try:
                sz = sizing(b, ctx, args.warmup + args.steps, args.k, args.h_slots,
                            args.reserved, args.row_bytes)
            except ValueError as e:
                skipped.append({"batch": b, "context": ctx, "reason": str(e)})
                continue
            if sz.host_bytes > args.max_host_gib * 2**30:
                skipped.append({"batch": b, "context": ctx, "reason":
                                f"host mirror {sz.host_bytes / 2**30:.1f} GiB > --max-host-gib"})
                continue
            t0 = time.perf_counter()
            stream = selection_stream(b, ctx, sz.steps, args.k, args.seed)
            for system in ("hisparse", "ulacache"):
                side = HiSparseSide(sz, device, kernel) if system == "hisparse" else \
                    UlaSide(sz, device, args.policy)
                rows.append(run_side(side, sz, stream, args.warmup, h2d).to_dict())
                del side
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            log(f"batch {b} ctx {ctx}: {time.perf_counter() - t0:.1f} s")
    cfg = {"k": args.k, "h_slots": args.h_slots, "reserved": args.reserved,
           "row_bytes": args.row_bytes, "steps": args.steps, "warmup": args.warmup,
           "seed": args.seed, "policy": args.policy, "batches": list(args.batches),
           "contexts": list(args.contexts), "block": BLOCK,
           "locality": DEFAULT_MODEL.to_dict()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"config": cfg, "device": name, "kernel": kernel is not None, "h2d_copy_gbps": h2d,
            "rows": rows, "ratios": ratio_rows(rows), "skipped": skipped}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--quick", action="store_true",
                    help=f"batches {QUICK_BATCHES} x contexts {QUICK_CONTEXTS}, 4 timed steps")
    ap.add_argument("--cpu", action="store_true",
                    help="no GPU: HiSparseBuffer stands in for the kernel (small sizes only)")
    ap.add_argument("--batches", type=_ints, default=BATCHES)
    ap.add_argument("--contexts", type=_ints, default=CONTEXTS)
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per cell")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (validated)")
    ap.add_argument("--k", type=int, default=K)
    ap.add_argument("--h-slots", type=int, default=H_SLOTS)
    ap.add_argument("--reserved", type=int, default=RESERVED_SLOTS)
    ap.add_argument("--row-bytes", type=int, default=ROW_BYTES)
    ap.add_argument("--policy", default="pblru")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-host-gib", type=float, default=40.0,
                    help="skip cells whose host mirror exceeds this (pinned; one side at a time)")
    ap.add_argument("--wheel-dir", type=Path, default=WHEEL_DIR,
                    help="the carried sglang + apache-tvm-ffi wheels")
    ap.add_argument("--site", type=Path, default=None,
                    help="a directory already holding sglang/ and tvm_ffi/ (instead of wheels)")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.steps = QUICK_BATCHES, QUICK_CONTEXTS, 4
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kernel = None
    if args.cpu:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print(NO_CUDA_MESSAGE, file=sys.stderr)
            return EXIT_UNMEASURED
        device = torch.device("cuda")
        with tempfile.TemporaryDirectory(prefix="hisparse_h2h_") as tmp:
            srcs = sources_in(args.site) if args.site else unpack(args.wheel_dir, Path(tmp))
            if srcs is None or srcs.missing():
                print(no_sources_message(args.wheel_dir, srcs.missing() if srcs else None),
                      file=sys.stderr)
                return EXIT_UNMEASURED
            kernel = build_kernel(srcs, Path(tmp), args.k, args.h_slots)
            result = run(args, device, kernel)
    if kernel is None:
        result = run(args, device, None)
    print(json.dumps(result) if args.json else format_table(result))
    if args.json:
        log(format_table(result))
    return 0 if all(r["valid"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
