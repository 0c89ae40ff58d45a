// Hopper forward (sm_90a) for float16 / bfloat16: FlashAttention-3's design, written on the
// vocabulary of sm90_mma.cuh (wgmma, swizzled tiles) and sm90_tma.cuh (TMA, mbarrier ring).
//
// Blocks of 128 * (1 + CONSUMERS) threads, one per SM, walk the work tiles, each BLOCK_M query rows
// of one (batch, head), in the order TileScheduler (below) gives them:
//  - warpgroup 0, the producer, gives most of its registers away; one thread loads each tile's Q
//    and streams its K and V tiles (last key block first) into a ring of STAGES slots by TMA. The
//    ring runs on across tiles, so the next tile's first K and V load during this one's epilogue;
//  - warpgroups 1..CONSUMERS each own 64 query rows: S = Q K^T by wgmma from shared memory, the
//    online softmax on the accumulators, O += P V by wgmma with P straight from registers.
// Two overlaps hide the softmax behind the tensor cores:
//  - inside a warpgroup, S_{j+1} = Q K_{j+1}^T and O += P_j V_j are issued before the softmax of
//    S_{j+1}, which runs while they execute;
//  - between warpgroups, named barriers pass the right to issue around the ring of consumers
//    (ping-pong), so one warpgroup's softmax runs under the others' products.
// The epilogue normalises O, writes lse, stages O in shared memory (each warpgroup its own 64 rows)
// and stores it by TMA (rows past the sequence end are clipped by the map; packed sequences, whose
// next rows belong to the next sequence, store 16-byte vectors instead). O has a staging tile of
// its own where it fits (d <= 128): Q is then free once the tile's last S = Q K^T is done, and the
// next tile's Q loads under this one's last P V and epilogue; at d = 256 O is staged in Q's rows.
//
// Head dims past FLASH_WIDE_TILE (the 512 tile): a consumer's O over every v column would be 256
// registers a thread, so a tile covers D_V of v's columns (v blocks: the tile index's fastest part,
// so a query block's v blocks run side by side and share Q and K through L2), each computing S
// whole; the first v block writes lse.
//
// Masks and score modifiers are those of every other kernel (Band, ScoreMod in common.cuh), given
// each accumulator's (query, key) from wgmma's layout (sm90_mma.cuh). The bias (a tile per key block
// from global memory) is not supported here: the dispatch (cupy_flash/families/) sends it to
// the portable kernels.
//
// FP8 (T = fa_e4m3, docs/fp8.md): the same kernel with e4m3 q, k and v and a bfloat16 O. The
// products are m64nNk32 e4m3 wgmma's, which read both operands K-major: V is read as V^T
// (head_dim rows of keys), written once per call by fp8_transpose_v (below) in fp8_p_key's key
// order, so P goes from the accumulators to the A operand without an exchange between threads.
// The descales join the score scale (q_descale x k_descale) and O's final scale (v_descale). P
// enters its product as e4m3 of exp2(s - max + 8): P x 2^8, in e4m3's normal range down to 2^-14
// of the row's max (with the maxima kept up to MAX_LAG behind, P x 2^8 <= 2^16 would overflow, so
// FP8 rows take the max 8 below: the stored reference is max - 8, P <= 2^8 <= 448).

#include "common.cuh"
#include "tensor_core.cuh"
#include "sm90_mma.cuh"
#include "sm90_wgmma_ops.cuh"
#include "sm90_tma.cuh"

// D_TILE: Q's and K's head-dim tile; D_V: V's and O's (D_TILE unless v's head_dim has a tile of its
// own, FEATURE_HEAD_DIM_V calls on families/sm90.py's FORWARD_SM90_HEAD_DIM_V, or a tile covers a
// v block: past FLASH_WIDE_TILE).
template <typename T, int BLOCK_M, int D_TILE, int BLOCK_N, int STAGES, int D_V = D_TILE>
struct ForwardSm90Storage {
    using Out = typename Sm90Element<T>::output;
    static constexpr int ROW = operand_row_elements<T, D_TILE>;   // elements of a swizzled row of Q and K
    static constexpr int CHUNKS = D_TILE / ROW, V_CHUNKS = D_V / ROW;
    static constexpr bool OWN_O = BLOCK_M * (sizeof(T) * D_TILE + sizeof(Out) * D_V) + STAGES * BLOCK_N * sizeof(T) * (D_TILE + D_V)
                                  + 2 * SWIZZLE_ATOM_BYTES <= SM90_BLOCK_SMEM_BYTES;
    static_assert(OWN_O || D_V * sizeof(Out) <= D_TILE * sizeof(T), "O staged in Q's rows must fit them");
    alignas(SWIZZLE_ATOM_BYTES) T q[CHUNKS][BLOCK_M][ROW];   // O's staging too where !OWN_O
    alignas(SWIZZLE_ATOM_BYTES) T k[STAGES][CHUNKS][BLOCK_N][ROW];
    // FP8: the same bytes hold V^T, in VtChunk's chunks of [D_TILE][64 or 128 keys] a stage.
    alignas(SWIZZLE_ATOM_BYTES) T v[STAGES][V_CHUNKS][BLOCK_N][ROW];
    alignas(OWN_O ? SWIZZLE_ATOM_BYTES : 16) Out o[OWN_O ? D_V / SWIZZLE_ROW_ELEMENTS : 1][OWN_O ? BLOCK_M : 1][SWIZZLE_ROW_ELEMENTS];
    unsigned long long q_full, q_empty;
    unsigned long long k_full[STAGES], k_empty[STAGES];
    TileHandover tiles;   // the dynamic tile order's hand-over (TileScheduler)
    unsigned long long v_full[STAGES], v_empty[STAGES];
};

