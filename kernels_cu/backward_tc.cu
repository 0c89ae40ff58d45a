// Tensor-core backward for float16 / bfloat16 (sm_80+): backward.cu's algorithm with the five
// products on mma.sync.m16n8k16 (fp32 accumulation). With the scores taken transposed (keys as
// rows, so each warp's rows are the key rows it also owns in dK and dV):
//   S^T  = K Q^T                       P^T  = exp2(S^T * scale_log2 - lse_log2[query])
//   dP^T = V dO^T                      dS^T = P^T * (dP^T - delta[query])
//   dV  += P^T dO     dK += dS^T Q     dQ  += dS K        (dK and dQ times softmax_scale at the end)
//
// One block per (key block, batch, head), key block slowest in the grid (so under the causal mask
// the blocks with the most query blocks start first). K and V stay in shared memory; the loop over
// query blocks streams Q, dO and the row statistics with 16-byte cp.async, STAGES = 2 loading block
// i+1 while block i computes. dK and dV accumulate in registers and are written once.
//
// Warps: each product has its own warp grid, since P^T and dS^T pass through shared memory anyway
// (as T). Scores: S_KEY_WARPS x (NUM_WARPS / S_KEY_WARPS) over keys x queries, each warp S_M
// m-tiles (16 keys) x S_N n-tiles (8 queries). dK, dV: KV_KEY_WARPS x (NUM_WARPS / KV_KEY_WARPS)
// over keys x head dim, each warp KV_M x KV_N tiles. dQ: (BLOCK_M / 16) x Q_SPLITS over queries x
// head dim. Warp tiles of 32 x 32 or 32 x 64 rather than 16 rows load each ldmatrix fragment for
// two mma's: with 16-row warp tiles the first version (0.53-0.75x FlashAttention-2) issued 0.75
// ldmatrix.x4 per mma and was bound by shared-memory bandwidth.
//
// dQ is added into the float32 dq_accum with red.global (2 floats per instruction on sm_90). With
// p.dq_semaphore (deterministic mode) the key blocks of one (batch, head) add to each query block
// strictly in key-block order, each waiting on a counter for its turn: the sum's order is fixed, so
// the result is bitwise reproducible. A block only ever waits on blocks of lower grid index, which
// the hardware dispatches first, so the wait cannot deadlock. A block publishes its adds to query
// block i one iteration late, just before its own turn at block i + 1: by then the reds have
// drained, so the fence costs little. Publishing right after the adds (every thread fencing) made
// deterministic mode 1.14-1.53x the atomic path; the fence stalled every warp on the reds' latency.

#include "common.cuh"
#include "tensor_core.cuh"

// The tile geometry (see the header): the row pitches, each product's warp grid, the passes that
// cap the accumulators live beside dK and dV, and the dynamic shared memory. (Enumerators rather
// than static constexpr members, which NVRTC would emit as unused device variables.)
template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES, int S_KEY_WARPS, int KV_KEY_WARPS,
          int FEATURES>
