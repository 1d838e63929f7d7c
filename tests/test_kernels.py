"""Row kernels: references, dispatch fallback, pinned memory, launchers and the CUDA source.

Three tiers:

- CPU tests of the references, the dispatch fallback, ``pinned_empty`` and the launchers'
  checks (always run).
- The exact CUDA source compiled as host C++ with a small shim and run serially through the
  real launchers (``_launch`` swapped for the emulator); needs ``g++``. This checks indexing,
  masking, rows-per-warp grouping and argument packing, not GPU memory semantics or speed.
- ``@pytest.mark.gpu``: each kernel against its reference on a CUDA device, per backend.
"""

from __future__ import annotations

import ctypes
import fnmatch
import gc
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ulacache.kernels.pinned as pinned
from ulacache.errors import ShapeError
from ulacache.kernels import cuda_rows, dispatch, peer_reference, reference

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def rand_pool(layers: int, rows: int, row_bytes: int, device="cpu", gen=None) -> torch.Tensor:
    """Random ``uint8 [layers, rows + 1, row_bytes]`` pool (scratch row included)."""
    t = torch.randint(0, 256, (layers, rows + 1, row_bytes), dtype=torch.uint8, generator=gen)
    return t.to(device)


def rand_pairs(n: int, src_rows: int, dst_rows: int, p_skip: float, gen) -> tuple:
    """``n`` pairs: random sources, distinct destinations, ``-1`` on either side w.p. p_skip."""
    src = torch.randint(0, src_rows, (n,), generator=gen)
    dst = torch.randperm(dst_rows, generator=gen)[:n]
    src[torch.rand(n, generator=gen) < p_skip] = -1
    dst[torch.rand(n, generator=gen) < p_skip] = -1
    return src, dst


def loop_gather(src, s_idx, dst, d_idx):
    out = dst.clone()
    for s, d in zip(s_idx.tolist(), d_idx.tolist(), strict=True):
        if s >= 0 and d >= 0:
            out[:, d] = src[:, s]
    return out


def loop_swap(g, g_idx, c, c_idx):
    g2, c2 = g.clone(), c.clone()
    for a, b in zip(g_idx.tolist(), c_idx.tolist(), strict=True):
        if a >= 0 and b >= 0:
            g2[:, a], c2[:, b] = c[:, b], g[:, a]
    return g2, c2


ROW_SIZES = [16, 656, 1152]


# ---------------------------------------------------------------------------------------------
# references (CPU)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("row_bytes", ROW_SIZES)
@pytest.mark.parametrize("layers", [1, 3])
def test_reference_gather(row_bytes, layers):
    g = torch.Generator().manual_seed(row_bytes * 10 + layers)
    src, dst = rand_pool(layers, 50, row_bytes, gen=g), rand_pool(layers, 40, row_bytes, gen=g)
    s, d = rand_pairs(30, 50, 40, 0.2, g)
    want = loop_gather(src, s, dst, d)
    reference.gather_rows(src, s, dst, d)
    assert torch.equal(dst, want)


@pytest.mark.parametrize("row_bytes", ROW_SIZES)
def test_reference_swap(row_bytes):
    g = torch.Generator().manual_seed(row_bytes)
    gp, cp = rand_pool(2, 20, row_bytes, gen=g), rand_pool(2, 30, row_bytes, gen=g)
    gi = torch.randperm(20, generator=g)[:12]
    ci = torch.randperm(30, generator=g)[:12]
    gi[3], ci[5] = -1, -1
    wg, wc = loop_swap(gp, gi, cp, ci)
    reference.swap_rows(gp, gi, cp, ci)
    assert torch.equal(gp, wg) and torch.equal(cp, wc)


@pytest.mark.parametrize("adt", [torch.int32, torch.int64])
@pytest.mark.parametrize("mdt", [torch.int32, torch.int64])
def test_reference_translate(adt, mdt):
    g = torch.Generator().manual_seed(7)
    mapping = torch.randint(0, 1000, (101,), generator=g).to(mdt)
    addrs = torch.randint(-1, 100, (4, 9), generator=g).to(adt)
    out = torch.empty(4, 9, dtype=torch.int32)
    reference.translate_rows(mapping, addrs, out, row_base=3)
    want = torch.where(addrs >= 0, mapping[addrs.clamp(min=0).long()].long() + 3, -1)
    assert torch.equal(out.long(), want)


