/* y = x @ W.T for W in GGUF block formats, computed as llama.cpp's CPU backend does: each row
 * of x is quantized to 8 bits per block of 32 (scale = max|x| / 127), then whole blocks are
 * integer dot products scaled by both blocks' scales. W stays in its file layout (the memory
 * map), so a decoded token reads 4-8 bits per weight instead of 32.
 *
 * Formats: Q4_0 (d * (q - 8)), Q4_1 (d * q + m), Q5_0 (d * (q - 16)), Q8_0 (d * q), Q4_K (per
 * 32-element sub-block d * sc * q - dmin * m), Q6_K (per 16 elements d * sc * (q - 32)). AVX2
 * when the compiler targets it, portable C otherwise; both give the same integer sums, and float
 * sums that differ only in order. Many rows of Q4_0, Q4_1, Q5_0 and Q4_K (prompts) take the
 * panel kernel on AVX2 (below).
 *
 * Threads: the pool of cpu_pool.c. kernels/cpu_lib.py compiles the kernels for the machine they
 * run on; kernels/qmatmul.py calls this file, and its qmatmul_ref is the specification. */

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

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };
#define QK 32
#define QK_K 256

/* ---------------------------------------------------------------- halves */
static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* ---------------------------------------------------------------- activations */
/* One row of k floats -> k int8 + per block: scale d and d * sum(q) (llama.cpp's q8_1). */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
#ifdef KV_AVX2
        /* the same numbers: the maximum is exact in any order, x * id rounds alike, and the
         * rounding to an integer is nearbyintf's (to nearest even) */
        __m256 v[4], m = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int r = 0; r < 4; r++) {
            v[r] = _mm256_loadu_ps(xb + 8 * r);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v[r]), m); /* a NaN leaves m, as fmaxf does */
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float db8 = _mm_cvtss_f32(m4) / 127.0f;
        const __m256 idv = _mm256_set1_ps(db8 != 0.0f ? 1.0f / db8 : 0.0f);
        __m256i iv[4];
        for (int r = 0; r < 4; r++)
            iv[r] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[r], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
        const __m256i p16 =
            _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(p16, order));
        d[b] = db8;
        s[b] = db8 * (float)_mm_cvtsi128_si32(t4);
#else
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float db = amax / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            const int v = (int)nearbyintf(xb[j] * id);
            q[b * QK + j] = (int8_t)v;
            sum += v;
        }
        d[b] = db;
        s[b] = db * (float)sum;
#endif
    }
}

/* ---------------------------------------------------------------- Q4_K scales */
/* The 6-bit scale and min of sub-block j (0..7) of a Q4_K super-block's 12 scale bytes. */
static inline void k_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* A format as 32-element units: unit u of a weight row has scale a, offset term c (added as
 * c * s_x, with s_x = d_x * sum(q_x)), and integer values given by the decoder. */
typedef struct {
    int type;
    int64_t row_bytes;
} wfmt;

/* ---------------------------------------------------------------- portable dot products */
#ifndef KV_AVX2
/* Integer dot of unit u of weight row w with 32 activation int8, plus its (a, c). */
static inline int unit_dot_scalar(const wfmt *f, const uint8_t *w, int64_t u, const int8_t *qx, float *a,
                                  float *c) {
    int sum = 0;
    switch (f->type) {
    case T_Q4_0: {
        const uint8_t *b = w + u * 18;
        *a = load_half(b);
        *c = 0.0f;
        for (int j = 0; j < 16; j++) {
            sum += ((b[2 + j] & 0xF) - 8) * qx[j];
            sum += ((b[2 + j] >> 4) - 8) * qx[j + 16];
        }
        break;
    }
    case T_Q4_1: {
        const uint8_t *b = w + u * 20;
        *a = load_half(b);
        *c = load_half(b + 2);
        for (int j = 0; j < 16; j++) {
            sum += (b[4 + j] & 0xF) * qx[j];
            sum += (b[4 + j] >> 4) * qx[j + 16];
        }
        break;
    }
    case T_Q5_0: {
        const uint8_t *b = w + u * 22;
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        *a = load_half(b);
        *c = 0.0f;
        for (int j = 0; j < 16; j++) {
            sum += (((b[6 + j] & 0xF) | (((qh >> j) & 1) << 4)) - 16) * qx[j];
            sum += (((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16) * qx[j + 16];
        }
        break;
    }
    case T_Q8_0: {
        const uint8_t *b = w + u * 34;
        *a = load_half(b);
        *c = 0.0f;
        for (int j = 0; j < 32; j++) sum += (int8_t)b[2 + j] * qx[j];
        break;
    }
    case T_Q6_K: {
        const uint8_t *b = w + (u / 8) * 210;
        const int h = (int)(u % 8) / 4, j = (int)(u % 4);
        const uint8_t *ql = b + h * 64 + (j & 1) * 32, *qh = b + 128 + h * 32;
        const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * j;
        *a = load_half(b + 208);
        *c = 0.0f;
        for (int l = 0; l < 32; l++) {
            const int q = (((ql[l] >> (4 * (j >> 1))) & 0xF) | (((qh[l] >> (2 * j)) & 3) << 4)) - 32;
            sum += sc[l / 16] * q * qx[l];
        }
        break;
    }
    case T_Q4_K: {
        const uint8_t *b = w + (u / 8) * 144;
        const int j = (int)(u % 8);
        uint8_t sc, m;
        k_scale_min(j, b + 4, &sc, &m);
        *a = load_half(b) * (float)sc;
        *c = -load_half(b + 2) * (float)m;
        const uint8_t *qs = b + 16 + (j / 2) * 32;
        const int shift = (j % 2) * 4;
        for (int i = 0; i < 32; i++) sum += ((qs[i] >> shift) & 0xF) * qx[i];
        break;
    }
    }
    return sum;
}
#endif

/* ---------------------------------------------------------------- AVX2 dot products */
#ifdef KV_AVX2
static inline __m256i nibbles32(const uint8_t *p) { /* 16 bytes -> 32 values, low nibbles first */
    /* the 16 bytes in both lanes, the upper lane shifted down a nibble: three instructions */
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0xF));
}

