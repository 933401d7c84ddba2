// Portable scalar variant of the host Adam update: the fallback on x86-64 CPUs without AVX2 and
// the only variant on other architectures (compilers still auto-vectorise it for the baseline
// ISA, e.g. SSE2 or NEON, which keeps results bitwise identical: lanes do the same IEEE ops).
#include "adam_states.h"
#include "host_adam.h"
#include "scalar_math.h"
#include "states_math.h"

namespace zo {
namespace {

template <int G, int O, int WD>
void scalar_range(const AdamArgs& a, size_t begin, size_t end)
{
    adam_scalar_range<G, O, WD, kBaselineHwFma>(a, begin, end);
}

template <int G, int O>
RangeFn select_wd(int wd_mode)
{
    switch (wd_mode) {
        case kWdL2: return &scalar_range<G, O, kWdL2>;
        case kWdDecoupled: return &scalar_range<G, O, kWdDecoupled>;
        default: return &scalar_range<G, O, kWdNone>;
    }
}

template <int G>
RangeFn select_out(int out_type, int wd_mode)
{
    switch (out_type) {
        case kOutBF16: return select_wd<G, kOutBF16>(wd_mode);
        case kOutF16: return select_wd<G, kOutF16>(wd_mode);
        default: return select_wd<G, kOutNone>(wd_mode);
    }
}

RangeFn select_kernel(int grad_type, int out_type, int wd_mode, bool /*stream_out*/)
{
    switch (grad_type) {
        case kGradBF16: return select_out<kGradBF16>(out_type, wd_mode);
        case kGradF16: return select_out<kGradF16>(out_type, wd_mode);
        default: return select_out<kGradF32>(out_type, wd_mode);
    }
}

void round_f32(const float* src, uint16_t* dst, size_t n, int out_type)
{
    if (out_type == kOutBF16) {
        for (size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
    } else {
        for (size_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
    }
}

template <int G>
float sumsq_scalar(const void* x, size_t begin, size_t end)
{
    float acc[kSumSqLanes] = {};
    sumsq_scalar_lanes<G>(x, begin, begin, end, acc);
    return sumsq_fold(acc);
}

SumSqFn select_sumsq(int grad_type)
{
    switch (grad_type) {
        case kGradBF16: return &sumsq_scalar<kGradBF16>;
        case kGradF16: return &sumsq_scalar<kGradF16>;
        default: return &sumsq_scalar<kGradF32>;
    }
}

// Compact states (adam_states.h).
template <int M, int S, int G, int O, int WD, bool SR>
void states_range(const StatesArgs& a, size_t begin, size_t end)
{
    states_scalar_range<M, S, G, O, WD, SR, kBaselineHwFma>(a, begin, end);
}

void sr_round_bf16(const float* src, uint16_t* dst, size_t n, uint32_t index0, uint32_t key)
{
    for (size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16_sr(src[i], index0 + static_cast<uint32_t>(i), key);
}

#define ZO_TARGET
#include "states_select.inc"
#undef ZO_TARGET

const KernelSet kScalar = {kIsaScalar, "scalar", 1, &select_kernel, &round_f32, 0, &select_sumsq};

}  // namespace

const KernelSet* scalar_kernels() { return &kScalar; }

StatesRangeFn select_states_scalar(int master_type, int state_type, int grad_type, int out_type,
                                   int wd_mode, bool stochastic)
{
    return states_select(master_type, state_type, grad_type, out_type, wd_mode, stochastic);
}
SrRoundFn sr_round_scalar() { return &sr_round_bf16; }

}  // namespace zo
