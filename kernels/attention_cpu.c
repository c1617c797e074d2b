/* Attention for a few query rows per stream (decode), on the CPU pool: the contract of
 * attention_ref in kernels/attention.py, which is its specification.
 *
 * out[s, i, h] = softmax_c(scale * q[s, i, h] . k[s, c, h / g] + mask[s, i, c]) v[s, c, h / g]
 * with g = H / Hkv query heads per KV head; a key whose mask is -inf is skipped without being
 * read; a row that sees no key is zeros. K and V are read in their cache type (f32, f16, bf16)
 * at any strides with a contiguous last dimension, so the cache is never copied. One task item
 * per (stream, query head): scores into a buffer, their maximum, exp and sum, then the weighted
 * sum of V rows. */

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
    float softcap; /* scores soft-capped: cap * tanh(score / cap) before the mask (Gemma 2); 0: not */
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

static inline __attribute__((always_inline)) float dot_row(const float *q, const uint8_t *k, int type, int64_t D) {
    int64_t j = 0;
    float sum = 0.0f;
#ifdef KV_AVX2
    /* four independent chains: one chain of dependent FMAs would cost its latency per step */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; j + 32 <= D; j += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k, type, j), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), load8(k, type, j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 16), load8(k, type, j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 24), load8(k, type, j + 24), a3);
    }
    for (; j + 8 <= D; j += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), load8(k, type, j), a0);
    sum = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; j < D; j++) sum += q[j] * load1(k, type, j);
    return sum;
}

static void axpy_row(float *acc, float w, const uint8_t *v, int type, int64_t Dv) {
    int64_t j = 0;
#ifdef KV_AVX2
    const __m256 wv = _mm256_set1_ps(w);
    for (; j + 8 <= Dv; j += 8)
        _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(wv, load8(v, type, j), _mm256_loadu_ps(acc + j)));
#endif
    for (; j < Dv; j++) acc[j] += w * load1(v, type, j);
}

/* w[c] = exp(sc[c] - mx), 0 where sc[c] is -inf; returns the sum of w. */
static float exp_row(float *w, const float *sc, float mx, int64_t n) {
    int64_t c = 0;
    float sum = 0.0f;
#ifdef KV_AVX2
    const __m256 vmx = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-INFINITY);
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) {
        const __m256 s8 = _mm256_loadu_ps(sc + c);
        __m256 y = exp8(_mm256_sub_ps(s8, vmx)); /* x <= 0: exp8's upper clamp never applies */
        y = _mm256_andnot_ps(_mm256_cmp_ps(s8, ninf, _CMP_EQ_OQ), y); /* hidden keys weigh 0 */
        _mm256_storeu_ps(w + c, y);
        acc = _mm256_add_ps(acc, y);
    }
    sum = hsum(acc);
#endif
    for (; c < n; c++) {
        w[c] = sc[c] == -INFINITY ? 0.0f : expf(sc[c] - mx);
        sum += w[c];
    }
    return sum;
}

/* o += sum_c w[c] v[c] over the rows with w[c] != 0, v rows `stride` bytes apart. 64 columns at
 * a time are kept in registers over all rows (an accumulator in memory would make every row
 * wait for the previous row's store). */
static inline __attribute__((always_inline)) void weighted_sum(float *o, const float *w, const uint8_t *v, int64_t stride, int64_t n, int type,
                         int64_t Dv) {
    int64_t j0 = 0;
#ifdef KV_AVX2
    for (; j0 + 64 <= Dv; j0 += 64) {
        __m256 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm256_loadu_ps(o + j0 + 8 * r);
        for (int64_t c = 0; c < n; c++) {
            if (w[c] == 0.0f) continue;
            const __m256 wv = _mm256_set1_ps(w[c]);
            const uint8_t *row = v + c * stride;
            for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(wv, load8(row, type, j0 + 8 * r), a[r]);
        }
        for (int r = 0; r < 8; r++) _mm256_storeu_ps(o + j0 + 8 * r, a[r]);
    }
#endif
    if (j0 < Dv) {
        for (int64_t c = 0; c < n; c++) {
            if (w[c] != 0.0f) axpy_row(o + j0, w[c], v + c * stride + j0 * elem_size(type), type, Dv - j0);
        }
    }
}

/* K and V rows a head reads ahead of the one it computes with: each (stream, layer) is read
 * once per step, from memory, a few hundred bytes a row at the cache's row stride. */
#define KV_AHEAD 8

