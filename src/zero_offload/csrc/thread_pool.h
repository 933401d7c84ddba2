// A small persistent thread pool: created on first use, grown on demand, never shrunk.
#pragma once

namespace zo {

// Runs task(ctx) on the calling thread and on up to nthreads-1 pool threads, and returns when
// every thread that entered the task has returned. The task must hand out its work dynamically
// (e.g. an atomic block counter) and return when none is left: pool threads join only while
// the caller is still inside the task, so a thread that wakes up late never delays the call.
// Calls are serialised; the pool threads copy the caller's floating-point environment (MXCSR /
// FPCR: rounding mode, flush-to-zero) before running the task, so results do not depend on
// which thread processed an element. If threads cannot be created, fewer are used.
void pool_run(int nthreads, void (*task)(void* ctx), void* ctx);

// As pool_run, but when another call holds the pool (the host Adam update running on a worker
// thread, for instance) the task runs on the calling thread alone at once instead of waiting for
// that call to end. Returns whether the pool was used.
bool pool_run_or_alone(int nthreads, void (*task)(void* ctx), void* ctx);

// Number of pool threads currently alive (for diagnostics).
int pool_size();

}  // namespace zo
