/* The panel kernel: many activation rows (prompts) against a weight. Its weights are unpacked,
 * PANEL_W rows at a time, into bytes laid out so that one vector holds 4 consecutive elements of
 * each row (one int32 lane per weight row): a broadcast of 4 activation bytes multiplies all the
 * rows at once (qpanel_vnni.c with AVX-512 VNNI, qpanel_avx2.c with AVX2). The integer sums are
 * those of the row kernels (llama.cpp's): per block for the 32-element formats (an offset such as
 * Q4_0's 8 through the activation block's sum, Q4_1's m through its s), per super-block with the
 * sub-block scales for the K-quants (Q4_K / Q5_K mins through the activation's sums by 32, Q6_K's
 * 32 through its sums by 16); each is scaled as the row kernels scale it, only the float
 * additions come in another order. A row's result does not depend on the other rows of the call.
 * Fewer rows keep the row kernels: unpacking per call costs more than one row saves. */

#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_pool.h"
#include "qpanel.h"
#include "qrows.h"

#ifdef KV_AVX2
/* The formats this kernel unpacks (the low-bit ones keep their row kernels, 8 rows a pass). */
static int panel_format(int type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q8_0 || type == T_Q4_K || type == T_Q5_K ||
           type == T_Q6_K;
}

int kvq_panels(int type) {
#if defined(PANEL_VNNI)
    return panel_format(type);
#else
    return type != T_Q8_0 && panel_format(type); /* Q8_0 x int8 overflows maddubs' int16 */
#endif
}

/* Block u (32 elements) of a weight row: its unsigned values in element order. */
static inline __m256i panel_values(int type, const uint8_t *row, int64_t u) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    switch (type) {
    case T_Q4_0: return nibbles32(((const block_q4_0 *)row)[u].qs);
    case T_Q4_1: return nibbles32(((const block_q4_1 *)row)[u].qs);
    case T_Q5_0: {
        const block_q5_0 *b = (const block_q5_0 *)row + u;
        return _mm256_or_si256(nibbles32(b->qs), _mm256_and_si256(bits32(b->qh), _mm256_set1_epi8(0x10)));
    }
    case T_Q8_0:
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)((const block_q8_0 *)row)[u].qs),
                                _mm256_set1_epi8((char)0x80));
    case T_Q6_K: {
        const block_q6_K *b = (const block_q6_K *)row + u / 8;
        const int h = (int)(u % 8) / 4, k4 = (int)(u % 4);
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32 * (k4 & 1)));
        const __m256i hi = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
        const __m256i l4 = _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (k4 >> 1))), m4);
        const __m256i h2 = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * k4)), _mm256_set1_epi8(3));
        return _mm256_or_si256(l4, _mm256_slli_epi16(h2, 4));
    }
    default: { /* Q4_K, Q5_K: sub-block j's nibbles (and fifth bits) */
        const int j = (int)(u % 8);
        const uint8_t *qs = type == T_Q4_K ? ((const block_q4_K *)row)[u / 8].qs : ((const block_q5_K *)row)[u / 8].qs;
        const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + (j / 2) * 32));
        __m256i q = _mm256_and_si256((j % 2) ? _mm256_srli_epi16(v, 4) : v, m4);
        if (type == T_Q5_K) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)((const block_q5_K *)row)[u / 8].qh);
            const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
            q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
        }
        return q;
    }
    }
}

/* Rows l of 8 consecutive weight rows' block values v[l] stored as 8 steps of 8 dwords: dword l of
 * step s holds row l's elements 4s .. 4s + 3; step s goes to out + s * stride. */
