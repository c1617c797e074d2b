/* y = x @ W.T for the GGUF formats Q2_K, Q3_K, IQ4_XS and IQ4_NL, over their blocks as they lie
 * in the file, computed as llama.cpp's CPU backend does: each activation row is quantized to
 * the format's dot-product type (ggml's vec_dot_type), Q8_K for Q2_K, Q3_K and IQ4_XS (per 256
 * elements: scale max / -127 of the element of largest magnitude, sums per 16), Q8_0 for IQ4_NL
 * (per 32: an fp16 scale max|x| / 127); a weight row's integer dot product with it is summed per
 * super-block (per block for IQ4_NL) and scaled once there.
 *
 * Formats (256 elements a super-block; IQ4_NL 32 a block):
 *   Q2_K   per 16 elements (d * sc) * q - dmin * m, q 0..3, 4-bit sc and m
 *   Q3_K   per 16 elements d * (sc - 32) * q, q -4..3 (2 low bits and a high-bit mask), 6-bit sc
 *   IQ4_XS per 32 elements d * (sc - 32) * v[q], v the 16 non-linear values, 6-bit sc
 *   IQ4_NL d * v[q]
 * qmatmul.c hands calls of these formats here (kvb_matmul); kernels/qmatmul_lowbit.py holds the
 * specification in torch. AVX2 where the compiler targets it, portable C otherwise: the same
 * integer sums, float sums in another order. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_kernels.h"
#include "cpu_pool.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1
#endif

enum { T_Q2_K = 10, T_Q3_K = 11, T_IQ4_NL = 20, T_IQ4_XS = 23 };
#define QB 32   /* elements of a Q8_0 / IQ4_NL block */
#define QSB 256 /* elements of a K super-block (Q8_K) */
#define NR 8    /* activation rows per pass over a weight row */
#define MAX_SEGS 8
#define PREFETCH_ROWS 8

static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

int kvb_supported(int type) { return type == T_Q2_K || type == T_Q3_K || type == T_IQ4_NL || type == T_IQ4_XS; }

static int uses_q8_k(int type) { return type != T_IQ4_NL; }

/* ---------------------------------------------------------------- activations */
/* ggml's round to nearest (ties to even) for |v| < 2^22. */
static inline int nearest_int(float v) {
    const float f = v + 12582912.f;
    int i;
    memcpy(&i, &f, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

/* ggml's quantize_row_q8_K (quantize_row_q8_K_ref on x86): per 256 elements, the element of
 * largest magnitude (the first of equals) sets iscale = -127 / max, q = min(127, round(iscale *
 * x)), d = 1 / iscale, and bsums the sums of q per 16. A block of zeros is d = 0, q = 0. */
static void quantize_row_q8_K(const float *x, int64_t k, int8_t *q, float *d, int16_t *bsums) {
    for (int64_t b = 0; b < k / QSB; b++) {
        const float *xb = x + b * QSB;
        int8_t *qb = q + b * QSB;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QSB; j++) {
            const float ax = fabsf(xb[j]);
            if (ax > amax) amax = ax, max = xb[j];
        }
        if (amax == 0.0f) {
            d[b] = 0.0f;
            memset(qb, 0, QSB);
            memset(bsums + b * (QSB / 16), 0, sizeof(int16_t) * (QSB / 16));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QSB; j++) {
            const int v = nearest_int(iscale * xb[j]);
            qb[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < QSB / 16; j++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) sum += qb[16 * j + l];
            bsums[b * (QSB / 16) + j] = (int16_t)sum;
        }
        d[b] = 1 / iscale;
    }
}

/* ggml's quantize_row_q8_0 on x86: per 32 elements d = max|x| / 127 kept as a half, q =
 * round(x * 127 / max|x|) to nearest even; d here is the half's value. */
static void quantize_row_q8_0_half(const float *x, int64_t k, int8_t *q, float *d) {
    for (int64_t b = 0; b < k / QB; b++) {
        const float *xb = x + b * QB;
        float amax = 0.0f;
        for (int j = 0; j < QB; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        for (int j = 0; j < QB; j++) q[b * QB + j] = (int8_t)nearbyintf(xb[j] * id);
        d[b] = half_to_float(float_to_half(amax / 127.f));
    }
}

/* ---------------------------------------------------------------- dot products */
/* One weight row (nb super-blocks, or blocks for IQ4_NL) against nr activation rows r: qx[r]
 * their int8 values, dx[r] their scales, bs[r] their sums per 16 (Q8_K); out[r] the results.
 * Each row's sums run in one order whatever nr is, so a row's bits do not depend on the rows
 * that share its pass. */
typedef void (*dot_fn)(const uint8_t *w, int64_t nb, const int8_t *const *qx, const float *const *dx,
                       const int16_t *const *bs, int nr, float *out);

/* The 16 scales of a Q3_K super-block, each minus 32. */
static inline void q3_k_scales(const uint8_t *s, int8_t *sc) {
    for (int j = 0; j < 16; j++) {
        const int lo = (j < 8 ? s[j] : s[j - 8] >> 4) & 0xF;
        const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

/* The 6-bit scale of sub-block ib of an IQ4_XS super-block, minus 32. */
static inline int iq4_xs_scale(const uint8_t *b, int ib) {
    uint16_t h;
    memcpy(&h, b + 2, 2);
    return (((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((h >> (2 * ib)) & 3) << 4)) - 32;
}

#ifdef KV_AVX2
static inline __m256i nibbles32(const uint8_t *p) { /* 16 bytes -> 32 values, low nibbles first */
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0xF));
}

/* Scales per int16 lane of a maddubs result over 32 elements: lo for elements 0-15, hi for 16-31. */
static inline __m256i pair_scales(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo));
}

/* sum(w * x) of 32 signed weights and 32 activations, as 8 int32 lanes weighted by `pw`. */
static inline __m256i dot32_signed(__m256i w, __m256i x, __m256i pw) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), pw);
}