struct BackwardTilesTc {
    enum : int {
        LD = D_TILE + 8,            // K, V, Q, dO rows (padded: see forward_tc.cu)
        LDM = BLOCK_M + 8,          // P^T, dS^T rows (keys x queries)
        S_M = BLOCK_N / S_KEY_WARPS / 16,                   // m-tiles (16 keys) of S^T per warp
        S_N = BLOCK_M / (NUM_WARPS / S_KEY_WARPS) / 8,      // n-tiles (8 queries) of S^T per warp
        KV_M = BLOCK_N / KV_KEY_WARPS / 16,                 // m-tiles of dK and of dV per warp
        KV_N = D_TILE / (NUM_WARPS / KV_KEY_WARPS) / 8,     // n-tiles of dK and of dV per warp
        Q_TILES = BLOCK_M / 16,
        Q_SPLITS = NUM_WARPS / Q_TILES,
        DQ_TILES = D_TILE / Q_SPLITS / 8,      // n-tiles of dQ per warp
        // Accumulators live beside dK + dV (4 * KV_M * KV_N fp32 registers each) are capped per
        // thread by computing S^T / dP^T and dQ in passes over their columns; past these budgets,
        // ptxas's 255-register limit meant spills in some instantiation.
        KV_REGS = 8 * KV_M * KV_N,
        // Variant kernels (softcap / ALiBi / window) hold more per score element: at 192, the causal
        // ones spilled 88-276 bytes at d=64 and d=128; 160 keeps every instantiation spill-free.
        S_BUDGET = FEATURES ? 160 : 192,
        S_PASSES = KV_REGS + 8 * S_M * S_N <= S_BUDGET || S_N % 4 ? 1 : 2,
        S_PASS_N = S_N / S_PASSES,
        // (Four passes only above FLASH_WIDE_TILE, whose dQ rows are the widest.)
        DQ_PASSES = KV_REGS + 4 * DQ_TILES <= 160 ? 1 : D_TILE > FLASH_WIDE_TILE && KV_REGS + 2 * DQ_TILES > 160 ? 4 : 2,
        DQ_PASS_TILES = (DQ_TILES / 2 + DQ_PASSES - 1) / DQ_PASSES * 2,   // whole pairs
    };
    enum : unsigned int {
        SMEM_BYTES = (2 * BLOCK_N * LD + 2 * STAGES * BLOCK_M * LD + 2 * BLOCK_N * LDM) * sizeof(T)
                     + 2 * STAGES * BLOCK_M * sizeof(float)
    };
    static_assert(S_M >= 1 && KV_M >= 1 && NUM_WARPS % S_KEY_WARPS == 0 && NUM_WARPS % KV_KEY_WARPS == 0 &&
                  NUM_WARPS % Q_TILES == 0, "warp layout");
    static_assert(S_PASS_N % 2 == 0 && KV_N % 2 == 0 && DQ_TILES % 2 == 0, "ldmatrix.x4 loads n-tiles in pairs");
    static_assert(STAGES == 1 || STAGES == 2, "stages");
};

// Starts loading the key block's K and V tiles (cp.async).
template <typename T, int D_TILE, int BLOCK_N, int LD, int THREADS>
__device__ __forceinline__ void load_kv_tiles_tc(const FlashParams& p, T* k_tile, T* v_tile, long long b, long long h,
                                                 const Sequence& seq, int kv_start, int seqlen_k, int head_dim, int head_dim_v) {
    async_load_tile<T, BLOCK_N, D_TILE, LD, THREADS>(
        k_tile, static_cast<const T*>(p.k) + tensor_offset(p.k_strides, b, seq.k_row0 + kv_start, kv_head_of_wide(h, p)),
        p.k_strides[1], seqlen_k - kv_start, head_dim);
    async_load_tile<T, BLOCK_N, D_TILE, LD, THREADS>(
        v_tile, static_cast<const T*>(p.v) + tensor_offset(p.v_strides, b, seq.k_row0 + kv_start, kv_head_of_wide(h, p)),
        p.v_strides[1], seqlen_k - kv_start, head_dim_v);
}

