// The two 8-bit maps of the blockwise 8-bit moments (adam_states.h), built once.
//
// Both come from the dynamic (tree) map of Dettmers et al. (bitsandbytes' create_dynamic_map):
// a decimal exponent 10^-6 .. 10^0 and a linear fraction that gets the bits the exponent does
// not use, 256 values in [-1, 1] (signed) or [0, 1] (unsigned).
//   first moment (exp_avg):     the signed dynamic map of exp_avg / absmax
//   second moment (exp_avg_sq): the unsigned dynamic map of sqrt(exp_avg_sq / absmax), stored as
//                               the squares of its values (so it is a map of exp_avg_sq itself)
// docs/kernel.md gives the measured errors that chose them. The Python reference
// (zero_offload/kernels/quant_maps.py) builds the same tables with the same double operations;
// a test checks that they are bitwise equal.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "adam_states.h"

namespace zo {
namespace {

// Exact powers of ten, 10^(6 - i).
constexpr double kPow10[7] = {1e6, 1e5, 1e4, 1e3, 1e2, 1e1, 1e0};

std::vector<double> dynamic_map(bool is_signed)
{
    std::vector<double> data;
    for (int i = 0; i < 7; ++i) {
        const int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;
        for (int j = 0; j + 1 < items; ++j) {
            const double b0 = 0.1 + 0.9 * j / (items - 1);
            const double b1 = 0.1 + 0.9 * (j + 1) / (items - 1);
            const double value = (b0 + b1) / 2 / kPow10[i];
            data.push_back(value);
            if (is_signed) data.push_back(-value);
        }
    }
    data.push_back(0.0);
    data.push_back(1.0);
    std::sort(data.begin(), data.end());
    return data;  // 256 values
}

// Number of midpoints <= y (the reference search).
uint32_t count_le(const float* mid, float y)
{
    uint32_t pos = 0;
    for (uint32_t s = 128; s >= 1; s >>= 1) pos = y >= mid[pos + s - 1] ? pos + s : pos;
    return pos;
}

float bits_to_f32(uint32_t u)
{
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Fills q from the 256 map values (doubles, squared for the second moment); false if a bucket
// holds more than one midpoint.
bool fill(const std::vector<double>& values, bool squared, QuantMap& q)
{
    for (size_t k = 0; k < 256; ++k) {
        const double x = values[k];
        q.value[k] = static_cast<float>(squared ? x * x : x);
    }
    for (size_t k = 0; k + 1 < 256; ++k)
        q.mid[k] = static_cast<float>((static_cast<double>(q.value[k]) + q.value[k + 1]) * 0.5);
    q.mid[255] = INFINITY;  // never read by the search; keeps the array whole
    for (uint32_t t = 0; t < 8; ++t) {
        const uint32_t step = 128u >> t;
        for (uint32_t c = 0; c < 128; ++c) {
            const uint32_t pos = c << (8 - t);  // the positions reachable before step t
            q.search[t][c] = pos + step - 1 < 256 ? q.mid[pos + step - 1] : INFINITY;
        }
    }
    // emin: the exponent field of the smallest nonzero |midpoint|; every |y| below 2^(emin-127)
    // lies strictly between the midpoints around zero.
    float small = INFINITY;
    for (size_t k = 0; k < 255; ++k)
        if (q.mid[k] != 0.0f) small = std::min(small, std::fabs(q.mid[k]));
    uint32_t small_bits;
    std::memcpy(&small_bits, &small, sizeof small_bits);
    q.lo_key = (small_bits >> 23) << 7;
    q.top_slot = kQTopKey - q.lo_key + 1;
    bool ok = q.top_slot < kQSlots;
    const float below = bits_to_f32((q.lo_key << 16) - 1);  // the largest tiny magnitude
    ok = ok && count_le(q.mid, -below) == count_le(q.mid, below);
    for (uint32_t sign = 0; sign < 2 && ok; ++sign) {
        q.base[sign][0] = static_cast<uint8_t>(count_le(q.mid, 0.0f));
        q.cut[sign][0] = INFINITY;
        for (uint32_t slot = 1; slot < kQSlots; ++slot) {
            q.base[sign][slot] = 0;  // NaN, |y| >= 2, unused slots
            q.cut[sign][slot] = INFINITY;
        }
        for (uint32_t key = q.lo_key; key < kQTopKey; ++key) {
            const uint32_t b = (sign << 15) | key;
            const float a = bits_to_f32(b << 16), z = bits_to_f32((b << 16) | 0xffffu);
            const float lo = std::min(a, z), hi = std::max(a, z);
            const uint32_t c_lo = count_le(q.mid, lo), c_hi = count_le(q.mid, hi);
            ok = ok && c_hi - c_lo <= 1;
            const uint32_t slot = key - q.lo_key + 1;
            q.base[sign][slot] = static_cast<uint8_t>(c_lo);
            q.cut[sign][slot] = c_hi > c_lo ? q.mid[c_lo] : INFINITY;
        }
    }
    return ok;
}

QuantMaps* build()
{
    static QuantMaps q;  // static storage, not the stack
    const bool ok_m = fill(dynamic_map(true), false, q.m);
    const bool ok_v = fill(dynamic_map(false), true, q.v);
    q.lut_ok = ok_m && ok_v;
    return &q;
}

// Built when the module is loaded, before any code can call the kernels.
const QuantMaps* const g_maps = build();

}  // namespace

const QuantMaps& quant_maps() { return *g_maps; }

}  // namespace zo
