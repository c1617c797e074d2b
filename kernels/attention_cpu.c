/* Attention for a few query rows per stream (decode), on the CPU pool: the contract of
 * attention_ref in kernels/attention.py, which is its specification.
 *
 * out[s, i, h] = softmax_c(scale * q[s, i, h] . k[s, c, h / g] + mask[s, i, c]) v[s, c, h / g]
 * with g = H / Hkv query heads per KV head; a key whose mask is -inf is skipped without being
 * read; a row that sees no key is zeros. K and V are read in their cache type (f32, f16, bf16)
 * at any strides with a contiguous last dimension, so the cache is never copied. One task item
 * per (stream, KV head, query row): the keys the row sees listed once, then for up to GT of the
 * KV head's query heads at a time (each K and V row read once for all of them) scores into a
 * buffer, their maximum, exp and sum, then the weighted sum of V rows. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_pool.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1
#endif

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static int elem_size(int type) { return type == KV_F32 ? 4 : 2; }

typedef struct {
    const float *q;
    int64_t sq_s, sq_i, sq_h;
    const uint8_t *k, *v; /* bytes; strides below in elements */
    int64_t sk_s, sk_c, sk_h, sv_s, sv_c, sv_h;
    int kv_type;
    const float *mask;
    int64_t sm_s, sm_i;
    float *out; /* [S, n_q, H, Dv] contiguous */
    int64_t n_q, H, g, n_kv, D, Dv;
    float scale;
} attn_t;

/* Element j of a row of the cache type. */
static inline float load1(const uint8_t *row, int type, int64_t j) {
    uint16_t h;
    switch (type) {
    case KV_F16:
        memcpy(&h, row + 2 * j, 2);
        return half_to_float(h);
    case KV_BF16: {
        memcpy(&h, row + 2 * j, 2);
        const uint32_t bits = (uint32_t)h << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    default: {
        float f;
        memcpy(&f, row + 4 * j, 4);
        return f;
    }
    }
}

#ifdef KV_AVX2
/* Elements j .. j + 7 of a row of the cache type, as floats. */
static inline __m256 load8(const uint8_t *row, int type, int64_t j) {
    switch (type) {
    case KV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * j)));
    case KV_BF16: {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * j)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    default: return _mm256_loadu_ps((const float *)(row + 4 * j));
    }
}

#endif

#define PREFETCH 8 /* keys ahead whose K and V rows are fetched */
#define GT 4 /* query heads of one KV head computed together: each K/V row is read once for them */

/* out[t] = q[t] . k for the ng (<= GT) query rows q[t], k a cache row of D elements. */
static inline __attribute__((always_inline)) void dots(const float *const *q, int ng, const uint8_t *k, int type,
                                                      int64_t D, float *out) {
    int64_t j = 0;
    float s[GT] = {0.0f, 0.0f, 0.0f, 0.0f};
#ifdef KV_AVX2
    __m256 a[GT], b[GT]; /* two chains per head: a chain of dependent FMAs costs its latency per step */
    for (int t = 0; t < GT; t++) a[t] = b[t] = _mm256_setzero_ps();
    for (; j + 16 <= D; j += 16) {
        const __m256 k0 = load8(k, type, j), k1 = load8(k, type, j + 8);
        for (int t = 0; t < ng; t++) {
            a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q[t] + j), k0, a[t]);
            b[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q[t] + j + 8), k1, b[t]);
        }
    }
    for (; j + 8 <= D; j += 8) {
        const __m256 kv = load8(k, type, j);
        for (int t = 0; t < ng; t++) a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(q[t] + j), kv, a[t]);
    }
    for (int t = 0; t < ng; t++) a[t] = _mm256_add_ps(a[t], b[t]);
    if (ng == GT) { /* the four sums at once */
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    } else {
        for (int t = 0; t < ng; t++) s[t] = hsum(a[t]);
    }
#endif
    for (; j < D; j++) {
        const float kj = load1(k, type, j);
        for (int t = 0; t < ng; t++) s[t] += q[t][j] * kj;
    }
    for (int t = 0; t < ng; t++) out[t] = s[t];
}