// Zeroes the dK and dV accumulators.
template <int KV_M, int KV_N>
__device__ __forceinline__ void zero_dkdv_tc(float (&dk_acc)[KV_M][KV_N][4], float (&dv_acc)[KV_M][KV_N][4]) {
#pragma unroll
    for (int m = 0; m < KV_M; ++m)
#pragma unroll
        for (int j = 0; j < KV_N; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[m][j][e] = dv_acc[m][j][e] = 0.f;
}

// S^T = K Q^T and dP^T = V dO^T for the warp's S_M m-tiles of keys x S_PASS_N n-tiles of queries
// from pass_col on. a_k and a_v hold the K and V fragments of one k-step (the kernel's arrays: where
// they are declared changes the machine code).
template <typename T, int D_TILE, int LD, int S_M, int S_PASS_N>
__device__ __forceinline__ void scores_and_dp_tc(float (&s)[S_M][S_PASS_N][4], float (&dp)[S_M][S_PASS_N][4],
                                                 unsigned int (&a_k)[S_M][4], unsigned int (&a_v)[S_M][4], unsigned int k_a,
                                                 unsigned int v_a, unsigned int q_base, unsigned int do_base,
                                                 unsigned int qdo_b, int pass_col) {
#pragma unroll
    for (int m = 0; m < S_M; ++m)
#pragma unroll
        for (int j = 0; j < S_PASS_N; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[m][j][e] = dp[m][j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D_TILE / 16; ++kk) {
#pragma unroll
        for (int m = 0; m < S_M; ++m) {
            ldmatrix_x4(a_k[m], k_a + 2u * (16 * m * LD + kk * 16));
            ldmatrix_x4(a_v[m], v_a + 2u * (16 * m * LD + kk * 16));
        }
#pragma unroll
        for (int j = 0; j < S_PASS_N; j += 2) {
            unsigned int b_q[4], b_do[4];
            const unsigned int at = qdo_b + 2u * ((pass_col + j * 8) * LD + kk * 16);
            ldmatrix_x4(b_q, q_base + at);
            ldmatrix_x4(b_do, do_base + at);
#pragma unroll
            for (int m = 0; m < S_M; ++m) {
                mma_two_tiles<T>(s[m][j], s[m][j + 1], a_k[m], b_q);
                mma_two_tiles<T>(dp[m][j], dp[m][j + 1], a_v[m], b_do);
            }
        }
    }
}

// P^T = exp2(S^T * scale_log2 - lse_log2) (or of the modified scores) and dS^T = P^T * (dP^T - delta)
// of the warp's tiles, to shared memory as T (pt_tile, dst_tile); dS^T is also added into dbias.
template <typename T, int LDM, bool IS_CAUSAL, int FEATURES, int S_M, int S_PASS_N>
__device__ __forceinline__ void probs_and_ds_tc(float (&s)[S_M][S_PASS_N][4], float (&dp)[S_M][S_PASS_N][4],
                                                const FlashParams& p, long long b, long long h, const Sequence& seq,
                                                const ScoreMod<FEATURES>& mod, const Band& band, const float* lse_tile,
                                                const float* delta_tile, T* pt_tile, T* dst_tile, int pass_col, int kv_start,
                                                int s_key, int q_start, int g, int t, bool needs_mask, int seqlen_k) {
    // Masked only on blocks that cross the sequence end or the causal diagonal (rows past
    // seqlen_q need no mask: their lse_log2 is +inf, so P = 0, and delta = 0).
#pragma unroll
    for (int j = 0; j < S_PASS_N; ++j) {
        const int col = pass_col + j * 8 + 2 * t;
        const float2 lse = *reinterpret_cast<const float2*>(lse_tile + col);
        const float2 dsum = *reinterpret_cast<const float2*>(delta_tile + col);
#pragma unroll
        for (int m = 0; m < S_M; ++m) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kv_start + s_key + 16 * m + g + 8 * (e >> 1);
                const int query = q_start + col + (e & 1);
                const float row_lse_log2 = (e & 1) ? lse.y : lse.x;
                float prob = ScoreMod<FEATURES>::active
                                 ? exp2f(mod.log2_logit(s[m][j][e], query, key) - row_lse_log2)
                                 : exp2f(fmaf(s[m][j][e], p.scale_log2, -row_lse_log2));
                if (needs_mask && !key_visible<IS_CAUSAL, FEATURES>(key, query, seqlen_k, band)) prob = 0.f;
                const float ds = prob * (dp[m][j][e] - ((e & 1) ? dsum.y : dsum.x));
                add_dbias<FEATURES>(p, b, h, query, key, seq, ds);
                dp[m][j][e] = (FEATURES & FEATURE_SOFTCAP) ? ds * mod.grad_factor(s[m][j][e]) : ds;
                s[m][j][e] = prob;
            }
            // Row pitch LDM = BLOCK_M + 8 elements puts rows g = 0..7 in distinct 4-bank groups.
            T* pt_row = pt_tile + (s_key + 16 * m + g) * LDM + col;
            T* dst_row = dst_tile + (s_key + 16 * m + g) * LDM + col;
            *reinterpret_cast<unsigned int*>(pt_row) = Mma<T>::pack(s[m][j][0], s[m][j][1]);
            *reinterpret_cast<unsigned int*>(pt_row + 8 * LDM) = Mma<T>::pack(s[m][j][2], s[m][j][3]);
            *reinterpret_cast<unsigned int*>(dst_row) = Mma<T>::pack(dp[m][j][0], dp[m][j][1]);
            *reinterpret_cast<unsigned int*>(dst_row + 8 * LDM) = Mma<T>::pack(dp[m][j][2], dp[m][j][3]);
        }
    }
}

