/* Helpers the compiled CPU kernels share (header-only: each kernel file inlines them): the half
 * conversion and, with AVX2 or NEON, a horizontal sum and e^x. */
#ifndef KVTOOL_CPU_HALF_H
#define KVTOOL_CPU_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* An IEEE half's bits as a float: F16C where the compiler targets it, exact bit arithmetic
 * otherwise (subnormals, infinities and NaNs included). */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__) || defined(__AVX2__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (man ? 0x400000 : 0) | (man << 13); /* a NaN comes out quiet, as with F16C */
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* x86's float -> int32 conversion (cvtps_epi32), rounding to nearest even, defined for every
 * input as there: a NaN or a value outside the int32 range gives INT32_MIN (the "integer
 * indefinite"), where C's conversion is undefined. */
static inline int32_t round_to_i32(float v) {
    return fabsf(v) < 2147483648.0f ? (int32_t)nearbyintf(v) : INT32_MIN;
}

/* An int32 saturated to int8, as x86's packs_epi32 then packs_epi16 give it. */
static inline int8_t saturate_i8(int32_t i) { return (int8_t)(i > 127 ? 127 : i < -128 ? -128 : i); }

/* y = x * w / sqrt(mean(x^2) + eps) over n elements, as ggml computes an RMS norm: each square a
 * float, their sum in double, then (x * scale) * w; y may be x. */
static inline void rms_norm_row(const float *x, int64_t n, const float *w, float eps, float *y) {
    double ss = 0.0;
    for (int64_t j = 0; j < n; j++) ss += (double)(x[j] * x[j]);
    const float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t j = 0; j < n; j++) y[j] = (x[j] * scale) * w[j];
}

/* A float as an IEEE half's bits, rounded to nearest even (as torch's .to(float16)): F16C where the
 * compiler targets it, bit arithmetic otherwise. */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000;
    const uint32_t au = u & 0x7FFFFFFF;
    if (au > 0x7F800000) return (uint16_t)(sign | 0x7E00 | ((au >> 13) & 0x3FF)); /* NaN: quiet, its payload's top (F16C's) */
    if (au >= 0x477FF000) return (uint16_t)(sign | 0x7C00); /* an infinity, or rounds past the largest half */
    if (au < 0x38800000) { /* a half subnormal (or zero): round |f| * 2^24 to an integer, ties to even */
        float af;
        memcpy(&af, &au, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(af * 16777216.0f));
    }
    const uint32_t mant = au + 0xFFF + ((au >> 13) & 1) - 0x38000000; /* rebias, round to nearest even */
    return (uint16_t)(sign | (mant >> 13));
#endif
}

#if defined(__AVX2__)
/* The sum of a vector's eight floats. */
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* e^x for 8 floats: x = n ln 2 + r, e^r by Cephes' expf polynomial, 2^n in the exponent bits;
 * within 2 ulp of expf. x is clamped to [-87.3, 88] (e^x stays a normal float: silu of a gate
 * below -88 comes out about 1e-36 times the gate instead of a denormal); a NaN stays NaN. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x)); /* NaN: x */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
/* exp8's e^x for 4 floats (the same clamp, reduction and polynomial, fused as there). */
static inline float32x4_t exp4(float32x4_t x) {
    x = vminq_f32(vdupq_n_f32(88.0f), vmaxq_f32(vdupq_n_f32(-87.3f), x));
    const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
    p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
    p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
    p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
    p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0f)), p, vmulq_f32(r, r));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
#endif

#endif