// The tensor maps of one call: q, k, v, o as 4-D tensors (head_dim, seqlen, heads, batch), boxes of
// 128 bytes x BLOCK_M (q), 128 bytes x BLOCK_N (k, v) or 64 x 64 (o: a warpgroup's rows) elements
// with 128-byte swizzle (cupy_flash/_tma.py). FP8: v is V^T (keys, head_dim, heads, batch) in boxes of
// 128 keys x D_TILE.
struct ForwardSm90Maps {
    TensorMap q, k, v, o;
};

// Dynamic shared memory a launch must give (read by the launcher from the compiled module, so the
// size is stated once): the storage and room to align it to SWIZZLE_ATOM_BYTES.
template <typename T, int BLOCK_M, int D_TILE, int BLOCK_N, int STAGES, int D_V = D_TILE>
__device__ const unsigned int forward_sm90_smem_bytes =
    sizeof(ForwardSm90Storage<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V>) + SWIZZLE_ATOM_BYTES;

// Registers a thread after setmaxnreg. A block is launched with the launch bounds' share of the
// 64K-register file (rounded down to 8: 168 a thread for 3 warpgroups), and setmaxnreg only moves
// registers within that allocation: the consumers' increase waits until the producer's decrease
// has freed enough, so the split must fit the launch's registers or the block hangs (seen on the
// H100: a producer at 32 with two consumers at 240, 32 + 480 > 3 x 168). The producer's tile
// counter (DYNAMIC) spilled 8-64 bytes at 24 registers: it gets 40, the consumers 232 (clean at
// d <= 128; d = 256 spilled at 232 and keeps the static order).
template <int CONSUMERS, bool DYNAMIC> struct Sm90Registers;
template <> struct Sm90Registers<2, false> { static constexpr int producer = 24, consumer = 240; };
template <> struct Sm90Registers<2, true> { static constexpr int producer = 40, consumer = 232; };
template <bool DYNAMIC> struct Sm90Registers<3, DYNAMIC> { static constexpr int producer = 32, consumer = 160; };
template <int CONSUMERS, bool DYNAMIC>
__host__ __device__ constexpr bool registers_fit_launch() {
    return Sm90Registers<CONSUMERS, DYNAMIC>::producer + CONSUMERS * Sm90Registers<CONSUMERS, DYNAMIC>::consumer
           <= (1 + CONSUMERS) * (65536 / (128 * (1 + CONSUMERS)) / 8 * 8);
}

// Named barriers: 1..CONSUMERS pass the right to issue products around the consumers; then one per
// consumer for its epilogue.
__device__ __forceinline__ int issue_barrier(int consumer) { return 1 + consumer; }
template <int CONSUMERS>
__device__ __forceinline__ int epilogue_barrier(int consumer) { return 1 + CONSUMERS + consumer; }

// Where one work tile, BLOCK_M query rows of one (batch, head), reads and writes: coordinates in
// the tensor maps and the key blocks it visits.
struct ForwardSm90Work {
    QueryBlock block;
    Sequence seq;
    Band band;
    int q_start;       // first query row of the block in its sequence
    int kv_first;      // key blocks [kv_first, kv_end), visited last first
    int kv_end;
    int batch_coord;   // the maps' batch coordinate (0 for packed batches: rows carry the offset)
    int kv_head;
    int v_col;         // the first of v's (and O's) columns the tile covers: its v block x D_V
    bool valid;        // false for the blocks past a packed sequence's end (the tiles cover the longest)
    __device__ __forceinline__ int blocks() const { return kv_end - kv_first; }
};

// Tiles in (batch, head)-major order, the query blocks of one head consecutive and the last first
// (under a causal mask they see the most keys; there the last heads' are dealt longest first
// across them: longest_first_tile): blocks resident together share their K/V, read from DRAM once
// and then from L2. With (batch, head) fastest (the mma.sync kernels' order) the
// 132 resident blocks of a 1k-token, 256-head call streamed 132 heads' K/V (67 MB, past L2):
// 209 against 328 TFLOP/s (d=128, bf16, H100).
// Block b starts with tile b. Where tiles cost the same the grid is persistent (one block per SM;
// the next tile's first K and V load during this one's epilogue) and block b then takes b + grid,
// b + 2 grid, ...; with a causal mask, a window or packed sequences (DYNAMIC) the grid is
// persistent too and the producer takes the next tile from a counter in global memory as it
// finishes loading one, handing it to the consumers through shared memory, so blocks that drew
// short tiles take more.
// Striding there gave tiles b, b + 132, ... of a causal 16k call 3x unequal work (d=128: 386
// against 570 TFLOP/s), and a block per tile paid each block's start (barriers, the first Q, K
// and V) once per tile: 0.80-0.89 of cuDNN at 2k causal. (The counter's atomic in the producer
// spilled at 24 registers; it has 40, and 32 beside three consumers: Sm90Registers.)
// Whether blocks take their tiles from the counter: where masks or packed sequences make tiles'
// work unequal, but not at d = 256, whose consumers then spilled 76-232 bytes (the loop's counter
// and round held across the tile): those calls get a block per tile, handed out by the hardware.
template <int D_TILE, bool IS_CAUSAL, int FEATURES>
struct DynamicTiles {
    static constexpr bool value = (IS_CAUSAL || (FEATURES & (FEATURE_WINDOW | FEATURE_VARLEN))) && D_TILE <= 128;
};
// The grid the launcher gives, read from the module: 2, one block per SM with a counter
// (TileCounter, zero at launch: DynamicTiles); 1, one block per SM striding over tiles of equal
// work (no mask, window or packed batch); 0, a block per tile.
template <int D_TILE, bool IS_CAUSAL, int FEATURES>
__device__ const unsigned int forward_sm90_tile_order =
    DynamicTiles<D_TILE, IS_CAUSAL, FEATURES>::value ? 2 : (!IS_CAUSAL && !(FEATURES & (FEATURE_WINDOW | FEATURE_VARLEN))) ? 1 : 0;