/* w[c] = exp(sc[c] - mx) for n scores (none -inf); returns the sum of w. */
static float exp_row(float *w, const float *sc, float mx, int64_t n) {
    int64_t c = 0;
    float sum = 0.0f;
#ifdef KV_AVX2
    /* exp(x) = 2^n exp(r), x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial */
    const __m256 vmx = _mm256_set1_ps(mx);
    const __m256 lo = _mm256_set1_ps(-87.3f), log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) {
        const __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(sc + c), vmx), lo);
        const __m256 fn = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 r = _mm256_fnmadd_ps(fn, c2, _mm256_fnmadd_ps(fn, c1, x));
        __m256 p = _mm256_set1_ps(1.9875691500e-4f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
        p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fn), _mm256_set1_epi32(127)), 23);
        const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
        _mm256_storeu_ps(w + c, y);
        acc = _mm256_add_ps(acc, y);
    }
    sum = hsum(acc);
#endif
    for (; c < n; c++) {
        w[c] = expf(sc[c] - mx);
        sum += w[c];
    }
    return sum;
}

/* o[t] = sum_c w[t][c] v[idx[c]] for the ng (<= GT) heads, over the n visible rows idx, V rows
 * `stride` bytes apart. 16 columns of every head are kept in registers over all rows (an
 * accumulator in memory would make every row wait for the previous row's store). */
static inline __attribute__((always_inline)) void weighted_sums(float *const *o, const float *const *w, int ng,
                                                               const int32_t *idx, int64_t n, const uint8_t *v,
                                                               int64_t stride, int type, int64_t Dv) {
    int64_t j0 = 0;
#ifdef KV_AVX2
    for (; j0 + 16 <= Dv; j0 += 16) {
        __m256 a[GT][2];
        for (int t = 0; t < GT; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();
        for (int64_t c = 0; c < n; c++) {
            const uint8_t *row = v + idx[c] * stride;
            const __m256 v0 = load8(row, type, j0), v1 = load8(row, type, j0 + 8);
            for (int t = 0; t < ng; t++) {
                const __m256 wv = _mm256_set1_ps(w[t][c]);
                a[t][0] = _mm256_fmadd_ps(wv, v0, a[t][0]);
                a[t][1] = _mm256_fmadd_ps(wv, v1, a[t][1]);
            }
        }
        for (int t = 0; t < ng; t++) {
            _mm256_storeu_ps(o[t] + j0, a[t][0]);
            _mm256_storeu_ps(o[t] + j0 + 8, a[t][1]);
        }
    }
#endif
    for (; j0 < Dv; j0++) {
        for (int t = 0; t < ng; t++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < n; c++) acc += w[t][c] * load1(v + idx[c] * stride, type, j0);
            o[t][j0] = acc;
        }
    }
}

/* Query heads t0 .. t0 + ng - 1 of KV head hk, query row i of stream s, over the n keys idx. */
static inline __attribute__((always_inline)) void group(const attn_t *A, int64_t s, int64_t hk, int64_t i,
                                                       int64_t t0, const int ng, const uint8_t *kb,
                                                       const uint8_t *vb, const float *m, const int32_t *idx,
                                                       int64_t n, float *const *sc, float *const *w,
                                                       const int type) {
    const int es = elem_size(type);
    const float *q[GT];
    float *o[GT];
    for (int t = 0; t < ng; t++) {
        const int64_t h = hk * A->g + t0 + t;
        q[t] = A->q + s * A->sq_s + i * A->sq_i + h * A->sq_h;
        o[t] = A->out + ((s * A->n_q + i) * A->H + h) * A->Dv;
    }
    if (n == 0) { /* sees no key: zeros */
        for (int t = 0; t < ng; t++) memset(o[t], 0, sizeof(float) * (size_t)A->Dv);
        return;
    }
    float mx[GT] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, d[GT];
    const int64_t kbytes = A->D * es, vbytes = A->Dv * es;
    for (int64_t c = 0; c < n; c++) {
        if (c + PREFETCH < n) { /* the cache is cold after a token's weights went by: fetch ahead, V too */
            const uint8_t *kn = kb + idx[c + PREFETCH] * A->sk_c * es, *vn = vb + idx[c + PREFETCH] * A->sv_c * es;
            for (int64_t b = 0; b < kbytes; b += 64) __builtin_prefetch(kn + b);
            for (int64_t b = 0; b < vbytes; b += 64) __builtin_prefetch(vn + b);
        }
        dots(q, ng, kb + idx[c] * A->sk_c * es, type, A->D, d);
        for (int t = 0; t < ng; t++) {
            sc[t][c] = d[t] * A->scale + m[idx[c]];
            if (sc[t][c] > mx[t]) mx[t] = sc[t][c];
        }
    }
    float inv[GT];
    for (int t = 0; t < ng; t++) inv[t] = 1.0f / exp_row(w[t], sc[t], mx[t], n);
    weighted_sums(o, (const float *const *)w, ng, idx, n, vb, A->sv_c * es, type, A->Dv);
    for (int t = 0; t < ng; t++) {
        for (int64_t j = 0; j < A->Dv; j++) o[t][j] *= inv[t];
    }
}

