// Decoding's shared pieces (decode.cu's kernels and decode_sm90.cu's): where a key's cache row
// lies, how many keys a sequence has, and a block's key range and rows.

#pragma once
#include "common.cuh"
#include "tensor_core.cuh"

// Row (in elements) of key `key` of batch entry b, K/V head kv_head in a cache with these strides:
// paged ({page, row, head} strides, the page from block_table) or contiguous ({batch, row, head}).
__device__ __forceinline__ long long cache_offset(const FlashParams& p, const long long* strides, long long b, int key,
                                                  long long kv_head) {
    if (p.block_table != nullptr) {
        const long long page = p.block_table[b * p.block_table_stride + (key >> p.page_shift)];
        return page * strides[0] + (long long)(key & ((1 << p.page_shift) - 1)) * strides[1] + kv_head * strides[2];
    }
    return b * strides[0] + (long long)key * strides[1] + kv_head * strides[2];
}

// Keys in sequence b's cache once the new rows are in (never past the cache's capacity: the append
// drops rows that do not fit, and the caller is told to leave room). Without cache_seqlens (the
// split-KV path of flash_forward) every sequence has p.seqlen_k keys.
// A negative length (never valid; it cannot be checked on the host without a sync) reads as 0.
// Read through L2 (ld.cg): the prefetch reads it before the kernel ahead has finished, and a line
// it left in L1 must not serve the read after the wait.
__device__ __forceinline__ int decode_seqlen_k(const FlashParams& p, long long b) {
    if (p.cache_seqlens == nullptr) return (int)p.seqlen_k;
    return (int)max(0LL, min((long long)__ldcg(p.cache_seqlens + b) + p.seqlen_new, p.cache_capacity));
}

// FEATURE_CACHE_INDEX (FlashAttention-2's cache_batch_idx, cache_leftpad): sequence b's cache is
// row cache_batch_idx[b] of the cache (b without it), and its keys start at row cache_leftpad[b]
// (0 without it): keys before it are not seen, and positions (the masks' diagonal, ALiBi) stay
// the cache's rows, as FlashAttention-2 counts them. An index outside the cache's p.cache_batch
// rows reads as -1: the sequence sees no key and its new rows are not written.
template <bool CACHE_INDEX>
__device__ __forceinline__ long long cache_row_of(const FlashParams& p, long long b) {
    if (!CACHE_INDEX || p.cache_batch_idx == nullptr) return b;
    const long long row = p.cache_batch_idx[b];
    return row >= 0 && row < p.cache_batch ? row : -1;
}
template <bool CACHE_INDEX>
__device__ __forceinline__ int cache_first_key(const FlashParams& p, long long b) {
    return CACHE_INDEX && p.cache_leftpad != nullptr ? max(0, p.cache_leftpad[b]) : 0;
}

// Keys [key_begin, key_end) a decode block may see: its split's range, cut to the band of its first
// and last tokens (and to sequence b's first key: FEATURE_CACHE_INDEX).
template <bool IS_CAUSAL, int FEATURES>
__device__ __forceinline__ void block_key_range(const FlashParams& p, const Band& band, int seqlen_k, int split, int row0,
                                                int row_count, long long group, long long b, int& key_begin, int& key_end) {
    const int token_first = (int)(row0 / group), token_last = (int)((row0 + row_count - 1) / group);
    key_begin = (int)min((long long)split * p.keys_per_split, (long long)seqlen_k);
    key_end = (int)min((long long)(split + 1) * p.keys_per_split, (long long)seqlen_k);
    if (IS_CAUSAL)
        key_end = (int)max((long long)key_begin, min((long long)key_end, (long long)token_last + band.right + 1));
    if (FEATURES & FEATURE_WINDOW)
        key_begin = (int)min((long long)key_end, max((long long)key_begin, (long long)token_first + band.left));
    if (FEATURES & FEATURE_CACHE_INDEX) key_begin = min(key_end, max(key_begin, cache_first_key<true>(p, b)));
}

// Rows g and g + 8 of this thread: token and head (and the ALiBi slope of that head).
template <int FEATURES>
__device__ __forceinline__ void thread_rows(const FlashParams& p, long long b, long long kv_head, long long group, int row0,
                                            int g, int rows_per_kv_head, int (&row_token)[2], long long (&row_head)[2],
                                            float (&row_slope)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = min(row0 + g + 8 * r, rows_per_kv_head - 1);   // padding rows repeat the last
        row_token[r] = (int)(row / group);
        row_head[r] = kv_head * group + row % group;
        row_slope[r] = (FEATURES & FEATURE_ALIBI) ? p.alibi_slopes[b * p.alibi_batch_stride + row_head[r]] : 0.f;
    }
}

