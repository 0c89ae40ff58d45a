// Hopper backward (sm_90a) for float16 / bfloat16, on the forward's vocabulary (sm90_mma.cuh,
// sm90_tma.cuh). Where it runs: cupy_flash/families/sm90.py, Backward.supports; how it is built and why:
// docs/performance.md ("How each path is built") and docs/decisions.md (Hopper backward).
//
// A tile is a key block of BLOCK_N keys of one (batch, head); one block per SM walks the tiles,
// taking the next from a counter (key blocks of one head consecutive: their Q, dO and dQ rows stay
// in L2; deterministic mode: 4 at a time). With the scores transposed (keys as rows):
//   S^T  = K Q^T                       P^T  = exp2(S^T * scale_log2 - lse_log2[query])
//   dP^T = V dO^T                      dS^T = P^T * (dP^T - delta[query])
//   dV  += P^T dO     dK += dS^T Q     dQ  += dS K        (dK and dQ times softmax_scale at the end:
//                                                          dK here, dQ in the convert kernel)
//  - warpgroup 0, the producer, gives its registers away; one thread loads each tile's K and V
//    once, and streams each query block's Q and dO tiles (TMA) and its lse_log2 and delta rows
//    (bulk copies) into a ring of STAGES slots that runs on across tiles;
//  - two consumer warpgroups share the products. At d <= 128 (BLOCK_N = 128: the key split) each
//    owns 64 of the block's keys: S^T and dP^T by wgmma from shared memory,
//    P^T and dS^T in registers, dV += P^T dO and dK += dS^T Q by wgmma with A from registers
//    (accumulated across the query loop), dS written to shared memory (queries x keys, keys
//    contiguous; two buffers, query blocks alternating) for dQ = dS K over all the block's keys,
//    each consumer a share of its 64-column chunks, added to dq_accum by a TMA reduce-add from
//    shared memory (one add per element per key block); deterministic mode (p.dq_semaphore)
//    orders the key blocks' adds. At d = 256 (BLOCK_N = 64: the head-dim split; one warpgroup's
//    registers cannot hold dK and dV of 64 keys x 256 columns) each consumer takes 32 of the
//    query block's queries in S^T and dP^T, writes its half of P^T and dS^T to shared memory,
//    and owns 128 head-dim columns of dK, dV and dQ, whose products read P^T and dS^T from there.
// Where BACKWARD_SM90_DQ_APART_KEYS (families/sm90.py) says so (every plain call at d = 256, short
// deterministic ones at d <= 128) the kernel runs without dQ (ADDS_DQ false: no dS for dQ, no
// adds, no turns; the key split then takes dK's A from registers too; d = 256 takes the product
// split, backward_sm90_product_split: consumer 0 S^T and consumer 1 dP^T, each for all 64 queries)
// and flash_backward_dq_sm90_kernel (at the end of this file) computes dQ with no adds at all.
// Row statistics are the preprocess kernel's: padded per (batch, head) to a multiple of 128 rows,
// lse_log2 +inf past the sequence (P = 0) and delta 0, so a query block is always whole; Q and dO
// rows past the sequence arrive as zeros. Keys past the sequence read zeros from K and V; the mask
// drops their P, and their dK / dV rows are not stored.

#include "common.cuh"
#include "tensor_core.cuh"
#include "sm90_mma.cuh"
#include "sm90_wgmma_ops.cuh"
#include "sm90_tma.cuh"
// the dQ kernel of the calls that compute dQ apart (one module holds both)
#include "backward_dq_sm90.cuh"

// A producer warpgroup and BACKWARD_SM90_CONSUMERS (_traits, in flash_interface.cuh) consumer
// warpgroups (cupy_flash/families/sm90.py, backward_sm90_threads).

// The key split computes dQ transposed (dQ^T = K^T dS^T, the head dim as wgmma's M) where the query
// block is not a multiple of wgmma's 64 rows (80: FlashAttention-3's d = 128 tile); its dQ staging
// then holds all the block's rows, else a 64-row dQ item's.
template <int BLOCK_M>
constexpr bool dq_transposed = BLOCK_M % 64 != 0;
template <int BLOCK_M>
constexpr int key_split_dq_rows = dq_transposed<BLOCK_M> ? BLOCK_M : 64;

template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES>
struct BackwardSm90Storage {
    static constexpr int CHUNKS = D_TILE / SWIZZLE_ROW_ELEMENTS;
    static constexpr bool HEAD_DIM_SPLIT = D_TILE > 128;
    alignas(SWIZZLE_ATOM_BYTES) T k[CHUNKS][BLOCK_N][SWIZZLE_ROW_ELEMENTS];
    alignas(SWIZZLE_ATOM_BYTES) T v[CHUNKS][BLOCK_N][SWIZZLE_ROW_ELEMENTS];
    alignas(SWIZZLE_ATOM_BYTES) T q[STAGES][CHUNKS][BLOCK_M][SWIZZLE_ROW_ELEMENTS];
    alignas(SWIZZLE_ATOM_BYTES) T dout[STAGES][CHUNKS][BLOCK_M][SWIZZLE_ROW_ELEMENTS];
    // Key split: dS (queries x keys, keys contiguous), two buffers (query blocks alternate): chunk c
    // holds consumer c's 64 keys. With two, a consumer writes block m's dS while the other may
    // still be reading block m - 1's, so the consumers meet once a block, not twice.
    // Head-dim split: [0] P^T and [1] dS^T (keys x queries, queries contiguous), each one chunk of
    // the block's 64 keys, the consumers' 32 queries side by side (the product split: consumer 0
    // writes P^T, consumer 1 dS^T, all 64 queries each).
    alignas(SWIZZLE_ATOM_BYTES) T ds[2][HEAD_DIM_SPLIT ? 1 : BLOCK_N / 64][HEAD_DIM_SPLIT ? BLOCK_N : BLOCK_M][SWIZZLE_ROW_ELEMENTS];
    // dQ (float32) of 64 query rows x a 64-column chunk per consumer, as two 32-column halves
    // (head-dim split: one 32-column piece of its 128 columns at a time), 128-byte rows, swizzled:
    // the source of the TMA reduce-add into dq_accum.
    // Key split with dQ transposed (dq_transposed): the consumer's 64 columns of dQ for all BLOCK_M
    // queries, as two 32-column halves. Unused without dQ (ADDS_DQ false; using it at d = 256 for
    // a second P^T / dS^T buffer measured +0.4%: docs/decisions.md, "P^T / dS^T double buffer").
    alignas(SWIZZLE_ATOM_BYTES) float dq[BACKWARD_SM90_CONSUMERS][HEAD_DIM_SPLIT ? 1 : 2][key_split_dq_rows<BLOCK_M>][32];
    alignas(16) float lse_log2[STAGES][BLOCK_M];
    alignas(16) float delta[STAGES][BLOCK_M];
    unsigned long long kv_full, kv_empty;
    unsigned long long full[STAGES], empty[STAGES];
    TileHandover tiles;   // the persistent grid's next tile (sm90_tma.cuh)
    // Deterministic mode, head-dim split: the consumer warps whose adds to their current turn have
    // completed (one count per warp per turn, never reset); the turn's last warp publishes it.
    unsigned int turn_arrivals;
    int num_kv_blocks, num_tiles;   // the producer's, read at each tile rather than held (24 registers)
};

// q, k, v, dO as 4-D tensors (head_dim, seqlen, heads, batch) in boxes of 64 x BLOCK_M (q, dO) or
// 64 x BLOCK_N (k, v) elements, and dq_accum (float32) in boxes of 32 columns x BLOCK_M rows (the
// head-dim split: 16, a warp's; backward_sm90_dq_box_rows, read by the launcher), 128-byte swizzled
// (cupy_flash/_tma.py).
struct BackwardSm90Maps {
    TensorMap q, k, v, dout, dq_accum;
};

template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES>
__device__ const unsigned int backward_sm90_smem_bytes =
    sizeof(BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>) + SWIZZLE_ATOM_BYTES;

// Rows of the dq_accum tensor map's box, read by the launcher from the module (stated once): a
// consumer's 64 rows of a query block (key split; with a query block not a multiple of 64, all its
// rows), a warp's 16 (head-dim split: each warp adds its own).
template <int D_TILE, int BLOCK_M>
constexpr int backward_sm90_dq_rows = D_TILE > 128 ? 16 : key_split_dq_rows<BLOCK_M>;
template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES>
__device__ const unsigned int backward_sm90_dq_box_rows = backward_sm90_dq_rows<D_TILE, BLOCK_M>;

// Registers after setmaxnreg: the block's warpgroups launched at 168 a thread (sm_90 launch bounds
// of 384 threads). The producer's tile loop (persistent grid) spilled 8-20 bytes at 24 registers in
// some instantiations; at 232 the d = 128 consumers' wgmma were serialized (ptxas C7512) and the
// d = 64 variant consumers spilled 72-76 bytes. So: 40 / 232 where the consumers fit (d = 64 plain
// calls, d = 256), else 24 / 240 (the producer's loop then held in fewer values: the tile counts
// read from shared memory).
template <int D_TILE, int FEATURES>
struct BackwardSm90Registers {
    static constexpr bool roomy_producer = D_TILE > 128 || (D_TILE == 64 && FEATURES == 0);
    static constexpr int producer = roomy_producer ? 40 : 24, consumer = roomy_producer ? 232 : 240;
    static_assert(producer + BACKWARD_SM90_CONSUMERS * consumer <= (1 + BACKWARD_SM90_CONSUMERS) * 168,
                  "setmaxnreg split beyond the launch's registers: the block would hang");
};

// Deterministic mode's turns, both splits: a turn covers 128 query rows (dq_turn_blocks query
// blocks; counter m / dq_turn_blocks in the launcher's per-query-block array, of which turns of
// several blocks use the first part). A key block waits for its turn at a turn's first block (or
// its range's first), has the turn's adds complete before the barrier after its last block, and
// publishes them after that barrier. A turn is a chain of L2 round trips (the reduces' completion,
// the publish, the next key block's poll) of several us. Measured (H100): a turn a 64-query block
// at d = 256 took 1.44-1.52x the atomic time at 2k-16k, pairs gained 1-12%; pairs at d = 128
// 1.00-1.05x from 2k (interleaved runs, medians of 3); pairs of d = 64's 128-query blocks lost at
// 1k-2k (0.87-0.98x), so d = 64 keeps a turn a block.
template <int BLOCK_M>
constexpr int dq_turn_blocks = BLOCK_M >= 128 ? 1 : 128 / BLOCK_M;