static inline void prefetch_row(const uint8_t *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

/* Query heads [i0, i1) of the flattened (stream, head) items. */
static inline __attribute__((always_inline)) void items_of_type(const attn_t *A, int64_t i0, int64_t i1,
                                                                 const int type) {
    const int es = elem_size(type);
    float *sc = malloc(sizeof(float) * (size_t)(2 * (A->n_kv > 0 ? A->n_kv : 1)));
    if (!sc) return; /* the caller checked a buffer of this size could be had */
    float *w = sc + (A->n_kv > 0 ? A->n_kv : 1);
    for (int64_t it = i0; it < i1; it++) {
        const int64_t s = it / A->H, h = it % A->H, hk = h / A->g;
        const uint8_t *kb = A->k + (s * A->sk_s + hk * A->sk_h) * es;
        const uint8_t *vb = A->v + (s * A->sv_s + hk * A->sv_h) * es;
        for (int64_t i = 0; i < A->n_q; i++) {
            const float *q = A->q + s * A->sq_s + i * A->sq_i + h * A->sq_h;
            const float *m = A->mask + s * A->sm_s + i * A->sm_i;
            float *o = A->out + ((s * A->n_q + i) * A->H + h) * A->Dv;
            memset(o, 0, sizeof(float) * (size_t)A->Dv);
            float mx = -INFINITY;
            for (int64_t c = 0; c < A->n_kv; c++) {
                if (c + KV_AHEAD < A->n_kv) { /* V too: the weighted sum reads it next */
                    prefetch_row(kb + (c + KV_AHEAD) * A->sk_c * es, A->D * es);
                    prefetch_row(vb + (c + KV_AHEAD) * A->sv_c * es, A->Dv * es);
                }
                if (m[c] == -INFINITY) {
                    sc[c] = -INFINITY;
                    continue;
                }
                sc[c] = dot_row(q, kb + c * A->sk_c * es, type, A->D) * A->scale;
                if (A->softcap != 0.0f) sc[c] = tanhf(sc[c] * (1.0f / A->softcap)) * A->softcap;
                sc[c] += m[c];
                if (sc[c] > mx) mx = sc[c];
            }
            if (mx == -INFINITY) continue; /* sees no key: zeros */
            const float sum = exp_row(w, sc, mx, A->n_kv);
            weighted_sum(o, w, vb, A->sv_c * es, A->n_kv, type, A->Dv);
            const float inv = 1.0f / sum;
            for (int64_t j = 0; j < A->Dv; j++) o[j] *= inv;
        }
    }
    free(sc);
}

static void attn_items(void *ctx, int64_t i0, int64_t i1) {
    const attn_t *A = ctx;
    switch (A->kv_type) { /* one copy of the loops per cache type, the type a constant in each */
    case KV_F16: items_of_type(A, i0, i1, KV_F16); break;
    case KV_BF16: items_of_type(A, i0, i1, KV_BF16); break;
    default: items_of_type(A, i0, i1, KV_F32); break;
    }
}

/* See the file's comment; each score soft-capped at `softcap` unless it is 0 (Gemma 2: cap *
 * tanh(scale * q.k / cap), then the mask). Strides are in elements; q, mask and out are float32, k
 * and v of `kv_type`. Returns 0, or -1 for a bad call. */
int kva_attention_softcap(const float *q, int64_t sq_s, int64_t sq_i, int64_t sq_h, const void *k, int64_t sk_s,
                          int64_t sk_c, int64_t sk_h, const void *v, int64_t sv_s, int64_t sv_c, int64_t sv_h,
                          int kv_type, const float *mask, int64_t sm_s, int64_t sm_i, float *out, int64_t S,
                          int64_t n_q, int64_t H, int64_t Hkv, int64_t n_kv, int64_t D, int64_t Dv, float scale,
                          float softcap) {
    if (kv_type < KV_F32 || kv_type > KV_BF16 || S < 0 || n_q < 0 || Hkv < 1 || H % Hkv || n_kv < 0) return -1;
    attn_t A = {q, sq_s, sq_i, sq_h, k, v, sk_s, sk_c, sk_h, sv_s, sv_c, sv_h, kv_type,
                mask, sm_s, sm_i, out, n_q, H, H / Hkv, n_kv, D, Dv, scale, softcap};
    void *probe = malloc(sizeof(float) * (size_t)(2 * (n_kv > 0 ? n_kv : 1)));
    if (!probe) return -1;
    free(probe);
    kv_parallel(attn_items, &A, S * H, 1);
    return 0;
}

/* kva_attention_softcap without a cap. */
int kva_attention(const float *q, int64_t sq_s, int64_t sq_i, int64_t sq_h, const void *k, int64_t sk_s,
                  int64_t sk_c, int64_t sk_h, const void *v, int64_t sv_s, int64_t sv_c, int64_t sv_h,
                  int kv_type, const float *mask, int64_t sm_s, int64_t sm_i, float *out, int64_t S,
                  int64_t n_q, int64_t H, int64_t Hkv, int64_t n_kv, int64_t D, int64_t Dv, float scale) {
    return kva_attention_softcap(q, sq_s, sq_i, sq_h, k, sk_s, sk_c, sk_h, v, sv_s, sv_c, sv_h, kv_type, mask, sm_s,
                                 sm_i, out, S, n_q, H, Hkv, n_kv, D, Dv, scale, 0.0f);
}
