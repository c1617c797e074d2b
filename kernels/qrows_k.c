/* Row kernels of the K-quants (qformats.h) against Q8_K activations: Q4_K, Q5_K and Q6_K. On
 * AVX2 each is ggml's x86 vec_dot for the format (arch/x86/quants.c): per super-block an exact
 * integer sum, scaled once by d_w * d_y, the mins through the activation's sums by 16; the weight
 * block is decoded once for all the activation rows. Elsewhere the same integers from the
 * sub-block dots of qdot.h (NEON or portable C). */

#include <stdint.h>

#include "cpu_half.h"
#include "qdot.h"
#include "qformats.h"
#include "qrows.h"

#ifdef KV_AVX2
/* Byte shuffles that broadcast scale pair i of 16 int16 (ggml's get_scale_shuffle_k4). */
static inline __m256i scale_shuffle_k4(int i) {
    static const uint8_t k[8][32] __attribute__((aligned(32))) = {
#define P(a) a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1
        {P(0), P(0)}, {P(2), P(2)}, {P(4), P(4)}, {P(6), P(6)}, {P(8), P(8)}, {P(10), P(10)}, {P(12), P(12)}, {P(14), P(14)},
#undef P
    };
    return _mm256_load_si256((const __m256i *)k[i]);
}

/* Byte shuffles that spread scales 2i and 2i + 1 of 16 int8 over 8 bytes each (get_scale_shuffle). */
static inline __m128i scale_shuffle_16(int i) {
    static const uint8_t k[8][16] __attribute__((aligned(16))) = {
#define P(a) a, a, a, a, a, a, a, a, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1
        {P(0)}, {P(2)}, {P(4)}, {P(6)}, {P(8)}, {P(10)}, {P(12)}, {P(14)},
#undef P
    };
    return _mm_load_si128((const __m128i *)k[i]);
}

/* The 8 sub-block scales of a Q4_K / Q5_K super-block as int16 pairs (both lanes), and its 8 mins. */
static inline void k_scales(const uint8_t *packed, __m256i *scales, __m128i *mins) {
    uint32_t utmp[4];
    unpack_k_scales(packed, utmp);
    const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32((int)utmp[3], (int)utmp[2], (int)utmp[1], (int)utmp[0]));
    *mins = _mm256_extracti128_si256(mins_and_scales, 1);
    const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
    *scales = _mm256_set_m128i(sc128, sc128);
}

/* The activation's sums by 32 (16 int16 by 16, added in pairs). */
static inline __m128i q8_sums32(const block_q8_K *y) {
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *)y->bsums);
    return _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
}

/* Q4_K and Q5_K: 8 sub-blocks of 32 unsigned values q[j] with 6-bit scales sc[j] and mins m[j]. */
static inline __attribute__((always_inline)) void rows_q45_K(int type, const uint8_t *w, int64_t nb,
                                                             const uint8_t *const *act, float *out, const int R) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[8];
    __m128 acc_m[8];
    float summs[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), acc_m[r] = _mm_setzero_ps(), summs[r] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *qs, *scales_packed;
        uint16_t hd, hdmin;
        __m256i hbits = _mm256_setzero_si256();
        if (type == T_Q4_K) {
            const block_q4_K *x = (const block_q4_K *)w + i;
            qs = x->qs, scales_packed = x->scales, hd = x->d, hdmin = x->dmin;
        } else {
            const block_q5_K *x = (const block_q5_K *)w + i;
            qs = x->qs, scales_packed = x->scales, hd = x->d, hdmin = x->dmin;
            hbits = _mm256_loadu_si256((const __m256i *)x->qh);
        }
        const float dw = half_to_float(hd), dminw = half_to_float(hdmin);
        __m256i scales, q[8], sc[8];
        __m128i mins;
        k_scales(scales_packed, &scales, &mins);
        __m256i hmask = _mm256_set1_epi8(1);
        for (int j = 0; j < 4; j++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            q[2 * j] = _mm256_and_si256(bits, m4);
            q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            if (type == T_Q5_K)
                for (int h = 0; h < 2; h++) { /* ggml's order: mask, shift down to bit 0, up to bit 4 */
                    const int bit = 2 * j + h;
                    const __m256i hb = _mm256_srl_epi16(_mm256_and_si256(hbits, hmask), _mm_cvtsi32_si128(bit));
                    q[bit] = _mm256_add_epi8(q[bit], _mm256_slli_epi16(hb, 4));
                    hmask = _mm256_slli_epi16(hmask, 1);
                }
            sc[2 * j] = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j));
            sc[2 * j + 1] = _mm256_shuffle_epi8(scales, scale_shuffle_k4(2 * j + 1));
        }
        for (int r = 0; r < R; r++) {
            const block_q8_K *y = (const block_q8_K *)act[r] + i;
            const float d = y->d * dw, dmin = -y->d * dminw;
            const __m128i prod = _mm_madd_epi16(mins, q8_sums32(y));
            if (type == T_Q4_K) {
                acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r]);
            } else {
                const __m128i z = _mm_setzero_si128();
                const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(prod, z), z);
                summs[r] = fmaf(dmin, (float)_mm_cvtsi128_si32(hsum), summs[r]); /* contracted in ggml's build */
            }
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                const __m256i y0 = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * j));
                const __m256i y1 = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * j + 32));
                const __m256i p0 = _mm256_madd_epi16(sc[j], _mm256_maddubs_epi16(q[j], y0));
                const __m256i p1 = _mm256_madd_epi16(sc[j + 1], _mm256_maddubs_epi16(q[j + 1], y1));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (type == T_Q4_K) {
            __m128 m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
            m = _mm_add_ss(m, _mm_movehdup_ps(m));
            out[r] = hsum(acc[r]) + _mm_cvtss_f32(m);
        } else {
            out[r] = hsum(acc[r]) + summs[r];
        }
    }
}