/* 32 bits -> 32 bytes: byte j is 0xFF where bit j is set. */
static inline __m256i bits32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i which = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), which); /* byte j: byte j/8 of v */
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
}

/* The two halves at p as floats (the first where only it is wanted), converted together: one
 * plain 4-byte load and one conversion. */
static inline __m128 load_halves2(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
}
static inline float load_half4(const uint8_t *p) { return _mm_cvtss_f32(load_halves2(p)); }

/* Unsigned 0..255 weights times signed activations, summed to 8 int32 lanes as float. */
static inline __m256 dot_u8_i8(__m256i w, __m256i x, __m256i pair_weights) {
    const __m256i p = _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, pair_weights));
}

/* Block u of a weight row as 32 unsigned values in element order, and its (d, m): the block
 * is d * q + m. */
static inline __m256i block_values(int type, const uint8_t *row, int64_t u, float *d, float *m) {
    if (type == T_Q4_0) {
        const uint8_t *b = row + u * 18;
        *d = load_half4(b), *m = -8.0f * *d;
        return nibbles32(b + 2);
    }
    if (type == T_Q4_1) {
        const uint8_t *b = row + u * 20;
        const __m128 dm = load_halves2(b);
        *d = _mm_cvtss_f32(dm), *m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
        return nibbles32(b + 4);
    }
    if (type == T_Q5_0) {
        const uint8_t *b = row + u * 22;
        *d = load_half4(b), *m = -16.0f * *d;
        return _mm256_or_si256(nibbles32(b + 6), _mm256_and_si256(bits32(b + 2), _mm256_set1_epi8(0x10)));
    }
    const uint8_t *b = row + (u / 8) * 144; /* Q4_K */
    const int j = (int)(u % 8);
    uint8_t sc, mn;
    k_scale_min(j, b + 4, &sc, &mn);
    const __m128 dmin = load_halves2(b);
    *d = _mm_cvtss_f32(dmin) * (float)sc, *m = -_mm_cvtss_f32(_mm_movehdup_ps(dmin)) * (float)mn;
    const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + (j / 2) * 32));
    return _mm256_and_si256((j % 2) ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0xF));
}
#endif

/* ---------------------------------------------------------------- one weight row, 4 x rows */
#define NR 4 /* activation rows per pass over a weight row: its blocks are decoded once per pass */
#define NG 8 /* rows of a group (AVX2): whole groups of activation rows are laid out for one pass */

#define PREFETCH_ROWS 8 /* weight rows ahead that a pass asks memory for */

#define MAX_SEGS 8 /* weights stacked along n_out (Q, K and V share one call) */

typedef struct {
    wfmt f;
    const uint8_t *w[MAX_SEGS];
    int64_t seg_end[MAX_SEGS]; /* the first row past each weight */
    int nseg;
    int64_t n_out, k, n;
    const int8_t *qx; /* [n, k] */
    const float *dx, *sx; /* [n, k / 32] */
    const int8_t *gqx; /* whole groups of NG rows laid out block by block, or NULL: [n / NG][k / 32][NG][32] */
    const float *gdx, *gsx; /* [n / NG][k / 32][NG] */
    float *y;
    int64_t ldy;
} job_t;

/* y[r][o] for NR activation rows (x rows qx[r], dx[r], sx[r]); rows past `nr` are computed on
 * duplicates and not stored, so the loop over r has a fixed length. */