// The forward's tiles: query blocks of (batch, head)s, in PersistentTiles' order (sm90_tma.cuh;
// the consumers receive a tile per warp). V_BLOCK > 0: each query block's tiles are its v blocks
// of V_BLOCK columns (the header), fastest.
template <int BLOCK_M, int BLOCK_N, bool IS_CAUSAL, int FEATURES, bool DYNAMIC, int V_BLOCK = 0>
struct TileScheduler : PersistentTiles<DYNAMIC, false> {
    int num_q_blocks;
    int v_blocks;    // 1 without v blocks
    int num_tiles;   // < 2^31: the launcher's grid limit
    __device__ __forceinline__ explicit TileScheduler(const FlashParams& p)
        : num_q_blocks((int)((p.seqlen_q + BLOCK_M - 1) / BLOCK_M)),
          v_blocks(V_BLOCK > 0 ? (head_dim_v_of<FEATURES>(p) + V_BLOCK - 1) / V_BLOCK : 1),
          num_tiles(num_q_blocks * (int)(p.batch * p.heads) * (V_BLOCK > 0 ? v_blocks : 1)) {}

    __device__ __forceinline__ ForwardSm90Work work(const FlashParams& p, int tile) const {
        ForwardSm90Work w;
        w.v_col = 0;
        if constexpr (V_BLOCK > 0) {
            w.v_col = tile % v_blocks * V_BLOCK;
            tile /= v_blocks;
        }
        // 32-bit divisions: tile < 2^31, so (batch, head) and heads fit (the 64-bit one's routine cost
        // the producer's 32 registers beside three consumers a 4-byte spill).
        // Under a plain causal mask the last heads' query blocks are dealt longest first across
        // them (longest_first_tile; a query block sees more keys the later it starts).
        const unsigned int heads = (unsigned int)p.heads;
        const HeadTile t = longest_first_tile((unsigned int)tile, (unsigned int)num_q_blocks, (unsigned int)(p.batch * p.heads),
                                              triangular_tiles<IS_CAUSAL, FEATURES>);
        w.block = {num_q_blocks - 1 - (int)t.rank, (long long)(t.bh / heads), (long long)(t.bh % heads)};
        w.seq = sequence_of<FEATURES>(p, w.block.b);
        w.q_start = w.block.q_block * BLOCK_M;
        w.valid = !(FEATURES & FEATURE_VARLEN) || w.q_start < w.seq.seqlen_q;
        w.band = band_of(p, w.seq);
        const int2 kv_range = kv_block_range<IS_CAUSAL, FEATURES>(w.seq, w.q_start, BLOCK_M, BLOCK_N, w.band);
        w.kv_first = kv_range.x;
        w.kv_end = w.valid ? kv_range.y : kv_range.x;
        w.batch_coord = (FEATURES & FEATURE_VARLEN) ? 0 : (int)w.block.b;
        w.kv_head = (int)kv_head_of(w.block.h, p);
        return w;
    }
};

// The producer thread: for each tile with keys to see, its first K and V, then its Q once the
// previous tile's epilogue has freed the Q tile, then the rest of its K and V. `ring` counts the
// K/V blocks loaded so far (the ring's position), `q_round` the Q tiles. The producer runs in 24
// registers (setmaxnreg): the loop keeps only the key row, the ring position and the count live.
// Claim a ring slot: wait until the consumers freed it (the parity opposite to theirs) and announce
// the bytes its loads bring; returns the barrier they complete.
__device__ __forceinline__ unsigned int claim_slot(unsigned long long* empty, unsigned long long* full, unsigned int parity,
                                                   unsigned int bytes) {
    barrier_wait(smem_addr(empty), parity ^ 1);
    const unsigned int full_bar = smem_addr(full);
    barrier_arrive_expect(full_bar, bytes);
    return full_bar;
}
// One ring slot's K or V tile, in its 128-byte-row chunks.
// (col: the first column, of a v block.)
template <int D_TILE, int ROWS, typename T>
__device__ __forceinline__ void load_into_slot(T* tile, const TensorMap* map, unsigned long long* empty, unsigned long long* full,
                                               unsigned int parity, int row, int head, int batch_coord, int col = 0) {
    constexpr int ROW = operand_row_elements<T, D_TILE>;
    const unsigned int full_bar = claim_slot(empty, full, parity, ROWS * D_TILE * sizeof(T));
#pragma unroll
    for (int c = 0; c < D_TILE / ROW; ++c)
        tma_load_4d(smem_addr(tile + c * ROWS * ROW), map, full_bar, col + c * ROW, row, head, batch_coord);
}
// FP8's V^T in shared memory: chunks of [D_TILE][KEYS keys], 128 keys (128-byte swizzle) where the
// key block is whole 128-key rows, else 64 (64-byte swizzle; the map's: cupy_flash/forward_fp8.py).
template <int BLOCK_N> struct VtChunk {
    static constexpr int KEYS = BLOCK_N % 128 == 0 ? 128 : 64;
};
// FP8: one slot's V^T, BLOCK_N keys from `row`, in VtChunk's chunks.
template <int D_TILE, int BLOCK_N, typename T>
__device__ __forceinline__ void load_transposed_into_slot(T* tile, const TensorMap* map, unsigned long long* empty,
                                                          unsigned long long* full, unsigned int parity, int row, int head,
                                                          int batch_coord) {
    constexpr int KEYS = VtChunk<BLOCK_N>::KEYS;
    const unsigned int full_bar = claim_slot(empty, full, parity, BLOCK_N * D_TILE * sizeof(T));
#pragma unroll
    for (int c = 0; c < BLOCK_N / KEYS; ++c)
        tma_load_4d(smem_addr(tile + c * D_TILE * KEYS), map, full_bar, row + KEYS * c, 0, head, batch_coord);
}

