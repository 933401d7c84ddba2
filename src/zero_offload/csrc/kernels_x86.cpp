// AVX2+FMA+F16C and AVX-512 variants of the host Adam update. Built for baseline x86-64: the
// ISA is enabled per function with target attributes, and host_adam.cpp only calls into a
// variant after checking the CPU at run time, so the module imports on any x86-64 CPU.
#include "host_adam.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

// GCC 12 reports a false -Wmaybe-uninitialized inside its own avx512fintrin.h (the deliberate
// `__m512 __Y = __Y;` of _mm512_undefined_ps) when intrinsics are used via target attributes.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "scalar_math.h"

namespace zo {
namespace {

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: 8 fp32 lanes.
// ---------------------------------------------------------------------------------------------
namespace avx2 {
#define ZO_TARGET __attribute__((target("avx2,fma,f16c")))

struct Ops {
    using V = __m256;
    static constexpr size_t W = 8;

    ZO_TARGET ZO_ALWAYS_INLINE static V set1(float x) { return _mm256_set1_ps(x); }
    ZO_TARGET ZO_ALWAYS_INLINE static V load(const float* p) { return _mm256_loadu_ps(p); }
    ZO_TARGET ZO_ALWAYS_INLINE static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
    ZO_TARGET ZO_ALWAYS_INLINE static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    ZO_TARGET ZO_ALWAYS_INLINE static V add(V a, V b) { return _mm256_add_ps(a, b); }
    ZO_TARGET ZO_ALWAYS_INLINE static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    ZO_TARGET ZO_ALWAYS_INLINE static V sqrt(V a) { return _mm256_sqrt_ps(a); }
    ZO_TARGET ZO_ALWAYS_INLINE static V div(V a, V b) { return _mm256_div_ps(a, b); }

    template <int G>
    ZO_TARGET ZO_ALWAYS_INLINE static V load_grad(const void* grad, size_t i)
    {
        if constexpr (G == kGradF32) {
            return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
        } else {
            const __m128i h =
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
            if constexpr (G == kGradBF16) {
                return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            } else {
                return _mm256_cvtph_ps(h);
            }
        }
    }

    template <int O, bool NT>
    ZO_TARGET ZO_ALWAYS_INLINE static void store_out(void* out, size_t i, V p)
    {
        auto* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
        if constexpr (O == kOutBF16) {
            const __m256i u = _mm256_castps_si256(p);
            const __m256i hi = _mm256_srli_epi32(u, 16);
            const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
            __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
            r = _mm256_srli_epi32(r, 16);
            const __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
            const __m256i nan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7f800000));
            const __m256i qnan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
            r = _mm256_blendv_epi8(r, qnan, nan);
            const __m128i packed =
                _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            store16<NT>(dst, packed);
        } else if constexpr (O == kOutF16) {
            store16<NT>(dst, _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }

    template <bool NT>
    ZO_TARGET ZO_ALWAYS_INLINE static void store16(__m128i* dst, __m128i x)
    {
        if constexpr (NT) {
            _mm_stream_si128(dst, x);  // dst is 16-byte aligned (checked by the caller)
        } else {
            _mm_storeu_si128(dst, x);
        }
    }
    ZO_TARGET ZO_ALWAYS_INLINE static void stream_fence() { _mm_sfence(); }
};

#include "adam_body.inc"
#include "sumsq_body.inc"

#undef ZO_TARGET
}  // namespace avx2

// ---------------------------------------------------------------------------------------------
// AVX-512 (F + BW; the F16C/FMA forms are used by the scalar tails): 16 fp32 lanes.
// ---------------------------------------------------------------------------------------------
namespace avx512 {
#define ZO_TARGET __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))

struct Ops {
    using V = __m512;
    static constexpr size_t W = 16;

    ZO_TARGET ZO_ALWAYS_INLINE static V set1(float x) { return _mm512_set1_ps(x); }
    ZO_TARGET ZO_ALWAYS_INLINE static V load(const float* p) { return _mm512_loadu_ps(p); }
    ZO_TARGET ZO_ALWAYS_INLINE static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
    ZO_TARGET ZO_ALWAYS_INLINE static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    ZO_TARGET ZO_ALWAYS_INLINE static V add(V a, V b) { return _mm512_add_ps(a, b); }
    ZO_TARGET ZO_ALWAYS_INLINE static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    ZO_TARGET ZO_ALWAYS_INLINE static V sqrt(V a) { return _mm512_sqrt_ps(a); }
    ZO_TARGET ZO_ALWAYS_INLINE static V div(V a, V b) { return _mm512_div_ps(a, b); }

    template <int G>
    ZO_TARGET ZO_ALWAYS_INLINE static V load_grad(const void* grad, size_t i)
    {
        if constexpr (G == kGradF32) {
            return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
        } else {
            const __m256i h = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
            if constexpr (G == kGradBF16) {
                return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            } else {
                return _mm512_cvtph_ps(h);
            }
        }
    }

    template <int O, bool NT>
    ZO_TARGET ZO_ALWAYS_INLINE static void store_out(void* out, size_t i, V p)
    {
        auto* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i);
        if constexpr (O == kOutBF16) {
            // Bit-exact RNE (not vcvtneps2bf16, which flushes subnormals to zero).
            const __m512i u = _mm512_castps_si512(p);
            const __m512i hi = _mm512_srli_epi32(u, 16);
            const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
            __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
            r = _mm512_srli_epi32(r, 16);
            const __m512i absu = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
            const __mmask16 nan = _mm512_cmpgt_epi32_mask(absu, _mm512_set1_epi32(0x7f800000));
            const __m512i qnan = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
            r = _mm512_mask_blend_epi32(nan, r, qnan);
            store32<NT>(dst, _mm512_cvtepi32_epi16(r));
        } else if constexpr (O == kOutF16) {
            store32<NT>(dst, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }

    template <bool NT>
    ZO_TARGET ZO_ALWAYS_INLINE static void store32(__m256i* dst, __m256i x)
    {
        if constexpr (NT) {
            _mm256_stream_si256(dst, x);  // dst is 32-byte aligned (checked by the caller)
        } else {
            _mm256_storeu_si256(dst, x);
        }
    }
    ZO_TARGET ZO_ALWAYS_INLINE static void stream_fence() { _mm_sfence(); }
};

#include "adam_body.inc"
#include "sumsq_body.inc"

#undef ZO_TARGET
}  // namespace avx512

const KernelSet kAvx2 = {kIsaAvx2, "avx2", 8, &avx2::select_kernel, &avx2::round_f32, 16,
                         &avx2::select_sumsq};
const KernelSet kAvx512 = {kIsaAvx512, "avx512", 16, &avx512::select_kernel, &avx512::round_f32,
                           32, &avx512::select_sumsq};

}  // namespace

const KernelSet* avx2_kernels() { return &kAvx2; }
const KernelSet* avx512_kernels() { return &kAvx512; }

}  // namespace zo

#else  // not x86-64

namespace zo {
const KernelSet* avx2_kernels() { return nullptr; }
const KernelSet* avx512_kernels() { return nullptr; }
}  // namespace zo

#endif
