/* Activation rows quantized for the block matmuls, as ggml's CPU backend quantizes them: each
 * weight format multiplies activations of one "vec_dot type" (ggml-cpu.c's type_traits_cpu):
 * Q8_0 for Q4_0, Q5_0 and Q8_0, Q8_1 for Q4_1, Q8_K for the K-quants. The blocks have ggml's
 * layouts (ggml-common.h), so a kernel ported from ggml reads them as ggml's does. */
#ifndef KVTOOL_Q8_ACT_H
#define KVTOOL_Q8_ACT_H

#include <stdint.h>

#define QK8 32   /* elements of a Q8_0 / Q8_1 block */
#define QK_K 256 /* elements of a K-quant super-block (and of a Q8_K block) */

typedef struct {
    uint16_t d; /* half: amax / 127 */
    int8_t qs[QK8];
} block_q8_0;

typedef struct {
    uint16_t d; /* half: amax / 127 */
    uint16_t s; /* half: d * sum(qs), d before its rounding to a half */
    int8_t qs[QK8];
} block_q8_1;

typedef struct {
    float d; /* 1 / iscale: the sign of the block's largest |x| flipped, over 127 */
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16]; /* sums of qs by 16 */
} block_q8_K;

/* The vec_dot types (ggml's type ids). */
enum { VDT_Q8_0 = 8, VDT_Q8_1 = 9, VDT_Q8_K = 15 };

/* One row of k floats (k a multiple of the block) -> k / 32 or k / 256 blocks, with the numbers
 * of ggml's x86 quantize_row_q8_0 / q8_1 (scale 127 / amax, ties to even) and of
 * quantize_row_q8_K_ref (iscale -127 / the largest |x| with its sign, ties to even). */
void kvq_quantize_row_q8_0(const float *x, block_q8_0 *y, int64_t k);
void kvq_quantize_row_q8_1(const float *x, block_q8_1 *y, int64_t k);
void kvq_quantize_row_q8_K(const float *x, block_q8_K *y, int64_t k);

/* Bytes of one row of k elements in a vec_dot type. */
int64_t kvq_act_row_bytes(int vdt, int64_t k);

/* Quantizes a row into the vec_dot type `vdt`. */
void kvq_quantize_row(int vdt, const float *x, void *y, int64_t k);

#endif