template <typename T, int BLOCK_M, int D_TILE, int BLOCK_N, int STAGES, int D_V>
__device__ __forceinline__ void produce_key_block(ForwardSm90Storage<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V>& smem,
                                                  const ForwardSm90Maps& maps, int key_row, int kv_head, int batch_coord,
                                                  int ring, int vt_offset, int v_col) {
    const RingSlot slot = ring_slot<STAGES>(ring);
    load_into_slot<D_TILE, BLOCK_N>(&smem.k[slot.index][0][0][0], &maps.k, &smem.k_empty[slot.index], &smem.k_full[slot.index],
                                    slot.parity, key_row, kv_head, batch_coord);
    if constexpr (sizeof(T) == 1)
        load_transposed_into_slot<D_TILE, BLOCK_N>(&smem.v[slot.index][0][0][0], &maps.v, &smem.v_empty[slot.index],
                                                   &smem.v_full[slot.index], slot.parity, key_row + vt_offset, kv_head, batch_coord);
    else
        load_into_slot<D_V, BLOCK_N>(&smem.v[slot.index][0][0][0], &maps.v, &smem.v_empty[slot.index], &smem.v_full[slot.index],
                                        slot.parity, key_row, kv_head, batch_coord, v_col);
}

template <int FEATURES, typename T, int BLOCK_M, int D_TILE, int BLOCK_N, int STAGES, int D_V>
__device__ __forceinline__ void produce_tile(ForwardSm90Storage<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V>& smem,
                                             const ForwardSm90Maps& maps, const FlashParams& p, const ForwardSm90Work& w, int& ring,
                                             int& q_round) {
    constexpr int ROW = operand_row_elements<T, D_TILE>, CHUNKS = D_TILE / ROW;
    constexpr unsigned int Q_BYTES = BLOCK_M * D_TILE * sizeof(T);
    if (w.blocks() <= 0) return;
    // FP8 packed batches: V^T holds each sequence from a row of its own (vt_rows, a multiple of 32).
    const int vt_offset = sizeof(T) == 1 && (FEATURES & FEATURE_VARLEN) ? p.vt_rows[w.block.b] - w.seq.k_row0 : 0;
    int key_row = w.seq.k_row0 + (w.kv_end - 1) * BLOCK_N;
    produce_key_block(smem, maps, key_row, w.kv_head, w.batch_coord, ring++, vt_offset, w.v_col);
    barrier_wait(smem_addr(&smem.q_empty), (q_round & 1) ^ 1);
    const unsigned int q_full = smem_addr(&smem.q_full);
    barrier_arrive_expect(q_full, Q_BYTES);
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
        tma_load_4d(smem_addr(&smem.q[c][0][0]), &maps.q, q_full, c * ROW, w.seq.q_row0 + w.q_start,
                    (int)w.block.h, w.batch_coord);
    ++q_round;
#pragma unroll 1
    for (int left = w.blocks() - 1; left > 0; --left) {
        key_row -= BLOCK_N;
        produce_key_block(smem, maps, key_row, w.kv_head, w.batch_coord, ring++, vt_offset, w.v_col);
    }
}

// One consumer warpgroup's running state for its 64 rows: each thread holds two rows (g and g + 8
// of its warp's 16) of O (D_TILE / 2 accumulators) and of the softmax statistics. P_LOG2: the
// exponents' reference sits this far below the row max (8 for FP8's P x 2^8, else 0).
template <int P_LOG2 = 0>
struct RowSoftmax {
    float row_max[2], row_max_scaled[2], row_sum[2];

    __device__ __forceinline__ RowSoftmax() {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            row_max[r] = FLASH_NEG_INF;
            row_max_scaled[r] = 0.f;
            row_sum[r] = 0.f;
        }
    }

    // s (scores of one key block, score units; masked entries -inf) becomes exp2(s - max) in place;
    // returns the factors by which each row's O must shrink before this block's P V is added, and
    // sets `moved` unless the warp kept its maxima (factors 1: O need not be touched). The maxima
    // stay while no row of the warp sees a score more than MAX_LAG (log2 units) above its
    // reference: P may then exceed 1 (up to 2^MAX_LAG, in range for float16 and bfloat16) and O
    // and lse stay exact (any reference gives the same lse = ref + log(sum exp(s - ref))), while
    // the warp skips O's rescale (D_TILE / 2 multiplies) and two ex2 a block once its maxima settle.
    static constexpr float MAX_LAG = 8.f;
    template <int N>
    __device__ __forceinline__ float2 step(float (&s)[N], float score_log2, bool& moved) {
        float block_max[2];
        bool near = true;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            block_max[r] = FLASH_NEG_INF;
#pragma unroll
            for (int i = 0; i < N / 4; ++i) block_max[r] = fmaxf(block_max[r], fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
            block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 1));
            block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 2));
            // A row with no maximum yet (-inf: lse needs a finite one) keeps it only while it sees no key.
            near = near && (row_max[r] == FLASH_NEG_INF ? block_max[r] == FLASH_NEG_INF
                                                        : fmaf(block_max[r], score_log2, -row_max_scaled[r]) <= MAX_LAG);
        }
        moved = !__all_sync(0xffffffffu, near);
        float rescale[2] = {1.f, 1.f};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (moved) {
                rescale[r] = raise_row_max(row_max[r], row_max_scaled[r], block_max[r], score_log2);
                if constexpr (P_LOG2 != 0) {   // the old reference was P_LOG2 below its max too
                    row_max_scaled[r] -= (float)P_LOG2;
                    rescale[r] *= (float)(1 << P_LOG2);
                }
            }
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < N / 4; ++i)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    s[4 * i + e] = exp2f(fmaf(s[4 * i + e], score_log2, -row_max_scaled[r]));
                    sum += s[4 * i + e];
                }
            row_sum[r] = row_sum[r] * rescale[r] + sum;
        }
        return make_float2(rescale[0], rescale[1]);
    }
};

