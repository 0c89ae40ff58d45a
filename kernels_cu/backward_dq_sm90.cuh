// The Hopper backward's dQ kernel (sm_90a), for the calls that compute dQ apart from the main
// kernel (backward_sm90.cu includes it: one module holds both).

#pragma once
#include "common.cuh"
#include "tensor_core.cuh"
#include "sm90_mma.cuh"
#include "sm90_wgmma_ops.cuh"
#include "sm90_tma.cuh"

// ---- dQ apart: plain d = 256 calls, short deterministic d <= 128 ones ---------------------------
// The calls BACKWARD_SM90_DQ_APART_KEYS (families/sm90.py) names run the main kernel without dQ
// (ADDS_DQ false: dK and dV only, no turns, the atomic grid) and then this kernel, which computes dQ with
// no adds at all: a block per BLOCK_M query rows of one (batch, head), Q and dO resident, the key
// blocks' K and V streamed through a ring, dQ accumulated in registers over every key the rows
// see and stored once as T. The sum's order is fixed by the loop, so the result is bitwise
// reproducible. At d = 256 the dQ reduce-adds' kernel spent about 40% of its time on dQ (without
// it: 0.59-0.69x, H200, bf16, 2k-16k) and its deterministic turns cost 1.28-1.48x the atomic time.
//   S  = Q K^T        P  = exp2(S * scale_log2 - lse_log2[query])
//   dP = dO V^T       dS = P * (dP - delta[query])       dQ += dS K   (times softmax_scale at the end)
//  - warpgroup 0, the producer: one thread loads Q and dO once, then each key block's K and V
//    (last first) into a ring of STAGES slots;
//  - warpgroups 1..CONSUMERS each own 64 query rows: S and dP by wgmma from shared memory, dS in
//    registers as the A operand of dQ += dS K (K read N-major, as the forward reads V). A block's
//    dQ product is issued with the next block's S and dP, so the tensor cores have it to run
//    while the consumer waits for S, and the consumers take turns to issue (ping-pong).
//  - the epilogue stages each consumer's dQ rows (times softmax_scale, as T) in its own rows of
//    the Q tile, which only it read, and stores them by TMA (rows past the sequence clipped).
// Row statistics are the preprocess kernel's (lse_log2 +inf on padded rows and rows that see no
// key, so their P and dQ are 0); they are padded to a multiple of 128 rows per (batch, head).
template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, int STAGES>
struct BackwardDqSm90Storage {
    static constexpr int CHUNKS = D_TILE / SWIZZLE_ROW_ELEMENTS;
    alignas(SWIZZLE_ATOM_BYTES) T q[CHUNKS][BLOCK_M][SWIZZLE_ROW_ELEMENTS];   // dQ's staging at the end
    alignas(SWIZZLE_ATOM_BYTES) T dout[CHUNKS][BLOCK_M][SWIZZLE_ROW_ELEMENTS];
    alignas(SWIZZLE_ATOM_BYTES) T k[STAGES][CHUNKS][BLOCK_N][SWIZZLE_ROW_ELEMENTS];
    alignas(SWIZZLE_ATOM_BYTES) T v[STAGES][CHUNKS][BLOCK_N][SWIZZLE_ROW_ELEMENTS];
    unsigned long long q_full;
    unsigned long long full[STAGES], empty[STAGES];
};

// q, dO (boxes of 64 x BLOCK_M), k, v (64 x BLOCK_N) and dq (64 x 64: a consumer's rows), the
// dtype's 4-D maps with 128-byte swizzle (cupy_flash/_tma.py). The same size as BackwardSm90Maps.
struct BackwardDqSm90Maps {
    TensorMap q, k, v, dout, dq;
};

template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, int STAGES>
__device__ const unsigned int backward_dq_sm90_smem_bytes =
    sizeof(BackwardDqSm90Storage<T, D_TILE, BLOCK_M, BLOCK_N, STAGES>) + SWIZZLE_ATOM_BYTES;

