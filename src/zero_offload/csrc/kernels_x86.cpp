// AVX2+FMA+F16C and AVX-512 variants of the host Adam update. Built for baseline x86-64: the
// ISA is enabled per function with target attributes, and host_adam.cpp only calls into a
// variant after checking the CPU at run time, so the module imports on any x86-64 CPU.
#include "adam_states.h"
#include "host_adam.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

// GCC 12 reports a false -Wmaybe-uninitialized inside its own avx512fintrin.h (the deliberate
// `__m512 __Y = __Y;` of _mm512_undefined_ps) when intrinsics are used via target attributes.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "scalar_math.h"
#include "states_math.h"

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

    // --- compact states (states_body.inc) ---
    ZO_TARGET ZO_ALWAYS_INLINE static V zero() { return _mm256_setzero_ps(); }
    ZO_TARGET ZO_ALWAYS_INLINE static V abs(V a)
    {
        return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);
    }
    ZO_TARGET ZO_ALWAYS_INLINE static V amax(V a, V b) { return _mm256_max_ps(a, b); }  // a>b?a:b
    ZO_TARGET ZO_ALWAYS_INLINE static float hmax(V a)
    {
        alignas(32) float t[W];
        _mm256_store_ps(t, a);
        float acc = 0.0f;
        for (size_t j = 0; j < W; ++j) acc = amax_step(t[j], acc);
        return acc;
    }
    // 8-bit codec: the scalar block code (table lookups; gathers would be slower).
    static void q8_decode(const StatesArgs& a, size_t b0, size_t b1, float* mbuf, float* vbuf)
    {
        q8_begin_block(a, b0, b1, mbuf, vbuf);
    }
    static void q8_encode(const StatesArgs& a, const Q8Block& q, size_t b1) { q8_end_block(a, q, b1); }
    ZO_TARGET ZO_ALWAYS_INLINE static V load_bf16(const void* p, size_t i)
    {
        return load_grad<kGradBF16>(p, i);
    }
    ZO_TARGET ZO_ALWAYS_INLINE static void store_bf16(void* p, size_t i, V x)
    {
        store_out<kOutBF16, false>(p, i, x);
    }
    ZO_TARGET ZO_ALWAYS_INLINE static void store_bf16_sr(void* p, size_t i, V x, uint32_t idx0,
                                                         uint32_t key)
    {
        __m256i h = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(idx0)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        h = _mm256_xor_si256(h, _mm256_set1_epi32(static_cast<int>(key)));
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
        h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
        h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
        const __m256i u = _mm256_castps_si256(x);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_srli_epi32(h, 16)), 16);
        const __m256i absu = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
        const __m256i nan = _mm256_cmpgt_epi32(absu, _mm256_set1_epi32(0x7f800000));
        const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        r = _mm256_blendv_epi8(r, qnan, nan);
        const __m128i packed =
            _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), packed);
    }
};

#include "adam_body.inc"
#include "states_body.inc"
#include "sumsq_body.inc"

#undef ZO_TARGET
}  // namespace avx2

// ---------------------------------------------------------------------------------------------
// AVX-512 (F + BW; the F16C/FMA forms are used by the scalar tails): 16 fp32 lanes.
// ---------------------------------------------------------------------------------------------
namespace avx512 {
#define ZO_TARGET __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
// The 8-bit decode's byte-table lookups (q8_decode_vbmi), where the CPU has them.
#define ZO_TARGET_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")))
const bool g_has_vbmi = __builtin_cpu_supports("avx512vbmi");

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

