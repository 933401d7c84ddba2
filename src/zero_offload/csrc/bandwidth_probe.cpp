// Memory-bandwidth probes for the benchmark (zero_offload.kernels.bench): trivial streaming
// loops run on the same thread pool and with the same block split as the Adam kernel, so that
// "% of the bandwidth bound" compares like with like.
//   triad:   a[i] = a[i] + s * b[i]            fp32, 12 bytes/element (read a, b; write a in place)
//   traffic: the Adam kernel's exact streams with no math: three fp32 arrays updated in place,
//            one 16-bit array read, one 16-bit array written (28 bytes/element).
#include "bandwidth_probe.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "thread_pool.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ZO_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ZO_CLONES
#endif

namespace zo {
namespace {

constexpr size_t kProbeBlock = 64 * 1024;

struct ProbeJob {
    int pattern;
    float* a;
    float* b;
    float* c;
    const uint16_t* g;
    uint16_t* o;
    size_t n;
    std::atomic<size_t> next{0};
};

ZO_CLONES void triad(float* __restrict__ a, const float* __restrict__ b, size_t lo, size_t hi)
{
    for (size_t i = lo; i < hi; ++i) a[i] = a[i] + 0.5f * b[i];
}

ZO_CLONES void traffic(float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                       const uint16_t* __restrict__ g, uint16_t* __restrict__ o, size_t lo,
                       size_t hi)
{
    for (size_t i = lo; i < hi; ++i) {
        const float gf = static_cast<float>(g[i]);
        const float np = p[i] + gf;
        p[i] = np;
        m[i] = m[i] + gf;
        v[i] = v[i] + gf;
        o[i] = static_cast<uint16_t>(static_cast<int32_t>(np));
    }
}

void run_probe(void* ctx)
{
    ProbeJob* j = static_cast<ProbeJob*>(ctx);
    for (;;) {
        const size_t lo = j->next.fetch_add(1, std::memory_order_relaxed) * kProbeBlock;
        if (lo >= j->n) break;
        const size_t hi = std::min(j->n, lo + kProbeBlock);
        if (j->pattern == kProbeTriad) {
            triad(j->a, j->b, lo, hi);
        } else {
            traffic(j->a, j->b, j->c, j->g, j->o, lo, hi);
        }
    }
}

}  // namespace

void bandwidth_probe(int pattern, float* a, float* b, float* c, const uint16_t* g, uint16_t* o,
                     size_t n, int threads)
{
    ProbeJob job;
    job.pattern = pattern;
    job.a = a;
    job.b = b;
    job.c = c;
    job.g = g;
    job.o = o;
    job.n = n;
    const size_t blocks = (n + kProbeBlock - 1) / kProbeBlock;
    pool_run(static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), blocks)), &run_probe,
             &job);
}

}  // namespace zo