static inline __attribute__((always_inline)) void rows_q6_K(int type, const uint8_t *w, int64_t nb,
                                                            const uint8_t *const *act, float *out, const int R) {
    (void)type;
    __m256 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const block_q6_K *x = (const block_q6_K *)w + i;
        const float dw = half_to_float(x->d);
        const __m128i scales = _mm_loadu_si128((const __m128i *)x->scales);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        __m256i q[8], sc[8];
        q6_K_values(x, q);
        for (int m = 0; m < 8; m++) sc[m] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, scale_shuffle_16(m)));
        for (int r = 0; r < R; r++) {
            const block_q8_K *y = (const block_q8_K *)act[r] + i;
            const float d = y->d * dw;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)y->bsums);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5); /* 32 * sum(sc * y) */
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                const __m256i y0 = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * j));
                const __m256i y1 = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * j + 32));
                const __m256i p0 = _mm256_madd_epi16(sc[j], _mm256_maddubs_epi16(q[j], y0));
                const __m256i p1 = _mm256_madd_epi16(sc[j + 1], _mm256_maddubs_epi16(q[j + 1], y1));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
            }
            sumi = _mm256_sub_epi32(sumi, q8sclsub);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}
#else
/* NEON or portable C: the sub-block dots of qdot.h, each super-block's scaled as ggml's generic code. */
static inline void rows_q45_K(int type, const uint8_t *w, int64_t nb, const uint8_t *const *act, float *out,
                              const int R) {
    for (int r = 0; r < R; r++) {
        float sumf = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const block_q8_K *y = (const block_q8_K *)act[r] + i;
            const uint8_t *qs, *scales, *qh = NULL;
            uint16_t hd, hdmin;
            if (type == T_Q4_K) {
                const block_q4_K *x = (const block_q4_K *)w + i;
                qs = x->qs, scales = x->scales, hd = x->d, hdmin = x->dmin;
            } else {
                const block_q5_K *x = (const block_q5_K *)w + i;
                qs = x->qs, scales = x->scales, hd = x->d, hdmin = x->dmin, qh = x->qh;
            }
            int dots[8], sumi = 0, summ = 0;
            sub_dots_q45_K(qs, qh, y->qs, dots);
            for (int j = 0; j < 8; j++) {
                int sc, m;
                scale_min_k4(j, scales, &sc, &m);
                sumi += sc * dots[j];
                summ += m * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
            }
            sumf += y->d * half_to_float(hd) * (float)sumi - y->d * half_to_float(hdmin) * (float)summ;
        }
        out[r] = sumf;
    }
}

static inline void rows_q6_K(int type, const uint8_t *w, int64_t nb, const uint8_t *const *act, float *out,
                             const int R) {
    (void)type;
    for (int r = 0; r < R; r++) {
        float sumf = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const block_q6_K *x = (const block_q6_K *)w + i;
            const block_q8_K *y = (const block_q8_K *)act[r] + i;
            int dots[16], sumi = 0;
            sub_dots_q6_K(x, y->qs, dots);
            for (int g = 0; g < 16; g++) sumi += x->scales[g] * (dots[g] - 32 * y->bsums[g]); /* q - 32 */
            sumf += y->d * half_to_float(x->d) * (float)sumi;
        }
        out[r] = sumf;
    }
}
#endif

ROW_VARIANTS(rows_q4_K, rows_q45_K, T_Q4_K)
ROW_VARIANTS(rows_q5_K, rows_q45_K, T_Q5_K)
ROW_VARIANTS(rows_q6_K, rows_q6_K, T_Q6_K)
