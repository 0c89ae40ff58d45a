// Row kernels of the backward, one module per dtype for both the CUDA-core and tensor-core paths.
//
// Preprocessing: delta = rowsum(dO * O) in float32, one value per (batch, head, query row).
// dS = P * (dP - delta) needs it for every key block, so it is computed once here rather than
// re-derived inside the backward loop. When dQ is accumulated in float32 (p.dq_accum != null), the
// same pass zeroes the accumulator row, saving a separate memset over the same rows. For the
// tensor-core backward (p.lse_log2 != null) it also writes lse * log2(e) (+inf where lse = -inf,
// so P = exp2(s * scale_log2 - lse_log2) is 0 on rows that see no key), and it writes the padded
// rows [a sequence's length, delta_stride) of delta (0) and lse_log2 (+inf) itself.
//
// Rows (batch, row, head) are visited in memory order of O, several to a warp (row_group below), so
// consecutive lanes and warps read consecutive rows; each lane reads 16-byte vectors of dO and O.

#include "common.cuh"
#include "fp8_values.cuh"

// A warp's rows: head_dim's 16-byte vectors spread over a power-of-two group of lanes (at most 32),
// so a warp takes 32 / lanes rows at once and every lane loads (16-bit, d = 128: 16 lanes a row; one
// row a warp left half the lanes idle, 0.76x the copy rate), and ROW_SETS such sets per pass, their
// loads issued before any reduction.
constexpr int ROW_SETS = 2;
struct RowGroup {
    int lanes, rows, sub, sublane;   // lanes a row, rows a set, this lane's row in the set and place in it
    // The warp's passes over the rows (ROW_SETS sets each): where its first starts, the step between
    // them, and this lane's row of set `set` in the pass starting at `first`.
    __device__ __forceinline__ long long first_pass() const { return first_row_of_warp() * rows * ROW_SETS; }
    __device__ __forceinline__ long long pass_step() const { return rows_per_grid() * rows * ROW_SETS; }
    __device__ __forceinline__ long long row(long long first, int set) const { return first + set * rows + sub; }
};
__device__ __forceinline__ RowGroup row_group(int head_dim, int vec) {
    const int vectors = (head_dim + vec - 1) / vec;
    int lanes = 1;
    while (lanes < vectors && lanes < 32) lanes *= 2;
    const int lane = threadIdx.x & 31;
    return {lanes, 32 / lanes, lane / lanes, lane % lanes};
}
__device__ __forceinline__ float group_sum(float x, int lanes) {
    for (int offset = lanes / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// A packed batch's sequence holding row `row`: the last s < sequences with cu_seqlens[s] <= row.
__device__ __forceinline__ int sequence_of_row(const int* cu_seqlens, int sequences, long long row) {
    int lo = 0, hi = sequences;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (cu_seqlens[mid] <= row) lo = mid; else hi = mid;
    }
    return lo;
}

template <typename T>
__global__ void __launch_bounds__(ROW_KERNEL_THREADS) flash_preprocess_kernel(const FlashParams p) {
    constexpr int VEC = Vec<T>::N;
    // A row's lanes cover the wider of o's (head_dim_v: the dot product) and dq_accum's (head_dim).
    const RowGroup g = row_group((int)max(p.head_dim, p.head_dim_v), VEC);
    const long long rows = p.batch * p.seqlen_q * p.heads;
    for (long long first = g.first_pass(); first < rows; first += g.pass_step()) {
        float dot[ROW_SETS];
#pragma unroll
        for (int set = 0; set < ROW_SETS; ++set) {
            const long long r = g.row(first, set);
            dot[set] = 0.f;
            if (r >= rows) continue;
            const auto [b, row, h] = row_index(p, r);
            const T* o = static_cast<const T*>(p.o) + tensor_offset(p.o_strides, b, row, h);
            const T* dout = static_cast<const T*>(p.dout) + tensor_offset(p.dout_strides, b, row, h);
            for (int c = g.sublane * VEC; c < p.head_dim_v; c += g.lanes * VEC) {
                float ov[VEC], dov[VEC];
                unpack(*reinterpret_cast<const uint4*>(o + c), ov, T{});
                unpack(*reinterpret_cast<const uint4*>(dout + c), dov, T{});
#pragma unroll
                for (int e = 0; e < VEC; ++e) dot[set] = fmaf(ov[e], dov[e], dot[set]);
            }
        }
#pragma unroll
        for (int set = 0; set < ROW_SETS; ++set) {
            const long long r = g.row(first, set);
            const float dot_sum = group_sum(dot[set], g.lanes);   // every lane: the warp's shuffles
            if (r >= rows) continue;
            const auto [b, row, h] = row_index(p, r);
            if (g.sublane == 0) {
                // Packed batch (launched as one sequence of all rows): delta and lse_log2 go to the
                // (batch, heads, delta_stride) layout of the attention kernels, row r of sequence s at
                // (s, h, r - cu_seqlens_q[s]); the sequence comes from a binary search.
                long long stats = b * p.delta_batch_stride + h * p.delta_stride + row;
                if (p.cu_seqlens_q != nullptr) {
                    const int s = sequence_of_row(p.cu_seqlens_q, (int)p.packed_sequences, row);
                    stats = (s * p.heads + h) * p.delta_stride + (row - p.cu_seqlens_q[s]);
                }
                p.delta[stats] = dot_sum;
                if (p.lse_log2 != nullptr) {
                    const float lse = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + row];
                    p.lse_log2[stats] = lse == FLASH_NEG_INF ? -FLASH_NEG_INF : lse * FLASH_LOG2E;
                }
            }
            if (p.dq_accum != nullptr) {
                float* acc = p.dq_accum + tensor_offset(p.dq_accum_strides, b, row, h);
                for (int c = g.sublane * 4; c < p.head_dim; c += g.lanes * 4)
                    *reinterpret_cast<float4*>(acc + c) = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    }
    // The padded rows of the (sequences, heads, delta_stride) statistics: delta 0 and lse_log2 +inf,
    // so P = 0 and dS = 0 on the rows past a sequence that the attention kernels' query blocks
    // read. Written here rather than by two fills before this launch: each was an operation of its
    // own per call, visible at 512 keys. A thread an entry; the grid covers the real rows' warps,
    // so this is at most a few entries a thread.
    const bool packed = p.cu_seqlens_q != nullptr;
    const long long entries = (packed ? p.packed_sequences : p.batch) * p.heads * p.delta_stride;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < entries;
         e += (long long)gridDim.x * blockDim.x) {
        const long long row = e % p.delta_stride, sequence = e / (p.heads * p.delta_stride);
        const long long length = packed ? p.cu_seqlens_q[sequence + 1] - p.cu_seqlens_q[sequence] : p.seqlen_q;
        if (row < length) continue;
        p.delta[e] = 0.f;
        if (p.lse_log2 != nullptr) p.lse_log2[e] = -FLASH_NEG_INF;
    }
}

// dQ = softmax_scale * dq_accum, cast to T; rows spread over the warp as in the preprocess.
template <typename T>
__global__ void __launch_bounds__(ROW_KERNEL_THREADS) flash_dq_convert_kernel(const FlashParams p) {
    constexpr int VEC = Vec<T>::N;
    const RowGroup g = row_group((int)p.head_dim, VEC);
    const long long rows = p.batch * p.seqlen_q * p.heads;
    for (long long first = g.first_pass(); first < rows; first += g.pass_step()) {
#pragma unroll
        for (int set = 0; set < ROW_SETS; ++set) {
            const long long r = g.row(first, set);
            if (r >= rows) continue;
            const auto [b, row, h] = row_index(p, r);
            const float* acc = p.dq_accum + tensor_offset(p.dq_accum_strides, b, row, h);
            T* dq = static_cast<T*>(p.dq) + tensor_offset(p.dq_strides, b, row, h);
            for (int c = g.sublane * VEC; c < p.head_dim; c += g.lanes * VEC) {
                float vals[VEC];
#pragma unroll
                for (int e = 0; e < VEC; e += 4) {
                    const float4 a = *reinterpret_cast<const float4*>(acc + c + e);
                    vals[e] = a.x * p.softmax_scale; vals[e + 1] = a.y * p.softmax_scale;
                    vals[e + 2] = a.z * p.softmax_scale; vals[e + 3] = a.w * p.softmax_scale;
                }
                *reinterpret_cast<uint4*>(dq + c) = pack(vals, T{});
            }
        }
    }
}

// One output row of the group sum: `head_dim` columns of `out` from the group's rows at `heads`.
template <typename T>
__device__ __forceinline__ void sum_group_row(T* out, const float* heads, int group, int head_dim, int lane) {
    constexpr int VEC = Vec<T>::N;   // T elements per 16-byte store; VEC / 4 float4 loads each
    static_assert(VEC % 4 == 0, "whole float4 loads");
    for (int c = lane * VEC; c < head_dim; c += 32 * VEC) {
        float sum[VEC] = {};
        for (int g = 0; g < group; ++g) {
#pragma unroll
            for (int e = 0; e < VEC; e += 4) {
                const float4 x = *reinterpret_cast<const float4*>(heads + (long long)g * head_dim + c + e);
                sum[e] += x.x; sum[e + 1] += x.y; sum[e + 2] += x.z; sum[e + 3] += x.w;
            }
        }
        *reinterpret_cast<uint4*>(out + c) = pack(sum, T{});
    }
}

// GQA/MQA: dK and dV of each K/V head = the sum over its group of query heads. The backward
// kernels write per-query-head float32 dK and dV into contiguous (batch, seqlen_k, heads, head_dim)
// and (..., head_dim_v) buffers (p.dk_expanded, p.dv_expanded); this sums each group of p.group
// adjacent heads in float32 and rounds once into p.dk and p.dv (batch, seqlen_k, heads / group,
// head_dim or head_dim_v). One warp per output row.
template <typename T>
__global__ void __launch_bounds__(ROW_KERNEL_THREADS) flash_kv_group_sum_kernel(const FlashParams p) {
    const int lane = threadIdx.x & 31;
    const long long heads_kv = p.heads / p.group;
    const float* dk_heads = static_cast<const float*>(p.dk_expanded);
    const float* dv_heads = static_cast<const float*>(p.dv_expanded);
    for (long long r = first_row_of_warp(); r < p.batch * p.seqlen_k * heads_kv; r += rows_per_grid()) {
        const long long b = r / (p.seqlen_k * heads_kv), row = (r / heads_kv) % p.seqlen_k, h = r % heads_kv;
        // (b, row, h * group) in the expanded buffers
        sum_group_row(static_cast<T*>(p.dk) + tensor_offset(p.dk_strides, b, row, h), dk_heads + r * p.group * p.head_dim,
                      (int)p.group, (int)p.head_dim, lane);
        sum_group_row(static_cast<T*>(p.dv) + tensor_offset(p.dv_strides, b, row, h), dv_heads + r * p.group * p.head_dim_v,
                      (int)p.group, (int)p.head_dim_v, lane);
    }
}

// FP8 inputs of the backward (docs/fp8.md, "The backward"): x, e4m3 bits strided as (batch, row,
// head, head_dim), times its (batch or packed sequence, head) descale, rounded to T into a
// contiguous array of x's shape. The backward's products then run in T on these values. A thread a
// 16-byte vector: 16 e4m3 elements in, 16 T out. descale is (descale rows, descale_heads); a query
// head h reads column h / (heads / descale_heads) (descales per K/V head's group). Packed batches
// (cu_seqlens != null; batch 1, rows the total): a row's sequence comes from a binary search.
// Vector i (16 elements) of a (batch, rows, heads, head_dim) array in memory order: where it is.
struct Fp8Vector {
    long long b, row, column;
    int h;
};
__device__ __forceinline__ Fp8Vector fp8_vector(long long i, int vectors, int heads, int rows) {
    const long long r = i / vectors;
    return {r / heads / rows, r / heads % rows, i % vectors * 16, (int)(r % heads)};
}

template <typename T>
__global__ void __launch_bounds__(ROW_KERNEL_THREADS) fp8_dequantize_kernel(
        const unsigned char* x, long long batch_stride, long long row_stride, long long head_stride, int batch,
        int rows, int heads, int head_dim, const float* descale, int descale_heads, const int* cu_seqlens,
        int sequences, T* out) {
    constexpr int VEC = Vec<T>::N;
    const int vectors = head_dim / 16;
    const long long total = (long long)batch * rows * heads * vectors;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const auto [b, row, column, h] = fp8_vector(i, vectors, heads, rows);
        const long long scale_row = cu_seqlens != nullptr ? sequence_of_row(cu_seqlens, sequences, row) : b;
        const float scale = descale[scale_row * descale_heads + h / (heads / descale_heads)];
        const uint4 raw = *reinterpret_cast<const uint4*>(x + b * batch_stride + row * row_stride + h * head_stride + column);
        const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
        float values[16];
#pragma unroll
        for (int e = 0; e < 16; ++e) values[e] = e4m3_value((words[e / 4] >> (8 * (e % 4))) & 0xffu) * scale;
        T* o = out + i * 16;   // contiguous: ((b * rows + row) * heads + h) * head_dim + column
#pragma unroll
        for (int part = 0; part < 16; part += VEC) *reinterpret_cast<uint4*>(o + part) = pack(values + part, T{});
    }
}