// An MLA block's place in the grid (flash_mla_decode_kernel's and flash_mla_decode_sm90_kernel's,
// ROWS rows a block): blockIdx.x = split + num_splits * (row block + row_blocks * (kv_head +
// heads_kv * b)); its first row and how many of its rows are real.
struct MlaBlock {
    long long group, heads_kv, b, kv_head;
    int rows_per_kv_head, split, row0, row_count;
};
template <int ROWS>
__device__ __forceinline__ MlaBlock mla_block(const FlashParams& p) {
    MlaBlock block;
    block.group = p.group;
    block.heads_kv = p.heads / p.group;
    block.rows_per_kv_head = (int)(block.group * p.seqlen_q);
    const int row_blocks = (block.rows_per_kv_head + ROWS - 1) / ROWS;
    block.split = (int)(blockIdx.x % p.num_splits);
    const long long rest = blockIdx.x / p.num_splits;
    block.row0 = (int)(rest % row_blocks) * ROWS;
    block.b = rest / row_blocks / block.heads_kv;
    block.kv_head = rest / row_blocks % block.heads_kv;
    block.row_count = min(ROWS, block.rows_per_kv_head - block.row0);
    return block;
}

// The keys an MLA block sees: its split's, cut to its rows' causal band (block_key_range), and the
// band itself (for the mask). After wait_for_predecessor: the append ahead writes cache_seqlens.
struct MlaKeys {
    Band band;
    int key_begin, key_end;
};
template <bool IS_CAUSAL>
__device__ __forceinline__ MlaKeys mla_keys(const FlashParams& p, const MlaBlock& block) {
    const int seqlen_k = decode_seqlen_k(p, block.b);
    Sequence seq = {(int)p.seqlen_q, seqlen_k, 0, 0};
    MlaKeys keys;
    keys.band = band_of(p, seq);
    block_key_range<IS_CAUSAL, 0>(p, keys.band, seqlen_k, block.split, block.row0, block.row_count, block.group, block.b,
                                  keys.key_begin, keys.key_end);
    return keys;
}

// A decode row's outputs (token, head of sequence b): its lse, and O's columns c, c + 1 (x, y
// already normalised), into the split's float32 partials where the keys are split, else the
// final lse and o.
__device__ __forceinline__ void store_row_lse(const FlashParams& p, int split, long long b, long long head, long long token,
                                              float lse) {
    if (p.num_splits > 1)
        p.lse_partial[(((long long)split * p.batch + b) * p.heads + head) * p.seqlen_q + token] = lse;
    else
        p.lse[b * p.lse_batch_stride + head * p.lse_head_stride + token] = lse;
}
template <typename T>
__device__ __forceinline__ void store_row_pair(const FlashParams& p, int split, long long b, long long token, long long head,
                                               int head_dim_v, int c, float x, float y) {
    if (p.num_splits > 1) {
        float* dst = static_cast<float*>(p.o_partial) +
                     ((((long long)split * p.batch + b) * p.seqlen_q + token) * p.heads + head) * head_dim_v + c;
        *reinterpret_cast<float2*>(dst) = make_float2(x, y);
    } else {
        T* dst = static_cast<T*>(p.o) + tensor_offset(p.o_strides, b, token, head) + c;
        *reinterpret_cast<unsigned int*>(dst) = Mma<T>::pack(x, y);
    }
}

// The products' type of a decode block: T, but fp16 for bf16 calls on an FP8 cache, whose tiles then
// convert in one instruction a pair (through float32 to bf16 they took four, and the conversion is
// the FP8 path's serial work: docs/decisions.md, Decoding); Q's rows are scaled into fp16's
// range first (scale_q_rows_to_f16).
template <typename T, bool FP8_CACHE> struct DecodeProducts { using type = T; static constexpr bool q_to_f16 = false; };
template <> struct DecodeProducts<fa_bf16, true> { using type = fa_f16; static constexpr bool q_to_f16 = true; };
// (An FP8 cache's products are fp16 for either dtype: the converted stage is fa_f16.)

// 2^n, exactly, for |n| <= 126.
__device__ __forceinline__ float power_of_two(int n) { return __uint_as_float((unsigned)(127 + n) << 23); }

// A bf16 Q row into fp16's range (an FP8 cache's products, DecodeProducts): x * 2^first * 2^second
// puts the row's largest magnitude at [2^14, 2^15), exactly but below 2^-10 of it, where fp16 turns
// subnormal (the shift, -113 .. 141, as two powers of two); unscale() = 2^-shift, which the scores
// take back (a subnormal is exact).
struct F16RowScale {
    int first, second;
    __device__ __forceinline__ float unscale() const { return power_of_two(-first) * power_of_two(-second); }
};
__device__ __forceinline__ F16RowScale f16_row_scale(float largest) {
    const int exponent = largest > 0.f ? (int)((__float_as_uint(largest) >> 23) & 0xffu) - 127 : 14;
    const int shift = 14 - exponent;
    return {shift / 2, shift - shift / 2};
}
