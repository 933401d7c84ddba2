// Scalar building blocks of the compact-state update (adam_states.h): state loads/stores, the
// 8-bit codec, stochastic rounding, and the element update. Used by the scalar variant and by
// the tails of the SIMD variants, which perform the same operations lane by lane.
#pragma once

#include <cstdint>
#include <cstring>

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

// The 8-bit codec of one block, in plain scalar code shared by every variant (table lookups;
// vector gathers are slow on many CPUs). Not vectorised, so the same instructions run whatever
// the includer's target; no always-inline callees (their options would differ).
#define ZO_Q8_LOOP __attribute__((noinline, optimize("no-tree-vectorize")))

// buf[k] = value[codes[b0 + k]] * scale for k < len.
ZO_Q8_LOOP static void q8_decode_block(const uint8_t* codes, size_t b0, size_t len,
                                       const QuantMap& q, float scale, float* buf)
{
    for (size_t k = 0; k < len; ++k) buf[k] = q.value[codes[b0 + k]] * scale;
}

// The nearest map entry of y: the number of midpoints <= y, by the bucket table (scalar code;
// inlined into the SIMD encoders for their few lanes that need it).
ZO_ALWAYS_INLINE uint8_t q8_encode_value(const QuantMap& q, float y)
{
    uint32_t u;
    std::memcpy(&u, &y, sizeof u);
    const uint32_t key = (u >> 16) & 0x7fffu, sign = u >> 31;
    const uint32_t slot = key < q.lo_key ? 0u : (key < kQTopKey ? key - q.lo_key + 1 : q.top_slot);
    const uint32_t code = q.base[sign][slot] + (y >= q.cut[sign][slot] ? 1u : 0u);
    return static_cast<uint8_t>(y == y ? code : 0u);  // NaN -> code 0
}

// codes[b0 + k] = encode(buf[k] * inv) for k < len.
ZO_Q8_LOOP static void q8_encode_block(uint8_t* codes, size_t b0, size_t len, const QuantMap& q,
                                       float inv, const float* buf)
{
    for (size_t k = 0; k < len; ++k) codes[b0 + k] = q8_encode_value(q, buf[k] * inv);
}

// absmax accumulation: acc = x > acc ? x : acc (NaN never wins; exact, so order-independent).
ZO_ALWAYS_INLINE float amax_step(float x, float acc) { return x > acc ? x : acc; }

// 1 / absmax of a block, 0 for an all-zero block.
ZO_ALWAYS_INLINE float q8_inverse(float amax) { return amax > 0.0f ? 1.0f / amax : 0.0f; }

template <int S>
ZO_ALWAYS_INLINE float load_state(const void* p, size_t i)
{
    if constexpr (S == kStateF32) {
        return static_cast<const float*>(p)[i];
    } else {
        return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
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

// Per-block context of an 8-bit range: the block's moments, decoded before the update and
// updated in place (relative to its first element b0), and their running absmax.
struct Q8Block {
    size_t b0;
    float* mbuf;
    float* vbuf;
    float amax_m, amax_v;
};

// One element: the fp32 kernel's update between the state loads and stores.
template <int M, int S, int G, int O, int WD, bool SR, bool kHwFma>
ZO_ALWAYS_INLINE void states_elem(const StatesArgs& a, size_t i, Q8Block* q)
{
    const float g = load_grad_scalar<G>(a.grad, i);  // read before out[i] (may alias) is written
    float p = load_master<M>(a.master, i);
    float m, v;
    if constexpr (S == kStateQ8) {
        m = q->mbuf[i - q->b0];
        v = q->vbuf[i - q->b0];
    } else {
        m = load_state<S>(a.exp_avg, i);
        v = load_state<S>(a.exp_avg_sq, i);
    }
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

// An 8-bit block [b0, b1): decode both moments into mbuf/vbuf with the block's scales.
ZO_ALWAYS_INLINE void q8_begin_block(const StatesArgs& a, size_t b0, size_t b1, float* mbuf,
                                     float* vbuf)
{
    const size_t blk = b0 / a.qblock;
    q8_decode_block(static_cast<const uint8_t*>(a.exp_avg), b0, b1 - b0, a.maps->m,
                    a.scale_m[blk], mbuf);
    q8_decode_block(static_cast<const uint8_t*>(a.exp_avg_sq), b0, b1 - b0, a.maps->v,
                    a.scale_v[blk], vbuf);
}

// ... and after the update: re-encode from the updated values with their new absmax.
ZO_ALWAYS_INLINE void q8_end_block(const StatesArgs& a, const Q8Block& q, size_t b1)
{
    const size_t blk = q.b0 / a.qblock;
    q8_encode_block(static_cast<uint8_t*>(a.exp_avg), q.b0, b1 - q.b0, a.maps->m,
                    q8_inverse(q.amax_m), q.mbuf);
    q8_encode_block(static_cast<uint8_t*>(a.exp_avg_sq), q.b0, b1 - q.b0, a.maps->v,
                    q8_inverse(q.amax_v), q.vbuf);
    a.scale_m[blk] = q.amax_m;
    a.scale_v[blk] = q.amax_v;
}

template <int M, int S, int G, int O, int WD, bool SR, bool kHwFma>
ZO_ALWAYS_INLINE void states_scalar_range(const StatesArgs& a, size_t begin, size_t end)
{
    if constexpr (S != kStateQ8) {
        for (size_t i = begin; i < end; ++i) states_elem<M, S, G, O, WD, SR, kHwFma>(a, i, nullptr);
    } else {
        alignas(64) float mbuf[kMaxQBlock];
        alignas(64) float vbuf[kMaxQBlock];
        for (size_t b0 = begin; b0 < end; b0 += a.qblock) {
            const size_t b1 = end - b0 < a.qblock ? end : b0 + a.qblock;
            q8_begin_block(a, b0, b1, mbuf, vbuf);
            Q8Block q = {b0, mbuf, vbuf, 0.0f, 0.0f};
            for (size_t i = b0; i < b1; ++i) states_elem<M, S, G, O, WD, SR, kHwFma>(a, i, &q);
            q8_end_block(a, q, b1);
        }
    }
}

}  // namespace
}  // namespace zo
