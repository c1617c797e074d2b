/* The pair kernels of the K-quants Q4_K and Q6_K (qrows_pair.h): ggml's AVX2 vec_dot (the one-row
 * kernel, qrows_k.c) with two activation rows a 512-bit vector. Per super-block each of the 8
 * int32 lanes gets the integer it gets there (vpmaddubsw, then the scales through vpdpwssd where
 * the one-row kernel takes vpmaddwd and an add: the same exact sums), scaled and added in the
 * same float operations, so each row has the one-row kernel's bits. The activation rows' numbers
 * (their bytes by chunks of 32, sums by 16 and 32, scales as floats) are laid out once a call. */

#include <string.h>

#include "cpu_half.h"
#include "qformats.h"
#include "qrows.h"
#include "qrows_pair.h"

#if defined(KV_PAIR_KERNELS)
#include <immintrin.h>

/* A super-block of two activation rows: each 32-byte chunk j of row A, then of row B; A's sums by
 * 16, then B's; their sums by 32 (as q8_sums32 adds them); d (A's 8 times, then B's); -d (4 each). */
typedef struct {
    int8_t qs[8][2 * 32];
    int16_t bsums[2][16];
    int16_t sums32[2][8];
    float d[16];
    float negd[8];
} pair_kblk;

int64_t kvq_pair_k_bytes(int64_t n, int64_t k) { return n / 2 * (k / QK_K) * (int64_t)sizeof(pair_kblk); }

void kvq_pair_k_prepare(const job_t *J, int64_t p, uint8_t *pairs) {
    const int64_t nb = J->k / QK_K, g = p / PAIR_GROUP, np = pair_group_size(J->n / 2, g);
    pair_kblk *out = (pair_kblk *)pairs + g * nb * PAIR_GROUP + p % PAIR_GROUP;
    const block_q8_K *rows[2] = {(const block_q8_K *)(J->act + 2 * p * J->act_row),
                                 (const block_q8_K *)(J->act + (2 * p + 1) * J->act_row)};
    for (int64_t ib = 0; ib < nb; ib++, out += np)
        for (int r = 0; r < 2; r++) {
            const block_q8_K *y = rows[r] + ib;
            for (int j = 0; j < 8; j++) memcpy(out->qs[j] + 32 * r, y->qs + 32 * j, 32);
            memcpy(out->bsums[r], y->bsums, sizeof(y->bsums));
            for (int j = 0; j < 8; j++) out->sums32[r][j] = (int16_t)(y->bsums[2 * j] + y->bsums[2 * j + 1]);
            for (int l = 0; l < 8; l++) out->d[8 * r + l] = y->d;
            for (int l = 0; l < 4; l++) out->negd[4 * r + l] = -y->d;
        }
}

/* The 4-lane float sum of the one-row kernel's mins: (0 + 2, 1 + 3), then those two. */
static inline float hsum4(__m128 m) {
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

/* A Q4_K weight row against the P pairs of a group: out[2 * P]. */
static inline __attribute__((always_inline)) void pass_q4_K(const uint8_t *w, const uint8_t *ahead, int64_t nb,
                                                            const pair_kblk *a, float *out, const int P) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    __m512 acc[PAIR_GROUP];
    __m256 acc_m[PAIR_GROUP];
    for (int p = 0; p < P; p++) acc[p] = _mm512_setzero_ps(), acc_m[p] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++, a += P) {
        const block_q4_K *x = (const block_q4_K *)w + i;
        for (int64_t b = 0; ahead && b < (int64_t)sizeof(block_q4_K); b += 64) /* spread over the pass */
            __builtin_prefetch(ahead + i * (int64_t)sizeof(block_q4_K) + b);
        const __m512 dw = _mm512_set1_ps(half_to_float(x->d));
        const __m256 dminw = _mm256_set1_ps(half_to_float(x->dmin));
        uint32_t utmp[4];
        unpack_k_scales(x->scales, utmp);
        const uint8_t *sm = (const uint8_t *)utmp; /* 8 scales, then 8 mins */
        const __m256i mins = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(sm + 8))));
        __m512i q[8], sc[8];
        for (int j = 0; j < 4; j++) {
            const __m512i bits = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qs + 32 * j)));
            q[2 * j] = _mm512_and_si512(bits, m4);
            q[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(bits, 4), m4);
            sc[2 * j] = _mm512_set1_epi16(sm[2 * j]);
            sc[2 * j + 1] = _mm512_set1_epi16(sm[2 * j + 1]);
        }
        for (int p = 0; p < P; p++) {
            __m512i sumi = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++)
                sumi = _mm512_dpwssd_epi32(sumi, sc[j], _mm512_maddubs_epi16(q[j], _mm512_loadu_si512(a[p].qs[j])));
            const __m256i prod = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)a[p].sums32));
            acc_m[p] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(a[p].negd), dminw), _mm256_cvtepi32_ps(prod),
                                       acc_m[p]);
            acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(a[p].d), dw), _mm512_cvtepi32_ps(sumi), acc[p]);
        }
    }
    for (int p = 0; p < P; p++) {
        out[2 * p] = hsum(_mm512_castps512_ps256(acc[p])) + hsum4(_mm256_castps256_ps128(acc_m[p]));
        out[2 * p + 1] = hsum(_mm512_extractf32x8_ps(acc[p], 1)) + hsum4(_mm256_extractf128_ps(acc_m[p], 1));
    }
}