@pytest.mark.parametrize("as_table", [False, True])
def test_peer_reference(as_table):
    g = torch.Generator().manual_seed(3)
    pools = [rand_pool(2, 30, 656, gen=g) for _ in range(3)]
    dst = rand_pool(2, 30, 656, gen=g)
    s, d = rand_pairs(25, 30, 30, 0.1, g)
    rank = torch.randint(-1, 3, (25,), generator=g)
    want = dst.clone()
    for r in range(3):
        want = loop_gather(pools[r], torch.where(rank == r, s, -1), want, d)
    srcs = peer_reference.pool_ptr_table(pools) if as_table else pools
    peer_reference.gather_rows_peers(srcs, rank, s, dst, d)
    assert torch.equal(dst, want)


def test_peer_reference_rejects_too_many_pools():
    pools = [rand_pool(1, 2, 16) for _ in range(9)]
    idx = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ShapeError):
        peer_reference.gather_rows_peers(pools, idx, idx, rand_pool(1, 2, 16), idx)


# ---------------------------------------------------------------------------------------------
# dispatch fallback and helpers (CPU)
# ---------------------------------------------------------------------------------------------
def test_dispatch_cpu_fallback_equals_reference():
    g = torch.Generator().manual_seed(11)
    src, dst = rand_pool(2, 40, 656, gen=g), rand_pool(2, 40, 656, gen=g)
    s, d = rand_pairs(20, 40, 40, 0.2, g)
    assert not dispatch.uses_kernel(src, dst)
    want = loop_gather(src, s, dst, d)
    dispatch.gather_rows(src, s, dst, d)
    assert torch.equal(dst, want)

    gp, cp = rand_pool(2, 20, 16, gen=g), rand_pool(2, 20, 16, gen=g)
    gi, ci = torch.randperm(20, generator=g)[:8], torch.randperm(20, generator=g)[:8]
    wg, wc = loop_swap(gp, gi, cp, ci)
    dispatch.swap_rows(gp, gi, cp, ci)
    assert torch.equal(gp, wg) and torch.equal(cp, wc)

    mapping = torch.arange(11, dtype=torch.int64) * 2
    addrs = torch.tensor([[0, -1, 9], [-1, -1, 3]])
    out = torch.empty(2, 3, dtype=torch.int32)
    dispatch.translate_rows(mapping, addrs, out, 1)
    assert out.tolist() == [[1, -1, 19], [-1, -1, 7]]

    pools = [rand_pool(2, 10, 16, gen=g) for _ in range(2)]
    rank = torch.tensor([0, 1, -1, 1], dtype=torch.int32)
    si = torch.tensor([1, 2, 3, -1], dtype=torch.int32)
    di = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    dst2 = rand_pool(2, 10, 16, gen=g)
    want2 = loop_gather(pools[1], torch.tensor([-1, 2, -1, -1]),
                        loop_gather(pools[0], torch.tensor([1, -1, -1, -1]), dst2, di), di)
    dispatch.gather_rows_peers(pools, rank, si, dst2, di)
    assert torch.equal(dst2, want2)


def test_sort_by_source_keeps_pairs():
    g = torch.Generator().manual_seed(5)
    s, d = rand_pairs(100, 1000, 500, 0.1, g)
    s2, d2 = dispatch.sort_by_source(s, d)
    assert torch.all(s2[1:] >= s2[:-1])
    pairs = sorted(zip(s.tolist(), d.tolist(), strict=True))
    assert pairs == sorted(zip(s2.tolist(), d2.tolist(), strict=True))
    rank = torch.randint(0, 3, (100,), generator=g)
    r3, s3, d3 = dispatch.sort_by_source(s, d, rank)
    key = r3 * (1 << 40) + s3
    assert torch.all(key[1:] >= key[:-1])
    triples = sorted(zip(rank.tolist(), s.tolist(), d.tolist(), strict=True))
    assert triples == sorted(zip(r3.tolist(), s3.tolist(), d3.tolist(), strict=True))


# ---------------------------------------------------------------------------------------------
# pinned memory (CPU, registration mocked)
# ---------------------------------------------------------------------------------------------
def test_pinned_exact_size_and_unregister(monkeypatch):
    calls = []
    monkeypatch.setattr(pinned, "_register", lambda p, n: calls.append(("reg", p, n)))
    monkeypatch.setattr(pinned, "_unregister", lambda p: calls.append(("unreg", p)))
    before = pinned.registered_bytes()
    t = pinned_t = pinned.pinned_empty((3, 7, 656), torch.uint8, register=True)
    assert t.shape == (3, 7, 656) and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.untyped_storage().nbytes() == 3 * 7 * 656
    assert t.data_ptr() % 4096 == 0
    assert calls == [("reg", t.data_ptr(), 3 * 7 * 656)]
    assert pinned.registered_bytes() - before == 3 * 7 * 656
    assert pinned.is_registered(t[2, 5])
    view = t[1]
    view.fill_(9)
    del t, pinned_t
    gc.collect()
    assert len(calls) == 1  # a view keeps the registration alive
    del view
    gc.collect()
    assert calls[-1][0] == "unreg" and pinned.registered_bytes() == before


