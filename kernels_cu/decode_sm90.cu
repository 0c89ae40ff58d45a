// MLA decoding on Hopper (sm_90a, wgmma): DeepSeek's latent cache (k rows of MLA_SM90_D_TILE = 576
// columns, v the first head_dim_v <= 512 of each, one K/V head), 16-bit or FP8 (e4m3) caches.
//
//   flash_mla_decode_sm90_kernel  one block per (split, 64 rows, batch, K/V head), as
//                                 flash_mla_decode_kernel's grid (decode.cu), so the plan, the
//                                 partials and the combine are the same
//
// Why wgmma: with 128 query heads a key of the cache meets 64 rows in a block, so decoding is
// compute-bound (docs/performance.md, MLA decoding), and mma.sync kernels re-read Q from shared
// memory for every 16 rows (150 TFLOP/s). Here Q stays in shared memory once per block as wgmma's
// A operand.
//
// The block's 256 threads are two warpgroups with different jobs (FlashMLA's division), over tiles
// of MLA_SM90_KEYS = 64 keys in two stages:
//   warpgroup 0  S = Q K^T for the whole tile (m64n64k16 x 36), the online softmax (it alone
//                keeps the rows' maxima and sums), P into the shared P tile with the rows' rescale
//                factors, then O over v's columns 0-255 += P V with P from its registers
//   warpgroup 1  the copies (Q, then each tile into the stage freed by both warpgroups), and O
//                over v's columns 256-511 += P V with P from the shared tile
// So warpgroup 0's scores of tile i + 1 run while warpgroup 1 multiplies tile i's P. A tile whose
// keys all count comes by TMA (k_map: boxes of 64 columns x 64 keys, or a page's keys where pages
// are shorter), completing on the stage's mbarrier; the last tile, past the split's or sequence's
// end, by cp.async with the rows past it zero-filled (a cache row past a sequence's length may
// hold anything, NaN too, and P = 0 does not cancel NaN in P V), published on a named barrier after
// fence.proxy.async (cp.async writes are generic-proxy writes, wgmma reads through the async
// proxy). P and its rescale factors (ordinary shared-memory writes that warpgroup 1 reads) are
// handed over on mbarriers (p_full, p_empty: arrive releases, the wait acquires); the other
// hand-overs are named barriers that one warpgroup arrives at and the other waits at (SYNC_*
// below; both waiting, from the two warpgroups' different code, is what compute-sanitizer's
// synccheck calls divergent). V is the tile's first 512 columns, read N-major. Tiles are 128-byte
// swizzled [rows][64 columns] chunks (sm90_mma.cuh), as TMA's 128-byte swizzle writes them.
//
// An FP8 cache (FP8_CACHE: e4m3 rows, a descale per (sequence, K/V head)): the products run in fp16
// (DecodeProducts; a bf16 Q's rows scaled into fp16's range by warpgroup 1 once Q lands). A tile's
// raw rows land unswizzled, chunk-major ([9 chunks][64 keys][64 bytes]), in the upper half of its
// 16-bit stage, and warpgroup 1 expands them in place into the swizzled fp16 tile (exact: every
// e4m3 value is an fp16) one tile ahead of its own P V, handing each over on the stage's
// `converted` mbarrier. k's descale multiplies the scores, v's the output.