// The order in which a key block visits its query blocks [range.x, range.y) (the producer's loads
// and both splits' loops), and deterministic mode's turns (TURN query blocks each) in that order.
// Ascending; descending for deterministic causal calls: every key block of a head sees the last
// query blocks, so all start at the same query block and key block j waits j turns once, its
// shorter work absorbing that (ascending, key block j starts at its diagonal behind j - 1, and
// the chain ends key blocks - 1 turns after the first key block's last). Measured (H100, bf16,
// interleaved A B B A, causal deterministic): d = 64 1k / 2k 1.13x / 1.10x, d = 128 512-2k
// 1.04-1.06x, d = 256 512-1k 1.05-1.07x, 4k-16k unchanged (0.98-1.01x).
template <int TURN>
struct QueryOrder {
    int2 range;
    bool descending;
    __device__ __forceinline__ int count() const { return range.y - range.x; }
    __device__ __forceinline__ int block(int it) const { return descending ? range.y - 1 - it : range.x + it; }
    __device__ __forceinline__ bool has_previous(int m) const { return descending ? m + 1 < range.y : m > range.x; }
    __device__ __forceinline__ int previous(int m) const { return descending ? m + 1 : m - 1; }
    __device__ __forceinline__ int last() const { return descending ? range.x : range.y - 1; }
    __device__ __forceinline__ bool first_of_turn(int m) const {
        return descending ? ((m + 1) % TURN == 0 || m + 1 == range.y) : (m % TURN == 0 || m == range.x);
    }
    __device__ __forceinline__ bool last_of_turn(int m) const {
        return descending ? (m % TURN == 0 || m == range.x) : ((m + 1) % TURN == 0 || m + 1 == range.y);
    }
};

// What the producer and the consumers know of their key block.
struct BackwardSm90Block {
    KeyBlock block;
    Sequence seq;
    Band band;
    int kv_start;
    bool keys_here;   // a packed batch's key blocks past their sequence's end do nothing
    int2 q_range;     // the query blocks that see any of the keys
    bool descending;  // visited last first (QueryOrder)
    int batch_coord;  // the tensor maps' batch coordinate (0 for a packed batch)
};

// A tile, one key block of a (batch, head), as the producer and the consumers see it. Atomic mode
// takes a head's key blocks in order, heads one after another (their Q, dO and dQ rows stay in
// L2; under a plain causal mask the last heads' dealt longest first across them); deterministic mode (p.dq_semaphore) DETERMINISTIC_KV_GROUP key blocks of a head at a time
// (key_block_of_tile). Measured (H100, bf16, d = 64 / 128, 2k-16k, against (batch, head)
// fastest): groups of 4 gave 1.0-1.53x (d = 64 2k 167 -> 224 TFLOP/s, d = 128 2k 203 -> 310).
// Against 4 (interleaved, 2k-16k): 2 lost 0-28% and 3 0-12% (the group's
// blocks share their head's Q, dO and dQ rows in L2); 6 lost at d = 64 2k causal (0.97x) and
// gained at d = 128 (2k-16k 0.996-1.023x, causal 2k-4k +2%) and d = 256 (2k-16k 0.993-1.093x,
// non-causal 2k-8k +5-9%; 1k 0.96-0.98x) in a two-round run; 8 lost 7-9% at d = 64 and d = 256
// 2k causal.
template <int D_TILE, int BLOCK_N, int BLOCK_M, bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ BackwardSm90Block backward_sm90_block(const FlashParams& p, int tile, int num_kv_blocks) {
    constexpr int DETERMINISTIC_KV_GROUP = D_TILE == 64 ? 4 : 6;
    // Atomic calls under a plain causal mask: the last heads' key blocks dealt longest first
    // across them (longest_first_tile; a key block sees fewer queries the later it starts).
    // (This beside key_block_of_tile's head-major branch on purpose: folded into it, with a
    // deal_tail flag, the plain kernels measured 0.97-1.00x at d = 256, 0.99-1.01x at d = 64 / 128:
    // docs/decisions.md, "the key block's two constructions kept apart".)
    KeyBlock block;
    if (triangular_tiles<IS_CAUSAL, FEATURES> && p.dq_semaphore == nullptr) {
        const unsigned int heads = (unsigned int)p.heads;
        const HeadTile t = longest_first_tile((unsigned int)tile, (unsigned int)num_kv_blocks, (unsigned int)(p.batch * p.heads));
        block = {(int)t.rank, (long long)(t.bh / heads), (long long)(t.bh % heads), (long long)t.bh};
    } else {
        block = key_block_of_tile(p, tile, num_kv_blocks, p.dq_semaphore == nullptr ? num_kv_blocks : DETERMINISTIC_KV_GROUP);
    }
    const int kv_start = block.kv_block * BLOCK_N;
    const Sequence seq = sequence_of<FEATURES>(p, block.b);
    const Band band = band_of(p, seq);
    // A packed batch's tiles cover its longest sequence; key blocks past this one's end do nothing
    // (the launcher's dK / dV rows past it belong to the next sequence).
    const bool keys_here = !(FEATURES & FEATURE_VARLEN) || kv_start < seq.seqlen_k;
    const int2 q_range = keys_here ? q_block_range<IS_CAUSAL, FEATURES>(seq, kv_start, BLOCK_M, BLOCK_N, band) : make_int2(0, 0);
    return {block, seq, band, kv_start, keys_here, q_range, IS_CAUSAL && p.dq_semaphore != nullptr,
            (FEATURES & FEATURE_VARLEN) ? 0 : (int)block.b};
}

// The producer thread's tile: each query block's Q and dO tiles and lse_log2 and delta rows into
// the ring (`ring`: the slots filled before this tile; it runs on across tiles), and after the
// first block's, K and V once the consumers are done with the last tile's (round: the block's
// tiles before this one).
template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES>
__device__ __forceinline__ void backward_sm90_produce(BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>& smem,
                                                      const BackwardSm90Maps& maps, const FlashParams& p,
                                                      const BackwardSm90Block& at, int round, int& ring) {
    constexpr int CHUNKS = D_TILE / SWIZZLE_ROW_ELEMENTS;
    const long long h = at.block.h;
    const long long stats_row0 = at.block.bh * p.delta_stride;   // (batch, head)'s rows: delta_batch_stride = heads x delta_stride
    const int kv_head = (int)kv_head_of_wide(h, p);
    const auto load_keys = [&]() {
        const unsigned int kv_full = smem_addr(&smem.kv_full);
        barrier_wait(smem_addr(&smem.kv_empty), (round & 1) ^ 1);
        barrier_arrive_expect(kv_full, 2 * BLOCK_N * D_TILE * sizeof(T));
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            tma_load_4d(smem_addr(&smem.k[c][0][0]), &maps.k, kv_full, c * SWIZZLE_ROW_ELEMENTS, at.seq.k_row0 + at.kv_start,
                        kv_head, at.batch_coord);
            tma_load_4d(smem_addr(&smem.v[c][0][0]), &maps.v, kv_full, c * SWIZZLE_ROW_ELEMENTS, at.seq.k_row0 + at.kv_start,
                        kv_head, at.batch_coord);
        }
    };
    const QueryOrder<1> order{at.q_range, at.descending};
    const auto load_query_block = [&](int i) {
        const int m = order.block(i);
        const RingSlot slot = ring_slot<STAGES>(ring + i);
        barrier_wait(smem_addr(&smem.empty[slot.index]), slot.parity ^ 1);
        const unsigned int full = smem_addr(&smem.full[slot.index]);
        barrier_arrive_expect(full, 2 * BLOCK_M * D_TILE * sizeof(T) + 2 * BLOCK_M * sizeof(float));
        const int row = at.seq.q_row0 + m * BLOCK_M;
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            tma_load_4d(smem_addr(&smem.q[slot.index][c][0][0]), &maps.q, full, c * SWIZZLE_ROW_ELEMENTS, row, (int)h,
                        at.batch_coord);
            tma_load_4d(smem_addr(&smem.dout[slot.index][c][0][0]), &maps.dout, full, c * SWIZZLE_ROW_ELEMENTS, row, (int)h,
                        at.batch_coord);
        }
        const long long stats_row = stats_row0 + m * BLOCK_M;
        bulk_load(smem_addr(&smem.lse_log2[slot.index][0]), p.lse_log2 + stats_row, BLOCK_M * sizeof(float), full);
        bulk_load(smem_addr(&smem.delta[slot.index][0]), p.delta + stats_row, BLOCK_M * sizeof(float), full);
    };
    // The first query block's loads go out before the wait for the last tile's K and V to be
    // released: a free slot takes them while the consumers finish that tile.
    if (order.count() > 0) load_query_block(0);
    load_keys();   // (where no query block sees the keys too: the consumers wait for them all the same)
#pragma unroll 1
    for (int i = 1; i < order.count(); ++i) load_query_block(i);
    ring += order.count();
}

template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES, bool IS_CAUSAL, int FEATURES, bool ADDS_DQ>
__device__ __forceinline__ void backward_sm90_key_split(BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>& smem,
                                                        const BackwardSm90Maps& maps, const FlashParams& p,
                                                        const BackwardSm90Block& at, int round, int& ring);
template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES, bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ void backward_sm90_head_dim_split(BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>& smem,
                                                             const BackwardSm90Maps& maps, const FlashParams& p,
                                                             const BackwardSm90Block& at, int round, int& ring);
template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES, bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ void backward_sm90_product_split(BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>& smem,
                                                            const FlashParams& p, const BackwardSm90Block& at, int round,
                                                            int& ring);