// The descales of an FP8 tile (1 otherwise): q_descale x k_descale, which joins the score scale,
// and v_descale, which joins O's final scale.
struct Descales {
    float qk, v;
};
template <typename T>
__device__ __forceinline__ Descales descales_of(const FlashParams& p, const ForwardSm90Work& w) {
    if constexpr (sizeof(T) == 1) {
        const long long kv = w.block.b * (p.heads / p.group) + w.kv_head;
        return {p.q_descale[w.block.b * p.heads + w.block.h] * p.k_descale[kv], p.v_descale[kv]};
    } else {
        return {1.f, 1.f};
    }
}

// The epilogue of one consumer warpgroup's 64 rows of a tile: lse, then O normalised, staged in
// the warpgroup's 64 rows of the staging tile and stored. A tile that sees no key (blocks == 0: its
// Q never loaded) stores zeros without staging: where O is staged in the Q tile, that may already
// hold the next tile's rows.
template <typename T, int BLOCK_M, int D_TILE, int BLOCK_N, int STAGES, int D_V, int FEATURES, int P_LOG2>
__device__ __forceinline__ void store_output(ForwardSm90Storage<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V>& smem,
                                             const ForwardSm90Maps& maps, const FlashParams& p, const ForwardSm90Work& w,
                                             int consumer, int thread, int lane, int row_in_block, int col_in_chunk,
                                             int first_query, const float (&o)[D_V / 2], const RowSoftmax<P_LOG2>& softmax,
                                             int blocks, int& q_round) {
    using Out = typename Sm90Element<T>::output;
    constexpr int CONSUMERS = BLOCK_M / 64;
    constexpr bool OWN_O = ForwardSm90Storage<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V>::OWN_O;
    constexpr bool TMA_STORE = !(FEATURES & FEATURE_VARLEN);
    constexpr unsigned int Q_CHUNK_BYTES = BLOCK_M * 128;
    float inv[2];
    float* lse = p.lse + w.block.b * p.lse_batch_stride + w.block.h * p.lse_head_stride + w.seq.q_row0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = softmax.row_sum[r];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        float2 lse_inv;
        if constexpr (sizeof(T) == 1) {   // the descales read again: not held in registers through the tile
            const Descales descale = descales_of<T>(p, w);
            lse_inv = finish_row<FEATURES>(p, w.block.h, softmax.row_max[r], softmax.row_max_scaled[r], total,
                                           score_to_log2<FEATURES>(p) * descale.qk, score_to_natural<FEATURES>(p) * descale.qk);
            lse_inv.y *= descale.v;
        } else {
            lse_inv = finish_row<FEATURES>(p, w.block.h, softmax.row_max[r], softmax.row_max_scaled[r], total);
        }
        inv[r] = lse_inv.y;
        const int query = first_query + 8 * r;
        if (lane % 4 == 0 && query < w.seq.seqlen_q && w.v_col == 0) lse[query] = lse_inv.x;   // the first v block's
    }
    unsigned char* staging = OWN_O ? reinterpret_cast<unsigned char*>(&smem.o[0][0][0]) : reinterpret_cast<unsigned char*>(&smem.q[0][0][0]);
    if (blocks > 0) {
        // The staging rows are free: with OWN_O the previous tile's store has read them once its
        // issuing thread's wait below is passed (the store is waited for here, a tile later, not
        // right after it is issued, where warp 0 then held up the warpgroup's next issue turn);
        // else they are this tile's Q rows, whose products are complete.
        if (OWN_O) {
            if (TMA_STORE && thread == 0) tma_store_wait_read();
            named_barrier_sync(epilogue_barrier<CONSUMERS>(consumer), 128);
        }
#pragma unroll
        for (int i = 0; i < D_V / 8; ++i) {
            const int col = 8 * i + col_in_chunk, chunk = col / SWIZZLE_ROW_ELEMENTS;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row_in_block + 8 * r;
                *reinterpret_cast<unsigned int*>(staging + chunk * Q_CHUNK_BYTES + swizzled_offset(row, col % SWIZZLE_ROW_ELEMENTS)) =
                    Mma<Out>::pack(o[4 * i + 2 * r] * inv[r], o[4 * i + 2 * r + 1] * inv[r]);
            }
        }
        if (TMA_STORE) fence_async_shared();   // the staging writes, before the TMA store reads them
        named_barrier_sync(epilogue_barrier<CONSUMERS>(consumer), 128);
        if (TMA_STORE) {
            if (thread == 0) {
#pragma unroll
                for (int c = 0; c < D_V / SWIZZLE_ROW_ELEMENTS; ++c)
                    tma_store_4d(&maps.o, smem_addr(staging + c * Q_CHUNK_BYTES + 64 * consumer * 128), w.v_col + c * SWIZZLE_ROW_ELEMENTS,
                                 w.seq.q_row0 + w.q_start + 64 * consumer, (int)w.block.h, w.batch_coord);
                tma_store_commit();
                if (!OWN_O) {
                    tma_store_wait_read();
                    barrier_arrive(smem_addr(&smem.q_empty), 4);   // for the warpgroup's 4 warps
                }
            }
            ++q_round;
            return;
        }
    }
    constexpr int UNITS = D_V / 8;   // 16-byte units per row
    const int head_dim = head_dim_v_of<FEATURES>(p) - w.v_col;   // o's, from the tile's first column
    Out* out = static_cast<Out*>(p.o) + tensor_offset(p.o_strides, w.block.b, w.seq.q_row0 + w.q_start, w.block.h) + w.v_col;
#pragma unroll 4
    for (int idx = thread; idx < 64 * UNITS; idx += 128) {
        const int row = 64 * consumer + idx / UNITS, col = (idx % UNITS) * 8;
        if (w.q_start + row < w.seq.seqlen_q && col < head_dim)
            *reinterpret_cast<uint4*>(out + row * p.o_strides[1] + col) = blocks > 0 ? *reinterpret_cast<const uint4*>(
                staging + (col / SWIZZLE_ROW_ELEMENTS) * Q_CHUNK_BYTES + swizzled_offset(row, col % SWIZZLE_ROW_ELEMENTS))
                : make_uint4(0, 0, 0, 0);
    }
    if (blocks > 0) {
        if (!OWN_O) {
            // The staging reads (generic proxy) come before the next Q's TMA writes (async proxy).
            fence_async_shared();
            __syncwarp();
            if (lane == 0) barrier_arrive(smem_addr(&smem.q_empty));
        }
        ++q_round;
    }
}

