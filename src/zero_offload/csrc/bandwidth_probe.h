// Streaming-bandwidth probes used by the benchmark to measure the memory bound (see .cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace zo {

enum ProbePattern : int { kProbeTriad = 0, kProbeTraffic = 1 };

// triad: a, b (n floats each); traffic: a, b, c (fp32) updated in place, g read, o written.
void bandwidth_probe(int pattern, float* a, float* b, float* c, const uint16_t* g, uint16_t* o,
                     size_t n, int threads);

}  // namespace zo
