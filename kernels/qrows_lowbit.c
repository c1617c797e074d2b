/* Row kernels of the low-bit formats (qformats.h): Q2_K, Q3_K and IQ4_XS against Q8_K
 * activations, IQ4_NL against Q8_0, as ggml pairs them (its vec_dot_type). Per super-block (per
 * block for IQ4_NL) an exact integer sum, scaled once by d_w * d_y, Q2_K's mins through the
 * activation's sums by 16; the weight block is decoded once for all the activation rows, and
 * each row's floats are added in one order whatever the number of rows. Portable C sums the same
 * integers (qdot.h, NEON or plain C). kernels/qmatmul.py's qmatmul_ref is the specification. */

#include <stdint.h>

#include "cpu_half.h"
#include "qdot.h"
#include "qformats.h"
#include "qrows.h"

#ifdef KV_AVX2
/* Scales per int16 lane of a maddubs result over 32 elements: lo for elements 0-15, hi for 16-31. */
static inline __m256i pair_scales(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}

/* sum(w * x) of 32 signed weights and 32 activations, as 8 int32 lanes weighted by `pw`. */
static inline __m256i dot32_signed(__m256i w, __m256i x, __m256i pw) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), pw);
}

/* The 8 vectors of 32 weights of a Q2_K, Q3_K or IQ4_XS super-block and the int16 scales of
 * each one's two halves (Q2_K: unsigned weights; the others signed). */
static inline __attribute__((always_inline)) void decode_k(int type, const uint8_t *w, int64_t i, __m256i wq[8],
                                                          __m256i pw[8], float *dw) {
    if (type == T_Q2_K) {
        const block_q2_K *x = (const block_q2_K *)w + i;
        *dw = half_to_float(x->d);
        for (int h = 0; h < 2; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int u = 4 * h + s;
                wq[u] = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * s), _mm256_set1_epi8(3));
                pw[u] = pair_scales(x->scales[2 * u] & 0xF, x->scales[2 * u + 1] & 0xF);
            }
        }
    } else if (type == T_Q3_K) {
        const block_q3_K *x = (const block_q3_K *)w + i;
        *dw = half_to_float(x->d);
        int8_t sc[16];
        q3_k_scales(x->scales, sc);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)x->hmask);
        for (int h = 0; h < 2; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int u = 4 * h + s;
                const __m256i bit = _mm256_set1_epi8((char)(1 << u));
                const __m256i unset = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * s), _mm256_set1_epi8(3));
                wq[u] = _mm256_sub_epi8(lo, _mm256_and_si256(unset, _mm256_set1_epi8(4)));
                pw[u] = pair_scales(sc[2 * u], sc[2 * u + 1]);
            }
        }
    } else {
        const block_iq4_xs *x = (const block_iq4_xs *)w + i;
        *dw = half_to_float(x->d);
        const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4_values()));
        for (int ib = 0; ib < 8; ib++) {
            wq[ib] = _mm256_shuffle_epi8(values, nibbles32(x->qs + 16 * ib));
            pw[ib] = _mm256_set1_epi16((short)iq4_xs_scale(x, ib));
        }
    }
}

static inline __attribute__((always_inline)) void rows_q8_K(int type, const uint8_t *w, int64_t nb,
                                                            const uint8_t *const *act, float *out, const int R) {
    __m256 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        __m256i wq[8], pw[8], mins = _mm256_setzero_si256();
        float dw, dmin = 0.0f;
        decode_k(type, w, i, wq, pw, &dw);
        if (type == T_Q2_K) {
            const block_q2_K *x = (const block_q2_K *)w + i;
            const __m128i sm = _mm_loadu_si128((const __m128i *)x->scales);
            mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), _mm_set1_epi8(0xF)));
            dmin = half_to_float(x->dmin);
        }
        for (int r = 0; r < R; r++) {
            const block_q8_K *y = (const block_q8_K *)act[r] + i;
            __m256i sumi = _mm256_setzero_si256();
            for (int u = 0; u < 8; u++) {
                const __m256i q8 = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * u));
                sumi = _mm256_add_epi32(sumi, type == T_Q2_K ? _mm256_madd_epi16(_mm256_maddubs_epi16(wq[u], q8), pw[u])
                                                             : dot32_signed(wq[u], q8, pw[u]));
            }
            if (type == T_Q2_K) {
                const __m256i prod = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)y->bsums));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(-y->d * dmin), _mm256_cvtepi32_ps(prod), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(y->d * dw), _mm256_cvtepi32_ps(sumi), acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * y->d), _mm256_cvtepi32_ps(sumi), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