/* Items [i0, i1) of the flattened (stream, KV head, query row) items: each computes the g query
 * heads of its KV head, GT at a time, over the keys its row's mask shows. */
static inline __attribute__((always_inline)) void items_of_type(const attn_t *A, int64_t i0, int64_t i1,
                                                                 const int type) {
    const int es = elem_size(type);
    const int64_t nk = A->n_kv > 0 ? A->n_kv : 1, Hkv = A->H / A->g;
    float *buf = malloc(sizeof(float) * (size_t)(2 * GT * nk) + sizeof(int32_t) * (size_t)nk);
    if (!buf) return; /* the caller checked a buffer of this size could be had */
    float *sc[GT], *w[GT];
    for (int t = 0; t < GT; t++) sc[t] = buf + t * nk, w[t] = buf + (GT + t) * nk;
    int32_t *idx = (int32_t *)(buf + 2 * GT * nk);
    for (int64_t it = i0; it < i1; it++) {
        const int64_t i = it % A->n_q, hk = (it / A->n_q) % Hkv, s = it / (A->n_q * Hkv);
        const uint8_t *kb = A->k + (s * A->sk_s + hk * A->sk_h) * es;
        const uint8_t *vb = A->v + (s * A->sv_s + hk * A->sv_h) * es;
        const float *m = A->mask + s * A->sm_s + i * A->sm_i;
        int64_t n = 0; /* the keys this row sees */
        for (int64_t c = 0; c < A->n_kv; c++) {
            if (m[c] != -INFINITY) idx[n++] = (int32_t)c;
        }
        for (int64_t t0 = 0; t0 < A->g; t0 += GT) {
            switch (A->g - t0 < GT ? (int)(A->g - t0) : GT) { /* a constant count: accumulators in registers */
            case 1: group(A, s, hk, i, t0, 1, kb, vb, m, idx, n, sc, w, type); break;
            case 2: group(A, s, hk, i, t0, 2, kb, vb, m, idx, n, sc, w, type); break;
            case 3: group(A, s, hk, i, t0, 3, kb, vb, m, idx, n, sc, w, type); break;
            default: group(A, s, hk, i, t0, GT, kb, vb, m, idx, n, sc, w, type); break;
            }
        }
    }
    free(buf);
}

static void attn_items(void *ctx, int64_t i0, int64_t i1) {
    const attn_t *A = ctx;
    switch (A->kv_type) { /* one copy of the loops per cache type, the type a constant in each */
    case KV_F16: items_of_type(A, i0, i1, KV_F16); break;
    case KV_BF16: items_of_type(A, i0, i1, KV_BF16); break;
    default: items_of_type(A, i0, i1, KV_F32); break;
    }
}

/* See the file's comment. Strides are in elements; q, mask and out are float32, k and v of
 * `kv_type`. Returns 0, or -1 for a bad call. */
int kva_attention(const float *q, int64_t sq_s, int64_t sq_i, int64_t sq_h, const void *k, int64_t sk_s,
                  int64_t sk_c, int64_t sk_h, const void *v, int64_t sv_s, int64_t sv_c, int64_t sv_h,
                  int kv_type, const float *mask, int64_t sm_s, int64_t sm_i, float *out, int64_t S,
                  int64_t n_q, int64_t H, int64_t Hkv, int64_t n_kv, int64_t D, int64_t Dv, float scale) {
    if (kv_type < KV_F32 || kv_type > KV_BF16 || S < 0 || n_q < 0 || Hkv < 1 || H % Hkv || n_kv < 0) return -1;
    attn_t A = {q, sq_s, sq_i, sq_h, k, v, sk_s, sk_c, sk_h, sv_s, sv_c, sv_h, kv_type,
                mask, sm_s, sm_i, out, n_q, H, H / Hkv, n_kv, D, Dv, scale};
    if (n_kv > INT32_MAX) return -1;
    void *probe = malloc(sizeof(float) * (size_t)((2 * GT + 1) * (n_kv > 0 ? n_kv : 1)));
    if (!probe) return -1;
    free(probe);
    kv_parallel(attn_items, &A, S * Hkv * n_q, 1);
    return 0;
}
