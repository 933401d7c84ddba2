// The sum of squares of a whole gradient buffer (the gradient norm's per-segment term), on the
// kernel set chosen at import (or by set_isa), multi-threaded.
#pragma once

#include <cstddef>

#include "host_adam.h"

namespace zo {

// Sum of x[i]^2 over [0, n), x of GradType grad_type. Blocks of kSumSqBlock elements are summed
// by ks's SumSqFn (fp32 lanes, see host_adam.h) on up to ``threads`` threads (the caller alone
// when the pool is busy); the block sums are added in block order in double precision and the
// total rounded once to fp32. The result depends on neither the thread count nor the ISA.
float sum_of_squares(const KernelSet* ks, const void* x, int grad_type, size_t n, int threads);

}  // namespace zo
