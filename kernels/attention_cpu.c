/* Attention over a KV cache on the CPU pool: the contract of attention_ref in
 * kernels/attention_ref.py, which is its specification.
 *
 * out[s, i, h] = softmax_c(scale * q[s, i, h] . k[s, c, h / g] + mask[s, i, c]) v[s, c, h / g]
 * with g = H / Hkv query heads per KV head; a key whose mask is -inf is skipped without being
 * read; a row that sees no key is zeros, a row with a NaN score is NaN. K and V are read in their cache types, each its own
 * (f32, f16, bf16, or the GGUF blocks of a quantized type, kv_blocks.h), at any strides with a
 * contiguous last dimension, so the cache is never copied or dequantized as a whole. Over a
 * quantized K the query row is quantized to q8_0/q8_1 and each key is an integer dot product
 * per block, as ggml's CPU flash attention computes it. One task item per (stream, query head):
 * scores into a buffer, their maximum, exp and sum, then the weighted sum of V rows; over a
 * quantized V (llama.cpp needs flash attention for one) the softmax is ggml's online one, key by
 * key in its order and roundings (online_sum). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "expf_libm.h"
#include "kv_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1
#if defined(__AVX512F__)
#define KV_AVX512 1 /* a quantized V's online sum 16 columns to a register */
#endif
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define KV_NEON 1
#endif

/* Bytes of one element of a cache tensor of `type` (a quantized cache: its bytes). */
static inline int elem_size(int type) { return type == KV_F32 ? 4 : kv_quantized(type) ? 1 : 2; }

typedef struct {
    const float *q;
    int64_t sq_s, sq_i, sq_h;
    const uint8_t *k, *v; /* bytes; strides below in elements of each tensor */
    int64_t sk_s, sk_c, sk_h, sv_s, sv_c, sv_h;
    int k_type, v_type;
    const float *mask;
    int64_t sm_s, sm_i;
    float *out; /* [S, n_q, H, Dv] contiguous */
    int64_t n_q, H, g, n_kv, D, Dv;
    float scale;
    float softcap; /* scores soft-capped: cap * tanh(score / cap) before the mask (Gemma 2); 0: not */
} attn_t;

/* A query row quantized for a quantized K (kvb_quantize_q). */
typedef struct {
    int8_t *q;
    float *d, *s;
} qrow_t;

/* Element j of a row of a float type. */
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
/* Elements j .. j + 7 of a row of a float type, as floats. */
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

#elif defined(KV_NEON)
/* Elements j .. j + 3 of a row of the cache type, as floats. */
static inline float32x4_t load4(const uint8_t *row, int type, int64_t j) {
    switch (type) {
    case KV_F16: return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(row + 2 * j))));
    case KV_BF16: return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)(row + 2 * j)), 16));
    default: return vld1q_f32((const float *)(row + 4 * j));
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
#elif defined(KV_NEON)
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (; j + 16 <= D; j += 16) {
        a0 = vfmaq_f32(a0, vld1q_f32(q + j), load4(k, type, j));
        a1 = vfmaq_f32(a1, vld1q_f32(q + j + 4), load4(k, type, j + 4));
        a2 = vfmaq_f32(a2, vld1q_f32(q + j + 8), load4(k, type, j + 8));
        a3 = vfmaq_f32(a3, vld1q_f32(q + j + 12), load4(k, type, j + 12));
    }
    for (; j + 4 <= D; j += 4) a0 = vfmaq_f32(a0, vld1q_f32(q + j), load4(k, type, j));
    sum = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
#endif
    for (; j < D; j++) sum += q[j] * load1(k, type, j);
    return sum;
}

/* K and V rows a head reads ahead of the one it computes with: each (stream, layer) is read
 * once per step, from memory, a few hundred bytes a row at the cache's row stride. */
#define KV_AHEAD 8

