/* The panel kernel: many activation rows (prompts) against a weight, AVX2. Its weights are
 * unpacked, PANEL rows at a time, into bytes laid out so that one 32-byte vector holds 4
 * consecutive elements of each of the PANEL rows (one int32 lane per weight row): a broadcast of
 * 4 activation bytes multiplies all of them at once, and the products add up in int16 lanes (8
 * steps of at most 2 * 15 * 127 for 4-bit weights: 30480; 4 steps of at most 2 * 31 * 127 for
 * Q5_0's 5 bits: 31496), then in int32 over the block. The integer sums are those of the row
 * kernels (llama.cpp's): per block for Q4_0, Q5_0 (their offset through the activation's block
 * sum) and Q4_1, per super-block with the 6-bit scales for Q4_K; each is scaled as the row
 * kernels scale it, only the float additions come in another order. A row's result does not
 * depend on the other rows of the call. Fewer rows keep the row kernels: unpacking per call
 * costs more than one row saves. */

#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_pool.h"
#include "qmatmul_job.h"
#include "qrows.h"

int kvq_panels(int type) {
#ifdef KV_AVX2
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q4_K;
#else
    (void)type;
    return 0;
#endif
}

#ifdef KV_AVX2
#define PANEL 8
#define PANEL_TILE 4 /* activation rows per pass over a panel */

/* A panel's weights: pq [nu][8 steps][PANEL][4] unsigned values; per 32-element block pd (d)
 * and pm (Q4_1's m); Q4_K per super-block pd (d) and pm (dmin), per block psc (its scale as
 * int16 pairs, lane l for row l) and per super-block pmin [4] (mins 2i, 2i + 1 as int16 pairs). */
typedef struct {
    uint8_t *pq;
    float *pd, *pm;
    __m256i *psc, *pmin;
} panel_t;

/* The activation rows' scales as floats: dx [n][nb] (Q8_0 / Q8_1 d per block, Q8_K d per
 * super-block), sx [n][nb] (Q8_1's s), qsum [n][nb] (Q8_0: each block's sum of qs), bs [n][nb][4]
 * (Q8_K: its sums by 32 as int16 pairs). */
typedef struct {
    float *dx, *sx;
    int32_t *qsum, *bs;
} acts_t;

/* Block u of a weight row: 32 unsigned values in element order. */
static inline __m256i panel_values(int type, const uint8_t *row, int64_t u) {
    switch (type) {
    case T_Q4_0: return nibbles32(((const block_q4_0 *)row)[u].qs);
    case T_Q4_1: return nibbles32(((const block_q4_1 *)row)[u].qs);
    case T_Q5_0: {
        const block_q5_0 *b = (const block_q5_0 *)row + u;
        return _mm256_or_si256(nibbles32(b->qs), _mm256_and_si256(bits32(b->qh), _mm256_set1_epi8(0x10)));
    }
    default: {
        const block_q4_K *b = (const block_q4_K *)row + u / 8;
        const int j = (int)(u % 8);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b->qs + (j / 2) * 32));
        return _mm256_and_si256((j % 2) ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0xF));
    }
    }
}

/* Weight rows [o, o + PANEL) unpacked into P; rows past n_out are zeros. Per block, the 8 rows'
 * 32 values (8 dwords of 4 each) are transposed so that dword l of step s is row l's elements
 * 4s .. 4s + 3. */