// One consumer warpgroup's part of a tile: its 64 rows' main loop and epilogue. `ring` and
// `q_round` advance as the producer's do.
template <typename T, int BLOCK_M, int D_TILE, int BLOCK_N, int STAGES, int D_V, bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ void consume_tile(ForwardSm90Storage<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V>& smem,
                                             const ForwardSm90Maps& maps, const FlashParams& p, const ForwardSm90Work& w,
                                             int consumer, int& ring, int& q_round) {
    constexpr int CONSUMERS = BLOCK_M / 64;
    constexpr bool OWN_O = ForwardSm90Storage<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V>::OWN_O;
    constexpr bool FP8 = sizeof(T) == 1;
    constexpr int MMA_K = Sm90Element<T>::mma_k;
    constexpr int ROW_BYTES = operand_row_elements<T, D_TILE> * sizeof(T);   // Q's and K's rows: 128 or 64 bytes
    constexpr unsigned int Q_CHUNK_BYTES = BLOCK_M * ROW_BYTES, KV_CHUNK_BYTES = BLOCK_N * ROW_BYTES;
    constexpr int VT_KEYS = VtChunk<BLOCK_N>::KEYS;   // FP8: V^T's chunks, VT_KEYS bytes a row
    constexpr unsigned int VT_CHUNK_BYTES = D_TILE * VT_KEYS;
    const int thread = threadIdx.x % 128, warp = thread / 32, lane = thread % 32;
    const int row_in_block = 64 * consumer + 16 * warp + lane / 4;   // this thread's rows: +0 and +8
    const int col_in_chunk = 2 * (lane % 4);                         // and columns 8i + this (+1)
    const int first_query = w.q_start + row_in_block;
    const int seqlen_k = w.seq.seqlen_k;
    const ScoreMod<FEATURES> mod(p, w.block.b, w.block.h, w.seq);
    const float score_log2 = FP8 ? score_to_log2<FEATURES>(p) * descales_of<T>(p, w).qk : score_to_log2<FEATURES>(p);

    float o[D_V / 2];
#pragma unroll
    for (int i = 0; i < D_V / 2; ++i) o[i] = 0.f;
    RowSoftmax<FP8 ? 8 : 0> softmax;
    bool rescale_o = true;   // the last softmax step moved a maximum: O is rescaled before its P V
    const int blocks = w.blocks();

    if (blocks > 0) {
        const unsigned int q_base = smem_addr(&smem.q[0][64 * consumer][0]);
        // S of key block (kv_end - 1 - i) in slot `slot`: issued, not waited for.
        auto issue_scores = [&](float (&s)[BLOCK_N / 2], const RingSlot& slot) {
            barrier_wait(smem_addr(&smem.k_full[slot.index]), slot.parity);
            unsigned int q_at = q_base, k_base = smem_addr(&smem.k[slot.index][0][0][0]);
            // Past the wide tile the product's 64 Q and K descriptors, loop-invariant, were held
            // across the key loop (spilling 356-508 bytes): opaque bases make them at each use.
            if constexpr (D_TILE > FLASH_WIDE_TILE) asm volatile("" : "+r"(q_at), "+r"(k_base));
            warpgroup_arrive();
            mma_k_major<T, BLOCK_N, D_TILE, false, ROW_BYTES>(s, q_at, Q_CHUNK_BYTES, k_base, KV_CHUNK_BYTES);
            warpgroup_commit();
        };
        auto issue_values = [&](unsigned int (&pa)[BLOCK_N / MMA_K][4], const RingSlot& slot) {
            barrier_wait(smem_addr(&smem.v_full[slot.index]), slot.parity);
            const unsigned int v_base = smem_addr(&smem.v[slot.index][0][0][0]);
            warpgroup_arrive();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / MMA_K; ++kk) {
                if constexpr (FP8 && VT_KEYS == 128)   // V^T, K-major: 32-key steps along its rows
                    Wgmma<T, D_V>::template rs<0>(o, pa[kk], k_major_descriptor(v_base + (kk / 4) * VT_CHUNK_BYTES + (kk % 4) * 32), 1);
                else if constexpr (FP8)
                    Wgmma<T, D_V>::template rs<0>(o, pa[kk], k_major_descriptor_64b(v_base + (kk / 2) * VT_CHUNK_BYTES + (kk % 2) * 32), 1);
                else
                    Wgmma<T, D_V>::template rs<1>(o, pa[kk], n_major_descriptor(v_base + kk * 2 * SWIZZLE_ATOM_BYTES, KV_CHUNK_BYTES), 1);
            }
            warpgroup_commit();
        };
        auto release = [&](unsigned long long* bar) {
            if (lane == 0) barrier_arrive(smem_addr(bar));
        };
        // Scores to logits (score modifiers), masks where the block crosses an edge, online softmax.
        auto softmax_step = [&](float (&s)[BLOCK_N / 2], int i) -> float2 {
            const int kv_start = (w.kv_end - 1 - i) * BLOCK_N;
            const int key0 = kv_start + col_in_chunk;
            if (ScoreMod<FEATURES>::active) {
#pragma unroll
                for (int j = 0; j < BLOCK_N / 2; ++j)
                    s[j] = mod.log2_logit(s[j], first_query + accumulator_row(j), key0 + accumulator_col(j));
            }
            if (tile_needs_mask<IS_CAUSAL, FEATURES>(w.q_start + 64 * consumer, 64, kv_start, BLOCK_N, seqlen_k, w.band)) {
                const TileMask mask(first_query, key0, seqlen_k, w.band);
#pragma unroll
                for (int j = 0; j < BLOCK_N / 2; ++j)
                    if (!mask.visible<IS_CAUSAL, FEATURES>(accumulator_row(j), accumulator_col(j))) s[j] = FLASH_NEG_INF;
            }
            return softmax.template step<BLOCK_N / 2>(s, score_log2, rescale_o);
        };

        barrier_wait(smem_addr(&smem.q_full), q_round & 1);
        float s[BLOCK_N / 2];
        unsigned int pa[BLOCK_N / MMA_K][4];
        named_barrier_sync(issue_barrier(consumer), 256);
        RingSlot slot = ring_slot<STAGES>(ring);
        issue_scores(s, slot);
        named_barrier_arrive(issue_barrier((consumer + 1) % CONSUMERS), 256);
        warpgroup_wait<0>();
        hold_registers(s);
        release(&smem.k_empty[slot.index]);
        if (OWN_O && blocks == 1) release(&smem.q_empty);   // the tile's last read of Q is done
        float2 rescale = softmax_step(s, 0);
        accumulator_to_a<T, BLOCK_N>(pa, s);

        for (int i = 1; i < blocks; ++i) {
            const RingSlot previous = slot;
            slot = ring_slot<STAGES>(ring + i);
            named_barrier_sync(issue_barrier(consumer), 256);
            issue_scores(s, slot);
            if (rescale_o) rescale_rows(o, rescale);
            issue_values(pa, previous);
            named_barrier_arrive(issue_barrier((consumer + 1) % CONSUMERS), 256);
            warpgroup_wait<1>();   // S of block i
            hold_registers(s);
            release(&smem.k_empty[slot.index]);
            if (OWN_O && i == blocks - 1) release(&smem.q_empty);
            rescale = softmax_step(s, i);
            warpgroup_wait<0>();   // O += P V of block i - 1: its P registers may now be rewritten
            hold_registers(o);
            hold_registers(s);
            release(&smem.v_empty[previous.index]);
            accumulator_to_a<T, BLOCK_N>(pa, s);
        }
        if (rescale_o) rescale_rows(o, rescale);
        issue_values(pa, slot);
        warpgroup_wait<0>();
        hold_registers(o);
        release(&smem.v_empty[slot.index]);
        ring += blocks;
    }

    store_output<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V, FEATURES>(smem, maps, p, w, consumer, thread, lane, row_in_block,
                                                                col_in_chunk, first_query, o, softmax, blocks, q_round);
}

