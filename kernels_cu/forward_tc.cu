// Tensor-core forward for float16 / bfloat16 (sm_80+): the same algorithm as forward.cu, with
// both products on mma.sync.m16n8k16 (fp32 accumulation).
//
// Block: NUM_WARPS warps, each owning M_TILES x 16 consecutive query rows for the whole K/V loop;
// BLOCK_M = 16 * NUM_WARPS * M_TILES = 128. Sharing one K/V tile among 128 rows halves the L2 traffic
// per FLOP of a 64-row block, and with M_TILES = 2 every K and V fragment loaded by ldmatrix feeds two
// mma's. (64-row blocks of 4 x 16 rows reached only 0.65-0.73x FlashAttention-2 on the H100.)
// Shared memory holds the Q tile and one K and one V tile (fp16/bf16, rows padded by 16 bytes so
// the 8 rows an ldmatrix phase reads fall in distinct bank groups: the row pitch in 16-byte units,
// D/8 + 1, is odd). Loads are 16-byte cp.async; the V tile of block j streams in while S = Q K_j^T
// is computed, and the K tile of block j+1 while the softmax and O += P V_j run (FlashAttention-2's
// order), so one buffer each suffices.
//
// Above FLASH_WIDE_TILE (head dims 264-512) a warp's O over every v column would not fit its
// registers: V_SPLIT blocks share a query block, each computing S whole and O over its own
// D_TILE / V_SPLIT v columns (index fastest in the grid, so they run together and share Q and K in
// L2); the first also writes lse.
//
// Fragments (PTX ISA, mma.m16n8k16 with .row.col): lane = 4g + t. A (16x16) regs hold rows g and
// g+8, columns 2t, 2t+1 (+8); B (16x8) regs hold k = 2t, 2t+1 (+8), column g; C (16x8) holds rows
// g, g+8 and columns 2t, 2t+1. Two adjacent C tiles of S are exactly one A fragment of P, so P
// goes from the S accumulators to the PV product without leaving registers.

#include "common.cuh"
#include "tensor_core.cuh"

// FEATURE_PAGED: rows [first, first + ROWS) of sequence b's K or V (strides: the tensor's;
// rows_valid of them inside the sequence) through its block_table row into a tile, base pointing at
// the K/V head's column 0 of page 0. (Contiguous calls keep their loads as they were written: the
// same loads through one helper reordered a few instructions of 150 instantiations.)
template <typename T, int ROWS, int WIDTH, int LD, int THREADS>
__device__ __forceinline__ void load_paged_rows_tc(T* tile, const T* base, const FlashParams& p, const long long* strides,
                                                   long long b, int first, int rows_valid, int width) {
    async_load_paged_tile<T, ROWS, WIDTH, LD, THREADS>(tile, base, p.block_table + b * p.block_table_stride,
                                                        (int)p.page_shift, strides[0], strides[1], first, rows_valid, width);
}

// Zeroes the O accumulators and starts each row's running max at -inf and its sum at 0.
template <int M_TILES, int O_TILES>
__device__ __forceinline__ void init_rows_tc(float (&o_acc)[M_TILES][O_TILES][4], float (&row_max)[M_TILES][2],
                                             float (&row_max_scaled)[M_TILES][2], float (&row_sum)[M_TILES][2]) {
#pragma unroll
    for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
        for (int j = 0; j < O_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[m][j][e] = 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[m][r] = FLASH_NEG_INF;
            row_max_scaled[m][r] = 0.f;
            row_sum[m][r] = 0.f;
        }
    }
}

// Stages the bias tile of the key block at kv_start in shared memory (FEATURE_BIAS).
template <int BLOCK_M, int BLOCK_N, int BIAS_LD, int THREADS, int FEATURES>
__device__ __forceinline__ void stage_bias_tile_tc(float* bias_tile, const ScoreMod<FEATURES>& mod, int q_start, int kv_start,
                                                   int seqlen_q, int seqlen_k) {
    // 4-byte copies: any strides (0 where the bias broadcasts); outside the sequence, zeros.
#pragma unroll 1
    for (int idx = threadIdx.x; idx < BLOCK_M * BLOCK_N; idx += THREADS) {
        const int r = idx / BLOCK_N, c = idx % BLOCK_N;
        const bool inside = q_start + r < seqlen_q && kv_start + c < seqlen_k;
        cp_async_4(smem_addr(bias_tile + r * BIAS_LD + c),
                   mod.bias + (inside ? (q_start + r) * mod.bias_row + (kv_start + c) * mod.bias_col : 0), inside);
    }
}