static void unpack_panel(const job_t *J, int64_t o, const panel_t *P) {
    const int type = J->f->type;
    const int64_t nu = J->k / QK8;
    const uint8_t *rows[PANEL];
    for (int l = 0; l < PANEL; l++) rows[l] = o + l < J->n_out ? job_row(J, o + l) : NULL;
    for (int64_t u = 0; u < nu; u++) {
        __m256i v[PANEL];
        for (int l = 0; l < PANEL; l++) v[l] = rows[l] ? panel_values(type, rows[l], u) : _mm256_setzero_si256();
        __m256i t[PANEL], w[PANEL];
        for (int l = 0; l < PANEL; l += 2) {
            t[l] = _mm256_unpacklo_epi32(v[l], v[l + 1]);
            t[l + 1] = _mm256_unpackhi_epi32(v[l], v[l + 1]);
        }
        for (int h = 0; h < PANEL; h += 4) {
            w[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);
            w[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);
            w[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
            w[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
        }
        uint8_t *pb = P->pq + u * QK8 * PANEL;
        for (int st = 0; st < 4; st++) {
            _mm256_store_si256((__m256i *)(pb + st * 32), _mm256_permute2x128_si256(w[st], w[st + 4], 0x20));
            _mm256_store_si256((__m256i *)(pb + (st + 4) * 32), _mm256_permute2x128_si256(w[st], w[st + 4], 0x31));
        }
    }
    /* the scales */
    if (type == T_Q4_K) {
        for (int64_t sb = 0; sb < nu / 8; sb++) {
            int16_t sc[8][PANEL][2], mn[4][PANEL][2];
            for (int l = 0; l < PANEL; l++) {
                uint32_t utmp[4] = {0, 0, 0, 0};
                float d = 0.0f, dmin = 0.0f;
                if (rows[l]) {
                    const block_q4_K *b = (const block_q4_K *)rows[l] + sb;
                    unpack_k_scales(b->scales, utmp);
                    d = half_to_float(b->d), dmin = half_to_float(b->dmin);
                }
                const uint8_t *s8 = (const uint8_t *)utmp, *m8 = s8 + 8;
                for (int j = 0; j < 8; j++) sc[j][l][0] = sc[j][l][1] = s8[j];
                for (int i = 0; i < 4; i++) mn[i][l][0] = m8[2 * i], mn[i][l][1] = m8[2 * i + 1];
                P->pd[sb * PANEL + l] = d, P->pm[sb * PANEL + l] = dmin;
            }
            for (int j = 0; j < 8; j++) P->psc[sb * 8 + j] = _mm256_loadu_si256((const __m256i *)sc[j]);
            for (int i = 0; i < 4; i++) P->pmin[sb * 4 + i] = _mm256_loadu_si256((const __m256i *)mn[i]);
        }
        return;
    }
    for (int64_t u = 0; u < nu; u++)
        for (int l = 0; l < PANEL; l++) {
            float d = 0.0f, m = 0.0f;
            if (rows[l] && type == T_Q4_1) {
                const block_q4_1 *b = (const block_q4_1 *)rows[l] + u;
                d = half_to_float(b->d), m = half_to_float(b->m);
            } else if (rows[l]) {
                d = half_to_float(type == T_Q4_0 ? ((const block_q4_0 *)rows[l])[u].d : ((const block_q5_0 *)rows[l])[u].d);
            }
            P->pd[u * PANEL + l] = d, P->pm[u * PANEL + l] = m;
        }
}

/* The qs of block u of activation row i. */
static inline const int8_t *act_block(const job_t *J, int64_t i, int64_t u) {
    const uint8_t *row = J->act + i * J->act_row;
    switch (J->f->vdt) {
    case VDT_Q8_K: return ((const block_q8_K *)row)[u / 8].qs + (u % 8) * QK8;
    case VDT_Q8_1: return ((const block_q8_1 *)row)[u].qs;
    default: return ((const block_q8_0 *)row)[u].qs;
    }
}

/* y[i + r][o .. o + nw) for activation rows r < R (R, flush constants where it is inlined): per
 * block the int16 sums go to int32 every `flush` steps (times Q4_K's scale), then as the row
 * kernels scale them. */
static inline __attribute__((always_inline)) void panel_tile(const job_t *J, const panel_t *P, const acts_t *A,
                                                             int64_t i, const int R, const int flush, int64_t o,
                                                             int nw) {
    const int type = J->f->type;
    const int64_t nu = J->k / QK8, nb = type == T_Q4_K ? nu / 8 : nu;
    __m256 acc[PANEL_TILE];
    __m256i isb[PANEL_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), isb[r] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t u = 0; u < nu; u++) {
        __m256i a16[PANEL_TILE], a32[PANEL_TILE];
        const uint8_t *pb = P->pq + u * QK8 * PANEL;
        const __m256i scale = type == T_Q4_K ? P->psc[u] : ones;
        const int8_t *qx[PANEL_TILE];
        for (int r = 0; r < R; r++) qx[r] = act_block(J, i + r, u);
        for (int s0 = 0; s0 < QK8 / 4; s0 += flush) {
            for (int r = 0; r < R; r++) a16[r] = _mm256_setzero_si256();
            for (int s = s0; s < s0 + flush; s++) {
                const __m256i w = _mm256_load_si256((const __m256i *)(pb + s * 32));
                for (int r = 0; r < R; r++) {
                    int32_t v;
                    memcpy(&v, qx[r] + 4 * s, 4);
                    a16[r] = _mm256_add_epi16(a16[r], _mm256_maddubs_epi16(w, _mm256_set1_epi32(v)));
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256i part = _mm256_madd_epi16(a16[r], scale);
                a32[r] = s0 ? _mm256_add_epi32(a32[r], part) : part;
            }
        }
        if (type == T_Q4_K) {
            for (int r = 0; r < R; r++) isb[r] = _mm256_add_epi32(isb[r], a32[r]);
            if (u % 8 != 7) continue;
            const int64_t sb = u / 8;
            const __m256 d = _mm256_loadu_ps(P->pd + sb * PANEL), dmin = _mm256_loadu_ps(P->pm + sb * PANEL);
            for (int r = 0; r < R; r++) {
                const float dx = A->dx[(i + r) * nb + sb];
                const int32_t *bs = A->bs + ((i + r) * nb + sb) * 4;
                __m256i msum = _mm256_setzero_si256();
                for (int p = 0; p < 4; p++)
                    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(P->pmin[sb * 4 + p], _mm256_set1_epi32(bs[p])));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isb[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, _mm256_set1_ps(-dx)), acc[r]);
                isb[r] = _mm256_setzero_si256();
            }
            continue;
        }
        const __m256 d = _mm256_loadu_ps(P->pd + u * PANEL);
        for (int r = 0; r < R; r++) {
            const float dx = A->dx[(i + r) * nb + u];
            if (type == T_Q4_0 || type == T_Q5_0) /* the values' offset, 8 or 16, in the integer sum */
                a32[r] = _mm256_sub_epi32(a32[r], _mm256_set1_epi32((type == T_Q4_0 ? 8 : 16) * A->qsum[(i + r) * nb + u]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a32[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
            if (type == T_Q4_1)
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(P->pm + u * PANEL), _mm256_set1_ps(A->sx[(i + r) * nb + u]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *y = J->y + (i + r) * J->ldy + o;
        if (nw == PANEL) {
            _mm256_storeu_ps(y, acc[r]);
        } else {
            float out[PANEL];
            _mm256_storeu_ps(out, acc[r]);
            memcpy(y, out, sizeof(float) * (size_t)nw);
        }
    }
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
    panel_t P = {aligned_alloc(32, (size_t)(nu * QK8 * PANEL)), malloc(sizeof(float) * (size_t)(2 * nu * PANEL)),
                 NULL, aligned_alloc(32, sizeof(__m256i) * (size_t)(nu + nu / 2 + 1)), NULL};
    if (!P.pq || !P.pd || !P.psc) {
        free(P.pq), free(P.pd), free(P.psc);
        T->failed = 1; /* only ever set: a benign race */
        return;
    }
    P.pm = P.pd + nu * PANEL, P.pmin = P.psc + nu;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t o = p * PANEL;
        const int nw = J->n_out - o < PANEL ? (int)(J->n_out - o) : PANEL;
        for (int l = PANEL; l < 2 * PANEL && o + l < J->n_out; l++) { /* ask memory for the next panel */
            const uint8_t *ahead = job_row(J, o + l);
            for (int64_t b = 0; b < J->row_bytes; b += 64) __builtin_prefetch(ahead + b);
        }
        unpack_panel(J, o, &P);
        int64_t i = 0;
        if (J->f->type == T_Q5_0) { /* 5 bits: int16 holds 4 steps */
            for (; i + PANEL_TILE <= J->n; i += PANEL_TILE) panel_tile(J, &P, T->A, i, PANEL_TILE, 4, o, nw);
            for (; i < J->n; i++) panel_tile(J, &P, T->A, i, 1, 4, o, nw);
        } else {
            for (; i + PANEL_TILE <= J->n; i += PANEL_TILE) panel_tile(J, &P, T->A, i, PANEL_TILE, 8, o, nw);
            for (; i < J->n; i++) panel_tile(J, &P, T->A, i, 1, 8, o, nw);
        }
    }
    free(P.pq), free(P.pd), free(P.psc);
}

int kvq_matmul_panels(const job_t *J) {
    const int vdt = J->f->vdt;
    const int64_t nb = vdt == VDT_Q8_K ? J->k / QK_K : J->k / QK8, cells = J->n * nb;
    acts_t A = {malloc(sizeof(float) * (size_t)(2 * cells)), NULL, malloc(sizeof(int32_t) * (size_t)(5 * cells)), NULL};
    if (!A.dx || !A.qsum) {
        free(A.dx), free(A.qsum);
        return -1;
    }
    A.sx = A.dx + cells, A.bs = A.qsum + cells;
    for (int64_t i = 0; i < J->n; i++) {
        const uint8_t *row = J->act + i * J->act_row;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t c = i * nb + b;
            if (vdt == VDT_Q8_K) {
                const block_q8_K *y = (const block_q8_K *)row + b;
                A.dx[c] = y->d;
                for (int p = 0; p < 4; p++) { /* sums by 32 of sub-blocks 2p and 2p + 1, as int16 pairs */
                    const int lo = y->bsums[4 * p] + y->bsums[4 * p + 1], hi = y->bsums[4 * p + 2] + y->bsums[4 * p + 3];
                    A.bs[c * 4 + p] = (int32_t)(((uint32_t)(uint16_t)hi << 16) | (uint16_t)lo);
                }
            } else {
                const int8_t *qs;
                if (vdt == VDT_Q8_1) {
                    const block_q8_1 *y = (const block_q8_1 *)row + b;
                    A.dx[c] = half_to_float(y->d), A.sx[c] = half_to_float(y->s), qs = y->qs;
                } else {
                    const block_q8_0 *y = (const block_q8_0 *)row + b;
                    A.dx[c] = half_to_float(y->d), qs = y->qs;
                }
                int s = 0;
                for (int j = 0; j < QK8; j++) s += qs[j];
                A.qsum[c] = s;
            }
        }
    }
    panels_t T = {.J = J, .A = &A};
    kv_parallel(matmul_panels, &T, (J->n_out + PANEL - 1) / PANEL, 1);
    free(A.dx), free(A.qsum);
    return T.failed ? -1 : 0;
}
#else
int kvq_matmul_panels(const job_t *J) {
    (void)J;
    return -1;
}
#endif
