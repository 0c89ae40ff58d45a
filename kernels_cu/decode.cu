// Decoding (float16 / bfloat16, sm_80+): attention of a few new query tokens against a long K/V
// cache, split over the keys (flash-decoding), with its combine and the cache append.
//
//   flash_append_kernel      k_new / v_new rows written into the cache at cache_seqlens[b] + t
//   flash_decode_kernel      one block per (split, row block, batch, K/V head): a partial softmax
//                            over the split's keys, written normalised with its lse (or, with one
//                            split, as the final O and lse)
//   flash_mla_decode_kernel  the same for MLA's latent cache (v a view of k): 64 rows a block
//                            sharing each tile of keys
//   flash_combine_kernel     O = sum_s exp(lse_s - lse) O_s, lse = logsumexp_s lse_s (the sink
//                            joined here); also merge_attention_states' kernel
//
// Rows of a decode block are (token, query head) pairs of one K/V head: row r is token r / group,
// head kv_head * group + r % group. So the whole group of query heads shares one read of the cache
// (GQA), and with one new token a group of 8 fills half an m16 tile instead of 1/16 of eight.
//
// Decoding is memory-bound: each key's K and V row is read once and used for 16 rows at most. The
// four warps of a block take interleaved tiles of 16 keys, each warp streaming its own tiles through
// its own two shared-memory stages (cp.async, warp-local waits: no block barrier in the loop), and
// merge their partial softmaxes once at the end. Tiles start at multiples of 16 keys, so with pages
// of 16 or more keys (powers of two) a tile never crosses a page: one block_table read per tile.
// Above FLASH_WIDE_TILE (head dims 264-576) a warp's O over every v column would not fit its
// registers: V_SPLIT blocks share each (split, row block, batch, K/V head), each scoring every key
// and keeping O over its own share of v's columns (the index fastest in the grid); the first writes
// lse. They run DECODE_WIDE_STAGES stages, which fit sm_80's shared memory.
// An FP8 cache (FEATURE_FP8_CACHE: e4m3 keys and values, a descale per (sequence, K/V head)) is read
// in its own bytes: each warp's stages take the raw tiles, and a tile is converted (exactly) into
// one T stage just before its products; S takes k's descale, and O v's at the end.

#include "common.cuh"
#include "decode_common.cuh"
#include "fp8_values.cuh"
#include "tensor_core.cuh"

// New row r of an append (batch, new token, K/V head, in that order) and where it lands: cache
// row `position` of the sequence's cache row cache_b (CACHE_INDEX: cache_row_of); ``lands`` false
// past the cache's capacity or for a sequence outside the cache (its row is dropped).
struct AppendRow {
    long long b, t, kv_head, position, cache_b;
    bool lands;
};
template <bool CACHE_INDEX>
__device__ __forceinline__ AppendRow append_row(const FlashParams& p, long long r, long long heads_kv) {
    AppendRow row;
    row.b = r / (p.seqlen_new * heads_kv);
    row.t = (r / heads_kv) % p.seqlen_new;
    row.kv_head = r % heads_kv;
    row.position = (long long)p.cache_seqlens[row.b] + row.t;
    row.cache_b = cache_row_of<CACHE_INDEX>(p, row.b);
    row.lands = !(row.position < 0 || row.position >= p.cache_capacity || (CACHE_INDEX && row.cache_b < 0));
    return row;
}

// One warp per (batch, new token, K/V head): 16-byte copies of its K and V rows into the cache
// (CACHE_INDEX: at the sequence's cache row, cache_row_of).
template <typename T, bool CACHE_INDEX = false>
__global__ void flash_append_kernel(const FlashParams p) {
    // Launched early (_launch.py): k_new, v_new and cache_seqlens may come from the kernel ahead.
    // The decode kernel behind it may start at once, prefetching while the rows land; it reads
    // them only once this kernel has finished.
    wait_for_predecessor();
    allow_dependents();
    const int lane = threadIdx.x & 31;
    const long long heads_kv = p.heads / p.group;
    const long long rows = p.batch * p.seqlen_new * heads_kv;
    for (long long r = first_row_of_warp(); r < rows; r += rows_per_grid()) {
        const AppendRow row = append_row<CACHE_INDEX>(p, r, heads_kv);
        if (!row.lands) continue;
        const long long b = row.b, t = row.t, kv_head = row.kv_head, position = row.position, cache_b = row.cache_b;
        T* k_dst = static_cast<T*>(const_cast<void*>(p.k)) + cache_offset(p, p.k_strides, cache_b, (int)position, kv_head);
        T* v_dst = static_cast<T*>(const_cast<void*>(p.v)) + cache_offset(p, p.v_strides, cache_b, (int)position, kv_head);
        const T* k_src = static_cast<const T*>(p.k_new) + tensor_offset(p.k_new_strides, b, t, kv_head);
        const T* v_src = static_cast<const T*>(p.v_new) + tensor_offset(p.v_new_strides, b, t, kv_head);
        for (int c = 8 * lane; c < p.head_dim; c += 8 * 32)
            *reinterpret_cast<uint4*>(k_dst + c) = *reinterpret_cast<const uint4*>(k_src + c);
        for (int c = 8 * lane; c < p.head_dim_v; c += 8 * 32)
            *reinterpret_cast<uint4*>(v_dst + c) = *reinterpret_cast<const uint4*>(v_src + c);
    }
}

// flash_append_kernel into an FP8 cache (FEATURE_FP8_CACHE): each new row as the e4m3 bits of
// x / descale (k_descale, v_descale of (b, K/V head)), rounded as quantize_fp8 rounds, 16 elements
// a lane (FP8 caches have head dims that are multiples of 16).
template <typename T>
__device__ __forceinline__ void quantize_16(unsigned char* dst, const T* src, float descale) {
    float values[16];
    unpack(*reinterpret_cast<const uint4*>(src), values, T{});
    unpack(*reinterpret_cast<const uint4*>(src + 8), values + 8, T{});
    unsigned words[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int e = 0; e < 16; ++e) words[e / 4] |= e4m3_bits_of_quotient(values[e], descale) << (8 * (e % 4));
    *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
}
template <typename T, bool CACHE_INDEX = false>
__global__ void flash_append_fp8_kernel(const FlashParams p) {
    wait_for_predecessor();   // (as flash_append_kernel)
    allow_dependents();
    const int lane = threadIdx.x & 31;
    const long long heads_kv = p.heads / p.group;
    const long long rows = p.batch * p.seqlen_new * heads_kv;
    for (long long r = first_row_of_warp(); r < rows; r += rows_per_grid()) {
        const AppendRow row = append_row<CACHE_INDEX>(p, r, heads_kv);
        if (!row.lands) continue;
        const long long b = row.b, t = row.t, kv_head = row.kv_head, position = row.position, cache_b = row.cache_b;
        unsigned char* k_dst = static_cast<unsigned char*>(const_cast<void*>(p.k)) + cache_offset(p, p.k_strides, cache_b, (int)position, kv_head);
        unsigned char* v_dst = static_cast<unsigned char*>(const_cast<void*>(p.v)) + cache_offset(p, p.v_strides, cache_b, (int)position, kv_head);
        const T* k_src = static_cast<const T*>(p.k_new) + tensor_offset(p.k_new_strides, b, t, kv_head);
        const T* v_src = static_cast<const T*>(p.v_new) + tensor_offset(p.v_new_strides, b, t, kv_head);
        const float k_scale = p.k_descale[b * heads_kv + kv_head], v_scale = p.v_descale[b * heads_kv + kv_head];
        for (int c = 16 * lane; c < p.head_dim; c += 16 * 32) quantize_16(k_dst + c, k_src + c, k_scale);
        for (int c = 16 * lane; c < p.head_dim_v; c += 16 * 32) quantize_16(v_dst + c, v_src + c, v_scale);
    }
}

// Rotary embedding of flash_decode's q and k_new (rotary_cos / rotary_sin, FlashAttention-2's): one
// warp per row, first q's (batch, seqlen_q, heads), then k_new's (batch, seqlen_new, heads_kv),
// each written rotated into out_q / out_k (contiguous, the same shapes), which the decode kernel
// and the append then read. Row t of k_new sits at position cache_seqlens[b] + t; q's row t at
// cache_seqlens[b] + t * q_step (q_step 1 with a causal mask or a window, else 0: all of q at
// cache_seqlens[b], as FlashAttention-2 places them); positions clamp to the table's rows.
// Columns pair as (2i, 2i + 1) when INTERLEAVED (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX),
// for i < rotary_dim / 2, turned by (cos, sin)[position, i]; columns from rotary_dim on are copied.
// Each value is x0 c - x1 s or x0 s + x1 c in float32, every operation rounded (no fused
// multiply-add: the reference computes the same in NumPy), then rounded once to T.
template <typename T, bool INTERLEAVED>
__global__ void __launch_bounds__(ROW_KERNEL_THREADS) flash_rotary_kernel(
        const T* q, long long q_batch, long long q_row, long long q_head, const T* k_new, long long k_batch, long long k_row,
        long long k_head, T* out_q, T* out_k, const T* cos, const T* sin, const int* cache_seqlens, int batch, int seqlen_q,
        int heads, int seqlen_new, int heads_kv, int head_dim, int rotary_dim, int seqlen_ro, int q_step) {
    const int lane = threadIdx.x & 31, half = rotary_dim / 2;
    const long long q_rows = (long long)batch * seqlen_q * heads;
    const long long rows = q_rows + (long long)batch * seqlen_new * heads_kv;
    for (long long r = first_row_of_warp(); r < rows; r += rows_per_grid()) {
        const bool is_q = r < q_rows;
        const long long i = is_q ? r : r - q_rows;
        const int per_token = is_q ? heads : heads_kv, tokens = is_q ? seqlen_q : seqlen_new;
        long long b, t, h;   // (32-bit divisions where they fit: a 64-bit one is a call, which spilled)
        if (rows <= 0xffffffffLL) {
            const unsigned int u = (unsigned int)i, per = (unsigned int)per_token;
            b = u / (per * (unsigned int)tokens), t = u / per % (unsigned int)tokens, h = u % per;
        } else {
            b = i / ((long long)tokens * per_token), t = i / per_token % tokens, h = i % per_token;
        }
        const T* src = is_q ? q + b * q_batch + t * q_row + h * q_head : k_new + b * k_batch + t * k_row + h * k_head;
        T* dst = (is_q ? out_q : out_k) + i * head_dim;
        const long long position = min((long long)seqlen_ro - 1,
                                       max(0LL, (long long)cache_seqlens[b] + t * (is_q ? q_step : 1)));
        const T* cos_row = cos + position * half;
        const T* sin_row = sin + position * half;
        for (int c = lane; c < half; c += 32) {
            const int c0 = INTERLEAVED ? 2 * c : c, c1 = INTERLEAVED ? 2 * c + 1 : c + half;
            const float x0 = to_float(src[c0]), x1 = to_float(src[c1]);
            const float cs = to_float(cos_row[c]), sn = to_float(sin_row[c]);
            dst[c0] = from_float<T>(__fsub_rn(__fmul_rn(x0, cs), __fmul_rn(x1, sn)));
            dst[c1] = from_float<T>(__fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, cs)));
        }
        for (int c = rotary_dim + lane; c < head_dim; c += 32) dst[c] = src[c];
    }
}