// S = Q K_j^T for the warp's rows x BLOCK_N keys; each K fragment serves all M_TILES. q_frag holds
// the Q fragments of one k-step (the kernel's array: where it is declared changes the machine code).
template <typename T, int D_TILE, int LD, int M_TILES, int S_TILES>
__device__ __forceinline__ void scores_tc(float (&s)[M_TILES][S_TILES][4], unsigned int (&q_frag)[M_TILES][4],
                                          unsigned int q_lane, unsigned int k_lane) {
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int j = 0; j < S_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[m][j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D_TILE / 16; ++kk) {
#pragma unroll
        for (int m = 0; m < M_TILES; ++m)
            ldmatrix_x4(q_frag[m], q_lane + 2u * (16 * m * LD + kk * 16));
#pragma unroll
        for (int j = 0; j < S_TILES; j += 2) {
            unsigned int bfrag[4];   // {b0, b1} of key tile j, then of key tile j + 1
            ldmatrix_x4(bfrag, k_lane + 2u * (j * 8 * LD + kk * 16));
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                mma_two_tiles<T>(s[m][j], s[m][j + 1], q_frag[m], bfrag);
            }
        }
    }
}

// The score modification of the warp's scores of the key block at kv_start (log2-domain logits; the
// bias from the staged tile).
template <int BIAS_LD, int FEATURES, int M_TILES, int S_TILES>
__device__ __forceinline__ void modify_scores_tc(float (&s)[M_TILES][S_TILES][4], const ScoreMod<FEATURES>& mod,
                                                 const float* bias_tile, int q_start, int warp_row, int kv_start, int g, int t) {
    if (ScoreMod<FEATURES>::active) {
#pragma unroll
        for (int m = 0; m < M_TILES; ++m)
#pragma unroll
            for (int j = 0; j < S_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int query = q_start + warp_row + 16 * m + g + 8 * (e >> 1);
                    const int key = kv_start + j * 8 + 2 * t + (e & 1);
                    const float bias_value =
                        (FEATURES & FEATURE_BIAS) ? bias_tile[(query - q_start) * BIAS_LD + key - kv_start] : 0.f;
                    s[m][j][e] = mod.log2_logit_with(s[m][j][e], query, key, bias_value);
                }
    }
}

// Online softmax of one key block (the 4 threads of a quad share a row): raises the row maxima,
// turns the scores into P = exp2(S * score_log2 - max), adds P's row sums and rescales O.
template <int M_TILES, int S_TILES, int O_TILES>
__device__ __forceinline__ void online_softmax_tc(float (&s)[M_TILES][S_TILES][4], float (&o_acc)[M_TILES][O_TILES][4],
                                                  float (&row_max)[M_TILES][2], float (&row_max_scaled)[M_TILES][2],
                                                  float (&row_sum)[M_TILES][2], float score_log2) {
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float block_max = FLASH_NEG_INF;
#pragma unroll
            for (int j = 0; j < S_TILES; ++j) block_max = fmaxf(block_max, fmaxf(s[m][j][2 * r], s[m][j][2 * r + 1]));
            block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
            block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 2));
            const float rescale = raise_row_max(row_max[m][r], row_max_scaled[m][r], block_max, score_log2);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < S_TILES; ++j)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    s[m][j][e] = exp2f(fmaf(s[m][j][e], score_log2, -row_max_scaled[m][r]));
                    sum += s[m][j][e];
                }
            row_sum[m][r] = row_sum[m][r] * rescale + sum;
            // Unconditional: skipping this when a warp vote finds every rescale == 1 measured
            // 9% slower at d=64 and 3% at d=128 (bf16, 16k, H100).
#pragma unroll
            for (int j = 0; j < O_TILES; ++j) {
                o_acc[m][j][2 * r] *= rescale;
                o_acc[m][j][2 * r + 1] *= rescale;
            }
        }
}