static void dot_q2_k(const uint8_t *w, int64_t nb, const int8_t *const *qx, const float *const *dx,
                     const int16_t *const *bs, int nr, float *out) {
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 84, *sc = b, *qs = b + 16;
        const float d = load_half(b + 80), dmin = load_half(b + 82);
        __m256i wq[8], pw[8];
        for (int h = 0; h < 2; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int u = 4 * h + s;
                wq[u] = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * s), m3);
                pw[u] = pair_scales(sc[2 * u] & 0xF, sc[2 * u + 1] & 0xF);
            }
        }
        const __m128i sm = _mm_loadu_si128((const __m128i *)sc);
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), _mm_set1_epi8(0xF)));
        for (int r = 0; r < nr; r++) {
            const int8_t *q8 = qx[r] + i * QSB;
            __m256i sumi = _mm256_setzero_si256();
            for (int u = 0; u < 8; u++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(q8 + 32 * u));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(wq[u], x), pw[u]));
            }
            const __m256i prod = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)(bs[r] + i * 16)));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(-dx[r][i] * dmin), _mm256_cvtepi32_ps(prod), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx[r][i] * d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]);
}

static void dot_q3_k(const uint8_t *w, int64_t nb, const int8_t *const *qx, const float *const *dx,
                     const int16_t *const *bs, int nr, float *out) {
    (void)bs;
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 110, *qs = b + 32;
        const float d = load_half(b + 108);
        int8_t sc[16];
        q3_k_scales(b + 96, sc);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        __m256i wq[8], pw[8];
        for (int h = 0; h < 2; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int s = 0; s < 4; s++) {
                const int u = 4 * h + s;
                const __m256i bit = _mm256_set1_epi8((char)(1 << u));
                const __m256i unset = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * s), m3);
                wq[u] = _mm256_sub_epi8(lo, _mm256_and_si256(unset, four));
                pw[u] = pair_scales(sc[2 * u], sc[2 * u + 1]);
            }
        }
        for (int r = 0; r < nr; r++) {
            const int8_t *q8 = qx[r] + i * QSB;
            __m256i sumi = _mm256_setzero_si256();
            for (int u = 0; u < 8; u++)
                sumi = _mm256_add_epi32(sumi, dot32_signed(wq[u], _mm256_loadu_si256((const __m256i *)(q8 + 32 * u)), pw[u]));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dx[r][i] * d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]);
}

static void dot_iq4_xs(const uint8_t *w, int64_t nb, const int8_t *const *qx, const float *const *dx,
                       const int16_t *const *bs, int nr, float *out) {
    (void)bs;
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4_values));
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 136;
        const float d = load_half(b);
        __m256i wq[8], pw[8];
        for (int ib = 0; ib < 8; ib++) {
            wq[ib] = _mm256_shuffle_epi8(values, nibbles32(b + 8 + 16 * ib));
            pw[ib] = _mm256_set1_epi16((short)iq4_xs_scale(b, ib));
        }
        for (int r = 0; r < nr; r++) {
            const int8_t *q8 = qx[r] + i * QSB;
            __m256i sumi = _mm256_setzero_si256();
            for (int u = 0; u < 8; u++)
                sumi = _mm256_add_epi32(sumi, dot32_signed(wq[u], _mm256_loadu_si256((const __m256i *)(q8 + 32 * u)), pw[u]));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r][i]), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]);
}