// L2 prefetch of the first PREFETCH_BYTES of K and V of a decode block's split, issued before
// wait_for_predecessor: launched early, the block has the kernel ahead's tail to fill (in a graph of
// decode calls, the previous call's epilogue and combine, 2-3 us with DRAM nearly idle). On the H100
// (bf16, d = 128, GQA 8:1 batch 1, graphs): 11.58 -> 10.48 us a call at 4k keys, 31.46 -> 29.41 at
// 32k (-6.5%; 64 KB a block: 30.08, 256 KB: 30.05), 101 -> 97.4 at 128k (256 KB: 96.1); 1:1
// batch 1 at 32k -1.3%. Prefetching inside the key loop too (each warp 4, 8 or 16 steps ahead)
// was slower everywhere, up to 1.6x (1:1 batch 8 at 4k keys: 190 -> 308 us).
// Safe before the wait: L2 is where every SM's writes land, so a line fetched early is never stale;
// only L1 could be, and cache_seqlens is read past it (decode_seqlen_k). The length, which the
// kernel ahead may still be advancing, only bounds the prefetch. Contiguous caches only: for a paged cache each
// prefetched row first needs its block_table entry (a stale or unset one skipped, bounded by the
// page count), and with those reads in series before the wait it measured slower at 32k keys
// (31.35 against 30.42 us, GQA 8:1 batch 1, pages of 256) and 1:1 at 4k (31.28 against 29.55),
// faster only at GQA 4k (9.83 against 10.05).
constexpr int PREFETCH_BYTES = 128 * 1024;
template <typename T, int FEATURES>
__device__ __forceinline__ void prefetch_split_to_l2(const FlashParams& p, long long b, long long kv_head, int split) {
    // A window may start far past the split's first keys.
    if (p.block_table != nullptr || (FEATURES & FEATURE_WINDOW)) return;
    const long long known = decode_seqlen_k(p, b);
    const int k_row_bytes = (int)p.head_dim * (int)sizeof(T), v_row_bytes = head_dim_v_of<FEATURES>(p) * (int)sizeof(T);
    const long long first = min((long long)split * p.keys_per_split, known);
    const long long last = min(min(first + p.keys_per_split, known), first + PREFETCH_BYTES / (k_row_bytes + v_row_bytes));
    // Lines of 128 bytes per row: one more than whole lines, the last clamped to the row's end, so a
    // row that straddles a line boundary is covered wherever it starts.
    const int lines = max(k_row_bytes, v_row_bytes) / 128 + 1;
    const int count = (int)(last - first) * 2 * lines;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const int key = (int)first + i / (2 * lines), line = i % lines;
        const bool is_v = (i / lines) & 1;
        const long long* strides = is_v ? p.v_strides : p.k_strides;
        const long long row = b * strides[0] + (long long)key * strides[1] + kv_head * strides[2];
        const char* at = reinterpret_cast<const char*>(static_cast<const T*>(is_v ? p.v : p.k) + row);
        asm volatile("prefetch.global.L2 [%0];" :: "l"(at + min(128 * line, (is_v ? v_row_bytes : k_row_bytes) - 1)));
    }
}

// Q rows of a decode block into shared memory (rows past row_count and columns past head_dim as
// zeros): row r is token (row0 + r) / group, head kv_head * group + (row0 + r) % group.
template <typename T, int LD, int CHUNKS, int THREADS>
__device__ __forceinline__ void load_q_rows(const FlashParams& p, T* q_tile, long long b, long long kv_head, long long group,
                                            int row0, int row_count, int head_dim) {
    for (int idx = threadIdx.x; idx < DECODE_ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
        const int row = row0 + r;
        const bool valid = r < row_count && c < head_dim;
        const T* src = static_cast<const T*>(p.q) +
                       (valid ? tensor_offset(p.q_strides, b, row / group, kv_head * group + row % group) + c : 0);
        cp_async_16(smem_addr(q_tile + r * LD + c), src, valid);
    }
}

// One warp's loads of key tiles into its stages: K and V rows tile_start .. tile_start + 15 (keys
// past key_end and columns past head_dim (K) or head_dim_v (V) as zeros), cp.async with the cache's
// read-once L2 policy. V's tile is DV_TILE columns wide (v's share of a block: D_TILE but above
// FLASH_WIDE_TILE), and v already points at the block's first column.
// Its members are references to the kernel's values, as a [&] lambda's captures are (held by
// value, the stage addresses compile to other code).
template <typename T, int D_TILE, int DV_TILE = D_TILE>
struct DecodeTileLoader {
    const FlashParams& p;
    const T* const& k;
    const T* const& v;
    T* const& my_tiles;   // [STAGES][K, V][KEYS][LD]
    const long long &b, &kv_head;   // b: the sequence's cache row (cache_row_of)
    const int &key_end, &head_dim, &head_dim_v, &lane;
    const unsigned long long& read_once;

    // Rows of one tile, WIDTH columns of which the first `valid` are read (the rest zeros).
    template <int WIDTH>
    __device__ __forceinline__ void load_rows(T* dst, const T* src, long long row, long long row_stride, int tile_start,
                                              int valid) const {
        constexpr int KEYS = 16, LD = WIDTH + 8, CHUNKS = WIDTH / 8;
        constexpr int ROWS_PER_PASS = CHUNKS >= 32 ? 1 : 32 / CHUNKS;
        if (CHUNKS < 32 && lane >= ROWS_PER_PASS * CHUNKS) return;   // (see operator())
        // Rows wider than v's (MLA's 576) one pass at a time: unrolled, their addresses took the
        // registers the 576 tile lacks (spills at 255).
#pragma unroll (WIDTH > FLASH_MAX_HEAD_DIM_V ? 1 : KEYS / ROWS_PER_PASS)
        for (int pass = 0; pass < KEYS / ROWS_PER_PASS; ++pass) {
#pragma unroll
            for (int part = 0; part < (CHUNKS > 32 ? (CHUNKS + 31) / 32 : 1); ++part) {
                if (CHUNKS > 32 && lane + 32 * part >= CHUNKS) continue;   // past the row: issue nothing
                const int r = (CHUNKS >= 32 ? pass : pass * ROWS_PER_PASS + lane / CHUNKS);
                const int col = CHUNKS >= 32 ? (lane + 32 * part) * 8 : (lane % CHUNKS) * 8;
                const bool ok = tile_start + r < key_end && col < valid;
                cp_async_16_once(smem_addr(dst + r * LD + col), src + (ok ? row + r * row_stride + col : 0), ok, read_once);
            }
        }
    }

    __device__ __forceinline__ void operator()(int tile_start, int stage) const {
        // The kernel's tile shape.
        constexpr int KEYS = 16;
        constexpr int LD = D_TILE + 8;
        constexpr int CHUNKS = D_TILE / 8;   // 16-byte chunks per row
        constexpr int ROWS_PER_PASS = CHUNKS >= 32 ? 1 : 32 / CHUNKS;
        constexpr int PASSES = KEYS / ROWS_PER_PASS;
        constexpr int TILE_ELEMS = KEYS * LD;
        constexpr int STAGE_ELEMS = TILE_ELEMS + KEYS * (DV_TILE + 8);
        T* k_dst = my_tiles + stage * STAGE_ELEMS;
        T* v_dst = k_dst + TILE_ELEMS;
        const long long k_row = cache_offset(p, p.k_strides, b, tile_start, kv_head);
        const long long v_row = cache_offset(p, p.v_strides, b, tile_start, kv_head);
        if constexpr (DV_TILE != D_TILE) {   // K and V of different widths: a loop each
            load_rows<D_TILE>(k_dst, k, k_row, p.k_strides[1], tile_start, head_dim);
            load_rows<DV_TILE>(v_dst, v, v_row, p.v_strides[1], tile_start, head_dim_v);
            return;
        }
        const int c = (lane % CHUNKS) * 8;
        // Lanes past ROWS_PER_PASS whole rows (when CHUNKS does not divide 32) issue nothing: even a
        // zero-byte cp.async writes its 16 bytes, which would land past the tile.
        if (CHUNKS < 32 && lane >= ROWS_PER_PASS * CHUNKS) return;
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) {
#pragma unroll
            for (int part = 0; part < (CHUNKS > 32 ? CHUNKS / 32 : 1); ++part) {
                const int r = (CHUNKS >= 32 ? pass : pass * ROWS_PER_PASS + lane / CHUNKS);
                const int col = CHUNKS >= 32 ? (lane + 32 * part) * 8 : c;
                const bool key_valid = tile_start + r < key_end;
                const bool k_valid = key_valid && col < head_dim, v_valid = key_valid && col < head_dim_v;
                cp_async_16_once(smem_addr(k_dst + r * LD + col), k + (k_valid ? k_row + r * p.k_strides[1] + col : 0), k_valid,
                                 read_once);
                cp_async_16_once(smem_addr(v_dst + r * LD + col), v + (v_valid ? v_row + r * p.v_strides[1] + col : 0), v_valid,
                                 read_once);
            }
        }
    }
};