// A persistent grid (one block per SM, the launcher's min(tiles, SMs)) whose blocks take their
// tiles from a counter (TileHandover, TileCounter: zero at launch, left zero): the next tile's K, V
// and first Q / dO load under this one's dK / dV stores, where a block per tile paid its start
// (barriers, the first loads) and its end (the stores, the last dQ adds) on an SM doing nothing
// else: 2,048 such blocks of a d = 128 2k causal call took 171 us with no query block to visit.
// Deterministic mode waits only for lower tiles, which blocks fetched earlier and finish first;
// its launches give a block per tile (cupy_flash/families/sm90.py, grid_of: the turns' chains were slower with
// tiles claimed ahead), so each block's fetch finds the counter past the end.
template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES, bool IS_CAUSAL, int FEATURES, bool ADDS_DQ>
__global__ void __launch_bounds__(128 * (1 + BACKWARD_SM90_CONSUMERS), 1)
flash_backward_sm90_kernel(const __grid_constant__ BackwardSm90Maps maps, const FlashParams p, TileCounter* tile_counter) {
    using Storage = BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>;
    using Tiles = PersistentTiles<true, true>;   // from the counter; a consumer thread receives its own
    constexpr int CONSUMERS = BACKWARD_SM90_CONSUMERS;
    static_assert(!(FEATURES & (FEATURE_SOFTCAP | FEATURE_ALIBI | FEATURE_BIAS)), "score modifiers run on the portable backward");
    static_assert(sizeof(Storage) + SWIZZLE_ATOM_BYTES <= SM90_BLOCK_SMEM_BYTES, "shared memory of one sm_90 block");
    require_dynamic_smem(backward_sm90_smem_bytes<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>);
    extern __shared__ unsigned char smem_raw[];
    Storage& smem = aligned_shared_storage<Storage>(smem_raw);
    // Tiles: key blocks of the longest sequence per (batch, head) (< 2^31: the launcher's grid limit).
    const int num_kv_blocks = (int)((p.seqlen_k + BLOCK_N - 1) / BLOCK_N);
    const int num_tiles = num_kv_blocks * (int)(p.batch * p.heads);

    if (threadIdx.x == 0) {
        prefetch_tensor_map(&maps.q);
        prefetch_tensor_map(&maps.k);
        prefetch_tensor_map(&maps.v);
        prefetch_tensor_map(&maps.dout);
        if (ADDS_DQ) prefetch_tensor_map(&maps.dq_accum);
        barrier_init(smem_addr(&smem.kv_full), 1);
        // One arrival per consumer thread, after its last product of the tile that reads K or V.
        barrier_init(smem_addr(&smem.kv_empty), 128 * CONSUMERS);
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(smem_addr(&smem.full[s]), 1);
            // One arrival per consumer thread: each read the slot's lse and delta rows with its own
            // loads, and an arrival releases only the arriving thread's reads (racecheck flagged
            // the bulk copy into the slot against lanes 1-31's reads when only lane 0 arrived).
            barrier_init(smem_addr(&smem.empty[s]), 128 * CONSUMERS);
        }
        smem.tiles.init(128 * CONSUMERS);   // receive_each: one arrival a consumer thread
        smem.turn_arrivals = 0;
        smem.num_kv_blocks = num_kv_blocks;
        smem.num_tiles = num_tiles;
        barrier_init_fence();
    }
    __syncthreads();

    int ring = 0;
    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        release_registers<BackwardSm90Registers<D_TILE, FEATURES>::producer>();
        if (threadIdx.x == 0) {
#pragma unroll 1
            for (int tile = blockIdx.x, round = 0; tile < *static_cast<volatile int*>(&smem.num_tiles); ++round) {
                const int kv_blocks = *static_cast<volatile int*>(&smem.num_kv_blocks);
                backward_sm90_produce(smem, maps, p, backward_sm90_block<D_TILE, BLOCK_N, BLOCK_M, IS_CAUSAL, FEATURES>(p, tile, kv_blocks),
                                      round, ring);
                tile = Tiles::producer_next(tile, tile_counter, smem.tiles, round);
            }
            Tiles::release_counter(tile_counter);
            // Behind the dQ kernel (cupy_flash/families/sm90.py) this kernel is launched early: its
            // blocks take the SMs the dQ kernel's last blocks leave. It reads nothing that kernel
            // writes (its lse_log2 / delta are the preprocess's, complete before the dQ kernel
            // started), but it must not end before it, so that the stream's next work sees dQ:
            // one thread a block waits for it here (at once after an ordinary launch).
            wait_for_predecessor();
        }
        return;
    }

    acquire_registers<BackwardSm90Registers<D_TILE, FEATURES>::consumer>();
#pragma unroll 1
    for (int tile = blockIdx.x, round = 0; tile < num_tiles; ++round) {
        const BackwardSm90Block at = backward_sm90_block<D_TILE, BLOCK_N, BLOCK_M, IS_CAUSAL, FEATURES>(p, tile, num_kv_blocks);
        if constexpr (Storage::HEAD_DIM_SPLIT && !ADDS_DQ)
            backward_sm90_product_split<T, D_TILE, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL, FEATURES>(smem, p, at, round, ring);
        else if constexpr (Storage::HEAD_DIM_SPLIT)
            backward_sm90_head_dim_split<T, D_TILE, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL, FEATURES>(smem, maps, p, at, round, ring);
        else
            backward_sm90_key_split<T, D_TILE, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL, FEATURES, ADDS_DQ>(smem, maps, p, at, round, ring);
        tile = Tiles::consumer_next(tile, smem.tiles, round);
    }
    // The dQ reduces (each consumer's first thread's; at d = 256 each warp's first lane's) are done
    // before the block's shared memory goes.
    if (threadIdx.x % 32 == 0) tma_store_wait_all();
}

// P^T in place of S^T (a consumer's 64 keys x N queries, in the accumulator layout): exp2 of the
// scaled scores less the queries' lse_log2 (`lse` and `first_query`: the tile's first query),
// masked where needs_mask. query_col: the thread's first column (2 (lane % 4)).
template <bool IS_CAUSAL, int FEATURES, int N>
__device__ __forceinline__ void probabilities_in_place(float (&s)[N / 2], const float* lse, float scale_log2, bool needs_mask,
                                                       int first_key, int first_query, int query_col, int seqlen_k,
                                                       const Band& band) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
        const int col = 8 * i + query_col;
        const float2 row_lse = *reinterpret_cast<const float2*>(lse + col);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = first_key + accumulator_row(e), query = first_query + col + accumulator_col(e);   // S^T: keys are rows
            float prob = exp2f(fmaf(s[4 * i + e], scale_log2, -((e & 1) ? row_lse.y : row_lse.x)));
            if (needs_mask && !key_visible<IS_CAUSAL, FEATURES>(key, query, seqlen_k, band)) prob = 0.f;
            s[4 * i + e] = prob;
        }
    }
}

// dS^T = P^T (dP^T - delta[query]) in place of dP^T (`delta`: the tile's first query's).
template <int N>
__device__ __forceinline__ void score_gradients_in_place(float (&dp)[N / 2], const float (&prob)[N / 2], const float* delta,
                                                         int query_col) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
        const float2 dsum = *reinterpret_cast<const float2*>(delta + 8 * i + query_col);
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[4 * i + e] = prob[4 * i + e] * (dp[4 * i + e] - ((e & 1) ? dsum.y : dsum.x));
    }
}

// The epilogue: a consumer's dK (times softmax_scale) and dV as T, 4-byte stores from the
// accumulator layout (keys first_key + 0 and + 8; COLUMNS head-dim columns from column0). Under
// GQA/MQA (p.group > 1) they go to the per-query-head buffers as float32, 8-byte stores: the group
// sum rounds once (rounded here too, dV was 2.9x the dense error at one key, d = 8, bf16).
template <typename T, int COLUMNS, int FEATURES>
__device__ __forceinline__ void store_key_gradients(const float (&dk)[COLUMNS / 2], const float (&dv)[COLUMNS / 2],
                                                    const FlashParams& p, const BackwardSm90Block& at, int first_key,
                                                    int column0, int query_col) {
    const int head_dim = (int)p.head_dim, head_dim_v = head_dim_v_of<FEATURES>(p);
    const long long dk_offset = tensor_offset(p.dk_strides, at.block.b, at.seq.k_row0, at.block.h);
    const long long dv_offset = tensor_offset(p.dv_strides, at.block.b, at.seq.k_row0, at.block.h);
    const bool per_head = p.group > 1;
#pragma unroll
    for (int i = 0; i < COLUMNS / 8; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = first_key + 8 * r, col = column0 + 8 * i + query_col;
            if (at.keys_here && key < at.seq.seqlen_k) {
                const long long dk_at = dk_offset + (long long)key * p.dk_strides[1] + col;
                const long long dv_at = dv_offset + (long long)key * p.dv_strides[1] + col;
                const float dk0 = dk[4 * i + 2 * r] * p.softmax_scale, dk1 = dk[4 * i + 2 * r + 1] * p.softmax_scale;
                const float dv0 = dv[4 * i + 2 * r], dv1 = dv[4 * i + 2 * r + 1];
                if (per_head) {
                    if (col < head_dim) *reinterpret_cast<float2*>(static_cast<float*>(p.dk) + dk_at) = make_float2(dk0, dk1);
                    if (col < head_dim_v) *reinterpret_cast<float2*>(static_cast<float*>(p.dv) + dv_at) = make_float2(dv0, dv1);
                } else {
                    if (col < head_dim) *reinterpret_cast<unsigned int*>(static_cast<T*>(p.dk) + dk_at) = Mma<T>::pack(dk0, dk1);
                    if (col < head_dim_v) *reinterpret_cast<unsigned int*>(static_cast<T*>(p.dv) + dv_at) = Mma<T>::pack(dv0, dv1);
                }
            }
        }
}

// The key split's shape (d <= 128, BLOCK_N = 128): each consumer owns 64 of the block's keys in
// every product; dS goes through shared memory for dQ only.
template <int D_TILE, int BLOCK_N, int BLOCK_M, int FEATURES>
struct KeySplitShape {
    static constexpr int CHUNKS = D_TILE / SWIZZLE_ROW_ELEMENTS;
    static constexpr int CONSUMERS = BACKWARD_SM90_CONSUMERS;   // 64 keys each
    static constexpr int DQ_BARRIER = 1;             // named barrier of the consumers around dS (0: __syncthreads)
    static constexpr unsigned int K_CHUNK_BYTES = BLOCK_N * 128, Q_CHUNK_BYTES = BLOCK_M * 128;
    // dQ's work items: (64 query rows, 64-column chunk) pieces of the query block (the dQ wgmma's M
    // is 64), shared out between the consumers, at most one each (its staging buffer is rewritten
    // each block). d = 128: two chunks of 64 queries; d = 64: 128 queries (BLOCK_M), two halves of
    // one chunk, so both consumers have one (with 64 queries consumer 0 had the only one, and
    // consumer 1 waited for it at the next block's barrier: 17% of the stall samples, ncu).
    // With dQ transposed (dq_transposed: dQ^T = K^T dS^T), M = the consumer's 64 head-dim columns
    // (chunk `consumer`), N = the block's queries, K = its keys.
    static constexpr bool DQ_TRANSPOSED = dq_transposed<BLOCK_M>;
    static constexpr int QUERY_HALVES = DQ_TRANSPOSED ? 1 : BLOCK_M / 64, DQ_ITEMS = QUERY_HALVES * CHUNKS;
    static_assert(BLOCK_N == 64 * CONSUMERS && BLOCK_M % 16 == 0 && D_TILE % 64 == 0, "64 keys per consumer, k16 query steps");
    static_assert(DQ_ITEMS <= CONSUMERS, "one dQ item per consumer and block: its shared memory is rewritten each block");
    static_assert(!DQ_TRANSPOSED || CHUNKS == CONSUMERS, "transposed dQ: a 64-column chunk per consumer");
    // Deterministic mode: one counter per (batch, head, query block); each consumer's first thread
    // waits for this block's turn (the key blocks before it, in order) before its adds to a query
    // block, and the first consumer's publishes them once both consumers have passed the next
    // block's barrier (each having waited for its adds to complete).
    // Its turns (dq_turn_blocks): at d = 128 pairs of query blocks, at d = 64 one block.
    static constexpr int TURN_BLOCKS = dq_turn_blocks<BLOCK_M>;
    static_assert(TURN_BLOCKS == 1 || ((TURN_BLOCKS * BLOCK_M) & (TURN_BLOCKS * BLOCK_M - 1)) == 0,
                  "a turn's first row is a mask of q_start");
    // Where DEFER_DQ_ADD the fence, the barrier and the add of a block's staged piece wait until the
    // next block's products are issued (d = 128: S^T's; d = 64, whose S^T is short: dP^T's) and run
    // under them, not between this block's products and the next's while the tensor cores idle.
    // Interleaved A/B (docs/decisions.md, "deferred dQ add"): d = 128 atomic
    // 2k-16k 1.03-1.09x, d = 64 atomic 2k-16k 1.03-1.08x (d = 64 after S^T instead: 0.92x causal).
    // Deterministic calls add at once, their turn first: deferred, their publish waited for the
    // later add (d = 128 0.94-0.98x at 2k-4k, d = 64 0.95-0.97x at 4k-16k without a mask). No
    // staged-start register: the piece added is always the previous block's (with the register,
    // the runtime branch spilled 48 bytes). The variant kernels spilled 32-976 bytes with it; ncu
    // (d = 64, 4k): the staging stores, fence and barrier held 15% of the consumers' stall samples.
    static constexpr bool DEFER_DQ_ADD = DQ_TRANSPOSED || (D_TILE == 64 && FEATURES == 0);
    static_assert(!DEFER_DQ_ADD || (!(FEATURES & FEATURE_VARLEN) && DQ_ITEMS == CONSUMERS),
                  "deferred: every block stages a piece in each consumer");

