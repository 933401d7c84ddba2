// Scalar building blocks shared by every kernel variant (the scalar kernel and the tails of the
// SIMD kernels). Everything here has internal linkage and is force-inlined, so each caller is
// compiled for its own instruction set and no out-of-line copy built for one ISA can be picked
// up by code built for another.
//
// Bitwise agreement with the SIMD bodies rests on two facts: every arithmetic step is a single
// correctly rounded IEEE-754 operation (mul, fma, sqrt, div) in the same order as in the SIMD
// code, and the build uses -ffp-contract=off so that the compiler never fuses or splits them.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "host_adam.h"

#define ZO_ALWAYS_INLINE inline __attribute__((always_inline))

namespace zo {
namespace {

ZO_ALWAYS_INLINE uint32_t f32_bits(float f)
{
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

ZO_ALWAYS_INLINE float bits_f32(uint32_t u)
{
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

ZO_ALWAYS_INLINE float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// fp16 -> fp32, exact (normals, subnormals, inf, NaN with payload).
ZO_ALWAYS_INLINE float f16_to_f32(uint16_t h)
{
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) return bits_f32(sign | 0x7f800000u | (mant << 13));  // inf / NaN
    if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0) return bits_f32(sign);  // +-0
    // Subnormal: normalise.
    uint32_t e = 113;  // exponent of 2^-14 in fp32 bias
    while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --e;
    }
    return bits_f32(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

// fp32 -> bf16, round to nearest even. NaN -> quiet NaN keeping sign and top payload bits.
ZO_ALWAYS_INLINE uint16_t f32_to_bf16(float f)
{
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp32 -> fp16, round to nearest even; same results as F16C vcvtps2ph with
// _MM_FROUND_TO_NEAREST_INT (overflow -> inf, gradual underflow, NaN -> quiet NaN with the
// top 9 payload bits).
ZO_ALWAYS_INLINE uint16_t f32_to_f16(float f)
{
    const uint32_t u = f32_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 -> inf
    if (a >= 0x38800000u) {                                               // fp16 normal range
        const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15
        return static_cast<uint16_t>(sign | (r >> 13));
    }
    if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25 rounds to 0 (tie->even)
    // fp16 subnormal: value / 2^-24, rounded to nearest even.
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - (a >> 23);  // 14 .. 24
    uint32_t k = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (k & 1u))) ++k;
    return static_cast<uint16_t>(sign | k);
}

// Correctly rounded fp32 fused multiply-add without an FMA unit (x86-64 baseline code): the
// product of two floats is exact in double, the double sum is made round-to-odd with an exact
// TwoSum error term, and rounding that to float is then correct (53 >= 24 + 2 bits; Boldo &
// Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
// odd", IEEE TC 2008). Bitwise equal to a hardware fmaf for all non-NaN results, and much faster
// than glibc's fmaf, which switches the rounding mode.
ZO_ALWAYS_INLINE float fmaf_emulated(float a, float b, float c)
{
    const double p = static_cast<double>(a) * static_cast<double>(b);  // exact
    const double cd = c;
    const double s = p + cd;
    const double bv = s - p;
    const double err = (p - (s - bv)) + (cd - bv);  // s + err == p + c exactly
    uint64_t u;
    std::memcpy(&u, &s, sizeof u);
    // Inexact and even: step to the odd neighbour on the side of the exact value (branch-free;
    // the condition is data-dependent and would mispredict).
    const uint64_t fix = static_cast<uint64_t>(err != 0.0) & static_cast<uint64_t>(std::isfinite(s)) &
                         (~u & 1u);
    const uint64_t up = static_cast<uint64_t>((err > 0.0) == (s > 0.0));
    u += fix * (2 * up - 1);
    double r;
    std::memcpy(&r, &u, sizeof r);
    return static_cast<float>(r);
}

// kHwFma: the caller's ISA has fused multiply-add instructions (or the platform's fmaf is the
// only option). The x86-64 baseline (no FMA) uses the emulation above.
template <bool kHwFma>
ZO_ALWAYS_INLINE float fma_f32(float a, float b, float c)
{
    if constexpr (kHwFma) {
        return __builtin_fmaf(a, b, c);
    } else {
        return fmaf_emulated(a, b, c);
    }
}

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(__FMA__)
constexpr bool kBaselineHwFma = false;
#else
constexpr bool kBaselineHwFma = true;
#endif

template <int G>
ZO_ALWAYS_INLINE float load_grad_scalar(const void* grad, size_t i)
{
    if constexpr (G == kGradF32) {
        return static_cast<const float*>(grad)[i];
    } else if constexpr (G == kGradBF16) {
        return bf16_to_f32(static_cast<const uint16_t*>(grad)[i]);
    } else {
        return f16_to_f32(static_cast<const uint16_t*>(grad)[i]);
    }
}

template <int O>
ZO_ALWAYS_INLINE void store_out_scalar(void* out, size_t i, float p)
{
    if constexpr (O == kOutBF16) {
        static_cast<uint16_t*>(out)[i] = f32_to_bf16(p);
    } else if constexpr (O == kOutF16) {
        static_cast<uint16_t*>(out)[i] = f32_to_f16(p);
    }
}

// The update of one element; the SIMD bodies perform exactly this sequence per lane.
template <int WD, bool kHwFma>
ZO_ALWAYS_INLINE void adam_scalar(float& p, float& m, float& v, float g, const AdamCoeffs& c)
{
    g = g * c.grad_scale;
    if constexpr (WD == kWdL2) g = fma_f32<kHwFma>(p, c.l2_wd, g);
    m = m * c.beta1;
    m = fma_f32<kHwFma>(g, c.one_minus_beta1, m);
    v = v * c.beta2;
    const float gg = g * g;
    v = fma_f32<kHwFma>(gg, c.one_minus_beta2, v);
    const float denom = fma_f32<kHwFma>(__builtin_sqrtf(v), c.bc2_rsqrt, c.eps);
    const float upd = m / denom;
    if constexpr (WD == kWdDecoupled) p = fma_f32<kHwFma>(p, c.neg_lr_wd, p);
    p = fma_f32<kHwFma>(upd, c.neg_step, p);
}

template <int G, int O, int WD, bool kHwFma>
ZO_ALWAYS_INLINE void adam_scalar_range(const AdamArgs& a, size_t begin, size_t end)
{
    float* __restrict__ master = a.master;
    float* __restrict__ exp_avg = a.exp_avg;
    float* __restrict__ exp_avg_sq = a.exp_avg_sq;
    const AdamCoeffs c = a.c;
    for (size_t i = begin; i < end; ++i) {
        float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
        const float g = load_grad_scalar<G>(a.grad, i);  // read before out[i] is written
        adam_scalar<WD, kHwFma>(p, m, v, g, c);
        master[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        store_out_scalar<O>(a.out, i, p);
    }
}

// Sum of squares (see SumSqFn): the pairwise fold of the kSumSqLanes lane sums.
ZO_ALWAYS_INLINE float sumsq_fold(float* acc)
{
    for (size_t w = kSumSqLanes / 2; w >= 1; w /= 2) {
        for (size_t j = 0; j < w; ++j) acc[j] = acc[j] + acc[j + w];
    }
    return acc[0];
}

// Elements [from, end) of a sum-of-squares range that starts at ``begin``, one at a time into
// their lanes (the scalar variant's whole range, the SIMD variants' tail).
template <int G>
ZO_ALWAYS_INLINE void sumsq_scalar_lanes(const void* x, size_t begin, size_t from, size_t end,
                                         float* acc)
{
    for (size_t i = from; i < end; ++i) {
        const float v = load_grad_scalar<G>(x, i);
        const float sq = v * v;
        acc[(i - begin) % kSumSqLanes] += sq;
    }
}

}  // namespace
}  // namespace zo