// DecodeTileLoader's loads from an FP8 cache (FEATURE_FP8_CACHE): a stage's raw K and V tiles, rows
// of D_TILE and DV_TILE bytes (unpadded: the conversion reads them in order), 16 elements a chunk.
template <int D_TILE, int DV_TILE>
struct DecodeFp8TileLoader {
    const FlashParams& p;
    const unsigned char* const& k;
    const unsigned char* const& v;
    unsigned char* const& my_raw;   // [STAGES][K, V][KEYS][D_TILE, DV_TILE]
    const long long &b, &kv_head;   // b: the sequence's cache row (cache_row_of)
    const int &key_end, &head_dim, &head_dim_v, &lane;

    template <int WIDTH>
    __device__ __forceinline__ void load_rows(unsigned char* dst, const unsigned char* src, long long row, long long row_stride,
                                              int tile_start, int valid) const {
        constexpr int KEYS = 16, CHUNKS = WIDTH / 16;
        // Rows wider than v's (MLA's 576) a step at a time, as DecodeTileLoader's (registers).
#pragma unroll (WIDTH > FLASH_MAX_HEAD_DIM_V ? 1 : (KEYS * CHUNKS + 31) / 32)
        for (int step = 0; step < (KEYS * CHUNKS + 31) / 32; ++step) {
            const int i = lane + 32 * step;
            if ((KEYS * CHUNKS) % 32 != 0 && i >= KEYS * CHUNKS) continue;   // past the tile: issue nothing
            const int r = i / CHUNKS, col = (i % CHUNKS) * 16;
            const bool ok = tile_start + r < key_end && col < valid;
            // No L2 policy here (the 16-bit loads' evict-first): with one, ptxas (NVRTC 12.9) folded
            // the shared window into a uniform register beside the memory descriptor in several
            // instantiations (LDGSTS [R+UR0], desc[UR1]), which the H100 ran as an illegal instruction.
            cp_async_16(smem_addr(dst + r * WIDTH + col), src + (ok ? row + r * row_stride + col : 0), ok);
        }
    }

    __device__ __forceinline__ void operator()(int tile_start, int stage) const {
        unsigned char* k_dst = my_raw + stage * 16 * (D_TILE + DV_TILE);
        load_rows<D_TILE>(k_dst, k, cache_offset(p, p.k_strides, b, tile_start, kv_head), p.k_strides[1], tile_start, head_dim);
        load_rows<DV_TILE>(k_dst + 16 * D_TILE, v, cache_offset(p, p.v_strides, b, tile_start, kv_head), p.v_strides[1],
                           tile_start, head_dim_v);
    }
};

// 16 raw rows of WIDTH e4m3 bytes into an fp16 tile of pitch WIDTH + 8, exactly; a lane 16 elements at a time.
template <int WIDTH>
__device__ __forceinline__ void convert_fp8_rows(fa_f16* dst, const unsigned char* src, int lane) {
    constexpr int CHUNKS = WIDTH / 16, LD = WIDTH + 8;
#pragma unroll
    for (int step = 0; step < (16 * CHUNKS + 31) / 32; ++step) {
        const int i = lane + 32 * step;
        if ((16 * CHUNKS) % 32 != 0 && i >= 16 * CHUNKS) continue;
        const int r = i / CHUNKS, c = (i % CHUNKS) * 16;
        const uint4 bytes = *reinterpret_cast<const uint4*>(src + r * WIDTH + c);
        const uint4 lo = make_uint4(e4m3x2_to_f16x2(bytes.x), e4m3x2_to_f16x2(bytes.x >> 16), e4m3x2_to_f16x2(bytes.y),
                                    e4m3x2_to_f16x2(bytes.y >> 16));
        const uint4 hi = make_uint4(e4m3x2_to_f16x2(bytes.z), e4m3x2_to_f16x2(bytes.z >> 16), e4m3x2_to_f16x2(bytes.w),
                                    e4m3x2_to_f16x2(bytes.w >> 16));
        *reinterpret_cast<uint4*>(dst + r * LD + c) = lo;
        *reinterpret_cast<uint4*>(dst + r * LD + c + 8) = hi;
    }
}

// The block's bf16 Q rows (in shared memory) into fp16 in place, row r times 2^s_r with s_r putting
// its largest magnitude at [2^14, 2^15) (exact but below 2^-10 of it, where fp16 turns
// subnormal); row_unscale[r] = 2^-s_r, which the scores take back. Warp w: rows 4w .. 4w + 3.
template <int D_TILE, int LD, int NUM_WARPS>
__device__ __forceinline__ void scale_q_rows_to_f16(fa_bf16* q_tile, float* row_unscale, int warp, int lane) {
    static_assert(DECODE_ROWS == 4 * NUM_WARPS, "four rows a warp");
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = 4 * warp + i;
        fa_bf16* q_row = q_tile + row * LD;
        float largest = 0.f;
        for (int c = lane; c < D_TILE; c += 32) largest = fmaxf(largest, fabsf(to_float(q_row[c])));
        for (int offset = 16; offset > 0; offset >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
        const F16RowScale scale = f16_row_scale(largest);
        const float scale_first = power_of_two(scale.first), scale_second = power_of_two(scale.second);
        for (int c = lane; c < D_TILE; c += 32) {
            const fa_f16 half = from_float<fa_f16>(to_float(q_row[c]) * scale_first * scale_second);
            reinterpret_cast<fa_f16*>(q_row)[c] = half;
        }
        if (lane == 0) row_unscale[row] = scale.unscale();
    }
}

// S = Q K^T of one key tile: the block's 16 rows against two n8 tiles of keys, from the lane's
// ldmatrix addresses in Q and in the K tile.
// An FP8 cache's descales of one (sequence, K/V head): k's and v's at index `at` of (batch, heads_kv).
__device__ __forceinline__ void cache_descales(const FlashParams& p, long long at, float& k_scale, float& v_scale) {
    k_scale = p.k_descale[at];
    v_scale = p.v_descale[at];
}

// A warp's O accumulators (mma.m16n8 C fragments) set to zero.
template <int O_TILES>
__device__ __forceinline__ void zero_accumulators(float (&o_acc)[O_TILES][4]) {
#pragma unroll
    for (int j = 0; j < O_TILES; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o_acc[j][e] = 0.f;
}

template <typename T, int D_TILE>
__device__ __forceinline__ void tile_scores(float (&s)[2][4], unsigned int q_lane, unsigned int k_lane) {
#pragma unroll
    for (int kk = 0; kk < D_TILE / 16; ++kk) {
        unsigned int a[4], bfrag[4];
        ldmatrix_x4(a, q_lane + 2u * kk * 16);
        ldmatrix_x4(bfrag, k_lane + 2u * kk * 16);
        mma_two_tiles<T>(s[0], s[1], a, bfrag);
    }
}

// Logits of a tile's scores (log2 units with a modifier), then the mask: the split's range and the
// band (-inf where a key is not visible to the row).
template <bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ void modify_and_mask(const FlashParams& p, float (&s)[2][4], int tile_start, int t, int key_begin,
                                                int key_end, const Band& band, const int (&row_token)[2],
                                                const float (&row_slope)[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const int key = tile_start + 8 * j + 2 * t + (e & 1);
            float z = s[j][e];
            if (ScoreMod<FEATURES>::active) {
                z *= p.softmax_scale;
                if (FEATURES & FEATURE_SOFTCAP) z = p.softcap * tanhf(z * p.softcap_inv);
                if (FEATURES & FEATURE_ALIBI) z -= row_slope[r] * fabsf((float)(key - row_token[r] - band.shift));
                z *= FLASH_LOG2E;
            }
            const bool visible = key < key_end && key >= key_begin &&
                                 (!IS_CAUSAL || key - row_token[r] <= band.right) &&
                                 (!(FEATURES & FEATURE_WINDOW) || key - row_token[r] >= band.left);
            s[j][e] = visible ? z : FLASH_NEG_INF;
        }
}

// The largest score of the tile's row r (of the thread's rows g and g + 8) over the quad sharing it.
__device__ __forceinline__ float quad_row_max(const float (&s)[2][4], int r) {
    float tile_max = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    return fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
}

// One row's step of the online softmax, given the tile's max for that row: its running max and sum
// take in the tile, its O is rescaled, and its scores become P = exp2(s * score_log2 - max_scaled).
template <int O_TILES>
__device__ __forceinline__ void softmax_row_step(float (&s)[2][4], float (&o_acc)[O_TILES][4], float& row_max,
                                                 float& row_max_scaled, float& row_sum, float tile_max, float score_log2,
                                                 int r) {
    const float rescale = raise_row_max(row_max, row_max_scaled, tile_max, score_log2);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[j][e] = exp2f(fmaf(s[j][e], score_log2, -row_max_scaled));
            sum += s[j][e];
        }
    row_sum = row_sum * rescale + sum;
#pragma unroll
    for (int j = 0; j < O_TILES; ++j) {
        o_acc[j][2 * r] *= rescale;
        o_acc[j][2 * r + 1] *= rescale;
    }
}

