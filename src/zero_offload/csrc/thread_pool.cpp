#include "thread_pool.h"

#include <cfenv>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#endif

namespace zo {
namespace {

constexpr int kMaxThreads = 1024;

struct Pool {
    std::mutex call_mu;  // one pool_run at a time
    std::mutex mu;       // guards everything below
    std::condition_variable cv_start;
    std::condition_variable cv_done;
    std::vector<std::thread*> workers;  // never joined: the pool lives until the process exits
    uint64_t generation = 0;
    int participants = 0;  // workers [0, participants) may join the current generation's task
    bool open = false;     // the caller has not finished yet: workers may still join
    int running = 0;       // workers inside the task right now
    void (*task)(void*) = nullptr;
    void* ctx = nullptr;
    std::fenv_t fenv;

    // A worker joins the task only while the caller is still inside it. The task hands out work
    // dynamically, so a worker that wakes up late (busy machine, oversubscribed cores) simply
    // finds nothing left, and the caller never waits for a thread that has not started.
    void worker_loop(int index, uint64_t seen)
    {
        for (;;) {
            void (*t)(void*);
            void* c;
            std::fenv_t env;
            {
                std::unique_lock<std::mutex> lk(mu);
                cv_start.wait(lk, [&] { return generation != seen; });
                seen = generation;
                if (!open || index >= participants) continue;
                ++running;
                t = task;
                c = ctx;
                env = fenv;
            }
            std::fesetenv(&env);
            t(c);
            {
                std::lock_guard<std::mutex> lk(mu);
                if (--running == 0 && !open) cv_done.notify_one();
            }
        }
    }

    // Returns how many workers are available (<= wanted).
    int grow(int wanted)
    {
        std::lock_guard<std::mutex> lk(mu);
        while (static_cast<int>(workers.size()) < wanted) {
            const int index = static_cast<int>(workers.size());
            try {
                auto* t = new std::thread(&Pool::worker_loop, this, index, generation);
                workers.push_back(t);
            } catch (...) {
                break;
            }
        }
        return static_cast<int>(workers.size()) < wanted ? static_cast<int>(workers.size())
                                                         : wanted;
    }
};

Pool* g_pool = nullptr;
std::once_flag g_once;

#if defined(__unix__) || defined(__APPLE__)
// fork() only duplicates the calling thread: the child gets a fresh pool (the parent's pool
// object is leaked there on purpose; its threads do not exist in the child).
void atfork_prepare() { g_pool->call_mu.lock(); }
void atfork_parent() { g_pool->call_mu.unlock(); }
void atfork_child() { g_pool = new Pool(); }
#endif

Pool& pool()
{
    std::call_once(g_once, [] {
        g_pool = new Pool();
#if defined(__unix__) || defined(__APPLE__)
        pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
#endif
    });
    return *g_pool;
}

// The caller holds p.call_mu; nthreads is at least 2.
void run_locked(Pool& p, int nthreads, void (*task)(void* ctx), void* ctx)
{
    const int helpers = p.grow(nthreads - 1);
    if (helpers > 0) {
        {
            std::lock_guard<std::mutex> lk(p.mu);
            p.task = task;
            p.ctx = ctx;
            std::fegetenv(&p.fenv);
            p.participants = helpers;
            p.open = true;
            ++p.generation;
        }
        p.cv_start.notify_all();
    }
    task(ctx);  // returns when no work is left to claim
    if (helpers > 0) {
        std::unique_lock<std::mutex> lk(p.mu);
        p.open = false;  // late workers no longer join; wait for those still working
        p.cv_done.wait(lk, [&] { return p.running == 0; });
    }
}

}  // namespace

void pool_run(int nthreads, void (*task)(void* ctx), void* ctx)
{
    if (nthreads > kMaxThreads) nthreads = kMaxThreads;
    if (nthreads <= 1) {
        task(ctx);
        return;
    }
    Pool& p = pool();
    std::lock_guard<std::mutex> call(p.call_mu);
    run_locked(p, nthreads, task, ctx);
}

bool pool_run_or_alone(int nthreads, void (*task)(void* ctx), void* ctx)
{
    if (nthreads > kMaxThreads) nthreads = kMaxThreads;
    if (nthreads <= 1) {
        task(ctx);
        return false;
    }
    Pool& p = pool();
    std::unique_lock<std::mutex> call(p.call_mu, std::try_to_lock);
    if (!call.owns_lock()) {
        task(ctx);  // hands out work dynamically: the caller alone takes every piece
        return false;
    }
    run_locked(p, nthreads, task, ctx);
    return true;
}

int pool_size()
{
    if (g_pool == nullptr) return 0;
    std::lock_guard<std::mutex> lk(g_pool->mu);
    return static_cast<int>(g_pool->workers.size());
}

}  // namespace zo