def test_pinned_unregistered_fallback_and_dtypes():
    t = pinned.pinned_empty([5, 3], torch.int64, register=False)
    assert t.shape == (5, 3) and t.dtype == torch.int64
    assert t.untyped_storage().nbytes() == 5 * 3 * 8
    t.fill_(4)
    assert int(t.sum()) == 60 and not pinned.is_registered(t)
    assert pinned.pinned_empty((0, 4)).numel() == 0


def test_device_view_off_cuda_is_the_host_tensor_and_refuses_misuse():
    """Off CUDA the view is the tensor itself (the CPU free stacks of a CPU or meta space); a
    tensor on another device, or unregistered memory for CUDA, is refused (a silent copy would
    split the kernels' stack from the host's)."""
    t = pinned.pinned_empty((9,), torch.int32, register=False)
    assert pinned.device_view(t, torch.device("cpu")) is t
    m = torch.empty(4, device="meta")
    assert pinned.device_view(m, torch.device("meta")) is m
    with pytest.raises(ValueError, match="cannot stand for"):
        pinned.device_view(t, torch.device("meta"))
    with pytest.raises(ValueError, match="registered"):
        pinned.device_view(t, torch.device("cuda"))
    arr = pinned._HostArray(torch.arange(12, dtype=torch.int32).view(3, 4)[:, 1:])
    face = arr.__cuda_array_interface__
    assert face["shape"] == (3, 3) and face["typestr"] == "<i4" and face["strides"] == (16, 4)


# ---------------------------------------------------------------------------------------------
# launcher checks (CPU: device checks patched so validation runs without a GPU)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fake_device(monkeypatch):
    """Pretend CPU tensors are device-readable and the kernel device is the CPU; record
    launches instead of running them."""
    launches = []
    monkeypatch.setattr(cuda_rows, "is_device_readable", lambda t: True)
    monkeypatch.setattr(cuda_rows, "_kernel_device", lambda a, b: torch.device("cpu"))
    monkeypatch.setattr(cuda_rows, "_launch", lambda *a: launches.append(a))
    return launches


def test_launcher_checks(fake_device):
    pool = torch.zeros(2, 9, 656, dtype=torch.uint8)
    other = torch.zeros(2, 9, 656, dtype=torch.uint8)
    idx = torch.zeros(4, dtype=torch.int64)
    cuda_rows.gather(pool, idx, other, idx)
    assert len(fake_device) == 1
    name, rows, vpl, _dev, threads, sig, args, *_ = fake_device[0]
    assert (name, vpl, threads) == ("ula_gather", 2, 8 * 32) and len(sig) == len(args)
    bad = [
        (pool.float(), idx, other, idx, "uint8"),
        (pool[:, :, :650], idx, other[:, :, :650], idx, "multiple of 16"),
        (pool, idx.int(), other, idx, "int64"),
        (pool, idx, other, idx[:3], "length"),
        (pool, idx[::2], other, idx[:2], "contiguous"),
        (pool, idx, pool[:, :4], idx, "share storage"),
        (pool, idx, torch.zeros(3, 9, 656, dtype=torch.uint8), idx, "differ"),
        (pool.transpose(1, 2), idx, other, idx, "multiple of 16"),
        (torch.zeros(2, 9, 672, dtype=torch.uint8)[:, :, 8:664], idx, other, idx, "aligned"),
        (torch.zeros(2, 9, 1312, dtype=torch.uint8)[:, :, ::2], idx, other, idx, "stride"),
    ]
    for s, si, d, di, msg in bad:
        with pytest.raises(ShapeError, match=msg):
            cuda_rows.gather(s, si, d, di)
    with pytest.raises(ValueError, match="rows_per_warp"):
        cuda_rows.gather(pool, idx, other, idx, rows_per_warp=3)
    out = torch.empty(2, 3, dtype=torch.int32)
    with pytest.raises(ShapeError, match="CUDA"):
        cuda_rows.translate(torch.zeros(4, dtype=torch.int64), torch.zeros(2, 3,
                            dtype=torch.int64), out)
    with pytest.raises(ShapeError, match="CUDA"):
        cuda_rows.gather_peers(idx, idx, idx, other, idx)
    assert len(fake_device) == 1