// The producer thread: Q and dO once, then each key block's K and V, last first, into the ring.
template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, int STAGES>
__device__ __forceinline__ void produce_dq_sm90(BackwardDqSm90Storage<T, D_TILE, BLOCK_M, BLOCK_N, STAGES>& smem,
                                                const BackwardDqSm90Maps& maps, const FlashParams& p, const Sequence& seq,
                                                long long b, long long h, int q_start, int2 kv_range, int blocks) {
    using Storage = BackwardDqSm90Storage<T, D_TILE, BLOCK_M, BLOCK_N, STAGES>;
    const int kv_head = (int)kv_head_of(h, p);
    const unsigned int q_full = smem_addr(&smem.q_full);
    barrier_arrive_expect(q_full, 2 * BLOCK_M * D_TILE * sizeof(T));
#pragma unroll
    for (int c = 0; c < Storage::CHUNKS; ++c) {
        tma_load_4d(smem_addr(&smem.q[c][0][0]), &maps.q, q_full, c * SWIZZLE_ROW_ELEMENTS, seq.q_row0 + q_start, (int)h, (int)b);
        tma_load_4d(smem_addr(&smem.dout[c][0][0]), &maps.dout, q_full, c * SWIZZLE_ROW_ELEMENTS, seq.q_row0 + q_start,
                    (int)h, (int)b);
    }
#pragma unroll 1
    for (int i = 0; i < blocks; ++i) {
        const RingSlot slot = ring_slot<STAGES>(i);
        barrier_wait(smem_addr(&smem.empty[slot.index]), slot.parity ^ 1);
        const unsigned int full = smem_addr(&smem.full[slot.index]);
        barrier_arrive_expect(full, 2 * BLOCK_N * D_TILE * sizeof(T));
        const int key_row = seq.k_row0 + (kv_range.y - 1 - i) * BLOCK_N;
#pragma unroll
        for (int c = 0; c < Storage::CHUNKS; ++c) {
            tma_load_4d(smem_addr(&smem.k[slot.index][c][0][0]), &maps.k, full, c * SWIZZLE_ROW_ELEMENTS, key_row, kv_head, (int)b);
            tma_load_4d(smem_addr(&smem.v[slot.index][c][0][0]), &maps.v, full, c * SWIZZLE_ROW_ELEMENTS, key_row, kv_head, (int)b);
        }
    }
}

// The epilogue of one consumer: dQ times softmax_scale as T in its rows of the Q tile (its products,
// the only readers of those rows, are complete; with no key block seen, Q never loaded), then one
// TMA store a 64-column chunk.
template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, int STAGES>
__device__ __forceinline__ void store_dq_sm90(BackwardDqSm90Storage<T, D_TILE, BLOCK_M, BLOCK_N, STAGES>& smem,
                                              const BackwardDqSm90Maps& maps, const FlashParams& p, const Sequence& seq,
                                              long long b, long long h, int q_start, int consumer, int thread,
                                              int row_in_block, int col_in_chunk, const float (&dq)[D_TILE / 2]) {
    using Storage = BackwardDqSm90Storage<T, D_TILE, BLOCK_M, BLOCK_N, STAGES>;
    constexpr int DQ_EPILOGUE_BARRIER = 1;   // named barriers 1, 2: one per consumer
    constexpr unsigned int Q_CHUNK_BYTES = BLOCK_M * 128;
    unsigned char* staging = reinterpret_cast<unsigned char*>(&smem.q[0][0][0]);
#pragma unroll
    for (int i = 0; i < D_TILE / 8; ++i) {
        const int col = 8 * i + col_in_chunk, chunk = col / SWIZZLE_ROW_ELEMENTS;
#pragma unroll
        for (int r = 0; r < 2; ++r)
            *reinterpret_cast<unsigned int*>(staging + chunk * Q_CHUNK_BYTES + swizzled_offset(row_in_block + 8 * r, col % SWIZZLE_ROW_ELEMENTS)) =
                Mma<T>::pack(dq[4 * i + 2 * r] * p.softmax_scale, dq[4 * i + 2 * r + 1] * p.softmax_scale);
    }
    fence_async_shared();   // the staging writes, before the TMA store reads them
    named_barrier_sync(DQ_EPILOGUE_BARRIER + consumer, 128);
    if (thread == 0) {
#pragma unroll
        for (int c = 0; c < Storage::CHUNKS; ++c)
            tma_store_4d(&maps.dq, smem_addr(staging + c * Q_CHUNK_BYTES + 64 * consumer * 128), c * SWIZZLE_ROW_ELEMENTS,
                         seq.q_row0 + q_start + 64 * consumer, (int)h, (int)b);
        tma_store_commit();
        tma_store_wait_all();   // the block's shared memory must outlive the store's reads
    }
}

