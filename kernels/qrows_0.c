/* Row kernels of the 32-element formats (qformats.h): Q4_0, Q5_0 and Q8_0 against Q8_0
 * activations, Q4_1 against Q8_1. On AVX2 each is ggml's x86 vec_dot for the format (arch/x86/
 * quants.c) with the weight block decoded once for all the activation rows; elsewhere
 * ggml's generic code over the integer dots of qdot.h (NEON or portable C, the same bits). */

#include <stdint.h>

#include "cpu_half.h"
#include "qdot.h"
#include "qformats.h"
#include "qrows.h"

#ifdef KV_AVX2
/* Signed 4- or 5-bit weights (Q4_0, Q5_0) and Q8_0 weights: per block d_w * d_y times the
 * integer dot, summed in 8 lanes, then across them. */
static inline __attribute__((always_inline)) void rows_signed(int type, const uint8_t *w, int64_t nb,
                                                              const uint8_t *const *act, float *out, const int R) {
    __m256 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < nb; ib++) {
        float dw;
        __m256i qx;
        if (type == T_Q4_0) {
            const block_q4_0 *x = (const block_q4_0 *)w + ib;
            dw = half_to_float(x->d);
            qx = _mm256_sub_epi8(nibbles32(x->qs), _mm256_set1_epi8(8));
        } else if (type == T_Q5_0) {
            const block_q5_0 *x = (const block_q5_0 *)w + ib;
            dw = half_to_float(x->d);
            qx = _mm256_or_si256(nibbles32(x->qs), _mm256_andnot_si256(bits32(x->qh), _mm256_set1_epi8((char)0xF0)));
        } else {
            const block_q8_0 *x = (const block_q8_0 *)w + ib;
            dw = half_to_float(x->d);
            qx = _mm256_loadu_si256((const __m256i *)x->qs);
        }
        const __m256i ax = _mm256_sign_epi8(qx, qx);
        for (int r = 0; r < R; r++) {
            const block_q8_0 *y = (const block_q8_0 *)act[r] + ib;
            const __m256 d = _mm256_set1_ps(dw * half_to_float(y->d));
            const __m256i sy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y->qs), qx);
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_u8_i8(ax, sy)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

static inline __attribute__((always_inline)) void rows_q4_1(int type, const uint8_t *w, int64_t nb,
                                                            const uint8_t *const *act, float *out, const int R) {
    (void)type;
    __m256 acc[8];
    float summs[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), summs[r] = 0.0f;
    for (int64_t ib = 0; ib < nb; ib++) {
        const block_q4_1 *x = (const block_q4_1 *)w + ib;
        const float d0 = half_to_float(x->d), m0 = half_to_float(x->m);
        const __m256i qx = nibbles32(x->qs);
        for (int r = 0; r < R; r++) {
            const block_q8_1 *y = (const block_q8_1 *)act[r] + ib;
            summs[r] = fmaf(m0, half_to_float(y->s), summs[r]); /* ggml's build contracts it so */
            const __m256 d = _mm256_set1_ps(d0 * half_to_float(y->d));
            const __m256i qy = _mm256_loadu_si256((const __m256i *)y->qs);
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_u8_i8(qx, qy)), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) + summs[r];
}
#else
/* NEON or portable C: the integer dots of qdot.h, each block's scaled as ggml's generic code. */
static inline void rows_signed(int type, const uint8_t *w, int64_t nb, const uint8_t *const *act, float *out,
                               const int R) {
    for (int r = 0; r < R; r++) {
        float sumf = 0.0f;
        for (int64_t ib = 0; ib < nb; ib++) {
            const block_q8_0 *y = (const block_q8_0 *)act[r] + ib;
            int sumi;
            float dw;
            if (type == T_Q4_0) {
                const block_q4_0 *x = (const block_q4_0 *)w + ib;
                dw = half_to_float(x->d), sumi = dot_q4_0(x, y->qs);
            } else if (type == T_Q5_0) {
                const block_q5_0 *x = (const block_q5_0 *)w + ib;
                dw = half_to_float(x->d), sumi = dot_q5_0(x, y->qs);
            } else {
                const block_q8_0 *x = (const block_q8_0 *)w + ib;
                dw = half_to_float(x->d), sumi = dot_q8_0(x, y->qs);
            }
            sumf += (float)sumi * dw * half_to_float(y->d);
        }
        out[r] = sumf;
    }
}

static inline void rows_q4_1(int type, const uint8_t *w, int64_t nb, const uint8_t *const *act, float *out,
                             const int R) {
    (void)type;
    for (int r = 0; r < R; r++) {
        float sumf = 0.0f;
        for (int64_t ib = 0; ib < nb; ib++) {
            const block_q4_1 *x = (const block_q4_1 *)w + ib;
            const block_q8_1 *y = (const block_q8_1 *)act[r] + ib;
            const int sumi = dot_q4_1(x, y->qs);
            sumf += half_to_float(x->d) * half_to_float(y->d) * (float)sumi + half_to_float(x->m) * half_to_float(y->s);
        }
        out[r] = sumf;
    }
}
#endif

ROW_VARIANTS(rows_q4_0, rows_signed, T_Q4_0)
ROW_VARIANTS(rows_q4_1, rows_q4_1, T_Q4_1)
ROW_VARIANTS(rows_q5_0, rows_signed, T_Q5_0)
ROW_VARIANTS(rows_q8_0, rows_signed, T_Q8_0)
