/* The machine's read bandwidth: N threads each sum their share of a buffer far larger than the
 * caches, best of R passes. `read_bandwidth MiB THREADS ROUNDS` prints GB/s (1e9 bytes a second).
 * benchmarks/qmatmul_bandwidth.py compiles and runs it beside the matmul kernels. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const uint8_t *buf;
static size_t share;
static volatile uint64_t sink;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *reader(void *arg) {
    const uint64_t *p = (const uint64_t *)(buf + (size_t)(intptr_t)arg * share);
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < share / 8; i += 8) { /* one cache line an iteration, four chains */
        s0 += p[i] ^ p[i + 4];
        s1 += p[i + 1] ^ p[i + 5];
        s2 += p[i + 2] ^ p[i + 6];
        s3 += p[i + 3] ^ p[i + 7];
    }
    sink += s0 + s1 + s2 + s3;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: read_bandwidth MiB THREADS ROUNDS\n");
        return 2;
    }
    const size_t bytes = (size_t)atol(argv[1]) << 20;
    const int nth = atoi(argv[2]), rounds = atoi(argv[3]);
    if (nth < 1 || nth > 256 || rounds < 1) return 2;
    uint8_t *b = aligned_alloc(4096, bytes);
    if (!b) return 1;
    memset(b, 1, bytes); /* every page touched before timing */
    buf = b, share = bytes / (size_t)nth / 64 * 64;
    double best = 0.0;
    for (int r = 0; r < rounds; r++) {
        pthread_t t[256];
        const double t0 = now();
        for (int i = 1; i < nth; i++) pthread_create(&t[i], NULL, reader, (void *)(intptr_t)i);
        reader((void *)0);
        for (int i = 1; i < nth; i++) pthread_join(t[i], NULL);
        const double gbs = (double)(share * (size_t)nth) / (now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    printf("%.2f\n", best);
    free(b);
    return 0;
}
