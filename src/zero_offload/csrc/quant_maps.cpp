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

void fill(const std::vector<double>& values, bool squared, float* value, float* mid)
{
    for (size_t k = 0; k < 256; ++k) {
        const double x = values[k];
        value[k] = static_cast<float>(squared ? x * x : x);
    }
    for (size_t k = 0; k + 1 < 256; ++k)
        mid[k] = static_cast<float>((static_cast<double>(value[k]) + value[k + 1]) * 0.5);
    mid[255] = INFINITY;  // never read by the search; keeps the array whole
}

QuantMaps build()
{
    QuantMaps q;
    fill(dynamic_map(true), false, q.value_m, q.mid_m);
    fill(dynamic_map(false), true, q.value_v, q.mid_v);
    return q;
}

// Built when the module is loaded, before any code can call the kernels.
const QuantMaps g_maps = build();

}  // namespace

const QuantMaps& quant_maps() { return g_maps; }

}  // namespace zo