// Online softmax over the tile (the 4 threads of a quad share a row): each row's step with the
// tile's max of that row.
template <int O_TILES>
__device__ __forceinline__ void online_softmax_tile(float (&s)[2][4], float (&o_acc)[O_TILES][4], float (&row_max)[2],
                                                    float (&row_max_scaled)[2], float (&row_sum)[2], float score_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
        softmax_row_step<O_TILES>(s, o_acc, row_max[r], row_max_scaled[r], row_sum[r], quad_row_max(s, r), score_log2, r);
}

// O += P V: the two key n-tiles of S are one A fragment of P; v_lane is the lane's ldmatrix
// address in the V tile.
template <typename T>
__device__ __forceinline__ void pack_p(unsigned int (&a)[4], const float (&s)[2][4]) {
    a[0] = Mma<T>::pack(s[0][0], s[0][1]);
    a[1] = Mma<T>::pack(s[0][2], s[0][3]);
    a[2] = Mma<T>::pack(s[1][0], s[1][1]);
    a[3] = Mma<T>::pack(s[1][2], s[1][3]);
}
template <typename T, int O_TILES>
__device__ __forceinline__ void accumulate_pv_packed(float (&o_acc)[O_TILES][4], const unsigned int (&a)[4], unsigned int v_lane) {
#pragma unroll
    for (int j = 0; j < O_TILES; j += 2) {
        unsigned int bfrag[4];
        ldmatrix_x4_trans(bfrag, v_lane + 2u * j * 8);
        mma_two_tiles<T>(o_acc[j], o_acc[j + 1], a, bfrag);
    }
}
template <typename T, int O_TILES>
__device__ __forceinline__ void accumulate_pv(float (&o_acc)[O_TILES][4], const float (&s)[2][4], unsigned int v_lane) {
    unsigned int a[4];
    pack_p<T>(a, s);
    accumulate_pv_packed<T, O_TILES>(o_acc, a, v_lane);
}

// A warp's running max (score units and as used in exponents) and total of rows g and g + 8 into
// the block's shared per-warp arrays, for the merge.
template <int NUM_WARPS>
__device__ __forceinline__ void publish_warp_rows(float (&merge_max)[NUM_WARPS][DECODE_ROWS],
                                                  float (&merge_max_scaled)[NUM_WARPS][DECODE_ROWS],
                                                  float (&merge_sum)[NUM_WARPS][DECODE_ROWS], const float (&row_max)[2],
                                                  const float (&row_max_scaled)[2], const float (&row_sum)[2], int warp,
                                                  int g, int t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = row_sum[r];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        if (t == 0) {
            merge_max[warp][g + 8 * r] = row_max[r];
            merge_max_scaled[warp][g + 8 * r] = row_max_scaled[r];
            merge_sum[warp][g + 8 * r] = total;
        }
    }
}

// Rows g and g + 8 of a warp's O scaled by its share of the merged softmax and the row's 1 / total,
// into merge_o; warp 0 stores the rows' lse (partial with several splits, else final) where writes_lse.
template <int NUM_WARPS, int O_TILES, int MERGE_LD, int FEATURES>
__device__ __forceinline__ void scale_warp_o(const FlashParams& p, float* merge_o,
                                             const float (&merge_max)[NUM_WARPS][DECODE_ROWS],
                                             const float (&merge_max_scaled)[NUM_WARPS][DECODE_ROWS],
                                             const float (&merge_sum)[NUM_WARPS][DECODE_ROWS],
                                             const float (&o_acc)[O_TILES][4], const float (&row_max_scaled)[2],
                                             const long long (&row_head)[2], const int (&row_token)[2], int warp, int g,
                                             int t, int split, long long b, int row_count, bool split_output,
                                             bool writes_lse) {
    constexpr int ROWS = DECODE_ROWS;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        // The row's largest max over the warps that saw a key (score units, and as used in exponents).
        float best = FLASH_NEG_INF, best_scaled = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w)
            if (merge_sum[w][row] > 0.f && merge_max[w][row] > best) {
                best = merge_max[w][row];
                best_scaled = merge_max_scaled[w][row];
            }
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < NUM_WARPS; ++w)
            if (merge_sum[w][row] > 0.f) total += merge_sum[w][row] * exp2f(merge_max_scaled[w][row] - best_scaled);
        // One split: the sink joins here; several: in the combine, once.
        const float2 lse_inv = split_output ? finish_row<FEATURES & ~FEATURE_SINK>(p, row_head[r], best, best_scaled, total)
                                            : finish_row<FEATURES>(p, row_head[r], best, best_scaled, total);
        const float scale = merge_sum[warp][row] > 0.f ? exp2f(row_max_scaled[r] - best_scaled) * lse_inv.y : 0.f;
#pragma unroll
        for (int j = 0; j < O_TILES; ++j)
            *reinterpret_cast<float2*>(&merge_o[(warp * ROWS + row) * MERGE_LD + j * 8 + 2 * t]) =
                make_float2(o_acc[j][2 * r] * scale, o_acc[j][2 * r + 1] * scale);
        if (writes_lse && warp == 0 && t == 0 && row < row_count) {
            if (split_output)
                p.lse_partial[(((long long)split * p.batch + b) * p.heads + row_head[r]) * p.seqlen_q + row_token[r]] = lse_inv.x;
            else
                p.lse[b * p.lse_batch_stride + row_head[r] * p.lse_head_stride + row_token[r]] = lse_inv.x;
        }
    }
}

// The block's O: the warps' scaled shares in merge_o summed and stored (float32 partial with several
// splits, else T). One thread per (row, D_TILE / 8 columns): 16-byte chunks 32 columns apart
// (conflict-free shared loads), summed over the warps and stored at v column v_col + c (head_dim_v:
// the block's columns; partial_row: a partial row's, all of v's).
template <typename T, int D_TILE, int NUM_WARPS, int MERGE_LD>
__device__ __forceinline__ void store_block_o(const FlashParams& p, const float* merge_o, int row0, int row_count,
                                              long long group, long long kv_head, int split, long long b, int head_dim_v,
                                              int v_col, int partial_row, bool split_output) {
    constexpr int ROWS = DECODE_ROWS;
    static_assert(ROWS * 8 == 32 * NUM_WARPS && D_TILE % 32 == 0, "epilogue: 8 threads per row, chunks of 32 columns");
    const int row = threadIdx.x / 8;
    if (row < row_count) {
        const int q_row = row0 + row;
        const long long token = q_row / group, head = kv_head * group + q_row % group;
#pragma unroll
        for (int chunk = 0; chunk < D_TILE / 32; ++chunk) {
            const int c = 4 * (threadIdx.x % 8) + 32 * chunk;
            float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int w = 0; w < NUM_WARPS; ++w) {
                const float4 more = *reinterpret_cast<const float4*>(&merge_o[(w * ROWS + row) * MERGE_LD + c]);
                sum.x += more.x; sum.y += more.y; sum.z += more.z; sum.w += more.w;
            }
            if (c >= head_dim_v) continue;
            if (split_output) {
                float* dst = static_cast<float*>(p.o_partial) +
                             ((((long long)split * p.batch + b) * p.seqlen_q + token) * p.heads + head) * partial_row + v_col + c;
                *reinterpret_cast<float4*>(dst) = sum;
            } else {
                T* dst = static_cast<T*>(p.o) + tensor_offset(p.o_strides, b, token, head) + v_col + c;
                *reinterpret_cast<uint2*>(dst) = make_uint2(Mma<T>::pack(sum.x, sum.y), Mma<T>::pack(sum.z, sum.w));
            }
        }
    }
}