def test_peer_launcher_takes_int32_plans(monkeypatch):
    """The peer gather's indices are a TP plan's ``int32`` entries; ``int64`` is refused in
    one line (a wrong width would read every other index as garbage on the GPU)."""
    launches = []
    monkeypatch.setattr(cuda_rows, "_on_gpu", lambda t: True)
    monkeypatch.setattr(cuda_rows, "is_device_readable", lambda t: True)
    monkeypatch.setattr(cuda_rows, "_launch", lambda *a: launches.append(a))
    dst = torch.zeros(2, 9, 656, dtype=torch.uint8)
    table = torch.zeros(3, dtype=torch.int64)
    i32, i64 = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)
    cuda_rows.gather_peers(table, i32, i32, dst, i32)
    assert len(launches) == 1 and launches[0][0] == "ula_gather_peer"
    for (rank, src, dst_idx), name in (((i64, i32, i32), "src_rank"),
                                       ((i32, i64, i32), "src_idx"),
                                       ((i32, i32, i64), "dst_idx")):
        with pytest.raises(ShapeError, match=f"{name}: expected int32"):
            cuda_rows.gather_peers(table, rank, src, dst, dst_idx)
    assert len(launches) == 1


def test_choose_rows_per_warp():
    assert cuda_rows.choose_rows_per_warp(2048, 2) == 1
    assert cuda_rows.choose_rows_per_warp(16384, 2) == 8
    assert cuda_rows.choose_rows_per_warp(131072, 3) == 8
    assert cuda_rows.choose_rows_per_warp(131072, 4) == 4
    assert cuda_rows.choose_rows_per_warp(131072, 3, swap=True) == 4
    assert [cuda_rows.vectors_per_lane(b) for b in (16, 656, 1152, 2048, 4096)] == [1, 2, 3, 4, 4]


# ---------------------------------------------------------------------------------------------
# the CUDA source file (kernels/rows.cu, read as text at import)
# ---------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parent.parent
ROWS_CU = REPO / "kernels" / "rows.cu"


def test_cuda_source_is_rows_cu():
    assert isinstance(cuda_rows.CUDA_SOURCE, str)
    assert cuda_rows.CUDA_SOURCE == ROWS_CU.read_text(encoding="utf-8")
    assert cuda_rows.CUDA_SOURCE == (Path(cuda_rows.__file__).parent / "rows.cu").read_text()
    lines = [ln.strip() for ln in cuda_rows.CUDA_SOURCE.splitlines()]
    assert not [ln for ln in lines if ln.startswith("#include")]  # NVRTC gets no headers
    for name in cuda_rows.KERNEL_NAMES:
        assert f"void {name}(" in cuda_rows.CUDA_SOURCE or f"({name}," in cuda_rows.CUDA_SOURCE
    src = cuda_rows.module_source(8, 3, True)
    assert src == "#define ROWS 8\n#define VPL 3\n#define ULA_NC 1\n" + cuda_rows.CUDA_SOURCE


def test_cuda_source_loads_from_plain_source_checkout(tmp_path):
    """Without the installed package (editable finder removed), ``ulacache/__init__.py`` puts
    the checkout root on ``ulacache.__path__``, so ``ulacache.kernels`` is ``kernels/`` and
    ``importlib.resources`` finds rows.cu there."""
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if '__editable__' not in str(getattr(f, '__module__', ''))]\n"
        "import ulacache.kernels.cuda_rows as c\n"
        "from pathlib import Path\n"
        f"root = Path({str(REPO)!r})\n"
        "assert Path(c.__file__).resolve() == root / 'kernels' / 'cuda_rows.py', c.__file__\n"
        "assert c.CUDA_SOURCE == (root / 'kernels' / 'rows.cu').read_text(encoding='utf-8')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_rows_cu_is_package_data():
    tomllib = pytest.importorskip("tomllib")

    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"]["ulacache.kernels"] == "kernels"
    globs = conf["package-data"]["ulacache.kernels"]
    assert any(fnmatch.fnmatch(ROWS_CU.name, g) for g in globs), globs


