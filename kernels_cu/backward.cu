// Backward of O = softmax(S) V with S = scale * Q K^T, given dO, lse and delta = rowsum(dO * O):
//   P  = exp(S - lse)              (recomputed, never stored)
//   dV = P^T dO
//   dP = dO V^T
//   dS = P * (dP - delta)
//   dK = scale * dS^T Q
//   dQ = scale * dS K
//
// flash_backward_kernel: one block per (key block, batch, head). K and V stay in shared memory, dK
// and dV accumulate in registers over the inner loop of query blocks and are written once. With
// ATOMIC_DQ the block also adds its share of dQ into a float32 accumulator with atomics
// (flash_dq_convert_kernel then scales and casts it); without, dQ comes from
// flash_backward_dq_kernel, one block per query block looping over key blocks, so every value is
// summed in a fixed order and the result is bitwise reproducible.
//
// CUDA-core version; same 16 x 8 thread layout and padded float32 tiles as the forward kernel.

#include "common.cuh"

// Row-wise softmax statistics of one query block. Rows past seqlen_q and rows that see no key
// (lse = -inf) get lse = -inf, which makes their P (and so dS) exactly 0.
template <int BLOCK_M>
__device__ __forceinline__ void load_row_stats(float* lse_tile, float* delta_tile, const FlashParams& p, long long b, long long h,
                                               const Sequence& seq, int q_start) {
    const float* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0;
    const float* delta = p.delta + b * p.delta_batch_stride + h * p.delta_stride;   // (batch, heads, rows), packed too
    for (int r = threadIdx.x; r < BLOCK_M; r += FLASH_THREADS) {
        const int query = q_start + r;
        const bool valid = query < seq.seqlen_q;
        lse_tile[r] = valid ? lse[query] : FLASH_NEG_INF;
        delta_tile[r] = valid ? delta[query] : 0.f;
    }
}

// P = exp(score * scale - lse), with the large terms meeting inside one fma so only the small
// difference is rounded (rounding lse * log2(e) first cost ~3x the error of a dense float32
// reference at logits in the thousands).
// With a score modifier (softcap, ALiBi), P = exp2(logit_log2 - lse * log2(e)).
template <int FEATURES>
__device__ __forceinline__ float softmax_prob(float score, float lse, bool visible, const FlashParams& p,
                                              const ScoreMod<FEATURES>& mod, int query, int key) {
    if (!visible || lse == FLASH_NEG_INF) return 0.f;
    if (ScoreMod<FEATURES>::active) return exp2f(fmaf(lse, -FLASH_LOG2E, mod.log2_logit(score, query, key)));
    return exp2f(fmaf(score, p.softmax_scale, -lse) * FLASH_LOG2E);
}

