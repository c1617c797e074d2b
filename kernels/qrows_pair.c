/* The pair kernels: Q4_0, Q5_0 and Q8_0 weights against 2 to 32 activation rows on AVX-512 VNNI,
 * two rows a 512-bit vector. ggml's AVX2 vec_dot (the one-row kernel, qrows_0.c) sums each block
 * as 8 int32 lanes of 4 products, scales them by d_w * d_y and adds them into 8 float lanes,
 * summed across at the end; here the two halves of a vector are those 8 lanes of two rows, and
 * every lane gets the same integer and the same float operations, so each row has the one-row
 * kernel's bits. What changes is how the integer comes: the weight's unsigned values (Q4_0's
 * nibbles, Q5_0's 5 bits, Q8_0's bytes + 128) times the activation's bytes in one vpdpbusd,
 * which starts from the offset's share (-offset times the activation's sums by 4), made once a
 * call with the rows' scales as floats (kvq_pair_prepare). That is 5 instructions a block for
 * two rows where the one-row kernel takes 10 for one, and 4 weight rows a pass reuse each
 * activation vector from registers. */

#include "qrows_pair.h"

#include <string.h>

#include "cpu_half.h"
#include "qformats.h"

/* A block of two activation rows: their bytes, the offset's share by 4 and their scales, each
 * row in one half. */
typedef struct {
    int8_t qs[2 * QK8];
    int32_t corr[16];
    float d[16];
} pair_blk;

#if defined(KV_PAIR_KERNELS)
#include <immintrin.h>

int kvq_pair_format(int type) {
    return type == T_Q4_0 || type == T_Q5_0 || type == T_Q8_0 || type == T_Q4_K || type == T_Q6_K;
}

static int offset_of(int type) { return type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 128; }

int64_t kvq_pair_bytes(int type, int64_t n, int64_t k) {
    if (kvq_format(type)->vdt == VDT_Q8_K) return kvq_pair_k_bytes(n, k);
    return n / 2 * (k / QK8) * (int64_t)sizeof(pair_blk);
}

/* The first block of group g's pairs. */
static inline pair_blk *group_base(uint8_t *pairs, int64_t nb, int64_t g) {
    return (pair_blk *)pairs + g * nb * PAIR_GROUP;
}

void kvq_pair_prepare(const job_t *J, int64_t p, uint8_t *pairs) {
    if (J->f->vdt == VDT_Q8_K) {
        kvq_pair_k_prepare(J, p, pairs);
        return;
    }
    const int64_t nb = J->k / QK8, g = p / PAIR_GROUP, np = pair_group_size(J->n / 2, g);
    pair_blk *out = group_base(pairs, nb, g) + p % PAIR_GROUP;
    const block_q8_0 *a = (const block_q8_0 *)(J->act + 2 * p * J->act_row);
    const block_q8_0 *b = (const block_q8_0 *)(J->act + (2 * p + 1) * J->act_row);
    const __m512i neg_off = _mm512_set1_epi32(-offset_of(J->f->type));
    for (int64_t ib = 0; ib < nb; ib++, out += np) {
        const __m512i y = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a[ib].qs)),
                                             _mm256_loadu_si256((const __m256i *)b[ib].qs), 1);
        _mm512_storeu_si512(out->qs, y);
        const __m512i sum4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), y);
        _mm512_storeu_si512(out->corr, _mm512_mullo_epi32(sum4, neg_off));
        const __m256 da = _mm256_set1_ps(half_to_float(a[ib].d)), db = _mm256_set1_ps(half_to_float(b[ib].d));
        _mm512_storeu_ps(out->d, _mm512_insertf32x8(_mm512_castps256_ps512(da), db, 1));
    }
}

/* A weight block's unsigned values, the same 32 in both halves. */
static inline __attribute__((always_inline)) __m512i weight_values(int type, const uint8_t *row, int64_t ib) {
    if (type == T_Q8_0) {
        const block_q8_0 *x = (const block_q8_0 *)row + ib;
        return _mm512_xor_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x->qs)),
                                _mm512_set1_epi8((char)0x80));
    }
    const uint8_t *qs = type == T_Q4_0 ? ((const block_q4_0 *)row)[ib].qs : ((const block_q5_0 *)row)[ib].qs;
    const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)qs));
    __m512i q = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(0xF));
    if (type == T_Q5_0) { /* the fifth bit of element j: bit j of qh */
        uint32_t qh;
        memcpy(&qh, ((const block_q5_0 *)row)[ib].qh, 4);
        const __mmask64 m = (__mmask64)qh | (__mmask64)qh << 32;
        q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(m, _mm512_set1_epi8(0x10)));
    }
    return q;
}

static inline __attribute__((always_inline)) float weight_scale(int type, const uint8_t *row, int64_t ib) {
    return half_to_float(type == T_Q4_0   ? ((const block_q4_0 *)row)[ib].d
                         : type == T_Q5_0 ? ((const block_q5_0 *)row)[ib].d
                                          : ((const block_q8_0 *)row)[ib].d);
}

