// CPython extension module zero_offload._aio: the I/O engine of NVMe offload.
//
// A request is (fd, buffer address, nbytes, file offset, read|write). submit() splits it into
// block_size pieces and queues them on a persistent pool of worker threads (one pool per thread
// count, created on first use, never shrunk: the pool of `threads` threads is DeepSpeed's
// aio.intra_op_parallelism); it returns a request id at once. The workers run pread/pwrite loops
// (short transfers and EINTR handled) outside the GIL, urgent requests' pieces (submit's
// `urgent`: a read someone waits for now) before every queued normal one, each class oldest
// first; the request completes when all its
// pieces are done, and keeps the first error (a read that meets the end of the file is an
// error). wait(id) releases the GIL until the request completes, consumes the id and raises
// OSError(errno, message) on failure; done(id) polls.
//
// A plain C-API module (no PyTorch headers, no pybind11): buffers arrive as raw addresses
// (Python ints) that the Python wrapper (zero_offload/nvme/io/aio.py) has validated, and it keeps
// the buffers and the file descriptors alive until the request is waited for. Several Python
// threads may submit and wait concurrently.
//
// Backend: POSIX threads with pread/pwrite. io_uring_available() reports whether the kernel
// accepts io_uring_setup (it is probed only; no io_uring backend is built, since neither liburing
// nor libaio headers are assumed).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#if defined(__linux__)
#include <sys/syscall.h>
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define ZO_HAVE_IO_URING_H 1
#endif
#endif

namespace zo {
namespace aio {
namespace {

constexpr int kMaxThreads = 1024;
constexpr uint64_t kMaxTransfer = 1ull << 30;  // per syscall (Linux caps one at 0x7ffff000)

struct Request {
    int fd = -1;
    char* addr = nullptr;
    uint64_t nbytes = 0;
    int64_t offset = 0;
    bool write = false;
    uint64_t block = 0;
    uint64_t npieces = 0;
    uint64_t next_piece = 0;  // guarded by the pool's mutex

    std::mutex mu;  // guards everything below
    std::condition_variable cv;
    uint64_t remaining = 0;  // pieces not finished yet
    bool finished = false;
    bool failed = false;  // once set, unstarted pieces are skipped
    int err = 0;          // errno of the first failure (EIO for an end of file)
    bool eof = false;     // the first failure is a read that met the end of the file
    int64_t err_offset = 0;     // file offset where the failing transfer started
    uint64_t err_want = 0;      // bytes it asked for
    uint64_t err_done = 0;      // bytes of that piece transferred before the failure
};

using RequestPtr = std::shared_ptr<Request>;

struct Pool {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<RequestPtr> urgent;  // requests with unclaimed pieces, oldest first: served
    std::deque<RequestPtr> queue;   // before any of these
    std::vector<std::thread*> workers;  // never joined: pools live until the process exits