template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, bool IS_CAUSAL, bool ATOMIC_DQ, int FEATURES>
__global__ void __launch_bounds__(FLASH_THREADS, 1) flash_backward_kernel(const FlashParams p) {
    constexpr int LD = D_TILE + 1;
    constexpr int T_LD = BLOCK_M + 1;
    constexpr int KROWS = BLOCK_N / 16;   // key rows per thread (dK, dV, S^T rows)
    constexpr int QCOLS = BLOCK_M / 8;    // query columns per thread (S^T columns)
    constexpr int QROWS = BLOCK_M / 16;   // query rows per thread (dQ)
    constexpr int DCOLS = D_TILE / 8;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0 && D_TILE % 32 == 0, "tile shape");
    constexpr unsigned int SMEM_BYTES = (2 * BLOCK_N * LD + 2 * BLOCK_M * LD + 2 * BLOCK_N * T_LD + 2 * BLOCK_M) * sizeof(float);
    require_dynamic_smem(SMEM_BYTES);

    extern __shared__ float smem[];
    float* k_tile = smem;                        // [BLOCK_N][LD]
    float* v_tile = k_tile + BLOCK_N * LD;       // [BLOCK_N][LD]
    float* q_tile = v_tile + BLOCK_N * LD;       // [BLOCK_M][LD]
    float* do_tile = q_tile + BLOCK_M * LD;      // [BLOCK_M][LD]
    float* pt_tile = do_tile + BLOCK_M * LD;     // P^T  [BLOCK_N][T_LD]
    float* dst_tile = pt_tile + BLOCK_N * T_LD;  // dS^T [BLOCK_N][T_LD]
    float* lse_tile = dst_tile + BLOCK_N * T_LD;
    float* delta_tile = lse_tile + BLOCK_M;

    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
    const int head_dim = (int)p.head_dim, head_dim_v = head_dim_v_of<FEATURES>(p);
    const KeyBlock block = key_block_of(p, false);
    const long long b = block.b, h = block.h;
    const int kv_start = block.kv_block * BLOCK_N;
    const Sequence seq = sequence_of<FEATURES>(p, b);
    const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
    if ((FEATURES & FEATURE_VARLEN) && kv_start >= seqlen_k) return;   // the grid covers the longest sequence
    const Band band = band_of(p, seq);
    const ScoreMod<FEATURES> mod(p, b, h, seq);
    const long long k_row = seq.k_row0 + kv_start;

    load_tile<T, BLOCK_N, D_TILE, LD>(k_tile, static_cast<const T*>(p.k) + tensor_offset(p.k_strides, b, k_row, kv_head_of(h, p)), p.k_strides[1], seqlen_k - kv_start, head_dim);
    load_tile<T, BLOCK_N, D_TILE, LD>(v_tile, static_cast<const T*>(p.v) + tensor_offset(p.v_strides, b, k_row, kv_head_of(h, p)), p.v_strides[1], seqlen_k - kv_start, head_dim_v);

    const int2 q_range = q_block_range<IS_CAUSAL, FEATURES>(seq, kv_start, BLOCK_M, BLOCK_N, band);

    float dk_acc[KROWS][DCOLS], dv_acc[KROWS][DCOLS];
#pragma unroll
    for (int i = 0; i < KROWS; ++i)
#pragma unroll
        for (int j = 0; j < DCOLS; ++j) dk_acc[i][j] = dv_acc[i][j] = 0.f;

    for (int q_block = q_range.x; q_block < q_range.y; ++q_block) {
        const int q_start = q_block * BLOCK_M;
        __syncthreads();   // previous iteration is done with the Q, dO, P^T and dS^T tiles
        const long long q_row = seq.q_row0 + q_start;
        load_tile<T, BLOCK_M, D_TILE, LD>(q_tile, static_cast<const T*>(p.q) + tensor_offset(p.q_strides, b, q_row, h), p.q_strides[1], seqlen_q - q_start, head_dim);
        load_tile<T, BLOCK_M, D_TILE, LD>(do_tile, static_cast<const T*>(p.dout) + tensor_offset(p.dout_strides, b, q_row, h), p.dout_strides[1], seqlen_q - q_start, head_dim_v);
        load_row_stats<BLOCK_M>(lse_tile, delta_tile, p, b, h, seq, q_start);
        __syncthreads();

        // S^T = K Q^T and dP^T = V dO^T for this thread's (key row, query column) pairs.
        float st[KROWS][QCOLS], dpt[KROWS][QCOLS];
#pragma unroll
        for (int i = 0; i < KROWS; ++i)
#pragma unroll
            for (int j = 0; j < QCOLS; ++j) st[i][j] = dpt[i][j] = 0.f;
        const auto key_row = [&](const float* tile) { return [=](int i, int d) { return tile[(ty * KROWS + i) * LD + d]; }; };
        const auto query_col = [&](const float* tile) { return [=](int j, int d) { return tile[(tx + 8 * j) * LD + d]; }; };
        accumulate<D_TILE, 2>(outer_product(st, key_row(k_tile), query_col(q_tile)),
                              outer_product(dpt, key_row(v_tile), query_col(do_tile)));
#pragma unroll
        for (int i = 0; i < KROWS; ++i) {
            const int key_local = ty * KROWS + i;
#pragma unroll
            for (int j = 0; j < QCOLS; ++j) {
                const int query_local = tx + 8 * j;
                const int key = kv_start + key_local, query = q_start + query_local;
                const bool visible = key_visible<IS_CAUSAL, FEATURES>(key, query, seqlen_k, band);
                const float prob = softmax_prob<FEATURES>(st[i][j], lse_tile[query_local], visible, p, mod, query, key);
                const float ds = prob * (dpt[i][j] - delta_tile[query_local]);   // d logit
                add_dbias<FEATURES>(p, b, h, query, key, seq, ds);
                pt_tile[key_local * T_LD + query_local] = prob;
                dst_tile[key_local * T_LD + query_local] = ds * mod.grad_factor(st[i][j]);
            }
        }
        __syncthreads();

        // dV += P^T dO, dK += dS^T Q (scale applied once at the end).
        const auto key_col = [&](const float* tile) { return [=](int i, int r) { return tile[(ty * KROWS + i) * T_LD + r]; }; };
        const auto dim_col = [&](const float* tile) { return [=](int j, int r) { return tile[r * LD + tx + 8 * j]; }; };
        accumulate<BLOCK_M, 2>(outer_product(dv_acc, key_col(pt_tile), dim_col(do_tile)),
                               outer_product(dk_acc, key_col(dst_tile), dim_col(q_tile)));

        if (ATOMIC_DQ) {
            // This key block's share of dQ = dS K, added into the float32 accumulator (unscaled).
            float dq[QROWS][DCOLS];
#pragma unroll
            for (int i = 0; i < QROWS; ++i)
#pragma unroll
                for (int j = 0; j < DCOLS; ++j) dq[i][j] = 0.f;
            accumulate<BLOCK_N, 2>(outer_product(dq, [&](int i, int c) { return dst_tile[c * T_LD + ty * QROWS + i]; },
                                                 [&](int j, int c) { return k_tile[c * LD + tx + 8 * j]; }));
#pragma unroll
            for (int i = 0; i < QROWS; ++i) {
                const int query = q_start + ty * QROWS + i;
                if (query < seqlen_q) {
                    float* acc = p.dq_accum + tensor_offset(p.dq_accum_strides, b, seq.q_row0 + query, h);
#pragma unroll
                    for (int j = 0; j < DCOLS; ++j) {
                        if (tx + 8 * j < head_dim) atomicAdd(acc + tx + 8 * j, dq[i][j]);
                    }
                }
            }
        }
    }

    // Stage dK (scaled) and dV through the K and V tiles and store them in 16-byte vectors. Every
    // key block writes its rows, also when no query sees them (zeros).
    __syncthreads();