static inline void transpose8(const __m256i *v, uint8_t *out, int64_t stride) {
    __m256i t[8], w[8];
    for (int l = 0; l < 8; l += 2) {
        t[l] = _mm256_unpacklo_epi32(v[l], v[l + 1]);
        t[l + 1] = _mm256_unpackhi_epi32(v[l], v[l + 1]);
    }
    for (int h = 0; h < 8; h += 4) {
        w[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
        w[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
        w[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
        w[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    for (int st = 0; st < 4; st++) {
        _mm256_storeu_si256((__m256i *)(out + st * stride), _mm256_permute2x128_si256(w[st], w[st + 4], 0x20));
        _mm256_storeu_si256((__m256i *)(out + (st + 4) * stride), _mm256_permute2x128_si256(w[st], w[st + 4], 0x31));
    }
}

/* The scales of weight row `row` (NULL: zeros) into lane l of the panel. */
static void panel_scales(int type, const uint8_t *row, int l, int64_t nu, const panel_t *P) {
    if (type == T_Q4_K || type == T_Q5_K) {
        for (int64_t sb = 0; sb < nu / 8; sb++) {
            uint32_t utmp[4] = {0, 0, 0, 0};
            float d = 0.0f, dmin = 0.0f;
            if (row) {
                const uint8_t *sc = type == T_Q4_K ? ((const block_q4_K *)row)[sb].scales : ((const block_q5_K *)row)[sb].scales;
                const uint16_t hd = type == T_Q4_K ? ((const block_q4_K *)row)[sb].d : ((const block_q5_K *)row)[sb].d;
                const uint16_t hm = type == T_Q4_K ? ((const block_q4_K *)row)[sb].dmin : ((const block_q5_K *)row)[sb].dmin;
                unpack_k_scales(sc, utmp);
                d = half_to_float(hd), dmin = half_to_float(hm);
            }
            const uint8_t *s8 = (const uint8_t *)utmp, *m8 = s8 + 8;
            for (int j = 0; j < 8; j++) P->psc[(sb * 8 + j) * PANEL_W + l] = s8[j];
            for (int p = 0; p < 4; p++) P->ppair[(sb * 4 + p) * PANEL_W + l] = (int32_t)((uint32_t)m8[2 * p + 1] << 16 | m8[2 * p]);
            P->pd[sb * PANEL_W + l] = d, P->pm[sb * PANEL_W + l] = dmin;
        }
        return;
    }
    if (type == T_Q6_K) {
        for (int64_t u = 0; u < nu; u++) {
            const block_q6_K *b = row ? (const block_q6_K *)row + u / 8 : NULL;
            const int8_t sa = b ? b->scales[2 * (u % 8)] : 0, sb = b ? b->scales[2 * (u % 8) + 1] : 0;
            P->psc[(u * 2) * PANEL_W + l] = sa, P->psc[(u * 2 + 1) * PANEL_W + l] = sb;
            P->ppair[u * PANEL_W + l] = (int32_t)((uint32_t)(uint16_t)sb << 16 | (uint16_t)sa);
            if (u % 8 == 0) P->pd[(u / 8) * PANEL_W + l] = b ? half_to_float(b->d) : 0.0f;
        }
        return;
    }
    for (int64_t u = 0; u < nu; u++) {
        float d = 0.0f, m = 0.0f;
        if (row) {
            switch (type) {
            case T_Q4_0: d = half_to_float(((const block_q4_0 *)row)[u].d); break;
            case T_Q5_0: d = half_to_float(((const block_q5_0 *)row)[u].d); break;
            case T_Q8_0: d = half_to_float(((const block_q8_0 *)row)[u].d); break;
            default:
                d = half_to_float(((const block_q4_1 *)row)[u].d), m = half_to_float(((const block_q4_1 *)row)[u].m);
            }
        }
        P->pd[u * PANEL_W + l] = d, P->pm[u * PANEL_W + l] = m;
    }
}

/* Weight rows [o, o + PANEL_W) unpacked into P; rows past n_out are zeros. */
static void unpack_panel(const job_t *J, int64_t o, const panel_t *P) {
    const int type = J->f->type;
    const int64_t nu = J->k / QK8;
    const uint8_t *rows[PANEL_W];
    for (int l = 0; l < PANEL_W; l++) rows[l] = o + l < J->n_out ? job_row(J, o + l) : NULL;
    for (int64_t u = 0; u < nu; u++)
        for (int g = 0; g < PANEL_W; g += 8) { /* 8 rows' steps side by side: group g at byte 4g of a step */
            __m256i v[8];
            for (int l = 0; l < 8; l++)
                v[l] = rows[g + l] ? panel_values(type, rows[g + l], u) : _mm256_setzero_si256();
            transpose8(v, P->pq + u * QK8 * PANEL_W + 4 * g, 4 * PANEL_W);
        }
    for (int l = 0; l < PANEL_W; l++) panel_scales(type, rows[l], l, nu, P);
}

typedef struct {
    const job_t *J;
    const acts_t *A;
    int failed;
} panels_t;

/* Panels [p0, p1) against every activation row: a task of the pool. */
static void matmul_panels(void *ctx, int64_t p0, int64_t p1) {
    panels_t *T = ctx;
    const job_t *J = T->J;
    const int64_t nu = J->k / QK8;
    panel_t P = {aligned_alloc(64, (size_t)(nu * QK8 * PANEL_W)), malloc(sizeof(float) * (size_t)(2 * nu * PANEL_W)),
                 NULL, malloc(sizeof(int32_t) * (size_t)(3 * nu * PANEL_W)), NULL};
    if (!P.pq || !P.pd || !P.psc) {
        free(P.pq), free(P.pd), free(P.psc);
        T->failed = 1; /* only ever set: a benign race */
        return;
    }
    P.pm = P.pd + nu * PANEL_W, P.ppair = P.psc + 2 * nu * PANEL_W;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t o = p * PANEL_W;
        for (int l = PANEL_W; l < 2 * PANEL_W && o + l < J->n_out; l++) { /* ask memory for the next panel */
            const uint8_t *ahead = job_row(J, o + l);
            for (int64_t b = 0; b < J->row_bytes; b += 64) __builtin_prefetch(ahead + b);
        }
        unpack_panel(J, o, &P);
        kvq_panel_rows(J, &P, T->A, o, J->n_out - o < PANEL_W ? (int)(J->n_out - o) : PANEL_W);
    }
    free(P.pq), free(P.pd), free(P.psc);
}

/* The activation rows' numbers (acts_t) from their blocks. */
static void fill_acts(const job_t *J, const acts_t *A) {
    const int64_t nu = J->k / QK8, nsb = J->k / QK_K;
    for (int64_t i = 0; i < J->n; i++) {
        const uint8_t *row = J->act + i * J->act_row;
        if (J->f->vdt == VDT_Q8_K) {
            for (int64_t sb = 0; sb < nsb; sb++) {
                const block_q8_K *y = (const block_q8_K *)row + sb;
                A->dx[i * nsb + sb] = y->d;
                for (int p = 0; p < 4; p++) { /* sums by 32 of sub-blocks 2p and 2p + 1 */
                    const int lo = y->bsums[4 * p] + y->bsums[4 * p + 1], hi = y->bsums[4 * p + 2] + y->bsums[4 * p + 3];
                    A->bpair32[(i * nsb + sb) * 4 + p] = (int32_t)((uint32_t)(uint16_t)hi << 16 | (uint16_t)lo);
                }
                for (int j = 0; j < 8; j++) /* sums by 16 of sub-block j's halves */
                    A->bpair16[i * nu + sb * 8 + j] =
                        (int32_t)((uint32_t)(uint16_t)y->bsums[2 * j + 1] << 16 | (uint16_t)y->bsums[2 * j]);
            }
            continue;
        }
        for (int64_t u = 0; u < nu; u++) {
            const int8_t *qs;
            if (J->f->vdt == VDT_Q8_1) {
                const block_q8_1 *y = (const block_q8_1 *)row + u;
                A->dx[i * nu + u] = half_to_float(y->d), A->sx[i * nu + u] = half_to_float(y->s), qs = y->qs;
            } else {
                const block_q8_0 *y = (const block_q8_0 *)row + u;
                A->dx[i * nu + u] = half_to_float(y->d), qs = y->qs;
            }
            int s = 0;
            for (int j = 0; j < QK8; j++) s += qs[j];
            A->qsum[i * nu + u] = s;
        }
    }
}

int kvq_matmul_panels(const job_t *J) {
    const int64_t cells = J->n * (J->k / QK8);
    acts_t A = {malloc(sizeof(float) * (size_t)(2 * cells)), NULL, malloc(sizeof(int32_t) * (size_t)(3 * cells)), NULL, NULL};
    if (!A.dx || !A.qsum) {
        free(A.dx), free(A.qsum);
        return -1;
    }
    A.sx = A.dx + cells, A.bpair32 = A.qsum + cells, A.bpair16 = A.qsum + 2 * cells;
    fill_acts(J, &A);
    panels_t T = {.J = J, .A = &A};
    kv_parallel(matmul_panels, &T, (J->n_out + PANEL_W - 1) / PANEL_W, 1);
    free(A.dx), free(A.qsum);
    return T.failed ? -1 : 0;
}
#endif /* without AVX2: qpanel_c.c */
