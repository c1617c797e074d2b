/* Activation quantization for the block matmuls: see q8_act.h. The AVX2 code and the portable
 * code give the same blocks. */

#include "q8_act.h"

#include <math.h>
#include <string.h>

#include "cpu_half.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1
#endif

#ifdef KV_AVX2
static inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 32 floats -> 32 int8 of round(x * id) (ties to even) in element order, and the sums of the two
 * halves of 16. */
static inline void quantize32(const float *x, float id, int8_t *q, int s16[2]) {
    const __m256 mul = _mm256_set1_ps(id);
    __m256i i[4];
    for (int r = 0; r < 4; r++)
        i[r] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * r), mul),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    s16[0] = hsum_i32(_mm256_add_epi32(i[0], i[1]));
    s16[1] = hsum_i32(_mm256_add_epi32(i[2], i[3]));
}

/* The index of the first of n floats whose |x| is amax (n a multiple of 8), or -1. */
static inline int64_t first_of(const float *x, int64_t n, float amax) {
    const __m256 sign = _mm256_set1_ps(-0.0f), m = _mm256_set1_ps(amax);
    for (int64_t j = 0; j < n; j += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), m, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
    return -1;
}

/* max |x| over n floats (n a multiple of 8), or NaN where one is NaN: ggml's max passes a NaN
 * over and rounds it to some int8, so it would vanish from the product (issue 28). */
static inline float amax_of(const float *x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}
#else
/* The AVX2 code's numbers for every input: a NaN product (a NaN in the block, or an infinity
 * times 0) is INT32_MIN, -128 once saturated, and the sums add the int32 values (wrapping). */
static inline void quantize32(const float *x, float id, int8_t *q, int s16[2]) {
    uint32_t sum[2] = {0, 0};
    for (int j = 0; j < QK8; j++) {
        const int32_t i = round_to_i32(x[j] * id);
        q[j] = saturate_i8(i);
        sum[j / 16] += (uint32_t)i;
    }
    s16[0] = (int)sum[0], s16[1] = (int)sum[1];
}

static inline int64_t first_of(const float *x, int64_t n, float amax) {
    for (int64_t j = 0; j < n; j++)
        if (fabsf(x[j]) == amax) return j;
    return -1;
}

static inline float amax_of(const float *x, int64_t n) {
    float m = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        if (isnan(x[j])) return NAN;
        m = fmaxf(m, fabsf(x[j]));
    }
    return m;
}
#endif

void kvq_quantize_row_q8_0(const float *x, block_q8_0 *y, int64_t k) {
    for (int64_t b = 0; b < k / QK8; b++, x += QK8) {
        const float amax = amax_of(x, QK8);
        int s16[2];
        y[b].d = float_to_half(amax / 127.0f);
        quantize32(x, amax != 0.0f ? 127.0f / amax : 0.0f, y[b].qs, s16);
    }
}

void kvq_quantize_row_q8_1(const float *x, block_q8_1 *y, int64_t k) {
    for (int64_t b = 0; b < k / QK8; b++, x += QK8) {
        const float amax = amax_of(x, QK8), d = amax / 127.0f;
        int s16[2];
        y[b].d = float_to_half(d);
        quantize32(x, amax != 0.0f ? 127.0f / amax : 0.0f, y[b].qs, s16);
        y[b].s = float_to_half(d * (float)(int)((uint32_t)s16[0] + (uint32_t)s16[1]));
    }
}

void kvq_quantize_row_q8_K(const float *x, block_q8_K *y, int64_t k) {
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K) {
        const float amax = amax_of(x, QK_K);
        if (amax == 0.0f || isnan(amax)) { /* ggml leaves bsums as they were: zeros here */
            memset(&y[b], 0, sizeof(y[b]));
            y[b].d = amax; /* a NaN reaches the row's results */
            continue;
        }
        const float max = x[first_of(x, QK_K, amax)]; /* the first largest |x|, with its sign */
        const float iscale = -127.0f / max;
        for (int g = 0; g < QK_K / QK8; g++) { /* |iscale * x| <= 127: ggml's MIN(127, v) never bites */
            int s16[2];
            quantize32(x + g * QK8, iscale, y[b].qs + g * QK8, s16);
            y[b].bsums[2 * g] = (int16_t)s16[0], y[b].bsums[2 * g + 1] = (int16_t)s16[1];
        }
        y[b].d = 1.0f / iscale;
    }
}

int64_t kvq_act_row_bytes(int vdt, int64_t k) {
    switch (vdt) {
    case VDT_Q8_0: return k / QK8 * (int64_t)sizeof(block_q8_0);
    case VDT_Q8_1: return k / QK8 * (int64_t)sizeof(block_q8_1);
    default: return k / QK_K * (int64_t)sizeof(block_q8_K);
    }
}

void kvq_quantize_row(int vdt, const float *x, void *y, int64_t k) {
    switch (vdt) {
    case VDT_Q8_0: kvq_quantize_row_q8_0(x, y, k); break;
    case VDT_Q8_1: kvq_quantize_row_q8_1(x, y, k); break;
    default: kvq_quantize_row_q8_K(x, y, k); break;
    }
}
