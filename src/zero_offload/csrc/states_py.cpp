// CPython entry points of the compact-state update: raw pointers (Python ints) validated by
// zero_offload/kernels/adam_states.py, the per-call constants, and the threaded run. The GIL is
// released for the whole update.
#define PY_SSIZE_T_CLEAN
#include "states_py.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "adam_coeffs.h"
#include "adam_states.h"
#include "thread_pool.h"

namespace zo {
namespace {

// Work blocks of 64 Ki elements: a multiple of every quantization block and of every SIMD
// width, so no result depends on which thread handled an element.
constexpr size_t kStatesBlock = 64 * 1024;
static_assert(kStatesBlock % kMaxQBlock == 0, "work blocks start on quantization blocks");

struct StatesJob {
    StatesRangeFn fn;
    const StatesArgs* args;
    size_t n;
    std::atomic<size_t> next_block{0};
};

void run_states_job(void* p)
{
    StatesJob* job = static_cast<StatesJob*>(p);
    for (;;) {
        const size_t b = job->next_block.fetch_add(1, std::memory_order_relaxed);
        const size_t begin = b * kStatesBlock;
        if (begin >= job->n) break;
        job->fn(*job->args, begin, std::min(job->n, begin + kStatesBlock));
    }
}

StatesRangeFn select_for(const KernelSet* ks, int mt, int st, int gt, int ot, int wd, bool sr)
{
    switch (ks->isa) {
        case kIsaAvx512: return select_states_avx512(mt, st, gt, ot, wd, sr);
        case kIsaAvx2: return select_states_avx2(mt, st, gt, ot, wd, sr);
        default: return select_states_scalar(mt, st, gt, ot, wd, sr);
    }
}

template <typename T>
T* as_ptr(unsigned long long v)
{
    return reinterpret_cast<T*>(static_cast<uintptr_t>(v));
}

bool is_pow2(Py_ssize_t x) { return x > 0 && (x & (x - 1)) == 0; }

}  // namespace

PyObject* py_adam_step_states(PyObject*, PyObject* args)
{
    unsigned long long master, exp_avg, exp_avg_sq, scale_m, scale_v, grad, out, seed, sr_offset;
    int grad_type, out_type, master_type, state_type, adamw, bias_correction, threads, sr;
    Py_ssize_t n, qblock;
    long long step;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
    if (!PyArg_ParseTuple(args, "KKKKKKiKiniinLdddddppdipKK:adam_step_states", &master, &exp_avg,
                          &exp_avg_sq, &scale_m, &scale_v, &grad, &grad_type, &out, &out_type, &n,
                          &master_type, &state_type, &qblock, &step, &lr, &beta1, &beta2, &eps,
                          &weight_decay, &adamw, &bias_correction, &grad_scale, &threads, &sr,
                          &seed, &sr_offset)) {
        return nullptr;
    }
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n must be >= 0, got %zd", n);
    if (step < 1) return PyErr_Format(PyExc_ValueError, "step must be >= 1, got %lld", step);
    if (threads < 1) return PyErr_Format(PyExc_ValueError, "threads must be >= 1, got %d", threads);
    if (grad_type < kGradF32 || grad_type > kGradF16)
        return PyErr_Format(PyExc_ValueError, "unknown grad type code %d", grad_type);
    if (out_type < kOutNone || out_type > kOutF16)
        return PyErr_Format(PyExc_ValueError, "unknown param_out type code %d", out_type);
    if (state_type == kStateQ8 &&
        (!is_pow2(qblock) || qblock < static_cast<Py_ssize_t>(kMinQBlock) ||
         qblock > static_cast<Py_ssize_t>(kMaxQBlock)))
        return PyErr_Format(PyExc_ValueError, "block_size must be a power of two in [%zu, %zu], got %zd",
                            kMinQBlock, kMaxQBlock, qblock);
    if (state_type == kStateQ8 && !quant_maps().lut_ok)
        return PyErr_Format(PyExc_RuntimeError, "8-bit map tables failed their self-check");
    const AdamHyper h = {step, lr, beta1, beta2, eps, weight_decay, grad_scale, adamw != 0,
                         bias_correction != 0};
    const KernelSet* ks = active_kernel_set();
    StatesRangeFn fn = select_for(ks, master_type, state_type, grad_type, out_type, wd_mode_of(h),
                                  sr != 0);
    if (fn == nullptr)
        return PyErr_Format(PyExc_ValueError,
                            "unsupported combination: master type %d, state type %d, param_out "
                            "type %d, stochastic rounding %d",
                            master_type, state_type, out_type, sr);
    if (n == 0) Py_RETURN_NONE;
    if (!master || !exp_avg || !exp_avg_sq || !grad || (out_type != kOutNone && !out) ||
        (state_type == kStateQ8 && (!scale_m || !scale_v)))
        return PyErr_Format(PyExc_ValueError, "null data pointer");

    StatesArgs a;
    a.master = as_ptr<void>(master);
    a.exp_avg = as_ptr<void>(exp_avg);
    a.exp_avg_sq = as_ptr<void>(exp_avg_sq);
    a.scale_m = as_ptr<float>(scale_m);
    a.scale_v = as_ptr<float>(scale_v);
    a.grad = as_ptr<const void>(grad);
    a.out = out_type == kOutNone ? nullptr : as_ptr<void>(out);
    a.qblock = state_type == kStateQ8 ? static_cast<size_t>(qblock) : kMaxQBlock;
    a.sr_key = sr_key(seed, static_cast<uint64_t>(step));
    a.sr_index0 = static_cast<uint32_t>(sr_offset);
    a.maps = &quant_maps();
    a.c = make_coeffs(h);

    StatesJob job;
    job.fn = fn;
    job.args = &a;
    job.n = static_cast<size_t>(n);
    const size_t blocks = (job.n + kStatesBlock - 1) / kStatesBlock;
    const int nthreads = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), blocks));
    Py_BEGIN_ALLOW_THREADS
    pool_run(nthreads, &run_states_job, &job);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_sr_round_bf16(PyObject*, PyObject* args)
{
    unsigned long long src, dst, seed, step, offset;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KKnKKK:sr_round_bf16", &src, &dst, &n, &seed, &step, &offset))
        return nullptr;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n must be >= 0");
    if (n > 0 && (!src || !dst)) return PyErr_Format(PyExc_ValueError, "null data pointer");
    SrRoundFn fn;
    switch (active_kernel_set()->isa) {
        case kIsaAvx512: fn = sr_round_avx512(); break;
        case kIsaAvx2: fn = sr_round_avx2(); break;
        default: fn = sr_round_scalar(); break;
    }
    fn(as_ptr<const float>(src), as_ptr<uint16_t>(dst), static_cast<size_t>(n),
       static_cast<uint32_t>(offset), sr_key(seed, step));
    Py_RETURN_NONE;
}