// dV += P^T dO and dK += dS^T Q for the warp's KV_M x KV_N tiles. a_p and a_ds hold the P^T and
// dS^T fragments of one k-step (the kernel's arrays, as in scores_and_dp_tc).
template <typename T, int BLOCK_M, int LD, int LDM, int KV_M, int KV_N>
__device__ __forceinline__ void accumulate_dkdv_tc(float (&dv_acc)[KV_M][KV_N][4], float (&dk_acc)[KV_M][KV_N][4],
                                                   unsigned int (&a_p)[KV_M][4], unsigned int (&a_ds)[KV_M][4],
                                                   unsigned int pt_a, unsigned int dst_a, unsigned int do_base,
                                                   unsigned int q_base, unsigned int qdo_bt) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
#pragma unroll
        for (int m = 0; m < KV_M; ++m) {
            ldmatrix_x4(a_p[m], pt_a + 2u * (16 * m * LDM + kk * 16));
            ldmatrix_x4(a_ds[m], dst_a + 2u * (16 * m * LDM + kk * 16));
        }
#pragma unroll
        for (int j = 0; j < KV_N; j += 2) {
            unsigned int b_do[4], b_q[4];
            ldmatrix_x4_trans(b_do, do_base + qdo_bt + 2u * (kk * 16 * LD + j * 8));
            ldmatrix_x4_trans(b_q, q_base + qdo_bt + 2u * (kk * 16 * LD + j * 8));
#pragma unroll
            for (int m = 0; m < KV_M; ++m) {
                mma_two_tiles<T>(dv_acc[m][j], dv_acc[m][j + 1], a_p[m], b_do);
                mma_two_tiles<T>(dk_acc[m][j], dk_acc[m][j + 1], a_ds[m], b_q);
            }
        }
    }
}

// Deterministic mode (semaphores set): publishes this key block's adds to the previous query block
// and waits for its turn at query block q_block.
template <int BLOCK_M, int BLOCK_N, bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ void take_dq_turn_tc(int* semaphores, int q_block, int q_block_begin, int kv_block,
                                                const Sequence& seq, int q_start, const Band& band) {
    if (semaphores != nullptr) {   // publish the previous block, wait for this one's turn
        if (threadIdx.x == 0) {
            if (q_block > q_block_begin) publish_dq(semaphores + q_block - 1);
            // This block's turn: after the key blocks of the query block's band that precede it.
            const int turn = (FEATURES & FEATURE_WINDOW)
                                 ? kv_block - kv_block_range<IS_CAUSAL, FEATURES>(seq, q_start, BLOCK_M, BLOCK_N, band).x
                                 : kv_block;
            wait_dq_turn(semaphores + q_block, turn);
        }
        __syncthreads();
    }
}

// dQ += dS K for the warp's 16 query rows and the DQ_PASS_TILES n-tiles (accumulators) of the pass
// from pass_tile on.
template <typename T, int BLOCK_N, int LD, int LDM, int DQ_TILES, int DQ_PASS_TILES>
__device__ __forceinline__ void dq_products_tc(float (&dq)[DQ_PASS_TILES][4], int pass_tile, unsigned int ds_at,
                                               unsigned int k_bt) {
#pragma unroll
    for (int j = 0; j < DQ_PASS_TILES; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        unsigned int a_ds[4];
        ldmatrix_x4_trans(a_ds, ds_at + 2u * kk * 16 * LDM);
#pragma unroll
        for (int j = 0; j < DQ_PASS_TILES; j += 2) {
            if (DQ_TILES % DQ_PASS_TILES == 0 || pass_tile + j < DQ_TILES) {
                unsigned int b_k[4];
                ldmatrix_x4_trans(b_k, k_bt + 2u * (kk * 16 * LD + (pass_tile + j) * 8));
                mma_two_tiles<T>(dq[j], dq[j + 1], a_ds, b_k);
            }
        }
    }
}