#include "common.cuh"
#include "decode_common.cuh"
#include "fp8_values.cuh"
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
    static constexpr int GROUP_COLUMNS = DV_TILE / 2;             // v columns of each warpgroup's O
    static constexpr int CHUNK_BYTES = ROWS * 128;                // one [64 rows][64 columns] 16-bit chunk
    static constexpr int THREADS = MLA_SM90_THREADS;
    // Named barriers (0 is __syncthreads'), each between the two warpgroups: one arrives, the other
    // waits. Each alternates strictly (a warpgroup arrives again only after the other has waited).
    static constexpr int SYNC_Q_READY = 1;     // Q and the first two tiles' cp.async copies landed
    static constexpr int SYNC_TILE_FULL = 2;   // the last tile's cp.async copies landed (the third tile on)
    static constexpr int SYNC_STAGE_FREE = 3;  // warpgroup 0's products have read a stage
    static constexpr int SYNC_COPIER = 4;      // warpgroup 1 alone (an FP8 tile's expansion)
    // An FP8 tile's raw rows in its 16-bit stage: chunk c (64 bytes of each of the 64 keys) at
    // RAW_OFFSET + c * RAW_CHUNK_BYTES. Expanding chunks 0-3 writes below RAW_OFFSET; chunks 4-8 are
    // read whole before any of their fp16 chunks (which overlap raw chunks 0-8) is written.
    static constexpr int RAW_CHUNK_BYTES = KEYS * SWIZZLE_ROW_ELEMENTS;
    static constexpr int RAW_OFFSET = CHUNKS * CHUNK_BYTES - CHUNKS * RAW_CHUNK_BYTES;
    static constexpr int RAW_FIRST_CHUNKS = 4;   // expanded straight through: 4 x CHUNK_BYTES <= RAW_OFFSET
    static_assert(RAW_FIRST_CHUNKS * CHUNK_BYTES <= RAW_OFFSET, "the first chunks' fp16 rows below the raw ones");
    static_assert(THREADS == 256 && KEYS == ROWS, "two warpgroups; Q and key chunks of the same shape");
    static_assert(16 * MLA_DECODE_ROW_TILES == ROWS, "flash_mla_decode_kernel's grid (decode.py counts its blocks)");
    static_assert(D_TILE % SWIZZLE_ROW_ELEMENTS == 0 && GROUP_COLUMNS % SWIZZLE_ROW_ELEMENTS == 0, "whole chunks");

    template <typename T>
    struct Storage {
        alignas(SWIZZLE_ATOM_BYTES) T q[CHUNKS][ROWS][SWIZZLE_ROW_ELEMENTS];
        alignas(SWIZZLE_ATOM_BYTES) T k[2][CHUNKS][KEYS][SWIZZLE_ROW_ELEMENTS];   // two stages
        alignas(SWIZZLE_ATOM_BYTES) T p[ROWS][KEYS];                               // P of the tile, swizzled
        float row_scale[ROWS];   // the rows' O rescale factors of the tile; at the end 1 / row sum
        int moved[4];            // per warp: whether its rows' factors are not all 1
        unsigned long long tile_full[2];   // per stage: its TMA copies landed
        unsigned long long p_full;         // a tile's P and factors written (warpgroup 0's 128 arrivals)
        unsigned long long p_empty;        // ... and read (warpgroup 1's 128 arrivals)
        unsigned long long converted[2];   // FP8 cache: per stage, its tile expanded (warpgroup 1's 128 arrivals)
        float row_unscale[ROWS];           // FP8 cache, bf16 Q: 2^-s of each row scaled into fp16's range
    };
};

// Dynamic shared memory a launch must give (read by the launcher from the compiled module, so the
// size is stated once, as forward_sm90_smem_bytes): the storage and room to align it.
template <typename T>
__device__ const unsigned int mla_decode_sm90_smem_bytes = sizeof(MlaSm90Shape::Storage<T>) + SWIZZLE_ATOM_BYTES;

// Byte offset of 16-byte chunk `c` (of CHUNKS x 8) of row r in a swizzled [CHUNKS][64 rows][64] tile.
__device__ __forceinline__ unsigned int mla_chunk_offset(int r, int c) {
    return (unsigned int)(c >> 3) * MlaSm90Shape::CHUNK_BYTES + swizzled_offset(r, (c & 7) * 8);
}

// The same chunk as a shared address.
__device__ __forceinline__ unsigned int mla_chunk_address(unsigned int tile, int r, int c) {
    return tile + mla_chunk_offset(r, c);
}

// 16 e4m3 values as 16 fp16, exactly: two 16-byte chunks.
__device__ __forceinline__ void e4m3x16_to_f16(const uint4& bytes, uint4& lo, uint4& hi) {
    lo = make_uint4(e4m3x2_to_f16x2(bytes.x), e4m3x2_to_f16x2(bytes.x >> 16), e4m3x2_to_f16x2(bytes.y),
                    e4m3x2_to_f16x2(bytes.y >> 16));
    hi = make_uint4(e4m3x2_to_f16x2(bytes.z), e4m3x2_to_f16x2(bytes.z >> 16), e4m3x2_to_f16x2(bytes.w),
                    e4m3x2_to_f16x2(bytes.w >> 16));
}