template <typename T, int BLOCK_M, int D_TILE, int BLOCK_N, int STAGES, bool IS_CAUSAL, int FEATURES, int D_V = D_TILE>
__global__ void __launch_bounds__(128 * (1 + BLOCK_M / 64), 1)
flash_forward_sm90_kernel(const __grid_constant__ ForwardSm90Maps maps, const FlashParams p, TileCounter* tile_counter) {
    using Storage = ForwardSm90Storage<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V>;
    constexpr int CONSUMERS = BLOCK_M / 64;
    constexpr bool DYNAMIC = DynamicTiles<D_TILE, IS_CAUSAL, FEATURES>::value;   // tiles from the counter
    static_assert(BLOCK_M % 64 == 0 && (CONSUMERS == 2 || CONSUMERS == 3), "64 query rows per consumer warpgroup");
    static_assert(D_TILE % operand_row_elements<T, D_TILE> == 0 && operand_row_elements<T, D_TILE> * sizeof(T) >= 64
                  && BLOCK_N % 16 == 0 && BLOCK_N <= 256, "tile shape");
    static_assert(!(FEATURES & FEATURE_BIAS), "the bias runs on the portable kernels");
    constexpr bool V_BLOCKS = D_TILE > FLASH_WIDE_TILE;   // a tile covers D_V of v's columns (the header)
    static_assert(D_V == D_TILE || (sizeof(T) == 2 && ((FEATURES & FEATURE_HEAD_DIM_V) || V_BLOCKS) && D_V % 64 == 0),
                  "V's own tile: 16-bit calls whose v has a head_dim of its own or v blocks, whole 128-byte chunks");
    static_assert(sizeof(T) == 2 || (BLOCK_N % 64 == 0 && Storage::OWN_O && !ScoreMod<FEATURES>::active),
                  "FP8: V^T in 64- or 128-key chunks, O staged apart, no score modifier");
    static_assert(registers_fit_launch<CONSUMERS, DYNAMIC>(), "setmaxnreg split beyond the launch's registers: the block would hang");
    static_assert(sizeof(Storage) + SWIZZLE_ATOM_BYTES <= SM90_BLOCK_SMEM_BYTES, "shared memory of one sm_90 block");
    require_dynamic_smem(forward_sm90_smem_bytes<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V>);
    extern __shared__ unsigned char smem_raw[];
    Storage& smem = aligned_shared_storage<Storage>(smem_raw);

    if (threadIdx.x == 0) {
        prefetch_tensor_map(&maps.q);
        prefetch_tensor_map(&maps.k);
        prefetch_tensor_map(&maps.v);
        if (!(FEATURES & FEATURE_VARLEN)) prefetch_tensor_map(&maps.o);
        barrier_init(smem_addr(&smem.q_full), 1);
        barrier_init(smem_addr(&smem.q_empty), 4 * CONSUMERS);   // one arrival per consumer warp
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(smem_addr(&smem.k_full[s]), 1);
            barrier_init(smem_addr(&smem.v_full[s]), 1);
            barrier_init(smem_addr(&smem.k_empty[s]), 4 * CONSUMERS);
            barrier_init(smem_addr(&smem.v_empty[s]), 4 * CONSUMERS);
        }
        smem.tiles.init(4 * CONSUMERS);   // receive: one arrival a consumer warp
        barrier_init_fence();
    }
    __syncthreads();

    const TileScheduler<BLOCK_M, BLOCK_N, IS_CAUSAL, FEATURES, DYNAMIC, V_BLOCKS ? D_V : 0> scheduler(p);
    int ring = 0, q_round = 0;
    const int warpgroup = threadIdx.x / 128;
    if (warpgroup == 0) {
        release_registers<Sm90Registers<CONSUMERS, DYNAMIC>::producer>();
        if (threadIdx.x == 0) {
#pragma unroll 1
            for (int tile = blockIdx.x, round = 0; tile < scheduler.num_tiles; ++round) {
                produce_tile<FEATURES>(smem, maps, p, scheduler.work(p, tile), ring, q_round);
                tile = scheduler.producer_next(tile, tile_counter, smem.tiles, round);
            }
            scheduler.release_counter(tile_counter);
        }
    } else {
        acquire_registers<Sm90Registers<CONSUMERS, DYNAMIC>::consumer>();
        const int consumer = warpgroup - 1;
        // Issue turns pass around the consumers (issue_barrier): the last one's turn comes before
        // the first's, so it starts the ring with one arrival; consumer 0 takes the ring's last
        // arrival at the end, so every named barrier ends balanced whatever the work.
        if (consumer == CONSUMERS - 1) named_barrier_arrive(issue_barrier(0), 256);
#pragma unroll 1
        for (int tile = blockIdx.x, round = 0; tile < scheduler.num_tiles; ++round) {
            const ForwardSm90Work w = scheduler.work(p, tile);
            if (w.valid)
                consume_tile<T, BLOCK_M, D_TILE, BLOCK_N, STAGES, D_V, IS_CAUSAL, FEATURES>(smem, maps, p, w, consumer, ring, q_round);
            tile = scheduler.consumer_next(tile, smem.tiles, round);
        }
        // The last store is still reading its staging rows: the block's shared memory must outlive it.
        if (threadIdx.x % 128 == 0) tma_store_wait_all();
        if (consumer == 0) named_barrier_sync(issue_barrier(0), 256);
    }
}

