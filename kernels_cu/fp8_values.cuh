// FP8 e4m3 values and bits outside the tensor cores: the FP8 backward's dequantise and quantize_fp8's
// kernels (preprocess.cu), and flash_decode's FP8 K/V cache (decode.cu).
#pragma once

#include "common.cuh"

// The float value of e4m3 bits (0x7f / 0xff: NaN).
__device__ __forceinline__ float e4m3_value(unsigned bits) {
    const unsigned exponent = (bits >> 3) & 15u, mantissa = bits & 7u;
    float magnitude = exponent != 0u ? __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20))   // 2^(e-7) (1 + m/8)
                                     : (float)mantissa * 0.001953125f;                                  // m 2^-9
    if ((bits & 0x7fu) == 0x7fu) magnitude = __uint_as_float(0x7fc00000u);                               // e4m3's NaN
    return (bits & 0x80u) ? -magnitude : magnitude;
}

// e4m3 of x / scale as NumPy's float64 quotient rounds (to nearest even, saturated, sign kept),
// in float32: q = x / scale rounded once, then q's e4m3 rounding, n = |q| / quantum (exact) and
// its nearest integer. Only where n lands on a half can q's rounding have moved the quotient onto
// a tie: there the exact residual x - q scale (fmaf; a correctly rounded quotient's residual is a
// float) says which side the exact quotient lies on, and only a true tie goes to even.
__device__ __forceinline__ unsigned e4m3_bits_of_quotient(float x, float scale) {
    const float q = x / scale;
    const unsigned sign = (__float_as_uint(q) >> 24) & 0x80u;
    const float a = fabsf(q);
    if (!(a < 448.f)) return sign | 0x7eu;   // saturated (the largest finite value)
    const int binade = max((int)(__float_as_uint(a) >> 23) - 127, -6);   // -6: the subnormals' quantum too
    const float n = a * __uint_as_float((unsigned)(127 + 3 - binade) << 23);   // a / 2^(binade - 3), exact
    float r = rintf(n);
    if (n - floorf(n) == 0.5f) {
        const float residual = fmaf(-q, scale, x);
        const float beyond = x >= 0.f ? residual : -residual;   // > 0: |x / scale| exceeds |q|
        if (beyond != 0.f) r = beyond > 0.f ? floorf(n) + 1.f : floorf(n);
    }
    return sign | (unsigned)((binade + 6) * 8 + (int)r);   // subnormal (binade -6, r < 8) and normal alike
}

// Two e4m3 values (bytes 0 and 1 of `pair`) as an fp16 pair, exactly: every finite e4m3 value is an
// fp16 (an FP8 cache's tiles convert to fp16 for bf16 calls too: decode.cu, DecodeProducts).
// sm_89+ converts in one instruction; before, e4m3's bits placed in fp16's (sign kept, exponent
// and mantissa one place right: 2^-8 of the value, subnormals included) are scaled by 2^8 (e4m3's
// NaN then reads as 480; quantisation never writes it).
__device__ __forceinline__ unsigned int e4m3x2_to_f16x2(unsigned int pair) {
    unsigned int out;
#if __CUDA_ARCH__ >= 890
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"((unsigned short)(pair & 0xffffu)));
#else
    const unsigned int spread = __byte_perm(pair, 0u, 0x1404);   // bytes {0, b0, 0, b1}
    const unsigned int scaled = (spread & 0x80008000u) | ((spread >> 1) & 0x3f803f80u);
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(scaled), "r"(0x5c005c00u));   // x 256 (exact)
#endif
    return out;
}