static inline void prefetch_row(const uint8_t *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

/* The score of key c (soft-capped where A asks, m the mask's value, not -inf). */
static inline __attribute__((always_inline)) float score1(const attn_t *A, const float *q, const qrow_t *Q,
                                                          const uint8_t *krow, float m, const int type) {
    const float dot = kv_quantized(type) ? kvb_dot_q(krow, type, Q->q, Q->d, Q->s, A->D) : dot_row(q, krow, type, A->D);
    if (A->softcap == 0.0f) return dot * A->scale + m;
    if (kv_quantized(A->v_type)) /* ggml's flash attention (online_sum): the scale divided by the cap first */
        return A->softcap * tanhf(dot * (A->scale / A->softcap)) + m;
    /* llama.cpp's graph without flash attention: scale, times 1 / cap, tanh, times cap */
    return tanhf(dot * A->scale * (1.0f / A->softcap)) * A->softcap + m;
}

#ifdef KV_AVX2
/* hsum of each of a[0 .. 8), lane k from a[k]: the additions of hsum in its pairing, so a key's
 * score has the same bits here as alone. */
static inline __m256 hsum_each8(const __m256 *a) {
    __m256 b[4];
    for (int i = 0; i < 4; i++) /* lanes j and j + 4 of a[2i] (low half), of a[2i + 1] (high half) */
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    /* then lanes 0 + 2 and 1 + 3 of each */
    const __m256 c0 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x44), _mm256_shuffle_ps(b[0], b[1], 0xEE));
    const __m256 c1 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], 0x44), _mm256_shuffle_ps(b[2], b[3], 0xEE));
    /* then their sum: a[0], a[2], a[4], a[6], a[1], a[3], a[5], a[7] */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(c0, c1, 0x88), _mm256_shuffle_ps(c0, c1, 0xDD));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Scores of keys c .. c + 7 of a quantized K, all shown by the mask (m8), no soft cap: eight
 * rows' lanes summed at once (hsum_each8), then scale and mask as score1. */
static inline __attribute__((always_inline)) __m256 scores8(const attn_t *A, const qrow_t *Q, const uint8_t *k,
                                                            int64_t kstride, __m256 m8, const int type) {
    __m256 lanes[8];
    float tail[8], summs[8];
    for (int j = 0; j < 8; j++)
        lanes[j] = kvb_dot_q_lanes(k + j * kstride, type, Q->q, Q->d, Q->s, A->D, tail + j, summs + j);
    const __m256 dot = _mm256_add_ps(_mm256_add_ps(hsum_each8(lanes), _mm256_loadu_ps(tail)), _mm256_loadu_ps(summs));
    return _mm256_add_ps(_mm256_mul_ps(dot, _mm256_set1_ps(A->scale)), m8);
}
#endif

/* sc[c] = score1 for the keys the mask shows (-inf for the others, not read); returns the
 * largest score. K of `type` (a constant in each inlined copy). */