    // A dQ item's 64-column chunk and first query row of the block (constants where the block has
    // 64 queries).
    static __device__ __forceinline__ int2 dq_item_chunk(int item) {
        return make_int2(QUERY_HALVES == 1 ? item : item % CHUNKS, QUERY_HALVES == 1 ? 0 : 64 * (item / CHUNKS));
    }
};

// A key-split consumer's view of its tile: references to backward_sm90_key_split's values (as its
// lambdas captured them), and the steps of a query block that use them.
template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES, bool IS_CAUSAL, int FEATURES>
struct KeySplitTile {
    using Shape = KeySplitShape<D_TILE, BLOCK_N, BLOCK_M, FEATURES>;
    BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>& smem;
    const BackwardSm90Maps& maps;
    const FlashParams& p;
    const Sequence& seq;
    const Band& band;
    const long long h;
    const int kv_block, kv_start, batch_coord, consumer, thread, warp, lane, query_col, first_key;
    const unsigned int k_rows, v_rows;
    float* const dq_accum;
    int* const semaphores;
    const QueryOrder<Shape::TURN_BLOCKS> order;

    // This consumer's dQ piece, staged in shared memory (its rows from query q_start), added by a TMA
    // reduce that its first thread issues after the proxy fence (which waits for the staging
    // stores) and the consumer's barrier.
    __device__ __forceinline__ void issue_dq_add(int q_start) const {
        if constexpr (Shape::DQ_TRANSPOSED) {
            static_assert(backward_sm90_dq_rows<D_TILE, BLOCK_M> == BLOCK_M, "a box is the block's rows");
#pragma unroll
            for (int half = 0; half < 2; ++half)
                tma_reduce_add_4d(&maps.dq_accum, smem_addr(&smem.dq[consumer][half][0][0]),
                                  consumer * SWIZZLE_ROW_ELEMENTS + 32 * half, seq.q_row0 + q_start, (int)h, batch_coord);
        } else {
            const int2 chunk = Shape::dq_item_chunk(consumer);   // the consumer's item (at most one)
            static_assert(backward_sm90_dq_rows<D_TILE, BLOCK_M> == 64, "a box is a consumer's 64 rows");
#pragma unroll
            for (int half = 0; half < 2; ++half)
                tma_reduce_add_4d(&maps.dq_accum, smem_addr(&smem.dq[consumer][half][0][0]),
                                  chunk.x * SWIZZLE_ROW_ELEMENTS + 32 * half, seq.q_row0 + q_start + chunk.y, (int)h, batch_coord);
        }
        tma_store_commit();
    }
    // The piece of block `it` of the loop (each block stages one where DEFER_DQ_ADD).
    __device__ __forceinline__ void add_staged_dq(int it) const {
        fence_async_shared();
        named_barrier_sync(2 + consumer, 128);   // the piece is written (ids 2, 3: one per consumer)
        if (thread == 0) issue_dq_add(order.block(it) * BLOCK_M);
    }

    // S^T = K Q^T and dP^T = V dO^T (this consumer's 64 keys x BLOCK_M queries), in two groups: P is
    // computed while dP^T's products run (and, where deferred, the last block's dQ piece added);
    // then P^T in place of S^T and dS^T of dP^T. (Issuing dV += P^T dO before dS too kept P's A
    // fragments live beside dS's: 20 bytes spilled at d = 128 with a window.)
    __device__ __forceinline__ void scores(float (&s)[BLOCK_M / 2], float (&dp)[BLOCK_M / 2], int it, const RingSlot& slot,
                                           int q_start, unsigned int q_base, unsigned int do_base, bool adds_deferred) const {
        constexpr unsigned int K_CHUNK_BYTES = Shape::K_CHUNK_BYTES, Q_CHUNK_BYTES = Shape::Q_CHUNK_BYTES;
        warpgroup_arrive();
        mma_k_major<T, BLOCK_M, D_TILE>(s, k_rows, K_CHUNK_BYTES, q_base, Q_CHUNK_BYTES);
        warpgroup_commit();
        if constexpr (Shape::DEFER_DQ_ADD && Shape::DQ_TRANSPOSED) {
            if (adds_deferred && it > 0) add_staged_dq(it - 1);   // the last block's piece, under S^T's products
            warpgroup_arrive();
        }
        mma_k_major<T, BLOCK_M, D_TILE>(dp, v_rows, K_CHUNK_BYTES, do_base, Q_CHUNK_BYTES);
        warpgroup_commit();
        if constexpr (Shape::DEFER_DQ_ADD && !Shape::DQ_TRANSPOSED) {   // d = 64: S^T is short; under dP^T's products
            if (adds_deferred && it > 0) add_staged_dq(it - 1);
        }
        warpgroup_wait<1>();   // S^T
        hold_registers(s);

        // P^T in place.
        const float* lse_tile = smem.lse_log2[slot.index];
        const float* delta_tile = smem.delta[slot.index];
        const bool needs_mask = tile_needs_mask<IS_CAUSAL, FEATURES>(q_start, BLOCK_M, kv_start + 64 * consumer, 64,
                                                                    seq.seqlen_k, band);
        probabilities_in_place<IS_CAUSAL, FEATURES, BLOCK_M>(s, lse_tile, p.scale_log2, needs_mask, first_key, q_start,
                                                             query_col, seq.seqlen_k, band);
        warpgroup_wait<0>();   // dP^T
        hold_registers(dp);

        // dS^T in place.
        score_gradients_in_place<BLOCK_M>(dp, s, delta_tile, query_col);
    }