PyObject* py_quant_maps(PyObject*, PyObject*)
{
    const QuantMaps& q = quant_maps();
    const float* tables[4] = {q.m.value, q.m.mid, q.v.value, q.v.mid};
    PyObject* out = PyTuple_New(4);
    if (out == nullptr) return nullptr;
    for (int t = 0; t < 4; ++t) {
        PyObject* b = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(tables[t]),
                                                256 * sizeof(float));
        if (b == nullptr) {
            Py_DECREF(out);
            return nullptr;
        }
        PyTuple_SET_ITEM(out, t, b);
    }
    return out;
}

const char kAdamStepStatesDoc[] =
    "adam_step_states(master, exp_avg, exp_avg_sq, scale_m, scale_v, grad, grad_type, out, "
    "out_type, n, master_type, state_type, block_size, step, lr, beta1, beta2, eps, weight_decay, "
    "adamw, bias_correction, grad_scale, threads, stochastic, seed, sr_offset)\n"
    "Raw-pointer host Adam/AdamW update with compact states (master_type 0=f32 1=bf16; "
    "state_type 0=f32 1=bf16 2=8-bit codes + fp32 scales). No validation of the buffers: use "
    "zero_offload.kernels.adam_step_states.";
const char kSrRoundDoc[] =
    "sr_round_bf16(src, dst, n, seed, step, offset): fp32 -> bf16 with the update's stochastic "
    "rounding (element k uses index offset + k).";
const char kQuantMapsDoc[] =
    "quant_maps() -> (value_m, mid_m, value_v, mid_v): the 8-bit maps as 256 fp32 each (bytes).";

}  // namespace zo