template <typename T, int D_TILE, int NUM_WARPS, bool IS_CAUSAL, int FEATURES>
__global__ void __launch_bounds__(32 * NUM_WARPS, D_TILE > 128 ? DECODE_BLOCKS_PER_SM_ABOVE_128 : DECODE_BLOCKS_PER_SM_TO_128)
flash_decode_kernel(const FlashParams p) {
    constexpr int ROWS = DECODE_ROWS;        // (token, head) rows per block: one m16 tile
    static_assert(ROWS == 16, "one m16 tile of rows");
    constexpr int KEYS = 16;                 // keys per warp tile: one k16 step of P V
    constexpr bool WIDE = D_TILE > FLASH_WIDE_TILE;
    constexpr int V_SPLIT = WIDE ? FLASH_V_SPLIT : 1;    // blocks over v's columns (the header)
    // v (and O) columns of this block: v's head dim stays within FLASH_MAX_HEAD_DIM_V where q's and
    // k's go past it (MLA's 576 tile: two blocks of 256 v columns).
    constexpr int DV_TILE = (D_TILE < FLASH_MAX_HEAD_DIM_V ? D_TILE : FLASH_MAX_HEAD_DIM_V) / V_SPLIT;
    // Tiles in flight per warp (_traits.DECODE_STAGES: why 2; DECODE_WIDE_STAGES: why 1).
    constexpr int STAGES = WIDE ? DECODE_WIDE_STAGES : DECODE_STAGES;
    constexpr int LD = D_TILE + 8;           // padded pitch (see forward_tc.cu)
    constexpr int LD_V = DV_TILE + 8;        // the V tiles'
    constexpr int O_TILES = DV_TILE / 8;
    constexpr int CHUNKS = D_TILE / 8;       // 16-byte chunks per row
    constexpr int ROWS_PER_PASS = CHUNKS >= 32 ? 1 : 32 / CHUNKS;
    constexpr int TILE_ELEMS = KEYS * LD;    // one K tile
    constexpr int STAGE_ELEMS = TILE_ELEMS + KEYS * LD_V;   // a stage: a K and a V tile
    constexpr int MERGE_LD = DV_TILE + 8;    // float pitch of the epilogue's per-warp O (float2 stores conflict-free)
    // FEATURE_FP8_CACHE: a warp's STAGES stages hold raw e4m3 tiles, converted into one T stage.
    constexpr bool FP8_CACHE = (FEATURES & FEATURE_FP8_CACHE) != 0;
    constexpr int COMPUTE_STAGES = FP8_CACHE ? 1 : STAGES;   // T stages of a warp
    constexpr int RAW_STAGE_BYTES = FP8_CACHE ? KEYS * (D_TILE + DV_TILE) : 0;
    constexpr unsigned int LOOP_BYTES = (ROWS * LD + NUM_WARPS * COMPUTE_STAGES * STAGE_ELEMS) * sizeof(T) +
                                        NUM_WARPS * STAGES * RAW_STAGE_BYTES;
    constexpr unsigned int MERGE_BYTES = (ROWS * LD) * sizeof(T) + NUM_WARPS * ROWS * MERGE_LD * sizeof(float);
    constexpr unsigned int SMEM_BYTES = LOOP_BYTES > MERGE_BYTES ? LOOP_BYTES : MERGE_BYTES;
    static_assert(WIDE || CHUNKS <= 32 || CHUNKS % 32 == 0, "row chunks per lane");   // (wide: load_rows)
    static_assert(KEYS % ROWS_PER_PASS == 0, "tile rows per pass");
    require_dynamic_smem(SMEM_BYTES);

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_tile = reinterpret_cast<T*>(smem_raw);                  // [ROWS][LD]
    T* warp_tiles = q_tile + ROWS * LD;                          // [NUM_WARPS][COMPUTE_STAGES][K, V][KEYS][LD, LD_V]
    // FEATURE_FP8_CACHE: [NUM_WARPS][STAGES][K, V][KEYS][D_TILE, DV_TILE] bytes
    unsigned char* raw_tiles = reinterpret_cast<unsigned char*>(warp_tiles + NUM_WARPS * COMPUTE_STAGES * STAGE_ELEMS);
    float* merge_o = reinterpret_cast<float*>(warp_tiles);       // epilogue: [NUM_WARPS][ROWS][MERGE_LD]
    __shared__ float merge_max[NUM_WARPS][ROWS], merge_max_scaled[NUM_WARPS][ROWS], merge_sum[NUM_WARPS][ROWS];
    // The products' type (DecodeProducts): fp16 for bf16 calls on an FP8 cache, Q's rows scaled.
    using CT = typename DecodeProducts<T, FP8_CACHE>::type;
    constexpr bool Q_TO_F16 = DecodeProducts<T, FP8_CACHE>::q_to_f16;
    __shared__ float row_unscale[Q_TO_F16 ? ROWS : 1];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int v_chunk = V_SPLIT > 1 ? (int)(blockIdx.x % V_SPLIT) : 0, v_col = v_chunk * DV_TILE;
    const unsigned int index = V_SPLIT > 1 ? blockIdx.x / V_SPLIT : blockIdx.x;   // of the (split, rows, b, head) block
    const int head_dim = (int)p.head_dim;
    const int head_dim_v = V_SPLIT > 1 ? min(head_dim_v_of<FEATURES>(p) - v_col, DV_TILE) : head_dim_v_of<FEATURES>(p);
    if (V_SPLIT > 1 && head_dim_v <= 0) return;   // past v's columns (never the first chunk)
    const long long group = p.group, heads_kv = p.heads / p.group;
    const int rows_per_kv_head = (int)(group * p.seqlen_q);
    const int row_blocks = (rows_per_kv_head + ROWS - 1) / ROWS;
    const int split = (int)(index % p.num_splits);
    const long long rest = index / p.num_splits;
    const int row0 = (int)(rest % row_blocks) * ROWS;
    const long long b = rest / row_blocks / heads_kv, kv_head = rest / row_blocks % heads_kv;
    const int row_count = min(ROWS, rows_per_kv_head - row0);
    // Launched early (_launch.py), the block starts while the kernel ahead still runs: it asks L2 for
    // the first keys of its split meanwhile, and reads nothing else before that kernel has finished.
    // The combine may then start its blocks, which wait for this kernel's end.
    // (With FEATURE_CACHE_INDEX the cache row is known only after the wait: no prefetch.)
    constexpr bool CACHE_INDEX = (FEATURES & FEATURE_CACHE_INDEX) != 0;
    if constexpr (!CACHE_INDEX && FP8_CACHE) prefetch_split_to_l2<unsigned char, FEATURES>(p, b, kv_head, split);
    if (!CACHE_INDEX && !FP8_CACHE) prefetch_split_to_l2<T, FEATURES>(p, b, kv_head, split);
    wait_for_predecessor();
    allow_dependents();

    // Q rows into shared memory first: they need no cache length, so their latency overlaps
    // cache_seqlens'.
    load_q_rows<T, LD, CHUNKS, 32 * NUM_WARPS>(p, q_tile, b, kv_head, group, row0, row_count, head_dim);
    cp_async_commit();
    // The sequence's cache row (FEATURE_CACHE_INDEX; -1: outside the cache, no key seen).
    const long long cache_b = cache_row_of<CACHE_INDEX>(p, b);

    // Keys this block may see: its split's range, cut to the band of its first and last tokens.
    const int seqlen_k = decode_seqlen_k(p, b);
    Sequence seq = {(int)p.seqlen_q, seqlen_k, 0, 0};
    const Band band = band_of(p, seq);
    int key_begin, key_end;
    block_key_range<IS_CAUSAL, FEATURES>(p, band, seqlen_k, split, row0, row_count, group, b, key_begin, key_end);
    if (CACHE_INDEX && cache_b < 0) key_begin = key_end = 0;   // no tile at all: its loads would read row -1

    // Rows g and g + 8 of this thread: token and head (and the ALiBi slope of that head).
    int row_token[2];
    float row_slope[2];
    long long row_head[2];
    thread_rows<FEATURES>(p, b, kv_head, group, row0, g, rows_per_kv_head, row_token, row_head, row_slope);

    const T* k = static_cast<const T*>(p.k);
    const T* v = static_cast<const T*>(p.v) + v_col;
    T* my_tiles = warp_tiles + warp * COMPUTE_STAGES * STAGE_ELEMS;
    fa_f16* my_products = reinterpret_cast<fa_f16*>(my_tiles);   // FEATURE_FP8_CACHE's converted stage
    // This warp's tiles: starts key_begin rounded down to 16, then every NUM_WARPS-th tile.
    const int first_tile = (key_begin & ~(KEYS - 1)) + warp * KEYS;
    constexpr int TILE_STEP = NUM_WARPS * KEYS;

    // The cache is read once: evict-first in L2, which keeps the partials and the kernels' code there
    // for the combine and the next call (GQA 8:1, batch 1, 32k keys: 33.6 -> 32.1 us a call in a
    // graph; 33 splits of uneven chunks, to give all 132 SMs a block, measured no faster than 32).
    const unsigned long long read_once = l2_evict_first_policy();
    const DecodeTileLoader<T, D_TILE, DV_TILE> load_tile = {p, k, v, my_tiles, cache_b, kv_head, key_end, head_dim, head_dim_v,
                                                   lane, read_once};
    // FEATURE_FP8_CACHE: the raw tiles' loader, and the descales of this sequence's K/V head.
    const unsigned char* k8 = static_cast<const unsigned char*>(p.k);
    const unsigned char* v8 = static_cast<const unsigned char*>(p.v) + v_col;
    unsigned char* my_raw = raw_tiles + warp * STAGES * RAW_STAGE_BYTES;
    const DecodeFp8TileLoader<D_TILE, DV_TILE> load_fp8_tile = {p, k8, v8, my_raw, cache_b, kv_head, key_end, head_dim,
                                                                 head_dim_v, lane};
    float k_scale = 1.f, v_scale = 1.f;
    if constexpr (FP8_CACHE) cache_descales(p, b * heads_kv + kv_head, k_scale, v_scale);

    float o_acc[O_TILES][4];
    zero_accumulators(o_acc);
    float row_max[2] = {FLASH_NEG_INF, FLASH_NEG_INF}, row_max_scaled[2] = {0.f, 0.f}, row_sum[2] = {0.f, 0.f};
    const float score_log2 = score_to_log2<FEATURES>(p);
    const unsigned int q_lane = smem_addr(q_tile) + a_frag_lane<LD>(lane);

#pragma unroll
    for (int ahead = 0; ahead < STAGES - 1; ++ahead) {   // one commit group per tile, empty or not
        if (first_tile + ahead * TILE_STEP < key_end) {
            if constexpr (FP8_CACHE) load_fp8_tile(first_tile + ahead * TILE_STEP, ahead);
            else load_tile(first_tile + ahead * TILE_STEP, ahead);
        }
        cp_async_commit();
    }
    cp_async_wait<STAGES - 1>();   // the Q group (committed first) landed for this thread ...
    __syncthreads();               // ... and for the block: every warp reads all of Q
    // Q_TO_F16: Q's rows scaled into fp16 in place, and each thread's rows' score factors.
    float score_factor[2] = {k_scale, k_scale};
    if constexpr (Q_TO_F16) {
        scale_q_rows_to_f16<D_TILE, LD, NUM_WARPS>(reinterpret_cast<fa_bf16*>(q_tile), row_unscale, warp, lane);
        __syncthreads();
        score_factor[0] = k_scale * row_unscale[g];
        score_factor[1] = k_scale * row_unscale[g + 8];
    }
    int stage = 0;
    for (int tile_start = first_tile; tile_start < key_end; tile_start += TILE_STEP, stage = (stage + 1) % STAGES) {
        const int ahead_start = tile_start + (STAGES - 1) * TILE_STEP;
        if (ahead_start < key_end) {
            if constexpr (FP8_CACHE) load_fp8_tile(ahead_start, (stage + STAGES - 1) % STAGES);
            else load_tile(ahead_start, (stage + STAGES - 1) % STAGES);
        }
        cp_async_commit();
        cp_async_wait<STAGES - 1>();   // this tile landed for this thread
        __syncwarp();         // ... and for the whole warp
        if constexpr (FP8_CACHE) {   // the raw tiles into the T stage (every lane done with it: the loop's end)
            convert_fp8_rows<D_TILE>(my_products, my_raw + stage * RAW_STAGE_BYTES, lane);
            convert_fp8_rows<DV_TILE>(my_products + TILE_ELEMS, my_raw + stage * RAW_STAGE_BYTES + KEYS * D_TILE, lane);
            __syncwarp();
        }
        const int compute_stage = FP8_CACHE ? 0 : stage;
        const unsigned int k_lane = smem_addr(my_tiles + compute_stage * STAGE_ELEMS) + b_frags_lane<LD>(lane);
        const unsigned int v_lane = smem_addr(my_tiles + compute_stage * STAGE_ELEMS + TILE_ELEMS) + b_frags_trans_lane<LD_V>(lane);

        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        tile_scores<CT, D_TILE>(s, q_lane, k_lane);
        if constexpr (FP8_CACHE) {
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[j][e] *= score_factor[e >> 1];
        }
        modify_and_mask<IS_CAUSAL, FEATURES>(p, s, tile_start, t, key_begin, key_end, band, row_token, row_slope);
        online_softmax_tile<O_TILES>(s, o_acc, row_max, row_max_scaled, row_sum, score_log2);
        accumulate_pv<CT, O_TILES>(o_acc, s, v_lane);
        __syncwarp();   // every lane is done with this stage before the next iteration refills it
    }

    // Merge the warps' partial softmaxes (the tiles are free once every warp has left its loop).
    // Every thread works out its two rows' merged max, total and lse itself (from four per-warp
    // values), scales its O by its warp's share and the row's 1 / total, and the output is then a
    // plain sum over the warps. The merge is serial code on the critical path of every call: the
    // old form (one thread per (row, 4 columns), each redoing the row's max and total in a loop)
    // took 2.1 us of a 4k-key call (globaltimer stamps, H100).
    if constexpr (FP8_CACHE) {
#pragma unroll
        for (int j = 0; j < O_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[j][e] *= v_scale;
    }
    cp_async_wait<0>();
    __syncthreads();
    publish_warp_rows<NUM_WARPS>(merge_max, merge_max_scaled, merge_sum, row_max, row_max_scaled, row_sum, warp, g, t);
    __syncthreads();
    const bool split_output = p.num_splits > 1;
    scale_warp_o<NUM_WARPS, O_TILES, MERGE_LD, FEATURES>(p, merge_o, merge_max, merge_max_scaled, merge_sum, o_acc,
                                                         row_max_scaled, row_head, row_token, warp, g, t, split, b,
                                                         row_count, split_output, v_chunk == 0);
    __syncthreads();
    store_block_o<T, DV_TILE, NUM_WARPS, MERGE_LD>(p, merge_o, row0, row_count, group, kv_head, split, b, head_dim_v,
                                                   v_col, V_SPLIT > 1 ? (int)p.head_dim_v : head_dim_v, split_output);
}

// MLA decoding (DeepSeek's latent cache: flash_decode where v is a view of k's first head_dim_v
// columns, no score modifier): a block takes MLA_DECODE_ROW_TILES x 16 (token, query head)
// rows of one K/V head and a split's keys. Its warps share each tile of MLA_DECODE_KEYS keys in
// shared memory, read from L2 once for all the block's rows, and V is the same tile's first
// columns. (flash_decode_kernel reads the cache once per 16 rows and per half of v: 16 times for
// 128 query heads, which left it bound by L2 at 0.05 of the DRAM rate, docs/decisions.md.)
// Warp w takes rows 16 (w % ROW_TILES) .. + 15 and v's columns DV_TILE (w / ROW_TILES) .. + DV_TILE - 1
// (a warp's O over all of v would not fit its registers). The two warps of a row tile (a pair)
// share the scores: each scores its half of the tile's keys, the pair exchanges the rows' tile
// maxima and then the P fragments in shared memory (a named barrier per pair), and each multiplies
// the whole tile's P by its own v columns; each keeps the row sums of its own keys, added at the end.
// FP8_CACHE (e4m3 latent rows, a descale per (sequence, K/V head)): the stages hold raw tiles, and
// the block converts each once into one fp16 tile before its products (as flash_decode_kernel's
// warps do theirs; bf16 calls' Q rows scaled into fp16's range, DecodeProducts).
template <typename T, int D_TILE, bool IS_CAUSAL, bool FP8_CACHE>
__global__ void __launch_bounds__(32 * MLA_DECODE_ROW_TILES * MLA_DECODE_V_HALVES, 1)
flash_mla_decode_kernel(const FlashParams p) {
    constexpr int ROW_TILES = MLA_DECODE_ROW_TILES, V_HALVES = MLA_DECODE_V_HALVES;
    constexpr int THREADS = 32 * ROW_TILES * V_HALVES;
    constexpr int ROWS = 16 * ROW_TILES;                       // (token, head) rows of a block
    constexpr int KEYS = MLA_DECODE_KEYS;                      // keys of a shared tile
    static_assert(MLA_DECODE_STAGES == 2, "the loop below double-buffers");
    constexpr int DV_TILE = FLASH_MAX_HEAD_DIM_V / V_HALVES;   // v (and O) columns of a warp
    constexpr int O_TILES = DV_TILE / 8;
    constexpr int LD = D_TILE + 8;                             // padded pitch (see forward_tc.cu)
    constexpr int CHUNKS = D_TILE / 8;                         // 16-byte chunks of a row
    static_assert(KEYS == 16 * V_HALVES && V_HALVES == 2, "a pair's warps score 16 keys each");
    static_assert(D_TILE % 16 == 0 && DV_TILE % 16 == 0, "whole k16 steps");
    // The products' type: T, or fp16 on an FP8 cache (DecodeProducts).
    using CT = typename DecodeProducts<T, FP8_CACHE>::type;
    constexpr bool Q_TO_F16 = DecodeProducts<T, FP8_CACHE>::q_to_f16;
    // Q, the key tiles (16-bit: two stages; FP8: one converted tile, then two stages of raw rows),
    // then the pairs' exchange: tile maxima and row sums (float [ROW_TILES][V_HALVES][16] each), P
    // fragments (uint [ROW_TILES][V_HALVES][4][32]: a lane's four in turn), and Q's row factors
    // (float [ROWS], Q_TO_F16). _traits.mla_decode_smem_bytes says the same.
    constexpr unsigned int TILE_BYTES = (ROWS + (FP8_CACHE ? 1 : 2) * KEYS) * LD * 2 + (FP8_CACHE ? 2 * KEYS * D_TILE : 0);
    constexpr unsigned int SMEM_BYTES = TILE_BYTES + 4 * ROW_TILES * V_HALVES * (2 * 16 + 4 * 32) + 4 * ROWS;
    require_dynamic_smem(SMEM_BYTES);
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* q_tile = reinterpret_cast<T*>(smem_raw);   // [ROWS][LD]
    T* k_tiles = q_tile + ROWS * LD;               // [2][KEYS][LD]; FP8_CACHE: the converted tile [KEYS][LD]
    unsigned char* raw_tiles = reinterpret_cast<unsigned char*>(k_tiles + KEYS * LD);   // FP8_CACHE: [2][KEYS][D_TILE]
    float* pair_max = reinterpret_cast<float*>(smem_raw + TILE_BYTES);
    float* pair_sum = pair_max + ROW_TILES * V_HALVES * 16;
    unsigned int* pair_p = reinterpret_cast<unsigned int*>(pair_sum + ROW_TILES * V_HALVES * 16);
    float* row_unscale = reinterpret_cast<float*>(pair_p + ROW_TILES * V_HALVES * 4 * 32);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row_tile = warp % ROW_TILES, v_half = warp / ROW_TILES;
    // This warp's and its partner's slots in the exchange, and the pair's barrier (ids from 1: 0 is
    // __syncthreads').
    const int mine = row_tile * V_HALVES + v_half, partner = row_tile * V_HALVES + (1 - v_half);
    const auto pair_sync = [&]() { asm volatile("bar.sync %0, %1;" :: "r"(1 + row_tile), "r"(64) : "memory"); };
    const MlaBlock block = mla_block<ROWS>(p);
    const long long group = block.group, heads_kv = block.heads_kv, b = block.b, kv_head = block.kv_head;
    const int rows_per_kv_head = block.rows_per_kv_head, split = block.split, row0 = block.row0, row_count = block.row_count;
    const int head_dim = (int)p.head_dim, head_dim_v = (int)p.head_dim_v;
    // Launched early (_launch.py): nothing is read before the kernel ahead has finished.
    wait_for_predecessor();
    allow_dependents();

    // Q rows (rows past row_count and columns past head_dim as zeros): row r is token r / group,
    // head kv_head * group + r % group, as flash_decode_kernel's.
    for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
        const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8, row = row0 + r;
        const bool valid = r < row_count && c < head_dim;
        const T* src = static_cast<const T*>(p.q) +
                       (valid ? tensor_offset(p.q_strides, b, row / group, kv_head * group + row % group) + c : 0);
        cp_async_16(smem_addr(q_tile + r * LD + c), src, valid);
    }
    cp_async_commit();

    const MlaKeys keys = mla_keys<IS_CAUSAL>(p, block);
    const Band band = keys.band;
    const int key_begin = keys.key_begin, key_end = keys.key_end;
    int row_token[2];
    long long row_head[2];
    float row_slope[2];
    thread_rows<0>(p, b, kv_head, group, row0 + 16 * row_tile, g, rows_per_kv_head, row_token, row_head, row_slope);

    // A tile of keys into a stage, every thread a share of its 16-byte chunks (keys past key_end and
    // columns past head_dim as zeros); a key's row found on its own (a tile may cross pages of 16).
    // FP8_CACHE: raw e4m3 rows of D_TILE bytes, without the L2 policy (DecodeFp8TileLoader: why).
    const T* k = static_cast<const T*>(p.k);
    const unsigned char* k8 = static_cast<const unsigned char*>(p.k);
    const unsigned long long read_once = l2_evict_first_policy();
    auto load_tile = [&](int tile_start, int stage) {
        if constexpr (FP8_CACHE) {
            constexpr int RAW_CHUNKS = D_TILE / 16;
            unsigned char* dst = raw_tiles + stage * KEYS * D_TILE;
            for (int idx = threadIdx.x; idx < KEYS * RAW_CHUNKS; idx += THREADS) {
                const int r = idx / RAW_CHUNKS, c = (idx % RAW_CHUNKS) * 16, key = tile_start + r;
                const bool ok = key < key_end && c < head_dim;
                cp_async_16(smem_addr(dst + r * D_TILE + c), k8 + (ok ? cache_offset(p, p.k_strides, b, key, kv_head) + c : 0), ok);
            }
        } else {
            T* dst = k_tiles + stage * KEYS * LD;
            for (int idx = threadIdx.x; idx < KEYS * CHUNKS; idx += THREADS) {
                const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8, key = tile_start + r;
                const bool ok = key < key_end && c < head_dim;
                const T* src = k + (ok ? cache_offset(p, p.k_strides, b, key, kv_head) + c : 0);
                cp_async_16_once(smem_addr(dst + r * LD + c), src, ok, read_once);
            }
        }
    };
    float k_scale = 1.f, v_scale = 1.f;
    if constexpr (FP8_CACHE) cache_descales(p, b * heads_kv + kv_head, k_scale, v_scale);

    float o_acc[O_TILES][4];
    zero_accumulators(o_acc);
    float row_max[2] = {FLASH_NEG_INF, FLASH_NEG_INF}, row_max_scaled[2] = {0.f, 0.f}, row_sum[2] = {0.f, 0.f};
    const float score_log2 = score_to_log2<0>(p);
    const unsigned int q_lane = smem_addr(q_tile + 16 * row_tile * LD) + a_frag_lane<LD>(lane);
    const int first_tile = key_begin & ~(KEYS - 1);
    if (first_tile < key_end) load_tile(first_tile, 0);
    cp_async_commit();
    // FP8_CACHE: the scores' factors of this thread's rows (k's descale; Q_TO_F16: with the row's).
    float score_factor[2] = {k_scale, k_scale};
    if constexpr (Q_TO_F16) {   // Q's rows into fp16 in place, as scale_q_rows_to_f16 (ROWS / 8 a warp)
        cp_async_wait<1>();
        __syncthreads();
        constexpr int ROWS_PER_WARP = ROWS / (ROW_TILES * V_HALVES);
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            const int row = ROWS_PER_WARP * warp + i;
            fa_bf16* q_row = reinterpret_cast<fa_bf16*>(q_tile) + row * LD;
            float largest = 0.f;
            for (int c = lane; c < D_TILE; c += 32) largest = fmaxf(largest, fabsf(to_float(q_row[c])));
            for (int offset = 16; offset > 0; offset >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
            const F16RowScale scale = f16_row_scale(largest);
            const float scale_first = power_of_two(scale.first), scale_second = power_of_two(scale.second);
            for (int c = lane; c < D_TILE; c += 32)
                reinterpret_cast<fa_f16*>(q_row)[c] = from_float<fa_f16>(to_float(q_row[c]) * scale_first * scale_second);
            if (lane == 0) row_unscale[row] = scale.unscale();
        }
        __syncthreads();
        score_factor[0] = k_scale * row_unscale[16 * row_tile + g];
        score_factor[1] = k_scale * row_unscale[16 * row_tile + g + 8];
    }
    int stage = 0;
    for (int tile_start = first_tile; tile_start < key_end; tile_start += KEYS, stage ^= 1) {
        if (tile_start + KEYS < key_end) load_tile(tile_start + KEYS, stage ^ 1);   // (the other stage is free)
        cp_async_commit();
        cp_async_wait<1>();   // Q and this tile landed for this thread ...
        __syncthreads();      // ... and for the block
        const CT* tile = reinterpret_cast<const CT*>(k_tiles) + (FP8_CACHE ? 0 : stage * KEYS * LD);
        if constexpr (FP8_CACHE) {   // the raw tile into the converted one, exactly, 16 elements a step
            constexpr int RAW_CHUNKS = D_TILE / 16;
            const unsigned char* raw = raw_tiles + stage * KEYS * D_TILE;
            for (int idx = threadIdx.x; idx < KEYS * RAW_CHUNKS; idx += THREADS) {
                const int r = idx / RAW_CHUNKS, c = (idx % RAW_CHUNKS) * 16;
                const uint4 bytes = *reinterpret_cast<const uint4*>(raw + r * D_TILE + c);
                fa_f16* dst = reinterpret_cast<fa_f16*>(k_tiles) + r * LD + c;
                *reinterpret_cast<uint4*>(dst) = make_uint4(e4m3x2_to_f16x2(bytes.x), e4m3x2_to_f16x2(bytes.x >> 16),
                                                            e4m3x2_to_f16x2(bytes.y), e4m3x2_to_f16x2(bytes.y >> 16));
                *reinterpret_cast<uint4*>(dst + 8) = make_uint4(e4m3x2_to_f16x2(bytes.z), e4m3x2_to_f16x2(bytes.z >> 16),
                                                                e4m3x2_to_f16x2(bytes.w), e4m3x2_to_f16x2(bytes.w >> 16));
            }
            __syncthreads();
        }
        // This warp's 16 keys of the tile (its v half's), scored and masked.
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        tile_scores<CT, D_TILE>(s, q_lane, smem_addr(tile + 16 * v_half * LD) + b_frags_lane<LD>(lane));
        if constexpr (FP8_CACHE) {
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[j][e] *= score_factor[e >> 1];
        }
        modify_and_mask<IS_CAUSAL, 0>(p, s, tile_start + 16 * v_half, t, key_begin, key_end, band, row_token, row_slope);
        // The rows' max over the whole tile: this warp's (over its quad), then its partner's.
        const float tile_max[2] = {quad_row_max(s, 0), quad_row_max(s, 1)};
        if (t == 0) {
            pair_max[mine * 16 + g] = tile_max[0];
            pair_max[mine * 16 + g + 8] = tile_max[1];
        }
        pair_sync();
        // Both warps raise the same running max from the same values; P of this warp's keys, its
        // part of the row sums, and O rescaled.
#pragma unroll
        for (int r = 0; r < 2; ++r)
            softmax_row_step<O_TILES>(s, o_acc, row_max[r], row_max_scaled[r], row_sum[r],
                                      fmaxf(tile_max[r], pair_max[partner * 16 + g + 8 * r]), score_log2, r);
        // P fragments exchanged: keys 0-15 are the first half's, 16-31 the second's.
        unsigned int own[4], other[4], first[4], second[4];
        pack_p<CT>(own, s);
#pragma unroll
        for (int i = 0; i < 4; ++i) pair_p[(mine * 4 + i) * 32 + lane] = own[i];
        pair_sync();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            other[i] = pair_p[(partner * 4 + i) * 32 + lane];
            first[i] = v_half == 0 ? own[i] : other[i];
            second[i] = v_half == 0 ? other[i] : own[i];
        }
        const unsigned int v_lane = smem_addr(tile + v_half * DV_TILE) + b_frags_trans_lane<LD>(lane);
        accumulate_pv_packed<CT, O_TILES>(o_acc, first, v_lane);
        accumulate_pv_packed<CT, O_TILES>(o_acc, second, v_lane + 2u * 16 * LD);
        __syncthreads();      // every warp is done with this stage (and the exchange) before they are refilled
    }
    cp_async_wait<0>();
    if constexpr (FP8_CACHE) {
#pragma unroll
        for (int j = 0; j < O_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[j][e] *= v_scale;
    }

    // Each warp's rows g and g + 8: the row's total over its quad, lse and 1 / total, and the warp's
    // O columns stored (float32 partials with several splits, else T); the first v half writes lse.
#pragma unroll
    for (int r = 0; r < 2; ++r) {   // each warp's part of the row sums, over its quad
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
        row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
        if (t == 0) pair_sum[mine * 16 + g + 8 * r] = row_sum[r];
    }
    pair_sync();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float total = row_sum[r] + pair_sum[partner * 16 + g + 8 * r];
        const float2 lse_inv = finish_row<0>(p, row_head[r], row_max[r], row_max_scaled[r], total);
        if (16 * row_tile + g + 8 * r >= row_count) continue;
        const long long token = row_token[r], head = row_head[r];
        if (v_half == 0 && t == 0) store_row_lse(p, split, b, head, token, lse_inv.x);
#pragma unroll
        for (int j = 0; j < O_TILES; ++j) {
            const int c = v_half * DV_TILE + 8 * j + 2 * t;
            if (c >= head_dim_v) continue;
            store_row_pair<T>(p, split, b, token, head, head_dim_v, c, o_acc[j][2 * r] * lse_inv.y,
                              o_acc[j][2 * r + 1] * lse_inv.y);
        }
    }
}