# ---------------------------------------------------------------------------------------------
# the CUDA source run on the CPU (host C++ shim, serial threads)
# ---------------------------------------------------------------------------------------------
SHIM = r"""
#include <cstdint>
#include <cstddef>
#include <type_traits>
#include <utility>
struct uint4 { unsigned int x, y, z, w; };
struct ula_dim3 { unsigned int x, y, z; };
static ula_dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
template <typename T> static inline T __ldg(const T* p) { return *p; }
"""

DRIVER = r"""
template <typename T> static T ula_conv(uint64_t v) {
    if constexpr (std::is_pointer<T>::value) return reinterpret_cast<T>(v);
    else return (T)(int64_t)v;
}
template <typename... A, size_t... I>
static void ula_run(void (*k)(A...), int grid, int block, const uint64_t* s,
                    std::index_sequence<I...>) {
    gridDim = {(unsigned)grid, 1, 1};
    blockDim = {(unsigned)block, 1, 1};
    for (int b = 0; b < grid; ++b)
        for (int t = 0; t < block; ++t) {
            blockIdx = {(unsigned)b, 0, 0};
            threadIdx = {(unsigned)t, 0, 0};
            k(ula_conv<A>(s[I])...);
        }
}
#define EMU(NAME) extern "C" void emu_##NAME(int g, int b, const uint64_t* s) { \
    ula_run(NAME, g, b, s, std::make_index_sequence<ARGS_##NAME>{}); }
"""

ARG_COUNTS = {"ula_gather": 11, "ula_gather_peer": 12, "ula_swap": 11}
ARG_COUNTS.update({n: 5 for n in cuda_rows.KERNEL_NAMES if n.startswith("ula_translate")})

_EMU_CACHE: dict[tuple[int, int, bool], ctypes.CDLL] = {}


def _emu_lib(rows: int, vpl: int, nc: bool, tmp: Path) -> ctypes.CDLL:
    if (rows, vpl, nc) in _EMU_CACHE:
        return _EMU_CACHE[(rows, vpl, nc)]
    src = SHIM + cuda_rows.module_source(rows, vpl, nc) + DRIVER
    src += "".join(f"#define ARGS_{n} {c}\nEMU({n})\n" for n, c in ARG_COUNTS.items())
    tag = hashlib.sha1(src.encode()).hexdigest()[:12]
    cpp, so = tmp / f"emu_{tag}.cpp", tmp / f"emu_{tag}.so"
    cpp.write_text(src)
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall",
                    "-Wno-unknown-pragmas", "-o", str(so), str(cpp)], check=True,
                   capture_output=True, text=True)
    lib = ctypes.CDLL(str(so))
    _EMU_CACHE[(rows, vpl, nc)] = lib
    return lib


