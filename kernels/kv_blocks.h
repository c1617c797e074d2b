/* K/V cache types as the compiled CPU kernels read them (header-only: attention_cpu.c and
 * rope_store_cpu.c inline it). The ids are kernels/kv_quant.py's `C_IDS`; the block layouts are
 * GGUF's (ggml-common.h): 32 values per block, an fp16 scale d first, an fp16 minimum m next for
 * the affine q4_1/q5_1, q5's fifth bits as a little-endian uint32, then the quants (4-bit ones
 * two to a byte: element j in the low nibble, j + 16 in the high one).
 *
 * Attention mirrors ggml's CPU flash attention over a quantized K: the query row is quantized
 * to q8_0 (q8_1 for an affine K) and each key block contributes d_k * d_q * (integer dot) (+ m_k
 * * s_q), with the integer products summed as ggml's AVX2 code does (maddubs of |x| and sign(y,
 * x)). A quantized V row is dequantized to float per block (d * q (+ m)) and added weighted. */
#ifndef KVTOOL_KV_BLOCKS_H
#define KVTOOL_KV_BLOCKS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_half.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVB_AVX2 1
#endif

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_Q8_0 = 3, KV_Q4_0 = 4, KV_Q4_1 = 5, KV_Q5_0 = 6, KV_Q5_1 = 7, KV_IQ4_NL = 8 };
#define KV_NTYPES 9
#define KV_QK 32

static const int8_t kvb_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline int kv_quantized(int type) { return type >= KV_Q8_0 && type < KV_NTYPES; }
static inline int kv_affine(int type) { return type == KV_Q4_1 || type == KV_Q5_1; }
static inline int kv_valid(int type) { return type >= 0 && type < KV_NTYPES; }

/* Bytes of one element (a float type) or of one block of 32 (a quantized type). */
static inline int kv_unit_bytes(int type) {
    static const int bytes[KV_NTYPES] = {4, 2, 2, 34, 18, 20, 22, 24, 18};
    return bytes[type];
}

/* Bytes a row of n values takes (n a multiple of 32 for a quantized type). */
static inline int64_t kv_row_bytes(int type, int64_t n) {
    return kv_quantized(type) ? n / KV_QK * kv_unit_bytes(type) : n * kv_unit_bytes(type);
}

static inline float kvb_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* A block's 32 values as integers (q8_0: q; q4_0: q - 8; q5_0: q - 16; q4_1/q5_1: q; iq4_nl: the
 * table's value) with its scale d and minimum m (0 but for the affine types): x = d * q + m. */
static inline void kvb_decode(const uint8_t *b, int type, int8_t *q, float *d, float *m) {
    *d = kvb_half(b);
    *m = kv_affine(type) ? kvb_half(b + 2) : 0.0f;
    switch (type) {
    case KV_Q8_0: memcpy(q, b + 2, 32); break;
    case KV_Q4_0:
    case KV_Q4_1:
    case KV_IQ4_NL: {
        const uint8_t *qs = b + (type == KV_Q4_1 ? 4 : 2);
        for (int j = 0; j < 16; j++) {
            const int lo = qs[j] & 15, hi = qs[j] >> 4;
            if (type == KV_IQ4_NL) {
                q[j] = kvb_iq4nl[lo];
                q[j + 16] = kvb_iq4nl[hi];
            } else {
                q[j] = (int8_t)(lo - (type == KV_Q4_0 ? 8 : 0));
                q[j + 16] = (int8_t)(hi - (type == KV_Q4_0 ? 8 : 0));
            }
        }
        break;
    }
    default: { /* q5_0, q5_1 */
        const int at = type == KV_Q5_1 ? 4 : 2;
        uint32_t qh;
        memcpy(&qh, b + at, 4);
        const uint8_t *qs = b + at + 4;
        const int off = type == KV_Q5_0 ? 16 : 0;
        for (int j = 0; j < 16; j++) {
            q[j] = (int8_t)(((qs[j] & 15) | (((qh >> j) & 1) << 4)) - off);
            q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
        }
    }
    }
}

