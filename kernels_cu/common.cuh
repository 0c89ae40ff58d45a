// Shared vocabulary of the cupy_flash kernels: element types, tile loads/stores. Every kernel file
// includes it; it includes flash_interface.cuh, which Python writes (cupy_flash/_compile.py): the
// feature bits, the configuration values and FlashParams.
//
// No CUDA headers are included (not even cuda_fp16.h): the conversions below are single PTX
// instructions, and leaving the headers out means NVRTC needs no include path, so the same source
// compiles on a machine with no CUDA toolkit and no GPU (the CI compile check does exactly that).

#pragma once
#include "flash_interface.cuh"

// FLASH_THREADS (_traits.THREADS, in flash_interface.cuh): every portable attention kernel's
// threads. Attention kernels declare __launch_bounds__(FLASH_THREADS, 1): with the thread count alone, ptxas
// for sm_80 capped five instantiations at 128 registers and spilled 8 bytes; with the explicit
// one-block minimum they use up to ~160 registers and spill nothing (shared memory, not registers,
// is what limits blocks per SM here).
#define FLASH_LOG2E 1.4426950408889634f
#define FLASH_LN2 0.6931471805599453f
#define FLASH_NEG_INF (-__int_as_float(0x7f800000))

// 16-bit floating types as raw storage; arithmetic always happens in float32.
struct fa_f16 { unsigned short bits; };
struct fa_bf16 { unsigned short bits; };
// FP8 e4m3 as raw storage: the FP8 forward's q, k and v, which only the tensor cores read.
struct fa_e4m3 { unsigned char bits; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(fa_f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(fa_bf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ fa_f16 from_float<fa_f16>(float x) {
    fa_f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}
template <> __device__ __forceinline__ fa_bf16 from_float<fa_bf16>(float x) {
    fa_bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));   // sm_80+
    return r;
}

// FlashParams, the one argument of every kernel: its fields (pointers, the tensors' 64-bit element
// strides {batch, row, head}, sizes, the variants' parameters) are listed once, with what each
// holds, in cupy_flash/_params.py (FIELDS), which writes the struct (_params.cuda_struct) into
// flash_interface.cuh (included above) and fills the same record at each launch.

// One sequence of the batch: its lengths and, for packed variable-length batches (FEATURE_VARLEN),
// the row of the packed tensors where it starts (0 otherwise: the batch stride does the work; under
// VARLEN the launcher sets the batch strides of q, k, v and their gradients to 0).
// Row offsets are 32-bit (the launcher checks total tokens < 2^31), which halves what a varlen
// kernel holds for them; it did not by itself remove the varlen backward's spills (tests/test_compile.py).
struct Sequence {
    int seqlen_q, seqlen_k;
    int q_row0, k_row0;
};

// The K/V head serving query head h (MQA/GQA). The forward kernels divide in 32 bits (heads < 2^31):
// the 64-bit division sits on the prologue's critical path (the first K load), which matters at
// short sequences. The backward keeps the 64-bit one: with 32 bits ptxas spilled 4 bytes in its
// d=256 causal instantiation on sm_90.
__device__ __forceinline__ long long kv_head_of(long long h, const FlashParams& p) {
    return (long long)((unsigned int)h / (unsigned int)p.group);
}
__device__ __forceinline__ long long kv_head_of_wide(long long h, const FlashParams& p) { return h / p.group; }

// Two float32 adds to consecutive addresses (dQ accumulators), one instruction on sm_90.
__device__ __forceinline__ void red_add_f32x2(float* address, float x, float y) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(address), "f"(x), "f"(y) : "memory");
#else
    atomicAdd(address, x);
    atomicAdd(address + 1, y);
#endif
}

__device__ __forceinline__ long long tensor_offset(const long long* strides, long long b, long long row, long long h) {
    return b * strides[0] + row * strides[1] + h * strides[2];
}

// Launch code computes the dynamic shared memory size from the same tile shapes; a mismatch would
// corrupt memory silently, so every kernel checks it on entry and traps instead.
__device__ __forceinline__ void require_dynamic_smem(unsigned int bytes) {
    unsigned int have;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < bytes) __trap();
}