/* vpermw indices that spread Q6_K scales 2m and 2m + 1 (of 16 int16) over 8 lanes each, twice. */
static inline __m512i scale_spread(int m) {
    static const int16_t k[8][32] __attribute__((aligned(64))) = {
#define S(a) a, a, a, a, a, a, a, a, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1, a + 1
        {S(0), S(0)}, {S(2), S(2)}, {S(4), S(4)}, {S(6), S(6)}, {S(8), S(8)}, {S(10), S(10)}, {S(12), S(12)}, {S(14), S(14)},
#undef S
    };
    return _mm512_load_si512(k[m]);
}

/* A Q6_K weight row against the P pairs of a group: out[2 * P]. */
static inline __attribute__((always_inline)) void pass_q6_K(const uint8_t *w, const uint8_t *ahead, int64_t nb,
                                                            const pair_kblk *a, float *out, const int P) {
    __m512 acc[PAIR_GROUP];
    for (int p = 0; p < P; p++) acc[p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++, a += P) {
        const block_q6_K *x = (const block_q6_K *)w + i;
        for (int64_t b = 0; ahead && b < (int64_t)sizeof(block_q6_K); b += 64) /* spread over the pass */
            __builtin_prefetch(ahead + i * (int64_t)sizeof(block_q6_K) + b);
        const __m512 dw = _mm512_set1_ps(half_to_float(x->d));
        const __m512i scales_16 =
            _mm512_broadcast_i64x4(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales)));
        __m256i q256[8];
        q6_K_values(x, q256);
        __m512i q[8], sc[8];
        for (int m = 0; m < 8; m++) q[m] = _mm512_broadcast_i64x4(q256[m]);
        for (int m = 0; m < 8; m++) sc[m] = _mm512_permutexvar_epi16(scale_spread(m), scales_16);
        for (int p = 0; p < P; p++) {
            const __m512i q8sclsub = _mm512_slli_epi32(_mm512_madd_epi16(_mm512_loadu_si512(a[p].bsums), scales_16), 5);
            __m512i sumi = _mm512_setzero_si512();
            for (int m = 0; m < 8; m++)
                sumi = _mm512_dpwssd_epi32(sumi, sc[m], _mm512_maddubs_epi16(q[m], _mm512_loadu_si512(a[p].qs[m])));
            sumi = _mm512_sub_epi32(sumi, q8sclsub);
            acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(a[p].d), dw), _mm512_cvtepi32_ps(sumi), acc[p]);
        }
    }
    for (int p = 0; p < P; p++) {
        out[2 * p] = hsum(_mm512_castps512_ps256(acc[p]));
        out[2 * p + 1] = hsum(_mm512_extractf32x8_ps(acc[p], 1));
    }
}

typedef void (*kpass_fn)(const uint8_t *, const uint8_t *, int64_t, const pair_kblk *, float *);
#define KPASS(F, P)                                                                                          \
    static void F##_##P(const uint8_t *w, const uint8_t *ahead, int64_t nb, const pair_kblk *a, float *out) { \
        F(w, ahead, nb, a, out, P);                                                                          \
    }
KPASS(pass_q4_K, 1)
KPASS(pass_q4_K, 2)
KPASS(pass_q4_K, 3)
KPASS(pass_q4_K, 4)
KPASS(pass_q6_K, 1)
KPASS(pass_q6_K, 2)
KPASS(pass_q6_K, 3)
KPASS(pass_q6_K, 4)
static const kpass_fn KPASSES[2][PAIR_GROUP] = {{pass_q4_K_1, pass_q4_K_2, pass_q4_K_3, pass_q4_K_4},
                                                {pass_q6_K_1, pass_q6_K_2, pass_q6_K_3, pass_q6_K_4}};

void kvq_pair_k_rows(const job_t *J, const uint8_t *pairs, int64_t o0, int64_t o1) {
    const int64_t nb = J->k / QK_K, npairs = J->n / 2;
    const kpass_fn *passes = KPASSES[J->f->type == T_Q6_K];
    for (int64_t g = 0; g * PAIR_GROUP < npairs; g++) {
        const int P = (int)pair_group_size(npairs, g);
        const pair_kblk *a = (const pair_kblk *)pairs + g * nb * PAIR_GROUP;
        for (int64_t o = o0; o < o1; o++) {
            const int fetch = g == 0 && o + PAIR_PREFETCH_ROWS < o1; /* weights come from memory once a call */
            float out[2 * PAIR_GROUP];
            passes[P - 1](job_row(J, o), fetch ? job_row(J, o + PAIR_PREFETCH_ROWS) : NULL, nb, a, out);
            for (int r = 0; r < 2 * P; r++) J->y[(g * 2 * PAIR_GROUP + r) * J->ldy + o] = out[r];
        }
    }
}
#endif