template <typename T, bool IS_CAUSAL, bool FP8_CACHE>
__global__ void __launch_bounds__(MLA_SM90_THREADS, 1)
flash_mla_decode_sm90_kernel(const __grid_constant__ TensorMap k_map, const FlashParams p) {
    using Shape = MlaSm90Shape;
    // The products' type: T, or fp16 on an FP8 cache (DecodeProducts).
    using CT = typename DecodeProducts<T, FP8_CACHE>::type;
    constexpr bool Q_TO_F16 = DecodeProducts<T, FP8_CACHE>::q_to_f16;
    constexpr int ROWS = Shape::ROWS, KEYS = Shape::KEYS, D_TILE = Shape::D_TILE, CHUNKS = Shape::CHUNKS;
    constexpr int GROUP_COLUMNS = Shape::GROUP_COLUMNS, CHUNK_BYTES = Shape::CHUNK_BYTES, THREADS = Shape::THREADS;
    constexpr int SYNC_Q_READY = Shape::SYNC_Q_READY, SYNC_TILE_FULL = Shape::SYNC_TILE_FULL;
    constexpr int SYNC_STAGE_FREE = Shape::SYNC_STAGE_FREE, SYNC_COPIER = Shape::SYNC_COPIER;
    using Tile = Shape::Storage<CT>;
    static_assert(sizeof(Tile) + SWIZZLE_ATOM_BYTES <= SM90_BLOCK_SMEM_BYTES, "shared memory of one sm_90 block");
    require_dynamic_smem(sizeof(Tile) + SWIZZLE_ATOM_BYTES);
    extern __shared__ unsigned char smem_raw[];
    Tile& smem = aligned_shared_storage<Tile>(smem_raw);

    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, thread = threadIdx.x & 127;
    const bool scorer = threadIdx.x < 128;   // warpgroup 0
    const int g = lane >> 2, t = lane & 3;
    const MlaBlock block = mla_block<ROWS>(p);
    const long long group = block.group, b = block.b, kv_head = block.kv_head;
    const int rows_per_kv_head = block.rows_per_kv_head, split = block.split, row0 = block.row0, row_count = block.row_count;
    const int head_dim = (int)p.head_dim, head_dim_v = (int)p.head_dim_v;
    if (threadIdx.x == 128) {
        barrier_init(smem_addr(&smem.tile_full[0]), 1);
        barrier_init(smem_addr(&smem.tile_full[1]), 1);
        barrier_init(smem_addr(&smem.p_full), 128);
        barrier_init(smem_addr(&smem.p_empty), 128);
        if (FP8_CACHE) {
            barrier_init(smem_addr(&smem.converted[0]), 128);
            barrier_init(smem_addr(&smem.converted[1]), 128);
        }
        barrier_init_fence();
    }
    __syncthreads();
    // Launched early (_launch.py): nothing is read before the kernel ahead has finished.
    wait_for_predecessor();
    allow_dependents();

    const MlaKeys keys = mla_keys<IS_CAUSAL>(p, block);
    const Band band = keys.band;
    const int key_begin = keys.key_begin, key_end = keys.key_end;
    const int first_tile = key_begin & ~(KEYS - 1);
    const int tiles = first_tile < key_end ? (key_end - first_tile + KEYS - 1) / KEYS : 0;
    int row_token[2];
    long long row_head[2];
    float row_slope[2];
    thread_rows<0>(p, b, kv_head, group, row0 + 16 * warp, g, rows_per_kv_head, row_token, row_head, row_slope);
    const int local_row = 16 * warp + g;   // this thread's rows (both warpgroups): local_row and local_row + 8
    const unsigned int q_tile = smem_addr(&smem.q[0][0][0]), p_tile = smem_addr(&smem.p[0][0]);
    auto stage_tile = [&](int stage) { return smem_addr(&smem.k[stage][0][0][0]); };
    // Tile i: by TMA where its keys all count (then the parity of its stage's barrier), else (the
    // last) by cp.async.
    auto whole = [&](int i) { return first_tile + (i + 1) * KEYS <= key_end; };
    auto tile_parity = [&](int i) { return (unsigned int)((i >> 1) & 1); };
    float k_scale = 1.f, v_scale = 1.f;   // an FP8 cache's descales of this sequence's K/V head
    if constexpr (FP8_CACHE) {
        const long long at = b * (p.heads / p.group) + kv_head;   // (batch, heads_kv)
        k_scale = p.k_descale[at];
        v_scale = p.v_descale[at];
    }

    float o[GROUP_COLUMNS / 2];   // this warpgroup's O columns
#pragma unroll
    for (int i = 0; i < GROUP_COLUMNS / 2; ++i) o[i] = 0.f;
    // This warpgroup's v columns in a stage, for O += P V (keys x columns, N-major: 64-column chunks
    // CHUNK_BYTES apart, a k16 step two 8-key atoms).
    const unsigned int v_offset = (scorer ? 0u : (unsigned int)(GROUP_COLUMNS / SWIZZLE_ROW_ELEMENTS)) * CHUNK_BYTES;

    float row_inv[2] = {0.f, 0.f};   // 1 / the rows' sums (warpgroup 0's, handed to warpgroup 1)
    if (scorer) {
        // ---- warpgroup 0: scores, softmax, P, O's first half ------------------------------------
        float row_max[2] = {FLASH_NEG_INF, FLASH_NEG_INF}, row_max_scaled[2] = {0.f, 0.f}, row_sum[2] = {0.f, 0.f};
        const float score_log2 = score_to_log2<0>(p);
        float s[KEYS / 2];
        unsigned int pa[KEYS / 16][4];
        if (tiles > 0) named_barrier_sync(SYNC_Q_READY, THREADS);
        // FP8 cache: the scores' factors of this thread's rows (k's descale; a bf16 Q's row scales).
        float score_factor[2] = {k_scale, k_scale};
        if constexpr (Q_TO_F16) {
            score_factor[0] *= smem.row_unscale[local_row];
            score_factor[1] *= smem.row_unscale[local_row + 8];
        }
#pragma unroll 1
        for (int i = 0; i < tiles; ++i) {
            const int stage = i & 1, tile_start = first_tile + i * KEYS;
            // The last tile's P V done: its stage is free for warpgroup 1's next copies, which then
            // start while S runs.
            warpgroup_wait<0>();
            hold_registers(o);
            if (i >= 1 && i + 1 < tiles) named_barrier_arrive(SYNC_STAGE_FREE, THREADS);   // tile i - 1's stage
            if (FP8_CACHE) barrier_wait(smem_addr(&smem.converted[stage]), tile_parity(i));
            else if (whole(i)) barrier_wait(smem_addr(&smem.tile_full[stage]), tile_parity(i));
            else if (i >= 2) named_barrier_sync(SYNC_TILE_FULL, THREADS);
            warpgroup_arrive();
            mma_k_major<CT, KEYS, D_TILE>(s, q_tile, CHUNK_BYTES, stage_tile(stage), CHUNK_BYTES);
            warpgroup_commit();
            warpgroup_wait<0>();
            hold_registers(s);
            if constexpr (FP8_CACHE) {
#pragma unroll
                for (int j = 0; j < KEYS / 2; ++j) s[j] *= score_factor[accumulator_half(j)];
            }

            // The mask (the split's keys, the causal band) and the rows' maxima over the tile.
            float tile_max[2] = {FLASH_NEG_INF, FLASH_NEG_INF};
#pragma unroll
            for (int j = 0; j < KEYS / 2; ++j) {
                const int half = accumulator_half(j);
                const int key = tile_start + accumulator_col(j) + 2 * t;
                const bool visible = key < key_end && key >= key_begin && (!IS_CAUSAL || key - row_token[half] <= band.right);
                s[j] = visible ? s[j] : FLASH_NEG_INF;
                tile_max[half] = fmaxf(tile_max[half], s[j]);
            }
            // The running max moves only when a row's max passes it by more than MAX_LAG (log2
            // units), as RowSoftmax in forward_sm90.cu: P stays below 2^MAX_LAG (in range for 16-bit
            // P), O and lse are exact for any reference, and O is rescaled rarely.
            constexpr float MAX_LAG = 8.f;
            bool near = true;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 1));
                tile_max[half] = fmaxf(tile_max[half], __shfl_xor_sync(0xffffffffu, tile_max[half], 2));
                near = near && (row_max[half] == FLASH_NEG_INF ? tile_max[half] == FLASH_NEG_INF
                                                              : fmaf(tile_max[half], score_log2, -row_max_scaled[half]) <= MAX_LAG);
            }
            const bool moved = !__all_sync(0xffffffffu, near);
            float2 rescale = make_float2(1.f, 1.f);
            if (moved) {
                rescale.x = raise_row_max(row_max[0], row_max_scaled[0], tile_max[0], score_log2);
                rescale.y = raise_row_max(row_max[1], row_max_scaled[1], tile_max[1], score_log2);
            }
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < KEYS / 2; ++j) {
                    if (accumulator_half(j) != half) continue;
                    s[j] = exp2f(fmaf(s[j], score_log2, -row_max_scaled[half]));
                    sum += s[j];
                }
                row_sum[half] = row_sum[half] * (half ? rescale.y : rescale.x) + sum;
            }
            accumulator_to_a<CT, KEYS>(pa, s);

            // P and the factors for warpgroup 1, once its products have read the last ones: pa[kk]
            // is four 8 x 8 tiles, (rows + 0, + 8) x (keys 16kk, 16kk + 8); stmatrix writes tile
            // L / 8's row L % 8 at lane L's address.
            if (i >= 1) barrier_wait(smem_addr(&smem.p_empty), (unsigned int)((i - 1) & 1));
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; ++kk) {
                const int quarter = lane / 8;
                stmatrix_x4(p_tile + swizzled_offset(16 * warp + 8 * (quarter & 1) + lane % 8, 16 * kk + 8 * (quarter >> 1)),
                            pa[kk]);
            }
            if (t == 0) {
                smem.row_scale[local_row] = rescale.x;
                smem.row_scale[local_row + 8] = rescale.y;
            }
            if (lane == 0) smem.moved[warp] = moved;
            fence_async_shared();   // P's writes, before warpgroup 1's products read them
            barrier_arrive(smem_addr(&smem.p_full));

            if (moved) rescale_rows(o, rescale);
            const unsigned long long v_desc = n_major_descriptor(stage_tile(stage) + v_offset, CHUNK_BYTES);
            warpgroup_arrive();
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; ++kk)
                Wgmma<CT, GROUP_COLUMNS>::template rs<1>(o, pa[kk], advance_descriptor(v_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
            warpgroup_commit();
        }
        warpgroup_wait<0>();
        hold_registers(o);

        // The rows' totals: lse (stored here) and 1 / total for both warpgroups' O, handed over as
        // one more tile's factors (once warpgroup 1 has read the last tile's).
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
            row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
            const float2 lse_inv = finish_row<0>(p, row_head[half], row_max[half], row_max_scaled[half], row_sum[half]);
            row_inv[half] = lse_inv.y * v_scale;   // (v_scale 1 but for an FP8 cache)
            if (t == 0 && local_row + 8 * half < row_count) store_row_lse(p, split, b, row_head[half], row_token[half], lse_inv.x);
        }
        if (tiles > 0) barrier_wait(smem_addr(&smem.p_empty), (unsigned int)((tiles - 1) & 1));
        if (t == 0) {
            smem.row_scale[local_row] = row_inv[0];
            smem.row_scale[local_row + 8] = row_inv[1];
        }
        barrier_arrive(smem_addr(&smem.p_full));
    } else {
        // ---- warpgroup 1: the copies, O's second half ---------------------------------------
        // 4 threads a row (a warp reads 8 rows of 64 contiguous bytes), 32 rows a pass; thread
        // part c takes the row's 16-byte chunks c, c + 4, ...
        const int copy_row = thread / 4, copy_part = thread % 4;
        constexpr int ROW_CHUNKS = D_TILE / 8;
#pragma unroll 1
        for (int pass = 0; pass < ROWS / 32; ++pass) {
            const int r = copy_row + 32 * pass, row = row0 + r;
            const bool row_valid = r < row_count;
            const T* src = static_cast<const T*>(p.q) +
                           (row_valid ? tensor_offset(p.q_strides, b, row / group, kv_head * group + row % group) : 0);
#pragma unroll
            for (int m = 0; m < ROW_CHUNKS / 4; ++m) {
                const int c = copy_part + 4 * m;
                const bool ok = row_valid && 8 * c < head_dim;
                cp_async_16(mla_chunk_address(q_tile, r, c), src + (ok ? 8 * c : 0), ok);
            }
        }
        const T* k = static_cast<const T*>(p.k);
        const unsigned long long read_once = l2_evict_first_policy();
        // Keys of one TMA box: 64, or a page's where pages are shorter (cupy_flash/decode.py encodes
        // k_map's box so).
        const int box_keys = p.block_table != nullptr ? min(KEYS, 1 << p.page_shift) : KEYS;
        // One thread's TMA copies of whole tile i into its stage (an FP8 tile's raw rows into the
        // stage's upper half, chunk-major, unswizzled: k_map's boxes are 64 bytes wide).
        auto issue_tma = [&](int i) {
            const int stage = i & 1;
            const unsigned int dst = stage_tile(stage), bar = smem_addr(&smem.tile_full[stage]);
            barrier_arrive_expect(bar, KEYS * D_TILE * (FP8_CACHE ? 1u : (unsigned int)sizeof(T)));
            for (int box = 0; box < KEYS; box += box_keys) {
                const int key = first_tile + i * KEYS + box;
                int row = key, outer = (int)b;   // a contiguous cache: (key, batch)
                if (p.block_table != nullptr) {   // a paged one: (row in page, page)
                    outer = (int)p.block_table[b * p.block_table_stride + (key >> p.page_shift)];
                    row = key & ((1 << p.page_shift) - 1);
                }
#pragma unroll
                for (int c = 0; c < CHUNKS; ++c) {
                    const unsigned int chunk = FP8_CACHE ? dst + Shape::RAW_OFFSET + c * Shape::RAW_CHUNK_BYTES + box * SWIZZLE_ROW_ELEMENTS
                                                         : dst + c * CHUNK_BYTES + box * 128;
                    tma_load_4d(chunk, &k_map, bar, c * SWIZZLE_ROW_ELEMENTS, row, (int)kv_head, outer);
                }
            }
        };
        // Tile i into its stage: whole, by TMA (one thread); else every thread's cp.async copies
        // (uncommitted), zeros past key_end and head_dim.
        auto load_tile = [&](int i) {
            const int tile_start = first_tile + i * KEYS;
            const unsigned int dst = stage_tile(i & 1);
            if (whole(i)) {
                if (thread == 0) issue_tma(i);
                __syncwarp();   // the warp whole again before its next barrier
                return;
            }
            if constexpr (FP8_CACHE) {   // raw rows as TMA lays them out: thread part c takes 16-byte units c, c + 4, ...
                const unsigned char* k8 = static_cast<const unsigned char*>(p.k);
                const unsigned int raw = dst + Shape::RAW_OFFSET;
#pragma unroll
                for (int pass = 0; pass < KEYS / 32; ++pass) {
                    const int r = copy_row + 32 * pass, key = tile_start + r;
                    const bool key_valid = key < key_end;
                    const unsigned char* src = k8 + (key_valid ? cache_offset(p, p.k_strides, b, key, kv_head) : 0);
#pragma unroll
                    for (int m = 0; m < D_TILE / 64; ++m) {
                        const int u = copy_part + 4 * m;
                        const bool ok = key_valid && 16 * u < head_dim;
                        cp_async_16_once(raw + (u >> 2) * Shape::RAW_CHUNK_BYTES + r * SWIZZLE_ROW_ELEMENTS + (u & 3) * 16,
                                         src + (ok ? 16 * u : 0), ok, read_once);
                    }
                }
            } else {
#pragma unroll
                for (int pass = 0; pass < KEYS / 32; ++pass) {
                    const int r = copy_row + 32 * pass, key = tile_start + r;
                    const bool key_valid = key < key_end;
                    const T* src = k + (key_valid ? cache_offset(p, p.k_strides, b, key, kv_head) : 0);
#pragma unroll
                    for (int m = 0; m < ROW_CHUNKS / 4; ++m) {
                        const int c = copy_part + 4 * m;
                        const bool ok = key_valid && 8 * c < head_dim;
                        cp_async_16_once(mla_chunk_address(dst, r, c), src + (ok ? 8 * c : 0), ok, read_once);
                    }
                }
            }
        };
        // FP8 cache: tile i's raw rows expanded in place into the stage's fp16 tile, for both
        // warpgroups' products (`converted`). Unit (thread + 128 m) of the raw tile: chunk m / 2,
        // key thread / 4 + 32 (m % 2), 16 bytes at thread % 4; units of chunks 0 to RAW_FIRST_CHUNKS
        // - 1 are expanded as read, the rest all read before any is written (Shape::RAW_OFFSET).
        auto convert_tile = [&](int i) {
            const int stage = i & 1;
            if (whole(i)) {
                barrier_wait(smem_addr(&smem.tile_full[stage]), tile_parity(i));
            } else {   // the copies of every thread of this warpgroup
                cp_async_wait<0>();
                named_barrier_sync(SYNC_COPIER, 128);
            }
            unsigned char* tile = reinterpret_cast<unsigned char*>(&smem.k[stage][0][0][0]);
            const int key = thread / 4, unit = thread % 4;
            auto raw_unit = [&](int m) {
                return *reinterpret_cast<const uint4*>(tile + Shape::RAW_OFFSET + (m >> 1) * Shape::RAW_CHUNK_BYTES +
                                                       (key + 32 * (m & 1)) * SWIZZLE_ROW_ELEMENTS + unit * 16);
            };
            auto store_unit = [&](int m, const uint4& bytes) {
                uint4 lo, hi;
                e4m3x16_to_f16(bytes, lo, hi);
                const int r = key + 32 * (m & 1), c = (m >> 1) * 8 + 2 * unit;   // c: the fp16 row's 16-byte chunk
                *reinterpret_cast<uint4*>(tile + mla_chunk_offset(r, c)) = lo;
                *reinterpret_cast<uint4*>(tile + mla_chunk_offset(r, c + 1)) = hi;
            };
            constexpr int FIRST_UNITS = 2 * Shape::RAW_FIRST_CHUNKS, UNITS = 2 * CHUNKS;
#pragma unroll
            for (int m = 0; m < FIRST_UNITS; ++m) store_unit(m, raw_unit(m));
            uint4 held[UNITS - FIRST_UNITS];
#pragma unroll
            for (int m = FIRST_UNITS; m < UNITS; ++m) held[m - FIRST_UNITS] = raw_unit(m);
            named_barrier_sync(SYNC_COPIER, 128);
#pragma unroll
            for (int m = FIRST_UNITS; m < UNITS; ++m) store_unit(m, held[m - FIRST_UNITS]);
            fence_async_shared();   // the generic writes, before the products' async-proxy reads
            barrier_arrive(smem_addr(&smem.converted[stage]));
        };
        // Q and a cp.async tile among the first two landed for this thread, visible to wgmma, then
        // for warpgroup 0.
        if (tiles > 0) load_tile(0);
        if (tiles > 1) load_tile(1);
        cp_async_commit();
        cp_async_wait<0>();
        if constexpr (Q_TO_F16) {   // this thread's Q chunks into fp16, each row times 2^s (scale_q_rows_to_f16)
            unsigned char* q_bytes = reinterpret_cast<unsigned char*>(&smem.q[0][0][0]);
#pragma unroll 1
            for (int pass = 0; pass < ROWS / 32; ++pass) {
                const int r = copy_row + 32 * pass;
                float largest = 0.f;
#pragma unroll
                for (int m = 0; m < ROW_CHUNKS / 4; ++m) {
                    const uint4 v = *reinterpret_cast<const uint4*>(q_bytes + mla_chunk_offset(r, copy_part + 4 * m));
                    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        largest = fmaxf(largest, fmaxf(fabsf(__uint_as_float(words[e] << 16)),
                                                       fabsf(__uint_as_float(words[e] & 0xffff0000u))));
                }
                largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));   // the row's 4 threads
                largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
                const F16RowScale scale = f16_row_scale(largest);
                const float scale_first = power_of_two(scale.first), scale_second = power_of_two(scale.second);
                auto f16x2 = [&](unsigned int w) {
                    const float lo = __uint_as_float(w << 16) * scale_first * scale_second;
                    const float hi = __uint_as_float(w & 0xffff0000u) * scale_first * scale_second;
                    return (unsigned int)from_float<fa_f16>(lo).bits | ((unsigned int)from_float<fa_f16>(hi).bits << 16);
                };
#pragma unroll
                for (int m = 0; m < ROW_CHUNKS / 4; ++m) {
                    uint4* chunk = reinterpret_cast<uint4*>(q_bytes + mla_chunk_offset(r, copy_part + 4 * m));
                    const uint4 v = *chunk;
                    *chunk = make_uint4(f16x2(v.x), f16x2(v.y), f16x2(v.z), f16x2(v.w));
                }
                if (copy_part == 0) smem.row_unscale[r] = scale.unscale();
            }
        }
        fence_async_shared();
        if (tiles > 0) named_barrier_arrive(SYNC_Q_READY, THREADS);
        if (FP8_CACHE && tiles > 0) convert_tile(0);
        const unsigned long long p_desc = k_major_descriptor(p_tile);