// O += P V_j: P from the S accumulators (two key tiles = one A fragment, packed into p_frag, the
// kernel's array as scores_tc's q_frag), V by ldmatrix.trans; each V fragment serves all M_TILES.
template <typename T, int BLOCK_N, int LD, int M_TILES, int S_TILES, int O_TILES>
__device__ __forceinline__ void accumulate_pv_tc(float (&o_acc)[M_TILES][O_TILES][4], unsigned int (&p_frag)[M_TILES][4],
                                                 const float (&s)[M_TILES][S_TILES][4], unsigned int v_lane) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
#pragma unroll
        for (int m = 0; m < M_TILES; ++m) {
            p_frag[m][0] = Mma<T>::pack(s[m][2 * kk][0], s[m][2 * kk][1]);
            p_frag[m][1] = Mma<T>::pack(s[m][2 * kk][2], s[m][2 * kk][3]);
            p_frag[m][2] = Mma<T>::pack(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
            p_frag[m][3] = Mma<T>::pack(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
        }
#pragma unroll
        for (int j = 0; j < O_TILES; j += 2) {
            unsigned int bfrag[4];   // {b0, b1} of d tile j, then of d tile j + 1
            ldmatrix_x4_trans(bfrag, v_lane + 2u * (kk * 16 * LD + j * 8));
#pragma unroll
            for (int m = 0; m < M_TILES; ++m) {
                mma_two_tiles<T>(o_acc[m][j], o_acc[m][j + 1], p_frag[m], bfrag);
            }
        }
    }
}

// Epilogue of the warp's rows: normalises O and stages it (as T) in the Q tile at its rows, which
// only this warp has read, and writes each row's lse where writes_lse (another block's otherwise).
template <typename T, int LD, int FEATURES, int M_TILES, int O_TILES>
__device__ __forceinline__ void finish_rows_tc(const FlashParams& p, long long h, const float (&o_acc)[M_TILES][O_TILES][4],
                                               const float (&row_max)[M_TILES][2], const float (&row_max_scaled)[M_TILES][2],
                                               const float (&row_sum)[M_TILES][2], T* q_tile, float* lse, int q_start,
                                               int warp_row, int g, int t, int seqlen_q, bool writes_lse) {
#pragma unroll
    for (int m = 0; m < M_TILES; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float total = row_sum[m][r];
            total += __shfl_xor_sync(0xffffffffu, total, 1);
            total += __shfl_xor_sync(0xffffffffu, total, 2);
            const int row = warp_row + 16 * m + g + 8 * r;
            const float2 lse_inv = finish_row<FEATURES>(p, h, row_max[m][r], row_max_scaled[m][r], total);
            const float inv = lse_inv.y;
#pragma unroll
            for (int j = 0; j < O_TILES; ++j) {
                *reinterpret_cast<unsigned int*>(q_tile + row * LD + j * 8 + 2 * t) =
                    Mma<T>::pack(o_acc[m][j][2 * r] * inv, o_acc[m][j][2 * r + 1] * inv);
            }
            if (writes_lse && t == 0 && q_start + row < seqlen_q) lse[q_start + row] = lse_inv.x;
        }
}

