"""Compile every fused kernel for a GPU target without a GPU (ahead-of-time check).

Triton's interpreter, which CI runs the kernels through on CPU, is permissive where the
compiler is not (scalar vs block operands, atomics' element types, constexpr globals, loop
bounds). This module records the exact launches one fused access, placement, translate, TP
gate set, round start and release would issue for a given group geometry, and compiles each of
them with ``triton.compile`` down to a cubin for ``sm_90`` (H200) and ``sm_100`` (B300) using
the ``ptxas`` bundled with Triton: no driver, no device.

    TRITON_INTERPRET=0 python -m ulacache.kernels.fused_compile [--arch 90 100]

Must run in a process where Triton was imported with the interpreter OFF (the test runs it as a
subprocess). Exit 0 when every kernel compiled; prints one line per kernel variant.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

log = logging.getLogger(__name__)

_DTYPES = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
           torch.uint8: "u8"}


def record_launches(n_layers: int = 2, gpu_slots: int = 4096, row_bytes: int = 656,
                    shape: tuple[int, int] = (8, 256)) -> list[tuple]:
    """The (kernel, args, meta) of one fused access, one placement, one translate, a
    prefetch, a deferred access and its replay (groups of two or more layers), one TP8 rank's
    own access and its gates, a round start and a release on a CPU group of this geometry,
    recorded instead of launched."""
    from ulacache.group import SelectionGroup
    from ulacache.pblru import DEFAULT_BUCKETS

    from . import fused_access as fa

    calls: list[tuple] = []

    def record(kernel, grid, *args, **meta):
        calls.append((kernel, args, meta))

    group, no_shadows = (
        SelectionGroup(list(range(n_layers)), gpu_slots * 4, gpu_slots, gpu_slots * 2,
                       row_bytes, "cpu", "pblru", DEFAULT_BUCKETS, False, access_path="torch",
                       max_call=shape[0] * shape[1], shadows=shadows) for shadows in (True, False))
    fused = fa.FusedAccess(group.tables)
    with fa.launches_recorded(record):
        addrs = torch.zeros(shape, dtype=torch.int64).view(-1)
        fused.run(addrs, place=False, out=torch.empty(addrs.shape, dtype=torch.int32))
        fa.FusedAccess(no_shadows.tables).run(  # the access without shadows is another kernel
            addrs, place=False, out=torch.empty(addrs.shape, dtype=torch.int32))
        fused.reclaim(addrs.numel())  # a placement's first launch (shadows)
        fused.run(addrs, place=True, victim_out=torch.empty(addrs.shape, dtype=torch.int64))
        fused.translate(addrs.to(torch.int32), torch.empty(addrs.shape, dtype=torch.int32))
        fused.run(addrs, place=False,  # a look-ahead prefetch (ulacache.prefetch)
                  prefetch_budget=torch.zeros((), dtype=torch.int64))
        if n_layers > 1:  # a shared group's deferred access and one layer's replay
            moves = torch.full((3, addrs.numel()), -1, dtype=torch.int32)
            fused.run(addrs, place=False, out=torch.empty(addrs.shape, dtype=torch.int32),
                      moves=moves)
            fused.replay(moves, addrs.numel(), 1)
        fused.run(addrs, place=False, out=torch.empty(addrs.shape, dtype=torch.int32),
                  stripe=(8, 3, gpu_slots * 32))  # a TP8 rank's own access
        fused.run(addrs, place=False, out=torch.empty(addrs.shape, dtype=torch.int32),
                  stripe=(8, 3, gpu_slots * 32), verdicts=False)  # a DCP rank's (stripe.py)
        from ulacache.buffer import LocalBuffer

        from .fused_tp import FusedGates

        buffer = LocalBuffer(gpu_slots * 32, gpu_slots, torch.device("cpu"))
        gates = FusedGates(buffer, gpu_slots, 3, 8, addrs.numel())
        own = torch.empty(addrs.shape, dtype=torch.int32)
        gates.claim_first(addrs)
        gates.run(addrs, torch.empty(8, addrs.numel(), dtype=torch.int32), own,
                  torch.empty(addrs.shape, dtype=torch.int32), torch.zeros(9, dtype=torch.int64),
                  torch.zeros(len(fa.COUNTER_COLUMNS), dtype=torch.int64))
        from ulacache.pblru import PBLRUArena

        from . import fused_policy
        from .fused_release import FusedRelease

        fused_policy.advance(PBLRUArena(2, gpu_slots, DEFAULT_BUCKETS))  # a round start
        FusedRelease(group.tables).run(addrs)
    return calls


GEOMETRIES = [
    dict(n_layers=2, gpu_slots=4096, row_bytes=656),  # GLM-5 FP8 rows, a shared group
    dict(n_layers=1, gpu_slots=1 << 22, row_bytes=16),  # 2^22 slots: 65 hyper blocks
]
"""Group geometries compiled by ``main``: the victim search's tile widths depend on them."""