    // dQ apart (flash_backward_dq_sm90_kernel): dV += P^T dO and dK += dS^T Q, both with A from
    // registers; dS never leaves them, and the consumers never meet.
    __device__ __forceinline__ void gradients_without_dq(float (&dk)[D_TILE / 2], float (&dv)[D_TILE / 2],
                                                         const unsigned int (&pa)[BLOCK_M / 16][4],
                                                         const unsigned int (&dsa)[BLOCK_M / 16][4], unsigned int q_base,
                                                         unsigned int do_base) const {
        const unsigned long long do_desc = n_major_descriptor(do_base, Shape::Q_CHUNK_BYTES);
        const unsigned long long q_desc = n_major_descriptor(q_base, Shape::Q_CHUNK_BYTES);
        warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk)
            Wgmma<T, D_TILE>::template rs<1>(dv, pa[kk], advance_descriptor(do_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk)
            Wgmma<T, D_TILE>::template rs<1>(dk, dsa[kk], advance_descriptor(q_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
        warpgroup_commit();
        warpgroup_wait<0>();
        hold_registers(dk);
        hold_registers(dv);
    }

    // Deterministic: this key block's turn at m's turn of query blocks (the key blocks before it
    // that see the turn's rows, from the first that sees its first row: .x depends on that row
    // only), waited for by each consumer's first thread before its adds to the turn's first
    // block. A turn a block (d = 64): block_turn, computed by every thread. Pairs: by the waiting
    // thread, the pair's first row a mask of q_start (hoisted, or from m / TURN_BLOCKS, it
    // spilled 24 bytes at d = 64).
    __device__ __forceinline__ void wait_turn(int m, int q_start, int block_turn) const {
        constexpr int TURN_BLOCKS = Shape::TURN_BLOCKS;
        if constexpr (TURN_BLOCKS == 1) {
            wait_dq_turn(semaphores + m, block_turn);
        } else {
            wait_dq_turn(semaphores + m / TURN_BLOCKS,
                         (FEATURES & FEATURE_WINDOW)
                             ? kv_block - kv_block_range<IS_CAUSAL, FEATURES>(seq, q_start & -(TURN_BLOCKS * BLOCK_M), BLOCK_M,
                                                                              BLOCK_N, band).x
                             : block_turn);
        }
    }
    // Block `it`'s staged piece (each consumer's, whole rows): where DEFER_DQ_ADD, atomic calls
    // leave it to the next block and deterministic ones add it at once, their turn first;
    // elsewhere added at once, the turn waited for after the barrier.
    __device__ __forceinline__ void add_or_defer_staged_dq(int it, int m, int q_start, int block_turn) const {
        if constexpr (Shape::DEFER_DQ_ADD) {
            if (semaphores != nullptr) {
                if (thread == 0 && order.first_of_turn(m)) wait_turn(m, q_start, block_turn);
                add_staged_dq(it);
            }
        } else {
            fence_async_shared();
            named_barrier_sync(2 + consumer, 128);   // the piece is written (ids 2, 3: one per consumer)
            if (thread == 0) {
                if (semaphores != nullptr && order.first_of_turn(m)) wait_turn(m, q_start, block_turn);
                issue_dq_add(q_start);
            }
        }
    }
    // The consumers' meeting of block m, after both wrote their dS rows. The staging is rewritten
    // after it: its last reduce has read it (deterministic, after a pair's last block: has
    // completed in global memory, so the pair's adds are published after the barrier).
    __device__ __forceinline__ void meet_after_ds(int m, bool publisher) const {
        constexpr int TURN_BLOCKS = Shape::TURN_BLOCKS;
        if (thread == 0) {
            if (semaphores != nullptr && (TURN_BLOCKS == 1 || (order.has_previous(m) && order.last_of_turn(order.previous(m)))))
                tma_store_wait_all();
            else tma_store_wait_read();
        }
        named_barrier_sync(Shape::DQ_BARRIER, 128 * Shape::CONSUMERS);   // both consumers' dS rows are written
        if (publisher && order.has_previous(m) && order.last_of_turn(order.previous(m)))
            publish_dq(semaphores + order.previous(m) / TURN_BLOCKS);   // the last turn's adds are done
    }

    // dS to shared memory in dS buffer `buffer`: both consumers' dQ products of two blocks ago read
    // it, and both waited for them before the last block's barrier. dsa[kk] holds four 8 x 8 tiles
    // of dS^T (keys x queries): (query blocks 2kk, 2kk + 1) x (key rows + 0, + 8); stmatrix .trans
    // writes each as 8 query rows of 8 contiguous keys, lane L giving the address of row L % 8 of
    // tile L / 8 (one instruction for 16 two-byte stores).
    __device__ __forceinline__ void stage_ds(const unsigned int (&dsa)[BLOCK_M / 16][4], int buffer) const {
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) {
            const int tile = lane / 8;
            const int query = 16 * kk + 8 * (tile >> 1) + lane % 8, key = 16 * warp + 8 * (tile & 1);
            stmatrix_x4_trans(smem_addr(&smem.ds[buffer][consumer][0][0]) + swizzled_offset(query, key), dsa[kk]);
        }
        fence_async_shared();   // the dS writes, before the dQ wgmma reads them
    }

    // dQ^T (this consumer's 64 columns x the block's queries) = K^T dS^T, where dQ is transposed:
    // A is the K chunk read M-major (columns contiguous), B dS buffer `buffer` (queries x keys) read
    // K-major; dK's product (issue_dk) goes behind it, and dQ^T is staged for the consumer's add.
    template <typename IssueDk>
    __device__ __forceinline__ void transposed_dq(int buffer, float (&dqt)[BLOCK_M / 2], const IssueDk& issue_dk) const {
        const unsigned long long kt_desc = n_major_descriptor(smem_addr(&smem.k[consumer][0][0]), Shape::K_CHUNK_BYTES);
        const unsigned long long ds_desc = k_major_descriptor(smem_addr(&smem.ds[buffer][0][0][0]));
        warpgroup_arrive();
#pragma unroll
        for (int kc = 0; kc < Shape::CONSUMERS; ++kc)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                Wgmma<T, BLOCK_M>::template ss<0, 1>(
                    dqt, advance_descriptor(kt_desc, (4 * kc + kk) * 2 * SWIZZLE_ATOM_BYTES),
                    advance_descriptor(ds_desc, kc * (unsigned int)sizeof(smem.ds[0][0]) + kk * 32), kc > 0 || kk > 0);
        warpgroup_commit();
        issue_dk();
        warpgroup_wait<1>();   // dV and dQ^T (dK runs on)
        hold_registers(dqt);
        // Thread's elements: column 16 warp + lane / 4 + 8 r of the consumer's 64 (warps 0-1 the
        // first 32-column half, 2-3 the second), queries 8 i + 2 (lane % 4) + e. Staged as
        // [query][32 columns], 128-byte rows, 16-byte units swizzled by query % 8 (TMA's
        // 128-byte swizzle): a store instruction's 32 lanes hit 8 distinct units of 4 rows
        // whose query % 8 differ, so every bank once.
        // Every row of a transposed block is whole: packed batches (the one partial-block case)
        // run the variant kernels' 64-query blocks (families/sm90.py, backward_sm90_config).
        static_assert(!(FEATURES & FEATURE_VARLEN), "transposed dQ: plain calls only");
        unsigned char* half = reinterpret_cast<unsigned char*>(&smem.dq[consumer][warp / 2][0][0]);
#pragma unroll
        for (int i = 0; i < BLOCK_M / 8; ++i)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = 16 * (warp % 2) + lane / 4 + 8 * r, query = 8 * i + query_col + e;
                    const unsigned int unit = (unsigned int)(col / 4) ^ (unsigned int)(query & 7);
                    *reinterpret_cast<float*>(half + query * 128 + unit * 16 + (col % 4) * 4) = dqt[4 * i + 2 * r + e];
                }
    }

    // dQ (64 queries x 64 head-dim columns of item `item`) = dS K over the block's BLOCK_N keys, from
    // dS buffer `buffer`, with dK's product (issue_dk) behind it. The items are shared out between
    // the consumers, so each dQ element is added to dq_accum once per key block (two adds, one per
    // consumer's keys, left the kernel L2-bound: ncu, d = 128, 4k: L2 83.8%, SM 33.8%).
    template <typename IssueDk>
    __device__ __forceinline__ void dq_item_product(int item, int buffer, float (&dq)[SWIZZLE_ROW_ELEMENTS / 2],
                                                    const IssueDk& issue_dk) const {
        const int2 chunk = Shape::dq_item_chunk(item);
        const int c = chunk.x, rows = chunk.y;
        const unsigned long long ds_desc = k_major_descriptor(smem_addr(&smem.ds[buffer][0][rows][0]));
        const unsigned long long k_desc = n_major_descriptor(smem_addr(&smem.k[c][0][0]), Shape::K_CHUNK_BYTES);
        warpgroup_arrive();
#pragma unroll
        for (int kc = 0; kc < Shape::CONSUMERS; ++kc)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                Wgmma<T, SWIZZLE_ROW_ELEMENTS>::template ss<1>(
                    dq, advance_descriptor(ds_desc, kc * (unsigned int)sizeof(smem.ds[0][0]) + kk * 32),
                    advance_descriptor(k_desc, kc * 64 * 128 + kk * 2 * SWIZZLE_ATOM_BYTES), kc > 0 || kk > 0);
        warpgroup_commit();
        issue_dk();
        warpgroup_wait<1>();   // dV and dQ (dK runs on)
        hold_registers(dq);
    }

    // An item's dQ staged for the consumer's TMA reduce-add: element (row, col) of a 32-column half
    // at row * 128 bytes, its 16-byte unit swizzled by row % 8 (TMA's 128-byte swizzle): a warp's
    // float2 stores then fill every bank twice, the least 256 bytes take.
    __device__ __forceinline__ void stage_dq_rows(const float (&dq)[SWIZZLE_ROW_ELEMENTS / 2]) const {
#pragma unroll
        for (int i = 0; i < SWIZZLE_ROW_ELEMENTS / 8; ++i)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = 16 * warp + lane / 4 + 8 * r;
                const unsigned int unit = (unsigned int)(2 * (i % 4) + (lane % 4) / 2) ^ (unsigned int)(row & 7);
                float* half = &smem.dq[consumer][i / 4][0][0];
                *reinterpret_cast<float2*>(reinterpret_cast<unsigned char*>(half) + row * 128 + unit * 16 +
                                           8 * (lane % 2)) = make_float2(dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
            }
    }
};