// Programmatic dependent launch (sm_90; cupy_flash/_launch.py). A kernel launched early may be
// resident before the kernel ahead of it in the stream has finished: it calls wait_for_predecessor
// before its first global memory access (it returns once that kernel completed and its writes are
// visible; at once for an ordinary launch). allow_dependents lets the next early-launched kernel's
// blocks start (it still waits for this one to end). Both are no-ops before sm_90.
__device__ __forceinline__ void wait_for_predecessor() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// One step of the online softmax's running max (every forward and the decode kernel): row_max
// (score units) rises to cover tile_max, row_max_scaled is its exponent offset in log2 units (0
// while the row has seen no key: exp2 of a masked -inf then gives 0, not NaN), and the returned
// factor exp2(old - new) rescales the row's sum and O (0 until the row has seen a key).
__device__ __forceinline__ float raise_row_max(float& row_max, float& row_max_scaled, float tile_max, float score_log2) {
    const float new_max = fmaxf(row_max, tile_max);
    const float new_max_scaled = new_max == FLASH_NEG_INF ? 0.f : new_max * score_log2;
    const float rescale = row_max == FLASH_NEG_INF ? 0.f : exp2f(row_max_scaled - new_max_scaled);
    row_max = new_max;
    row_max_scaled = new_max_scaled;
    return rescale;
}

// 16-byte vectors: 8 elements of a 16-bit type, 4 floats.
template <typename T> struct Vec { static constexpr int N = 16 / sizeof(T); };

__device__ __forceinline__ void unpack(const uint4& raw, float* out, float) {
    out[0] = __uint_as_float(raw.x); out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z); out[3] = __uint_as_float(raw.w);
}
__device__ __forceinline__ void unpack(const uint4& raw, float* out, fa_f16) {
    const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = to_float(fa_f16{(unsigned short)(w[i] & 0xffffu)});
        out[2 * i + 1] = to_float(fa_f16{(unsigned short)(w[i] >> 16)});
    }
}
__device__ __forceinline__ void unpack(const uint4& raw, float* out, fa_bf16) {
    const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 pack(const float* in, float) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]), __float_as_uint(in[3]));
}
template <typename T16>
__device__ __forceinline__ uint4 pack(const float* in, T16) {
    unsigned int w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = (unsigned int)from_float<T16>(in[2 * i]).bits | ((unsigned int)from_float<T16>(in[2 * i + 1]).bits << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Copy a (ROWS x D_TILE) tile of T from global memory into float32 shared memory with row pitch LD.
// Consecutive threads read consecutive 16-byte vectors of a row (coalesced). Rows at or past
// rows_valid and columns at or past head_dim are filled with zeros, so padded rows and columns
// contribute nothing to any dot product.
template <typename T, int ROWS, int D_TILE, int LD>
__device__ __forceinline__ void load_tile(float* tile, const T* base, long long row_stride, int rows_valid, int head_dim) {
    constexpr int VEC = Vec<T>::N;
    constexpr int VECS_PER_ROW = D_TILE / VEC;
    for (int idx = threadIdx.x; idx < ROWS * VECS_PER_ROW; idx += FLASH_THREADS) {
        const int r = idx / VECS_PER_ROW;
        const int c = (idx % VECS_PER_ROW) * VEC;
        float vals[VEC];
        if (r < rows_valid && c < head_dim) {
            unpack(*reinterpret_cast<const uint4*>(base + r * row_stride + c), vals, T{});
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) vals[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) tile[r * LD + c + e] = vals[e];
    }
}

// Write rows [0, rows_valid) and columns [0, head_dim) of a float32 shared tile, times `scale`,
// to global memory as T, in 16-byte vectors.
template <typename T, int ROWS, int D_TILE, int LD>
__device__ __forceinline__ void store_tile(T* base, long long row_stride, const float* tile, int rows_valid, int head_dim, float scale) {
    constexpr int VEC = Vec<T>::N;
    constexpr int VECS_PER_ROW = D_TILE / VEC;
    for (int idx = threadIdx.x; idx < ROWS * VECS_PER_ROW; idx += FLASH_THREADS) {
        const int r = idx / VECS_PER_ROW;
        const int c = (idx % VECS_PER_ROW) * VEC;
        if (r < rows_valid && c < head_dim) {
            float vals[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) vals[e] = tile[r * LD + c + e] * scale;
            *reinterpret_cast<uint4*>(base + r * row_stride + c) = pack(vals, T{});
        }
    }
}

// Sum / max over the 8 threads (tx = 0..7) that share a row in the 16 x 8 thread layout.
__device__ __forceinline__ float row_group_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    return x;
}
__device__ __forceinline__ float row_group_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
    return x;
}