// FP8's V^T (the header above): v (batch, seqlen_k, heads_kv, head_dim) e4m3, 16-byte-aligned rows,
// into vt (batch, heads_kv, head_dim, keys) contiguous, keys = seqlen_k rounded up to 32 (zeros
// past seqlen_k: masked keys' P is 0, and 0 x NaN would not be), each 32 keys in fp8_p_key's
// order: vt[b, h, d, 32 g + c] = v[b, 32 g + fp8_p_key(c), h, d]. A packed batch (vt_rows given:
// v (total_k, heads_kv, head_dim), batch 1 here) puts sequence s's keys from vt row vt_rows[s], a
// multiple of 32, so each 32-key group holds one sequence's keys. A block moves 64 keys of one
// (batch, head), read as 16-byte vectors of v's rows and written as 4-byte words of vt's
// (FP8_TRANSPOSE_KEYS, FP8_TRANSPOSE_THREADS: cupy_flash/_traits.py).
template <typename T>
__global__ void __launch_bounds__(FP8_TRANSPOSE_THREADS) fp8_transpose_v(const unsigned char* v, long long batch_stride, long long row_stride,
                                                       long long head_stride, int heads_kv, int seqlen_k, int head_dim,
                                                       unsigned char* vt, int keys, const int* cu_seqlens_k, const int* vt_rows,
                                                       int sequences) {
    static_assert(sizeof(T) == 1 && FP8_KEY_GROUP == Sm90Element<T>::mma_k, "V^T is FP8's, its key order one k32 step's");
    __shared__ __align__(16) unsigned char tile[FP8_TRANSPOSE_KEYS][256 + 16];   // a padded row per key
    const long long key_blocks = keys / FP8_TRANSPOSE_KEYS + (keys % FP8_TRANSPOSE_KEYS != 0);
    const long long bh = blockIdx.x / key_blocks;
    const int key0 = (int)(blockIdx.x % key_blocks) * FP8_TRANSPOSE_KEYS;
    const long long b = bh / heads_kv, h = bh % heads_kv;
    const unsigned char* src = v + b * batch_stride + h * head_stride;
    const int units = head_dim / 16;
    for (int i = threadIdx.x; i < FP8_TRANSPOSE_KEYS * units; i += blockDim.x) {
        const int r = i / units, u = i % units;
        uint4 x = make_uint4(0, 0, 0, 0);
        int row = key0 + r, rows = seqlen_k;   // the key's row in its sequence, and the sequence's rows
        long long first = 0;                   // the sequence's first row of v
        if (vt_rows != nullptr) {   // packed: the sequence holding this row, the last s with vt_rows[s] <= row
            int low = 0, high = sequences - 1;
            while (low < high) {
                const int middle = (low + high + 1) / 2;
                if (vt_rows[middle] <= row) low = middle; else high = middle - 1;
            }
            rows = cu_seqlens_k[low + 1] - cu_seqlens_k[low];
            row -= vt_rows[low];
            first = cu_seqlens_k[low];
        }
        if (row < rows) x = *reinterpret_cast<const uint4*>(src + (first + row) * row_stride + 16 * u);
        *reinterpret_cast<uint4*>(&tile[r][16 * u]) = x;
    }
    __syncthreads();
    unsigned char* dst = vt + bh * head_dim * keys;
    for (int i = threadIdx.x; i < head_dim * (FP8_TRANSPOSE_KEYS / 4); i += blockDim.x) {
        const int d = i / (FP8_TRANSPOSE_KEYS / 4), c = 4 * (i % (FP8_TRANSPOSE_KEYS / 4));   // positions c..c + 3
        if (key0 + c >= keys) continue;
        unsigned int word = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int position = c + e;
            word |= (unsigned int)tile[(position & ~(FP8_KEY_GROUP - 1)) + fp8_p_key(position & (FP8_KEY_GROUP - 1))][d] << (8 * e);
        }
        *reinterpret_cast<unsigned int*>(dst + (long long)d * keys + key0 + c) = word;
    }
}