static inline __attribute__((always_inline)) float scores_of_type(const attn_t *A, const float *q, const qrow_t *Q,
                                                                  const uint8_t *kb, const uint8_t *vb,
                                                                  const float *m, float *sc, const int type) {
    const int64_t kstride = A->sk_c * elem_size(type), vstride = A->sv_c * elem_size(A->v_type);
    const int64_t kbytes = kv_row_bytes(type, A->D), vbytes = kv_row_bytes(A->v_type, A->Dv);
    float mx = -INFINITY;
    int64_t c = 0;
#ifdef KV_AVX2
    if (kv_quantized(type) && A->softcap == 0.0f) { /* eight keys at a time where all eight are shown */
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        __m256 mx8 = ninf;
        for (; c + 8 <= A->n_kv; c += 8) {
            for (int64_t j = c + KV_AHEAD; j < c + KV_AHEAD + 8 && j < A->n_kv; j++) {
                prefetch_row(kb + j * kstride, kbytes); /* V too: the weighted sum reads it next */
                prefetch_row(vb + j * vstride, vbytes);
            }
            const __m256 m8 = _mm256_loadu_ps(m + c);
            const int hidden = _mm256_movemask_ps(_mm256_cmp_ps(m8, ninf, _CMP_EQ_OQ));
            if (hidden == 0) {
                const __m256 s8 = scores8(A, Q, kb + c * kstride, kstride, m8, type);
                _mm256_storeu_ps(sc + c, s8);
                mx8 = _mm256_max_ps(mx8, s8);
                continue;
            }
            for (int64_t j = c; j < c + 8; j++) {
                sc[j] = m[j] == -INFINITY ? -INFINITY : score1(A, q, Q, kb + j * kstride, m[j], type);
                if (sc[j] > mx) mx = sc[j];
            }
        }
        float top[8];
        _mm256_storeu_ps(top, mx8);
        for (int j = 0; j < 8; j++)
            if (top[j] > mx) mx = top[j];
    }
#endif
    for (; c < A->n_kv; c++) {
        if (c + KV_AHEAD < A->n_kv) { /* V too: the weighted sum reads it next */
            prefetch_row(kb + (c + KV_AHEAD) * kstride, kbytes);
            prefetch_row(vb + (c + KV_AHEAD) * vstride, vbytes);
        }
        if (m[c] == -INFINITY) {
            sc[c] = -INFINITY;
            continue;
        }
        sc[c] = score1(A, q, Q, kb + c * kstride, m[c], type);
        if (sc[c] > mx) mx = sc[c];
    }
    return mx;
}

static float scores(const attn_t *A, const float *q, const qrow_t *Q, const uint8_t *kb, const uint8_t *vb,
                    const float *m, float *sc) {
    switch (A->k_type) { /* one copy of the loop per K type, the type a constant in each */
    case KV_F16: return scores_of_type(A, q, Q, kb, vb, m, sc, KV_F16);
    case KV_BF16: return scores_of_type(A, q, Q, kb, vb, m, sc, KV_BF16);
    case KV_Q8_0: return scores_of_type(A, q, Q, kb, vb, m, sc, KV_Q8_0);
    case KV_Q4_0: return scores_of_type(A, q, Q, kb, vb, m, sc, KV_Q4_0);
    case KV_Q4_1: return scores_of_type(A, q, Q, kb, vb, m, sc, KV_Q4_1);
    case KV_Q5_0: return scores_of_type(A, q, Q, kb, vb, m, sc, KV_Q5_0);
    case KV_Q5_1: return scores_of_type(A, q, Q, kb, vb, m, sc, KV_Q5_1);
    case KV_IQ4_NL: return scores_of_type(A, q, Q, kb, vb, m, sc, KV_IQ4_NL);
    default: return scores_of_type(A, q, Q, kb, vb, m, sc, KV_F32);
    }
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
#elif defined(KV_NEON)
    const float32x4_t vmx = vdupq_n_f32(mx), ninf = vdupq_n_f32(-INFINITY);
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (; c + 4 <= n; c += 4) {
        const float32x4_t s4 = vld1q_f32(sc + c);
        float32x4_t y = exp4(vsubq_f32(s4, vmx)); /* x <= 0: exp4's upper clamp never applies */
        y = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(y), vceqq_f32(s4, ninf))); /* hidden keys weigh 0 */
        vst1q_f32(w + c, y);
        acc = vaddq_f32(acc, y);
    }
    sum = vaddvq_f32(acc);
#endif
    for (; c < n; c++) {
        w[c] = sc[c] == -INFINITY ? 0.0f : expf(sc[c] - mx);
        sum += w[c];
    }
    return sum;
}

static void axpy_row(float *acc, float w, const uint8_t *v, int type, int64_t Dv) {
    int64_t j = 0;
#ifdef KV_AVX2
    const __m256 wv = _mm256_set1_ps(w);
    for (; j + 8 <= Dv; j += 8)
        _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(wv, load8(v, type, j), _mm256_loadu_ps(acc + j)));
