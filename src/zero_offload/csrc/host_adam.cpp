// CPython extension module zero_offload._host_adam: the host Adam/AdamW update of ZeRO-Offload.
//
// A plain C-API module (no PyTorch headers, no pybind11): tensors arrive as raw data pointers
// (Python ints) that the Python wrapper (zero_offload/kernels/host_adam.py) has validated. The
// instruction set is chosen at import time from what the CPU supports (AVX-512 > AVX2 > scalar)
// and can be overridden with set_isa() for testing. The GIL is released for the whole update.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam_coeffs.h"
#include "bandwidth_probe.h"
#include "host_adam.h"
#include "states_py.h"
#include "sumsq.h"
#include "thread_pool.h"

namespace zo {
namespace {

// Work is handed out in blocks whose boundaries are multiples of 64 elements (so each block is
// a whole number of SIMD iterations of every variant); the result of an element never depends
// on which thread or which code path (SIMD body or scalar tail) handled it.
constexpr size_t kBlock = 64 * 1024;
static_assert(kBlock % 64 == 0, "block boundaries must be multiples of 64 elements");

const KernelSet* g_supported[3] = {nullptr, nullptr, nullptr};  // indexed by Isa
const KernelSet* g_active = nullptr;
bool g_stream_out = false;  // non-temporal stores for param_out (see set_stream_out)

void detect_isas()
{
    g_supported[kIsaScalar] = scalar_kernels();
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw");
    if (avx2) g_supported[kIsaAvx2] = avx2_kernels();
    if (avx512) g_supported[kIsaAvx512] = avx512_kernels();
#endif
    for (int i = 2; i >= 0; --i) {
        if (g_supported[i] != nullptr) {
            g_active = g_supported[i];
            break;
        }
    }
}

struct Job {
    RangeFn fn;
    const AdamArgs* args;
    size_t n;
    std::atomic<size_t> next_block{0};
};

void run_job(void* p)
{
    Job* job = static_cast<Job*>(p);
    for (;;) {
        const size_t b = job->next_block.fetch_add(1, std::memory_order_relaxed);
        const size_t begin = b * kBlock;
        if (begin >= job->n) break;
        job->fn(*job->args, begin, std::min(job->n, begin + kBlock));
    }
}

template <typename T>
T* as_ptr(unsigned long long v)
{
    return reinterpret_cast<T*>(static_cast<uintptr_t>(v));
}

PyObject* py_adam_step(PyObject*, PyObject* args)
{
    unsigned long long master, exp_avg, exp_avg_sq, grad, out;
    int grad_type, out_type, adamw, bias_correction, threads;
    Py_ssize_t n;
    long long step;
    double lr, beta1, beta2, eps, weight_decay, grad_scale;
    if (!PyArg_ParseTuple(args, "KKKKiKinLdddddppdi:adam_step", &master, &exp_avg, &exp_avg_sq,
                          &grad, &grad_type, &out, &out_type, &n, &step, &lr, &beta1, &beta2,
                          &eps, &weight_decay, &adamw, &bias_correction, &grad_scale, &threads)) {
        return nullptr;
    }
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n must be >= 0, got %zd", n);
    if (step < 1) return PyErr_Format(PyExc_ValueError, "step must be >= 1, got %lld", step);
    if (threads < 1) return PyErr_Format(PyExc_ValueError, "threads must be >= 1, got %d", threads);
    if (grad_type < kGradF32 || grad_type > kGradF16)
        return PyErr_Format(PyExc_ValueError, "unknown grad type code %d", grad_type);
    if (out_type < kOutNone || out_type > kOutF16)
        return PyErr_Format(PyExc_ValueError, "unknown param_out type code %d", out_type);
    if (n == 0) Py_RETURN_NONE;
    if (!master || !exp_avg || !exp_avg_sq || !grad || (out_type != kOutNone && !out))
        return PyErr_Format(PyExc_ValueError, "null data pointer");

    // Per-call scalars in double precision, rounded once to fp32.
    const AdamHyper h = {step, lr, beta1, beta2, eps, weight_decay, grad_scale, adamw != 0,
                         bias_correction != 0};
    const int wd_mode = wd_mode_of(h);
    AdamArgs a;
    a.master = as_ptr<float>(master);
    a.exp_avg = as_ptr<float>(exp_avg);
    a.exp_avg_sq = as_ptr<float>(exp_avg_sq);
    a.grad = as_ptr<const void>(grad);
    a.out = out_type == kOutNone ? nullptr : as_ptr<void>(out);
    a.c = make_coeffs(h);

    Job job;
    const bool stream = g_stream_out && out_type != kOutNone && g_active->stream_align > 0 &&
                        (out % static_cast<unsigned long long>(g_active->stream_align)) == 0;
    job.fn = g_active->select(grad_type, out_type, wd_mode, stream);
    job.args = &a;
    job.n = static_cast<size_t>(n);
    const size_t blocks = (job.n + kBlock - 1) / kBlock;
    const int nthreads = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), blocks));

    Py_BEGIN_ALLOW_THREADS
    pool_run(nthreads, &run_job, &job);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_round_f32(PyObject*, PyObject* args)
{
    unsigned long long src, dst;
    Py_ssize_t n;
    int out_type;
    if (!PyArg_ParseTuple(args, "KKni:round_f32", &src, &dst, &n, &out_type)) return nullptr;
    if (out_type != kOutBF16 && out_type != kOutF16)
        return PyErr_Format(PyExc_ValueError, "out_type must be 1 (bf16) or 2 (fp16)");
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n must be >= 0");
    if (n > 0 && (!src || !dst)) return PyErr_Format(PyExc_ValueError, "null data pointer");
    g_active->round(as_ptr<const float>(src), as_ptr<uint16_t>(dst), static_cast<size_t>(n),
                    out_type);
    Py_RETURN_NONE;
}