// The CUDA-core kernels' products, a thread's ROWS x COLS outputs at a time: acc[i][j] += a(i, k) *
// b(j, k) over k, the operands read from shared memory by a and b. Products over the same k (S^T
// and dP^T; dV and dK) step together: accumulate<K, UNROLL>(outer_product(...), outer_product(...))
// issues every operand load of a step before its multiply-adds.
template <int ROWS, int COLS, typename A, typename B>
struct OuterProduct {
    float (&acc)[ROWS][COLS];
    A a;
    B b;
    float a_k[ROWS], b_k[COLS];
    __device__ __forceinline__ void load(int k) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) a_k[i] = a(i, k);
#pragma unroll
        for (int j = 0; j < COLS; ++j) b_k[j] = b(j, k);
    }
    __device__ __forceinline__ void add() {
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
#pragma unroll
            for (int j = 0; j < COLS; ++j) acc[i][j] = fmaf(a_k[i], b_k[j], acc[i][j]);
    }
};
template <int ROWS, int COLS, typename A, typename B>
__device__ __forceinline__ OuterProduct<ROWS, COLS, A, B> outer_product(float (&acc)[ROWS][COLS], A a, B b) {
    return {acc, a, b};
}
template <int K, int UNROLL, typename... Products>
__device__ __forceinline__ void accumulate(Products... products) {
#pragma unroll UNROLL
    for (int k = 0; k < K; ++k) {
        (products.load(k), ...);
        (products.add(), ...);
    }
}

// Blocks of a 1-D grid are handed out roughly in index order. For query-block kernels, index i
// maps to the last query blocks first (under the causal mask they see the most keys and would
// otherwise finish last), with (batch, head) varying fastest.
struct QueryBlock {
    int q_block;
    long long b, h;
};
__device__ __forceinline__ QueryBlock query_block_of(const FlashParams& p, int block_m) {
    const long long bh_count = p.batch * p.heads;
    const int num_q_blocks = (int)((p.seqlen_q + block_m - 1) / block_m);
    const long long bh = blockIdx.x % bh_count;
    return {num_q_blocks - 1 - (int)(blockIdx.x / bh_count), bh / p.heads, bh % p.heads};
}
// The same for the block at place `index` of that order, where the grid interleaves more blocks (the
// wide tiles' v blocks). (Written apart: the form above, with blockIdx.x read at each use, is
// what the portable kernels were tuned with; through this one their SASS changed.)
__device__ __forceinline__ QueryBlock query_block_of(const FlashParams& p, int block_m, unsigned int index) {
    const long long bh_count = p.batch * p.heads;
    const int num_q_blocks = (int)((p.seqlen_q + block_m - 1) / block_m);
    const long long bh = index % bh_count;
    return {num_q_blocks - 1 - (int)(index / bh_count), bh / p.heads, bh % p.heads};
}