static void dot_iq4_nl(const uint8_t *w, int64_t nb, const int8_t *const *qx, const float *const *dx,
                       const int16_t *const *bs, int nr, float *out) {
    (void)bs;
    __m256 acc[NR];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4_values));
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 18;
        const float d = load_half(b);
        const __m256i wq = _mm256_shuffle_epi8(values, nibbles32(b + 2));
        for (int r = 0; r < nr; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(qx[r] + i * QB));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[r][i]), _mm256_cvtepi32_ps(dot32_signed(wq, x, ones)), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) out[r] = hsum(acc[r]);
}
#else
/* Portable: each super-block's integer sum, scaled and added in order. */
static void dot_q2_k(const uint8_t *w, int64_t nb, const int8_t *const *qx, const float *const *dx,
                     const int16_t *const *bs, int nr, float *out) {
    for (int r = 0; r < nr; r++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 84, *sc = b, *qs = b + 16;
            const int8_t *q8 = qx[r] + i * QSB;
            int isum = 0, summs = 0;
            for (int e = 0; e < QSB; e++) {
                const int h = e / 128, s = (e % 128) / 32, l = e % 32;
                isum += (sc[e / 16] & 0xF) * ((qs[32 * h + l] >> (2 * s)) & 3) * q8[e];
            }
            for (int j = 0; j < 16; j++) summs += bs[r][i * 16 + j] * (sc[j] >> 4);
            acc += -dx[r][i] * load_half(b + 82) * (float)summs;
            acc += dx[r][i] * load_half(b + 80) * (float)isum;
        }
        out[r] = acc;
    }
}

static void dot_q3_k(const uint8_t *w, int64_t nb, const int8_t *const *qx, const float *const *dx,
                     const int16_t *const *bs, int nr, float *out) {
    (void)bs;
    for (int r = 0; r < nr; r++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 110, *qs = b + 32;
            const int8_t *q8 = qx[r] + i * QSB;
            int8_t sc[16];
            q3_k_scales(b + 96, sc);
            int isum = 0;
            for (int e = 0; e < QSB; e++) {
                const int h = e / 128, s = (e % 128) / 32, l = e % 32;
                const int q = ((qs[32 * h + l] >> (2 * s)) & 3) - ((b[l] >> (4 * h + s)) & 1 ? 0 : 4);
                isum += sc[e / 16] * q * q8[e];
            }
            acc += dx[r][i] * load_half(b + 108) * (float)isum;
        }
        out[r] = acc;
    }
}

static void dot_iq4_xs(const uint8_t *w, int64_t nb, const int8_t *const *qx, const float *const *dx,
                       const int16_t *const *bs, int nr, float *out) {
    (void)bs;
    for (int r = 0; r < nr; r++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 136;
            const int8_t *q8 = qx[r] + i * QSB;
            int isum = 0;
            for (int ib = 0; ib < 8; ib++) {
                const uint8_t *qs = b + 8 + 16 * ib;
                int s = 0;
                for (int j = 0; j < 16; j++)
                    s += iq4_values[qs[j] & 0xF] * q8[32 * ib + j] + iq4_values[qs[j] >> 4] * q8[32 * ib + 16 + j];
                isum += iq4_xs_scale(b, ib) * s;
            }
            acc += load_half(b) * dx[r][i] * (float)isum;
        }
        out[r] = acc;
    }
}

static void dot_iq4_nl(const uint8_t *w, int64_t nb, const int8_t *const *qx, const float *const *dx,
                       const int16_t *const *bs, int nr, float *out) {
    (void)bs;
    for (int r = 0; r < nr; r++) {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 18, *qs = b + 2;
            const int8_t *q8 = qx[r] + i * QB;
            int s = 0;
            for (int j = 0; j < 16; j++) s += iq4_values[qs[j] & 0xF] * q8[j] + iq4_values[qs[j] >> 4] * q8[16 + j];
            acc += load_half(b) * dx[r][i] * (float)s;
        }
        out[r] = acc;
    }
}
#endif

static dot_fn dot_for(int type) {
    switch (type) {
    case T_Q2_K: return dot_q2_k;
    case T_Q3_K: return dot_q3_k;
    case T_IQ4_XS: return dot_iq4_xs;
    default: return dot_iq4_nl;
    }
}

/* ---------------------------------------------------------------- the matmul */
typedef struct {
    int type;
    int64_t row_bytes, k, n, n_out, nb; /* nb: scale blocks per row (super-blocks, or IQ4_NL blocks) */
    const uint8_t *w[MAX_SEGS];
    int64_t seg_end[MAX_SEGS];
    const float *x, *norm_w;
    int64_t ldx;
    float eps;
    int8_t *qx;  /* [n, k] */
    float *dx;   /* [n, nb] */
    int16_t *bs; /* [n, k / 16] (Q8_K) */
    float *y;
    int64_t ldy;
    int failed;
} job_t;

