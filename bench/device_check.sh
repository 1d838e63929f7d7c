#!/usr/bin/env bash
# Device check: every GPU test and the bandwidth bench, in under 6 minutes on one H200.
#
#   bash bench/device_check.sh LOGDIR
#
# 1. pytest -m gpu (all GPU-marked tests: each kernel vs its reference per compile backend, the
#    decode graph, the prefetch path captured and sync-free, stream order, CUDA IPC peers, TP
#    mode in two processes on one GPU, DeepGEMM's paged MQA logits over striped index-K's
#    per-rank tables),
# 2. bench/bandwidth.py --json --sweep (ceilings and every kernel at 656/1152 B x 2K/16K/131K,
#    and the duplex factor (H2D + D2H) / swap that bench/decode_sweep.py --duplex-factor takes),
# 3. bench/access_bench.py --quick (fused access vs the torch path: launches, identical
#    results, time ratio, access / data-movement; graph-captured),
# 4. bench/prefetch_overlap.py --quick (the prefetch stream's copies against an attention-sized
#    kernel on the forward stream, as a ratio to the serial time; plain pinned H2D copies of the
#    same bytes as the control),
# 5. bench/hisparse_head_to_head.py --quick (when SGLang's kernel sources are carried; its
#    ulacache side runs the fused path, the default on CUDA),
# 6. bench/decode_sweep.py --real-rows (concurrency 64 and 128, 16 steps: one layer of real
#    FP8 rows per step through ulacache's fused access, HiSparse's data movement and a torch
#    sparse-MLA stand-in, timed; measured peak ratios),
# 7. a short summary table (bench/device_summary.py), printed last, with the targets marked; a
#    bench that could not run is "not measured" with its own one-line reason, never rc=0.
# Full logs go to LOGDIR: pytest_gpu.log, bandwidth.json, bandwidth.log, access.json,
# access.log, prefetch_overlap.json, prefetch_overlap.log, hisparse_h2h.json, decode_sweep/
# (csv, md, json), summary.txt.
# Exit code: 0 when tests pass and the bench ran (targets are reported, not enforced),
# 1 on a test failure (or a bench that found its own result invalid: access, prefetch_overlap),
# 2 when the bench could not run.
# Environment: PYTHON (default python3), PYTEST_TIMEOUT (default 200 s), BENCH_TIMEOUT (110 s),
# ACCESS_TIMEOUT (60 s), PREFETCH_TIMEOUT (45 s), H2H_TIMEOUT (80 s), SWEEP_TIMEOUT (90 s).
# Typical runs are well inside 6 minutes; the worst case (every step at its timeout) is 585 s.
#
# The lent H200's image has torch, Triton, CuPy, prometheus_client and hypothesis but not
# msgspec (the core's config library). Carry its wheel (docs/benchmarks.md, "Device check"):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 -d .whl msgspec==0.23.0
# and name .whl in the run's carry; this script installs what it finds there.
set -uo pipefail

usage() { echo "usage: bash bench/device_check.sh LOGDIR   (every GPU test and bench; logs and summary.txt in LOGDIR)"; }
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    "") usage >&2; exit 2 ;;
    -*) echo "device_check: unknown option $1" >&2; usage >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then echo "device_check: one LOGDIR, got $#" >&2; usage >&2; exit 2; fi