    // --- compact states (states_body.inc) ---
    ZO_TARGET ZO_ALWAYS_INLINE static V zero() { return _mm512_setzero_ps(); }
    ZO_TARGET ZO_ALWAYS_INLINE static V abs(V a)
    {
        return _mm512_castsi512_ps(
            _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff)));
    }
    ZO_TARGET ZO_ALWAYS_INLINE static V amax(V a, V b) { return _mm512_max_ps(a, b); }  // a>b?a:b
    ZO_TARGET ZO_ALWAYS_INLINE static float hmax(V a)
    {
        alignas(64) float t[W];
        _mm512_store_ps(t, a);
        float acc = 0.0f;
        for (size_t j = 0; j < W; ++j) acc = amax_step(t[j], acc);
        return acc;
    }
    // 8-bit codec with in-register table lookups (vpermt2ps; gathers are slow on many CPUs).
    // Decode: value[code] from 16 registers, 32 entries per permute, selected by code bits 5-7.
    ZO_TARGET static void q8_decode_one(const uint8_t* codes, size_t b0, size_t len,
                                        const QuantMap& q, float scale, float* buf)
    {
        V t[16];
        for (int r = 0; r < 16; ++r) t[r] = _mm512_load_ps(q.value + 16 * r);
        const V vs = _mm512_set1_ps(scale);
        size_t k = 0;
        for (; k + W <= len; k += W) {
            const __m512i c = _mm512_cvtepu8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b0 + k)));
            V x[4];
            for (int r = 0; r < 4; ++r) x[r] = _mm512_permutex2var_ps(t[2 * r], c, t[2 * r + 1]);
            const __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
            const __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
            const __mmask16 b7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
            const V lo = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, x[0], x[1]),
                                              _mm512_mask_blend_ps(b5, x[2], x[3]));
            for (int r = 0; r < 4; ++r)
                x[r] = _mm512_permutex2var_ps(t[8 + 2 * r], c, t[8 + 2 * r + 1]);
            const V hi = _mm512_mask_blend_ps(b6, _mm512_mask_blend_ps(b5, x[0], x[1]),
                                              _mm512_mask_blend_ps(b5, x[2], x[3]));
            _mm512_storeu_ps(buf + k, _mm512_mul_ps(_mm512_mask_blend_ps(b7, lo, hi), vs));
        }
        for (; k < len; ++k) buf[k] = q.value[codes[b0 + k]] * scale;
    }
    // Decode of 64 codes at once with byte-table lookups (VBMI): each byte of the 256 values
    // from 4 registers (two 128-entry vpermt2b, chosen by code bit 7), the 4 byte planes then
    // interleaved into 4 vectors of fp32. The codes are first permuted so that the interleave
    // (per 128-bit lane) leaves the values in element order. Returns the elements done.
    ZO_TARGET_VBMI static size_t q8_decode_vbmi(const uint8_t* codes, size_t len, const QuantMap& q,
                                                float scale, float* buf)
    {
        alignas(64) static const uint8_t kOrder[64] = {
            0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
            4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
            8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
            12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
        const __m512i order = _mm512_load_si512(kOrder);
        __m512i t[4][4];
        for (int j = 0; j < 4; ++j)
            for (int r = 0; r < 4; ++r) t[j][r] = _mm512_load_si512(q.planes[j] + 64 * r);
        const V vs = _mm512_set1_ps(scale);
        size_t k = 0;
        for (; k + 64 <= len; k += 64) {
            const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + k));
            const __mmask64 hi = _mm512_movepi8_mask(c);
            __m512i b[4];
            for (int j = 0; j < 4; ++j)
                b[j] = _mm512_mask_blend_epi8(hi, _mm512_permutex2var_epi8(t[j][0], c, t[j][1]),
                                              _mm512_permutex2var_epi8(t[j][2], c, t[j][3]));
            const __m512i w0 = _mm512_unpacklo_epi8(b[0], b[1]), w1 = _mm512_unpackhi_epi8(b[0], b[1]);
            const __m512i x0 = _mm512_unpacklo_epi8(b[2], b[3]), x1 = _mm512_unpackhi_epi8(b[2], b[3]);
            const __m512i d[4] = {_mm512_unpacklo_epi16(w0, x0), _mm512_unpackhi_epi16(w0, x0),
                                  _mm512_unpacklo_epi16(w1, x1), _mm512_unpackhi_epi16(w1, x1)};
            for (int r = 0; r < 4; ++r)
                _mm512_storeu_ps(buf + k + 16 * r, _mm512_mul_ps(_mm512_castsi512_ps(d[r]), vs));
        }
        return k;
    }
    ZO_TARGET static void q8_decode_fast(const uint8_t* codes, size_t b0, size_t len,
                                         const QuantMap& q, float scale, float* buf)
    {
        const size_t k = g_has_vbmi ? q8_decode_vbmi(codes + b0, len, q, scale, buf) : 0;
        if (k < len) q8_decode_one(codes, b0 + k, len - k, q, scale, buf + k);
    }
    ZO_TARGET static void q8_decode(const StatesArgs& a, size_t b0, size_t b1, float* mbuf,
                                    float* vbuf)
    {
        const size_t blk = b0 / a.qblock;
        q8_decode_fast(static_cast<const uint8_t*>(a.exp_avg), b0, b1 - b0, a.maps->m,
                      a.scale_m[blk], mbuf);
        q8_decode_fast(static_cast<const uint8_t*>(a.exp_avg_sq), b0, b1 - b0, a.maps->v,
                      a.scale_v[blk], vbuf);
    }
    // Encode: the binary search of q8 codes (the number of midpoints <= y), each step's
    // candidates looked up in registers; the scalar tail uses the bucket table (same result).
    ZO_TARGET static void q8_encode_one(uint8_t* codes, size_t b0, size_t len, const QuantMap& q,
                                        float inv, const float* buf)
    {
        const V s0 = _mm512_set1_ps(q.search[0][0]);
        const V s1 = _mm512_load_ps(q.search[1]), s2 = _mm512_load_ps(q.search[2]);
        const V s3 = _mm512_load_ps(q.search[3]), s4 = _mm512_load_ps(q.search[4]);
        const V s5a = _mm512_load_ps(q.search[5]), s5b = _mm512_load_ps(q.search[5] + 16);
        V s6[4], s7[8];
        for (int r = 0; r < 4; ++r) s6[r] = _mm512_load_ps(q.search[6] + 16 * r);
        for (int r = 0; r < 8; ++r) s7[r] = _mm512_load_ps(q.search[7] + 16 * r);
        const V vinv = _mm512_set1_ps(inv);
        size_t k = 0;
        for (; k + W <= len; k += W) {
            const V y = _mm512_mul_ps(_mm512_loadu_ps(buf + k), vinv);
            // c: pos >> (8 - t) before step t; pos gains (128 >> t) where y >= the candidate.
            __m512i c = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, s0, _CMP_GE_OQ),
                                               _mm512_set1_epi32(1));
            const V* small[4] = {&s1, &s2, &s3, &s4};
            for (int t = 0; t < 4; ++t) {
                const V m = _mm512_permutexvar_ps(c, *small[t]);
                const __mmask16 ge = _mm512_cmp_ps_mask(y, m, _CMP_GE_OQ);
                c = _mm512_mask_add_epi32(_mm512_add_epi32(c, c), ge, _mm512_add_epi32(c, c),
                                          _mm512_set1_epi32(1));
            }
            {  // 32 candidates
                const V m = _mm512_permutex2var_ps(s5a, c, s5b);
                const __mmask16 ge = _mm512_cmp_ps_mask(y, m, _CMP_GE_OQ);
                c = _mm512_mask_add_epi32(_mm512_add_epi32(c, c), ge, _mm512_add_epi32(c, c),
                                          _mm512_set1_epi32(1));
            }
            {  // 64 candidates
                const __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
                const V m = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(s6[0], c, s6[1]),
                                                 _mm512_permutex2var_ps(s6[2], c, s6[3]));
                const __mmask16 ge = _mm512_cmp_ps_mask(y, m, _CMP_GE_OQ);
                c = _mm512_mask_add_epi32(_mm512_add_epi32(c, c), ge, _mm512_add_epi32(c, c),
                                          _mm512_set1_epi32(1));
            }
            {  // 128 candidates
                const __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
                const __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
                const V lo = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(s7[0], c, s7[1]),
                                                  _mm512_permutex2var_ps(s7[2], c, s7[3]));
                const V hi = _mm512_mask_blend_ps(b5, _mm512_permutex2var_ps(s7[4], c, s7[5]),
                                                  _mm512_permutex2var_ps(s7[6], c, s7[7]));
                const V m = _mm512_mask_blend_ps(b6, lo, hi);
                const __mmask16 ge = _mm512_cmp_ps_mask(y, m, _CMP_GE_OQ);
                c = _mm512_mask_add_epi32(_mm512_add_epi32(c, c), ge, _mm512_add_epi32(c, c),
                                          _mm512_set1_epi32(1));
            }
            _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b0 + k), _mm512_cvtepi32_epi8(c));
        }
        if (k < len) q8_encode_block(codes, b0 + k, len - k, q, inv, buf + k);
    }
    // Encode without a search (QuantFast in adam_states.h): the piece of |y| from its exponent
    // and one compare, the count as floor of an affine function of X (|y|, or sqrt(|y|) for
    // the second moment), clamped to the piece's range; lanes near an integer are re-encoded
    // by the bucket table, which is exact.
    template <bool kSigned>
    ZO_TARGET static void q8_encode_fast(uint8_t* codes, size_t b0, size_t len, const QuantMap& q,
                                         float inv, const float* buf)
    {
        const QuantFast& f = q.fast;
        const V s0 = _mm512_load_ps(f.slope), s1 = _mm512_load_ps(f.slope + 16);
        const V t0 = _mm512_load_ps(f.offset), t1 = _mm512_load_ps(f.offset + 16);
        const V d0 = _mm512_load_ps(f.bias), d1 = _mm512_load_ps(f.bias + 16);
        const V n0 = _mm512_load_ps(f.next), n1 = _mm512_load_ps(f.next + 16);
        const __m512i r0 = _mm512_load_si512(f.range), r1 = _mm512_load_si512(f.range + 16);
        const __m512i p0 = _mm512_load_si512(f.first), p1 = _mm512_load_si512(f.first + 16);
        const V vinv = _mm512_set1_ps(inv);
        const V two = _mm512_set1_ps(2.0f);
        const V half = _mm512_set1_ps(0.5f), lim = _mm512_set1_ps(0.5f - kQNear);
        const __m512i base = _mm512_set1_epi32(static_cast<int>(f.base));
        const __m512i one = _mm512_set1_epi32(1), lo16 = _mm512_set1_epi32(0xffff);
        const __m512i absmask = _mm512_set1_epi32(0x7fffffff), zero = _mm512_setzero_si512();
        size_t k = 0;
        for (; k + W <= len; k += W) {
            const V y = _mm512_mul_ps(_mm512_loadu_ps(buf + k), vinv);
            const __m512i u = _mm512_castps_si512(y);
            const __mmask16 neg = _mm512_cmplt_epi32_mask(u, zero);
            // |y| clamped to 2 (inf -> 2, the last bucket); NaN stays NaN (min's 2nd operand)
            const V a = _mm512_min_ps(two, _mm512_castsi512_ps(_mm512_and_si512(u, absmask)));
            __m512i b = _mm512_subs_epu16(_mm512_srli_epi32(_mm512_castps_si512(a), 23), base);
            if (!kSigned) b = _mm512_srli_epi32(b, 1);
            const __m512i first = _mm512_permutex2var_epi32(p0, b, p1);
            const V next = _mm512_permutex2var_ps(n0, b, n1);
            const __mmask16 ge = _mm512_cmp_ps_mask(a, next, _CMP_GE_OQ);
            const __m512i p = _mm512_mask_add_epi32(first, ge, first, one);
            V x = a;
            if (!kSigned) {  // sqrt(a - bias): rsqrt14, one Newton step (relative error < 2^-21)
                const V d = _mm512_max_ps(_mm512_set1_ps(0x1p-126f),  // NaN stays NaN
                                          _mm512_sub_ps(a, _mm512_permutex2var_ps(d0, p, d1)));
                const V r = _mm512_rsqrt14_ps(d);
                const V s = _mm512_mul_ps(d, r);
                const V h = _mm512_fnmadd_ps(s, r, _mm512_set1_ps(1.0f));
                x = _mm512_fmadd_ps(_mm512_mul_ps(s, half), h, s);
            }
            const V g = _mm512_fmadd_ps(x, _mm512_permutex2var_ps(s0, p, s1),
                                        _mm512_permutex2var_ps(t0, p, t1));
            __m512i c = _mm512_cvttps_epi32(g);
            const V fr = _mm512_sub_ps(_mm512_sub_ps(g, _mm512_cvtepi32_ps(c)), half);
            __mmask16 near = _mm512_cmp_ps_mask(
                _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(fr), absmask)), lim,
                _CMP_NLE_UQ);
            const __m512i range = _mm512_permutex2var_epi32(r0, p, r1);
            c = _mm512_max_epi32(c, _mm512_and_si512(range, lo16));
            c = _mm512_min_epi32(c, _mm512_srli_epi32(range, 16));
            if (kSigned) {  // y < 0: 127 - (positive midpoints below |y|, at most 127)
                near |= _mm512_mask_cmp_ps_mask(neg, a, next, _CMP_EQ_OQ);  // -y a threshold
                const __m512i k127 = _mm512_set1_epi32(127);
                c = _mm512_mask_sub_epi32(_mm512_add_epi32(c, k127), neg, k127,
                                          _mm512_min_epi32(c, k127));
            } else {
                near |= neg;  // negative second moments (never from the update)
            }
            _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b0 + k), _mm512_cvtepi32_epi8(c));
            for (unsigned m = near; m != 0; m &= m - 1) {
                const size_t j = k + static_cast<size_t>(__builtin_ctz(m));
                codes[b0 + j] = q8_encode_value(q, buf[j] * inv);
            }
        }
        if (k < len) q8_encode_block(codes, b0 + k, len - k, q, inv, buf + k);
    }
    ZO_TARGET static void q8_encode(const StatesArgs& a, const Q8Block& q, size_t b1)
    {
        const size_t blk = q.b0 / a.qblock;
        if (a.maps->m.fast.ok && a.maps->v.fast.ok) {
            q8_encode_fast<true>(static_cast<uint8_t*>(a.exp_avg), q.b0, b1 - q.b0, a.maps->m,
                                 q8_inverse(q.amax_m), q.mbuf);
            q8_encode_fast<false>(static_cast<uint8_t*>(a.exp_avg_sq), q.b0, b1 - q.b0,
                                  a.maps->v, q8_inverse(q.amax_v), q.vbuf);
            a.scale_m[blk] = q.amax_m;
            a.scale_v[blk] = q.amax_v;
            return;
        }
        q8_encode_one(static_cast<uint8_t*>(a.exp_avg), q.b0, b1 - q.b0, a.maps->m,
                      q8_inverse(q.amax_m), q.mbuf);
        q8_encode_one(static_cast<uint8_t*>(a.exp_avg_sq), q.b0, b1 - q.b0, a.maps->v,
                      q8_inverse(q.amax_v), q.vbuf);
        a.scale_m[blk] = q.amax_m;
        a.scale_v[blk] = q.amax_v;
    }
    ZO_TARGET ZO_ALWAYS_INLINE static V load_bf16(const void* p, size_t i)
    {
        return load_grad<kGradBF16>(p, i);
    }
    ZO_TARGET ZO_ALWAYS_INLINE static void store_bf16(void* p, size_t i, V x)
    {
        store_out<kOutBF16, false>(p, i, x);
    }
    ZO_TARGET ZO_ALWAYS_INLINE static void store_bf16_sr(void* p, size_t i, V x, uint32_t idx0,
                                                         uint32_t key)
    {
        __m512i h = _mm512_add_epi32(
            _mm512_set1_epi32(static_cast<int>(idx0)),
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        h = _mm512_xor_si512(h, _mm512_set1_epi32(static_cast<int>(key)));
        h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
        h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
        h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
        h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
        h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
        const __m512i u = _mm512_castps_si512(x);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_srli_epi32(h, 16)), 16);
        const __m512i absu = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
        const __mmask16 nan = _mm512_cmpgt_epi32_mask(absu, _mm512_set1_epi32(0x7f800000));
        const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        r = _mm512_mask_blend_epi32(nan, r, qnan);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i),
                            _mm512_cvtepi32_epi16(r));
    }
};