PyObject* py_sumsq(PyObject*, PyObject* args)
{
    unsigned long long x;
    int grad_type, threads;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "Kini:sumsq", &x, &grad_type, &n, &threads)) return nullptr;
    if (n < 0) return PyErr_Format(PyExc_ValueError, "n must be >= 0, got %zd", n);
    if (threads < 1) return PyErr_Format(PyExc_ValueError, "threads must be >= 1, got %d", threads);
    if (grad_type < kGradF32 || grad_type > kGradF16)
        return PyErr_Format(PyExc_ValueError, "unknown grad type code %d", grad_type);
    if (n > 0 && !x) return PyErr_Format(PyExc_ValueError, "null data pointer");
    float out;
    const KernelSet* ks = g_active;
    Py_BEGIN_ALLOW_THREADS
    out = sum_of_squares(ks, as_ptr<const void>(x), grad_type, static_cast<size_t>(n), threads);
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble(static_cast<double>(out));
}

PyObject* py_get_isa(PyObject*, PyObject*) { return PyUnicode_FromString(g_active->name); }

PyObject* py_simd_width(PyObject*, PyObject*) { return PyLong_FromLong(g_active->simd_width); }

PyObject* py_supported_isas(PyObject*, PyObject*)
{
    PyObject* t = PyList_New(0);
    if (t == nullptr) return nullptr;
    for (int i = 0; i < 3; ++i) {
        if (g_supported[i] == nullptr) continue;
        PyObject* s = PyUnicode_FromString(g_supported[i]->name);
        if (s == nullptr || PyList_Append(t, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(t);
            return nullptr;
        }
        Py_DECREF(s);
    }
    return t;
}

PyObject* py_set_isa(PyObject*, PyObject* args)
{
    const char* name;
    if (!PyArg_ParseTuple(args, "s:set_isa", &name)) return nullptr;
    for (int i = 0; i < 3; ++i) {
        if (g_supported[i] != nullptr && std::strcmp(g_supported[i]->name, name) == 0) {
            g_active = g_supported[i];
            Py_RETURN_NONE;
        }
    }
    PyObject* supported = py_supported_isas(nullptr, nullptr);
    if (supported == nullptr) return nullptr;
    PyErr_Format(PyExc_ValueError, "ISA %R is not supported by this CPU/build (supported: %R)",
                 PyTuple_GET_ITEM(args, 0), supported);
    Py_DECREF(supported);
    return nullptr;
}

PyObject* py_bandwidth_probe(PyObject*, PyObject* args)
{
    int pattern, threads;
    unsigned long long a, b, c, g, o;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iKKKKKni:bandwidth_probe", &pattern, &a, &b, &c, &g, &o, &n,
                          &threads)) {
        return nullptr;
    }
    if (pattern != kProbeTriad && pattern != kProbeTraffic)
        return PyErr_Format(PyExc_ValueError, "pattern must be 0 (triad) or 1 (traffic)");
    if (n < 0 || threads < 1) return PyErr_Format(PyExc_ValueError, "need n >= 0, threads >= 1");
    if (n > 0 && (!a || !b || (pattern == kProbeTraffic && (!c || !g || !o))))
        return PyErr_Format(PyExc_ValueError, "null data pointer");
    if (n == 0) Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    bandwidth_probe(pattern, as_ptr<float>(a), as_ptr<float>(b), as_ptr<float>(c),
                    as_ptr<const uint16_t>(g), as_ptr<uint16_t>(o), static_cast<size_t>(n),
                    threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_pool_size(PyObject*, PyObject*) { return PyLong_FromLong(pool_size()); }

PyObject* py_set_stream_out(PyObject*, PyObject* args)
{
    int on;
    if (!PyArg_ParseTuple(args, "p:set_stream_out", &on)) return nullptr;
    const bool was = g_stream_out;
    g_stream_out = on != 0;
    return PyBool_FromLong(was);
}

PyMethodDef kMethods[] = {
    {"adam_step", py_adam_step, METH_VARARGS,
     "adam_step(master, exp_avg, exp_avg_sq, grad, grad_type, out, out_type, n, step, lr, "
     "beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale, threads)\n"
     "Raw-pointer host Adam/AdamW update (pointers as ints; grad_type 0=f32 1=bf16 2=f16; "
     "out_type 0=none 1=bf16 2=f16). No validation of the buffers: use "
     "zero_offload.kernels.host_adam_step."},
    {"round_f32", py_round_f32, METH_VARARGS,
     "round_f32(src, dst, n, out_type): fp32 -> bf16 (1) / fp16 (2), RNE, as the kernel does."},
    {"sumsq", py_sumsq, METH_VARARGS,
     "sumsq(x, grad_type, n, threads) -> float: sum of squares of n contiguous elements "
     "(grad_type 0=f32 1=bf16 2=f16), fp32 lanes, the same result on every ISA and thread "
     "count. No validation of the buffer: use zero_offload.kernels.sumsq.sum_of_squares."},
    {"get_isa", py_get_isa, METH_NOARGS, "Name of the active instruction set variant."},
    {"simd_width", py_simd_width, METH_NOARGS, "fp32 lanes per vector of the active variant."},
    {"supported_isas", py_supported_isas, METH_NOARGS,
     "Variants this CPU can run, slowest first."},
    {"set_isa", py_set_isa, METH_VARARGS, "Select a variant by name (testing)."},
    {"bandwidth_probe", py_bandwidth_probe, METH_VARARGS,
     "bandwidth_probe(pattern, a, b, c, g, o, n, threads): streaming loop for the benchmark's "
     "bandwidth bound; 0 = triad a += 0.5*b (12 B/elem), 1 = the kernel's 28 B/elem streams."},
    {"set_stream_out", py_set_stream_out, METH_VARARGS,
     "set_stream_out(on) -> previous: write param_out with non-temporal stores (when aligned)."},
    {"pool_size", py_pool_size, METH_NOARGS, "Number of worker threads alive in the pool."},
    {"adam_step_states", py_adam_step_states, METH_VARARGS, kAdamStepStatesDoc},
    {"sr_round_bf16", py_sr_round_bf16, METH_VARARGS, kSrRoundDoc},
    {"quant_maps", py_quant_maps, METH_NOARGS, kQuantMapsDoc},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_host_adam",
    "Host (CPU) Adam/AdamW update kernel for ZeRO-Offload (SIMD, multi-threaded, GIL released).",
    -1, kMethods,
};

}  // namespace

const KernelSet* active_kernel_set() { return g_active; }

}  // namespace zo

PyMODINIT_FUNC PyInit__host_adam(void)
{
    zo::detect_isas();
    return PyModule_Create(&zo::kModule);
}