#elif defined(KV_NEON)
    for (; j + 4 <= Dv; j += 4) vst1q_f32(acc + j, vfmaq_n_f32(vld1q_f32(acc + j), load4(v, type, j), w));
#endif
    for (; j < Dv; j++) acc[j] += w * load1(v, type, j);
}

/* o += sum_c w[c] v[c] over the rows with w[c] != 0, V of a float type, rows `stride` bytes
 * apart. 64 columns at a time (NEON: 32) are kept in registers over all rows (an accumulator
 * in memory would make every row wait for the previous row's store). */
static inline __attribute__((always_inline)) void sum_float(float *o, const float *w, const uint8_t *v,
                                                             int64_t stride, int64_t n, int type, int64_t Dv) {
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
#elif defined(KV_NEON)
    for (; j0 + 32 <= Dv; j0 += 32) {
        float32x4_t a[8];
        for (int r = 0; r < 8; r++) a[r] = vld1q_f32(o + j0 + 4 * r);
        for (int64_t c = 0; c < n; c++) {
            if (w[c] == 0.0f) continue;
            const uint8_t *row = v + c * stride;
            for (int r = 0; r < 8; r++) a[r] = vfmaq_n_f32(a[r], load4(row, type, j0 + 4 * r), w[c]);
        }
        for (int r = 0; r < 8; r++) vst1q_f32(o + j0 + 4 * r, a[r]);
    }
#endif
    if (j0 < Dv) {
        for (int64_t c = 0; c < n; c++) {
            if (w[c] != 0.0f) axpy_row(o + j0, w[c], v + c * stride + j0 * elem_size(type), type, Dv - j0);
        }
    }
}

#ifdef KV_AVX2
/* A quantized V's weighted sum (online_cols) keeps its columns in vectors of VACC_W floats:
 * 16 with AVX-512 (half the instructions), else 8. add_block gives each value of one block
 * dequantized first, a product and a sum each rounded, as ggml's to_float gives it to
 * ggml_vec_mad_f32, then fused with the weight (so the weighted sums round as llama.cpp's). */
#ifdef KV_AVX512
#define VACC_W 16
typedef __m512 vacc_t;
static inline vacc_t vacc_zero(void) { return _mm512_setzero_ps(); }
static inline vacc_t vacc_scale(vacc_t a, float m) { return _mm512_mul_ps(a, _mm512_set1_ps(m)); }
static inline void vacc_store(float *o, vacc_t a) { _mm512_storeu_ps(o, a); }

/* a[0 .. 2) += w (d q (+ m)) over the block at blk. */
static inline __attribute__((always_inline)) void add_block(vacc_t *a, float w, const uint8_t *blk, int type) {
    __m128i lo, hi;
    if (type == KV_Q8_0) {
        lo = _mm_loadu_si128((const __m128i *)(blk + 2)), hi = _mm_loadu_si128((const __m128i *)(blk + 18));
    } else {
        const __m256i ints = kvb_decode8(blk, type);
        lo = _mm256_castsi256_si128(ints), hi = _mm256_extracti128_si256(ints, 1);
    }
    const __m512 d = _mm512_set1_ps(kvb_half(blk)), wv = _mm512_set1_ps(w);
    __m512 x0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), d);
    __m512 x1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), d);
    if (kv_affine(type)) {
        const __m512 m = _mm512_set1_ps(kvb_half(blk + 2));
        x0 = _mm512_add_ps(x0, m), x1 = _mm512_add_ps(x1, m);
    }
    a[0] = _mm512_fmadd_ps(wv, x0, a[0]);
    a[1] = _mm512_fmadd_ps(wv, x1, a[1]);
}
#else
#define VACC_W 8
typedef __m256 vacc_t;
static inline vacc_t vacc_zero(void) { return _mm256_setzero_ps(); }
static inline vacc_t vacc_scale(vacc_t a, float m) { return _mm256_mul_ps(a, _mm256_set1_ps(m)); }
static inline void vacc_store(float *o, vacc_t a) { _mm256_storeu_ps(o, a); }