// Four consecutive columns as float32: a 16-byte load of floats, an 8-byte load of 16-bit values.
__device__ __forceinline__ float4 load_vector4(const float* at) { return *reinterpret_cast<const float4*>(at); }
template <typename T16>
__device__ __forceinline__ float4 load_vector4(const T16* at) {
    const uint2 raw = *reinterpret_cast<const uint2*>(at);
    return make_float4(to_float(T16{(unsigned short)(raw.x & 0xffffu)}), to_float(T16{(unsigned short)(raw.x >> 16)}),
                       to_float(T16{(unsigned short)(raw.y & 0xffffu)}), to_float(T16{(unsigned short)(raw.y >> 16)}));
}

// Partial columns c..c+3 of one row (vector loads when head_dim is a multiple of 4, so every row
// starts aligned; element loads otherwise); columns past head_dim read as 0.
template <typename T_IN>
__device__ __forceinline__ float4 load_four(const T_IN* row, int c, int head_dim, bool vectors) {
    if (vectors) return c < head_dim ? load_vector4(row + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    float f[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) f[e] = c + e < head_dim ? to_float(row[c + e]) : 0.f;
    return make_float4(f[0], f[1], f[2], f[3]);
}

// One block per (batch, token, head) row, its blockDim.x / 32 warps (1 to 8, chosen by the launch
// from the number of splits) taking interleaved splits, COMBINE_BATCH at a time. Each lane holds four
// columns (two passes above 128). Latency is what counts (a few KB a row, every call waits on it), so
// a warp issues its first batch's lse and O loads and, one per lane, the first 32 splits' lse
// together; from those lanes every warp has the row's max and total by shuffles (no barrier), so
// its share of O is sum_s exp(lse_s - max) O_s and the warps' shares simply add up. A split that saw
// no key (lse -inf) weighs exactly 0 whatever its O holds; a row no split saw gets lse -inf and O = 0.
// Before this form (each warp a running max, merged by warp 0 in loops over the warps), the combine
// took 3.4 us of a 4k-key call from its start to its end (globaltimer stamps, H100). And earlier,
// one warp per row walking the splits one by one waited on memory once per split (57 us for 86
// splits, 8 query heads per K/V head at 32k keys, against 34 us for the decode kernel).
// Partials are T_IN, contiguous (splits, batch, seqlen_q, heads, head_dim_v); lse_partial (splits,
// batch, heads, seqlen_q). With p.sink the sink's logit joins the merged row (FEATURE_SINK).
// PASSES: 128 columns each (2 to head_dim_v 256: a template flag, so that the common case keeps its
// registers). PASSES 1 (head_dim_v above 256) slices the row: each block one 128-column slice of
// it, blockIdx.x = row x slices + slice, so MLA's 512 columns at batch 1 (128 rows, 32-64 splits)
// are read by 512 blocks rather than 128 (docs/decisions.md, Decoding: "the wide combine sliced").
template <typename T_IN, typename T_OUT, int PASSES>
__global__ void __launch_bounds__(32 * COMBINE_MAX_WARPS) flash_combine_kernel(const FlashParams p) {
    constexpr int MAX_WARPS = COMBINE_MAX_WARPS;   // COMBINE_BATCH splits a warp at a time (_traits)
    __shared__ float4 warp_sums[MAX_WARPS][PASSES][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    constexpr int COLUMNS = COMBINE_PASS_COLUMNS;   // a pass's (and a slice's) columns: 4 a lane
    static_assert(COLUMNS == 4 * 32, "four columns a lane");
    const int slices = PASSES == 1 ? ((int)p.head_dim_v + COLUMNS - 1) / COLUMNS : 1;
    const int slice = PASSES == 1 ? (int)(blockIdx.x % slices) : 0;
    const int column0 = COLUMNS * slice;   // the block's first column of o
    const int head_dim = (int)p.head_dim_v - column0;   // o's columns from column0 on
    const int passes = PASSES == 2 && head_dim > COLUMNS ? 2 : 1;
    const bool vectors = (p.head_dim_v & 3) == 0;
    const long long rows = p.batch * p.seqlen_q * p.heads;
    const long long row_elems = rows * p.head_dim_v;
    const long long lse_split_stride = p.batch * p.heads * p.seqlen_q;
    const int splits = (int)p.num_splits;
    // A row's indices and pointers (32-bit divisions where they fit: a 64-bit one is a long
    // dependent sequence).
    RowIndex at;
    const float* lse_row;
    const T_IN* o_row;
    auto find_row = [&](long long r) {
        if (rows <= 0xffffffffLL) {
            const unsigned int ri = (unsigned int)r, heads = (unsigned int)p.heads, seqlen_q = (unsigned int)p.seqlen_q;
            at = {(long long)(ri / (heads * seqlen_q)), (long long)((ri / heads) % seqlen_q), (long long)(ri % heads)};
        } else {
            at = row_index(p, r);
        }
        lse_row = p.lse_partial + (at.b * p.heads + at.h) * p.seqlen_q + at.row;
        o_row = static_cast<const T_IN*>(p.o_partial) + r * p.head_dim_v + column0;
    };
    // The first row's are worked out while the decode kernel still runs (the empty asm keeps them
    // before the wait): after it they took 0.45 us (globaltimer stamps, H100). With the decode
    // kernel's Q loads issued first: 9.30 -> 9.09 us a call (GQA 8:1 batch 1, 4k keys).
    const long long first_row = blockIdx.x / slices;   // (the launch makes gridDim.x a multiple of slices)
    find_row(first_row);
    asm volatile("" :: "l"(lse_row), "l"(o_row), "l"(at.b), "l"(at.h), "l"(at.row));
    wait_for_predecessor();   // launched early behind the decode kernel (_launch.py)
    allow_dependents();
    for (long long r = first_row; r < rows; r += gridDim.x / slices) {   // uniform over the block
        if (r != first_row) find_row(r);
        float lse_s[COMBINE_BATCH];
        float4 part[COMBINE_BATCH][PASSES];
        auto load_batch = [&](int s0) {   // this warp's splits s0, s0 + warps, ...: lse and O
#pragma unroll
            for (int i = 0; i < COMBINE_BATCH; ++i) {
                const int s = s0 + i * warps;
                lse_s[i] = s < splits ? lse_row[s * lse_split_stride] : FLASH_NEG_INF;
#pragma unroll
                for (int pass = 0; pass < PASSES; ++pass)
                    part[i][pass] = pass < passes ? load_four(o_row + (s < splits ? s : 0) * row_elems, COLUMNS * pass + 4 * lane,
                                                              head_dim, vectors)
                                                  : make_float4(0.f, 0.f, 0.f, 0.f);
            }
        };
        load_batch(warp);
        // The row's max and sum of exp(lse_s - max): online per lane over splits lane, lane + 32, ...,
        // then across the lanes. -inf (no key) adds nothing; a max of -inf means no split saw a key.
        float row_max = lane < splits ? lse_row[lane * lse_split_stride] : FLASH_NEG_INF;
        float total = row_max == FLASH_NEG_INF ? 0.f : 1.f;
        for (int s = lane + 32; s < splits; s += 32) {
            const float x = lse_row[s * lse_split_stride];
            if (x == FLASH_NEG_INF) continue;
            if (x > row_max) {
                total = (row_max == FLASH_NEG_INF ? 0.f : total * expf(row_max - x)) + 1.f;
                row_max = x;
            } else {
                total += expf(x - row_max);
            }
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other_max = __shfl_xor_sync(0xffffffffu, row_max, offset);
            const float other_total = __shfl_xor_sync(0xffffffffu, total, offset);
            const float joined = fmaxf(row_max, other_max);
            if (joined != FLASH_NEG_INF)
                total = (row_max == FLASH_NEG_INF ? 0.f : total * expf(row_max - joined)) +
                        (other_max == FLASH_NEG_INF ? 0.f : other_total * expf(other_max - joined));
            row_max = joined;
        }
        // This warp's share of O (unnormalised: weights exp(lse_s - max) <= 1).
        float4 acc[PASSES];
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) acc[pass] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = warp;;) {
#pragma unroll
            for (int i = 0; i < COMBINE_BATCH; ++i) {
                if (lse_s[i] == FLASH_NEG_INF) continue;
                const float weight = expf(lse_s[i] - row_max);
#pragma unroll
                for (int pass = 0; pass < PASSES; ++pass) {
                    acc[pass].x += weight * part[i][pass].x;
                    acc[pass].y += weight * part[i][pass].y;
                    acc[pass].z += weight * part[i][pass].z;
                    acc[pass].w += weight * part[i][pass].w;
                }
            }
            s0 += COMBINE_BATCH * warps;
            if (s0 >= splits) break;
            load_batch(s0);
        }
#pragma unroll
        for (int pass = 0; pass < PASSES; ++pass) warp_sums[warp][pass][lane] = acc[pass];
        __syncthreads();
        if (warp == 0) {
            float lse = row_max == FLASH_NEG_INF ? FLASH_NEG_INF : row_max + logf(total);
            float shrink = 1.f;   // exp(lse - lse with the sink)
            if (p.sink != nullptr) {
                const float2 joined = join_sink(lse, p.sink[at.h]);
                lse = joined.x;
                shrink = joined.y;
            }
            const float scale = row_max == FLASH_NEG_INF ? 0.f : shrink / total;
            T_OUT* out = static_cast<T_OUT*>(p.o) + tensor_offset(p.o_strides, at.b, at.row, at.h) + column0;
#pragma unroll
            for (int pass = 0; pass < PASSES; ++pass) {
                if (pass >= passes) break;
                float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                for (int w = 0; w < MAX_WARPS; ++w) {
                    if (w >= warps) break;
                    const float4 more = warp_sums[w][pass][lane];
                    sum.x += more.x; sum.y += more.y; sum.z += more.z; sum.w += more.w;
                }
                const float f[4] = {sum.x * scale, sum.y * scale, sum.z * scale, sum.w * scale};
                const int c = COLUMNS * pass + 4 * lane;
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (c + e < head_dim) out[c + e] = from_float<T_OUT>(f[e]);
            }
            if (lane == 0 && slice == 0) p.lse[at.b * p.lse_batch_stride + at.h * p.lse_head_stride + at.row] = lse;
        }
        __syncthreads();   // warp_sums is rewritten by the next row
    }
}