/* W weight rows against the P pairs of a group; out[w][2 * P]. */
static inline __attribute__((always_inline)) void pair_pass(int type, const uint8_t *const *w,
                                                            const uint8_t *const *ahead, int64_t nb,
                                                            const pair_blk *a, float *out, const int W,
                                                            const int P) {
    const int64_t bs = type == T_Q4_0 ? sizeof(block_q4_0) : type == T_Q5_0 ? sizeof(block_q5_0) : sizeof(block_q8_0);
    __m512 acc[4][PAIR_GROUP];
    for (int i = 0; i < W; i++)
        for (int p = 0; p < P; p++) acc[i][p] = _mm512_setzero_ps();
    for (int64_t ib = 0; ib < nb; ib++, a += P) {
        __m512i q[4];
        __m512 dw[4];
        for (int i = 0; ahead && i < W; i++) __builtin_prefetch(ahead[i] + ib * bs); /* spread over the pass */
        for (int i = 0; i < W; i++) {
            q[i] = weight_values(type, w[i], ib);
            dw[i] = _mm512_set1_ps(weight_scale(type, w[i], ib));
        }
        for (int p = 0; p < P; p++) {
            const __m512i y = _mm512_loadu_si512(a[p].qs);
            const __m512 dy = _mm512_loadu_ps(a[p].d);
            for (int i = 0; i < W; i++) {
                const __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(a[p].corr), q[i], y);
                acc[i][p] = _mm512_fmadd_ps(_mm512_mul_ps(dw[i], dy), _mm512_cvtepi32_ps(s), acc[i][p]);
            }
        }
    }
    for (int i = 0; i < W; i++)
        for (int p = 0; p < P; p++) {
            out[i * 2 * P + 2 * p] = hsum(_mm512_castps512_ps256(acc[i][p]));
            out[i * 2 * P + 2 * p + 1] = hsum(_mm512_extractf32x8_ps(acc[i][p], 1));
        }
}

/* pass_TYPE_W_P: pair_pass with every count and the type known to the compiler. */
#define PASS(T, W, P)                                                                                         \
    static void pass_##T##_##W##_##P(const uint8_t *const *w, const uint8_t *const *ahead, int64_t nb,        \
                                     const pair_blk *a, float *out) {                                        \
        pair_pass(T, w, ahead, nb, a, out, W, P);                                                            \
    }
#define PASSES(T) PASS(T, 1, 1) PASS(T, 1, 2) PASS(T, 1, 3) PASS(T, 1, 4) PASS(T, 4, 1) PASS(T, 4, 2) PASS(T, 4, 3) PASS(T, 4, 4)
PASSES(T_Q4_0)
PASSES(T_Q5_0)
PASSES(T_Q8_0)
typedef void (*pass_fn)(const uint8_t *const *, const uint8_t *const *, int64_t, const pair_blk *, float *);
#define TABLE(T)                                                                                              \
    {{pass_##T##_1_1, pass_##T##_1_2, pass_##T##_1_3, pass_##T##_1_4},                                        \
     {pass_##T##_4_1, pass_##T##_4_2, pass_##T##_4_3, pass_##T##_4_4}}
static const pass_fn TABLES[3][2][PAIR_GROUP] = {TABLE(T_Q4_0), TABLE(T_Q5_0), TABLE(T_Q8_0)};

void kvq_pair_rows(const job_t *J, const uint8_t *pairs, int64_t o0, int64_t o1) {
    const int64_t nb = J->k / QK8, npairs = J->n / 2;
    const int type = J->f->type;
    if (J->f->vdt == VDT_Q8_K) {
        kvq_pair_k_rows(J, pairs, o0, o1);
        return;
    }
    const pass_fn(*passes)[PAIR_GROUP] = TABLES[type == T_Q4_0 ? 0 : type == T_Q5_0 ? 1 : 2];
    for (int64_t g = 0; g * PAIR_GROUP < npairs; g++) {
        const int P = (int)pair_group_size(npairs, g);
        const pair_blk *a = group_base((uint8_t *)pairs, nb, g);
        for (int64_t o = o0; o < o1;) {
            const int W = o + 4 <= o1 ? 4 : 1;
            const uint8_t *w[4], *ahead[4]; /* weights come from memory once a call: the first group asks */
            const int fetch = g == 0 && o + W - 1 + PAIR_PREFETCH_ROWS < o1;
            for (int i = 0; i < W; i++) {
                w[i] = job_row(J, o + i);
                ahead[i] = fetch ? job_row(J, o + i + PAIR_PREFETCH_ROWS) : NULL;
            }
            float out[4 * 2 * PAIR_GROUP];
            passes[W == 4][P - 1](w, fetch ? ahead : NULL, nb, a, out);
            for (int i = 0; i < W; i++)
                for (int r = 0; r < 2 * P; r++) J->y[(g * 2 * PAIR_GROUP + r) * J->ldy + o + i] = out[i * 2 * P + r];
            o += W;
        }
    }
}
#else
int kvq_pair_format(int type) {
    (void)type;
    return 0;
}

int64_t kvq_pair_bytes(int type, int64_t n, int64_t k) {
    (void)type, (void)n, (void)k;
    return 0;
}

void kvq_pair_prepare(const job_t *J, int64_t p, uint8_t *pairs) { (void)J, (void)p, (void)pairs; }

void kvq_pair_rows(const job_t *J, const uint8_t *pairs, int64_t o0, int64_t o1) {
    (void)J, (void)pairs, (void)o0, (void)o1;
}
#endif