/* Block values r*8 .. r*8 + 7 of a decoded block as floats (q8_0: read from memory directly). */
static inline __m256 block8(const uint8_t *blk, __m256i ints, int r, int type) {
    if (type == KV_Q8_0) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * r))));
    const __m128i half = r < 2 ? _mm256_castsi256_si128(ints) : _mm256_extracti128_si256(ints, 1);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32((r & 1) ? _mm_srli_si128(half, 8) : half));
}

/* a[0 .. 4) += w (d q (+ m)) over the block at blk. */
static inline __attribute__((always_inline)) void add_block(vacc_t *a, float w, const uint8_t *blk, int type) {
    const __m256i ints = type == KV_Q8_0 ? _mm256_setzero_si256() : kvb_decode8(blk, type);
    const __m256 d = _mm256_set1_ps(kvb_half(blk)), wv = _mm256_set1_ps(w);
    const __m256 m = _mm256_set1_ps(kv_affine(type) ? kvb_half(blk + 2) : 0.0f);
    for (int r = 0; r < 4; r++) {
        __m256 x = _mm256_mul_ps(block8(blk, ints, r, type), d);
        if (kv_affine(type)) x = _mm256_add_ps(x, m);
        a[r] = _mm256_fmadd_ps(wv, x, a[r]);
    }
}
#endif
#define VACC_BLOCK (KV_QK / VACC_W) /* vectors a block's 32 values fill */
#define VACC_PASS (8 / VACC_BLOCK)  /* blocks a pass keeps in 8 vectors: 64 columns, or 128 with AVX-512 */
#endif

static void weighted_sum(const attn_t *A, float *o, const float *w, const uint8_t *vb) {
    const int64_t stride = A->sv_c * elem_size(A->v_type), n = A->n_kv, Dv = A->Dv;
    switch (A->v_type) { /* one copy per float V type, as for the scores (a quantized V: online_sum) */
    case KV_F16: sum_float(o, w, vb, stride, n, KV_F16, Dv); break;
    case KV_BF16: sum_float(o, w, vb, stride, n, KV_BF16, Dv); break;
    default: sum_float(o, w, vb, stride, n, KV_F32, Dv); break;
    }
}

/* The weights of ggml's CPU flash attention (llama.cpp needs it for a quantized V): keys in
 * order with a running maximum M; at key c the output so far is scaled by ms[c] (expf(Mold - M)
 * on a new maximum, else 1) and gets v[c] times vs[c] (1 on a new maximum, else expf(s - M));
 * hidden keys: ms 1, vs 0. This is one key's step. */
static inline void online_key(float s, float *M, float *ms, float *vs) {
    if (s == -INFINITY) {
        *ms = 1.0f, *vs = 0.0f;
    } else if (s > *M) {
        *ms = expf(*M - s), *vs = 1.0f;
        *M = s;
    } else {
        *ms = 1.0f, *vs = expf(s - *M);
    }
}

#ifndef KV_AVX2
/* online_key over the n keys; ms may be sc (each score is read before its ms is written).
 * Returns the sum S, accumulated as ggml's (S = S * ms + vs). */
static float online_weights(const float *sc, int64_t n, float *ms, float *vs) {
    float M = -INFINITY, S = 0.0f;
    for (int64_t c = 0; c < n; c++) {
        online_key(sc[c], &M, ms + c, vs + c);
        S = S * ms[c] + vs[c];
    }
    return S;
}
#endif