/* ggml's order: even and odd blocks in two accumulators, added at the end; an odd last block
 * in scalar float. */
static inline __attribute__((always_inline)) void rows_iq4_nl(int type, const uint8_t *w, int64_t nb,
                                                              const uint8_t *const *act, float *out, const int R) {
    (void)type;
    __m256 acc[8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4_values()));
    int64_t i = 0;
    for (; i + 1 < nb; i += 2) {
        for (int b = 0; b < 2; b++) {
            const block_iq4_nl *x = (const block_iq4_nl *)w + i + b;
            const float dw = half_to_float(x->d);
            const __m256i wq = _mm256_shuffle_epi8(values, nibbles32(x->qs));
            for (int r = 0; r < R; r++) {
                const block_q8_0 *y = (const block_q8_0 *)act[r] + i + b;
                const __m256i q8 = _mm256_loadu_si256((const __m256i *)y->qs);
                acc[r][b] = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(y->d) * dw),
                                            _mm256_cvtepi32_ps(dot32_signed(wq, q8, _mm256_set1_epi16(1))), acc[r][b]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        float sum = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        if (i < nb) {
            const block_iq4_nl *x = (const block_iq4_nl *)w + i;
            const block_q8_0 *y = (const block_q8_0 *)act[r] + i;
            int s = 0;
            for (int j = 0; j < 16; j++)
                s += iq4_values()[x->qs[j] & 0xF] * y->qs[j] + iq4_values()[x->qs[j] >> 4] * y->qs[16 + j];
            sum += half_to_float(y->d) * half_to_float(x->d) * (float)s;
        }
        out[r] = sum;
    }
}
#else
/* NEON or portable C: the integer dots of qdot.h, each super-block's scaled in one order. */
static inline void rows_q8_K(int type, const uint8_t *w, int64_t nb, const uint8_t *const *act, float *out,
                             const int R) {
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const block_q8_K *y = (const block_q8_K *)act[r] + i;
            int isum = 0;
            if (type == T_Q2_K) {
                const block_q2_K *x = (const block_q2_K *)w + i;
                int dots[16], summs = 0;
                sub_dots_q23_K(T_Q2_K, x->qs, NULL, y->qs, dots);
                for (int g = 0; g < 16; g++) isum += (x->scales[g] & 0xF) * dots[g], summs += y->bsums[g] * (x->scales[g] >> 4);
                acc += -y->d * half_to_float(x->dmin) * (float)summs;
                acc += y->d * half_to_float(x->d) * (float)isum;
            } else if (type == T_Q3_K) {
                const block_q3_K *x = (const block_q3_K *)w + i;
                int dots[16];
                int8_t sc[16];
                q3_k_scales(x->scales, sc);
                sub_dots_q23_K(T_Q3_K, x->qs, x->hmask, y->qs, dots);
                for (int g = 0; g < 16; g++) isum += sc[g] * dots[g];
                acc += half_to_float(x->d) * y->d * (float)isum;
            } else {
                const block_iq4_xs *x = (const block_iq4_xs *)w + i;
                for (int ib = 0; ib < 8; ib++) isum += iq4_xs_scale(x, ib) * dot_iq4(x->qs + 16 * ib, y->qs + 32 * ib);
                acc += half_to_float(x->d) * y->d * (float)isum;
            }
        }
        out[r] = acc;
    }
}

static inline void rows_iq4_nl(int type, const uint8_t *w, int64_t nb, const uint8_t *const *act, float *out,
                               const int R) {
    (void)type;
    for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const block_iq4_nl *x = (const block_iq4_nl *)w + i;
            const block_q8_0 *y = (const block_q8_0 *)act[r] + i;
            acc += half_to_float(x->d) * half_to_float(y->d) * (float)dot_iq4(x->qs, y->qs);
        }
        out[r] = acc;
    }
}
#endif

ROW_VARIANTS(rows_q2_K, rows_q8_K, T_Q2_K)
ROW_VARIANTS(rows_q3_K, rows_q8_K, T_Q3_K)
ROW_VARIANTS(rows_iq4_xs, rows_q8_K, T_IQ4_XS)
ROW_VARIANTS(rows_iq4_nl, rows_iq4_nl, T_IQ4_NL)