#ifdef KV_AVX2
#define ROWS_NR(NAME, NRV, SIGNED, ...)                                                                  \
    static void NAME(const uint8_t *w, int64_t nu, const int8_t *const *qx, const float *const *dx,        \
                     const float *const *sx, float *out) {                                               \
        __m256 acc[NRV];                                                                                  \
        float off[NRV];                                                                                   \
        for (int r = 0; r < NRV; r++) acc[r] = _mm256_setzero_ps(), off[r] = 0.0f;                         \
        const __m256i ones = _mm256_set1_epi16(1);                                                       \
        for (int64_t u = 0; u < nu; u++) {                                                               \
            float a, c;                                                                                  \
            __m256i wv, pw = ones; /* pw: int16 weights of the pairs (Q6_K's two scales) */              \
            __VA_ARGS__                                                                                  \
            const __m256i wabs = SIGNED ? _mm256_sign_epi8(wv, wv) : wv;                                 \
            for (int r = 0; r < NRV; r++) {                                                               \
                __m256i xv = _mm256_loadu_si256((const __m256i *)(qx[r] + u * QK));                      \
                if (SIGNED) xv = _mm256_sign_epi8(xv, wv);                                               \
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a * dx[r][u]), dot_u8_i8(wabs, xv, pw), acc[r]);     \
                if (!SIGNED) off[r] += c * sx[r][u];                                                     \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < NRV; r++) out[r] = hsum(acc[r]) + off[r];                                     \
    }

/* y[r][o] for a group of NG activation rows laid out block by block (qx [nu][NG][32], dx and sx
 * [nu][NG]): the NG scales of a block are one vector product, and the offsets one vector sum.
 * Each row's sums are those of ROWS_NR, in the same order, so the bits are the same. */
#define ROWS_GROUP(NAME, SIGNED, ...)                                                                    \
    static void NAME(const uint8_t *w, int64_t nu, const int8_t *qx, const float *dx, const float *sx,   \
                     float *out) {                                                                       \
        __m256 acc[NG], off = _mm256_setzero_ps();                                                       \
        for (int r = 0; r < NG; r++) acc[r] = _mm256_setzero_ps();                                        \
        const __m256i ones = _mm256_set1_epi16(1);                                                       \
        float scale[NG] __attribute__((aligned(32)));                                                    \
        for (int64_t u = 0; u < nu; u++) {                                                               \
            float a, c;                                                                                  \
            __m256i wv, pw = ones;                                                                       \
            __VA_ARGS__                                                                                  \
            const __m256i wabs = SIGNED ? _mm256_sign_epi8(wv, wv) : wv;                                 \
            _mm256_store_ps(scale, _mm256_mul_ps(_mm256_set1_ps(a), _mm256_loadu_ps(dx + u * NG)));      \
            if (!SIGNED)                                                                                 \
                off = _mm256_add_ps(off, _mm256_mul_ps(_mm256_set1_ps(c), _mm256_loadu_ps(sx + u * NG)));  \
            const int8_t *xb = qx + u * NG * QK;                                                         \
            for (int r = 0; r < NG; r++) {                                                               \
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xb + r * QK));                         \
                if (SIGNED) xv = _mm256_sign_epi8(xv, wv);                                               \
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale[r]), dot_u8_i8(wabs, xv, pw), acc[r]);     \
            }                                                                                            \
        }                                                                                                \
        float offs[NG];                                                                                  \
        _mm256_storeu_ps(offs, off);                                                                     \
        for (int r = 0; r < NG; r++) out[r] = hsum(acc[r]) + offs[r];                                     \
    }

