/* What the row kernel files (qrows_0.c, qrows_k.c) share: the AVX2 or NEON helpers, and the table of a
 * format's kernels for 1, 2, 4 and 8 activation rows made from one always-inlined function. */
#ifndef KVTOOL_QROWS_H
#define KVTOOL_QROWS_H

#include <stdint.h>
#include <string.h>

#include "qformats.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1

/* 16 bytes -> 32 values: the low nibbles, then the high nibbles (ggml's bytes_from_nibbles_32). */
static inline __m256i nibbles32(const uint8_t *p) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0xF));
}

/* 32 bits -> 32 bytes: byte j is 0xFF where bit j is set (ggml's bytes_from_bits_32). */
static inline __m256i bits32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    const __m256i which = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), which);
    return _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
}

/* Unsigned bytes times signed bytes, each 4 neighbours summed into an int32 lane: VNNI where the
 * machine has it, as ggml's mul_sum_us8_pairs_float chooses (the same sums: no pair here reaches
 * the int16 saturation of maddubs). */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
/* A Q6_K super-block's 256 unsigned values (q + 32), 32 a vector in ggml's order (its AVX2 vec_dot). */
static inline void q6_K_values(const block_q6_K *x, __m256i q[8]) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    for (int j = 0; j < 2; j++) {
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * j));
        const __m256i b2 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * j + 32));
        const __m256i bh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * j));
        const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(bh, m3), 4);
        const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(12)), 2);
        const __m256i h2 = _mm256_and_si256(bh, _mm256_set1_epi8(48));
        const __m256i h3 = _mm256_srli_epi16(_mm256_and_si256(bh, _mm256_set1_epi8(-64)), 2);
        q[4 * j] = _mm256_or_si256(_mm256_and_si256(b1, m15), h0);
        q[4 * j + 1] = _mm256_or_si256(_mm256_and_si256(b2, m15), h1);
        q[4 * j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m15), h2);
        q[4 * j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m15), h3);
    }
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define KV_NEON 1

/* acc + the products of 16 signed bytes, each 4 neighbours summed into an int32 lane: the dot
 * product instruction where the CPU has it, else widening multiplies (ggml's ggml_vdotq_s32);
 * the same integers either way. */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    const int16x8_t p0 = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    const int16x8_t p1 = vmull_s8(vget_high_s8(a), vget_high_s8(b));
    return vaddq_s32(acc, vaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1)));
#endif
}
#endif

/* kvq_rows_NAME: FN(TYPE, w, nb, act, out, R) for R = 1, 2, 4 and 8. */
#define ROW_VARIANT(NAME, FN, TYPE, R)                                                                   \
    static void NAME##_##R(const uint8_t *w, int64_t nb, const uint8_t *const *act, float *out) {        \
        FN(TYPE, w, nb, act, out, R);                                                                    \
    }
#define ROW_VARIANTS(NAME, FN, TYPE)                                                                     \
    ROW_VARIANT(NAME, FN, TYPE, 1)                                                                       \
    ROW_VARIANT(NAME, FN, TYPE, 2)                                                                       \
    ROW_VARIANT(NAME, FN, TYPE, 4)                                                                       \
    ROW_VARIANT(NAME, FN, TYPE, 8)                                                                       \
    const rows_fn kvq_##NAME[ROW_KERNELS] = {NAME##_1, NAME##_2, NAME##_4, NAME##_8};

#endif