// Adds row g + 8 r of a pass of dQ (its columns below head_dim) to the row of dq_accum at `row`
// with red.global.
template <int DQ_TILES, int DQ_PASS_TILES>
__device__ __forceinline__ void add_dq_row_tc(const float (&dq)[DQ_PASS_TILES][4], int r, float* row, int pass_tile, int dq_col,
                                              int t, int head_dim) {
#pragma unroll
    for (int j = 0; j < DQ_PASS_TILES; ++j) {
        const int col = dq_col + (pass_tile + j) * 8 + 2 * t;
        if ((DQ_TILES % DQ_PASS_TILES == 0 || pass_tile + j < DQ_TILES) && col < head_dim)
            red_add_f32x2(row + col, dq[j][2 * r], dq[j][2 * r + 1]);
    }
}

// Deterministic mode, after the loop: publishes this key block's adds to its last query block (the
// block, its sequence and its query range found again from p).
template <int BLOCK_M, int BLOCK_N, bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ void publish_last_dq_tc(const FlashParams& p) {
    __syncthreads();
    const KeyBlock again = key_block_of(p, false);
    const Sequence again_seq = sequence_of<FEATURES>(p, again.b);
    const int2 range =
        q_block_range<IS_CAUSAL, FEATURES>(again_seq, again.kv_block * BLOCK_N, BLOCK_M, BLOCK_N, band_of(p, again_seq));
    if (threadIdx.x == 0 && range.x < range.y)
        publish_dq(dq_semaphores_of<BLOCK_M>(p, again.bh) + range.y - 1);
}

// Epilogue: dK (times softmax_scale) and dV as T, staged through the K and V tiles (each warp
// writes only its own rows and columns), then stored in 16-byte vectors.
template <typename T, int D_TILE, int BLOCK_N, int LD, int THREADS, int KV_M, int KV_N>
__device__ __forceinline__ void write_dkdv_tc(const float (&dk_acc)[KV_M][KV_N][4], const float (&dv_acc)[KV_M][KV_N][4],
                                              const FlashParams& p, long long b, long long h, const Sequence& seq, T* k_tile,
                                              T* v_tile, int kv_start, int kv_key, int kv_col, int g, int t, int seqlen_k,
                                              int head_dim, int head_dim_v) {
    cp_async_wait<0>();
    __syncthreads();
    // GQA/MQA (p.group > 1): per-query-head float32 dK and dV instead, 8-byte stores straight from
    // the accumulators, so the group sum rounds once (rounded here too, dV was 2.9x the dense error
    // at one key, d = 8).
    const bool per_head = p.group > 1;
    float* dk32 = static_cast<float*>(p.dk) + tensor_offset(p.dk_strides, b, seq.k_row0 + kv_start, h);
    float* dv32 = static_cast<float*>(p.dv) + tensor_offset(p.dv_strides, b, seq.k_row0 + kv_start, h);
#pragma unroll
    for (int m = 0; m < KV_M; ++m)
#pragma unroll
        for (int j = 0; j < KV_N; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int key = kv_key + 16 * m + g + 8 * r, col = kv_col + j * 8 + 2 * t;
                const float dk0 = dk_acc[m][j][2 * r] * p.softmax_scale, dk1 = dk_acc[m][j][2 * r + 1] * p.softmax_scale;
                const float dv0 = dv_acc[m][j][2 * r], dv1 = dv_acc[m][j][2 * r + 1];
                if (per_head) {
                    if (kv_start + key < seqlen_k) {
                        if (col < head_dim) *reinterpret_cast<float2*>(dk32 + key * p.dk_strides[1] + col) = make_float2(dk0, dk1);
                        if (col < head_dim_v) *reinterpret_cast<float2*>(dv32 + key * p.dv_strides[1] + col) = make_float2(dv0, dv1);
                    }
                } else {
                    *reinterpret_cast<unsigned int*>(k_tile + key * LD + col) = Mma<T>::pack(dk0, dk1);
                    *reinterpret_cast<unsigned int*>(v_tile + key * LD + col) = Mma<T>::pack(dv0, dv1);
                }
            }
    if (per_head) return;
    __syncthreads();
    // One loop for both tiles rather than store_staged_tile twice: with two loops, ptxas (at 255
    // registers in this kernel) spilled 8-12 bytes at d=160 and d=224 on sm_90.
    T* dk = static_cast<T*>(p.dk) + tensor_offset(p.dk_strides, b, seq.k_row0 + kv_start, h);
    T* dv = static_cast<T*>(p.dv) + tensor_offset(p.dv_strides, b, seq.k_row0 + kv_start, h);
    constexpr int CHUNKS = D_TILE / 8;
    for (int idx = threadIdx.x; idx < BLOCK_N * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS;
        const int c = (idx % CHUNKS) * 8;
        if (kv_start + r < seqlen_k) {
            if (c < head_dim) *reinterpret_cast<uint4*>(dk + r * p.dk_strides[1] + c) = *reinterpret_cast<const uint4*>(k_tile + r * LD + c);
            if (c < head_dim_v) *reinterpret_cast<uint4*>(dv + r * p.dv_strides[1] + c) = *reinterpret_cast<const uint4*>(v_tile + r * LD + c);
        }
    }
}