@pytest.fixture
def emulated(monkeypatch, tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    tmp = tmp_path_factory.getbasetemp()
    used = []

    def launch(name, rows, vpl, device, n_threads, sig, args, nc=False):
        lib = _emu_lib(rows, vpl, nc, tmp)
        grid = max(1, -(-n_threads // cuda_rows.THREADS))
        slots = (ctypes.c_uint64 * len(args))(*[int(a) & (2**64 - 1) for a in args])
        assert len(sig) == len(args) == ARG_COUNTS[name]
        getattr(lib, f"emu_{name}")(grid, cuda_rows.THREADS, slots)
        used.append((name, rows, vpl))

    monkeypatch.setattr(cuda_rows, "is_device_readable", lambda t: True)
    monkeypatch.setattr(cuda_rows, "_kernel_device", lambda a, b: torch.device("cpu"))
    monkeypatch.setattr(cuda_rows, "_launch", launch)
    monkeypatch.setattr(cuda_rows, "_on_gpu", lambda t: True)
    return used


@pytest.mark.parametrize("row_bytes", [16, 656, 1152, 2064])
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("rows_per_warp", [None, 1, 2, 8])
@pytest.mark.parametrize("nc", [False, True])
def test_emulated_gather(emulated, row_bytes, layers, rows_per_warp, nc):
    g = torch.Generator().manual_seed(row_bytes + layers)
    src = rand_pool(layers, 300, row_bytes, gen=g)
    dst = rand_pool(layers, 200, row_bytes, gen=g)[:, :, :]  # distinct storage
    s, d = rand_pairs(77, 300, 200, 0.15, g)
    want = loop_gather(src, s, dst, d)
    cuda_rows.gather(src, s, dst, d, rows_per_warp=rows_per_warp, nc=nc)
    assert torch.equal(dst, want)
    assert emulated[-1][0] == "ula_gather"


def test_emulated_gather_strided_pools(emulated):
    g = torch.Generator().manual_seed(1)
    big = rand_pool(4, 100, 1312, gen=g)
    src = big[::2, :, 656:]  # layer stride 2 layers, row stride 1312
    dst = rand_pool(2, 50, 656, gen=g)
    s, d = rand_pairs(40, 100, 50, 0.1, g)
    want = loop_gather(src, s, dst, d)
    cuda_rows.gather(src, s, dst, d, rows_per_warp=4)
    assert torch.equal(dst, want)


@pytest.mark.parametrize("row_bytes", [16, 656, 1152])
@pytest.mark.parametrize("layers", [1, 2])
def test_emulated_peer_gather(emulated, row_bytes, layers):
    g = torch.Generator().manual_seed(row_bytes * layers)
    pools = [rand_pool(layers, 60, row_bytes, gen=g) for _ in range(3)]
    dst = rand_pool(layers, 60, row_bytes, gen=g)
    s, d = rand_pairs(45, 60, 60, 0.1, g)
    rank = torch.randint(-1, 3, (45,), generator=g)
    want = dst.clone()
    rank, s, d = rank.int(), s.int(), d.int()  # a TP plan's entries
    peer_reference.gather_rows_peers(pools, rank, s, want, d)
    table = peer_reference.pool_ptr_table(pools)
    cuda_rows.gather_peers(table, rank, s, dst, d, rows_per_warp=2)
    assert torch.equal(dst, want)


@pytest.mark.parametrize("row_bytes", [16, 656, 1152, 2064])
@pytest.mark.parametrize("rows_per_warp", [None, 1, 4])
def test_emulated_swap(emulated, row_bytes, rows_per_warp):
    g = torch.Generator().manual_seed(row_bytes)
    gp, cp = rand_pool(3, 40, row_bytes, gen=g), rand_pool(3, 70, row_bytes, gen=g)
    gi = torch.randperm(40, generator=g)[:25]
    ci = torch.randperm(70, generator=g)[:25]
    gi[torch.rand(25, generator=g) < 0.2] = -1
    ci[torch.rand(25, generator=g) < 0.2] = -1
    wg, wc = loop_swap(gp, gi, cp, ci)
    cuda_rows.swap(gp, gi, cp, ci, rows_per_warp=rows_per_warp)
    assert torch.equal(gp, wg) and torch.equal(cp, wc)


@pytest.mark.parametrize("adt", [torch.int32, torch.int64])
@pytest.mark.parametrize("mdt", [torch.int32, torch.int64])
def test_emulated_translate(emulated, adt, mdt):
    g = torch.Generator().manual_seed(2)
    mapping = torch.randint(0, 10**6, (1001,), generator=g).to(mdt)
    addrs = torch.randint(-1, 1000, (3, 700), generator=g).to(adt)
    out = torch.empty(3, 700, dtype=torch.int32)
    want = torch.empty_like(out)
    reference.translate_rows(mapping, addrs, want, row_base=64)
    assert cuda_rows.translate(mapping, addrs, out, row_base=64) is out
    assert torch.equal(out, want)


# ---------------------------------------------------------------------------------------------
# the CUDA source through nvcc (syntax, registers, spills), when nvcc is installed
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("rows,vpl,nc", [(1, 1, False), (8, 2, True), (8, 3, False),
                                         (4, 4, False)])
def test_cuda_source_compiles_without_spills(tmp_path, rows, vpl, nc):
    cu = tmp_path / "k.cu"
    cu.write_text(cuda_rows.module_source(rows, vpl, nc))
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v",
                        "-o", str(tmp_path / "k.cubin"), str(cu)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # every kernel of the configurations the launchers pick must not spill
    if rows * vpl <= 12:
        assert " 0 bytes spill stores" in r.stderr and "bytes spill stores, " in r.stderr
        spills = [ln for ln in r.stderr.splitlines() if "spill stores" in ln]
        assert all(ln.strip().startswith("0 bytes stack frame, 0 bytes spill") for ln in spills)
    else:
        spills = [ln for ln in r.stderr.splitlines()
                  if "spill stores" in ln and not ln.strip().startswith("0 bytes stack")]
        # only the swap may exceed its register budget at configurations it never uses
        assert len(spills) <= 1


# ---------------------------------------------------------------------------------------------
# GPU tests
# ---------------------------------------------------------------------------------------------
def _backends() -> list[str]:
    out = []
    try:
        import cupy  # noqa: F401

        out.append("cupy")
    except Exception:
        pass
    if hasattr(torch.cuda, "_compile_kernel"):
        out.append("torch")
    return out or ["none-available"]


@pytest.fixture(params=_backends())
def backend(request, monkeypatch):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    monkeypatch.setenv("ULACACHE_KERNEL_BACKEND", request.param)
    cuda_rows.reset_backend()
    assert cuda_rows.backend_name() == request.param, f"backend {request.param} unusable"
    yield request.param
    cuda_rows.reset_backend()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _host_pool(layers, rows, row_bytes, gen):
    t = pinned.pinned_empty((layers, rows + 1, row_bytes))
    t.copy_(rand_pool(layers, rows, row_bytes, gen=gen))
    return t


@gpu
@needs_cuda
@pytest.mark.parametrize("row_bytes", ROW_SIZES)
@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("direction", ["h2d", "d2d", "d2h"])
def test_gpu_gather(backend, row_bytes, layers, direction):
    g = _gen(row_bytes + layers)
    n = 3000
    host = _host_pool(layers, 5000, row_bytes, g)
    dev = rand_pool(layers, 5000, row_bytes, "cuda", g)
    dev2 = rand_pool(layers, 4000, row_bytes, "cuda", g)
    src, dst = {"h2d": (host, dev2), "d2d": (dev, dev2), "d2h": (dev, host)}[direction]
    s, d = rand_pairs(n, src.shape[1] - 1, dst.shape[1] - 1, 0.1, g)
    want = dst.cpu().clone()
    reference.gather_rows(src.cpu(), s, want, d)
    for rpw in (None, 1, 8):
        dst_c = dst.clone() if dst.is_cuda else dst  # h2d/d2d compare the fresh copy
        cuda_rows.gather(src, s.cuda(), dst_c, d.cuda(), rows_per_warp=rpw)
        torch.cuda.synchronize()
        assert torch.equal(dst_c.cpu(), want), (direction, rpw)
    assert dispatch.uses_kernel(src, dst)


@gpu
@needs_cuda
@pytest.mark.parametrize("row_bytes", ROW_SIZES)
@pytest.mark.parametrize("layers", [1, 3])
def test_gpu_peer_gather(backend, row_bytes, layers):
    g = _gen(row_bytes * 3 + layers)
    pools = [rand_pool(layers, 2000, row_bytes, "cuda", g) for _ in range(2)]
    pools.append(_host_pool(layers, 2000, row_bytes, g))
    dst = rand_pool(layers, 2000, row_bytes, "cuda", g)
    s, d = rand_pairs(1500, 2000, 2000, 0.1, g)
    rank = torch.randint(-1, 3, (1500,), generator=g)
    want = dst.cpu()
    rank, s, d = rank.int(), s.int(), d.int()  # a TP plan's entries
    peer_reference.gather_rows_peers([p.cpu() for p in pools], rank, s, want, d)
    table = peer_reference.pool_ptr_table(pools, "cuda")
    dispatch.gather_rows_peers(table, rank.cuda(), s.cuda(), dst, d.cuda())
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), want)


@gpu
@needs_cuda
@pytest.mark.parametrize("row_bytes", ROW_SIZES)
@pytest.mark.parametrize("layers", [1, 4])
def test_gpu_swap(backend, row_bytes, layers):
    g = _gen(row_bytes + 17 * layers)
    gp = rand_pool(layers, 3000, row_bytes, "cuda", g)
    cp = _host_pool(layers, 5000, row_bytes, g)
    gi = torch.randperm(3000, generator=g)[:2500]
    ci = torch.randperm(5000, generator=g)[:2500]
    gi[torch.rand(2500, generator=g) < 0.1] = -1
    ci[torch.rand(2500, generator=g) < 0.1] = -1
    wg, wc = gp.cpu(), cp.clone()
    reference.swap_rows(wg, gi, wc, ci)
    dispatch.swap_rows(gp, gi.cuda(), cp, ci.cuda())
    torch.cuda.synchronize()
    assert torch.equal(gp.cpu(), wg) and torch.equal(cp, wc)


@gpu
@needs_cuda
@pytest.mark.parametrize("adt", [torch.int32, torch.int64])
@pytest.mark.parametrize("mdt", [torch.int32, torch.int64])
def test_gpu_translate(backend, adt, mdt):
    g = _gen(9)
    mapping = torch.randint(0, 10**6, (100_001,), generator=g).to(mdt)
    addrs = torch.randint(-1, 100_000, (64, 2048), generator=g).to(adt)
    want = torch.empty(64, 2048, dtype=torch.int32)
    reference.translate_rows(mapping, addrs, want, 64)
    out = torch.empty(64, 2048, dtype=torch.int32, device="cuda")
    assert dispatch.translate_rows(mapping.cuda(), addrs.cuda(), out, 64) is out
    assert torch.equal(out.cpu(), want)


@gpu
@needs_cuda
def test_gpu_graph_capture(backend):
    g = _gen(4)
    host = _host_pool(2, 4000, 656, g)
    dev = torch.zeros(2, 2001, 656, dtype=torch.uint8, device="cuda")
    s = torch.full((1024,), -1, dtype=torch.int64, device="cuda")
    d = torch.full((1024,), -1, dtype=torch.int64, device="cuda")
    mapping = torch.arange(4001, dtype=torch.int64, device="cuda") * 3
    out = torch.empty(8, 128, dtype=torch.int32, device="cuda")
    addrs = torch.full((8, 128), -1, dtype=torch.int64, device="cuda")
    dispatch.gather_rows(host, s, dev, d)  # compile outside the capture
    dispatch.translate_rows(mapping, addrs, out, 0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dispatch.gather_rows(host, s, dev, d)
        dispatch.translate_rows(mapping, addrs, out, 0)
    s0, d0 = rand_pairs(1024, 4000, 2000, 0.2, g)
    s.copy_(s0)
    d.copy_(d0)
    addrs.copy_(torch.randint(-1, 4000, (8, 128), generator=g))
    graph.replay()
    torch.cuda.synchronize()
    want = torch.zeros(2, 2001, 656, dtype=torch.uint8)
    reference.gather_rows(host, s0, want, d0)
    assert torch.equal(dev.cpu(), want)
    assert torch.equal(out.cpu().long(), torch.where(addrs >= 0, addrs * 3, -1).cpu())


@gpu
@needs_cuda
def test_gpu_launchers_reject(backend):
    dev = torch.zeros(2, 10, 656, dtype=torch.uint8, device="cuda")
    idx = torch.zeros(3, dtype=torch.int64, device="cuda")
    plain_host = torch.zeros(2, 10, 656, dtype=torch.uint8)
    with pytest.raises(ShapeError, match="page-locked"):
        cuda_rows.gather(plain_host, idx, dev, idx)
    with pytest.raises(ShapeError, match="on cpu"):
        cuda_rows.gather(dev.clone(), idx.cpu(), dev, idx)
    with pytest.raises(ShapeError, match="aligned"):
        big = torch.zeros(2, 10, 672, dtype=torch.uint8, device="cuda")
        cuda_rows.gather(big[:, :, 8:664], idx, dev, idx)
    with pytest.raises(ShapeError, match="int32"):
        cuda_rows.translate(torch.zeros(5, dtype=torch.int64, device="cuda"),
                            torch.zeros(2, 2, dtype=torch.int64, device="cuda"),
                            torch.zeros(2, 2, dtype=torch.int64, device="cuda"))
    # the dispatcher falls back to the reference for what the kernel cannot take
    assert not dispatch.uses_kernel(plain_host, dev)


@gpu
@needs_cuda
def test_gpu_pinned_exact_size():
    before = pinned.registered_bytes()
    t = pinned.pinned_empty((3, 1001, 656))
    nbytes = 3 * 1001 * 656
    assert t.untyped_storage().nbytes() == nbytes
    assert pinned.registered_bytes() - before == nbytes
    assert cuda_rows.is_device_readable(t)
    t.fill_(7)
    assert int(t.cuda().float().mean()) == 7
    del t
    gc.collect()
    assert pinned.registered_bytes() == before


@gpu
@needs_cuda
def test_gpu_device_view_aliases_host_memory():
    """A CUDA view of a pinned host tensor (the CPU free stacks): device writes land in host
    memory and host writes are seen by the device, no copy; the view keeps the memory alive."""
    host = pinned.pinned_empty((1001,), torch.int32)
    host.copy_(torch.arange(1001, dtype=torch.int32))
    view = pinned.device_view(host, torch.device("cuda", torch.cuda.current_device()))
    assert view.is_cuda and view.data_ptr() == host.data_ptr()
    view[::2] = -view[::2]
    torch.cuda.synchronize()
    assert int(host[10]) == -10 and int(host[11]) == 11
    host[3] = 77
    assert int(view[3].item()) == 77
    del host
    gc.collect()
    assert int(view.sum().item()) != 0  # still mapped: the view holds the host tensor
