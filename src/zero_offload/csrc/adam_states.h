// Host Adam/AdamW update with compact optimizer states: the types shared by every variant.
//
// The fp32-state kernel (host_adam.h) keeps an fp32 master and fp32 moments. This family keeps
//   * the master in fp32 or bf16 (a bf16 master IS the 16-bit param: no separate output), written
//     rounded to nearest even or, on request, stochastically rounded (deterministic hash of
//     (seed, step, element index), so the result does not depend on threads or ISA);
//   * both moments in fp32, bf16 (rounded to nearest even, as DeepSpeed's CPU Adam stores them)
//     or 8-bit codes with one fp32 absmax scale per block of qblock elements (blockwise 8-bit
//     Adam): each block is decoded, updated in fp32 and re-encoded from the updated values (the
//     new absmax is taken from the updated block, codes are the nearest map entries).
// The update arithmetic per element is exactly the fp32 kernel's (adam_scalar); only the loads
// and stores of the states differ. Every variant gives bitwise identical results.
#pragma once

#include <cstddef>
#include <cstdint>

#include "host_adam.h"

namespace zo {

enum MasterType : int { kMasterF32 = 0, kMasterBF16 = 1 };
enum StateType : int { kStateF32 = 0, kStateBF16 = 1, kStateQ8 = 2 };

// Largest quantization block; qblock is a power of two in [kMinQBlock, kMaxQBlock], so the work
// blocks of the thread pool (multiples of 64 Ki elements) always start on a quantization block.
constexpr size_t kMaxQBlock = 256;
constexpr size_t kMinQBlock = 32;

// The two 8-bit maps: 256 sorted fp32 values in [-1, 1] (first moment, signed) and [0, 1]
// (second moment, unsigned), and their 255 midpoints (padded to 256 with +inf). A code is the
// index of its value; encoding y = x * (1/absmax) gives the number of midpoints <= y (nearest
// value, ties to the larger one). Built once at load (quant_maps.cpp).
//
// Encoding looks that count up instead of searching. The fp32 values that share their top 16
// bits (a bf16 bucket) contain at most one midpoint (a bucket is 2^-7 of its magnitude wide; the
// maps' values are >= 1.4% apart), so code(y) = base[b] + (y >= cut[b]), with base[b] the count at
// the bucket's lower end and cut[b] the midpoint inside it (+inf if none). Only magnitudes in
// [2^(emin-127), 2) have buckets of their own: every smaller |y| lies between the two midpoints
// around 0 (slot 0 of its sign), and slot top_slot holds |y| >= 2 (the count of midpoints below
// 2 or -2, as the search gives; only an infinite 1 / absmax makes |y| exceed 1 by more than a
// rounding). NaN is code 0, before the lookup. Checked when built.
constexpr uint32_t kQTopKey = 0x4000;  // bf16 bits of 2.0: the first magnitude without a bucket
constexpr uint32_t kQSlots = 6400;     // per sign: slot 0, the buckets [emin << 7, kQTopKey), top
// Vector encoding without a search (AVX-512), built and verified once per map (quant_maps.cpp).
// Count only the positive midpoints of |y| (the signed map's negative midpoints are their
// mirror images), on a transformed axis X = |y| (first moment) or X ~ sqrt(|y| - bias) (second
// moment: see quant_maps.cpp): the positive axis is cut at some midpoints (the thresholds) into
// at most 32 pieces, and in each piece the count is an affine function of X,
// g = fma(X, slope, offset), with g within kQFastTol of k + 1 at every midpoint k inside the
// piece. Hence wherever g is at least kQNear from every integer, the count is floor(g) clamped
// to the piece's count range [cmin, cmax]; lanes nearer than kQNear to an integer (ties, NaN,
// negative second moments: a small fraction) are re-encoded exactly by the bucket table.
// A piece is found without a search: bucket b = max(E - base, 0) >> shift of the fp32 exponent
// field E of |y| holds at most one threshold, so piece = first[b] + (|y| >= next[b]).
constexpr float kQNear = 1.0f / 256.0f;
constexpr double kQFastTol = 1.0 / 512.0;
struct QuantFast {
    alignas(64) float slope[32];    // per piece
    alignas(64) float offset[32];   // per piece
    alignas(64) float bias[32];     // per piece: X = sqrt(|y| - bias) (second moment)
    alignas(64) int32_t range[32];  // per piece: cmin | cmax << 16
    alignas(64) int32_t first[32];  // per bucket: the piece of its lower end
    alignas(64) float next[32];     // per bucket: the threshold inside it, +inf if none
    uint32_t base, shift;           // bucket of an exponent field E: max(E - base, 0) >> shift
    bool ok;                        // built and verified
};

struct QuantMap {
    alignas(64) float value[256];
    alignas(64) float mid[256];
    alignas(64) float cut[2][kQSlots];
    alignas(64) uint8_t base[2][kQSlots];
    // The binary search's candidates per step, for in-register lookups (AVX-512): step t
    // (s = 128 >> t) compares y with search[t][pos >> (8 - t)] = mid[pos + s - 1].
    alignas(64) float search[8][128];
    // Byte j of value[c] at planes[j][c], for byte-table lookups of 64 codes at once (VBMI).
    alignas(64) uint8_t planes[4][256];
    uint32_t lo_key;    // emin << 7: bf16 magnitude bits of the first bucket
    uint32_t top_slot;  // kQTopKey - lo_key + 1
    QuantFast fast;
};
struct QuantMaps {
    QuantMap m;   // exp_avg
    QuantMap v;   // exp_avg_sq
    bool lut_ok;  // the bucket tables are exact (checked when built)
};
const QuantMaps& quant_maps();


struct StatesArgs {
    void* master;        // float* or uint16_t* (bf16)
    void* exp_avg;       // float*, uint16_t* (bf16) or uint8_t* (codes)
    void* exp_avg_sq;    // idem
    float* scale_m;      // kStateQ8: one absmax per qblock of exp_avg, updated in place
    float* scale_v;      // kStateQ8: idem for exp_avg_sq
    const void* grad;
    void* out;           // fp32 master only: the new weight rounded to bf16/fp16, or null
    size_t qblock;       // kStateQ8 block size
    uint32_t sr_key;     // stochastic rounding: per-call key, sr_key(seed, step)
    uint32_t sr_index0;  // stochastic rounding: index of element 0 (low 32 bits)
    const QuantMaps* maps;  // kStateQ8: &quant_maps()
    AdamCoeffs c;
};

// Processes elements [begin, end); begin is a multiple of qblock.
using StatesRangeFn = void (*)(const StatesArgs& args, size_t begin, size_t end);
// Stochastic rounding of n fp32 values to bf16 as the update does (element k uses index
// index0 + k), for tests.
using SrRoundFn = void (*)(const float* src, uint16_t* dst, size_t n, uint32_t index0,
                           uint32_t key);

// Returns null for a combination the family does not cover (fp32 master with fp32 moments is
// the fp32-state kernel; param_out only with an fp32 master; stochastic rounding only with a
// bf16 master).
StatesRangeFn select_states_scalar(int master_type, int state_type, int grad_type, int out_type,
                                   int wd_mode, bool stochastic);
StatesRangeFn select_states_avx2(int master_type, int state_type, int grad_type, int out_type,
                                 int wd_mode, bool stochastic);
StatesRangeFn select_states_avx512(int master_type, int state_type, int grad_type, int out_type,
                                   int wd_mode, bool stochastic);
SrRoundFn sr_round_scalar();
SrRoundFn sr_round_avx2();
SrRoundFn sr_round_avx512();

// murmur3's 32-bit finaliser: a bijection with full avalanche.
constexpr uint32_t fmix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    x ^= x >> 16;
    return x;
}

// The per-call key of stochastic rounding. Element i of a call draws
// r = fmix32((index0 + i) mod 2^32 ^ key) >> 16 and rounds the fp32 bits up by r / 2^16 of a
// bf16 ulp: (bits + r) >> 16.
constexpr uint32_t sr_key(uint64_t seed, uint64_t step)
{
    const uint32_t s = fmix32(static_cast<uint32_t>(step) ^ fmix32(static_cast<uint32_t>(step >> 32)));
    return fmix32(static_cast<uint32_t>(seed) ^ fmix32(static_cast<uint32_t>(seed >> 32) ^ s));
}

}  // namespace zo