template <typename T, int D_TILE, int BLOCK_M, int BLOCK_N, int STAGES, bool IS_CAUSAL, int FEATURES>
__global__ void __launch_bounds__(128 * (1 + BLOCK_M / 64), 1)
flash_backward_dq_sm90_kernel(const __grid_constant__ BackwardDqSm90Maps maps, const FlashParams p) {
    using Storage = BackwardDqSm90Storage<T, D_TILE, BLOCK_M, BLOCK_N, STAGES>;
    constexpr int CONSUMERS = BLOCK_M / 64;
    constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;
    constexpr unsigned int Q_CHUNK_BYTES = BLOCK_M * 128, KV_CHUNK_BYTES = BLOCK_N * 128;
    constexpr int DQ_ISSUE_BARRIER = 3;   // named barriers 3, 4: one per consumer (store_dq_sm90's: 1, 2)
    static_assert(CONSUMERS == 2 && D_TILE % SWIZZLE_ROW_ELEMENTS == 0 && BLOCK_N % 16 == 0, "tile shape");
    static_assert((FEATURES & ~FEATURE_HEAD_DIM_V) == 0,
                  "plain and causal calls, v's own head_dim too (the others keep the main kernel's ordered adds)");
    static_assert(PRODUCER_REGISTERS + CONSUMERS * CONSUMER_REGISTERS <= (1 + CONSUMERS) * 168,
                  "setmaxnreg split beyond the launch's registers: the block would hang");
    static_assert(sizeof(Storage) + SWIZZLE_ATOM_BYTES <= SM90_BLOCK_SMEM_BYTES, "shared memory of one sm_90 block");
    require_dynamic_smem(backward_dq_sm90_smem_bytes<T, D_TILE, BLOCK_M, BLOCK_N, STAGES>);
    extern __shared__ unsigned char smem_raw[];
    Storage& smem = aligned_shared_storage<Storage>(smem_raw);

    // The block's query rows: the last query blocks first (under a causal mask they see the most
    // keys), the last heads' dealt longest first across them (longest_first_tile).
    const int num_q_blocks = (int)((p.seqlen_q + BLOCK_M - 1) / BLOCK_M);
    const unsigned int heads = (unsigned int)p.heads;
    const HeadTile tile = longest_first_tile(blockIdx.x, (unsigned int)num_q_blocks, (unsigned int)(p.batch * p.heads),
                                             triangular_tiles<IS_CAUSAL, FEATURES>);
    const long long bh = tile.bh, b = tile.bh / heads, h = tile.bh % heads;
    const int q_start = (num_q_blocks - 1 - (int)tile.rank) * BLOCK_M;
    const Sequence seq = sequence_of<FEATURES>(p, b);
    const Band band = band_of(p, seq);
    const int2 kv_range = kv_block_range<IS_CAUSAL, FEATURES>(seq, q_start, BLOCK_M, BLOCK_N, band);
    const int blocks = kv_range.y - kv_range.x;

    if (threadIdx.x == 0) {
        allow_dependents();   // the main kernel, launched early behind this one, may take SMs as they free
        prefetch_tensor_map(&maps.q);
        prefetch_tensor_map(&maps.k);
        prefetch_tensor_map(&maps.v);
        prefetch_tensor_map(&maps.dout);
        prefetch_tensor_map(&maps.dq);
        barrier_init(smem_addr(&smem.q_full), 1);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(smem_addr(&smem.full[s]), 1);
            barrier_init(smem_addr(&smem.empty[s]), 4 * CONSUMERS);   // one arrival per consumer warp
        }
        barrier_init_fence();
    }
    __syncthreads();

    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        release_registers<PRODUCER_REGISTERS>();
        if (threadIdx.x == 0 && blocks > 0) produce_dq_sm90<T, D_TILE, BLOCK_M, BLOCK_N, STAGES>(smem, maps, p, seq, b, h, q_start, kv_range, blocks);
        return;
    }

    acquire_registers<CONSUMER_REGISTERS>();
    const int consumer = warpgroup - 1;
    const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
    const int row_in_block = 64 * consumer + 16 * warp + lane / 4;   // this thread's rows: +0 and +8
    const int col_in_chunk = 2 * (lane % 4);                         // and columns 8i + this (+1)
    const int first_query = q_start + row_in_block;
    // The rows' statistics (padded per (batch, head): in range for every row of the block).
    const long long stats = bh * p.delta_stride + first_query;
    const float lse_log2[2] = {p.lse_log2[stats], p.lse_log2[stats + 8]};
    const float delta[2] = {p.delta[stats], p.delta[stats + 8]};

    float dq[D_TILE / 2];