// A key-split consumer's tile (KeySplitShape): dK and dV of its 64 keys over the query blocks.
template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES, bool IS_CAUSAL, int FEATURES, bool ADDS_DQ>
__device__ __forceinline__ void backward_sm90_key_split(BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>& smem,
                                                        const BackwardSm90Maps& maps, const FlashParams& p,
                                                        const BackwardSm90Block& at, int round, int& ring) {
    using Shape = KeySplitShape<D_TILE, BLOCK_N, BLOCK_M, FEATURES>;
    constexpr int CONSUMERS = Shape::CONSUMERS, TURN_BLOCKS = Shape::TURN_BLOCKS;
    constexpr unsigned int Q_CHUNK_BYTES = Shape::Q_CHUNK_BYTES;
    const KeyBlock& block = at.block;
    const long long b = block.b, h = block.h;
    const int kv_start = at.kv_start, batch_coord = at.batch_coord;
    const Sequence& seq = at.seq;
    const Band& band = at.band;
    const int2 q_range = at.q_range;
    const int warpgroup = threadIdx.x / 128;
    const int consumer = warpgroup - 1;
    const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
    const int key_row = 16 * warp + lane / 4;       // this thread's keys: + 0 and + 8 (of the consumer's 64)
    const int query_col = 2 * (lane % 4);           // and queries 8i + this (+1)
    const int first_key = kv_start + 64 * consumer + key_row;
    const unsigned int k_rows = smem_addr(&smem.k[0][64 * consumer][0]);
    const unsigned int v_rows = smem_addr(&smem.v[0][64 * consumer][0]);
    float* dq_accum = p.dq_accum + tensor_offset(p.dq_accum_strides, b, seq.q_row0, h);
    int* semaphores = p.dq_semaphore == nullptr ? nullptr : dq_semaphores_of<BLOCK_M>(p, block.bh);
    const bool publisher = semaphores != nullptr && consumer == 0 && thread == 0;
    const QueryOrder<TURN_BLOCKS> order{q_range, at.descending};
    const KeySplitTile<T, D_TILE, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL, FEATURES> tile{
        smem, maps, p, seq, band, h, block.kv_block, kv_start, batch_coord, consumer, thread, warp, lane, query_col, first_key,
        k_rows, v_rows, dq_accum, semaphores, order};

    // Atomic calls add the previous block's staged piece at the top of the loop. Without dQ there is
    // none (the dQ kernel computes dQ): adds of the never-written staging went into dq through the
    // map that stands in for dq_accum, in every deterministic d = 64 / 128 call that takes the dQ
    // kernel, hidden because that kernel ran after this one and overwrote dq. The runtime half (no
    // accumulator) is the same fact as !ADDS_DQ; with the branch folded away at compile time ptxas
    // spilled 4 bytes in the d = 64 kernels without dQ.
    const bool adds_deferred = (ADDS_DQ || p.dq_accum != nullptr) && semaphores == nullptr;
    float dk[D_TILE / 2], dv[D_TILE / 2];
#pragma unroll
    for (int i = 0; i < D_TILE / 2; ++i) dk[i] = dv[i] = 0.f;
    barrier_wait(smem_addr(&smem.kv_full), round & 1);   // also where no query block sees these keys: the loads must land

#pragma unroll 1
    for (int it = 0; it < order.count(); ++it) {
        const int m = order.block(it);
        const RingSlot slot = ring_slot<STAGES>(ring + it);
        const int q_start = m * BLOCK_M;
        barrier_wait(smem_addr(&smem.full[slot.index]), slot.parity);
        const unsigned int q_base = smem_addr(&smem.q[slot.index][0][0][0]);
        const unsigned int do_base = smem_addr(&smem.dout[slot.index][0][0][0]);

        float s[BLOCK_M / 2], dp[BLOCK_M / 2];
        tile.scores(s, dp, it, slot, q_start, q_base, do_base, adds_deferred);
        unsigned int pa[BLOCK_M / 16][4], dsa[BLOCK_M / 16][4];
        accumulator_to_a<T, BLOCK_M>(pa, s);
        accumulator_to_a<T, BLOCK_M>(dsa, dp);
        if constexpr (!ADDS_DQ) {
            tile.gradients_without_dq(dk, dv, pa, dsa, q_base, do_base);
            barrier_arrive(smem_addr(&smem.empty[slot.index]));   // the slot's Q and dO: last read by dK / dV
            continue;
        }
        tile.stage_ds(dsa, (ring + it) & 1);

        // dV += P^T dO (A from registers, dO read N-major), under the barrier below. dK += dS^T Q
        // comes after dQ's product, reading dS^T from this consumer's dS tile (A transposed), so
        // dQ's epilogue runs under it (wgmma groups complete in order: behind dK, dQ's product and
        // epilogue waited for both products; with dS^T's A fragments kept in registers for it,
        // dq, dk, dv and the fragments spilled 100-284 bytes at d = 128).
        const unsigned long long do_desc = n_major_descriptor(do_base, Q_CHUNK_BYTES);
        warpgroup_arrive();
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk)
            Wgmma<T, D_TILE>::template rs<1>(dv, pa[kk], advance_descriptor(do_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
        warpgroup_commit();
        const unsigned long long own_ds_desc = n_major_descriptor(smem_addr(&smem.ds[(ring + it) & 1][consumer][0][0]), Q_CHUNK_BYTES);
        const unsigned long long q_desc = n_major_descriptor(q_base, Q_CHUNK_BYTES);
        const auto issue_dk = [&]() {
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk)
                Wgmma<T, D_TILE>::template ss<1, 1>(dk, advance_descriptor(own_ds_desc, kk * 2 * SWIZZLE_ATOM_BYTES),
                                                    advance_descriptor(q_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
            warpgroup_commit();
        };
        bool dk_issued = false;

        const bool whole_rows = !(FEATURES & FEATURE_VARLEN) || q_start + BLOCK_M <= seq.seqlen_q;
        tile.meet_after_ds(m, publisher);
        const int block_turn = (Shape::TURN_BLOCKS == 1 && (FEATURES & FEATURE_WINDOW))
                                   ? block.kv_block - kv_block_range<IS_CAUSAL, FEATURES>(seq, q_start, BLOCK_M, BLOCK_N, band).x
                                   : block.kv_block;   // (KeySplitTile::wait_turn)
        const auto add_or_defer_staged_dq = [&]() { tile.add_or_defer_staged_dq(it, m, q_start, block_turn); };
        if constexpr (Shape::DQ_TRANSPOSED) {
            float dqt[BLOCK_M / 2];
            tile.transposed_dq((ring + it) & 1, dqt, issue_dk);
            tile.add_or_defer_staged_dq(it, m, q_start, block_turn);
            dk_issued = true;
        } else {
            // An item's adds: a TMA reduce-add of the staged chunk, issued by the consumer's first
            // thread (red.global adds in a sequence's partial last block).
#pragma unroll 1
            for (int item = consumer; item < Shape::DQ_ITEMS; item += CONSUMERS) {
                float dq[SWIZZLE_ROW_ELEMENTS / 2];
                tile.dq_item_product(item, (ring + it) & 1, dq, issue_dk);
                dk_issued = true;
                if (whole_rows) {
                    tile.stage_dq_rows(dq);
                    add_or_defer_staged_dq();
                } else {
                    if (semaphores != nullptr && order.first_of_turn(m)) {   // the turn, before any of this consumer's adds
                        if (thread == 0) tile.wait_turn(m, q_start, block_turn);
                        named_barrier_sync(2 + consumer, 128);
                    }
                    const int2 chunk = Shape::dq_item_chunk(item);
#pragma unroll
                    for (int i = 0; i < SWIZZLE_ROW_ELEMENTS / 8; ++i)
#pragma unroll
                        for (int r = 0; r < 2; ++r) {
                            const int query = q_start + chunk.y + 16 * warp + lane / 4 + 8 * r;
                            const int col = chunk.x * SWIZZLE_ROW_ELEMENTS + 8 * i + query_col;   // head_dim: a multiple of 8
                            if (query < seq.seqlen_q && col < (int)p.head_dim)
                                red_add_f32x2(dq_accum + (long long)query * p.dq_accum_strides[1] + col,
                                              dq[4 * i + 2 * r], dq[4 * i + 2 * r + 1]);
                        }
                }
            }
        }
        if (!dk_issued) {   // no dQ item here
            warpgroup_arrive();
            issue_dk();
        }
        warpgroup_wait<0>();   // the dK (and dV) products
        hold_registers(dk);
        hold_registers(dv);
        // The slot's Q and dO were last read by the dK / dV products (complete: wait<0> above);
        // this block's dS buffer is rewritten two blocks on, after the next block's barrier.
        barrier_arrive(smem_addr(&smem.empty[slot.index]));
    }
    if constexpr (Shape::DEFER_DQ_ADD && ADDS_DQ) {
        if (semaphores == nullptr && order.count() > 0) tile.add_staged_dq(order.count() - 1);   // the last block's piece
    }
    // K and V were last read by this tile's products (complete: wait<0> in the loop): the producer
    // may load the next tile's under the stores below.
    barrier_arrive(smem_addr(&smem.kv_empty));
    ring += order.count();
    if (ADDS_DQ && semaphores != nullptr) {   // publish the last query block's adds
        if (thread == 0) tma_store_wait_all();
        named_barrier_sync(Shape::DQ_BARRIER, 128 * CONSUMERS);
        if (publisher && order.count() > 0) publish_dq(semaphores + order.last() / TURN_BLOCKS);
    }

    store_key_gradients<T, D_TILE, FEATURES>(dk, dv, p, at, first_key, 0, query_col);
}

// A head-dim-split consumer's view of its tile (values of backward_sm90_head_dim_split's), and
// the steps of a query block that use them.
template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES, bool IS_CAUSAL, int FEATURES>
struct HeadDimSplitTile {
    static constexpr int CONSUMERS = BACKWARD_SM90_CONSUMERS;
    static constexpr int COLUMNS = D_TILE / CONSUMERS;    // a consumer's head-dim columns in dK, dV and dQ
    static constexpr int PIECE = 32;                      // dQ columns per reduce-add (the staging buffer's)
    static constexpr int TURN_BLOCKS = dq_turn_blocks<BLOCK_M>;
    BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>& smem;
    const BackwardSm90Maps& maps;
    const FlashParams& p;
    const Sequence& seq;
    const Band& band;
    const long long b, h;
    const int kv_block, batch_coord, consumer, warp, lane, column0;
    int* const semaphores;
    const QueryOrder<TURN_BLOCKS> order;

    // The block's dQ (query block m): each warp stages its own 16 rows of dQ, a 32-column piece at
    // a time, and adds them with a TMA reduce-add (boxes of 32 columns x 16 rows,
    // backward_sm90_dq_box_rows), so the warps never wait for each other here (with a consumer's
    // whole 64 rows a box, as the key split does, and its two barriers a piece: causal 16k 289 ->
    // 329 TFLOP/s). A packed batch's
    // last, partial query block of a sequence (a box would add into the next sequence's rows)
    // adds the staged rows inside the sequence by red.global instead (adding from registers
    // there spilled 12 bytes with a window).
    __device__ __forceinline__ void add_dq(const float (&dq)[COLUMNS / 2], int m, int q_start) const {
        const bool whole_rows = !(FEATURES & FEATURE_VARLEN) || q_start + BLOCK_M <= seq.seqlen_q;
        static_assert(backward_sm90_dq_rows<D_TILE, BLOCK_M> == 16, "a box is a warp's 16 rows");
        unsigned char* warp_rows = reinterpret_cast<unsigned char*>(&smem.dq[consumer][0][16 * warp][0]);
#pragma unroll
        for (int piece = 0; piece < COLUMNS / PIECE; ++piece) {
            if (lane == 0) tma_store_wait_read();   // the warp's last reduce has read its rows
            __syncwarp();
            // Element (row, col) at row * 128 bytes, its 16-byte unit swizzled by row % 8 (TMA's
            // 128-byte swizzle), as the key split's halves.
#pragma unroll
            for (int i = 0; i < PIECE / 8; ++i)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int row = lane / 4 + 8 * r;   // of the warp's 16 (16 * warp: a multiple of 8)
                    const unsigned int unit = (unsigned int)(2 * i + (lane % 4) / 2) ^ (unsigned int)(row & 7);
                    const int reg = 4 * (piece * PIECE / 8 + i) + 2 * r;
                    *reinterpret_cast<float2*>(warp_rows + row * 128 + unit * 16 + 8 * (lane % 2)) = make_float2(dq[reg], dq[reg + 1]);
                }
            fence_async_shared();
            __syncwarp();   // the warp's rows of the piece are written
            // Deterministic: this key block's turn at m's pair of query blocks (the blocks of the
            // pair's band before it), at the pair's first block here.
            if (semaphores != nullptr && piece == 0 && lane == 0 && order.first_of_turn(m)) {
                const int pair_start = m / TURN_BLOCKS * TURN_BLOCKS * BLOCK_M;
                wait_dq_turn(semaphores + m / TURN_BLOCKS,
                             (FEATURES & FEATURE_WINDOW)
                                 ? kv_block - kv_block_range<IS_CAUSAL, FEATURES>(seq, pair_start, TURN_BLOCKS * BLOCK_M,
                                                                                   BLOCK_N, band).x
                                 : kv_block);
            }
            if (whole_rows) {
                if (lane == 0) {
                    tma_reduce_add_4d(&maps.dq_accum, smem_addr(warp_rows), column0 + PIECE * piece,
                                      seq.q_row0 + q_start + 16 * warp, (int)h, batch_coord);
                    tma_store_commit();
                }
            } else {
                __syncwarp();   // (after the turn)
                // Lane L: row L / 2 of the warp's, columns 16 (L % 2) + 0..15 of the piece.
                const int row = lane / 2, query = q_start + 16 * warp + row;
                float* dq_row = p.dq_accum + tensor_offset(p.dq_accum_strides, b, seq.q_row0, h) +
                                (long long)query * p.dq_accum_strides[1] + column0 + PIECE * piece;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int col = 16 * (lane % 2) + 2 * j;
                    const unsigned int unit = (unsigned int)(col / 4) ^ (unsigned int)(row & 7);
                    const float2 x = *reinterpret_cast<const float2*>(warp_rows + row * 128 + unit * 16 + (col % 4) * 4);
                    if (query < seq.seqlen_q && column0 + PIECE * piece + col < (int)p.head_dim)   // head_dim: a multiple of 8
                        red_add_f32x2(dq_row + col, x.x, x.y);
                }
            }
        }
    }

    // Deterministic: the warp's adds to the turn have completed (its lanes' red.global adds
    // ordered before lane 0's by the warp barrier); the last of the consumers' warps to count
    // its own publishes the turn. Measured (H100, bf16, interleaved against one thread
    // publishing between the consumers' barriers, its fence holding both): 1.01-1.07x at
    // 2k-16k; a publisher warp in the producer warpgroup polling the count measured 0.73-0.79x
    // at 4k-16k without a mask (docs/decisions.md, "deterministic publisher warp"). The key split
    // (d <= 128) still publishes from a thread after its dS barrier: not measured this way.
    // The count's eighth arrival of a turn is its last: the consumers' barriers of the next
    // block keep a turn's arrivals ahead of any of the next turn's.
    __device__ __forceinline__ void publish_turn(int m) const {
        if (semaphores != nullptr && order.last_of_turn(m)) {
            __syncwarp();
            if (lane == 0) {
                tma_store_wait_all();
                if ((shared_add_acq_rel(&smem.turn_arrivals, 1) + 1) % (4 * CONSUMERS) == 0)
                    publish_dq(semaphores + m / TURN_BLOCKS);
            }
        }
    }
};

