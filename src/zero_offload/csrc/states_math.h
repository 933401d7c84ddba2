// Scalar building blocks of the compact-state update (adam_states.h): state loads/stores, the
// 8-bit codec, stochastic rounding, and the element update. Used by the scalar variant and by
// the tails of the SIMD variants, which perform the same operations lane by lane.
#pragma once

#include <cstdint>

#include "adam_states.h"
#include "scalar_math.h"

namespace zo {
namespace {

// Stochastic rounding to bf16 of the element with (32-bit) index idx. NaN -> quiet NaN as RNE.
ZO_ALWAYS_INLINE uint16_t f32_to_bf16_sr(float f, uint32_t idx, uint32_t key)
{
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    const uint32_t r = fmix32(idx ^ key) >> 16;
    return static_cast<uint16_t>((u + r) >> 16);
}

// Nearest map entry of y: the number of midpoints <= y, by an 8-step branch-free binary search
// (NaN compares false everywhere and gives code 0).
ZO_ALWAYS_INLINE uint8_t q8_encode(float y, const float* mid)
{
    uint32_t pos = 0;
    for (uint32_t s = 128; s >= 1; s >>= 1) {
        const uint32_t cand = pos + s;
        pos = y >= mid[cand - 1] ? cand : pos;
    }
    return static_cast<uint8_t>(pos);
}

// absmax accumulation: acc = x > acc ? x : acc (NaN never wins; exact, so order-independent).
ZO_ALWAYS_INLINE float amax_step(float x, float acc) { return x > acc ? x : acc; }

// 1 / absmax of a block, 0 for an all-zero block.
ZO_ALWAYS_INLINE float q8_inverse(float amax) { return amax > 0.0f ? 1.0f / amax : 0.0f; }

template <int S>
ZO_ALWAYS_INLINE float load_state(const void* p, size_t i, const float* value, float scale)
{
    if constexpr (S == kStateF32) {
        return static_cast<const float*>(p)[i];
    } else if constexpr (S == kStateBF16) {
        return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    } else {
        return value[static_cast<const uint8_t*>(p)[i]] * scale;
    }
}

template <int S>
ZO_ALWAYS_INLINE void store_state(void* p, size_t i, float x)
{
    if constexpr (S == kStateF32) {
        static_cast<float*>(p)[i] = x;
    } else if constexpr (S == kStateBF16) {
        static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
    }
}

template <int M>
ZO_ALWAYS_INLINE float load_master(const void* p, size_t i)
{
    if constexpr (M == kMasterF32) {
        return static_cast<const float*>(p)[i];
    } else {
        return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    }
}

template <int M, int O, bool SR>
ZO_ALWAYS_INLINE void store_master(const StatesArgs& a, size_t i, float p)
{
    if constexpr (M == kMasterF32) {
        static_cast<float*>(a.master)[i] = p;
        store_out_scalar<O>(a.out, i, p);
    } else if constexpr (SR) {
        static_cast<uint16_t*>(a.master)[i] =
            f32_to_bf16_sr(p, a.sr_index0 + static_cast<uint32_t>(i), a.sr_key);
    } else {
        static_cast<uint16_t*>(a.master)[i] = f32_to_bf16(p);
    }
}

// Per-block context of an 8-bit range: old scales, the updated fp32 moments of the block
// (relative to its first element b0) and their running absmax.
struct Q8Block {
    size_t b0;
    float scale_m, scale_v;
    float* mbuf;
    float* vbuf;
    float amax_m, amax_v;
};

// One element: the fp32 kernel's update between the state loads and stores.
template <int M, int S, int G, int O, int WD, bool SR, bool kHwFma>
ZO_ALWAYS_INLINE void states_elem(const StatesArgs& a, size_t i, Q8Block* q)
{
    const QuantMaps& maps = *a.maps;
    const float g = load_grad_scalar<G>(a.grad, i);  // read before out[i] (may alias) is written
    float p = load_master<M>(a.master, i);
    float m = load_state<S>(a.exp_avg, i, maps.value_m, q ? q->scale_m : 0.0f);
    float v = load_state<S>(a.exp_avg_sq, i, maps.value_v, q ? q->scale_v : 0.0f);
    adam_scalar<WD, kHwFma>(p, m, v, g, a.c);
    store_master<M, O, SR>(a, i, p);
    if constexpr (S == kStateQ8) {
        q->mbuf[i - q->b0] = m;
        q->vbuf[i - q->b0] = v;
        q->amax_m = amax_step(__builtin_fabsf(m), q->amax_m);
        q->amax_v = amax_step(__builtin_fabsf(v), q->amax_v);
    } else {
        store_state<S>(a.exp_avg, i, m);
        store_state<S>(a.exp_avg_sq, i, v);
    }
}

// Encodes buf[from - b0, n - b0) into codes[from, n) with inverse scale inv.
ZO_ALWAYS_INLINE void q8_encode_scalar(uint8_t* codes, const float* buf, size_t b0, size_t from,
                                       size_t end, float inv, const float* mid)
{
    for (size_t i = from; i < end; ++i) codes[i] = q8_encode(buf[i - b0] * inv, mid);
}

template <int M, int S, int G, int O, int WD, bool SR, bool kHwFma>
ZO_ALWAYS_INLINE void states_scalar_range(const StatesArgs& a, size_t begin, size_t end)
{
    if constexpr (S != kStateQ8) {
        for (size_t i = begin; i < end; ++i) states_elem<M, S, G, O, WD, SR, kHwFma>(a, i, nullptr);
    } else {
        const QuantMaps& maps = *a.maps;
        alignas(64) float mbuf[kMaxQBlock];
        alignas(64) float vbuf[kMaxQBlock];
        for (size_t b0 = begin; b0 < end; b0 += a.qblock) {
            const size_t b1 = end - b0 < a.qblock ? end : b0 + a.qblock;
            const size_t blk = b0 / a.qblock;
            Q8Block q = {b0, a.scale_m[blk], a.scale_v[blk], mbuf, vbuf, 0.0f, 0.0f};
            for (size_t i = b0; i < b1; ++i) states_elem<M, S, G, O, WD, SR, kHwFma>(a, i, &q);
            q8_encode_scalar(static_cast<uint8_t*>(a.exp_avg), mbuf, b0, b0, b1,
                             q8_inverse(q.amax_m), maps.mid_m);
            q8_encode_scalar(static_cast<uint8_t*>(a.exp_avg_sq), vbuf, b0, b0, b1,
                             q8_inverse(q.amax_v), maps.mid_v);
            a.scale_m[blk] = q.amax_m;
            a.scale_v[blk] = q.amax_v;
        }
    }
}

}  // namespace
}  // namespace zo