// Key-block kernels (backward), one block per (key block, batch, head), in one of two orders:
//  - kv_block_fastest: index i is key block i % num_kv_blocks of (batch, head) i / num_kv_blocks.
//    The blocks resident together belong to one or two heads and stream the same Q, dO and dQ rows,
//    which then stay in L2 (FlashAttention-2's order). With (batch, head) fastest, an 8k d=128
//    backward read 7x more from DRAM (L2 hit rate 81% against 94%).
//  - otherwise (batch, head) fastest: index i is key block i / (batch * heads), so blocks wait only
//    on lower key blocks of their head that are dispatched earlier and few of them are resident at
//    once (the deterministic backward's ordered dQ adds need both).
struct KeyBlock {
    int kv_block;
    long long b, h, bh;   // bh = b * heads + h
};
__device__ __forceinline__ KeyBlock key_block_of(const FlashParams& p, bool kv_block_fastest) {
    const long long bh_count = p.batch * p.heads;
    long long bh;
    int kv_block;
    if (kv_block_fastest) {
        const long long num_kv_blocks = gridDim.x / bh_count;
        bh = blockIdx.x / num_kv_blocks;
        kv_block = (int)(blockIdx.x % num_kv_blocks);
    } else {
        bh = blockIdx.x % bh_count;
        kv_block = (int)(blockIdx.x / bh_count);
    }
    return {kv_block, bh / p.heads, bh % p.heads, bh};
}

// Tiles of unequal work (under a causal mask a head's first key block, or its last query block,
// sees the most): a (batch, head)'s tile of `rank` 0 is its longest. Tile `tile` as (bh, rank):
// heads one after another, each longest first (blocks resident together share the head's rows in
// L2), except the last heads, enough for LONGEST_FIRST_TAIL_TILES tiles, whose tiles are dealt
// rank by rank across them, so the grid's last tiles are its shortest. Head by head to the end,
// the last head's longest tiles start shortly before the end and set the finish: a greedy
// schedule of the tiles on 132 SMs finishes 3-7% after their mean (causal 1k-8k, d = 64-256),
// dealt 0.4-1.8%. Measured (H100, interleaved against head by head, causal 512-8k): forward
// 1.007-1.070 (d = 256 2k-4k +5-7%), backward 0.983-1.054 (mean +1%).
struct HeadTile {
    unsigned int bh, rank;
};
// The calls whose tiles are so ordered: a plain causal mask (a window's band or packed sequences
// give tiles of other lengths).
template <bool IS_CAUSAL, int FEATURES>
constexpr bool triangular_tiles = IS_CAUSAL && !(FEATURES & (FEATURE_WINDOW | FEATURE_VARLEN));
// Two waves of an H100's 132 SMs (more on smaller GPUs). One wave measured the same; four lost
// 4% at d = 128 1k and eight 18-24% at d = 128 1k-4k (backward): the more heads run side by side,
// the more of their rows miss L2. A constant: %nsmid, read here, cost the d = 128 causal backward
// an 8-byte spill.
constexpr unsigned int LONGEST_FIRST_TAIL_TILES = 2 * 132;
// deal_tail false: heads one after another to the end (tiles of equal length, or an order that
// must stay so).
__device__ __forceinline__ HeadTile longest_first_tile(unsigned int tile, unsigned int per_head, unsigned int bh_count,
                                                       bool deal_tail = true) {
    if (!deal_tail) return {tile / per_head, tile % per_head};
    const unsigned int tail = min(bh_count, (LONGEST_FIRST_TAIL_TILES + per_head - 1) / per_head);
    const unsigned int tail_start = (bh_count - tail) * per_head;
    if (tile < tail_start) return {tile / per_head, tile % per_head};
    const unsigned int r = tile - tail_start;
    return {bh_count - tail + r % tail, r / tail};
}

// A persistent grid's tile (the Hopper backward) as a key block of `num_kv_blocks` per (batch,
// head): a head's key blocks consecutive, or in groups of `group` consecutive key blocks of one
// (batch, head), all heads' first group before any head's second (deterministic mode's order). A
// tile waits only for lower key blocks of its head, which come earlier either way; a group's
// blocks run side by side, so they share their head's Q, dO and dQ rows in L2 (with (batch, head)
// fastest every key block read them from DRAM on its own), at a waiting chain of `group` blocks.
// 32-bit arithmetic (tiles < 2^31, the launcher's bound): the Hopper producer's few registers.
__device__ __forceinline__ KeyBlock key_block_of_tile(const FlashParams& p, int tile, int num_kv_blocks, int group) {
    const unsigned int t = (unsigned int)tile, blocks = (unsigned int)num_kv_blocks;
    const unsigned int bh_count = (unsigned int)(p.batch * p.heads), heads = (unsigned int)p.heads;
    unsigned int bh, kv_block;
    if (group >= num_kv_blocks) {
        bh = t / blocks;
        kv_block = t % blocks;
    } else {   // (bh_count * group < the tile count)
        const unsigned int group_start = t / (bh_count * (unsigned int)group) * (unsigned int)group;   // its first key block
        const unsigned int size = min((unsigned int)group, blocks - group_start);
        const unsigned int r = t - group_start * bh_count;
        bh = r / size;
        kv_block = group_start + r % size;
    }
    return {(int)kv_block, (long long)(bh / heads), (long long)(bh % heads), (long long)bh};
}