    void worker_loop();
};

struct State {
    std::mutex mu;  // guards everything below
    std::map<int, Pool*> pools;  // by thread count
    std::unordered_map<uint64_t, RequestPtr> requests;  // submitted, not yet waited for
    uint64_t next_id = 1;
};

State* g_state = nullptr;
std::once_flag g_once;

// fork() only duplicates the calling thread: the child starts with no pools and no requests
// (the parent's state is leaked there on purpose; its worker threads do not exist in the child).
void atfork_prepare() { g_state->mu.lock(); }
void atfork_parent() { g_state->mu.unlock(); }
void atfork_child() { g_state = new State(); }

State& state()
{
    std::call_once(g_once, [] {
        g_state = new State();
        pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    });
    return *g_state;
}

bool at_or_past_eof(int fd, int64_t pos)
{
    struct stat st;
    return fstat(fd, &st) == 0 && st.st_size <= pos;
}

void finish_piece(Request& r, int err, bool eof, int64_t at, uint64_t want, uint64_t done)
{
    std::lock_guard<std::mutex> lk(r.mu);
    if ((err != 0 || eof) && !r.failed) {
        r.failed = true;
        r.err = eof ? EIO : err;
        r.eof = eof;
        r.err_offset = at;
        r.err_want = want;
        r.err_done = done;
    }
    if (--r.remaining == 0) {
        r.finished = true;
        r.cv.notify_all();
    }
}

void run_piece(Request& r, uint64_t piece)
{
    {
        std::lock_guard<std::mutex> lk(r.mu);
        if (r.failed) {  // the request has failed already: do not touch the file any more
            if (--r.remaining == 0) {
                r.finished = true;
                r.cv.notify_all();
            }
            return;
        }
    }
    const uint64_t begin = piece * r.block;
    const uint64_t len = r.nbytes - begin < r.block ? r.nbytes - begin : r.block;
    char* const p = r.addr + begin;
    const int64_t off = r.offset + static_cast<int64_t>(begin);
    uint64_t done = 0;
    int err = 0;
    bool eof = false;
    while (done < len) {
        const uint64_t left = len - done;
        const size_t want = static_cast<size_t>(left < kMaxTransfer ? left : kMaxTransfer);
        const off_t pos = static_cast<off_t>(off + static_cast<int64_t>(done));
        const ssize_t n = r.write ? pwrite(r.fd, p + done, want, pos) : pread(r.fd, p + done, want, pos);
        if (n > 0) {
            done += static_cast<uint64_t>(n);
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n == 0) {
            if (r.write) {
                err = EIO;  // pwrite of a nonzero count that writes nothing
            } else {
                eof = true;
            }
            break;
        }
        err = errno;
        // With O_DIRECT, a read cut short by the end of the file leaves an unaligned position,
        // and the retry fails with EINVAL instead of returning 0: that is an end of file too.
        if (!r.write && err == EINVAL && done > 0 &&
            at_or_past_eof(r.fd, off + static_cast<int64_t>(done))) {
            err = 0;
            eof = true;
        }
        break;
    }
    finish_piece(r, err, eof, off, len, done);
}

void Pool::worker_loop()
{
    // Signals are for the main thread (Python handles them there); workers never take them.
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    for (;;) {
        RequestPtr r;
        uint64_t piece;
        {
            std::unique_lock<std::mutex> lk(mu);
            cv.wait(lk, [&] { return !urgent.empty() || !queue.empty(); });
            std::deque<RequestPtr>& from = urgent.empty() ? queue : urgent;
            r = from.front();
            piece = r->next_piece++;
            if (r->next_piece == r->npieces) from.pop_front();
        }
        run_piece(*r, piece);
    }
}

// The pool of exactly `threads` workers (created on first use). Caller holds state().mu.
// Returns nullptr when no thread could be started.
Pool* get_pool(State& s, int threads)
{
    auto it = s.pools.find(threads);
    if (it != s.pools.end()) return it->second;
    Pool* pool = new Pool();
    for (int i = 0; i < threads; ++i) {
        try {
            pool->workers.push_back(new std::thread(&Pool::worker_loop, pool));
        } catch (...) {
            break;
        }
    }
    if (pool->workers.empty()) {
        delete pool;
        return nullptr;
    }
    s.pools.emplace(threads, pool);  // fewer threads than asked if creation failed: still used
    return pool;
}

void* as_ptr(unsigned long long v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }

PyObject* py_submit(PyObject*, PyObject* args)
{
    int fd, is_write, threads, urgent = 0;
    unsigned long long addr;
    long long nbytes, offset, block_size;
    if (!PyArg_ParseTuple(args, "iKLLpLi|p:submit", &fd, &addr, &nbytes, &offset, &is_write,
                          &block_size, &threads, &urgent)) {
        return nullptr;
    }
    if (fd < 0) return PyErr_Format(PyExc_ValueError, "fd must be >= 0, got %d", fd);
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, got %lld", nbytes);
    if (offset < 0) return PyErr_Format(PyExc_ValueError, "offset must be >= 0, got %lld", offset);
    if (block_size < 1)
        return PyErr_Format(PyExc_ValueError, "block_size must be >= 1, got %lld", block_size);
    if (threads < 1 || threads > kMaxThreads)
        return PyErr_Format(PyExc_ValueError, "threads must be in [1, %d], got %d", kMaxThreads,
                            threads);
    if (nbytes > 0 && addr == 0) return PyErr_Format(PyExc_ValueError, "null buffer address");

    auto r = std::make_shared<Request>();
    r->fd = fd;
    r->addr = static_cast<char*>(as_ptr(addr));
    r->nbytes = static_cast<uint64_t>(nbytes);
    r->offset = offset;
    r->write = is_write != 0;
    r->block = static_cast<uint64_t>(block_size);
    r->npieces = (r->nbytes + r->block - 1) / r->block;
    r->remaining = r->npieces;
    r->finished = r->npieces == 0;

    State& s = state();
    uint64_t id;
    Pool* pool = nullptr;
    {
        std::lock_guard<std::mutex> lk(s.mu);
        if (r->npieces > 0) {
            pool = get_pool(s, threads);
            if (pool == nullptr)
                return PyErr_Format(PyExc_RuntimeError, "could not start any I/O thread");
        }
        id = s.next_id++;
        s.requests.emplace(id, r);
    }
    if (pool != nullptr) {
        {
            std::lock_guard<std::mutex> lk(pool->mu);
            (urgent ? pool->urgent : pool->queue).push_back(r);
        }
        if (r->npieces == 1) {
            pool->cv.notify_one();
        } else {
            pool->cv.notify_all();
        }
    }
    return PyLong_FromUnsignedLongLong(id);
}

RequestPtr find(unsigned long long id)
{
    State& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    auto it = s.requests.find(id);
    return it == s.requests.end() ? nullptr : it->second;
}

PyObject* unknown_id(unsigned long long id)
{
    return PyErr_Format(PyExc_ValueError, "unknown aio request id %llu (never submitted, or "
                        "already waited for)", id);
}

PyObject* py_wait(PyObject*, PyObject* args)
{
    unsigned long long id;
    if (!PyArg_ParseTuple(args, "K:wait", &id)) return nullptr;
    RequestPtr r = find(id);
    if (!r) return unknown_id(id);
    Py_BEGIN_ALLOW_THREADS
    {
        std::unique_lock<std::mutex> lk(r->mu);
        r->cv.wait(lk, [&] { return r->finished; });
    }
    Py_END_ALLOW_THREADS
    {
        State& s = state();
        std::lock_guard<std::mutex> lk(s.mu);
        s.requests.erase(id);
    }
    if (!r->failed) Py_RETURN_NONE;
    char msg[256];
    if (r->eof) {
        std::snprintf(msg, sizeof msg,
                      "unexpected end of file: read %llu of %llu bytes at file offset %lld",
                      static_cast<unsigned long long>(r->err_done),
                      static_cast<unsigned long long>(r->err_want),
                      static_cast<long long>(r->err_offset));
    } else {
        std::snprintf(msg, sizeof msg, "%s (%s of %llu bytes at file offset %lld)",
                      std::strerror(r->err), r->write ? "pwrite" : "pread",
                      static_cast<unsigned long long>(r->err_want),
                      static_cast<long long>(r->err_offset));
    }
    PyObject* exc_args = Py_BuildValue("(is)", r->err, msg);
    if (exc_args == nullptr) return nullptr;
    PyErr_SetObject(PyExc_OSError, exc_args);  // OSError(errno, msg): FileNotFoundError etc.
    Py_DECREF(exc_args);
    return nullptr;
}

PyObject* py_done(PyObject*, PyObject* args)
{
    unsigned long long id;
    if (!PyArg_ParseTuple(args, "K:done", &id)) return nullptr;
    RequestPtr r = find(id);
    if (!r) return unknown_id(id);
    std::lock_guard<std::mutex> lk(r->mu);
    return PyBool_FromLong(r->finished ? 1 : 0);
}

PyObject* py_backend(PyObject*, PyObject*) { return PyUnicode_FromString("pthreads"); }

// Whether this kernel (and container: seccomp, kernel.io_uring_disabled) accepts io_uring_setup.
PyObject* py_io_uring_available(PyObject*, PyObject*)
{
#if defined(ZO_HAVE_IO_URING_H) && defined(__NR_io_uring_setup)
    struct io_uring_params params;
    std::memset(&params, 0, sizeof params);
    long fd;
    Py_BEGIN_ALLOW_THREADS
    fd = syscall(__NR_io_uring_setup, 1, &params);
    if (fd >= 0) close(static_cast<int>(fd));
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(fd >= 0 ? 1 : 0);
#else
    Py_RETURN_FALSE;
#endif
}

PyObject* py_pending(PyObject*, PyObject*)
{
    State& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    return PyLong_FromSize_t(s.requests.size());
}

PyObject* py_pool_threads(PyObject*, PyObject*)
{
    State& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    PyObject* d = PyDict_New();
    if (d == nullptr) return nullptr;
    for (const auto& kv : s.pools) {
        PyObject* k = PyLong_FromLong(kv.first);
        PyObject* v = PyLong_FromSize_t(kv.second->workers.size());
        if (k == nullptr || v == nullptr || PyDict_SetItem(d, k, v) < 0) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(d);
            return nullptr;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    return d;
}

PyMethodDef kMethods[] = {
    {"submit", py_submit, METH_VARARGS,
     "submit(fd, addr, nbytes, offset, is_write, block_size, threads, urgent=False) -> int\n"
     "Queue a pread (is_write false) or pwrite of nbytes at file offset `offset` from/to the "
     "buffer at address addr, split into block_size pieces run by the pool of `threads` "
     "threads; an urgent request's pieces run before every queued normal one. Returns a request id at once. The buffer and fd must stay valid until wait(). "
     "No alignment checks: use zero_offload.nvme.io.aio.AioEngine."},
    {"wait", py_wait, METH_VARARGS,
     "wait(id): block (GIL released) until the request completes; consumes the id. Raises "
     "OSError(errno, message) with the first error (EIO for a read past the end of the file)."},
    {"done", py_done, METH_VARARGS, "done(id) -> bool: whether the request has completed."},
    {"backend", py_backend, METH_NOARGS, "Name of the I/O backend: 'pthreads'."},
    {"io_uring_available", py_io_uring_available, METH_NOARGS,
     "Whether the io_uring_setup syscall works here (probe only; not used as a backend)."},
    {"pending", py_pending, METH_NOARGS, "Number of submitted requests not yet waited for."},
    {"pool_threads", py_pool_threads, METH_NOARGS,
     "{requested thread count: threads alive} of the worker pools started so far."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_aio",
    "NVMe offload I/O engine: pread/pwrite requests split into blocks and run by persistent "
    "worker threads outside the GIL.",
    -1, kMethods, nullptr, nullptr, nullptr, nullptr,
};

}  // namespace
}  // namespace aio
}  // namespace zo

PyMODINIT_FUNC PyInit__aio(void)
{
    zo::aio::state();
    PyObject* m = PyModule_Create(&zo::aio::kModule);
    // submit() takes `urgent` (older builds of this module do not: the wrapper checks this).
    if (m != nullptr && PyModule_AddIntConstant(m, "SUBMIT_URGENT", 1) != 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
