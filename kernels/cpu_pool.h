/* The CPU kernels' thread pool (cpu_pool.c): the caller computes one share of a task, workers
 * the rest. Workers spin briefly after a task, then sleep (a futex on Linux, a condition
 * variable elsewhere), so they cost nothing between tokens. One task runs at a time (a lock), so kernels may be called from any thread. */
#ifndef KVTOOL_CPU_POOL_H
#define KVTOOL_CPU_POOL_H

#include <stdint.h>

/* Items [i0, i1) of a task; `ctx` is the task's own data. */
typedef void (*kv_task_fn)(void *ctx, int64_t i0, int64_t i1);

/* Runs fn over items 0 .. n_items - 1 in chunks of at least min_chunk items, on up to the
 * pool's threads (fewer when there are fewer chunks), and returns when all are done. */
void kv_parallel(kv_task_fn fn, void *ctx, int64_t n_items, int64_t min_chunk);

/* Threads (the caller included) that later tasks use; returns the number set. */
int kv_set_threads(int n);

#endif
