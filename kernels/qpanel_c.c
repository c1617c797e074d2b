/* The panel kernel of the builds without AVX2 (portable C, NEON): many activation rows (prompts)
 * against a weight with no float copy of it. PANEL_C_W weight rows at a time are decoded once
 * into signed bytes in the activation's element order (q8 values: Q4_0's q - 8, Q5_0's q - 16,
 * Q8_0's q; Q4_1's, the K-quants' unsigned q; Q3_K's signed q, IQ4_NL's and IQ4_XS's looked-up
 * values) with their scales; every activation row then
 * takes its integer dots with them (qdot.h's dot32_i8, NEON or portable C) block by block. Each
 * output is the row kernels' (qrows_0.c, qrows_k.c, qrows_lowbit.c) without AVX2, bit for bit: the same integers,
 * scaled and added in the same order, so a row's result does not depend on the other rows. */

#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_pool.h"
#include "qdot.h"
#include "qmatmul_job.h"
#include "qrows.h"

#ifndef KV_AVX2

#define PANEL_C_W 8 /* weight rows decoded at a time: 8 rows of a 2048-wide matrix are 16 KB */

int kvq_panels(int type) { return kvq_format(type) != NULL; }

/* A tile's decoded weights: vals [PANEL_C_W][k] bytes; per block of 32 (u) or super-block (sb):
 * d [PANEL_C_W][nu] (the K-quants' by sb), m [PANEL_C_W][nu] (Q4_1's m, the K-quants' dmin by
 * sb), sc [PANEL_C_W][nu * 2] (Q4_K / Q5_K: scale and min of sub-block u; Q6_K: the two scales
 * of 16 of block u). */
typedef struct {
    int8_t *vals;
    float *d, *m;
    int32_t *sc;
} tile_t;

