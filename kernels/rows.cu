// UlaCache row-movement kernels: gather (ula_gather, ula_gather_peer), promotion swap
// (ula_swap) and logical -> physical translation (ula_translate_a{32,64}_m{32,64}).
//
// This file is CUDA C++ source loaded as text by kernels/cuda_rows.py (CUDA_SOURCE) and
// compiled at first use with NVRTC (CuPy RawModule or torch's NVRTC wrapper), one module per
// (ROWS, VPL, ULA_NC). cuda_rows.module_source() prepends the compile-time constants
//     #define ROWS <rows per warp>     (1, 2, 4 or 8)
//     #define VPL <16-byte vectors per lane per row, held in registers>   (1..4)
//     #define ULA_NC <0|1>             (gather loads: 0 plain, 1 __ldg non-coherent)
// to this text; the #ifndef defaults below only apply when the file is compiled on its own.
// Rows longer than 32 * VPL chunks are still correct: the tail is copied by a load/store loop.
//
// Constraints, keep them when editing:
// - NVRTC-compatible: no #include, only builtins NVRTC provides (uint4, __ldg, threadIdx, ...).
// - Also compilable as host C++17: tests/test_kernels.py compiles this exact text with a small
//   shim (uint4, threadIdx, __global__ ...) and runs the kernels serially on the CPU against
//   the pure-torch references. Kernel names and argument lists must match the launchers and
//   KERNEL_NAMES in cuda_rows.py.

#ifndef ROWS
#define ROWS 4
#endif
#ifndef VPL
#define VPL 2
#endif
#ifndef ULA_NC
#define ULA_NC 0
#endif
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned char u8;

// Gather source loads. Plain (coherent) loads keep every load of a warp ahead of its stores in
// the final code (ptxas may sink non-coherent ld.global.nc loads below stores to save registers:
// 88 instead of 112 registers at ROWS=8, VPL=3, fewer bytes in flight). ULA_NC=1 selects __ldg.
__device__ __forceinline__ uint4 ula_ld_nc(const u8* p) {
#if ULA_NC
    return __ldg(reinterpret_cast<const uint4*>(p));
#else
    return *reinterpret_cast<const uint4*>(p);
#endif
}
__device__ __forceinline__ uint4 ula_ld(const u8* p) {
    return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void ula_st(u8* p, uint4 v) {
    *reinterpret_cast<uint4*>(p) = v;
}

// Gather body. PEER: the source base is src_table[src_rank[i]] (rank < 0 = skip). Index is
// the element type of the index arrays (i64, or int for the TP plans: 4 B an entry per group).
template <bool PEER, typename Index>
__device__ __forceinline__ void ula_gather_body(
    const u8* __restrict__ src, const u64* __restrict__ src_table,
    const Index* __restrict__ src_rank, i64 src_layer_stride, i64 src_row_stride,
    const Index* __restrict__ src_idx,
    u8* __restrict__ dst, i64 dst_layer_stride, i64 dst_row_stride,
    const Index* __restrict__ dst_idx,
    i64 n, i64 pairs, int chunks)
{
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const i64 first = warp * ROWS;
    if (first >= pairs) return;
    const u8* sp[ROWS];
    u8* dp[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        sp[r] = 0;
        dp[r] = 0;
        const i64 p = first + r;
        if (p < pairs) {
            const i64 l = p / n;
            const i64 i = p - l * n;
            const i64 s = src_idx[i];
            const i64 d = dst_idx[i];
            const u8* base = src;
            bool ok = s >= 0 && d >= 0;
            if (PEER) {
                const i64 rk = src_rank[i];
                ok = ok && rk >= 0;
                base = ok ? reinterpret_cast<const u8*>(src_table[rk]) : (const u8*)0;
            }
            if (ok) {
                sp[r] = base + l * src_layer_stride + s * src_row_stride;
                dp[r] = dst + l * dst_layer_stride + d * dst_row_stride;
            }
        }
    }
    uint4 buf[ROWS][VPL];
    // Issue every load of this warp first ...
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = lane + 32 * v;
            if (sp[r] != 0 && c < chunks) buf[r][v] = ula_ld_nc(sp[r] + 16 * (i64)c);
        }
    }
    // ... then every store.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = lane + 32 * v;
            if (sp[r] != 0 && c < chunks) ula_st(dp[r] + 16 * (i64)c, buf[r][v]);
        }
    }
    // Tail of rows longer than 32 * VPL chunks (rows over 2048 bytes).
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (sp[r] == 0) continue;
        for (int c = lane + 32 * VPL; c < chunks; c += 32)
            ula_st(dp[r] + 16 * (i64)c, ula_ld_nc(sp[r] + 16 * (i64)c));
    }
}