def signature(kernel, args: tuple, meta: dict) -> tuple[dict, dict]:
    """Triton signature and constexprs of one recorded launch."""
    sig, consts = {}, {}
    values = dict(zip([p.name for p in kernel.params], args))
    values.update(meta)
    defaults = inspect.signature(kernel.fn).parameters
    for p in kernel.params:
        v = values[p.name] if p.name in values else defaults[p.name].default
        if p.is_constexpr or v is None:  # an unused optional pointer is a constexpr None
            sig[p.name] = "constexpr"
            consts[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _DTYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        else:
            sig[p.name] = "i64" if not -2**31 <= int(v) < 2**31 else "i32"
    return sig, consts


def resources(cubin: bytes) -> dict[str, int]:
    """``REG``, ``STACK``, ``SHARED``, ``LOCAL`` of a cubin (``cuobjdump`` bundled with Triton);
    empty when the tool is missing."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


COMPILE_OPTIONS = ("maxnreg", "num_warps", "num_stages")
"""Launch keywords that are compile options, not kernel parameters."""


class SpillError(RuntimeError):
    """A kernel needs stack (register spills to local memory) on a target."""


def compile_all(archs: list[int], geometries: list[dict] | None = None) -> list[str]:
    """Compile every recorded launch for each ``sm_<arch>``; returns one line per variant.
    Raises on the first kernel that does not compile, and :class:`SpillError` when one
    spills registers (a stack frame): the decode path must stay in registers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lines, seen = [], set()
    launches = [c for g in (geometries or GEOMETRIES) for c in record_launches(**g)]
    for kernel, args, meta in launches:
        sig, consts = signature(kernel, args, meta)
        key = (kernel.__name__, tuple(sorted(consts.items())))
        if key in seen:
            continue
        seen.add(key)
        for arch in archs:
            t0 = time.time()
            src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
            # compile options a launch passes (maxnreg), as the JIT would take them
            options = {k: meta[k] for k in COMPILE_OPTIONS if k in meta}
            out = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            use = resources(out.asm["cubin"])
            line = (f"sm_{arch} {kernel.__name__:<22} {dict(consts)} {options or ''}cubin "
                    f"{len(out.asm['cubin'])} B, {time.time() - t0:.1f} s, "
                    + (", ".join(f"{k} {v}" for k, v in use.items()) or "no cuobjdump"))
            if use.get("STACK") or use.get("LOCAL"):
                raise SpillError(line)
            lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 100])
    args = ap.parse_args(argv)
    from . import fused_access as fa

    if fa.triton is None:
        print("Triton is not installed", file=sys.stderr)
        return 2
    if fa.INTERPRETED or os.environ.get("TRITON_INTERPRET") == "1":
        print("run with TRITON_INTERPRET=0: the kernels were decorated for the interpreter",
              file=sys.stderr)
        return 2
    for line in compile_all(args.arch):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