LOGDIR=$1
mkdir -p "$LOGDIR" || exit 2
LOGDIR=$(cd "$LOGDIR" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
PY=${PYTHON:-python3}
T0=$(date +%s)

# Wheels carried to a machine without a registry (see the header).
if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ulacache-site "$REPO"/.whl/*.whl && \
        export PYTHONPATH="/tmp/ulacache-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import msgspec, prometheus_client" >/dev/null 2>&1; then
    echo "device_check: msgspec or prometheus_client missing; carry their wheels in .whl/" >&2
    exit 2
fi

# Make `import ulacache.kernels` work without installing: the package maps
# ulacache.kernels -> kernels/ and ulacache.patches -> patches/ (pyproject package-dir).
if ! "$PY" -c "import ulacache.kernels.cuda_rows" >/dev/null 2>&1; then
    SHIM=$(mktemp -d)
    mkdir -p "$SHIM/ulacache"
    for f in "$REPO"/ulacache/*; do ln -s "$f" "$SHIM/ulacache/$(basename "$f")"; done
    ln -sfn "$REPO/kernels" "$SHIM/ulacache/kernels"
    [ -d "$REPO/patches" ] && ln -sfn "$REPO/patches" "$SHIM/ulacache/patches"
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    echo "== device_check $(date -u +%FT%TZ) in $REPO"
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
        --format=csv 2>&1 || true
    "$PY" - <<'EOF' 2>&1
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import cupy
    print("cupy", cupy.__version__)
except Exception as e:
    print("cupy unavailable:", e)
EOF
} > "$LOGDIR/env.log" 2>&1
cat "$LOGDIR/env.log"

echo "== pytest -m gpu"
timeout "${PYTEST_TIMEOUT:-200}" "$PY" -m pytest -m gpu -q -p no:cacheprovider -rfEs \
    --junitxml="$LOGDIR/pytest_gpu.xml" > "$LOGDIR/pytest_gpu.log" 2>&1
PYTEST_RC=$?
tail -n 5 "$LOGDIR/pytest_gpu.log"

echo "== bench/bandwidth.py --json --sweep"
timeout "${BENCH_TIMEOUT:-110}" "$PY" bench/bandwidth.py --json --sweep \
    > "$LOGDIR/bandwidth.json" 2> "$LOGDIR/bandwidth.log"
BENCH_RC=$?
tail -n 3 "$LOGDIR/bandwidth.log"

# The fused access path (issue 10): launches per group-step, identical to the torch path,
# per-step time ratio and access / pure data movement, pools 2^16 and 2^20 (the full grid is
# `python bench/access_bench.py`). HiSparse is timed by the head-to-head below.
echo "== bench/access_bench.py --quick --json"
timeout "${ACCESS_TIMEOUT:-60}" "$PY" bench/access_bench.py --quick --pools 16,20 \
    --no-hisparse --json > "$LOGDIR/access.json" 2> "$LOGDIR/access.log"
ACCESS_RC=$?
tail -n 12 "$LOGDIR/access.log"

# The look-ahead prefetch (ulacache/prefetch.py) under real overlap: the engine's side stream
# (the group's fused prefetch, 4096 FP8 rows per group) against an attention-sized bmm on the
# forward stream, alone and together, as a ratio to the serial time; plain torch H2D copies of
# the same bytes on a side stream are the control. Exits 2 with one line where it cannot run.
echo "== bench/prefetch_overlap.py --quick --json"
timeout "${PREFETCH_TIMEOUT:-45}" "$PY" bench/prefetch_overlap.py --quick --json \
    > "$LOGDIR/prefetch_overlap.json" 2> "$LOGDIR/prefetch_overlap.log"
PREFETCH_RC=$?
tail -n 8 "$LOGDIR/prefetch_overlap.log"

# HiSparse's own swap-in kernel vs ulacache's access on identical selections (issue 11): runs
# when the sglang and apache-tvm-ffi wheels are carried in .whl-hisparse/ (see the script's
# header); otherwise it says why in one line and exits 2 ("not measured" in the summary). Its
# runtime is not measured yet.
echo "== bench/hisparse_head_to_head.py --quick --json"
timeout "${H2H_TIMEOUT:-80}" "$PY" bench/hisparse_head_to_head.py --quick --json \
    > "$LOGDIR/hisparse_h2h.json" 2> "$LOGDIR/hisparse_h2h.log"
H2H_RC=$?
tail -n 25 "$LOGDIR/hisparse_h2h.log"

# The decode sweep with real rows (issue 11): the CPU default's best tunings (HiSparse H=4096
# x=4, ulacache c=1, docs/results.md) at full size, two levels around HiSparse's admission cap,
# a few steps each; the full sweep is `python bench/decode_sweep.py` (tuning, 3 seeds).
echo "== bench/decode_sweep.py --real-rows --scale 1 --levels 64,128 --steps 16"
timeout "${SWEEP_TIMEOUT:-90}" "$PY" bench/decode_sweep.py --real-rows --scale 1 --seeds 1 \
    --hs-buffers 4096 --hs-ratios 4 --ula-ratios 1 --wb-ratios 1 --levels 64,128 --steps 16 \
    --warmup 4 \
    --no-png --quiet --json --out "$LOGDIR/decode_sweep" \
    > "$LOGDIR/decode_sweep.json" 2> "$LOGDIR/decode_sweep.log"
SWEEP_RC=$?
tail -n 8 "$LOGDIR/decode_sweep.log"

"$PY" bench/device_summary.py "$LOGDIR" "$T0" pytest="$PYTEST_RC" bandwidth="$BENCH_RC" \
    access="$ACCESS_RC" prefetch_overlap="$PREFETCH_RC" hisparse_h2h="$H2H_RC" \
    decode_sweep="$SWEEP_RC" | tee "$LOGDIR/summary.txt"

if [ "$PYTEST_RC" -ne 0 ] || [ "$ACCESS_RC" -eq 1 ] || [ "$PREFETCH_RC" -eq 1 ]; then exit 1; fi
if [ "$BENCH_RC" -ne 0 ]; then exit 2; fi
exit 0