// quantize_fp8's GPU path (cupy_flash/fp8.py: e4m3, a descale per (batch, head), no rotation),
// computed as its array arithmetic is, so the bits agree: amax = max |x| over the group (exact),
// descale = float32(amax / 448) (1 for an all-zero group), and each element the e4m3 of
// x / descale as NumPy's float64 quotient rounds (e4m3_bits_of_quotient).
// amax (batch x heads unsigned, zeroed first) as the bits of non-negative floats, which order as
// unsigned integers do: grid (batch x heads, row blocks of FP8_AMAX_ROWS, _traits).
template <typename T>
__global__ void __launch_bounds__(ROW_KERNEL_THREADS) fp8_group_amax_kernel(
        const T* x, long long batch_stride, long long row_stride, long long head_stride, int rows, int heads,
        int head_dim, unsigned* amax) {
    constexpr int VEC = Vec<T>::N;
    const int group = blockIdx.x, b = group / heads, h = group % heads;
    const int first = blockIdx.y * FP8_AMAX_ROWS, count = min(FP8_AMAX_ROWS, rows - first);
    const int vectors = head_dim / VEC;
    const T* base = x + b * batch_stride + h * head_stride;
    float largest = 0.f;
    bool nan = false;   // fmaxf drops NaN: a NaN element makes the group's amax NaN (above every other's bits)
    for (int i = threadIdx.x; i < count * vectors; i += blockDim.x) {
        float values[VEC];
        unpack(*reinterpret_cast<const uint4*>(base + (first + i / vectors) * row_stride + i % vectors * VEC), values, T{});
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            largest = fmaxf(largest, fabsf(values[e]));
            nan |= values[e] != values[e];
        }
    }
    unsigned bits = nan ? 0x7fc00000u : __float_as_uint(largest);
    for (int offset = 16; offset > 0; offset >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
    if ((threadIdx.x & 31) == 0) atomicMax(amax + group, bits);
}

