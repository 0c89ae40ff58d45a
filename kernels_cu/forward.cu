// Forward: O = softmax(scale * Q K^T) V and lse = logsumexp(scale * Q K^T) per query row.
//
// One block per (query block, batch, head). The Q tile stays in shared memory while K and V tiles
// stream through one buffer; the online softmax keeps a running row_max and an un-normalised
// output that is rescaled by exp2(row_max_old - row_max_new) whenever the max grows, and divided
// by the row sum once at the end. Every exponential is one exp2 of fma(score, scale * log2(e),
// -row_max_scaled): the large terms meet inside the fma and only the small difference is rounded.
// (Scaling scores first rounds each at |score| * scale * log2(e); with logits in the thousands,
// in float32 that tripled the error of P against a dense float32 reference.) row_max itself is
// kept unscaled; its scaled copy may carry a rounding residual, but the residual is common to a
// row's O and l and cancels in O / l; for lse it is removed exactly (finish_row, common.cuh).
//
// CUDA-core version (fp32 FMAs on fp32 tiles in shared memory): correct for every dtype and head
// dim; the tensor-core kernels for fp16/bf16 replace it on the fast path.
//
// Thread layout: 16 x 8 (ty, tx). Thread (ty, tx) owns query rows ty*ROWS + i, score columns
// tx + 8*j and output columns tx + 8*j: the 8 threads of a row sit in one warp, so row reductions
// are three shuffles. Shared rows are padded by one float so that the 4 rows (Q) or 8 rows (K) a
// warp reads at one column fall in distinct banks.

#include "common.cuh"

template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, bool IS_CAUSAL, int FEATURES>
__global__ void __launch_bounds__(FLASH_THREADS, 1) flash_forward_kernel(const FlashParams p) {
    constexpr int LD = D_TILE + 1;
    constexpr int P_LD = BLOCK_N + 1;
    constexpr int ROWS = BLOCK_M / 16;
    constexpr int SCOLS = BLOCK_N / 8;
    constexpr int DCOLS = D_TILE / 8;
    static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 8 == 0 && D_TILE % 32 == 0, "tile shape");
    constexpr unsigned int SMEM_BYTES = (BLOCK_M * LD + BLOCK_N * LD + BLOCK_M * P_LD) * sizeof(float);
    require_dynamic_smem(SMEM_BYTES);

    extern __shared__ float smem[];
    float* q_tile = smem;                      // [BLOCK_M][LD]
    float* kv_tile = q_tile + BLOCK_M * LD;    // [BLOCK_N][LD], K then V
    float* p_tile = kv_tile + BLOCK_N * LD;    // [BLOCK_M][P_LD]

    const QueryBlockScope<T, FEATURES> at(p, BLOCK_M);
    if (at.past_sequence()) return;
    const auto& [b, h, seq, band, mod, q, k, v] = at.head;
    const int q_start = at.q_start, seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k, head_dim = (int)p.head_dim;
    const int head_dim_v = head_dim_v_of<FEATURES>(p);
    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
    const float score_log2 = score_to_log2<FEATURES>(p);

    load_tile<T, BLOCK_M, D_TILE, LD>(q_tile, q + q_start * p.q_strides[1], p.q_strides[1], seqlen_q - q_start, head_dim);

    const int2 kv_range = kv_block_range<IS_CAUSAL, FEATURES>(seq, q_start, BLOCK_M, BLOCK_N, band);

    float o_acc[ROWS][DCOLS];
    float row_max[ROWS];          // unscaled max of the scores seen so far; -inf before any key
    float row_max_scaled[ROWS];   // row_max * scale_log2 as used in the exponents (0 while -inf)
    float row_sum[ROWS];          // this thread's share of the row sum; summed over the row at the end
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        row_max[i] = FLASH_NEG_INF;
        row_max_scaled[i] = 0.f;
        row_sum[i] = 0.f;
#pragma unroll
        for (int j = 0; j < DCOLS; ++j) o_acc[i][j] = 0.f;
    }

    for (int kv_block = kv_range.x; kv_block < kv_range.y; ++kv_block) {
        const int kv_start = kv_block * BLOCK_N;
        __syncthreads();   // everyone is done with the previous V tile (and Q is loaded)
        load_tile<T, BLOCK_N, D_TILE, LD>(kv_tile, k + kv_start * p.k_strides[1], p.k_strides[1], seqlen_k - kv_start, head_dim);
        __syncthreads();

        float s[ROWS][SCOLS];
#pragma unroll
        for (int i = 0; i < ROWS; ++i)
#pragma unroll
            for (int j = 0; j < SCOLS; ++j) s[i][j] = 0.f;
        accumulate<D_TILE, 4>(outer_product(s, [&](int i, int d) { return q_tile[(ty * ROWS + i) * LD + d]; },
                                            [&](int j, int d) { return kv_tile[(tx + 8 * j) * LD + d]; }));

#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int query = q_start + ty * ROWS + i;
            float block_max = FLASH_NEG_INF;
#pragma unroll
            for (int j = 0; j < SCOLS; ++j) {
                const int key = kv_start + tx + 8 * j;
                if (ScoreMod<FEATURES>::active) s[i][j] = mod.log2_logit(s[i][j], query, key);
                if (!key_visible<IS_CAUSAL, FEATURES>(key, query, seqlen_k, band)) s[i][j] = FLASH_NEG_INF;
                block_max = fmaxf(block_max, s[i][j]);
            }
            const float rescale = raise_row_max(row_max[i], row_max_scaled[i], row_group_max(block_max), score_log2);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < SCOLS; ++j) {
                const float prob = exp2f(fmaf(s[i][j], score_log2, -row_max_scaled[i]));
                sum += prob;
                p_tile[(ty * ROWS + i) * P_LD + tx + 8 * j] = prob;
            }
            row_sum[i] = row_sum[i] * rescale + sum;
#pragma unroll
            for (int j = 0; j < DCOLS; ++j) o_acc[i][j] *= rescale;
        }

        __syncthreads();   // P written, K no longer read
        load_tile<T, BLOCK_N, D_TILE, LD>(kv_tile, v + kv_start * p.v_strides[1], p.v_strides[1], seqlen_k - kv_start, head_dim_v);
        __syncthreads();

        accumulate<BLOCK_N, 2>(outer_product(o_acc, [&](int i, int c) { return p_tile[(ty * ROWS + i) * P_LD + c]; },
                                             [&](int j, int c) { return kv_tile[c * LD + tx + 8 * j]; }));
    }

    // Normalise once, stage O through the Q tile, store it in 16-byte vectors. The barrier matters
    // when the loop ran zero times (a causal block that sees no key): Q may still be loading.
    __syncthreads();
    float* lse = p.lse + b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        const int row = ty * ROWS + i;
        const float2 lse_inv = finish_row<FEATURES>(p, h, row_max[i], row_max_scaled[i], row_group_sum(row_sum[i]));
#pragma unroll
        for (int j = 0; j < DCOLS; ++j) q_tile[row * LD + tx + 8 * j] = o_acc[i][j] * lse_inv.y;
        if (tx == 0 && q_start + row < seqlen_q) lse[q_start + row] = lse_inv.x;
    }
    __syncthreads();
    T* o = static_cast<T*>(p.o) + tensor_offset(p.o_strides, b, seq.q_row0 + q_start, h);
    store_tile<T, BLOCK_M, D_TILE, LD>(o, p.o_strides[1], q_tile, seqlen_q - q_start, head_dim_v, 1.f);
}