#ifdef KV_AVX2
/* x with its lanes moved up by k (lane i gets lane i - k), -inf into the first k. */
static inline __m256 lanes_up(__m256 x, const int k) {
    const __m256i idx = k == 1 ? _mm256_setr_epi32(0, 0, 1, 2, 3, 4, 5, 6)
                        : k == 2 ? _mm256_setr_epi32(0, 0, 0, 1, 2, 3, 4, 5)
                                 : _mm256_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3);
    const __m256 ninf = _mm256_set1_ps(-INFINITY), p = _mm256_permutevar8x32_ps(x, idx);
    return k == 1 ? _mm256_blend_ps(p, ninf, 0x01) : k == 2 ? _mm256_blend_ps(p, ninf, 0x03) : _mm256_blend_ps(p, ninf, 0x0F);
}

/* online_weights' ms and vs, 8 keys at a time: M before key c is the running maximum of the
 * scores before it (a scan), so every key's expf is known at once: expf(-|s - M|) is ms on a
 * new maximum (expf(M - s)) and vs otherwise (expf(s - M)); expf_libm8 has libm's bits. The sum
 * S is left to sum_online, which adds it in ggml's order. ms may be sc. */
static void online_weights8(const float *sc, int64_t n, float *ms, float *vs) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    __m256 carry = ninf; /* the maximum so far, in every lane */
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const __m256 s = _mm256_loadu_ps(sc + c);
        __m256 t = _mm256_max_ps(s, lanes_up(s, 1));
        t = _mm256_max_ps(t, lanes_up(t, 2));
        t = _mm256_max_ps(t, lanes_up(t, 4)); /* lane i: the maximum of lanes 0 .. i */
        const __m256 M = _mm256_max_ps(lanes_up(t, 1), carry);
        carry = _mm256_permutevar8x32_ps(_mm256_max_ps(t, carry), _mm256_set1_epi32(7));
        const __m256 e = expf_libm8(_mm256_or_ps(_mm256_sub_ps(s, M), sign)); /* -|s - M| */
        const __m256 fresh = _mm256_cmp_ps(s, M, _CMP_GT_OQ), hidden = _mm256_cmp_ps(s, ninf, _CMP_EQ_OQ);
        _mm256_storeu_ps(ms + c, _mm256_blendv_ps(_mm256_blendv_ps(one, e, fresh), one, hidden));
        _mm256_storeu_ps(vs + c, _mm256_andnot_ps(hidden, _mm256_blendv_ps(e, one, fresh)));
    }
    float M = _mm256_cvtss_f32(carry);
    for (; c < n; c++) online_key(sc[c], &M, ms + c, vs + c); /* the last keys one by one */
}

/* Columns [32 b0, 32 (b0 + nblk)) of ggml's online steps (see sum_online), kept in registers
 * over all keys; returns S, the sum of the weights accumulated as ggml's: S = S * ms + vs (keys
 * with vs 0 add nothing, and S * 1 is S). nblk is a constant in each inlined copy. */
static inline __attribute__((always_inline)) float online_cols(float *o, const float *ms, const float *vs,
                                                                const uint8_t *v, int64_t stride, int64_t n,
                                                                int type, int64_t b0, const int nblk) {
    const int bb = kv_unit_bytes(type);
    vacc_t a[8];
    for (int r = 0; r < VACC_BLOCK * nblk; r++) a[r] = vacc_zero();
    float S = 0.0f;
    for (int64_t c = 0; c < n; c++) {
        if (vs[c] == 0.0f) continue; /* hidden (or a weight that underflowed: adds nothing) */
        if (ms[c] != 1.0f) {
            for (int r = 0; r < VACC_BLOCK * nblk; r++) a[r] = vacc_scale(a[r], ms[c]);
            S *= ms[c];
        }
        S += vs[c];
        for (int k = 0; k < nblk; k++) add_block(a + VACC_BLOCK * k, vs[c], v + c * stride + (b0 + k) * bb, type);
    }
    for (int r = 0; r < VACC_BLOCK * nblk; r++) vacc_store(o + b0 * KV_QK + VACC_W * r, a[r]);
    return S;
}
#endif

