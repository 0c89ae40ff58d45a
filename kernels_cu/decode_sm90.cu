// MLA decoding on Hopper (sm_90a, wgmma): DeepSeek's latent cache (k rows of MLA_SM90_D_TILE = 576
// columns, v the first head_dim_v <= 512 of each, one K/V head), 16-bit caches.
//
//   flash_mla_decode_sm90_kernel  one block per (split, 64 rows, batch, K/V head), as
//                                 flash_mla_decode_kernel's grid (decode.cu), so the plan, the
//                                 partials and the combine are the same
//
// Why wgmma: with 128 query heads a key of the cache meets 64 rows in a block, so decoding is
// compute-bound (docs/performance.md, MLA decoding), and mma.sync kernels re-read Q from shared
// memory for every 16 rows (150 TFLOP/s). Here Q stays in shared memory once per block and two
// warpgroups read it as wgmma's A operand.
//
// The block's 256 threads are two warpgroups over 64 rows. Per tile of MLA_SM90_KEYS = 64 keys:
//   1. every thread copies its share of the next tile into the other stage (cp.async, zero-filled
//      past the keys and head_dim), so one tile loads while this one is used;
//   2. warpgroup w scores keys 32w .. 32w + 31 of the tile: S_w = Q K_w^T (m64n32k16 x 36);
//   3. the two exchange their rows' tile maxima in shared memory, so both raise the same running
//      max; each writes its P (16-bit) into the shared 64 x 64 P tile;
//   4. warpgroup w accumulates O over v's columns 256w .. 256w + 255 for all 64 keys:
//      O_w += P V_w (m64n256k16 x 4), V read from the same tile (its first 512 columns), N-major.
// Each warpgroup keeps the row sums of its own keys, added at the end. Tiles are 128-byte swizzled
// [rows][64 columns] chunks (sm90_mma.cuh), written by cp.async and read through the async proxy
// after fence.proxy.async.

#include "common.cuh"
#include "decode_common.cuh"
#include "tensor_core.cuh"
#include "sm90_mma.cuh"
#include "sm90_wgmma_ops.cuh"
#include "sm90_tma.cuh"

// The kernel's shape. (Members of a struct, as Sm90Element's: constants in a named namespace
// reach the PTX under names hashed from the source text, so the file alone and the package's
// expanded source would compile to different PTX.)
struct MlaSm90Shape {
    static constexpr int ROWS = 64;                               // (token, query head) rows of a block: one wgmma M
    static constexpr int KEYS = MLA_SM90_KEYS;                    // keys of a tile
    static constexpr int D_TILE = MLA_SM90_D_TILE;                // k's columns (q's)
    static constexpr int DV_TILE = FLASH_MAX_HEAD_DIM_V;          // v's columns (o's)
    static constexpr int CHUNKS = D_TILE / SWIZZLE_ROW_ELEMENTS;  // 64-column chunks of a row
    static constexpr int GROUP_KEYS = KEYS / 2;                   // keys a warpgroup scores
    static constexpr int GROUP_COLUMNS = DV_TILE / 2;             // v columns a warpgroup accumulates
    static constexpr int CHUNK_BYTES = ROWS * 128;                // one [64 rows][64 columns] 16-bit chunk
    static constexpr int SCORES_BARRIER = 1;                      // named barrier of both warpgroups (0 is __syncthreads')
    static_assert(MLA_SM90_THREADS == 256 && KEYS == ROWS, "two warpgroups; Q and key chunks of the same shape");
    static_assert(16 * MLA_DECODE_ROW_TILES == ROWS, "flash_mla_decode_kernel's grid (decode.py counts its blocks)");
    static_assert(D_TILE % SWIZZLE_ROW_ELEMENTS == 0 && GROUP_COLUMNS % SWIZZLE_ROW_ELEMENTS == 0, "whole chunks");

    template <typename T>
    struct Storage {
        alignas(SWIZZLE_ATOM_BYTES) T q[CHUNKS][ROWS][SWIZZLE_ROW_ELEMENTS];
        alignas(SWIZZLE_ATOM_BYTES) T k[2][CHUNKS][KEYS][SWIZZLE_ROW_ELEMENTS];   // two stages
        alignas(SWIZZLE_ATOM_BYTES) T p[ROWS][KEYS];                               // P of the tile, swizzled
        float tile_max[2][ROWS];   // each warpgroup's rows' maxima over its keys of the tile
        float row_sum[2][ROWS];    // at the end: each warpgroup's row sums
    };
};

