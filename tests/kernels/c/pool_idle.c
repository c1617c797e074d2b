/* kernels/cpu_pool.c driven from C: tasks of every size give every item exactly once, then the
 * process's CPU time while the pool sits idle for a second (workers asleep, not spinning).
 * Prints "ok <idle cpu seconds>" or "bad <what>". */
#include <stdint.h>
#include <stdio.h>
#include <sys/resource.h>
#include <time.h>

#include "cpu_pool.h"

static void mark(void *ctx, int64_t i0, int64_t i1) {
    int *seen = (int *)ctx;
    for (int64_t i = i0; i < i1; i++) __atomic_fetch_add(&seen[i], 1, __ATOMIC_RELAXED);
}

static double cpu_seconds(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

int main(void) {
    static int seen[100000];
    kv_set_threads(4);
    for (int round = 0; round < 200; round++) {
        const int64_t n = 1 + (round * 7919) % 100000;
        for (int64_t i = 0; i < n; i++) seen[i] = 0;
        kv_parallel(mark, seen, n, 1 + round % 13);
        for (int64_t i = 0; i < n; i++)
            if (seen[i] != 1) {
                printf("bad item %lld of %lld done %d times\n", (long long)i, (long long)n, seen[i]);
                return 1;
            }
    }
    struct timespec settle = {0, 50 * 1000 * 1000}, idle = {1, 0};
    nanosleep(&settle, NULL); /* past the workers' spin */
    const double t0 = cpu_seconds();
    nanosleep(&idle, NULL);
    printf("ok %.4f\n", cpu_seconds() - t0);
    return 0;
}