/* Weight row `row`'s values and scales into row l of the tile. */
static void decode_row(int type, const uint8_t *row, int64_t k, int l, const tile_t *T) {
    const int64_t nu = k / QK8;
    int8_t *v = T->vals + l * k;
    float *d = T->d + l * nu, *m = T->m + l * nu;
    int32_t *sc = T->sc + l * nu * 2;
    for (int64_t u = 0; u < nu; u++, v += QK8) {
        switch (type) {
        case T_Q4_0: {
            const block_q4_0 *b = (const block_q4_0 *)row + u;
            for (int j = 0; j < 16; j++) v[j] = (int8_t)((b->qs[j] & 0xF) - 8), v[j + 16] = (int8_t)((b->qs[j] >> 4) - 8);
            d[u] = half_to_float(b->d);
            break;
        }
        case T_Q4_1: {
            const block_q4_1 *b = (const block_q4_1 *)row + u;
            for (int j = 0; j < 16; j++) v[j] = (int8_t)(b->qs[j] & 0xF), v[j + 16] = (int8_t)(b->qs[j] >> 4);
            d[u] = half_to_float(b->d), m[u] = half_to_float(b->m);
            break;
        }
        case T_Q5_0: {
            const block_q5_0 *b = (const block_q5_0 *)row + u;
            uint32_t qh;
            memcpy(&qh, b->qh, 4);
            for (int j = 0; j < 16; j++) {
                v[j] = (int8_t)(((b->qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - 16);
                v[j + 16] = (int8_t)(((b->qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
            }
            d[u] = half_to_float(b->d);
            break;
        }
        case T_Q8_0: {
            const block_q8_0 *b = (const block_q8_0 *)row + u;
            memcpy(v, b->qs, QK8);
            d[u] = half_to_float(b->d);
            break;
        }
        case T_Q6_K: {
            const block_q6_K *b = (const block_q6_K *)row + u / 8;
            const int h = (int)(u % 8) / 4, k4 = (int)(u % 4);
            for (int l2 = 0; l2 < 32; l2++) {
                const uint8_t lo = b->ql[64 * h + l2 + 32 * (k4 & 1)] >> (4 * (k4 >> 1));
                v[l2] = (int8_t)((lo & 0xF) | (((b->qh[32 * h + l2] >> (2 * k4)) & 3) << 4));
            }
            sc[2 * u] = b->scales[2 * (u % 8)], sc[2 * u + 1] = b->scales[2 * (u % 8) + 1];
            if (u % 8 == 0) d[u / 8] = half_to_float(b->d);
            break;
        }
        case T_Q2_K: case T_Q3_K: case T_IQ4_XS: { /* sub-block j of 32 of super-block u / 8 */
            const int j = (int)(u % 8);
            const block_q2_K *b2 = (const block_q2_K *)row + u / 8;
            const block_q3_K *b3 = (const block_q3_K *)row + u / 8;
            const block_iq4_xs *bx = (const block_iq4_xs *)row + u / 8;
            for (int l2 = 0; l2 < 32; l2++) {
                const int e = 32 * j + l2;
                v[l2] = (int8_t)(type == T_Q2_K ? q2_k_value(b2, e) : type == T_Q3_K ? q3_k_value(b3, e) : iq4_xs_value(bx, e));
            }
            if (type == T_Q2_K) { /* the two groups' scales (their mins stay in the block: tile_rows) */
                sc[2 * u] = b2->scales[2 * j] & 0xF, sc[2 * u + 1] = b2->scales[2 * j + 1] & 0xF;
            } else if (type == T_Q3_K) {
                int8_t s3[16];
                q3_k_scales(b3->scales, s3);
                sc[2 * u] = s3[2 * j], sc[2 * u + 1] = s3[2 * j + 1];
            } else {
                sc[2 * u] = iq4_xs_scale(bx, j);
            }
            if (j == 0) {
                d[u / 8] = half_to_float(type == T_Q2_K ? b2->d : type == T_Q3_K ? b3->d : bx->d);
                if (type == T_Q2_K) m[u / 8] = half_to_float(b2->dmin);
            }
            break;
        }
        case T_IQ4_NL: {
            const block_iq4_nl *b = (const block_iq4_nl *)row + u;
            for (int j = 0; j < 16; j++) v[j] = iq4_values()[b->qs[j] & 0xF], v[j + 16] = iq4_values()[b->qs[j] >> 4];
            d[u] = half_to_float(b->d);
            break;
        }
        default: { /* Q4_K, Q5_K: sub-block j of super-block u / 8 */
            const int j = (int)(u % 8);
            const block_q4_K *b4 = (const block_q4_K *)row + u / 8;
            const block_q5_K *b5 = (const block_q5_K *)row + u / 8;
            const uint8_t *qs = type == T_Q4_K ? b4->qs : b5->qs, *scales = type == T_Q4_K ? b4->scales : b5->scales;
            for (int l2 = 0; l2 < 32; l2++) {
                int q = (qs[32 * (j / 2) + l2] >> (4 * (j % 2))) & 0xF;
                if (type == T_Q5_K) q |= ((b5->qh[l2] >> j) & 1) << 4;
                v[l2] = (int8_t)q;
            }
            int s, mn;
            scale_min_k4(j, scales, &s, &mn);
            sc[2 * u] = s, sc[2 * u + 1] = mn;
            if (j == 0) {
                d[u / 8] = half_to_float(type == T_Q4_K ? b4->d : b5->d);
                m[u / 8] = half_to_float(type == T_Q4_K ? b4->dmin : b5->dmin);
            }
        }
        }
    }
}

/* y[i][o + l] for every activation row i and the tile's nw rows: the row kernels' float code. */
static void tile_rows(const job_t *J, const tile_t *T, int64_t o, int nw) {
    const int type = J->f->type;
    const int64_t k = J->k, nu = k / QK8;
    for (int64_t i = 0; i < J->n; i++) {
        const uint8_t *row = J->act + i * J->act_row;
        float *yi = J->y + i * J->ldy + o;
        for (int l = 0; l < nw; l++) {
            const int8_t *v = T->vals + l * k;
            const float *d = T->d + l * nu, *m = T->m + l * nu;
            const int32_t *sc = T->sc + l * nu * 2;
            float sumf = 0.0f;
            if (J->f->vdt == VDT_Q8_K) {
                for (int64_t sb = 0; sb < nu / 8; sb++) {
                    const block_q8_K *y = (const block_q8_K *)row + sb;
                    int sumi = 0, summ = 0;
                    if (type == T_Q2_K || type == T_Q3_K) { /* 16 groups of 16, Q2_K's mins from the block */
                        for (int g = 0; g < 16; g++) sumi += sc[sb * 16 + g] * dot16_i8(v + sb * QK_K + 16 * g, y->qs + 16 * g);
                        if (type == T_Q2_K) {
                            const block_q2_K *x = (const block_q2_K *)job_row(J, o + l) + sb;
                            for (int g = 0; g < 16; g++) summ += y->bsums[g] * (x->scales[g] >> 4);
                            sumf += -y->d * m[sb] * (float)summ;
                            sumf += y->d * d[sb] * (float)sumi;
                        } else {
                            sumf += d[sb] * y->d * (float)sumi;
                        }
                    } else if (type == T_IQ4_XS) {
                        for (int j = 0; j < 8; j++)
                            sumi += sc[2 * (sb * 8 + j)] * dot32_i8(v + (sb * 8 + j) * QK8, y->qs + QK8 * j);
                        sumf += d[sb] * y->d * (float)sumi;
                    } else if (type == T_Q6_K) {
                        for (int g = 0; g < 16; g++) { /* q - 32 through the sums by 16 */
                            const int dot = dot16_i8(v + sb * QK_K + 16 * g, y->qs + 16 * g);
                            sumi += sc[sb * 16 + g] * (dot - 32 * y->bsums[g]);
                        }
                        sumf += y->d * d[sb] * (float)sumi;
                    } else {
                        for (int j = 0; j < 8; j++) {
                            const int64_t u = sb * 8 + j;
                            sumi += sc[2 * u] * dot32_i8(v + u * QK8, y->qs + QK8 * j);
                            summ += sc[2 * u + 1] * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
                        }
                        sumf += y->d * d[sb] * (float)sumi - y->d * m[sb] * (float)summ;
                    }
                }
            } else if (J->f->vdt == VDT_Q8_1) {
                for (int64_t u = 0; u < nu; u++) {
                    const block_q8_1 *y = (const block_q8_1 *)row + u;
                    const int sumi = dot32_i8(v + u * QK8, y->qs);
                    sumf += d[u] * half_to_float(y->d) * (float)sumi + m[u] * half_to_float(y->s);
                }
            } else if (type == T_IQ4_NL) {
                for (int64_t u = 0; u < nu; u++) {
                    const block_q8_0 *y = (const block_q8_0 *)row + u;
                    sumf += d[u] * half_to_float(y->d) * (float)dot32_i8(v + u * QK8, y->qs);
                }
            } else {
                for (int64_t u = 0; u < nu; u++) {
                    const block_q8_0 *y = (const block_q8_0 *)row + u;
                    sumf += (float)dot32_i8(v + u * QK8, y->qs) * d[u] * half_to_float(y->d);
                }
            }
            yi[l] = sumf;
        }
    }
}

typedef struct {
    const job_t *J;
    int failed;
} tiles_t;

/* Tiles [t0, t1) against every activation row: a task of the pool. */
static void matmul_tiles(void *ctx, int64_t t0, int64_t t1) {
    tiles_t *S = ctx;
    const job_t *J = S->J;
    const int64_t nu = J->k / QK8;
    tile_t T = {malloc((size_t)(PANEL_C_W * J->k)), malloc(sizeof(float) * (size_t)(2 * PANEL_C_W * nu)), NULL,
                malloc(sizeof(int32_t) * (size_t)(2 * PANEL_C_W * nu))};
    if (!T.vals || !T.d || !T.sc) {
        free(T.vals), free(T.d), free(T.sc);
        S->failed = 1; /* only ever set: a benign race */
        return;
    }
    T.m = T.d + PANEL_C_W * nu;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t o = t * PANEL_C_W;
        const int nw = J->n_out - o < PANEL_C_W ? (int)(J->n_out - o) : PANEL_C_W;
        for (int l = 0; l < nw; l++) decode_row(J->f->type, job_row(J, o + l), J->k, l, &T);
        tile_rows(J, &T, o, nw);
    }
    free(T.vals), free(T.d), free(T.sc);
}

int kvq_matmul_panels(const job_t *J) {
    tiles_t S = {.J = J};
    kv_parallel(matmul_tiles, &S, (J->n_out + PANEL_C_W - 1) / PANEL_C_W, 1);
    return S.failed ? -1 : 0;
}
#endif
