/* The pair kernels: two activation rows a 512-bit vector, for 2 to 32 rows of Q4_0, Q5_0, Q8_0
 * (qrows_pair.c), Q4_K and Q6_K (qrows_pair_k.c) on AVX-512 VNNI. Each row's result has the bits
 * of the one-row kernel. */
#ifndef KVTOOL_QROWS_PAIR_H
#define KVTOOL_QROWS_PAIR_H

#include <stdint.h>

#include "qmatmul_job.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__F16C__)
#define KV_PAIR_KERNELS 1
#endif

#define PAIR_GROUP 4         /* pairs a pass over a weight row: 8 activation rows */
#define PAIR_PREFETCH_ROWS 8 /* weight rows ahead that the first group's pass asks memory for */

/* Pairs in group g of `npairs`: pairs come in groups of PAIR_GROUP, a group's blocks by block,
 * then pair. */
static inline int64_t pair_group_size(int64_t npairs, int64_t g) {
    return npairs - g * PAIR_GROUP < PAIR_GROUP ? npairs - g * PAIR_GROUP : PAIR_GROUP;
}

/* 1 where this build has the pair kernel for the format. */
int kvq_pair_format(int type);

/* Bytes of the paired activations of n rows (n / 2 pairs) of k elements for the format. */
int64_t kvq_pair_bytes(int type, int64_t n, int64_t k);

/* Rows 2p and 2p + 1 of J's quantized activations laid out as pair p of `pairs` (J->act set). */
void kvq_pair_prepare(const job_t *J, int64_t p, uint8_t *pairs);

/* y[i][o] for the first 2 * (n / 2) activation rows i and the weight rows o in [o0, o1). */
void kvq_pair_rows(const job_t *J, const uint8_t *pairs, int64_t o0, int64_t o1);

/* The K-quants' part (qrows_pair_k.c), behind the three above. */
int64_t kvq_pair_k_bytes(int64_t n, int64_t k);
void kvq_pair_k_prepare(const job_t *J, int64_t p, uint8_t *pairs);
void kvq_pair_k_rows(const job_t *J, const uint8_t *pairs, int64_t o0, int64_t o1);

#endif