/* Activation rows [i0, i1) quantized (RMS-normed first where norm_w is given): a pool task. */
static void quantize_rows(void *ctx, int64_t i0, int64_t i1) {
    job_t *J = ctx;
    float *normed = J->norm_w ? malloc(sizeof(float) * (size_t)J->k) : NULL;
    if (J->norm_w && !normed) {
        J->failed = 1; /* only ever set: a benign race */
        return;
    }
    for (int64_t i = i0; i < i1; i++) {
        const float *xi = J->x + i * J->ldx;
        if (normed) {
            rms_norm_row(xi, J->k, J->norm_w, J->eps, normed);
            xi = normed;
        }
        if (uses_q8_k(J->type))
            quantize_row_q8_K(xi, J->k, J->qx + i * J->k, J->dx + i * J->nb, J->bs + i * (J->k / 16));
        else
            quantize_row_q8_0_half(xi, J->k, J->qx + i * J->k, J->dx + i * J->nb);
    }
    free(normed);
}

/* Weight rows [o0, o1) against every activation row: a pool task. */
static void matmul_rows(void *ctx, int64_t o0, int64_t o1) {
    const job_t *J = ctx;
    const dot_fn fn = dot_for(J->type);
    const int q8k = uses_q8_k(J->type);
    for (int64_t i0 = 0; i0 < J->n; i0 += NR) {
        const int nr = J->n - i0 < NR ? (int)(J->n - i0) : NR;
        const int8_t *qx[NR];
        const float *dx[NR];
        const int16_t *bs[NR];
        for (int r = 0; r < nr; r++) {
            qx[r] = J->qx + (i0 + r) * J->k, dx[r] = J->dx + (i0 + r) * J->nb;
            bs[r] = q8k ? J->bs + (i0 + r) * (J->k / 16) : NULL;
        }
        int seg = 0;
        for (int64_t o = o0; o < o1; o++) {
            while (o >= J->seg_end[seg]) seg++;
            const int64_t row = o - (seg ? J->seg_end[seg - 1] : 0);
            if (i0 == 0 && o + PREFETCH_ROWS < J->seg_end[seg]) {
                const uint8_t *ahead = J->w[seg] + (row + PREFETCH_ROWS) * J->row_bytes;
                for (int64_t b = 0; b < J->row_bytes; b += 64) __builtin_prefetch(ahead + b);
            }
            float out[NR];
            fn(J->w[seg] + row * J->row_bytes, J->nb, qx, dx, bs, nr, out);
            for (int r = 0; r < nr; r++) J->y[(i0 + r) * J->ldy + o] = out[r];
        }
    }
}

/* y = x @ W.T (qmatmul.c's matmul, whose arguments these are) for the formats of this file: x
 * [n, k] float32 rows ldx apart (RMS-normed with norm_w first unless it is NULL), W the nseg
 * weights ws[s] of seg_rows[s] rows each stacked along n_out, y rows ldy apart. k must be a
 * multiple of the format's block (256; 32 for IQ4_NL). Returns 0, or -1 for a bad call. */
int kvb_matmul(int type, const uint8_t *const *ws, const int64_t *seg_rows, int nseg, int64_t row_bytes, int64_t k,
               const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy, const float *norm_w, float eps) {
    const int64_t block = uses_q8_k(type) ? QSB : QB;
    if (!kvb_supported(type) || k <= 0 || k % block || n < 0 || nseg < 1 || nseg > MAX_SEGS) return -1;
    job_t J = {.type = type, .row_bytes = row_bytes, .k = k, .n = n, .nb = k / block, .x = x, .norm_w = norm_w,
               .ldx = ldx, .eps = eps, .y = y, .ldy = ldy};
    for (int s = 0; s < nseg; s++) {
        if (seg_rows[s] < 0) return -1;
        J.w[s] = ws[s];
        J.n_out += seg_rows[s];
        J.seg_end[s] = J.n_out;
    }
    if (n == 0 || J.n_out == 0) return 0;
    J.qx = malloc((size_t)(n * k));
    J.dx = malloc(sizeof(float) * (size_t)(n * J.nb));
    J.bs = uses_q8_k(type) ? malloc(sizeof(int16_t) * (size_t)(n * (k / 16))) : NULL;
    if (!J.qx || !J.dx || (uses_q8_k(type) && !J.bs)) {
        free(J.qx), free(J.dx), free(J.bs);
        return -1;
    }
    kv_parallel(quantize_rows, &J, n, 1);
    if (!J.failed) kv_parallel(matmul_rows, &J, J.n_out, 4);
    free(J.qx), free(J.dx), free(J.bs);
    return J.failed ? -1 : 0;
}