// Dynamic shared memory a launch must give (read by the launcher from the compiled module, so the
// size is stated once, as forward_sm90_smem_bytes): the storage and room to align it.
template <typename T>
__device__ const unsigned int mla_decode_sm90_smem_bytes = sizeof(MlaSm90Shape::Storage<T>) + SWIZZLE_ATOM_BYTES;

// 16-byte chunk `c` (of CHUNKS x 8) of row r of a swizzled [CHUNKS][64 rows][64] tile, as a shared
// address.
__device__ __forceinline__ unsigned int mla_chunk_address(unsigned int tile, int r, int c) {
    return tile + (unsigned int)(c >> 3) * MlaSm90Shape::CHUNK_BYTES + swizzled_offset(r, (c & 7) * 8);
}

template <typename T, bool IS_CAUSAL>
__global__ void __launch_bounds__(MLA_SM90_THREADS, 1) flash_mla_decode_sm90_kernel(const FlashParams p) {
    using Shape = MlaSm90Shape;
    constexpr int ROWS = Shape::ROWS, KEYS = Shape::KEYS, D_TILE = Shape::D_TILE, CHUNKS = Shape::CHUNKS;
    constexpr int GROUP_KEYS = Shape::GROUP_KEYS, GROUP_COLUMNS = Shape::GROUP_COLUMNS, CHUNK_BYTES = Shape::CHUNK_BYTES;
    constexpr int SCORES_BARRIER = Shape::SCORES_BARRIER;
    using Tile = Shape::Storage<T>;
    static_assert(sizeof(Tile) + SWIZZLE_ATOM_BYTES <= SM90_BLOCK_SMEM_BYTES, "shared memory of one sm_90 block");
    require_dynamic_smem(sizeof(Tile) + SWIZZLE_ATOM_BYTES);
    extern __shared__ unsigned char smem_raw[];
    Tile& smem = aligned_shared_storage<Tile>(smem_raw);

    const int lane = threadIdx.x & 31, group_id = threadIdx.x / 128, warp = (threadIdx.x / 32) & 3;
    const int g = lane >> 2, t = lane & 3;
    const MlaBlock block = mla_block<ROWS>(p);
    const long long group = block.group, heads_kv = block.heads_kv, b = block.b, kv_head = block.kv_head;
    const int rows_per_kv_head = block.rows_per_kv_head, split = block.split, row0 = block.row0, row_count = block.row_count;
    const int head_dim = (int)p.head_dim, head_dim_v = (int)p.head_dim_v;
    // Launched early (_launch.py): nothing is read before the kernel ahead has finished.
    wait_for_predecessor();
    allow_dependents();

    // Copies: 8 threads a row (a warp reads 4 rows of 128 contiguous bytes), 32 rows a pass; thread
    // part p takes the row's chunks p, p + 8, ... (one 16-byte unit of each 64-column chunk).
    const int copy_row = threadIdx.x / 8, copy_part = threadIdx.x % 8;
    const unsigned int q_tile = smem_addr(&smem.q[0][0][0]);
    for (int pass = 0; pass < ROWS / 32; ++pass) {
        const int r = copy_row + 32 * pass, row = row0 + r;
        const bool row_valid = r < row_count;
        const T* src = static_cast<const T*>(p.q) +
                       (row_valid ? tensor_offset(p.q_strides, b, row / group, kv_head * group + row % group) : 0);
#pragma unroll
        for (int m = 0; m < CHUNKS; ++m) {
            const int c = copy_part + 8 * m;
            const bool ok = row_valid && 8 * c < head_dim;
            cp_async_16(mla_chunk_address(q_tile, r, c), src + (ok ? 8 * c : 0), ok);
        }
    }

    const MlaKeys keys = mla_keys<IS_CAUSAL>(p, block);
    const Band band = keys.band;
    const int key_begin = keys.key_begin, key_end = keys.key_end;
    int row_token[2];
    long long row_head[2];
    float row_slope[2];
    thread_rows<0>(p, b, kv_head, group, row0 + 16 * warp, g, rows_per_kv_head, row_token, row_head, row_slope);

    const T* k = static_cast<const T*>(p.k);
    const unsigned long long read_once = l2_evict_first_policy();
    auto load_tile = [&](int tile_start, int stage) {
        const unsigned int dst = smem_addr(&smem.k[stage][0][0][0]);
#pragma unroll
        for (int pass = 0; pass < KEYS / 32; ++pass) {
            const int r = copy_row + 32 * pass, key = tile_start + r;
            const bool key_valid = key < key_end;
            const T* src = k + (key_valid ? cache_offset(p, p.k_strides, b, key, kv_head) : 0);
#pragma unroll
            for (int m = 0; m < CHUNKS; ++m) {
                const int c = copy_part + 8 * m;
                const bool ok = key_valid && 8 * c < head_dim;
                cp_async_16_once(mla_chunk_address(dst, r, c), src + (ok ? 8 * c : 0), ok, read_once);
            }
        }
    };

    float o[GROUP_COLUMNS / 2];
#pragma unroll
    for (int i = 0; i < GROUP_COLUMNS / 2; ++i) o[i] = 0.f;
    float row_max[2] = {FLASH_NEG_INF, FLASH_NEG_INF}, row_max_scaled[2] = {0.f, 0.f}, row_sum[2] = {0.f, 0.f};
    const float score_log2 = score_to_log2<0>(p);
    const int first_tile = key_begin & ~(KEYS - 1);
    if (first_tile < key_end) load_tile(first_tile, 0);
    cp_async_commit();   // Q and the first tile

    const unsigned int p_tile = smem_addr(&smem.p[0][0]);
    const int local_row = 16 * warp + g;   // this thread's rows: local_row and local_row + 8
    int stage = 0;
    for (int tile_start = first_tile; tile_start < key_end; tile_start += KEYS, stage ^= 1) {
        if (tile_start + KEYS < key_end) load_tile(tile_start + KEYS, stage ^ 1);   // (the other stage is free)
        cp_async_commit();
        cp_async_wait<1>();     // Q and this tile landed for this thread ...
        fence_async_shared();   // ... visible to wgmma's reads ...
        __syncthreads();        // ... and for the block

        // S = Q K^T over this warpgroup's 32 keys of the tile.
        const unsigned int k_tile = smem_addr(&smem.k[stage][0][0][0]);
        float s[GROUP_KEYS / 2];
        warpgroup_arrive();
        mma_k_major<T, GROUP_KEYS, D_TILE>(s, q_tile, CHUNK_BYTES, k_tile + GROUP_KEYS * group_id * 128, CHUNK_BYTES);
        warpgroup_commit();
        warpgroup_wait<0>();
        hold_registers(s);

        // The mask (the split's keys, the causal band), the rows' maxima over this warpgroup's keys.
        float tile_max[2] = {FLASH_NEG_INF, FLASH_NEG_INF};
#pragma unroll
        for (int j = 0; j < GROUP_KEYS / 2; ++j) {
            const int half = accumulator_half(j);
            const int key = tile_start + GROUP_KEYS * group_id + accumulator_col(j) + 2 * t;
            const bool visible = key < key_end && key >= key_begin && (!IS_CAUSAL || key - row_token[half] <= band.right);
            s[j] = visible ? s[j] : FLASH_NEG_INF;
            tile_max[half] = fmaxf(tile_max[half], s[j]);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 1));
            tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 2));
            if (t == 0) smem.tile_max[group_id][local_row + 8 * half] = tile_max[half];
        }
        named_barrier_sync(SCORES_BARRIER, MLA_SM90_THREADS);
        // Both warpgroups' warps of these rows take the same tile maxima, so they make the same
        // choices: the running max moves only when a row's max passes it by more than MAX_LAG
        // (log2 units), as RowSoftmax in forward_sm90.cu (P then stays below 2^MAX_LAG, in range
        // for 16-bit P; O and lse are exact for any reference), so O is rescaled rarely.
        constexpr float MAX_LAG = 8.f;
        float both[2];
        bool near = true;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            both[half] = fmaxf(tile_max[half], smem.tile_max[1 - group_id][local_row + 8 * half]);
            near = near && (row_max[half] == FLASH_NEG_INF ? both[half] == FLASH_NEG_INF
                                                          : fmaf(both[half], score_log2, -row_max_scaled[half]) <= MAX_LAG);
        }
        const bool moved = !__all_sync(0xffffffffu, near);
        float2 rescale = make_float2(1.f, 1.f);
        if (moved) {
            rescale.x = raise_row_max(row_max[0], row_max_scaled[0], both[0], score_log2);
            rescale.y = raise_row_max(row_max[1], row_max_scaled[1], both[1], score_log2);
        }
        // P of this warpgroup's keys and its part of the row sums.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < GROUP_KEYS / 2; ++j) {
                if (accumulator_half(j) != half) continue;
                s[j] = exp2f(fmaf(s[j], score_log2, -row_max_scaled[half]));
                sum += s[j];
            }
            row_sum[half] = row_sum[half] * (half ? rescale.y : rescale.x) + sum;
        }
        // P into the shared tile: pa[kk] is four 8 x 8 tiles, (rows + 0, + 8) x (keys 16kk, 16kk + 8)
        // of this warpgroup's keys; stmatrix writes tile L / 8's row L % 8 at lane L's address.
        unsigned int pa[GROUP_KEYS / 16][4];
        accumulator_to_a<T, GROUP_KEYS>(pa, s);
