// Backward preprocessing: delta = rowsum(dO * O) in float32, one value per (batch, head, query row).
// dS = P * (dP - delta) needs it for every key block, so it is computed once here rather than
// re-derived inside the backward loop. When the atomic dQ path is used (p.dq_accum != null), the
// same pass zeroes the float32 dQ accumulator row, saving a separate memset over the same rows.
//
// One warp per (batch, row, head), visited in memory order of O so consecutive warps read
// consecutive rows; each lane reads 16-byte vectors of dO and O.

template <typename T>
__global__ void __launch_bounds__(256) flash_preprocess_kernel(const FlashParams p) {
    constexpr int VEC = Vec<T>::N;
    const int lane = threadIdx.x & 31;
    for (long long r = first_row_of_warp(); r < p.batch * p.seqlen_q * p.heads; r += rows_per_grid()) {
        const auto [b, row, h] = row_index(p, r);
        const T* o = static_cast<const T*>(p.o) + tensor_offset(p.o_strides, b, row, h);
        const T* dout = static_cast<const T*>(p.dout) + tensor_offset(p.dout_strides, b, row, h);
        float dot = 0.f;
        for (int c = lane * VEC; c < p.head_dim; c += 32 * VEC) {
            float ov[VEC], dov[VEC];
            unpack(*reinterpret_cast<const uint4*>(o + c), ov, T{});
            unpack(*reinterpret_cast<const uint4*>(dout + c), dov, T{});
#pragma unroll
            for (int e = 0; e < VEC; ++e) dot = fmaf(ov[e], dov[e], dot);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        if (lane == 0) p.delta[(b * p.heads + h) * p.seqlen_q + row] = dot;
        if (p.dq_accum != nullptr) {
            float* acc = p.dq_accum + tensor_offset(p.dq_accum_strides, b, row, h);
            for (int c = lane * 4; c < p.head_dim; c += 32 * 4) {
                *reinterpret_cast<float4*>(acc + c) = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    }
}