// Deterministic dQ (the backward kernels' p.dq_semaphore): called by one thread after a barrier
// that follows the block's dQ adds to a query block: the barrier orders every thread's reds before
// this thread's fence, and the fence (cumulative) before the count moves (the pattern of
// cooperative groups' grid barrier).
__device__ __forceinline__ void publish_dq(int* semaphore) {
    __threadfence();
    atomicAdd(semaphore, 1);
}

// ... and the wait for a block's turn at a query block: until `turn` key blocks have published.
__device__ __forceinline__ void wait_dq_turn(const int* semaphore, int turn) {
    int done;
    do {
        asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(done) : "l"(semaphore) : "memory");
    } while (done < turn);
}

// The deterministic dQ counters of (batch, head) bh: one per query block of BLOCK_M rows.
template <int BLOCK_M>
__device__ __forceinline__ int* dq_semaphores_of(const FlashParams& p, long long bh) {
    return p.dq_semaphore + bh * ((p.seqlen_q + BLOCK_M - 1) / BLOCK_M);
}

// ---- Masks and variants ------------------------------------------------------------------------
// Every attention kernel takes IS_CAUSAL and FEATURES (a bitmask) as template flags, so a plain
// instantiation compiles none of the variant code. Masks are bands around the bottom-right
// diagonal (shift = seqlen_k - seqlen_q): key j is visible from query i iff j < seqlen_k and
//   IS_CAUSAL:       j - i <= shift + p.window_right   (0 for plain causal; a window's right size)
//   FEATURE_WINDOW:  j - i >= shift - p.window_left    (a sliding window's left size)
// The FEATURE_* bits (WINDOW, SOFTCAP, ALIBI, SINK: forward only, joins each row's softmax in the
// epilogue; BIAS: an additive float32 bias read per (b, h, query, key) with broadcast strides;
// VARLEN: a packed variable-length batch, lengths from cu_seqlens) are defined once, in
// cupy_flash/_features.py, which writes them ahead of every family's source.

template <int FEATURES>
__device__ __forceinline__ Sequence sequence_of(const FlashParams& p, long long b) {
    if (FEATURES & FEATURE_VARLEN) {
        const int q0 = p.cu_seqlens_q[b], q1 = p.cu_seqlens_q[b + 1];
        const int k0 = p.cu_seqlens_k[b], k1 = p.cu_seqlens_k[b + 1];
        return {q1 - q0, k1 - k0, q0, k0};
    }
    return {(int)p.seqlen_q, (int)p.seqlen_k, 0, 0};
}


struct Band {
    int right;   // visible iff left <= key - query <= right (each bound only where its flag is set)
    int left;
    int shift;
};
// int arithmetic: seqlens < 2^30 and the launcher clamps window sizes below 2^30.
__device__ __forceinline__ Band band_of(const FlashParams& p, const Sequence& seq) {
    const int shift = seq.seqlen_k - seq.seqlen_q;
    return {shift + (int)p.window_right, shift - (int)p.window_left, shift};
}

template <bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ bool key_visible(int key, int query, int seqlen_k, const Band& band) {
    return key < seqlen_k && (!IS_CAUSAL || key - query <= band.right) &&
           (!(FEATURES & FEATURE_WINDOW) || key - query >= band.left);
}