// bits (contiguous like x) and descale (batch x heads float32) from amax: a thread per 16 elements.
template <typename T>
__global__ void __launch_bounds__(ROW_KERNEL_THREADS) fp8_quantize_kernel(
        const T* x, long long batch_stride, long long row_stride, long long head_stride, int batch, int rows, int heads,
        int head_dim, const unsigned* amax, unsigned char* bits, float* descale) {
    constexpr int VEC = Vec<T>::N;
    const int vectors = head_dim / 16;
    const long long total = (long long)batch * rows * heads * vectors;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        const auto [b, row, column, h] = fp8_vector(i, vectors, heads, rows);
        const float largest = __uint_as_float(amax[b * heads + h]);
        const float scale = largest > 0.f ? (float)((double)largest / 448.0) : 1.f;
        if (i < (long long)batch * heads) {
            const float own = __uint_as_float(amax[i]);
            descale[i] = own > 0.f ? (float)((double)own / 448.0) : (own == 0.f ? 1.f : own);   // NaN stays
        }
        const T* source = x + b * batch_stride + row * row_stride + h * head_stride + column;
        float values[16];
#pragma unroll
        for (int part = 0; part < 16; part += VEC) unpack(*reinterpret_cast<const uint4*>(source + part), values + part, T{});
        unsigned words[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < 16; ++e) words[e / 4] |= e4m3_bits_of_quotient(values[e], scale) << (8 * (e % 4));
        *reinterpret_cast<uint4*>(bits + i * 16) = make_uint4(words[0], words[1], words[2], words[3]);
    }
}

