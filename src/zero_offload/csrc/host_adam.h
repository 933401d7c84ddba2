// Host (CPU) Adam/AdamW update for ZeRO-Offload: shared types and declarations.
//
// One pass over memory per element: read the grad (fp32/bf16/fp16), scale it, update the
// fp32 master weight and the fp32 Adam moments in place, and optionally write the new weight
// rounded to bf16/fp16 (round-to-nearest-even) into a staging buffer.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zo {

enum GradType : int { kGradF32 = 0, kGradBF16 = 1, kGradF16 = 2 };
enum OutType : int { kOutNone = 0, kOutBF16 = 1, kOutF16 = 2 };
// Weight-decay flavour: none, L2 (classic Adam: g += wd * p), decoupled (AdamW: p -= lr*wd*p).
enum WdMode : int { kWdNone = 0, kWdL2 = 1, kWdDecoupled = 2 };

// Per-call constants, computed once on the host side (double) and rounded to fp32.
struct AdamCoeffs {
    float grad_scale;  // loss unscale x clip coefficient
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float bc2_rsqrt;   // 1 / sqrt(1 - beta2^step)  (1 without bias correction)
    float eps;
    float neg_step;    // -lr / (1 - beta1^step)
    float l2_wd;       // weight_decay                 (kWdL2)
    float neg_lr_wd;   // -lr * weight_decay           (kWdDecoupled)
};

struct AdamArgs {
    float* master;
    float* exp_avg;
    float* exp_avg_sq;
    const void* grad;
    void* out;  // may be null when out_type == kOutNone
    AdamCoeffs c;
};

// Processes elements [begin, end). Every variant computes bitwise identical results for every
// element, whatever the range boundaries (the SIMD body and its scalar tail share the same
// sequence of IEEE-754 operations, with explicit fused multiply-adds).
using RangeFn = void (*)(const AdamArgs& args, size_t begin, size_t end);
// Rounds n fp32 values to bf16/fp16 (RNE) exactly as the update kernels do (used by tests).
using RoundFn = void (*)(const float* src, uint16_t* dst, size_t n, int out_type);

// Sum of squares of elements [begin, end) of a gradient (GradType), for the gradient norm.
// fp32 accumulation in kSumSqLanes virtual lanes: element begin+k goes to lane k % kSumSqLanes,
// each lane adds its squares (x*x rounded, then added) in index order, and the lanes are combined
// by a fixed pairwise tree (sumsq_fold). Every variant performs this same sequence of IEEE
// operations, so the result is bitwise independent of the ISA; NaN and Inf propagate.
constexpr size_t kSumSqLanes = 64;
using SumSqFn = float (*)(const void* x, size_t begin, size_t end);

enum Isa : int { kIsaScalar = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };

struct KernelSet {
    Isa isa;
    const char* name;
    int simd_width;  // fp32 lanes per vector
    // stream_out: write param_out with non-temporal stores (ignored by the scalar variant);
    // the caller guarantees param_out is aligned to stream_align bytes.
    RangeFn (*select)(int grad_type, int out_type, int wd_mode, bool stream_out);
    RoundFn round;
    int stream_align;  // bytes; 0 = no streaming stores
    SumSqFn (*select_sumsq)(int grad_type);
};

// Defined in kernels_scalar.cpp / kernels_x86.cpp. The x86 sets are null on other targets.
const KernelSet* scalar_kernels();
const KernelSet* avx2_kernels();
const KernelSet* avx512_kernels();

}  // namespace zo