// key_visible for the elements a thread holds of a tile, at (query0 + row, key0 + col) with row
// and col compile-time offsets in the accumulator layout: each test compares one constant with one
// register (int arithmetic, as key_visible).
struct TileMask {
    int key_limit;    // col < key_limit: key < seqlen_k
    int right_limit;  // col - row <= right_limit: the causal (right) edge
    int left_limit;   // col - row >= left_limit: a window's left edge
    __device__ __forceinline__ TileMask(int query0, int key0, int seqlen_k, const Band& band)
        : key_limit(seqlen_k - key0), right_limit(band.right - (key0 - query0)), left_limit(band.left - (key0 - query0)) {}
    template <bool IS_CAUSAL, int FEATURES>
    __device__ __forceinline__ bool visible(int row, int col) const {
        return col < key_limit && (!IS_CAUSAL || col - row <= right_limit) &&
               (!(FEATURES & FEATURE_WINDOW) || col - row >= left_limit);
    }
};

// Whether any (query, key) of a query block x key block tile may be masked: the tile crosses the
// sequence end or a band edge. Tiles inside the band skip the per-element test.
template <bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ bool tile_needs_mask(int q_start, int block_m, int kv_start, int block_n, int seqlen_k, const Band& band) {
    return kv_start + block_n > seqlen_k ||
           (IS_CAUSAL && kv_start + block_n - 1 - q_start > band.right) ||
           ((FEATURES & FEATURE_WINDOW) && kv_start - (q_start + block_m - 1) < band.left);
}

// Key blocks [first, end) that a query block starting at q_start sees any key of.
template <bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ int2 kv_block_range(const Sequence& seq, int q_start, int block_m, int block_n, const Band& band) {
    const int num_kv_blocks = (seq.seqlen_k + block_n - 1) / block_n;
    int first = 0, end = num_kv_blocks;
    if (IS_CAUSAL) {   // the last row's last visible key
        const long long last_key = (long long)q_start + block_m - 1 + band.right;
        end = last_key < 0 ? 0 : (int)min((long long)num_kv_blocks, last_key / block_n + 1);
    }
    if (FEATURES & FEATURE_WINDOW) {   // the first row's first visible key
        const long long first_key = (long long)q_start + band.left;
        first = (int)min((long long)num_kv_blocks, max(0LL, first_key) / block_n);
    }
    return make_int2(first, max(first, end));
}

// Query blocks [first, end) that see any key of the key block starting at kv_start.
template <bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ int2 q_block_range(const Sequence& seq, int kv_start, int block_m, int block_n, const Band& band) {
    const int num_q_blocks = (seq.seqlen_q + block_m - 1) / block_m;
    int first = 0, end = num_q_blocks;
    if (IS_CAUSAL) {   // the first query that sees the block's first key
        const long long first_query = (long long)kv_start - band.right;
        first = (int)min((long long)num_q_blocks, max(0LL, first_query) / block_m);
    }
    if (FEATURES & FEATURE_WINDOW) {   // the last query that sees the block's last key
        const long long last_query = (long long)kv_start + block_n - 1 - band.left;
        end = last_query < 0 ? 0 : (int)min((long long)num_q_blocks, last_query / block_m + 1);
    }
    return make_int2(first, max(first, end));
}