template <typename T, int D_TILE, int BLOCK_N, int NUM_WARPS, int M_TILES, bool IS_CAUSAL, int FEATURES>
__global__ void __launch_bounds__(32 * NUM_WARPS, 1) flash_forward_tc_kernel(const FlashParams p) {
    constexpr int THREADS = 32 * NUM_WARPS;
    constexpr int BLOCK_M = 16 * NUM_WARPS * M_TILES;
    constexpr int V_SPLIT = D_TILE > FLASH_WIDE_TILE ? FLASH_V_SPLIT : 1;   // blocks over v's columns
    constexpr int DV_TILE = D_TILE / V_SPLIT;  // v (and O) columns of this block
    constexpr int LD = D_TILE + 8;            // padded row pitch, elements
    constexpr int LD_V = DV_TILE + 8;         // the V tile's
    constexpr int S_TILES = BLOCK_N / 8;      // n-tiles of S per m-tile
    constexpr int O_TILES = DV_TILE / 8;      // n-tiles of O per m-tile
    static_assert(D_TILE % 32 == 0 && DV_TILE % 32 == 0 && BLOCK_N % 16 == 0, "tile shape");
    // FEATURE_BIAS: the bias tile of each key block, float32, staged with the V tile. Read from
    // global memory inside the score loop, the 64 loaded values per thread lived beside the scores
    // and spilled 8-216 bytes in most instantiations (also when loaded into the accumulators).
    constexpr int BIAS_LD = BLOCK_N + 8;
    constexpr unsigned int BIAS_BYTES = (FEATURES & FEATURE_BIAS) ? BLOCK_M * BIAS_LD * sizeof(float) : 0;
    constexpr unsigned int SMEM_BYTES = ((BLOCK_M + BLOCK_N) * LD + BLOCK_N * LD_V) * sizeof(T) + BIAS_BYTES;
    require_dynamic_smem(SMEM_BYTES);

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_tile = reinterpret_cast<T*>(smem_raw);   // [BLOCK_M][LD]
    T* k_tile = q_tile + BLOCK_M * LD;             // [BLOCK_N][LD]
    T* v_tile = k_tile + BLOCK_N * LD;             // [BLOCK_N][LD_V]
    float* bias_tile = reinterpret_cast<float*>(v_tile + BLOCK_N * LD_V);   // [BLOCK_M][BIAS_LD], FEATURE_BIAS

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int v_chunk = V_SPLIT > 1 ? (int)(blockIdx.x % V_SPLIT) : 0, v_col = v_chunk * DV_TILE;
    const int head_dim = (int)p.head_dim;
    const int head_dim_v = V_SPLIT > 1 ? min(head_dim_v_of<FEATURES>(p) - v_col, DV_TILE) : head_dim_v_of<FEATURES>(p);
    if (V_SPLIT > 1 && head_dim_v <= 0) return;   // past v's columns: nothing to compute (never the first chunk)
    const QueryBlock block = V_SPLIT > 1 ? query_block_of(p, BLOCK_M, blockIdx.x / V_SPLIT) : query_block_of(p, BLOCK_M);
    const long long b = block.b, h = block.h;
    const int q_start = block.q_block * BLOCK_M;
    const Sequence seq = sequence_of<FEATURES>(p, b);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    if ((FEATURES & FEATURE_VARLEN) && q_start >= seqlen_q) return;   // the grid covers the longest sequence
    const Band band = band_of(p, seq);
    const ScoreMod<FEATURES> mod(p, b, h, seq);
    const float score_log2 = score_to_log2<FEATURES>(p);

    const T* q = static_cast<const T*>(p.q) + tensor_offset(p.q_strides, b, seq.q_row0 + q_start, h);
    // (FEATURE_PAGED: at page 0, the rows come through block_table.)
    constexpr bool PAGED = (FEATURES & FEATURE_PAGED) != 0;
    const T* k = static_cast<const T*>(p.k) + tensor_offset(p.k_strides, PAGED ? 0 : b, PAGED ? 0 : seq.k_row0, kv_head_of(h, p));
    const T* v = static_cast<const T*>(p.v) + tensor_offset(p.v_strides, PAGED ? 0 : b, PAGED ? 0 : seq.k_row0, kv_head_of(h, p)) + v_col;

    const int2 kv_range = kv_block_range<IS_CAUSAL, FEATURES>(seq, q_start, BLOCK_M, BLOCK_N, band);
    const int kv_end = kv_range.y;

    async_load_tile<T, BLOCK_M, D_TILE, LD, THREADS>(q_tile, q, p.q_strides[1], seqlen_q - q_start, head_dim);
    if (kv_range.x < kv_end) {
        const int first = kv_range.x * BLOCK_N;
        if constexpr (PAGED)
            load_paged_rows_tc<T, BLOCK_N, D_TILE, LD, THREADS>(k_tile, k, p, p.k_strides, b, first, seqlen_k - first, head_dim);
        else
            async_load_tile<T, BLOCK_N, D_TILE, LD, THREADS>(k_tile, k + first * p.k_strides[1], p.k_strides[1], seqlen_k - first, head_dim);
    }
    cp_async_commit();

    float o_acc[M_TILES][O_TILES][4];
    // Per thread and m-tile: rows g (index 0) and g + 8 (index 1) of the tile's 16.
    float row_max[M_TILES][2], row_max_scaled[M_TILES][2], row_sum[M_TILES][2];
    init_rows_tc(o_acc, row_max, row_max_scaled, row_sum);
    const int warp_row = warp * 16 * M_TILES;
    // ldmatrix.x4 lane addresses: lanes 8i..8i+7 give the rows of 8x8 matrix i.
    const unsigned int q_lane = smem_addr(q_tile + warp_row * LD) + a_frag_lane<LD>(lane);
    const unsigned int k_lane = smem_addr(k_tile) + b_frags_lane<LD>(lane);
    const unsigned int v_lane = smem_addr(v_tile) + b_frags_trans_lane<LD_V>(lane);

    for (int kv_block = kv_range.x; kv_block < kv_end; ++kv_block) {
        const int kv_start = kv_block * BLOCK_N;
        cp_async_wait();
        __syncthreads();   // K_j (and Q) landed; every warp is done reading V_{j-1}
        if constexpr (PAGED)
            load_paged_rows_tc<T, BLOCK_N, DV_TILE, LD_V, THREADS>(v_tile, v, p, p.v_strides, b, kv_start, seqlen_k - kv_start,
                                                                   head_dim_v);
        else
            async_load_tile<T, BLOCK_N, DV_TILE, LD_V, THREADS>(v_tile, v + kv_start * p.v_strides[1], p.v_strides[1], seqlen_k - kv_start, head_dim_v);
        if (FEATURES & FEATURE_BIAS)
            stage_bias_tile_tc<BLOCK_M, BLOCK_N, BIAS_LD, THREADS>(bias_tile, mod, q_start, kv_start, seqlen_q, seqlen_k);
        cp_async_commit();

        float s[M_TILES][S_TILES][4];
        unsigned int q_frag[M_TILES][4];   // scores_tc's Q fragments
        scores_tc<T, D_TILE, LD>(s, q_frag, q_lane, k_lane);

        cp_async_wait();
        __syncthreads();   // V_j landed; every warp is done reading K_j
        if (kv_block + 1 < kv_end) {
            const int next = kv_start + BLOCK_N;
            if constexpr (PAGED)
                load_paged_rows_tc<T, BLOCK_N, D_TILE, LD, THREADS>(k_tile, k, p, p.k_strides, b, next, seqlen_k - next, head_dim);
            else
                async_load_tile<T, BLOCK_N, D_TILE, LD, THREADS>(k_tile, k + next * p.k_strides[1], p.k_strides[1], seqlen_k - next, head_dim);
        }
        cp_async_commit();

        modify_scores_tc<BIAS_LD>(s, mod, bias_tile, q_start, warp_row, kv_start, g, t);
        // Mask only blocks that cross the sequence end or a band edge (int arithmetic: keys and
        // queries are < 2^30, so key - query and the band offsets fit).
        if (tile_needs_mask<IS_CAUSAL, FEATURES>(q_start, BLOCK_M, kv_start, BLOCK_N, seqlen_k, band)) {
#pragma unroll
            for (int m = 0; m < M_TILES; ++m)
#pragma unroll
                for (int j = 0; j < S_TILES; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int query = q_start + warp_row + 16 * m + g + 8 * (e >> 1);
                        const int key = kv_start + j * 8 + 2 * t + (e & 1);
                        if (!key_visible<IS_CAUSAL, FEATURES>(key, query, seqlen_k, band)) s[m][j][e] = FLASH_NEG_INF;
                    }
        }

        online_softmax_tc(s, o_acc, row_max, row_max_scaled, row_sum, score_log2);

        unsigned int p_frag[M_TILES][4];   // accumulate_pv_tc's P fragments
        accumulate_pv_tc<T, BLOCK_N, LD_V>(o_acc, p_frag, s, v_lane);
    }

    // Epilogue: normalise, write lse, stage O in the Q tile (each warp only its own rows, which
    // only it has read), then store rows in 16-byte vectors.
    cp_async_wait();
    __syncthreads();
    float* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0;
    finish_rows_tc<T, LD, FEATURES>(p, h, o_acc, row_max, row_max_scaled, row_sum, q_tile, lse, q_start, warp_row, g, t,
                                    seqlen_q, v_chunk == 0);
    __syncthreads();
    store_staged_tile<T, BLOCK_M, DV_TILE, LD, THREADS>(static_cast<T*>(p.o) + tensor_offset(p.o_strides, b, seq.q_row0 + q_start, h) + v_col,
                                                       p.o_strides[1], q_tile, seqlen_q - q_start, head_dim_v);
}
