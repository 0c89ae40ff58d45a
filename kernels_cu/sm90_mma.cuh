// Warpgroup MMA on Hopper (sm_90a): wgmma.mma_async's ordering instructions, the 128-byte-swizzled
// shared-memory tiles its operands are read from, and their matrix descriptors.
// The instructions themselves (one per element type and N) are in sm90_wgmma_ops.cuh.
//
// A warpgroup (4 consecutive warps, the first a multiple of 4) issues each wgmma together. Its
// float32 accumulator (m64nN) is laid out per warp as mma.m16n8's C fragment: warp w of the group
// holds rows 16w + g and 16w + g + 8 (lane = 4g + t), and register 4i + e holds row
// 16w + g + 8 * (e >> 1), column 8i + 2t + (e & 1). A from registers is mma.m16n8k16's A fragment.

#pragma once
#include "common.cuh"
#include "tensor_core.cuh"

// ---- the accumulator's layout -----------------------------------------------------------------
// Register j of a thread's accumulator: which of its two rows (0: 16w + g, 1: 16w + g + 8), and
// its row and column offsets from the thread's first element (row 16w + g, column 2t).
__device__ __forceinline__ constexpr int accumulator_half(int j) { return (j >> 1) & 1; }
__device__ __forceinline__ constexpr int accumulator_row(int j) { return 8 * accumulator_half(j); }
__device__ __forceinline__ constexpr int accumulator_col(int j) { return 8 * (j >> 2) + (j & 1); }

// ---- ordering --------------------------------------------------------------------------------
// warpgroup_arrive: the registers (accumulators, A fragments) written by ordinary instructions
// before it are what the following wgmma's read. commit closes a group of issued wgmma's;
// wait<N> returns once at most N groups are still running.
__device__ __forceinline__ void warpgroup_arrive() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void warpgroup_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void warpgroup_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }

// The compiler sees a wgmma as an asm statement that writes its accumulators at once; the hardware
// writes them when the group completes. Passing the registers through an empty volatile asm after
// warpgroup_wait (and before an issue) keeps the compiler from moving their reads and writes
// across it.
template <int N>
__device__ __forceinline__ void hold_registers(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}

// An accumulator's rows scaled: the thread's first row (16w + g) by rescale.x, its second by
// rescale.y (the online softmax's O when a row's maximum moves).
template <int N>
__device__ __forceinline__ void rescale_rows(float (&o)[N], float2 rescale) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        o[4 * i + 0] *= rescale.x;
        o[4 * i + 1] *= rescale.x;
        o[4 * i + 2] *= rescale.y;
        o[4 * i + 3] *= rescale.y;
    }
}

// ---- 128-byte-swizzled tiles -----------------------------------------------------------------
// A tile of 16-bit elements with head_dim (or any 64-element-wide dimension) contiguous is kept
// as CHUNKS blocks of [rows][64 elements]: each row is 128 bytes, and inside every 1024-byte atom
// of 8 rows the 16-byte unit u of row r sits at unit u ^ (r % 8). This is what a TMA load with
// CU_TENSOR_MAP_SWIZZLE_128B writes (a box of 64 elements x rows), and what a descriptor with
// swizzle mode "128B" reads. Ordinary accesses of 16 bytes by 8 consecutive rows hit 8 distinct
// bank groups. Blocks start on 1024-byte boundaries.
constexpr int SWIZZLE_ROW_ELEMENTS = 64;   // 128 bytes of a 16-bit type
constexpr int SWIZZLE_ATOM_BYTES = 1024;

// What the element type changes: a swizzled row holds 64 16-bit or 128 8-bit elements, and one
// wgmma's K is 32 bytes of either (k16, or k32 for e4m3), so a tile's byte geometry and its
// descriptors' steps are the same for both. The FP8 forward writes its O in bfloat16.
template <typename T> struct Sm90Element {
    static constexpr int row_elements = 128 / sizeof(T);
    static constexpr int mma_k = 32 / sizeof(T);
    using output = T;
};
template <> struct Sm90Element<fa_e4m3> {
    static constexpr int row_elements = 128;
    static constexpr int mma_k = 32;
    using output = fa_bf16;
};

// The rows of K-major operands tiled by head dim (Q and K for S = Q K^T): 128-byte swizzled rows,
// or where the head-dim tile is shorter (e4m3 at d <= 64) one 64-byte row, 64-byte swizzled
// (k_major_descriptor_64b's layout; the TMA map's box and swizzle match: cupy_flash/forward_fp8.py).
template <typename T, int D_TILE>
constexpr int operand_row_elements = D_TILE < Sm90Element<T>::row_elements ? D_TILE : Sm90Element<T>::row_elements;