/* o = sum over keys of ggml's online steps (o = o * ms[c], then o = fma(v[c], vs[c], o), each V
 * value d q (+ m) as its to_float gives it), then o / S: the roundings of ggml's loop, so a later
 * layer that quantizes this output rounds as llama.cpp's does (a two-pass softmax differs in the
 * last bits, enough to flip a q8_0 step). 64 columns at a time kept in registers over all keys
 * (no row is dequantized into memory). */
static inline __attribute__((always_inline)) void sum_online(float *o, float *sc, float *w, const uint8_t *v,
                                                              int64_t stride, int64_t n, int type, int64_t Dv) {
    const int64_t nb = Dv / KV_QK;
    float S = 0.0f, *ms = sc, *vs = w;
#ifdef KV_AVX2
    online_weights8(sc, n, ms, vs);
    for (int64_t b0 = 0; b0 < nb; b0 += VACC_PASS) {
        switch (nb - b0 < VACC_PASS ? nb - b0 : VACC_PASS) { /* the block count a constant in each copy */
        case 1: S = online_cols(o, ms, vs, v, stride, n, type, b0, 1); break;
#if VACC_PASS == 4
        case 2: S = online_cols(o, ms, vs, v, stride, n, type, b0, 2); break;
        case 3: S = online_cols(o, ms, vs, v, stride, n, type, b0, 3); break;
#endif
        default: S = online_cols(o, ms, vs, v, stride, n, type, b0, VACC_PASS); break;
        }
    }
#else
    S = online_weights(sc, n, ms, vs);
    const int bb = kv_unit_bytes(type);
    int8_t q[KV_QK];
    for (int64_t c = 0; c < n; c++) {
        if (vs[c] == 0.0f) continue;
        if (ms[c] != 1.0f)
            for (int64_t j = 0; j < Dv; j++) o[j] *= ms[c];
        for (int64_t b = 0; b < nb; b++) {
            float d, m;
            kvb_decode(v + c * stride + b * bb, type, q, &d, &m);
            for (int j = 0; j < KV_QK; j++) {
                const float x = q[j] * d; /* rounded before m is added, as ggml's to_float */
                o[b * KV_QK + j] = fmaf(kv_affine(type) ? x + m : x, vs[c], o[b * KV_QK + j]);
            }
        }
    }
#endif
    const float inv = S == 0.0f ? 0.0f : 1.0f / S;
    for (int64_t j = 0; j < Dv; j++) o[j] *= inv;
}

static void online_sum(const attn_t *A, float *o, float *sc, float *w, const uint8_t *vb) {
    const int64_t stride = A->sv_c, n = A->n_kv, Dv = A->Dv;
    switch (A->v_type) {
    case KV_Q8_0: sum_online(o, sc, w, vb, stride, n, KV_Q8_0, Dv); break;
    case KV_Q4_0: sum_online(o, sc, w, vb, stride, n, KV_Q4_0, Dv); break;
    case KV_Q4_1: sum_online(o, sc, w, vb, stride, n, KV_Q4_1, Dv); break;
    case KV_Q5_0: sum_online(o, sc, w, vb, stride, n, KV_Q5_0, Dv); break;
    case KV_Q5_1: sum_online(o, sc, w, vb, stride, n, KV_Q5_1, Dv); break;
    default: sum_online(o, sc, w, vb, stride, n, KV_IQ4_NL, Dv); break;
    }
}

/* Per-task scratch: scores and weights over the keys, and the quantized query row. */
static size_t scratch_bytes(int64_t n_kv, int64_t D) {
    const int64_t n = n_kv > 0 ? n_kv : 1;
    return sizeof(float) * (size_t)(2 * n + 2 * (D / KV_QK + 1)) + (size_t)D + 64;
}