#define ROWS_FN(NAME, SIGNED, ...)                                                                       \
    ROWS_NR(NAME##_1, 1, SIGNED, __VA_ARGS__)                                                            \
    ROWS_NR(NAME##_4, NR, SIGNED, __VA_ARGS__)                                                           \
    ROWS_GROUP(NAME##_g, SIGNED, __VA_ARGS__)

/* Q4_0 and Q5_0 as signed values (q - 8, q - 16), their offset in the integer sum. */
ROWS_FN(rows_q4_0, 1, {
    wv = _mm256_sub_epi8(block_values(T_Q4_0, w, u, &a, &c), _mm256_set1_epi8(8));
    c = 0.0f;
})
ROWS_FN(rows_q4_1, 0, { wv = block_values(T_Q4_1, w, u, &a, &c); })
/* Q5_0's q - 16 is the nibble where the fifth bit is set, else the nibble - 16 (0xF0 | nibble). */
ROWS_FN(rows_q5_0, 1, {
    const uint8_t *b = w + u * 22;
    a = load_half4(b), c = 0.0f;
    wv = _mm256_or_si256(nibbles32(b + 6), _mm256_andnot_si256(bits32(b + 2), _mm256_set1_epi8((char)0xF0)));
})
ROWS_FN(rows_q6_k, 1, {
    const uint8_t *b = w + (u / 8) * 210;
    const int h = (int)(u % 8) / 4, j = (int)(u % 4);
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + h * 64 + (j & 1) * 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + h * 32));
    const __m256i m4 = _mm256_set1_epi8(0xF), m2 = _mm256_set1_epi8(3);
    const __m128i sh_lo = _mm_cvtsi32_si128(4 * (j >> 1)), sh_hi = _mm_cvtsi32_si128(2 * j);
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, sh_lo), m4);
    const __m256i up = _mm256_and_si256(_mm256_srl_epi16(qh, sh_hi), m2);
    wv = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(up, 4)), _mm256_set1_epi8(32));
    const int8_t *sc = (const int8_t *)(b + 192) + h * 8 + 2 * j;
    pw = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0]));
    a = load_half(b + 208), c = 0.0f;
})
ROWS_FN(rows_q8_0, 1, {
    const uint8_t *b = w + u * 34;
    a = load_half4(b), c = 0.0f;
    wv = _mm256_loadu_si256((const __m256i *)(b + 2));
})
ROWS_FN(rows_q4_k, 0, { wv = block_values(T_Q4_K, w, u, &a, &c); })
#else
#define ROWS_FN(NAME, TYPE)                                                                              \
    ROWS_SC(NAME##_1, 1, TYPE)                                                                           \
    ROWS_SC(NAME##_4, NR, TYPE)
#define ROWS_SC(NAME, NRV, TYPE)                                                                         \
    static void NAME(const uint8_t *w, int64_t nu, const int8_t *const *qx, const float *const *dx,        \
                     const float *const *sx, float *out) {                                               \
        const wfmt f = {TYPE, 0};                                                                        \
        for (int r = 0; r < NRV; r++) {                                                                  \
            float acc = 0.0f, off = 0.0f;                                                                \
            for (int64_t u = 0; u < nu; u++) {                                                           \
                float a, c;                                                                              \
                const int s = unit_dot_scalar(&f, w, u, qx[r] + u * QK, &a, &c);                         \
                acc += a * dx[r][u] * (float)s;                                                          \
                off += c * sx[r][u];                                                                     \
            }                                                                                            \
            out[r] = acc + off;                                                                          \
        }                                                                                                \
    }
ROWS_FN(rows_q4_0, T_Q4_0)
ROWS_FN(rows_q4_1, T_Q4_1)
ROWS_FN(rows_q5_0, T_Q5_0)
ROWS_FN(rows_q8_0, T_Q8_0)
ROWS_FN(rows_q6_k, T_Q6_K)
ROWS_FN(rows_q4_k, T_Q4_K)
#endif

typedef void (*rows_fn)(const uint8_t *, int64_t, const int8_t *const *, const float *const *,
                        const float *const *, float *);

static rows_fn rows_for(int type, int one) {
    switch (type) {
    case T_Q4_0: return one ? rows_q4_0_1 : rows_q4_0_4;
    case T_Q4_1: return one ? rows_q4_1_1 : rows_q4_1_4;
    case T_Q5_0: return one ? rows_q5_0_1 : rows_q5_0_4;
    case T_Q8_0: return one ? rows_q8_0_1 : rows_q8_0_4;
    case T_Q6_K: return one ? rows_q6_k_1 : rows_q6_k_4;
    default: return one ? rows_q4_k_1 : rows_q4_k_4;
    }
}

#ifdef KV_AVX2
typedef void (*group_fn)(const uint8_t *, int64_t, const int8_t *, const float *, const float *, float *);

static group_fn group_for(int type) {
    switch (type) {
    case T_Q4_0: return rows_q4_0_g;
    case T_Q4_1: return rows_q4_1_g;
    case T_Q5_0: return rows_q5_0_g;
    case T_Q8_0: return rows_q8_0_g;
    case T_Q6_K: return rows_q6_k_g;
    default: return rows_q4_k_g;
    }
}

/* The whole groups of activation rows over weight rows [o0, o1); returns the rows they cover. */
static int64_t matmul_groups(const job_t *J, int64_t o0, int64_t o1) {
    if (!J->gqx) return 0;
    const group_fn fn = group_for(J->f.type);
    const int64_t nu = J->k / QK, ng = J->n / NG;
    for (int64_t g = 0; g < ng; g++) {
        const int8_t *qx = J->gqx + g * nu * NG * QK;
        const float *dx = J->gdx + g * nu * NG, *sx = J->gsx + g * nu * NG;
        int seg = 0;
        for (int64_t o = o0; o < o1; o++) {
            while (o >= J->seg_end[seg]) seg++;
            const int64_t row = o - (seg ? J->seg_end[seg - 1] : 0);
            float out[NG];
            if (g == 0 && o + PREFETCH_ROWS < J->seg_end[seg]) {
                const uint8_t *ahead = J->w[seg] + (row + PREFETCH_ROWS) * J->f.row_bytes;
                for (int64_t b = 0; b < J->f.row_bytes; b += 64) __builtin_prefetch(ahead + b);
            }
            fn(J->w[seg] + row * J->f.row_bytes, nu, qx, dx, sx, out);
            for (int r = 0; r < NG; r++) J->y[(g * NG + r) * J->ldy + o] = out[r];
        }
    }
    return ng * NG;
}
#else
static int64_t matmul_groups(const job_t *J, int64_t o0, int64_t o1) {
    (void)J, (void)o0, (void)o1;
    return 0;
}
#endif

/* ---------------------------------------------------------------- panels: many rows (prompts) */
/* A prompt has many activation rows per weight row. Its weights are unpacked, PANEL rows at a
 * time, into bytes laid out so that one 32-byte vector holds 4 consecutive elements of each of
 * the PANEL rows (one int32 lane per weight row): a broadcast of 4 activation bytes multiplies
 * all of them at once, and the products add up in int16 lanes (8 steps of at most 2 * 15 * 127
 * for 4-bit weights: 30480; 4 steps of at most 2 * 31 * 127 for Q5_0's 5 bits: 31496), then in
 * int32 over the block. Per block, a row's integer sum is scaled by both blocks' scales and the
 * weight's offset added, in block order: a row's result does not depend on the other rows of
 * the call. Fewer rows keep the row and group kernels: unpacking per call costs more than one
 * row saves (a decoded token took 1.6x as long with panels). */
#define PANEL 8
#define PANEL_TILE 4 /* activation rows per pass over a panel */
#define PANEL_MIN_ROWS 33 /* fewer rows keep the row and group kernels (models/linear.py's QUANT_MAX_ROWS) */

/* Whether a format has the panel kernel in this build. */
int kvq_panels(int type) {
#ifdef KV_AVX2
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q4_K;
#else
    (void)type;
    return 0;
#endif
}

#ifdef KV_AVX2
/* The weight rows [o, o + PANEL) of the stacked segments; NULL past n_out. */
static void panel_rows(const job_t *J, int64_t o, const uint8_t **rows) {
    for (int l = 0; l < PANEL; l++) {
        if (o + l < J->n_out) {
            int seg = 0;
            while (o + l >= J->seg_end[seg]) seg++;
            rows[l] = J->w[seg] + (o + l - (seg ? J->seg_end[seg - 1] : 0)) * J->f.row_bytes;
        } else {
            rows[l] = NULL;
        }
    }
}

/* Weight rows [o, o + PANEL) unpacked: pq [nu][8 steps][PANEL][4], pd and pm [nu][PANEL]; rows
 * past n_out are zeros. Per block, the 8 rows' 32 values (8 dwords of 4 each) are transposed so that
 * dword l of step s is row l's elements 4s .. 4s + 3. */
static void unpack_panel(const job_t *J, int64_t o, uint8_t *pq, float *pd, float *pm) {
    const int64_t nu = J->k / QK;
    const uint8_t *rows[PANEL];
    panel_rows(J, o, rows);
    for (int64_t u = 0; u < nu; u++) {
        __m256i v[PANEL];
        for (int l = 0; l < PANEL; l++) {
            if (rows[l]) {
                v[l] = block_values(J->f.type, rows[l], u, pd + u * PANEL + l, pm + u * PANEL + l);
            } else {
                v[l] = _mm256_setzero_si256(), pd[u * PANEL + l] = 0.0f, pm[u * PANEL + l] = 0.0f;
            }
        }
        __m256i t[PANEL], w[PANEL];
        for (int l = 0; l < PANEL; l += 2) {
            t[l] = _mm256_unpacklo_epi32(v[l], v[l + 1]);
            t[l + 1] = _mm256_unpackhi_epi32(v[l], v[l + 1]);
        }
        for (int h = 0; h < PANEL; h += 4) {
            w[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
            w[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
            w[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
            w[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
        }
        uint8_t *pb = pq + u * QK * PANEL;
        for (int st = 0; st < 4; st++) {
            _mm256_store_si256((__m256i *)(pb + st * 32), _mm256_permute2x128_si256(w[st], w[st + 4], 0x20));
            _mm256_store_si256((__m256i *)(pb + (st + 4) * 32), _mm256_permute2x128_si256(w[st], w[st + 4], 0x31));
        }
    }
}

/* y[r][o .. o + nw) for activation rows r < R, the int16 sums moved to int32 every `flush` steps
 * (R and flush constants where it is inlined). */
static inline __attribute__((always_inline)) void panel_tile(const uint8_t *pq, const float *pd, const float *pm,
                                                             int64_t nu, const job_t *J, int64_t i, const int R,
                                                             const int flush, int64_t o, int nw) {
    __m256 acc[PANEL_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *qx = J->qx + i * J->k;
    const float *dx = J->dx + i * nu, *sx = J->sx + i * nu;
    for (int64_t u = 0; u < nu; u++) {
        __m256i a16[PANEL_TILE], a32[PANEL_TILE];
        const uint8_t *pb = pq + u * QK * PANEL;
        for (int s0 = 0; s0 < QK / 4; s0 += flush) {
            for (int r = 0; r < R; r++) a16[r] = _mm256_setzero_si256();
            for (int s = s0; s < s0 + flush; s++) {
                const __m256i w = _mm256_load_si256((const __m256i *)(pb + s * 32));
                for (int r = 0; r < R; r++) {
                    int32_t v;
                    memcpy(&v, qx + r * J->k + u * QK + 4 * s, 4);
                    a16[r] = _mm256_add_epi16(a16[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(v)));
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256i part = _mm256_madd_epi16(a16[r], ones);
                a32[r] = s0 ? _mm256_add_epi32(a32[r], part) : part;
            }
        }
        const __m256 d = _mm256_loadu_ps(pd + u * PANEL), m = _mm256_loadu_ps(pm + u * PANEL);
        for (int r = 0; r < R; r++) {
            const __m256 f = _mm256_cvtepi32_ps(a32[r]);
            acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nu + u])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nu + u]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *y = J->y + (i + r) * J->ldy + o;
        if (nw == PANEL) {
            _mm256_storeu_ps(y, acc[r]);
        } else {
            float out[PANEL];
            _mm256_storeu_ps(out, acc[r]);
            memcpy(y, out, sizeof(float) * (size_t)nw);
        }
    }
}

typedef struct {
    const job_t *J;
    int failed;
} panels_t;

/* Panels [p0, p1) against every activation row: a task of the pool. */
static void matmul_panels(void *ctx, int64_t p0, int64_t p1) {
    panels_t *P = ctx;
    const job_t *J = P->J;
    const int64_t nu = J->k / QK;
    uint8_t *pq = aligned_alloc(32, (size_t)(nu * QK * PANEL));
    float *pd = malloc(sizeof(float) * (size_t)(2 * nu * PANEL));
    if (!pq || !pd) {
        free(pq), free(pd);
        P->failed = 1; /* only ever set: a benign race */
        return;
    }
    float *pm = pd + nu * PANEL;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t o = p * PANEL;
        const int nw = J->n_out - o < PANEL ? (int)(J->n_out - o) : PANEL;
        if (o + PANEL < J->n_out) { /* weights come from memory once per token: ask for the next panel */
            const uint8_t *ahead[PANEL];
            panel_rows(J, o + PANEL, ahead);
            for (int l = 0; l < PANEL && ahead[l]; l++)
                for (int64_t b = 0; b < J->f.row_bytes; b += 64) __builtin_prefetch(ahead[l] + b);
        }
        unpack_panel(J, o, pq, pd, pm);
        int64_t i = 0;
        if (J->f.type == T_Q5_0) { /* 5 bits: int16 holds 4 steps */
            for (; i + PANEL_TILE <= J->n; i += PANEL_TILE) panel_tile(pq, pd, pm, nu, J, i, PANEL_TILE, 4, o, nw);
            for (; i < J->n; i++) panel_tile(pq, pd, pm, nu, J, i, 1, 4, o, nw);
        } else {
            for (; i + PANEL_TILE <= J->n; i += PANEL_TILE) panel_tile(pq, pd, pm, nu, J, i, PANEL_TILE, 8, o, nw);
            for (; i < J->n; i++) panel_tile(pq, pd, pm, nu, J, i, 1, 8, o, nw);
        }
    }
    free(pq), free(pd);
}
#endif

/* Weight rows [o0, o1) of a matmul: a task of the pool. */
static void matmul_rows(void *ctx, int64_t o0, int64_t o1) {
    const job_t *J = ctx;
    const rows_fn fn4 = rows_for(J->f.type, 0), fn1 = rows_for(J->f.type, 1);
    const int64_t nu = J->k / QK;
    const int64_t grouped = matmul_groups(J, o0, o1);
    for (int64_t i0 = grouped; i0 < J->n; i0 += NR) {
        const int nr = J->n - i0 < NR ? (int)(J->n - i0) : NR;
        const int8_t *qx[NR];
        const float *dx[NR], *sx[NR];
        for (int r = 0; r < NR; r++) {
            const int64_t i = i0 + (r < nr ? r : 0);
            qx[r] = J->qx + i * J->k, dx[r] = J->dx + i * nu, sx[r] = J->sx + i * nu;
        }
        int seg = 0;
        for (int64_t o = o0; o < o1; o++) {
            while (o >= J->seg_end[seg]) seg++;
            const int64_t row = o - (seg ? J->seg_end[seg - 1] : 0);
            float out[NR];
            if (i0 == grouped && grouped == 0 && o + PREFETCH_ROWS < J->seg_end[seg]) {
                /* weights come from memory once per token: ask for a row a few rows ahead */
                const uint8_t *ahead = J->w[seg] + (row + PREFETCH_ROWS) * J->f.row_bytes;
                for (int64_t b = 0; b < J->f.row_bytes; b += 64) __builtin_prefetch(ahead + b);
            }
            (nr == 1 ? fn1 : fn4)(J->w[seg] + row * J->f.row_bytes, nu, qx, dx, sx, out);
            for (int r = 0; r < nr; r++) J->y[(i0 + r) * J->ldy + o] = out[r];
        }
    }
}

/* ---------------------------------------------------------------- entry points */
int kvq_supported(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q8_0 || type == T_Q4_K ||
           type == T_Q6_K || kvb_supported(type);
}


/* Quantizing the activation rows (RMS-normed first where norm_w is given): a task of the pool. */
typedef struct {
    const float *x;
    int64_t ldx, k;
    const float *norm_w;
    float eps;
    int8_t *qx;
    float *dx, *sx;
    int8_t *gqx; /* NULL, or whole groups of NG rows also laid out block by block */
    float *gdx, *gsx;
    int64_t n_grouped;
    int failed;
} quant_t;

static void quantize_rows(void *ctx, int64_t i0, int64_t i1) {
    quant_t *Q = ctx;
    const int64_t k = Q->k, nu = k / QK;
    float *normed = Q->norm_w ? malloc(sizeof(float) * (size_t)k) : NULL;
    if (Q->norm_w && !normed) {
        Q->failed = 1; /* only ever set: a benign race */
        return;
    }
    for (int64_t i = i0; i < i1; i++) {
        const float *xi = Q->x + i * Q->ldx;
        if (normed) {
            rms_norm_row(xi, k, Q->norm_w, Q->eps, normed);
            xi = normed;
        }
        quantize_row(xi, k, Q->qx + i * k, Q->dx + i * nu, Q->sx + i * nu);
#ifdef KV_AVX2
        if (Q->gqx && Q->gsx && i < Q->n_grouped) {
            const int64_t g = i / NG, r = i % NG;
            for (int64_t u = 0; u < nu; u++) {
                const int64_t at = (g * nu + u) * NG + r;
                memcpy(Q->gqx + at * QK, Q->qx + i * k + u * QK, QK);
                Q->gdx[at] = Q->dx[i * nu + u], Q->gsx[at] = Q->sx[i * nu + u];
            }
        }
#endif
    }
    free(normed);
}

/* y = x @ W.T for x [n, k] float32 (rows ldx apart) and W the `nseg` weights ws[s] of
 * seg_rows[s] rows each (GGUF blocks, `row_bytes` a row), stacked along n_out; y [n, n_out]
 * float32 (rows ldy apart). k must be a multiple of 32 (of 256 for Q4_K and Q6_K). Returns 0,
 * or -1 for a bad call. */
static int matmul(int type, const uint8_t *const *ws, const int64_t *seg_rows, int nseg, int64_t row_bytes,
                  int64_t k, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy, const float *norm_w,
                  float eps) {
    if (kvb_supported(type)) /* qmatmul_lowbit.c: activations quantized as llama.cpp does for each */
        return kvb_matmul(type, ws, seg_rows, nseg, row_bytes, k, x, ldx, n, y, ldy, norm_w, eps);
    const int64_t block = type == T_Q4_K || type == T_Q6_K ? QK_K : QK;
    if (!kvq_supported(type) || k % block || n < 0 || nseg < 1 || nseg > MAX_SEGS) return -1;
    job_t J = {.f = {type, row_bytes}, .nseg = nseg, .k = k, .n = n, .y = y, .ldy = ldy};
    int64_t n_out = 0;
    for (int s = 0; s < nseg; s++) {
        if (seg_rows[s] < 0) return -1;
        J.w[s] = ws[s];
        n_out += seg_rows[s];
        J.seg_end[s] = n_out;
    }
    J.n_out = n_out;
    if (n == 0 || n_out == 0) return 0;
    const int64_t nu = k / QK;
    int8_t *qx = malloc((size_t)(n * k));
    float *dx = malloc(sizeof(float) * (size_t)(n * nu)), *sx = malloc(sizeof(float) * (size_t)(n * nu));
    if (!qx || !dx || !sx) {
        free(qx), free(dx), free(sx);
        return -1;
    }
    int8_t *gqx = NULL;
    float *gdx = NULL;
#ifdef KV_AVX2
    const int panels = n >= PANEL_MIN_ROWS && kvq_panels(type);
    const int64_t ng = panels ? 0 : n / NG;
    if (ng > 0) { /* whole groups of rows, also laid out block by block for the group kernel */
        gqx = malloc((size_t)(ng * NG * k));
        gdx = malloc(sizeof(float) * (size_t)(2 * ng * NG * nu));
        if (!gqx || !gdx) {
            free(gqx), free(gdx);
            gqx = NULL, gdx = NULL; /* the row kernels compute them instead */
        }
    }
#endif
    const int64_t n_grouped = gqx ? n / NG * NG : 0;
    quant_t Q = {.x = x, .ldx = ldx, .k = k, .norm_w = norm_w, .eps = eps, .qx = qx, .dx = dx, .sx = sx,
                 .gqx = gqx, .gdx = gdx, .gsx = gdx ? gdx + n_grouped * nu : NULL, .n_grouped = n_grouped};
    kv_parallel(quantize_rows, &Q, n, 1);
    if (Q.failed) {
        free(qx), free(dx), free(sx), free(gqx), free(gdx);
        return -1;
    }
    J.qx = qx, J.dx = dx, J.sx = sx;
    J.gqx = gqx, J.gdx = gdx, J.gsx = Q.gsx;
#ifdef KV_AVX2
    if (panels) {
        panels_t P = {.J = &J};
        kv_parallel(matmul_panels, &P, (n_out + PANEL - 1) / PANEL, 1);
        free(qx), free(dx), free(sx);
        return P.failed ? -1 : 0;
    }
#endif
    kv_parallel(matmul_rows, &J, n_out, 4);
    free(qx), free(dx), free(sx), free(gqx), free(gdx);
    return 0;
}


/* Threads (the caller included) that the kernels use; returns the number set. */
int kvq_set_threads(int n) { return kv_set_threads(n); }

/* The same call with the weight's description (cpu_kernels.h) made once: fewer arguments to
 * convert per call from Python, where a call costs microseconds. */
int kvq_matmul_w(const kvq_weight *w, const float *x, int64_t ldx, int64_t n, float *y) {
    return matmul(w->type, w->ws, w->seg_rows, w->nseg, w->row_bytes, w->k, x, ldx, n, y, w->n_out, NULL, 0.0f);
}

/* y = rms_norm(x) * norm_w @ W.T: the norm applied to each row on its way to quantization (in
 * the models a normed row feeds only the matmul after it). */
int kvq_matmul_norm(const kvq_weight *w, const float *x, int64_t ldx, int64_t n, float *y, const float *norm_w,
                    float eps) {
    return matmul(w->type, w->ws, w->seg_rows, w->nseg, w->row_bytes, w->k, x, ldx, n, y, w->n_out, norm_w, eps);
}

/* y = rms_norm(x) * norm_w @ W.T into rows `ldy` floats apart (a column block of a wider y). */
int kvq_matmul_ld(const kvq_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                  const float *norm_w, float eps) {
    if (ldy < w->n_out) return -1;
    return matmul(w->type, w->ws, w->seg_rows, w->nseg, w->row_bytes, w->k, x, ldx, n, y, ldy, norm_w, eps);
}

/* act(gate) * up over rows of [gate | up] (n_ff each), the hidden row overwriting the gate half:
 * items are the hidden elements, row by row. act is silu, or with `gelu` ggml's CPU GELU: the
 * gate rounded to a half and looked up in `gelu` (65536 floats, one per half's bits), except
 * gate <= -10 -> 0 and gate >= 10 -> gate. A task of the pool. */
typedef struct {
    float *g;
    int64_t n_ff;
    const float *gelu;
} glu_t;

static float gelu_lookup(const float *table, float x) {
    return x <= -10.0f ? 0.0f : x >= 10.0f ? x : table[float_to_half(x)];
}

static void glu_items(void *ctx, int64_t e0, int64_t e1) {
    const glu_t *S = ctx;
    for (int64_t e = e0; e < e1;) {
        const int64_t i = e / S->n_ff, j0 = e % S->n_ff;
        const int64_t j1 = S->n_ff < j0 + (e1 - e) ? S->n_ff : j0 + (e1 - e);
        float *gi = S->g + i * 2 * S->n_ff;
        int64_t j = j0;
        if (S->gelu) {
#ifdef KV_AVX2
            const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
            for (; j + 8 <= j1; j += 8) {
                const __m256 g = _mm256_loadu_ps(gi + j), u = _mm256_loadu_ps(gi + S->n_ff + j);
                const __m256i h = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT));
                __m256 a = _mm256_i32gather_ps(S->gelu, h, 4);
                a = _mm256_blendv_ps(a, g, _mm256_cmp_ps(g, hi, _CMP_GE_OQ));
                a = _mm256_andnot_ps(_mm256_cmp_ps(g, lo, _CMP_LE_OQ), a);
                _mm256_storeu_ps(gi + j, _mm256_mul_ps(a, u));
            }
#endif
            for (; j < j1; j++) gi[j] = gelu_lookup(S->gelu, gi[j]) * gi[S->n_ff + j];
        } else {
#ifdef KV_AVX2
            for (; j + 8 <= j1; j += 8) {
                const __m256 g = _mm256_loadu_ps(gi + j), u = _mm256_loadu_ps(gi + S->n_ff + j);
                const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)));
                _mm256_storeu_ps(gi + j, _mm256_mul_ps(_mm256_div_ps(g, den), u));
            }
#endif
            for (; j < j1; j++) gi[j] = gi[j] / (1.0f + expf(-gi[j])) * gi[S->n_ff + j];
        }
        e += j1 - j0;
    }
}

/* A gated feed-forward in one call: y = down(act(gate(x)) * up(x)), `gate_up` holding the gate
 * rows then the up rows (n_out 2 * n_ff), `down` taking n_ff columns; act is silu (SwiGLU), or
 * ggml's CPU GELU with the table `gelu` (glu_items); x is RMS-normed with norm_w first unless
 * norm_w is NULL. The hidden rows are quantized like any activation. */
int kvq_ffn_glu(const kvq_weight *gate_up, const kvq_weight *down, const float *x, int64_t ldx, int64_t n,
                float *y, const float *norm_w, float eps, const float *gelu) {
    const int64_t n_ff = gate_up->n_out / 2;
    if (gate_up->n_out % 2 || down->k != n_ff) return -1;
    float *g = malloc(sizeof(float) * (size_t)(n * gate_up->n_out));
    if (!g) return -1;
    int rc = kvq_matmul_norm(gate_up, x, ldx, n, g, norm_w, eps);
    if (rc == 0) {
        glu_t S = {g, n_ff, gelu};
        kv_parallel(glu_items, &S, n * n_ff, 8192); /* a row or two: not worth waking a thread */
        rc = kvq_matmul_w(down, g, gate_up->n_out, n, y);
    }
    free(g);
    return rc;
}
