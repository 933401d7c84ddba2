// The per-call constants of the host Adam update, shared by the fp32-state and compact-state
// entry points: computed in double precision and rounded once to fp32.
#pragma once

#include <cmath>

#include "host_adam.h"

namespace zo {

struct AdamHyper {
    long long step;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
    bool adamw, bias_correction;
};

inline int wd_mode_of(const AdamHyper& h)
{
    return h.weight_decay > 0.0 ? (h.adamw ? kWdDecoupled : kWdL2) : kWdNone;
}

inline AdamCoeffs make_coeffs(const AdamHyper& h)
{
    const double step = static_cast<double>(h.step);
    const double bc1 = h.bias_correction ? 1.0 - std::pow(h.beta1, step) : 1.0;
    const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, step) : 1.0;
    AdamCoeffs c;
    c.grad_scale = static_cast<float>(h.grad_scale);
    c.beta1 = static_cast<float>(h.beta1);
    c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    c.bc2_rsqrt = static_cast<float>(1.0 / std::sqrt(bc2));
    c.eps = static_cast<float>(h.eps);
    c.neg_step = static_cast<float>(-(h.lr / bc1));
    c.l2_wd = static_cast<float>(h.weight_decay);
    c.neg_lr_wd = static_cast<float>(-(h.lr * h.weight_decay));
    return c;
}

}  // namespace zo