#pragma unroll 1
        for (int i = 0; i < tiles; ++i) {
            const int stage = i & 1;
            if (FP8_CACHE && i + 1 < tiles) convert_tile(i + 1);   // while warpgroup 0 scores tile i
            barrier_wait(smem_addr(&smem.p_full), (unsigned int)(i & 1));
            if (FP8_CACHE) barrier_wait(smem_addr(&smem.converted[stage]), tile_parity(i));
            else if (whole(i)) barrier_wait(smem_addr(&smem.tile_full[stage]), tile_parity(i));
            if (smem.moved[warp]) rescale_rows(o, make_float2(smem.row_scale[local_row], smem.row_scale[local_row + 8]));
            const unsigned long long v_desc = n_major_descriptor(stage_tile(stage) + v_offset, CHUNK_BYTES);
            warpgroup_arrive();
#pragma unroll
            for (int kk = 0; kk < KEYS / 16; ++kk)
                Wgmma<CT, GROUP_COLUMNS>::template ss<1>(o, advance_descriptor(p_desc, kk * 32),
                                                        advance_descriptor(v_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
            warpgroup_commit();
            if (!FP8_CACHE && i + 1 >= 2 && i + 1 < tiles && !whole(i + 1)) {   // the last tile's cp.async copies, while the products run
                cp_async_wait<0>();
                fence_async_shared();
                named_barrier_arrive(SYNC_TILE_FULL, THREADS);
            }
            warpgroup_wait<0>();
            hold_registers(o);
            barrier_arrive(smem_addr(&smem.p_empty));   // (after the last tile: the totals may come)
            if (i + 2 < tiles) {   // tile i + 2 into this stage, once warpgroup 0's products have read it
                named_barrier_sync(SYNC_STAGE_FREE, THREADS);
                load_tile(i + 2);
                cp_async_commit();
            }
        }
        cp_async_wait<0>();
        barrier_wait(smem_addr(&smem.p_full), (unsigned int)(tiles & 1));   // the totals
        row_inv[0] = smem.row_scale[local_row];
        row_inv[1] = smem.row_scale[local_row + 8];
    }

    // This warpgroup's O columns of rows local_row and local_row + 8 (float32 partials with several
    // splits, else T).
    const int column0 = scorer ? 0 : GROUP_COLUMNS;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        if (local_row + 8 * half >= row_count) continue;
        const float inv = row_inv[half];
        const long long token = row_token[half], head = row_head[half];
#pragma unroll
        for (int c8 = 0; c8 < GROUP_COLUMNS / 8; ++c8) {
            const int c = column0 + 8 * c8 + 2 * t;
            if (c >= head_dim_v) continue;
            store_row_pair<T>(p, split, b, token, head, head_dim_v, c, o[4 * c8 + 2 * half] * inv, o[4 * c8 + 2 * half + 1] * inv);
        }
    }
}