// The block's storage at the first SWIZZLE_ATOM_BYTES boundary of dynamic shared memory. The
// offset is added to the __shared__ array's pointer, not to an integer, so the compiler still knows
// the storage is shared and its plain C++ accesses compile to ld/st.shared (LDS/STS). Through an
// integer cast they were generic (LD.E/ST.E): the backward's dQ staging stores then waited on the
// long scoreboard at the proxy fence after them (ncu, d = 128 8k: 9% of the consumers' samples).
template <typename Storage>
__device__ __forceinline__ Storage& aligned_shared_storage(unsigned char* raw) {
    const unsigned int misalignment = (unsigned int)__cvta_generic_to_shared(raw) & (SWIZZLE_ATOM_BYTES - 1);
    return *reinterpret_cast<Storage*>(raw + ((SWIZZLE_ATOM_BYTES - misalignment) & (SWIZZLE_ATOM_BYTES - 1)));
}

// Byte offset of element (row, col) of a [rows][64] swizzled block (col < 64, 16-bit elements).
__device__ __forceinline__ unsigned int swizzled_offset(int row, int col) {
    const unsigned int unit = (unsigned int)(col >> 3) ^ (unsigned int)(row & 7);
    return (unsigned int)row * 128u + unit * 16u + (unsigned int)(col & 7) * 2u;
}

// ---- matrix descriptors (PTX ISA, "Matrix Descriptor Format") ----------------------------------
// bits 0-13: start address >> 4; 16-29: leading-dimension byte offset >> 4; 32-45: stride-
// dimension byte offset >> 4; 62-63: swizzle mode (1 = 128B). The start address may step inside
// a swizzled row (the hardware applies the XOR to the full address, hence the 1024-byte alignment).
__device__ __forceinline__ unsigned long long smem_descriptor(unsigned int addr, unsigned int leading_bytes,
                                                              unsigned int stride_bytes, unsigned long long swizzle = 1) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)((leading_bytes >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)((stride_bytes >> 4) & 0x3FFFu) << 32) | (swizzle << 62);
}
// K-major operand (the reduction dimension contiguous: Q and K for S = Q K^T): 8-row atoms
// SWIZZLE_ATOM_BYTES apart; a k16 step is 32 bytes along the row, the next 64-column chunk the
// next block. The leading offset is unused with this swizzle (1 by convention).
__device__ __forceinline__ unsigned long long k_major_descriptor(unsigned int addr) {
    return smem_descriptor(addr, 16, SWIZZLE_ATOM_BYTES);
}
// K-major operand in 64-byte rows with 64-byte swizzle (mode 2: 8-row atoms of 512 bytes): the FP8
// forward's V^T where a key block is not whole 128-key rows.
__device__ __forceinline__ unsigned long long k_major_descriptor_64b(unsigned int addr) {
    return smem_descriptor(addr, 16, 512, 2);
}
// N-major operand (B read with TRANS_B = 1: V for O += P V, keys x head_dim with head_dim
// contiguous): along N, 64-element chunks are `chunk_bytes` apart (the leading offset); along K,
// 8-key atoms are SWIZZLE_ATOM_BYTES apart (the stride offset); a k16 step is 2 atoms.
__device__ __forceinline__ unsigned long long n_major_descriptor(unsigned int addr, unsigned int chunk_bytes) {
    return smem_descriptor(addr, chunk_bytes, SWIZZLE_ATOM_BYTES);
}

// `desc` with its start address moved by `bytes` (a multiple of 16): the address field is the low
// 14 bits and shared addresses stay below 2^18, so the sum never carries out of it. One add per
// product in place of the five instructions that build a descriptor from an address (they ran
// inside a consumer's issue turn, 12-16 products a key block).
__device__ __forceinline__ unsigned long long advance_descriptor(unsigned long long desc, unsigned int bytes) {
    return desc + (bytes >> 4);
}

template <typename T, int N> struct Wgmma;   // sm90_wgmma_ops.cuh

