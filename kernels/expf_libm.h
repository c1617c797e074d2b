/* glibc's expf for 8 floats at once, with its bits (header-only: attention_cpu.c inlines it).
 *
 * ggml's CPU flash attention, which a quantized V cache needs, weighs each key with libm's expf;
 * a vectorized exp that differs in the last bit would move kvtool's outputs off llama.cpp's. This
 * is glibc's algorithm (sysdeps/ieee754/flt-32/e_expf.c, since 2.27) as its FMA build computes it:
 * in double, x * 32 / ln 2 = k + r, 2^(k/32) from a table of 32 and 2^(r/32) by a cubic, fused as
 * that build fuses it (in 8 doubles with AVX-512, else 4), then one rounding to float; below log(2^-149) the results of its underflow
 * branches. Equal to glibc's expf for every float (checked over all of them); other C libraries'
 * expf may differ from it in the last bit. */
#ifndef KVTOOL_EXPF_LIBM_H
#define KVTOOL_EXPF_LIBM_H

#include <math.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* __exp2f_data.tab: the bits of 2^(i/32) less i << 47. */
static const int64_t expf_libm_tab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};

#if defined(__AVX512F__)
/* The main path for 8 floats, in 8 doubles: e^x rounded once to float. */
static inline __m256 expf_libm_main(__m256 x) {
    const __m512d xd = _mm512_cvtps_pd(x);
    const __m512d invln2n = _mm512_set1_pd(0x1.71547652b82fep+5), shift = _mm512_set1_pd(0x1.8p+52);
    const __m512d kds = _mm512_fmadd_pd(invln2n, xd, shift); /* k + shift: k rounded to an integer */
    const __m512i ki = _mm512_castpd_si512(kds);
    const __m512d r = _mm512_fmsub_pd(invln2n, xd, _mm512_sub_pd(kds, shift));
    /* the table by the low 5 bits of k: two two-register permutes (4 bits each), then bit 4 */
    const __m512i t0 = _mm512_loadu_si512(expf_libm_tab), t1 = _mm512_loadu_si512(expf_libm_tab + 8);
    const __m512i t2 = _mm512_loadu_si512(expf_libm_tab + 16), t3 = _mm512_loadu_si512(expf_libm_tab + 24);
    const __m512i t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(ki, _mm512_set1_epi64(16)),
                                              _mm512_permutex2var_epi64(t0, ki, t1), _mm512_permutex2var_epi64(t2, ki, t3));
    const __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));
    const __m512d z = _mm512_fmadd_pd(r, _mm512_set1_pd(0x1.c6af84b912394p-20), _mm512_set1_pd(0x1.ebfce50fac4f3p-13));
    const __m512d y = _mm512_fmadd_pd(r, _mm512_set1_pd(0x1.62e42ff0c52d6p-6), _mm512_set1_pd(1.0));
    return _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y), s));
}
#else
/* The main path for 4 doubles (x converted from float): e^x rounded once to float. */
static inline __m128 expf_libm4(__m256d xd) {
    const __m256d invln2n = _mm256_set1_pd(0x1.71547652b82fep+5), shift = _mm256_set1_pd(0x1.8p+52);
    const __m256d kds = _mm256_fmadd_pd(invln2n, xd, shift); /* k + shift: k rounded to an integer */
    const __m256i ki = _mm256_castpd_si256(kds);
    const __m256d r = _mm256_fmsub_pd(invln2n, xd, _mm256_sub_pd(kds, shift));
    const __m256i t = _mm256_i64gather_epi64((const long long *)expf_libm_tab,
                                             _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8);
    const __m256d s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64(ki, 47)));
    const __m256d z = _mm256_fmadd_pd(r, _mm256_set1_pd(0x1.c6af84b912394p-20), _mm256_set1_pd(0x1.ebfce50fac4f3p-13));
    const __m256d y = _mm256_fmadd_pd(r, _mm256_set1_pd(0x1.62e42ff0c52d6p-6), _mm256_set1_pd(1.0));
    return _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_fmadd_pd(z, _mm256_mul_pd(r, r), y), s));
}

static inline __m256 expf_libm_main(__m256 x) {
    const __m256 lo = _mm256_castps128_ps256(expf_libm4(_mm256_cvtps_pd(_mm256_castps256_ps128(x))));
    return _mm256_insertf128_ps(lo, expf_libm4(_mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))), 1);
}
#endif

/* expf of 8 floats, each as glibc's expf gives it. */
static inline __m256 expf_libm8(__m256 x) {
    __m256 y = expf_libm_main(x);
    const __m256 lo = _mm256_set1_ps(-0x1.9d1d9ep6f), hi = _mm256_set1_ps(0x1.62e42ep6f);
    const __m256 main = _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), _mm256_cmp_ps(x, hi, _CMP_LE_OQ));
    if (_mm256_movemask_ps(main) == 0xFF) return y;
    /* glibc's branches for |x| >= 88: below log(2^-150) 0, below log(2^-149) the least subnormal,
     * above log(2^128) infinity, a NaN itself */
    y = _mm256_blendv_ps(y, _mm256_set1_ps(0x1p-149f), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(-0x1.9fe368p6f), _CMP_LT_OQ));
    y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    return _mm256_blendv_ps(y, _mm256_add_ps(x, x), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

#endif