extern "C" __global__ void ula_gather(
    const u8* __restrict__ src, i64 src_layer_stride, i64 src_row_stride,
    const i64* __restrict__ src_idx,
    u8* __restrict__ dst, i64 dst_layer_stride, i64 dst_row_stride,
    const i64* __restrict__ dst_idx, i64 n, i64 pairs, int chunks)
{
    ula_gather_body<false, i64>(src, (const u64*)0, (const i64*)0, src_layer_stride,
                                src_row_stride, src_idx, dst, dst_layer_stride,
                                dst_row_stride, dst_idx, n, pairs, chunks);
}

extern "C" __global__ void ula_gather_peer(
    const u64* __restrict__ src_table, const int* __restrict__ src_rank,
    i64 src_layer_stride, i64 src_row_stride, const int* __restrict__ src_idx,
    u8* __restrict__ dst, i64 dst_layer_stride, i64 dst_row_stride,
    const int* __restrict__ dst_idx, i64 n, i64 pairs, int chunks)
{
    ula_gather_body<true, int>((const u8*)0, src_table, src_rank, src_layer_stride,
                               src_row_stride, src_idx, dst, dst_layer_stride,
                               dst_row_stride, dst_idx, n, pairs, chunks);
}

// Promotion swap: gpu row g <-> cpu row c, per layer. Plain (coherent) loads: the kernel
// writes the same rows it reads; each lane reads both of its chunks before writing either.
extern "C" __global__ void ula_swap(
    u8* gpu, i64 gpu_layer_stride, i64 gpu_row_stride, const i64* __restrict__ gpu_idx,
    u8* cpu, i64 cpu_layer_stride, i64 cpu_row_stride, const i64* __restrict__ cpu_idx,
    i64 n, i64 pairs, int chunks)
{
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const i64 first = warp * ROWS;
    if (first >= pairs) return;
    u8* gp[ROWS];
    u8* cp[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        gp[r] = 0;
        cp[r] = 0;
        const i64 p = first + r;
        if (p < pairs) {
            const i64 l = p / n;
            const i64 i = p - l * n;
            const i64 g = gpu_idx[i];
            const i64 c = cpu_idx[i];
            if (g >= 0 && c >= 0) {
                gp[r] = gpu + l * gpu_layer_stride + g * gpu_row_stride;
                cp[r] = cpu + l * cpu_layer_stride + c * cpu_row_stride;
            }
        }
    }
    uint4 bg[ROWS][VPL];
    uint4 bc[ROWS][VPL];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = lane + 32 * v;
            if (gp[r] != 0 && c < chunks) {
                bc[r][v] = ula_ld(cp[r] + 16 * (i64)c);
                bg[r][v] = ula_ld(gp[r] + 16 * (i64)c);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int v = 0; v < VPL; ++v) {
            const int c = lane + 32 * v;
            if (gp[r] != 0 && c < chunks) {
                ula_st(gp[r] + 16 * (i64)c, bc[r][v]);
                ula_st(cp[r] + 16 * (i64)c, bg[r][v]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (gp[r] == 0) continue;
        for (int c = lane + 32 * VPL; c < chunks; c += 32) {
            const uint4 a = ula_ld(cp[r] + 16 * (i64)c);
            const uint4 b = ula_ld(gp[r] + 16 * (i64)c);
            ula_st(gp[r] + 16 * (i64)c, a);
            ula_st(cp[r] + 16 * (i64)c, b);
        }
    }
}

// Logical -> physical translation, -1 preserved. Grid-stride over the flattened [bs, k].
template <typename A, typename M>
__device__ __forceinline__ void ula_translate_body(
    const A* __restrict__ addrs, const M* __restrict__ mapping, int* __restrict__ out,
    i64 count, i64 row_base)
{
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += step) {
        const i64 a = (i64)addrs[i];
        out[i] = a >= 0 ? (int)((i64)mapping[a] + row_base) : -1;
    }
}

#define ULA_TRANSLATE(NAME, A, M)                                                         \
    extern "C" __global__ void NAME(const A* __restrict__ addrs,                          \
                                    const M* __restrict__ mapping, int* __restrict__ out, \
                                    i64 count, i64 row_base) {                            \
        ula_translate_body<A, M>(addrs, mapping, out, count, row_base);                   \
    }
ULA_TRANSLATE(ula_translate_a32_m32, int, int)
ULA_TRANSLATE(ula_translate_a32_m64, int, i64)
ULA_TRANSLATE(ula_translate_a64_m32, i64, int)
ULA_TRANSLATE(ula_translate_a64_m64, i64, i64)
