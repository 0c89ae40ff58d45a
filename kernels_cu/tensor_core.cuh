// Tensor-core vocabulary shared by the fp16/bf16 kernels (forward_tc.cu, backward_tc.cu), sm_80+:
// mma.sync.m16n8k16 with fp32 accumulation, ldmatrix fragment loads, 16-byte cp.async tile loads.

#pragma once
#include "common.cuh"

template <typename T> struct Mma;
// Mma<T>: two floats packed into a pair of T, and D += A B by mma.sync.m16n8k16 with fp32 accumulation.
#define FA_MMA_OF(T, PTX_TYPE)                                                                          \
    template <> struct Mma<T> {                                                                          \
        static __device__ __forceinline__ unsigned int pack(float lo, float hi) {                        \
            unsigned int r;                                                                              \
            asm("cvt.rn." PTX_TYPE "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                   \
            return r;                                                                                    \
        }                                                                                                \
        static __device__ __forceinline__ void mma(float* d, const unsigned int* a, const unsigned int* b) { \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE                  \
                         ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                    \
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));            \
        }                                                                                                \
    };
FA_MMA_OF(fa_f16, "f16")
FA_MMA_OF(fa_bf16, "bf16")
#undef FA_MMA_OF

// D0 += A B0 and D1 += A B1 for two 8-column n-tiles whose B fragments one ldmatrix_x4 loads
// (b: {b0, b1} of the first, then of the second).
template <typename T>
__device__ __forceinline__ void mma_two_tiles(float* d0, float* d1, const unsigned int* a, const unsigned int* b) {
    Mma<T>::mma(d0, a, b);
    Mma<T>::mma(d1, a, b + 2);
}

__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}
// Addresses are 32-bit shared-window addresses: a per-lane base plus a compile-time offset,
// which ptxas folds into the instruction's immediate instead of keeping one register per tile.
__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* r, unsigned int addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// 16-byte global -> shared copy; with valid = false it writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(unsigned int dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// The same for data read once (a decode's K/V stream), marked evict-first in L2 so that it does not
// push out what is read again soon (the split partials, the kernels' code).
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
__device__ __forceinline__ void cp_async_16_once(unsigned int dst, const void* src, bool valid, unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0), "l"(policy));
}
// 4-byte copy (the bias tile: any strides); with valid = false it writes zero.
__device__ __forceinline__ void cp_async_4(unsigned int dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Wait until at most PENDING of this thread's committed groups are still in flight.
template <int PENDING = 0>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory"); }

// Start copying a (ROWS x D_TILE) tile of T into shared memory (pitch LD elements); rows at or
// past rows_valid and columns at or past head_dim become zeros.
template <typename T, int ROWS, int D_TILE, int LD, int THREADS>
__device__ __forceinline__ void async_load_tile(T* tile, const T* base, long long row_stride, int rows_valid, int head_dim) {
    constexpr int CHUNKS = D_TILE / 8;   // 16-byte chunks per row
    // Each thread keeps one column and bumps one pointer by ROWS_PER_PASS rows (when CHUNKS does
    // not divide THREADS, the last THREADS % CHUNKS threads idle). Letting the compiler precompute
    // every pass's 64-bit offset held 2 registers per pass across the whole K/V loop: the forward
    // ran 12% faster without them (H100, bf16, d=64 and 128), and the backward stopped spilling.
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
    static_assert(ROWS_PER_PASS >= 1, "too few threads for one row");
    if (THREADS % CHUNKS != 0 && threadIdx.x >= ROWS_PER_PASS * CHUNKS) return;
    const int c = (threadIdx.x % CHUNKS) * 8;
    int r = threadIdx.x / CHUNKS;
    const T* src = base + r * row_stride + c;
    const long long step = ROWS_PER_PASS * row_stride;
    const unsigned int dst = smem_addr(tile + r * LD + c);
#pragma unroll
    for (int pass = 0; pass < (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++pass, r += ROWS_PER_PASS, src += step) {
        if (ROWS % ROWS_PER_PASS == 0 || r < ROWS) {
            const bool valid = r < rows_valid && c < head_dim;
            cp_async_16(dst + 2u * pass * ROWS_PER_PASS * LD, valid ? src : base, valid);
        }
    }
}

// async_load_tile from a paged cache: row r is key first + r, at row (first + r) % page size of page
// pages[(first + r) >> page_shift], where base points at page 0's first row (the head's column 0).
// Each row asks for its own page, so any page size serves (flash_decode's, from 16 keys).
template <typename T, int ROWS, int D_TILE, int LD, int THREADS>
__device__ __forceinline__ void async_load_paged_tile(T* tile, const T* base, const int* pages, int page_shift,
                                                      long long page_stride, long long row_stride, int first,
                                                      int rows_valid, int head_dim) {
    constexpr int CHUNKS = D_TILE / 8;   // 16-byte chunks per row
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
    static_assert(ROWS_PER_PASS >= 1, "too few threads for one row");
    if (THREADS % CHUNKS != 0 && threadIdx.x >= ROWS_PER_PASS * CHUNKS) return;
    const int c = (threadIdx.x % CHUNKS) * 8;
    const int r0 = threadIdx.x / CHUNKS;
    const int in_page = (1 << page_shift) - 1;
    const unsigned int dst = smem_addr(tile + r0 * LD + c);
#pragma unroll
    for (int pass = 0; pass < (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++pass) {
        const int r = r0 + pass * ROWS_PER_PASS;
        if (ROWS % ROWS_PER_PASS == 0 || r < ROWS) {
            const bool valid = r < rows_valid && c < head_dim;
            const int key = first + r;
            const T* src = valid ? base + pages[key >> page_shift] * page_stride + (long long)(key & in_page) * row_stride + c
                                 : base;
            cp_async_16(dst + 2u * pass * ROWS_PER_PASS * LD, src, valid);
        }
    }
}

// Store rows [0, rows_valid) and columns [0, head_dim) of a (ROWS x D_TILE) shared-memory tile
// (pitch LD elements) to global memory in 16-byte vectors, consecutive threads taking consecutive
// chunks of a row (the epilogues stage their register results this way for coalesced stores).
template <typename T, int ROWS, int D_TILE, int LD, int THREADS>
__device__ __forceinline__ void store_staged_tile(T* base, long long row_stride, const T* tile, int rows_valid, int head_dim) {
    constexpr int CHUNKS = D_TILE / 8;
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS;
        const int c = (idx % CHUNKS) * 8;
        if (r < rows_valid && c < head_dim)
            *reinterpret_cast<uint4*>(base + r * row_stride + c) = *reinterpret_cast<const uint4*>(tile + r * LD + c);
    }
}

// Lane addresses for ldmatrix.x4 (byte offsets into a tile of 2-byte elements with pitch LD).
// Fragments of mma.m16n8k16 (PTX ISA; lane = 4g + t): A (16x16, m x k) regs hold rows g / g+8 and
// columns 2t, 2t+1 / +8; B (16x8, k x n) regs hold k = 2t, 2t+1 / +8 and column g.
//   a_frag:       A from a tile stored [m][k] (row-major A).
//   a_frag_trans: A from a tile stored [k][m] (the transpose), with .trans.
//   b_frags:      B of two adjacent n-tiles from a tile stored [n][k], {b0, b1, b0', b1'}.
//   b_frags_trans: the same from a tile stored [k][n], with .trans.
// Each returns the offset of the fragment at (row 0, column 0) of the stored tile; add the
// fragment's position as 2 * (row * LD + column) bytes (compile-time constants in the loops).
template <int LD> __device__ __forceinline__ unsigned int a_frag_lane(int lane) {
    return 2u * (((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4));
}
template <int LD> __device__ __forceinline__ unsigned int a_frag_trans_lane(int lane) {
    return 2u * (((lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1));
}
template <int LD> __device__ __forceinline__ unsigned int b_frags_lane(int lane) {
    return 2u * (((lane & 7) + 8 * (lane >> 4)) * LD + 8 * ((lane >> 3) & 1));
}
template <int LD> __device__ __forceinline__ unsigned int b_frags_trans_lane(int lane) {
    return 2u * (((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4));
}