#pragma unroll
    for (int i = 0; i < KROWS; ++i)
#pragma unroll
        for (int j = 0; j < DCOLS; ++j) {
            k_tile[(ty * KROWS + i) * LD + tx + 8 * j] = dk_acc[i][j];
            v_tile[(ty * KROWS + i) * LD + tx + 8 * j] = dv_acc[i][j];
        }
    __syncthreads();
    store_tile<T, BLOCK_N, D_TILE, LD>(static_cast<T*>(p.dk) + tensor_offset(p.dk_strides, b, k_row, h), p.dk_strides[1], k_tile, seqlen_k - kv_start, head_dim, p.softmax_scale);
    store_tile<T, BLOCK_N, D_TILE, LD>(static_cast<T*>(p.dv) + tensor_offset(p.dv_strides, b, k_row, h), p.dv_strides[1], v_tile, seqlen_k - kv_start, head_dim_v, 1.f);
}

// Deterministic dQ: one block per (query block, batch, head), looping over key blocks in order;
// dQ accumulates in registers, so no two blocks ever write the same element.
template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, bool IS_CAUSAL, int FEATURES>
__global__ void __launch_bounds__(FLASH_THREADS, 1) flash_backward_dq_kernel(const FlashParams p) {
    constexpr int LD = D_TILE + 1;
    constexpr int S_LD = BLOCK_N + 1;
    constexpr int ROWS = BLOCK_M / 16;
    constexpr int SCOLS = BLOCK_N / 8;
    constexpr int DCOLS = D_TILE / 8;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 8 == 0 && D_TILE % 32 == 0, "tile shape");
    constexpr unsigned int SMEM_BYTES = (2 * BLOCK_M * LD + 2 * BLOCK_N * LD + BLOCK_M * S_LD + 2 * BLOCK_M) * sizeof(float);
    require_dynamic_smem(SMEM_BYTES);

    extern __shared__ float smem[];
    float* q_tile = smem;                       // [BLOCK_M][LD]
    float* do_tile = q_tile + BLOCK_M * LD;     // [BLOCK_M][LD]
    float* k_tile = do_tile + BLOCK_M * LD;     // [BLOCK_N][LD]
    float* v_tile = k_tile + BLOCK_N * LD;      // [BLOCK_N][LD]
    float* ds_tile = v_tile + BLOCK_N * LD;     // [BLOCK_M][S_LD]
    float* lse_tile = ds_tile + BLOCK_M * S_LD;
    float* delta_tile = lse_tile + BLOCK_M;

    const QueryBlockScope<T, FEATURES> at(p, BLOCK_M);
    if (at.past_sequence()) return;
    const auto& [b, h, seq, band, mod, q, k, v] = at.head;
    const int q_start = at.q_start, seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = (int)p.head_dim;
    const int head_dim_v = head_dim_v_of<FEATURES>(p);
    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
    const long long q_row = seq.q_row0 + q_start;

    load_tile<T, BLOCK_M, D_TILE, LD>(q_tile, q + q_start * p.q_strides[1], p.q_strides[1], seqlen_q - q_start, head_dim);
    load_tile<T, BLOCK_M, D_TILE, LD>(do_tile, static_cast<const T*>(p.dout) + tensor_offset(p.dout_strides, b, q_row, h), p.dout_strides[1], seqlen_q - q_start, head_dim_v);
    load_row_stats<BLOCK_M>(lse_tile, delta_tile, p, b, h, seq, q_start);

    const int2 kv_range = kv_block_range<IS_CAUSAL, FEATURES>(seq, q_start, BLOCK_M, BLOCK_N, band);

    float dq_acc[ROWS][DCOLS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int j = 0; j < DCOLS; ++j) dq_acc[i][j] = 0.f;

    for (int kv_block = kv_range.x; kv_block < kv_range.y; ++kv_block) {
        const int kv_start = kv_block * BLOCK_N;
        __syncthreads();   // previous K tile no longer read (and Q, dO, stats are loaded)
        load_tile<T, BLOCK_N, D_TILE, LD>(k_tile, k + kv_start * p.k_strides[1], p.k_strides[1], seqlen_k - kv_start, head_dim);
        load_tile<T, BLOCK_N, D_TILE, LD>(v_tile, v + kv_start * p.v_strides[1], p.v_strides[1], seqlen_k - kv_start, head_dim_v);
        __syncthreads();

        float s[ROWS][SCOLS], dp[ROWS][SCOLS];
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
#pragma unroll
            for (int j = 0; j < SCOLS; ++j) s[i][j] = dp[i][j] = 0.f;
        const auto query_row = [&](const float* tile) { return [=](int i, int d) { return tile[(ty * ROWS + i) * LD + d]; }; };
        const auto key_row = [&](const float* tile) { return [=](int j, int d) { return tile[(tx + 8 * j) * LD + d]; }; };
        accumulate<D_TILE, 2>(outer_product(s, query_row(q_tile), key_row(k_tile)),
                              outer_product(dp, query_row(do_tile), key_row(v_tile)));
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int query_local = ty * ROWS + i;
#pragma unroll
            for (int j = 0; j < SCOLS; ++j) {
                const int key_local = tx + 8 * j;
                const int key = kv_start + key_local, query = q_start + query_local;
                const bool visible = key_visible<IS_CAUSAL, FEATURES>(key, query, seqlen_k, band);
                const float prob = softmax_prob<FEATURES>(s[i][j], lse_tile[query_local], visible, p, mod, query, key);
                ds_tile[query_local * S_LD + key_local] = prob * (dp[i][j] - delta_tile[query_local]) * mod.grad_factor(s[i][j]);
            }
        }
        __syncthreads();

        accumulate<BLOCK_N, 2>(outer_product(dq_acc, [&](int i, int c) { return ds_tile[(ty * ROWS + i) * S_LD + c]; },
                                             [&](int j, int c) { return k_tile[c * LD + tx + 8 * j]; }));
    }

    __syncthreads();   // Q tile free for staging (also when the loop ran zero times)
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
        for (int j = 0; j < DCOLS; ++j) q_tile[(ty * ROWS + i) * LD + tx + 8 * j] = dq_acc[i][j];
    __syncthreads();
    store_tile<T, BLOCK_M, D_TILE, LD>(static_cast<T*>(p.dq) + tensor_offset(p.dq_strides, b, q_row, h), p.dq_strides[1], q_tile, seqlen_q - q_start, head_dim, p.softmax_scale);
}