#pragma unroll
    for (int i = 0; i < D_TILE / 2; ++i) dq[i] = 0.f;
    if (blocks > 0) {
        const unsigned int q_base = smem_addr(&smem.q[0][64 * consumer][0]);
        const unsigned int do_base = smem_addr(&smem.dout[0][64 * consumer][0]);
        float s[BLOCK_N / 2], dp[BLOCK_N / 2];
        unsigned int dsa[BLOCK_N / 16][4];
        // S and dP of the key block in `slot`, two groups: issued, not waited for.
        const auto issue_scores = [&](const RingSlot& slot) {
            barrier_wait(smem_addr(&smem.full[slot.index]), slot.parity);
            warpgroup_arrive();
            mma_k_major<T, BLOCK_N, D_TILE>(s, q_base, Q_CHUNK_BYTES, smem_addr(&smem.k[slot.index][0][0][0]), KV_CHUNK_BYTES);
            warpgroup_commit();
            mma_k_major<T, BLOCK_N, D_TILE>(dp, do_base, Q_CHUNK_BYTES, smem_addr(&smem.v[slot.index][0][0][0]), KV_CHUNK_BYTES);
            warpgroup_commit();
        };
        barrier_wait(smem_addr(&smem.q_full), 0);
        // dQ += dS K of key block i (dS in dsa), issued, not waited for.
        const auto issue_dq = [&](int i) {
            const unsigned int k_base = smem_addr(&smem.k[ring_slot<STAGES>(i).index][0][0][0]);
            warpgroup_arrive();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk)
                Wgmma<T, D_TILE>::template rs<1>(dq, dsa[kk], n_major_descriptor(k_base + kk * 2 * SWIZZLE_ATOM_BYTES, KV_CHUNK_BYTES), 1);
            warpgroup_commit();
        };
        // Issue turns (ping-pong, as the forward's): a consumer issues block i - 1's dQ product and
        // block i's S and dP in its turn, then passes it on, so one consumer's exponentials and dS
        // run under the other's products (1.01-1.06x at d = 256, 1k-16k, H200, bf16). Consumer 1
        // starts the ring with an arrival; consumer 0 takes its last one after the loop.
        if (consumer == 1) named_barrier_arrive(DQ_ISSUE_BARRIER, 256);
#pragma unroll 1
        for (int i = 0; i < blocks; ++i) {
            const RingSlot slot = ring_slot<STAGES>(i);
            named_barrier_sync(DQ_ISSUE_BARRIER + consumer, 256);
            if (i > 0) issue_dq(i - 1);
            issue_scores(slot);
            named_barrier_arrive(DQ_ISSUE_BARRIER + (1 - consumer), 256);
            warpgroup_wait<1>();   // S of block i (and the last block's dQ product, issued before it)
            hold_registers(s);
            if (i > 0 && lane == 0) barrier_arrive(smem_addr(&smem.empty[ring_slot<STAGES>(i - 1).index]));   // its K, V read
            const int kv_start = (kv_range.y - 1 - i) * BLOCK_N;
            float prob[BLOCK_N / 2];
#pragma unroll
            for (int j = 0; j < BLOCK_N / 2; ++j) prob[j] = exp2f(fmaf(s[j], p.scale_log2, -lse_log2[accumulator_half(j)]));
            if (tile_needs_mask<IS_CAUSAL, FEATURES>(q_start + 64 * consumer, 64, kv_start, BLOCK_N, seq.seqlen_k, band)) {
                const TileMask mask(first_query, kv_start + col_in_chunk, seq.seqlen_k, band);
#pragma unroll
                for (int j = 0; j < BLOCK_N / 2; ++j)
                    if (!mask.visible<IS_CAUSAL, FEATURES>(accumulator_row(j), accumulator_col(j))) prob[j] = 0.f;
            }
            warpgroup_wait<0>();   // dP of block i
            hold_registers(dp);
#pragma unroll
            for (int j = 0; j < BLOCK_N / 2; ++j) dp[j] = prob[j] * (dp[j] - delta[accumulator_half(j)]);
            accumulator_to_a<T, BLOCK_N>(dsa, dp);
        }
        issue_dq(blocks - 1);
        if (consumer == 0) named_barrier_sync(DQ_ISSUE_BARRIER, 256);
        warpgroup_wait<0>();
        hold_registers(dq);
    }

    store_dq_sm90<T, D_TILE, BLOCK_M, BLOCK_N, STAGES>(smem, maps, p, seq, b, h, q_start, consumer, thread, row_in_block,
                                                       col_in_chunk, dq);
}
