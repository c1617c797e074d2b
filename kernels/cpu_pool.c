/* The CPU kernels' thread pool: see cpu_pool.h. */
#define _GNU_SOURCE /* syscall() */
#include "cpu_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#if defined(__linux__) && !defined(KV_POOL_NO_FUTEX)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef struct {
    kv_task_fn fn;
    void *ctx;
    int64_t n_items, chunk;
    atomic_long next; /* the next item to hand out */
} task_t;

static void run_task(task_t *T) {
    for (;;) {
        const int64_t i0 = atomic_fetch_add(&T->next, T->chunk);
        if (i0 >= T->n_items) return;
        T->fn(T->ctx, i0, i0 + T->chunk < T->n_items ? i0 + T->chunk : T->n_items);
    }
}

#define MAX_THREADS 256
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* one task at a time */
static int g_n_threads = 1;                                /* the caller included */
static int g_n_workers = 0;
static atomic_int g_gen;      /* bumped for every task */
static atomic_int g_pending;  /* workers still on the current task */
static atomic_int g_sleeping; /* workers waiting on the futex */
static task_t *volatile g_task;

/* A worker that found no task sleeps until the generation moves on: a futex on Linux, a
 * condition variable elsewhere (KV_POOL_NO_FUTEX builds that path on Linux too, for its test). */
#if defined(__linux__) && !defined(KV_POOL_NO_FUTEX)
static void gen_wait(atomic_int *addr, int val) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void gen_wake_all(atomic_int *addr) {
    syscall(SYS_futex, (int *)addr, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}
#else
static pthread_mutex_t g_wait_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wait_cond = PTHREAD_COND_INITIALIZER;

static void gen_wait(atomic_int *addr, int val) {
    /* checked under the lock the waker broadcasts under: a move between the check and the
     * wait cannot be missed */
    pthread_mutex_lock(&g_wait_lock);
    while (atomic_load(addr) == val) pthread_cond_wait(&g_wait_cond, &g_wait_lock);
    pthread_mutex_unlock(&g_wait_lock);
}

static void gen_wake_all(atomic_int *addr) {
    (void)addr;
    pthread_mutex_lock(&g_wait_lock);
    pthread_cond_broadcast(&g_wait_cond);
    pthread_mutex_unlock(&g_wait_lock);
}
#endif

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield");
#endif
}

#define SPIN 20000 /* pauses before sleeping: a few hundred microseconds */

static void *worker(void *arg) {
    int seen = (int)(intptr_t)arg; /* the generation when it was made: it waits for the next */
    for (;;) {
        int gen, spins = 0;
        while ((gen = atomic_load(&g_gen)) == seen) {
            if (++spins < SPIN) {
                cpu_relax();
            } else {
                atomic_fetch_add(&g_sleeping, 1);
                if (atomic_load(&g_gen) == seen) gen_wait(&g_gen, seen);
                atomic_fetch_sub(&g_sleeping, 1);
                spins = 0;
            }
        }
        seen = gen;
        run_task(g_task);
        atomic_fetch_sub(&g_pending, 1);
    }
    return NULL;
}

static void after_fork_child(void) { /* the workers did not survive the fork */
    g_n_workers = 0;
    atomic_store(&g_pending, 0);
    atomic_store(&g_sleeping, 0);
    pthread_mutex_init(&g_lock, NULL);
#if !defined(__linux__) || defined(KV_POOL_NO_FUTEX)
    pthread_mutex_init(&g_wait_lock, NULL);
    pthread_cond_init(&g_wait_cond, NULL);
#endif
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static void init_once(void) { pthread_atfork(NULL, NULL, after_fork_child); }

int kv_set_threads(int n) {
    pthread_once(&g_once, init_once);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&g_lock);
    g_n_threads = n;
    pthread_mutex_unlock(&g_lock);
    return n;
}

static void ensure_workers(int n) {
    while (g_n_workers < n) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &at, worker, (void *)(intptr_t)atomic_load(&g_gen)) != 0) {
            pthread_attr_destroy(&at);
            break;
        }
        pthread_attr_destroy(&at);
        g_n_workers++;
    }
}

void kv_parallel(kv_task_fn fn, void *ctx, int64_t n_items, int64_t min_chunk) {
    if (n_items <= 0) return;
    pthread_once(&g_once, init_once);
    if (min_chunk < 1) min_chunk = 1;
    task_t T = {.fn = fn, .ctx = ctx, .n_items = n_items};
    pthread_mutex_lock(&g_lock);
    const int64_t most = (n_items + min_chunk - 1) / min_chunk; /* threads with a chunk each */
    const int nth = (int)(g_n_threads < most ? g_n_threads : most);
    /* several chunks per thread, so a thread the OS delays costs little */
    T.chunk = n_items / ((int64_t)nth * 8) > min_chunk ? n_items / ((int64_t)nth * 8) : min_chunk;
    atomic_store(&T.next, 0);
    if (nth > 1) ensure_workers(nth - 1);
    if (nth > 1 && g_n_workers > 0) {
        /* every worker wakes per task; those beyond nth find no chunk left and return at once */
        g_task = &T;
        atomic_store(&g_pending, g_n_workers);
        atomic_fetch_add(&g_gen, 1);
        if (atomic_load(&g_sleeping) > 0) gen_wake_all(&g_gen);
        run_task(&T);
        for (int spins = 0; atomic_load(&g_pending) > 0; spins++) {
            if (spins < SPIN) cpu_relax();
            else sched_yield(); /* a worker the OS parked: give it the core */
        }
    } else {
        run_task(&T);
    }
    pthread_mutex_unlock(&g_lock);
}
