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
    for (size_t k = 0; k < 256; ++k) {
        uint32_t u;
        std::memcpy(&u, &q.value[k], sizeof u);
        for (size_t j = 0; j < 4; ++j) q.planes[j][k] = static_cast<uint8_t>(u >> (8 * j));
    }
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
            q.base[sign][slot] = 0;  // unused slots
            q.cut[sign][slot] = INFINITY;
        }
        // |y| >= 2 (and NaN, which the encoder maps to code 0 before the lookup)
        q.base[sign][q.top_slot] = static_cast<uint8_t>(count_le(q.mid, sign ? -2.0f : 2.0f));
        q.cut[sign][q.top_slot] = NAN;  // no compare adds to it (+inf >= +inf would)
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

// --- The search-free vector encoding (QuantFast in adam_states.h) ---

uint32_t f32_bits(float f)
{
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

// Bucket of a magnitude a >= 0 and the lower end of bucket b.
uint32_t fast_bucket(const QuantFast& f, float a)
{
    const uint32_t e = f32_bits(a) >> 23;
    const uint32_t b = (e > f.base ? e - f.base : 0) >> f.shift;
    return b < 32 ? b : 31;
}
float fast_bucket_lo(const QuantFast& f, uint32_t b)
{
    return b == 0 ? 0.0f : bits_to_f32(((b << f.shift) + f.base) << 23);
}

// Relative error bound of the kernels' sqrt estimate of the second moment (rsqrt14 or rsqrtps,
// then one Newton step): about 2^-21.5; the pieces are built for 2^-20.
constexpr double kSqrtRelErr = 1.0 / (1 << 20);

struct FastPiece {
    int start;                // threshold: index of the midpoint that starts it (-1: a = 0)
    std::vector<int> inside;  // midpoints strictly inside
    float slope, offset, bias;
};

// Fits g = slope * X + offset with g(X[k]) = k + 1 at the inside midpoints, X = mid (first
// moment) or sqrt(mid - bias) (second moment: its midpoints are (x_k^2 + x_(k+1)^2) / 2 of
// values x_k evenly spaced by h inside a decade, i.e. (x_k + h/2)^2 + bias with bias = h^2 / 4,
// one eighth of their second difference); false if some midpoint is off by more than the
// tolerance, the estimate's and the fma's errors included.
bool fast_fit(const std::vector<float>& pos, const std::vector<int>& ks, bool sqrt_dom,
              FastPiece& p)
{
    p.bias = 0.0f;
    if (ks.empty()) {
        p.slope = 0.0f;
        p.offset = 0.5f;  // constant count: g never near an integer
        return true;
    }
    if (sqrt_dom && ks.size() >= 3) {
        const double d2 = static_cast<double>(pos[ks[2]]) - 2.0 * pos[ks[1]] + pos[ks[0]];
        p.bias = static_cast<float>(std::max(d2, 0.0) / 8.0);
    }
    auto X = [&](int k) {
        if (k < 0) return 0.0;
        return sqrt_dom ? std::sqrt(std::max(static_cast<double>(pos[k]) - p.bias, 0.0))
                        : static_cast<double>(pos[k]);
    };
    const int k0 = ks.front(), k1 = ks.back();
    const double s = k0 == k1 ? 0.5 / (X(k0) - X(k0 - 1)) : (k1 - k0) / (X(k1) - X(k0));
    p.slope = static_cast<float>(s);
    p.offset = static_cast<float>((k0 + 1) - static_cast<double>(p.slope) * X(k0));
    double dev = 0.0;
    for (int k : ks)
        dev = std::max(dev, std::fabs(static_cast<double>(p.slope) * X(k) + p.offset - (k + 1)));
    // X's relative error: the sqrt estimate, and the rounding of mid - bias
    const double est = sqrt_dom ? static_cast<double>(p.slope) * X(k1) * kSqrtRelErr : 0.0;
    const double fma_err = std::ldexp(1.0, -24) * (k1 + 2);
    return dev + est + fma_err <= kQFastTol;
}

// Builds f from the positive midpoints pos[0..n) (the count of those <= |y|); false if the
// pieces do not fit the 32-entry tables or a bucket would hold two thresholds.
bool build_fast(const std::vector<float>& pos, bool sqrt_dom, uint32_t base, uint32_t shift,
                QuantFast& f)
{
    f.base = base;
    f.shift = shift;
    f.ok = false;
    const int n = static_cast<int>(pos.size());
    // A threshold may start a bucket or lie inside one, but no bucket holds two inside.
    auto allowed = [&](int last, int t) {
        const uint32_t b = fast_bucket(f, pos[t]);
        if (pos[t] == fast_bucket_lo(f, b) || last < 0) return true;
        return fast_bucket(f, pos[last]) != b || pos[last] == fast_bucket_lo(f, b);
    };
    std::vector<FastPiece> pieces;
    FastPiece cur{-1, {}, 0.0f, 0.5f, 0.0f};
    for (int k = 0; k < n;) {
        std::vector<int> trial = cur.inside;
        trial.push_back(k);
        FastPiece probe = cur;
        if (fast_fit(pos, trial, sqrt_dom, probe)) {
            cur.inside = trial;
            ++k;
            continue;
        }
        // Start a new piece at the latest midpoint that may be a threshold.
        int t = k;
        while (t > cur.start && !allowed(cur.start, t)) --t;
        if (t <= cur.start) return false;
        while (!cur.inside.empty() && cur.inside.back() >= t) cur.inside.pop_back();
        pieces.push_back(cur);
        cur = FastPiece{t, {}, 0.0f, 0.5f, 0.0f};
        k = t + 1;
    }
    pieces.push_back(cur);
    if (pieces.size() > 32) return false;
    for (size_t i = 0; i < 32; ++i) {
        f.slope[i] = 0.0f;
        f.offset[i] = 0.5f;
        f.bias[i] = 0.0f;
        f.range[i] = 0;
    }
    for (size_t i = 0; i < pieces.size(); ++i) {
        FastPiece& p = pieces[i];
        if (!fast_fit(pos, p.inside, sqrt_dom, p)) return false;
        const int cmin = p.start + 1;
        const int cmax = i + 1 < pieces.size() ? pieces[i + 1].start : n;
        f.slope[i] = p.slope;
        f.offset[i] = p.offset;
        f.bias[i] = p.bias;
        f.range[i] = cmin | (cmax << 16);
    }
    for (uint32_t b = 0; b < 32; ++b) {
        const float lo = fast_bucket_lo(f, b);
        int first = 0;
        float next = INFINITY;
        for (size_t i = 1; i < pieces.size(); ++i) {
            const float t = pos[pieces[i].start];
            if (t <= lo) {
                first = static_cast<int>(i);
            } else if (next == INFINITY && fast_bucket(f, t) == b) {
                next = t;
            } else if (fast_bucket(f, t) == b) {
                return false;  // two thresholds inside one bucket
            }
        }
        f.first[b] = first;
        f.next[b] = next;
    }
    f.ok = true;
    return true;
}

QuantMaps* build()
{
    static QuantMaps q;  // static storage, not the stack
    const bool ok_m = fill(dynamic_map(true), false, q.m);
    const bool ok_v = fill(dynamic_map(false), true, q.v);
    q.lut_ok = ok_m && ok_v;
    // Positive midpoints: the signed map's upper half (its lower half mirrors them), all of the
    // unsigned map's. Buckets: one octave of |y| from 2^-30 (first moment), two octaves of
    // |y| (one of sqrt) from 2^-60 (second moment); |y| is clamped to 2 so 2..inf is bucket 31.
    build_fast(std::vector<float>(q.m.mid + 127, q.m.mid + 255), false, 97, 0, q.m.fast);
    build_fast(std::vector<float>(q.v.mid, q.v.mid + 255), true, 66, 1, q.v.fast);
    return &q;
}

// Built when the module is loaded, before any code can call the kernels.
const QuantMaps* const g_maps = build();

}  // namespace

const QuantMaps& quant_maps() { return *g_maps; }

}  // namespace zo