// The head-dim split (d = 256, BLOCK_N = 64; the calls that add dQ: a window or a packed batch,
// others take the product split below): consumer c takes queries [32c, 32c + 32) of each
// query block in S^T and dP^T, writes them as its half of P^T and dS^T (keys x queries) to shared
// memory, and owns head-dim columns [128c, 128c + 128) of dK, dV (accumulated across the query
// loop) and dQ (per query block). Per block the consumers meet twice: before P^T / dS^T are
// rewritten (both consumers' products of the last block have read them) and after (both halves
// are written). dQ's product is issued first, in a group of its own, so its epilogue (four
// 32-column pieces through the consumer's staging buffer, each warp's rows a TMA reduce-add) runs
// under dV's and dK's products.
template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES, bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ void backward_sm90_head_dim_split(BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>& smem,
                                                             const BackwardSm90Maps& maps, const FlashParams& p,
                                                             const BackwardSm90Block& at, int round, int& ring) {
    constexpr int CONSUMERS = BACKWARD_SM90_CONSUMERS;
    constexpr int QUERIES = BLOCK_M / CONSUMERS;   // a consumer's queries in S^T and dP^T
    constexpr int COLUMNS = D_TILE / CONSUMERS;    // a consumer's head-dim columns in dK, dV and dQ
    constexpr int PIECE = 32;                      // dQ columns per reduce-add (the staging buffer's)
    constexpr int SCORES_BARRIER = 1;              // named barrier of the consumers around P^T / dS^T
    constexpr unsigned int K_CHUNK_BYTES = BLOCK_N * 128, Q_CHUNK_BYTES = BLOCK_M * 128;
    static_assert(BLOCK_N == 64 && BLOCK_M == 64 && D_TILE == 256, "P^T and dS^T one 64 x 64 chunk each; 128 columns a consumer");
    const KeyBlock& block = at.block;
    const long long b = block.b, h = block.h;
    const int kv_start = at.kv_start;
    const Sequence& seq = at.seq;
    const Band& band = at.band;

    const int consumer = threadIdx.x / 128 - 1;
    const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
    const int key_row = 16 * warp + lane / 4;       // this thread's keys: + 0 and + 8 (of the block's 64)
    const int query_col = 2 * (lane % 4);           // and queries 8i + this (+1) of the consumer's, or columns
    const int first_key = kv_start + key_row;
    const int query0 = QUERIES * consumer, column0 = COLUMNS * consumer;
    const unsigned int k_rows = smem_addr(&smem.k[0][0][0]), v_rows = smem_addr(&smem.v[0][0][0]);
    const unsigned int p_tile = smem_addr(&smem.ds[0][0][0][0]), ds_tile = smem_addr(&smem.ds[1][0][0][0]);
    // Deterministic mode: the turns (dq_turn_blocks; with 64-query blocks, pairs). Each warp's first
    // thread waits for the pair's turn before its first add to it and has the pair's adds complete
    // after its last block; the last of the eight warps to do so publishes them (a 64 x 64 x 256
    // block's products take ~3.9 us on an SM).
    constexpr int TURN_BLOCKS = dq_turn_blocks<BLOCK_M>;
    int* semaphores = p.dq_semaphore == nullptr ? nullptr : dq_semaphores_of<BLOCK_M>(p, block.bh);
    const QueryOrder<TURN_BLOCKS> order{at.q_range, at.descending};
    const HeadDimSplitTile<T, D_TILE, BLOCK_N, BLOCK_M, STAGES, IS_CAUSAL, FEATURES> tile{
        smem, maps, p, seq, band, b, h, block.kv_block, at.batch_coord, consumer, warp, lane, column0, semaphores, order};

    float dk[COLUMNS / 2], dv[COLUMNS / 2];
#pragma unroll
    for (int i = 0; i < COLUMNS / 2; ++i) dk[i] = dv[i] = 0.f;
    barrier_wait(smem_addr(&smem.kv_full), round & 1);   // also where no query block sees these keys: the loads must land

#pragma unroll 1
    for (int it = 0; it < order.count(); ++it) {
        const int m = order.block(it);
        const RingSlot slot = ring_slot<STAGES>(ring + it);
        const int q_start = m * BLOCK_M;
        barrier_wait(smem_addr(&smem.full[slot.index]), slot.parity);
        const unsigned int q_base = smem_addr(&smem.q[slot.index][0][0][0]);
        const unsigned int do_base = smem_addr(&smem.dout[slot.index][0][0][0]);

        // S^T = K Q^T and dP^T = V dO^T (the block's 64 keys x this consumer's queries), in two
        // groups: P is computed while dP^T's products run.
        float s[QUERIES / 2], dp[QUERIES / 2];
        warpgroup_arrive();
        mma_k_major<T, QUERIES, D_TILE>(s, k_rows, K_CHUNK_BYTES, q_base + query0 * 128, Q_CHUNK_BYTES);
        warpgroup_commit();
        mma_k_major<T, QUERIES, D_TILE>(dp, v_rows, K_CHUNK_BYTES, do_base + query0 * 128, Q_CHUNK_BYTES);
        warpgroup_commit();
        warpgroup_wait<1>();   // S^T
        hold_registers(s);

        const float* lse_tile = smem.lse_log2[slot.index] + query0;
        const float* delta_tile = smem.delta[slot.index] + query0;
        const bool needs_mask = tile_needs_mask<IS_CAUSAL, FEATURES>(q_start + query0, QUERIES, kv_start, BLOCK_N,
                                                                    seq.seqlen_k, band);
        probabilities_in_place<IS_CAUSAL, FEATURES, QUERIES>(s, lse_tile, p.scale_log2, needs_mask, first_key,
                                                             q_start + query0, query_col, seq.seqlen_k, band);
        warpgroup_wait<0>();   // dP^T
        hold_registers(dp);
        score_gradients_in_place<QUERIES>(dp, s, delta_tile, query_col);
        unsigned int pa[QUERIES / 16][4], dsa[QUERIES / 16][4];
        accumulator_to_a<T, QUERIES>(pa, s);
        accumulator_to_a<T, QUERIES>(dsa, dp);

        // Both consumers' products of the last block have read P^T and dS^T (each waited for them).
        named_barrier_sync(SCORES_BARRIER, 128 * CONSUMERS);
        // P^T and dS^T rows as they are held (keys x queries): pa[kk] is four 8 x 8 tiles, (key rows
        // + 0, + 8) x (queries 16kk, 16kk + 8); stmatrix writes tile L / 8's row L % 8 at lane L's address.
#pragma unroll
        for (int kk = 0; kk < QUERIES / 16; ++kk) {
            const int tile = lane / 8;
            const unsigned int offset = swizzled_offset(16 * warp + 8 * (tile & 1) + lane % 8, query0 + 16 * kk + 8 * (tile >> 1));
            stmatrix_x4(p_tile + offset, pa[kk]);
            stmatrix_x4(ds_tile + offset, dsa[kk]);
        }
        fence_async_shared();   // the writes, before the products read them
        named_barrier_sync(SCORES_BARRIER, 128 * CONSUMERS);   // both halves are written

        // dQ (the block's queries x this consumer's columns) = dS K: A is dS^T's tile read M-major
        // (queries contiguous); then dV += P^T dO and dK += dS^T Q, A read K-major.
        float dq[COLUMNS / 2];
        warpgroup_arrive();
        const unsigned long long ds_n_desc = n_major_descriptor(ds_tile, K_CHUNK_BYTES);
        const unsigned long long k_desc = n_major_descriptor(k_rows + (column0 / 64) * K_CHUNK_BYTES, K_CHUNK_BYTES);
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
            Wgmma<T, COLUMNS>::template ss<1, 1>(dq, advance_descriptor(ds_n_desc, kk * 2 * SWIZZLE_ATOM_BYTES),
                                                 advance_descriptor(k_desc, kk * 2 * SWIZZLE_ATOM_BYTES), kk > 0);
        warpgroup_commit();
        const unsigned long long p_desc = k_major_descriptor(p_tile), ds_k_desc = k_major_descriptor(ds_tile);
        const unsigned long long do_desc = n_major_descriptor(do_base + (column0 / 64) * Q_CHUNK_BYTES, Q_CHUNK_BYTES);
        const unsigned long long q_desc = n_major_descriptor(q_base + (column0 / 64) * Q_CHUNK_BYTES, Q_CHUNK_BYTES);
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk)
            Wgmma<T, COLUMNS>::template ss<1>(dv, advance_descriptor(p_desc, kk * 32),
                                              advance_descriptor(do_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
#pragma unroll
        for (int kk = 0; kk < BLOCK_M / 16; ++kk)
            Wgmma<T, COLUMNS>::template ss<1>(dk, advance_descriptor(ds_k_desc, kk * 32),
                                              advance_descriptor(q_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
        warpgroup_commit();
        warpgroup_wait<1>();   // dQ
        hold_registers(dq);

        tile.add_dq(dq, m, q_start);
        warpgroup_wait<0>();   // dV, dK
        hold_registers(dk);
        hold_registers(dv);
        tile.publish_turn(m);
        barrier_arrive(smem_addr(&smem.empty[slot.index]));   // the slot's Q and dO: last read by dK / dV
    }
    barrier_arrive(smem_addr(&smem.kv_empty));   // K and V: last read by this tile's products (wait<0> above)
    ring += order.count();

    store_key_gradients<T, COLUMNS, FEATURES>(dk, dv, p, at, first_key, column0, query_col);   // this consumer's columns
}

// The product split (d = 192 and 256 without dQ: ADDS_DQ false, the calls that take the dQ
// kernel). Each consumer computes one of the block's two score products for all 64 queries, so
// each is a 64 x 64 x D_TILE wgmma (the head-dim split's two 64 x 32 products a consumer read K or
// V from shared memory once per 32 queries: a third more operand bytes):
//   consumer 0: S^T = K Q^T, P^T in registers, written to shared memory as T;
//   consumer 1: dP^T = V dO^T, P^T read back from there (ldmatrix: the fragments consumer 0 held),
//               dS^T = P^T (dP^T - delta), written to shared memory as T.
// Each then owns whole 64-column chunks of dK and dV (product_split_columns): the one holding P^T
// (dS^T) in registers takes it as the A operand of dV (dK), the other reads it from shared memory.
// dS^T uses P^T rounded to T, as the operand of dV is (the dense reference's form rounds it too).
// The consumers meet through named barriers in pairs, arrive on one side and sync on the other:
// P_READY / DS_READY (written), P_FREE / DS_FREE (the other consumer's products of the last block
// have read it; none before a tile's first block: the next tile's K / V wait covers the last).
// Consumer 0's columns of dK and dV: half at d = 256; at 192 one chunk, consumer 1 two (a 96-column
// half would start inside a swizzled 64-column chunk; consumer 0 also takes the exponentials).
// One function with the role a runtime branch, as at 256 before d = 192 came: each role a template
// of its own measured 0.95x at d = 256 causal (docs/decisions.md, "product split at d = 192").
template <int D_TILE>
constexpr int product_split_columns = D_TILE == 256 ? 128 : 64;

// The first COLUMNS / 2 accumulators of a consumer's dK or dV (all of them where both own as many).
template <int COLUMNS, int N>
__device__ __forceinline__ float (&leading(float (&x)[N]))[COLUMNS / 2] {
    static_assert(COLUMNS / 2 <= N, "a consumer's columns within the accumulators");
    return reinterpret_cast<float (&)[COLUMNS / 2]>(x);
}

template <typename T, int D_TILE, int BLOCK_N, int BLOCK_M, int STAGES, bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ void backward_sm90_product_split(BackwardSm90Storage<T, D_TILE, BLOCK_N, BLOCK_M, STAGES>& smem,
                                                            const FlashParams& p, const BackwardSm90Block& at, int round,
                                                            int& ring) {
    constexpr int CONSUMERS = BACKWARD_SM90_CONSUMERS;
    constexpr int COLUMNS0 = product_split_columns<D_TILE>, COLUMNS1 = D_TILE - COLUMNS0;   // each one's dK, dV columns
    constexpr int COLUMNS = COLUMNS0 > COLUMNS1 ? COLUMNS0 : COLUMNS1;   // the accumulators': the wider one's
    constexpr int P_READY = 1, DS_READY = 2, P_FREE = 3, DS_FREE = 4, PAIR = 128 * CONSUMERS;
    constexpr unsigned int K_CHUNK_BYTES = BLOCK_N * 128, Q_CHUNK_BYTES = BLOCK_M * 128;
    static_assert(BLOCK_N == 64 && BLOCK_M == 64 && (D_TILE == 192 || D_TILE == 256) && CONSUMERS == 2
                      && COLUMNS0 % 64 == 0 && COLUMNS1 % 64 == 0,
                  "P^T and dS^T one 64 x 64 chunk each; whole 64-column chunks a consumer");
    const int kv_start = at.kv_start;
    const Sequence& seq = at.seq;
    const Band& band = at.band;

    const int consumer = threadIdx.x / 128 - 1;
    const bool scores = consumer == 0;              // S^T and P^T; else dP^T and dS^T
    const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
    const int first_key = kv_start + 16 * warp + lane / 4;   // this thread's keys: + 0 and + 8
    const int query_col = 2 * (lane % 4);           // and queries 8i + this (+1), or columns
    const int column0 = COLUMNS0 * consumer;
    const unsigned int p_tile = smem_addr(&smem.ds[0][0][0][0]), ds_tile = smem_addr(&smem.ds[1][0][0][0]);
    // Lane L's row address of the 8 x 8 tiles of 16-query step kk (stmatrix_x4 / ldmatrix_x4): tile
    // L / 8 is (key rows + 0, + 8) x (queries + 0, + 8), the accumulator_to_a fragment's order.
    unsigned int tile_offset[BLOCK_M / 16];
#pragma unroll
    for (int kk = 0; kk < BLOCK_M / 16; ++kk)
        tile_offset[kk] = swizzled_offset(16 * warp + 8 * ((lane / 8) & 1) + lane % 8, 16 * kk + 8 * (lane / 16));
    const unsigned long long p_desc = k_major_descriptor(p_tile), ds_desc = k_major_descriptor(ds_tile);
    const QueryOrder<1> order{at.q_range, at.descending};

    float dk[COLUMNS / 2], dv[COLUMNS / 2];
#pragma unroll
    for (int i = 0; i < COLUMNS / 2; ++i) dk[i] = dv[i] = 0.f;
    barrier_wait(smem_addr(&smem.kv_full), round & 1);   // also where no query block sees these keys: the loads must land

#pragma unroll 1
    for (int it = 0; it < order.count(); ++it) {
        const int m = order.block(it);
        const RingSlot slot = ring_slot<STAGES>(ring + it);
        const int q_start = m * BLOCK_M;
        const bool last = it + 1 == order.count();
        barrier_wait(smem_addr(&smem.full[slot.index]), slot.parity);
        const unsigned int q_base = smem_addr(&smem.q[slot.index][0][0][0]);
        const unsigned int do_base = smem_addr(&smem.dout[slot.index][0][0][0]);
        const unsigned long long do_desc = n_major_descriptor(do_base + (column0 / 64) * Q_CHUNK_BYTES, Q_CHUNK_BYTES);
        const unsigned long long q_desc = n_major_descriptor(q_base + (column0 / 64) * Q_CHUNK_BYTES, Q_CHUNK_BYTES);

        // S^T (consumer 0) or dP^T (consumer 1): the block's 64 keys x 64 queries.
        float s[BLOCK_M / 2];
        unsigned int a[BLOCK_M / 16][4];
        warpgroup_arrive();
        mma_k_major<T, BLOCK_M, D_TILE>(s, smem_addr(scores ? &smem.k[0][0][0] : &smem.v[0][0][0]), K_CHUNK_BYTES,
                                        scores ? q_base : do_base, Q_CHUNK_BYTES);
        warpgroup_commit();
        warpgroup_wait<0>();
        hold_registers(s);

        if (scores) {
            const bool needs_mask = tile_needs_mask<IS_CAUSAL, FEATURES>(q_start, BLOCK_M, kv_start, BLOCK_N, seq.seqlen_k, band);
            probabilities_in_place<IS_CAUSAL, FEATURES, BLOCK_M>(s, smem.lse_log2[slot.index], p.scale_log2, needs_mask,
                                                                 first_key, q_start, query_col, seq.seqlen_k, band);
            accumulator_to_a<T, BLOCK_M>(a, s);
            if (it > 0) named_barrier_sync(P_FREE, PAIR);   // consumer 1's dV of the last block has read P^T
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) stmatrix_x4(p_tile + tile_offset[kk], a[kk]);
            fence_async_shared();   // the writes, before consumer 1's products read them
            named_barrier_arrive(P_READY, PAIR);
            // dV += P^T dO (A from registers), then dK += dS^T Q once consumer 1 has written dS^T.
            warpgroup_arrive();
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk)
                Wgmma<T, COLUMNS0>::template rs<1>(leading<COLUMNS0>(dv), a[kk],
                                                   advance_descriptor(do_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
            warpgroup_commit();
            named_barrier_sync(DS_READY, PAIR);
            warpgroup_arrive();
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk)
                Wgmma<T, COLUMNS0>::template ss<1>(leading<COLUMNS0>(dk), advance_descriptor(ds_desc, kk * 32),
                                                   advance_descriptor(q_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
            warpgroup_commit();
            warpgroup_wait<0>();
            if (!last) named_barrier_arrive(DS_FREE, PAIR);
        } else {
            named_barrier_sync(P_READY, PAIR);
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) ldmatrix_x4(a[kk], p_tile + tile_offset[kk]);
            float prob[BLOCK_M / 2];
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk)
                unpack(make_uint4(a[kk][0], a[kk][1], a[kk][2], a[kk][3]), prob + 8 * kk, T{});
            score_gradients_in_place<BLOCK_M>(s, prob, smem.delta[slot.index], query_col);
            accumulator_to_a<T, BLOCK_M>(a, s);
            if (it > 0) named_barrier_sync(DS_FREE, PAIR);   // consumer 0's dK of the last block has read dS^T
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) stmatrix_x4(ds_tile + tile_offset[kk], a[kk]);
            fence_async_shared();
            named_barrier_arrive(DS_READY, PAIR);
            // dK += dS^T Q (A from registers), dV += P^T dO (P^T from shared memory).
            warpgroup_arrive();
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk)
                Wgmma<T, COLUMNS1>::template rs<1>(leading<COLUMNS1>(dk), a[kk],
                                                   advance_descriptor(q_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
#pragma unroll
            for (int kk = 0; kk < BLOCK_M / 16; ++kk)
                Wgmma<T, COLUMNS1>::template ss<1>(leading<COLUMNS1>(dv), advance_descriptor(p_desc, kk * 32),
                                                   advance_descriptor(do_desc, kk * 2 * SWIZZLE_ATOM_BYTES), 1);
            warpgroup_commit();
            warpgroup_wait<0>();
            if (!last) named_barrier_arrive(P_FREE, PAIR);
        }
        hold_registers(dk);
        hold_registers(dv);
        barrier_arrive(smem_addr(&smem.empty[slot.index]));   // the slot's Q and dO: last read by dK / dV
    }
    barrier_arrive(smem_addr(&smem.kv_empty));   // K and V: last read by this tile's products
    ring += order.count();

    if constexpr (COLUMNS0 == COLUMNS1)   // this consumer's columns
        store_key_gradients<T, COLUMNS, FEATURES>(dk, dv, p, at, first_key, column0, query_col);
    else if (scores)
        store_key_gradients<T, COLUMNS0, FEATURES>(leading<COLUMNS0>(dk), leading<COLUMNS0>(dv), p, at, first_key, 0,
                                                   query_col);
    else
        store_key_gradients<T, COLUMNS1, FEATURES>(leading<COLUMNS1>(dk), leading<COLUMNS1>(dv), p, at, first_key,
                                                   COLUMNS0, query_col);
}