// The logit of a raw score q.k, in log2 units, with the score modifiers applied in
// FlashAttention's order: softcap, then the ALiBi bias -slope * |i + shift - j|, then the additive
// bias. Only used when one of them is set: the plain kernels fold softmax_scale * log2(e) into
// their exp2's fma.
template <int FEATURES>
struct ScoreMod {
    static constexpr bool active = (FEATURES & (FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_BIAS)) != 0;
    float scale, cap, inv_cap, slope;
    int shift, seqlen_q, seqlen_k;
    const float* bias;                 // the (b, h) plane of the bias
    long long bias_row, bias_col;
    __device__ __forceinline__ ScoreMod(const FlashParams& p, long long b, long long h, const Sequence& seq)
        : scale(p.softmax_scale), cap(p.softcap), inv_cap(p.softcap_inv),
          slope((FEATURES & FEATURE_ALIBI) ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f),
          shift(seq.seqlen_k - seq.seqlen_q), seqlen_q(seq.seqlen_q), seqlen_k(seq.seqlen_k),
          bias((FEATURES & FEATURE_BIAS) ? p.bias + b * p.bias_strides[0] + h * p.bias_strides[1] : nullptr),
          bias_row(p.bias_strides[2]), bias_col(p.bias_strides[3]) {}
    // The bias at (query, key); 0 outside the sequence (padding rows and columns of a tile, masked).
    __device__ __forceinline__ float bias_at(int query, int key) const {
        return query < seqlen_q && key < seqlen_k ? bias[query * bias_row + key * bias_col] : 0.f;
    }
    // The logit with a given bias value (the tensor-core forward stages the bias in shared memory).
    __device__ __forceinline__ float log2_logit_with(float raw, int query, int key, float bias_value) const {
        float z = raw * scale;
        if (FEATURES & FEATURE_SOFTCAP) z = cap * tanhf(z * inv_cap);
        // key - query - shift: the signed distance from the diagonal (exact in float below 2^24).
        if (FEATURES & FEATURE_ALIBI) z -= slope * fabsf((float)(key - query - shift));
        if (FEATURES & FEATURE_BIAS) z += bias_value;
        return z * FLASH_LOG2E;
    }
    __device__ __forceinline__ float log2_logit(float raw, int query, int key) const {
        return log2_logit_with(raw, query, key, (FEATURES & FEATURE_BIAS) ? bias_at(query, key) : 0.f);
    }
    // d logit / d (scale * raw): 1 - tanh^2 under softcap, else 1.
    __device__ __forceinline__ float grad_factor(float raw) const {
        if (!(FEATURES & FEATURE_SOFTCAP)) return 1.f;
        const float th = tanhf(raw * scale * inv_cap);
        return 1.f - th * th;
    }
};

// A block's (batch, head) as the portable kernels see it: its sequence (a packed batch's own rows),
// the band of keys its queries see, the score modifier, and where the head's rows start: its first
// query row of q, its K/V head's first key row of k and v.
template <typename T, int FEATURES>
struct HeadScope {
    long long b, h;
    Sequence seq;
    Band band;
    ScoreMod<FEATURES> mod;
    const T *q, *k, *v;
    __device__ __forceinline__ HeadScope(const FlashParams& p, long long batch, long long head)
        : b(batch), h(head), seq(sequence_of<FEATURES>(p, batch)), band(band_of(p, seq)), mod(p, batch, head, seq),
          q(static_cast<const T*>(p.q) + tensor_offset(p.q_strides, batch, seq.q_row0, head)),
          k(static_cast<const T*>(p.k) + tensor_offset(p.k_strides, batch, seq.k_row0, kv_head_of(head, p))),
          v(static_cast<const T*>(p.v) + tensor_offset(p.v_strides, batch, seq.k_row0, kv_head_of(head, p))) {}
};

// A query-block kernel's block (query_block_of's order): its first query and its head. A packed
// batch's grid covers the longest sequence, so a block may lie past its own (past_sequence). The
// key-block kernels keep their own prologue, which builds the band and score modifier after that
// exit (docs/decisions.md, portable backward: "a small vocabulary").
template <typename T, int FEATURES>
struct QueryBlockScope {
    int q_start;
    HeadScope<T, FEATURES> head;
    __device__ __forceinline__ QueryBlockScope(const FlashParams& p, int block_m) : QueryBlockScope(p, query_block_of(p, block_m), block_m) {}
    __device__ __forceinline__ QueryBlockScope(const FlashParams& p, QueryBlock block, int block_m)
        : q_start(block.q_block * block_m), head(p, block.b, block.h) {}
    __device__ __forceinline__ bool past_sequence() const { return (FEATURES & FEATURE_VARLEN) && q_start >= head.seq.seqlen_q; }
};

// FEATURE_BIAS backward: the gradient of the logit (dS, before the softcap factor) is the bias's
// gradient; with a broadcast bias several (b, h, i, j) share an element and add atomically. The
// launcher zeroes p.dbias (tiles outside the mask's band are never visited).
template <int FEATURES>
__device__ __forceinline__ void add_dbias(const FlashParams& p, long long b, long long h, int query, int key,
                                          const Sequence& seq, float ds) {
    if (!(FEATURES & FEATURE_BIAS) || p.dbias == nullptr || query >= seq.seqlen_q || key >= seq.seqlen_k) return;
    float* at = p.dbias + b * p.dbias_strides[0] + h * p.dbias_strides[1] + query * p.dbias_strides[2] +
                key * p.dbias_strides[3];
    if (p.dbias_atomic) atomicAdd(at, ds);
    else *at = ds;
}