// d (64 x N) = A B^T with A (64 rows) and B (N rows) both K-major over K = D_TILE, stored as
// 128-byte-row chunks `a_chunk_bytes` / `b_chunk_bytes` apart (S = Q K^T in the forward, S^T = K Q^T
// and dP^T = V dO^T in the backward). Issues the products only: between warpgroup_arrive and
// warpgroup_commit. ADVANCE: the two descriptors built once and advanced per product (the
// backward: d = 256 +3.5%, d = 64 / 128 unchanged), else built per product (the forward: advanced,
// d = 64 measured 0.95-0.98x on all 16 shapes, bf16 and fp16, 1k-16k, interleaved A B B A twice;
// d = 128 / 256 0.95-1.02x).
// ROW_BYTES: the operands' rows, 128 bytes (k_major_descriptor) or 64 (k_major_descriptor_64b:
// operand_row_elements' short tile).
template <typename T, int N, int D_TILE, bool ADVANCE = true, int ROW_BYTES = 128>
__device__ __forceinline__ void mma_k_major(float (&d)[N / 2], unsigned int a, unsigned int a_chunk_bytes, unsigned int b,
                                            unsigned int b_chunk_bytes) {
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "128- or 64-byte rows");
    constexpr int STEPS = ROW_BYTES / 32;   // 32-byte K steps inside a row
    auto descriptor = [](unsigned int addr) {
        return ROW_BYTES == 128 ? k_major_descriptor(addr) : k_major_descriptor_64b(addr);
    };
    const unsigned long long a_desc = descriptor(a), b_desc = descriptor(b);
#pragma unroll
    for (int kk = 0; kk < D_TILE / Sm90Element<T>::mma_k; ++kk) {
        const unsigned int a_step = (kk / STEPS) * a_chunk_bytes + (kk % STEPS) * 32;
        const unsigned int b_step = (kk / STEPS) * b_chunk_bytes + (kk % STEPS) * 32;
        if constexpr (ADVANCE)
            Wgmma<T, N>::template ss<0>(d, advance_descriptor(a_desc, a_step), advance_descriptor(b_desc, b_step), kk > 0);
        else
            Wgmma<T, N>::template ss<0>(d, descriptor(a + a_step), descriptor(b + b_step), kk > 0);
    }
}

// Four 8 x 8 tiles of 16-bit elements (mma fragments: a thread's register holds row lane / 4,
// columns 2 (lane % 4) + 0, 1) stored as they are held: tile i's row r (8 contiguous elements) at
// the shared address lane 8i + r gives.
__device__ __forceinline__ void stmatrix_x4(unsigned int addr, const unsigned int (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
// The same tiles stored transposed: tile i's row r (the fragment's column r, 8 contiguous
// elements) at the shared address lane 8i + r gives.
__device__ __forceinline__ void stmatrix_x4_trans(unsigned int addr, const unsigned int (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// Four floats as e4m3 (round to nearest, saturating), the first in the lowest byte.
__device__ __forceinline__ unsigned int pack_e4m3x4(float x0, float x1, float x2, float x3) {
    unsigned short low, high;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(low) : "f"(x1), "f"(x0));   // the first operand goes high
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(high) : "f"(x3), "f"(x2));
    return (unsigned int)low | ((unsigned int)high << 16);
}

// The key of position c (0..31) of a k32 step of P as the e4m3 A operand. A thread's A fragment
// holds, for its rows g and g + 8, positions 4t..4t + 3 and 16 + 4t..16 + 4t + 3 (mma.m16n8k32's
// layout), while its accumulator holds keys 2t, 2t + 1 of each 8-key chunk. Each thread packs
// its own accumulators in order, with no exchange between threads, so position c holds the key
// below; V^T is stored in the same key order (fp8_transpose_v in forward_sm90.cu), so P V sums
// the same products.
__host__ __device__ __forceinline__ constexpr int fp8_p_key(int c) {
    return (c & 16) + 2 * ((c >> 2) & 3) + 8 * ((c >> 1) & 1) + (c & 1);
}

// P (float32 accumulator of S, 64 x N) as the A operand of the next wgmma. 16-bit: k16 step kk
// takes S's n-chunks 2kk and 2kk + 1, i.e. mma.m16n8k16's A fragment. e4m3: k32 step kk takes
// n-chunks 4kk..4kk + 3 in fp8_p_key's order.
template <typename T, int N>
__device__ __forceinline__ void accumulator_to_a(unsigned int (&a)[N / Sm90Element<T>::mma_k][4], const float (&s)[N / 2]) {
    if constexpr (sizeof(T) == 1) {
#pragma unroll
        for (int kk = 0; kk < N / 32; ++kk) {
            const float* c = s + 16 * kk;
            a[kk][0] = pack_e4m3x4(c[0], c[1], c[4], c[5]);      // row g, keys 2t, 2t + 1, 8 + 2t, 9 + 2t
            a[kk][1] = pack_e4m3x4(c[2], c[3], c[6], c[7]);      // row g + 8
            a[kk][2] = pack_e4m3x4(c[8], c[9], c[12], c[13]);    // row g, the same keys + 16
            a[kk][3] = pack_e4m3x4(c[10], c[11], c[14], c[15]);  // row g + 8
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < N / 16; ++kk) {
            a[kk][0] = Mma<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
            a[kk][1] = Mma<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
            a[kk][2] = Mma<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
            a[kk][3] = Mma<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
        }
    }
}
