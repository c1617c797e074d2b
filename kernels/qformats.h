/* The weight formats of the block matmuls (qmatmul.c): ggml's block layouts, and per format its
 * activation type and its row kernels (qrows_0.c: the 32-element formats, qrows_k.c: the
 * K-quants). A row kernel computes what ggml's vec_dot for the format computes, in the same
 * order of float operations on AVX2, so each output has the bits of llama.cpp's; the kernels
 * for several activation rows at once give every row those same bits. */
#ifndef KVTOOL_QFORMATS_H
#define KVTOOL_QFORMATS_H

#include <stdint.h>

#include "q8_act.h"

/* ggml's type ids */
enum {
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q5_0 = 6,
    T_Q8_0 = 8,
    T_Q2_K = 10,
    T_Q3_K = 11,
    T_Q4_K = 12,
    T_Q5_K = 13,
    T_Q6_K = 14,
    T_IQ4_NL = 20,
    T_IQ4_XS = 23,
};

typedef struct {
    uint16_t d;
    uint8_t qs[QK8 / 2];
} block_q4_0;
typedef struct {
    uint16_t d, m;
    uint8_t qs[QK8 / 2];
} block_q4_1;
typedef struct {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[QK8 / 2];
} block_q5_0;
/* Q8_0 weights are block_q8_0 (q8_act.h). */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12]; /* 8 six-bit scales and 8 six-bit mins */
    uint8_t qs[QK_K / 2];
} block_q4_K;
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_K;
typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_K;
typedef struct {
    uint8_t scales[QK_K / 16]; /* per 16: a 4-bit scale (low) and a 4-bit min (high) */
    uint8_t qs[QK_K / 4];
    uint16_t d, dmin;
} block_q2_K;
typedef struct {
    uint8_t hmask[QK_K / 8]; /* the high bit, set: q is 0..3, clear: q - 4 */
    uint8_t qs[QK_K / 4];
    uint8_t scales[12]; /* 16 six-bit scales */
    uint16_t d;
} block_q3_K;
typedef struct {
    uint16_t d;
    uint16_t scales_h;
    uint8_t scales_l[QK_K / 64];
    uint8_t qs[QK_K / 2];
} block_iq4_xs;
typedef struct {
    uint16_t d;
    uint8_t qs[QK8 / 2];
} block_iq4_nl;

/* out[r] = (weight row w) . (activation row act[r]) for r < the kernel's row count; nb blocks. */
typedef void (*rows_fn)(const uint8_t *w, int64_t nb, const uint8_t *const *act, float *out);

#define ROW_KERNELS 4 /* kernels of 1, 2, 4 and 8 activation rows */

typedef struct {
    int type;
    int64_t blck, type_size; /* elements and bytes of a block */
    int vdt;                 /* the activation type (q8_act.h) */
    const rows_fn *rows;     /* ROW_KERNELS of them */
} qformat;

/* The format of a type id, or NULL. */
const qformat *kvq_format(int type);

/* Row kernels of each format: qrows_0.c, qrows_k.c, qrows_lowbit.c. */
extern const rows_fn kvq_rows_q4_0[ROW_KERNELS], kvq_rows_q4_1[ROW_KERNELS], kvq_rows_q5_0[ROW_KERNELS],
    kvq_rows_q8_0[ROW_KERNELS];
extern const rows_fn kvq_rows_q4_K[ROW_KERNELS], kvq_rows_q5_K[ROW_KERNELS], kvq_rows_q6_K[ROW_KERNELS];
extern const rows_fn kvq_rows_q2_K[ROW_KERNELS], kvq_rows_q3_K[ROW_KERNELS], kvq_rows_iq4_xs[ROW_KERNELS],
    kvq_rows_iq4_nl[ROW_KERNELS];

/* Q4_K / Q5_K: the 8 six-bit scales (utmp[0..1]) and mins (utmp[2..3]) of 12 packed bytes, as
 * ggml unpacks them. */
static inline void unpack_k_scales(const uint8_t *scales, uint32_t utmp[4]) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    __builtin_memcpy(utmp, scales, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
}

/* Sub-block j of 32 of a Q4_K / Q5_K super-block: its scale and min (ggml's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The 16 non-linear values of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl). */
static inline const int8_t *iq4_values(void) {
    static const int8_t v[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
    return v;
}

/* The 16 scales of a Q3_K super-block, each minus 32. */
static inline void q3_k_scales(const uint8_t *s, int8_t *sc) {
    for (int j = 0; j < 16; j++) {
        const int lo = (j < 8 ? s[j] : s[j - 8] >> 4) & 0xF;
        const int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

/* The 6-bit scale of sub-block ib of an IQ4_XS super-block, minus 32. */
static inline int iq4_xs_scale(const block_iq4_xs *x, int ib) {
    return (((x->scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((x->scales_h >> (2 * ib)) & 3) << 4)) - 32;
}

/* Element e of a Q2_K super-block (0..3), of a Q3_K one (-4..3), of an IQ4_XS one (its value). */
static inline int q2_k_value(const block_q2_K *x, int e) {
    return (x->qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
}
static inline int q3_k_value(const block_q3_K *x, int e) {
    const int h = e / 128, s = (e % 128) / 32, l = e % 32;
    return ((x->qs[32 * h + l] >> (2 * s)) & 3) - ((x->hmask[l] >> (4 * h + s)) & 1 ? 0 : 4);
}
static inline int iq4_xs_value(const block_iq4_xs *x, int e) {
    const uint8_t b = x->qs[16 * (e / 32) + e % 16];
    return iq4_values()[e % 32 < 16 ? b & 0xF : b >> 4];
}

#endif