#ifdef KVB_AVX2
/* ggml's bytes_from_bits_32: byte j is 0xFF where bit j of x is set. */
static inline __m256i kvb_bits32(const uint8_t *x) {
    uint32_t x32;
    memcpy(&x32, x, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* 16 bytes of nibbles as 32 bytes: the low nibbles, then the high ones. */
static inline __m256i kvb_nibbles(const uint8_t *qs) {
    const __m128i t = _mm_loadu_si128((const __m128i *)qs);
    const __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(b, _mm256_set1_epi8(15));
}

/* kvb_decode's integers as one vector of 32 bytes. */
static inline __m256i kvb_decode8(const uint8_t *b, int type) {
    switch (type) {
    case KV_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case KV_Q4_0: return _mm256_sub_epi8(kvb_nibbles(b + 2), _mm256_set1_epi8(8));
    case KV_Q4_1: return kvb_nibbles(b + 4);
    case KV_IQ4_NL: {
        const __m128i t = _mm_loadu_si128((const __m128i *)kvb_iq4nl);
        return _mm256_shuffle_epi8(_mm256_insertf128_si256(_mm256_castsi128_si256(t), t, 1), kvb_nibbles(b + 2));
    }
    case KV_Q5_0: /* q - 16: the nibble with 0xF0 where the fifth bit is clear */
        return _mm256_or_si256(kvb_nibbles(b + 6), _mm256_andnot_si256(kvb_bits32(b + 2), _mm256_set1_epi8((char)0xF0)));
    default: /* q5_1 */
        return _mm256_or_si256(kvb_nibbles(b + 8), _mm256_and_si256(kvb_bits32(b + 4), _mm256_set1_epi8(0x10)));
    }
}

/* The sum of x[i] * y[i] over 32 signed bytes, as 8 int32 lanes converted to float (ggml's
 * mul_sum_i8_pairs_float). */
static inline __m256 kvb_dot8(__m256i x, __m256i y) {
    const __m256i ax = _mm256_sign_epi8(x, x), sy = _mm256_sign_epi8(y, x);
    const __m256i dot = _mm256_maddubs_epi16(ax, sy);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(dot, _mm256_set1_epi16(1)));
}
#endif

/* A query row of n floats (n a multiple of 32) quantized as ggml's x86 quantize_row_q8_0/q8_1:
 * per block d = max|x| / 127 (its fp16 rounding kept as float in d[b]), q = x * (127 / max|x|)
 * rounded to nearest even; s[b] = fp16(d * sum(q)) (q8_1's, as float). */
static inline void kvb_quantize_q(const float *x, int64_t n, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < n / KV_QK; b++) {
        const float *xb = x + b * KV_QK;
        float amax = 0.0f;
        for (int j = 0; j < KV_QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float db = amax / 127.f, id = amax != 0.0f ? 127.f / amax : 0.0f;
        uint32_t sum = 0; /* x86's int32 lanes: a NaN's INT32_MIN wraps */
        for (int j = 0; j < KV_QK; j++) {
            const int32_t v = round_to_i32(xb[j] * id);
            q[b * KV_QK + j] = saturate_i8(v);
            sum += (uint32_t)v;
        }
        d[b] = half_to_float(float_to_half(db));
        s[b] = half_to_float(float_to_half(db * (float)(int32_t)sum));
    }
}

#ifdef KVB_AVX2
/* kvb_dot_q before its last additions: the 8 lanes whose sum (hsum) it is, the odd last block
 * of an iq4_nl row (ggml's scalar code, d * integer sum) in *tail and an affine K's minimums
 * times the query's block sums in *summs (0 where the type has none): the dot product is
 * hsum(lanes) + *tail + *summs. */
static inline __attribute__((always_inline)) __m256 kvb_dot_q_lanes(const uint8_t *k, int type, const int8_t *q,
                                                                     const float *d, const float *s, int64_t n,
                                                                     float *tail, float *summs) {
    const int bb = kv_unit_bytes(type);
    /* ggml's iq4_nl code alternates two accumulators over the blocks; the others keep one */
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const int64_t nb = n / KV_QK;
    *tail = 0.0f, *summs = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *kb = k + b * bb;
        if (type == KV_IQ4_NL && (nb & 1) && b == nb - 1) {
            int8_t kq[KV_QK];
            float dk, mk;
            kvb_decode(kb, type, kq, &dk, &mk);
            int isum = 0;
            for (int j = 0; j < KV_QK; j++) isum += kq[j] * q[b * KV_QK + j];
            *tail += d[b] * dk * (float)isum;
            continue;
        }
        const __m256 p = kvb_dot8(kvb_decode8(kb, type), _mm256_loadu_si256((const __m256i *)(q + b * KV_QK)));
        const int a = type == KV_IQ4_NL ? (int)(b & 1) : 0;
        acc[a] = _mm256_fmadd_ps(_mm256_set1_ps(kvb_half(kb) * d[b]), p, acc[a]);
        if (kv_affine(type)) *summs += kvb_half(kb + 2) * s[b];
    }
    return type == KV_IQ4_NL ? _mm256_add_ps(acc[0], acc[1]) : acc[0];
}
#endif

/* A query quantized by kvb_quantize_q dotted with one key row of `type` (n values). */
static inline __attribute__((always_inline)) float kvb_dot_q(const uint8_t *k, int type, const int8_t *q,
                                                              const float *d, const float *s, int64_t n) {
#ifdef KVB_AVX2
    float tail, summs;
    const __m256 lanes = kvb_dot_q_lanes(k, type, q, d, s, n, &tail, &summs);
    return hsum(lanes) + tail + summs;
#else
    const int bb = kv_unit_bytes(type);
    float sum = 0.0f, summs = 0.0f;
    int8_t kq[KV_QK];
    for (int64_t b = 0; b < n / KV_QK; b++) {
        float dk, mk;
        kvb_decode(k + b * bb, type, kq, &dk, &mk);
        int isum = 0;
        for (int j = 0; j < KV_QK; j++) isum += kq[j] * q[b * KV_QK + j];
        sum += dk * d[b] * (float)isum;
        summs += mk * s[b];
    }
    return sum + summs;
#endif
}

/* The Walsh-Hadamard rotation of kernels/hadamard.py (ggml's fwht), in place on each run of
 * n values of x[0 .. len): scaled by 1 / sqrt(n), then butterflies (u, v) -> (u + v, u - v) of
 * width 1, 2, ... n / 2: the same float operations in the same order. */
static inline void kvb_fwht(float *x, int64_t len, int64_t n) {
    const float scale = 1.0f / sqrtf((float)n);
    for (int64_t r = 0; r < len; r += n) {
        float *y = x + r;
        for (int64_t j = 0; j < n; j++) y[j] = y[j] * scale;
        for (int64_t w = 1; w < n; w <<= 1)
            for (int64_t i = 0; i < n; i += 2 * w)
                for (int64_t j = 0; j < w; j++) {
                    const float u = y[i + j], v = y[i + w + j];
                    y[i + j] = u + v;
                    y[i + w + j] = u - v;
                }
    }
}

#endif