// FEATURE_SINK: a row's lse with the sink's logit joined to its softmax, and the factor
// exp(lse - joined) by which its output shrinks (0 for a row that sees no key: its output stays 0).
__device__ __forceinline__ float2 join_sink(float lse, float sink) {
    if (lse == FLASH_NEG_INF) return make_float2(sink, 0.f);
    const float hi = fmaxf(lse, sink), lo = fminf(lse, sink);
    const float joined = hi + log1pf(expf(lo - hi));
    return make_float2(joined, expf(lse - joined));
}

// v's head_dim (o's, dO's, dV's): its own under FEATURE_HEAD_DIM_V, else q's and k's.
template <int FEATURES>
__device__ __forceinline__ int head_dim_v_of(const FlashParams& p) {
    return (int)((FEATURES & FEATURE_HEAD_DIM_V) ? p.head_dim_v : p.head_dim);
}

// The forward's score units: raw q.k scores (times scale_log2 in the exp2's fma; times
// softmax_scale to natural units), or with a score modifier log2-unit logits (scale 1; ln 2).
template <int FEATURES>
__device__ __forceinline__ float score_to_log2(const FlashParams& p) {
    return ScoreMod<FEATURES>::active ? 1.f : p.scale_log2;
}
template <int FEATURES>
__device__ __forceinline__ float score_to_natural(const FlashParams& p) {
    return ScoreMod<FEATURES>::active ? FLASH_LN2 : p.softmax_scale;
}

// End of a forward row: from its running max (score units), the max as used in the exponents and
// the row sum, the row's lse and the factor that normalises its output (0 for a row that saw no
// key), the sink joined under FEATURE_SINK. total = sum exp2(s * scale_log2 - max_scaled) and
// max_scaled = max * scale_log2 - residual with the residual exact through an fma, so
// lse = max * scale + (log2(total) - residual) * ln2: one rounding at |lse|, as a dense float32
// logsumexp has. score_log2 and score_natural: the factors from score units to exp2's and to lse's.
template <int FEATURES>
__device__ __forceinline__ float2 finish_row(const FlashParams& p, long long h, float row_max, float row_max_scaled, float total,
                                            float score_log2, float score_natural) {
    const float residual = fmaf(row_max, score_log2, -row_max_scaled);
    float lse = total > 0.f ? fmaf(row_max, score_natural, (log2f(total) - residual) * FLASH_LN2)
                            : FLASH_NEG_INF;
    float inv = total > 0.f ? 1.f / total : 0.f;
    if (FEATURES & FEATURE_SINK) {
        const float2 joined = join_sink(lse, p.sink[h]);
        lse = joined.x;
        inv *= joined.y;
    }
    return make_float2(lse, inv);
}
// The same in the call's own units (the FP8 forward's scale holds the inputs' descales).
template <int FEATURES>
__device__ __forceinline__ float2 finish_row(const FlashParams& p, long long h, float row_max, float row_max_scaled, float total) {
    return finish_row<FEATURES>(p, h, row_max, row_max_scaled, total, score_to_log2<FEATURES>(p), score_to_natural<FEATURES>(p));
}

// Row kernels (delta, dQ convert): one warp per (batch, row, head), rows numbered in the memory
// order of a (batch, seqlen_q, heads, head_dim) tensor; a warp loops so any grid covers every row.
struct RowIndex {
    long long b, row, h;
};
__device__ __forceinline__ RowIndex row_index(const FlashParams& p, long long r) {
    return {r / (p.heads * p.seqlen_q), (r / p.heads) % p.seqlen_q, r % p.heads};
}
__device__ __forceinline__ long long first_row_of_warp() {
    return (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
}
__device__ __forceinline__ long long rows_per_grid() { return (long long)gridDim.x * (blockDim.x / 32); }

