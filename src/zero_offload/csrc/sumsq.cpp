// Driver of the sum of squares: fixed blocks, claimed dynamically by the pool's threads, each
// block's fp32 sum written to its own slot, the slots added in block order.
#include "sumsq.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "thread_pool.h"

namespace zo {
namespace {

// Block boundaries are multiples of kSumSqLanes, so an element's lane is its index modulo
// kSumSqLanes in every block, and a block's sum never depends on which thread computed it.
constexpr size_t kSumSqBlock = 64 * 1024;
static_assert(kSumSqBlock % kSumSqLanes == 0, "blocks are whole lane groups");

struct SumSqJob {
    SumSqFn fn;
    const void* x;
    size_t n;
    float* partials;  // one per block
    std::atomic<size_t> next_block{0};
};

void run_sumsq(void* p)
{
    SumSqJob* job = static_cast<SumSqJob*>(p);
    for (;;) {
        const size_t b = job->next_block.fetch_add(1, std::memory_order_relaxed);
        const size_t begin = b * kSumSqBlock;
        if (begin >= job->n) break;
        job->partials[b] = job->fn(job->x, begin, std::min(job->n, begin + kSumSqBlock));
    }
}

}  // namespace

float sum_of_squares(const KernelSet* ks, const void* x, int grad_type, size_t n, int threads)
{
    if (n == 0) return 0.0f;
    const size_t blocks = (n + kSumSqBlock - 1) / kSumSqBlock;
    std::vector<float> partials(blocks);
    SumSqJob job;
    job.fn = ks->select_sumsq(grad_type);
    job.x = x;
    job.n = n;
    job.partials = partials.data();
    const int nthreads = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), blocks));
    pool_run_or_alone(nthreads, &run_sumsq, &job);
    double total = 0.0;
    for (const float s : partials) total += static_cast<double>(s);
    return static_cast<float>(total);
}

}  // namespace zo