// Ring attention's running output (cupy_flash/distributed.py), in one pass where separate array
// operations took six: rows [row0, row0 + n) of a rank's float32 (o_acc, lse_acc) joined with a
// block's partial (o, lse) over other keys, as two softmaxes over disjoint keys join: lse =
// log(e^lse_acc + e^lse) and o their weighted mean. A side with lse = -inf (no key) weighs 0; a row
// neither side saw stays (o_acc, -inf). o_acc (batch, local, heads, head_dim_v) and lse_acc (batch,
// heads, local), o (batch, n, heads, head_dim_v) and lse (batch, heads, n): contiguous. A warp a
// (batch, row, head), its lanes over the columns.
template <typename T>
__global__ void __launch_bounds__(ROW_KERNEL_THREADS) ring_merge_kernel(
        float* o_acc, float* lse_acc, const T* o, const float* lse, int batch, int local, int row0, int n, int heads,
        int head_dim_v) {
    const int lane = threadIdx.x & 31;
    const long long rows = (long long)batch * n * heads;
    for (long long r = first_row_of_warp(); r < rows; r += rows_per_grid()) {
        const long long b = r / ((long long)n * heads), t = r / heads % n, h = r % heads;
        float* acc_lse = lse_acc + (b * heads + h) * local + row0 + t;
        const float old = *acc_lse, part = lse[(b * heads + h) * n + t];
        const float top = fmaxf(old, part);
        if (top == FLASH_NEG_INF) continue;
        const float w_old = expf(old - top), w_new = expf(part - top), inv_total = 1.f / (w_old + w_new);
        float* acc_row = o_acc + ((b * local + row0 + t) * heads + h) * head_dim_v;
        const T* row = o + r * head_dim_v;
        for (int c = lane; c < head_dim_v; c += 32)
            acc_row[c] = (acc_row[c] * w_old + to_float(row[c]) * w_new) * inv_total;
        __syncwarp();
        if (lane == 0) *acc_lse = top + logf(w_old + w_new);
    }
}

// acc[:, row0:row0 + n] += x in float32: acc (batch, acc_rows, inner) float32 and x (batch, n, inner),
// contiguous (the ring's dQ rows and its travelling dK / dV accumulators). A warp a (batch, row).
template <typename T>
__global__ void __launch_bounds__(ROW_KERNEL_THREADS) ring_accumulate_kernel(
        float* acc, const T* x, int batch, int acc_rows, int row0, int n, int inner) {
    const int lane = threadIdx.x & 31;
    const long long rows = (long long)batch * n;
    for (long long r = first_row_of_warp(); r < rows; r += rows_per_grid()) {
        float* acc_row = acc + ((r / n) * acc_rows + row0 + r % n) * inner;
        const T* row = x + r * inner;
        for (int c = lane; c < inner; c += 32) acc_row[c] += to_float(row[c]);
    }
}