#pragma unroll
        for (int kk = 0; kk < GROUP_KEYS / 16; ++kk) {
            const int quarter = lane / 8;
            const unsigned int offset = swizzled_offset(16 * warp + 8 * (quarter & 1) + lane % 8,
                                                        GROUP_KEYS * group_id + 16 * kk + 8 * (quarter >> 1));
            stmatrix_x4(p_tile + offset, pa[kk]);
        }
        fence_async_shared();   // the writes, before the products read them
        named_barrier_sync(SCORES_BARRIER, MLA_SM90_THREADS);   // both halves of P are written

        if (moved) rescale_rows(o, rescale);
        // O_w += P V_w: A is P (rows x keys, K-major), B this warpgroup's v columns of the tile
        // (keys x columns, N-major: 64-column chunks CHUNK_BYTES apart, a k16 step two 8-key atoms).
        const unsigned long long p_desc = k_major_descriptor(p_tile);
        const unsigned long long v_desc = n_major_descriptor(k_tile + (GROUP_COLUMNS / SWIZZLE_ROW_ELEMENTS) * group_id * CHUNK_BYTES,
                                                             CHUNK_BYTES);
        warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < KEYS / 16; ++kk)
            Wgmma<T, GROUP_COLUMNS>::template ss<1>(o, advance_descriptor(p_desc, kk * 32),
                                                    advance_descriptor(v_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
        warpgroup_commit();
        warpgroup_wait<0>();
        hold_registers(o);
        __syncthreads();   // both warpgroups are done with this stage and P before they are rewritten
    }
    cp_async_wait<0>();

    // Rows local_row and local_row + 8: the row's total over both warpgroups' keys, lse and
    // 1 / total; this warpgroup's O columns stored (float32 partials with several splits, else T);
    // the first warpgroup writes lse.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
        row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
        if (t == 0) smem.row_sum[group_id][local_row + 8 * half] = row_sum[half];
    }
    named_barrier_sync(SCORES_BARRIER, MLA_SM90_THREADS);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float total = row_sum[half] + smem.row_sum[1 - group_id][local_row + 8 * half];
        const float2 lse_inv = finish_row<0>(p, row_head[half], row_max[half], row_max_scaled[half], total);
        if (local_row + 8 * half >= row_count) continue;
        const long long token = row_token[half], head = row_head[half];
        if (group_id == 0 && t == 0) store_row_lse(p, split, b, head, token, lse_inv.x);
#pragma unroll
        for (int i = 0; i < GROUP_COLUMNS / 8; ++i) {
            const int c = GROUP_COLUMNS * group_id + 8 * i + 2 * t;
            if (c >= head_dim_v) continue;
            store_row_pair<T>(p, split, b, token, head, head_dim_v, c, o[4 * i + 2 * half] * lse_inv.y,
                              o[4 * i + 2 * half + 1] * lse_inv.y);
        }
    }
}