#include "adam_body.inc"
#include "states_body.inc"
#include "sumsq_body.inc"

#undef ZO_TARGET
#undef ZO_TARGET_VBMI
}  // namespace avx512

const KernelSet kAvx2 = {kIsaAvx2, "avx2", 8, &avx2::select_kernel, &avx2::round_f32, 16,
                         &avx2::select_sumsq};
const KernelSet kAvx512 = {kIsaAvx512, "avx512", 16, &avx512::select_kernel, &avx512::round_f32,
                           32, &avx512::select_sumsq};

}  // namespace

const KernelSet* avx2_kernels() { return &kAvx2; }
const KernelSet* avx512_kernels() { return &kAvx512; }

StatesRangeFn select_states_avx2(int master_type, int state_type, int grad_type, int out_type,
                                 int wd_mode, bool stochastic)
{
    return avx2::states_select(master_type, state_type, grad_type, out_type, wd_mode, stochastic);
}
StatesRangeFn select_states_avx512(int master_type, int state_type, int grad_type, int out_type,
                                   int wd_mode, bool stochastic)
{
    return avx512::states_select(master_type, state_type, grad_type, out_type, wd_mode,
                                 stochastic);
}
SrRoundFn sr_round_avx2() { return &avx2::sr_round_bf16; }
SrRoundFn sr_round_avx512() { return &avx512::sr_round_bf16; }

}  // namespace zo

#else  // not x86-64

#include "adam_states.h"

namespace zo {
const KernelSet* avx2_kernels() { return nullptr; }
const KernelSet* avx512_kernels() { return nullptr; }
StatesRangeFn select_states_avx2(int, int, int, int, int, bool) { return nullptr; }
StatesRangeFn select_states_avx512(int, int, int, int, int, bool) { return nullptr; }
SrRoundFn sr_round_avx2() { return nullptr; }
SrRoundFn sr_round_avx512() { return nullptr; }
}  // namespace zo

#endif