/* Query heads [i0, i1) of the flattened (stream, head) items. */
static void attn_items(void *ctx, int64_t i0, int64_t i1) {
    const attn_t *A = ctx;
    const int64_t n = A->n_kv > 0 ? A->n_kv : 1, nb = A->D / KV_QK + 1;
    float *sc = malloc(scratch_bytes(A->n_kv, A->D));
    if (!sc) return; /* the caller checked a buffer of this size could be had */
    const int online = kv_quantized(A->v_type);
    float *w = sc + n;
    qrow_t Q = {(int8_t *)(w + n + 2 * nb), w + n, w + n + nb};
    const int qk = kv_quantized(A->k_type);
    const int64_t ek = elem_size(A->k_type), ev = elem_size(A->v_type);
    for (int64_t it = i0; it < i1; it++) {
        const int64_t s = it / A->H, h = it % A->H, hk = h / A->g;
        const uint8_t *kb = A->k + (s * A->sk_s + hk * A->sk_h) * ek;
        const uint8_t *vb = A->v + (s * A->sv_s + hk * A->sv_h) * ev;
        for (int64_t i = 0; i < A->n_q; i++) {
            const float *q = A->q + s * A->sq_s + i * A->sq_i + h * A->sq_h;
            const float *m = A->mask + s * A->sm_s + i * A->sm_i;
            float *o = A->out + ((s * A->n_q + i) * A->H + h) * A->Dv;
            memset(o, 0, sizeof(float) * (size_t)A->Dv);
            if (qk) kvb_quantize_q(q, A->D, Q.q, Q.d, Q.s);
            const float mx = scores(A, q, &Q, kb, vb, m, sc);
            int nan = 0;
            for (int64_t c = 0; c < A->n_kv; c++) nan |= sc[c] != sc[c];
            if (nan) { /* NaN in Q or K: the row is NaN, as softmax makes it (not zeros, not hidden) */
                for (int64_t j = 0; j < A->Dv; j++) o[j] = NAN;
                continue;
            }
            if (mx == -INFINITY) continue; /* sees no key: zeros */
            if (online) {
                online_sum(A, o, sc, w, vb);
                continue;
            }
            const float sum = exp_row(w, sc, mx, A->n_kv);
            weighted_sum(A, o, w, vb);
            const float inv = 1.0f / sum;
            for (int64_t j = 0; j < A->Dv; j++) o[j] *= inv;
        }
    }
    free(sc);
}

/* See the file's comment; each score soft-capped at `softcap` unless it is 0 (Gemma 2: cap *
 * tanh(scale * q.k / cap), then the mask). Strides are in elements of each tensor (bytes for a
 * quantized type); q, mask and out are float32, k of `k_type` and v of `v_type` (kv_blocks.h's
 * ids; a quantized type's rows of D or Dv values are whole blocks). Returns 0, or -1 for a bad call. */
int kva_attention(const float *q, int64_t sq_s, int64_t sq_i, int64_t sq_h, const void *k, int64_t sk_s,
                  int64_t sk_c, int64_t sk_h, const void *v, int64_t sv_s, int64_t sv_c, int64_t sv_h,
                  int k_type, int v_type, const float *mask, int64_t sm_s, int64_t sm_i, float *out, int64_t S,
                  int64_t n_q, int64_t H, int64_t Hkv, int64_t n_kv, int64_t D, int64_t Dv, float scale,
                  float softcap) {
    if (!kv_valid(k_type) || !kv_valid(v_type) || S < 0 || n_q < 0 || Hkv < 1 || H % Hkv || n_kv < 0) return -1;
    if ((kv_quantized(k_type) && D % KV_QK) || (kv_quantized(v_type) && Dv % KV_QK)) return -1;
    attn_t A = {q, sq_s, sq_i, sq_h, k, v, sk_s, sk_c, sk_h, sv_s, sv_c, sv_h, k_type, v_type,
                mask, sm_s, sm_i, out, n_q, H, H / Hkv, n_kv, D, Dv, scale, softcap};
    void *probe = malloc(scratch_bytes(n_kv, D));
    if (!probe) return -1;
    free(probe);
    kv_parallel(attn_items, &A, S * H, 1);
    return 0;
}