template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int STAGES, int S_KEY_WARPS, int KV_KEY_WARPS, bool IS_CAUSAL, int FEATURES>
__global__ void __launch_bounds__(32 * NUM_WARPS, 1) flash_backward_tc_kernel(const FlashParams p) {
    using Tiles = BackwardTilesTc<T, D_TILE, BLOCK_M, BLOCK_N, NUM_WARPS, STAGES, S_KEY_WARPS, KV_KEY_WARPS, FEATURES>;
    constexpr int THREADS = 32 * NUM_WARPS, LD = Tiles::LD, LDM = Tiles::LDM;
    constexpr int S_M = Tiles::S_M, S_N = Tiles::S_N, S_PASSES = Tiles::S_PASSES, S_PASS_N = Tiles::S_PASS_N;
    constexpr int KV_M = Tiles::KV_M, KV_N = Tiles::KV_N, Q_TILES = Tiles::Q_TILES, Q_SPLITS = Tiles::Q_SPLITS;
    constexpr int DQ_TILES = Tiles::DQ_TILES, DQ_PASSES = Tiles::DQ_PASSES, DQ_PASS_TILES = Tiles::DQ_PASS_TILES;
    require_dynamic_smem(Tiles::SMEM_BYTES);

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* k_tile = reinterpret_cast<T*>(smem_raw);         // [BLOCK_N][LD]
    T* v_tile = k_tile + BLOCK_N * LD;                   // [BLOCK_N][LD]
    T* q_tiles = v_tile + BLOCK_N * LD;                  // [STAGES][BLOCK_M][LD]
    T* do_tiles = q_tiles + STAGES * BLOCK_M * LD;       // [STAGES][BLOCK_M][LD]
    T* pt_tile = do_tiles + STAGES * BLOCK_M * LD;       // P^T  [BLOCK_N][LDM]
    T* dst_tile = pt_tile + BLOCK_N * LDM;               // dS^T [BLOCK_N][LDM]
    float* lse_tiles = reinterpret_cast<float*>(dst_tile + BLOCK_N * LDM);   // [STAGES][BLOCK_M]
    float* delta_tiles = lse_tiles + STAGES * BLOCK_M;                       // [STAGES][BLOCK_M]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int head_dim = (int)p.head_dim, head_dim_v = head_dim_v_of<FEATURES>(p);
    const KeyBlock block = key_block_of(p, p.dq_semaphore == nullptr);
    const long long b = block.b, h = block.h, bh = block.bh;
    const int kv_block = block.kv_block, kv_start = kv_block * BLOCK_N;
    const Sequence seq = sequence_of<FEATURES>(p, b);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    // Varlen: the grid covers the longest sequence. No query block waits on a key block past its
    // sequence's end (the turns count from kv_block_range), so leaving early cannot stall one.
    if ((FEATURES & FEATURE_VARLEN) && kv_start >= seqlen_k) return;

    const Band band = band_of(p, seq);
    const ScoreMod<FEATURES> mod(p, b, h, seq);
    const int num_q_blocks = (int)((p.seqlen_q + BLOCK_M - 1) / BLOCK_M);   // semaphores per (batch, head)
    const int2 q_range = q_block_range<IS_CAUSAL, FEATURES>(seq, kv_start, BLOCK_M, BLOCK_N, band);   // blocks that see these keys
    const int q_block_begin = q_range.x, q_block_end = q_range.y;

    const T* q = static_cast<const T*>(p.q) + tensor_offset(p.q_strides, b, seq.q_row0, h);
    const T* dout = static_cast<const T*>(p.dout) + tensor_offset(p.dout_strides, b, seq.q_row0, h);
    // delta and lse_log2 are (batch, heads, delta_stride) also for packed batches (padded per
    // sequence: +inf and 0 past its end), so the same 16-byte loads serve both.
    const long long stats_row0 = b * p.delta_batch_stride + h * p.delta_stride;
    const float* lse_log2 = p.lse_log2 + stats_row0;
    const float* delta = p.delta + stats_row0;

    auto load_query_block = [&](int q_block, int stage) {
        const int q_start = q_block * BLOCK_M;
        async_load_tile<T, BLOCK_M, D_TILE, LD, THREADS>(q_tiles + stage * BLOCK_M * LD, q + q_start * p.q_strides[1],
                                                         p.q_strides[1], seqlen_q - q_start, head_dim);
        async_load_tile<T, BLOCK_M, D_TILE, LD, THREADS>(do_tiles + stage * BLOCK_M * LD, dout + q_start * p.dout_strides[1],
                                                         p.dout_strides[1], seqlen_q - q_start, head_dim_v);
        // delta and lse_log2 rows are padded to a multiple of every BLOCK_M, so each chunk is whole.
        constexpr int CHUNKS = BLOCK_M / 4;
        for (int i = threadIdx.x; i < 2 * CHUNKS; i += THREADS) {
            const bool is_delta = i >= CHUNKS;
            const int c = (i - (is_delta ? CHUNKS : 0)) * 4;
            cp_async_16(smem_addr((is_delta ? delta_tiles : lse_tiles) + stage * BLOCK_M + c),
                        (is_delta ? delta : lse_log2) + q_start + c, true);
        }
    };

    load_kv_tiles_tc<T, D_TILE, BLOCK_N, LD, THREADS>(p, k_tile, v_tile, b, h, seq, kv_start, seqlen_k, head_dim, head_dim_v);
    if (q_block_begin < q_block_end) load_query_block(q_block_begin, 0);
    cp_async_commit();

    // This warp's pieces of each product (see the header).
    const int s_key = 16 * S_M * (warp % S_KEY_WARPS);
    const int s_col = 8 * S_N * (warp / S_KEY_WARPS);
    const int kv_key = 16 * KV_M * (warp % KV_KEY_WARPS);
    const int kv_col = 8 * KV_N * (warp / KV_KEY_WARPS);
    const int dq_row = 16 * (warp % Q_TILES);
    const int dq_col = (warp / Q_TILES) * (D_TILE / Q_SPLITS);

    // ldmatrix lane addresses (tensor_core.cuh): A of S^T / dP^T from K / V ([key][d]); B from Q / dO
    // ([query][d] = [n][k]); A of dV / dK from P^T / dS^T ([key][query]); B of dV / dK from dO / Q
    // ([query][d] = [k][n], trans); A of dQ = dS from dS^T ([key][query] = [k][m], trans); B of dQ
    // from K ([key][d] = [k][n], trans). Q and dO addresses are relative to the stage's tile.
    const unsigned int k_a = smem_addr(k_tile + s_key * LD) + a_frag_lane<LD>(lane);
    const unsigned int v_a = smem_addr(v_tile + s_key * LD) + a_frag_lane<LD>(lane);
    const unsigned int qdo_b = b_frags_lane<LD>(lane);   // + the pass's first query row
    const unsigned int pt_a = smem_addr(pt_tile + kv_key * LDM) + a_frag_lane<LDM>(lane);
    const unsigned int dst_a = smem_addr(dst_tile + kv_key * LDM) + a_frag_lane<LDM>(lane);
    const unsigned int qdo_bt = 2u * kv_col + b_frags_trans_lane<LD>(lane);
    const unsigned int ds_at = smem_addr(dst_tile + dq_row) + a_frag_trans_lane<LDM>(lane);
    const unsigned int k_bt = smem_addr(k_tile + dq_col) + b_frags_trans_lane<LD>(lane);

    float dk_acc[KV_M][KV_N][4], dv_acc[KV_M][KV_N][4];
    zero_dkdv_tc(dk_acc, dv_acc);

    float* dq_accum = p.dq_accum + tensor_offset(p.dq_accum_strides, b, seq.q_row0, h);
    int* semaphores = p.dq_semaphore == nullptr ? nullptr : p.dq_semaphore + bh * num_q_blocks;
    // Deterministic mode, thread 0 only: the query block whose adds are not yet published. Kept in
    // shared memory: as a register, live through the loop, it spilled 4-8 bytes at d=256.
    __shared__ int unpublished_q_block;
    if (threadIdx.x == 0) unpublished_q_block = -1;

    for (int q_block = q_block_begin, it = 0; q_block < q_block_end; ++q_block, ++it) {
        const int stage = STAGES == 2 ? (it & 1) : 0, q_start = q_block * BLOCK_M;
        cp_async_wait<0>();
        __syncthreads();   // this query block landed; every warp is done with the previous one's tiles
        if (STAGES == 2 && q_block + 1 < q_block_end) load_query_block(q_block + 1, stage ^ 1);
        cp_async_commit();

        const unsigned int q_base = smem_addr(q_tiles + stage * BLOCK_M * LD);
        const unsigned int do_base = smem_addr(do_tiles + stage * BLOCK_M * LD);
        const float* lse_tile = lse_tiles + stage * BLOCK_M;
        const float* delta_tile = delta_tiles + stage * BLOCK_M;

        // S^T = K Q^T and dP^T = V dO^T for the warp's tile, in S_PASSES passes over its queries,
        // then P^T and dS^T to shared memory.
        const bool needs_mask = tile_needs_mask<IS_CAUSAL, FEATURES>(q_start, BLOCK_M, kv_start, BLOCK_N, seqlen_k, band);
#pragma unroll 1
        for (int pass = 0; pass < S_PASSES; ++pass) {
            const int pass_col = s_col + pass * S_PASS_N * 8;
            float s[S_M][S_PASS_N][4], dp[S_M][S_PASS_N][4];
            unsigned int a_k[S_M][4], a_v[S_M][4];   // scores_and_dp_tc's K and V fragments
            scores_and_dp_tc<T, D_TILE, LD>(s, dp, a_k, a_v, k_a, v_a, q_base, do_base, qdo_b, pass_col);
            probs_and_ds_tc<T, LDM, IS_CAUSAL>(s, dp, p, b, h, seq, mod, band, lse_tile, delta_tile, pt_tile, dst_tile,
                                               pass_col, kv_start, s_key, q_start, g, t, needs_mask, seqlen_k);
        }
        __syncthreads();   // P^T and dS^T complete

        unsigned int a_p[KV_M][4], a_ds[KV_M][4];   // accumulate_dkdv_tc's P^T and dS^T fragments
        accumulate_dkdv_tc<T, BLOCK_M, LD, LDM>(dv_acc, dk_acc, a_p, a_ds, pt_a, dst_a, do_base, q_base, qdo_bt);
        if (STAGES == 1) {
            __syncthreads();   // every warp is done with Q and dO: the next block may load under dQ
            if (q_block + 1 < q_block_end) load_query_block(q_block + 1, 0);
            cp_async_commit();
        }

        // dQ_block = dS K for the warp's 16 query rows x D / Q_SPLITS columns, added to dq_accum in DQ_PASSES passes.
        take_dq_turn_tc<BLOCK_M, BLOCK_N, IS_CAUSAL, FEATURES>(semaphores, q_block, q_block_begin, kv_block, seq, q_start, band);
#pragma unroll 1
        for (int pass = 0; pass < DQ_PASSES; ++pass) {
            const int pass_tile = pass * DQ_PASS_TILES;
            float dq[DQ_PASS_TILES][4];
            dq_products_tc<T, BLOCK_N, LD, LDM, DQ_TILES>(dq, pass_tile, ds_at, k_bt);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int query = q_start + dq_row + g + 8 * r;
                if (query < seqlen_q)
                    add_dq_row_tc<DQ_TILES>(dq, r, dq_accum + query * p.dq_accum_strides[1], pass_tile, dq_col, t, head_dim);
            }
        }
    }
    if (semaphores != nullptr) publish_last_dq_tc<BLOCK_M, BLOCK_N, IS_CAUSAL, FEATURES>(p);

    write_dkdv_tc<T, D_TILE, BLOCK_N, LD, THREADS>(dk_acc, dv_acc, p, b, h, seq, k_tile, v_tile, kv_start, kv_key, kv_col, g, t,
                                                   seqlen_k, head_dim, head_dim_v);
}
