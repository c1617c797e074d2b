/* The panel kernel's shared state (qpanel.c unpacks, qpanel_avx2.c or qpanel_vnni.c multiply):
 * PANEL_W weight rows unpacked into bytes laid out so that one vector holds 4 consecutive
 * elements of each row (one int32 lane per weight row), and the activation rows' scales. */
#ifndef KVTOOL_QPANEL_H
#define KVTOOL_QPANEL_H

#include <stdint.h>

#include "qmatmul_job.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PANEL_VNNI 1
#define PANEL_VW 16 /* weight rows a vector of int32 lanes holds: a zmm */
#define PANEL_NV 2  /* vectors a panel: independent sums enough to hide vpdpbusd's latency */
#else
#define PANEL_VW 8 /* a ymm */
#define PANEL_NV 1
#endif
#define PANEL_W (PANEL_VW * PANEL_NV) /* weight rows a panel */

/* A panel's weights, for blocks u of 32 elements and super-blocks sb of the K-quants:
 * pq [nu][8 steps][PANEL_W][4] unsigned values (Q8_0's shifted by 128);
 * pd [..][PANEL_W] d per block (per super-block for the K-quants);
 * pm [..][PANEL_W] Q4_1's m per block, the K-quants' dmin per super-block;
 * psc [nu][PANEL_W] Q4_K / Q5_K sub-block scales, [nu][2][PANEL_W] Q6_K's two scales of 16;
 * ppair [nsb][4][PANEL_W] Q4_K / Q5_K mins 2p, 2p + 1 as int16 pairs, [nu][PANEL_W] Q6_K's two
 * scales of a block as int16 pairs. */
typedef struct {
    uint8_t *pq;
    float *pd, *pm;
    int32_t *psc, *ppair;
} panel_t;

/* The activation rows' numbers the tiles use, per row i: dx [i][..] d per block (Q8_K: per
 * super-block), sx [i][nu] Q8_1's s, qsum [i][nu] a block's sum of qs, bpair [i][..] sums of qs
 * as int16 pairs (Q8_K: by 32, [nsb][4]; for Q6_K also by 16, [nu]). */
typedef struct {
    float *dx, *sx;
    int32_t *qsum, *bpair32, *bpair16;
} acts_t;

/* y[i][o .. o + nw) for every activation row i, of the panel P of weight rows [o, o + nw). */
void kvq_panel_rows(const job_t *J, const panel_t *P, const acts_t *A, int64_t o, int nw);

/* The qs of block u (32 elements) of an activation row in the vec_dot type vdt. */
static inline const int8_t *act_block(const uint8_t *row, int vdt, int64_t u) {
    switch (vdt) {
    case VDT_Q8_K: return ((const block_q8_K *)row)[u / 8].qs + (u % 8) * QK8;
    case VDT_Q8_1: return ((const block_q8_1 *)row)[u].qs;
    default: return ((const block_q8_0 *)row)[u].qs;
    }
}

/* The integer offset a format's unsigned panel values carry (q - offset), 0 for none. */
static inline int panel_offset(int type) {
    return type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? 128 : type == T_Q6_K ? 32 : 0;
}

#endif
