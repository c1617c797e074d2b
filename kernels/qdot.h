/* Integer dot products of one weight block with an activation block's qs, per format, for the
 * kernels built without AVX2 (qrows_0.c, qrows_k.c, qrows_lowbit.c): a NEON section (ggml's ARM
 * kernels' way: nibbles unpacked in registers, dot16 of qrows.h) and a portable C section. Both give the same
 * integers, so the float code around them (shared) gives the same bits on every CPU. The dots of
 * already decoded bytes serve the panel kernel without AVX2 (qpanel_c.c). */
#ifndef KVTOOL_QDOT_H
#define KVTOOL_QDOT_H

#include <stdint.h>
#include <string.h>

#include "qformats.h"
#include "qrows.h"

#if defined(KV_NEON)
/* ---- NEON ---- */

/* The low and the high nibbles of 16 bytes as signed bytes minus `off`. */
static inline void nibbles_s8(const uint8_t *p, int8_t off, int8x16_t *lo, int8x16_t *hi) {
    const uint8x16_t v = vld1q_u8(p);
    *lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0xF))), vdupq_n_s8(off));
    *hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), vdupq_n_s8(off));
}

/* Bits 0-15 of p[0..1] as 16 bytes: `val` where the bit is set, else 0. */
static inline uint8x16_t bits16(const uint8_t *p, uint8_t val) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t bytes = vcombine_u8(vdup_n_u8(p[0]), vdup_n_u8(p[1]));
    return vandq_u8(vtstq_u8(bytes, vld1q_u8(bit)), vdupq_n_u8(val));
}

static inline int dot2x16(int8x16_t a0, const int8_t *y0, int8x16_t a1, const int8_t *y1) {
    return vaddvq_s32(dot16(dot16(vdupq_n_s32(0), a0, vld1q_s8(y0)), a1, vld1q_s8(y1)));
}

static inline int dot_q4_0(const block_q4_0 *x, const int8_t *y) {
    int8x16_t lo, hi;
    nibbles_s8(x->qs, 8, &lo, &hi);
    return dot2x16(lo, y, hi, y + 16);
}

static inline int dot_q4_1(const block_q4_1 *x, const int8_t *y) {
    int8x16_t lo, hi;
    nibbles_s8(x->qs, 0, &lo, &hi);
    return dot2x16(lo, y, hi, y + 16);
}

static inline int dot_q5_0(const block_q5_0 *x, const int8_t *y) {
    const uint8x16_t v = vld1q_u8(x->qs);
    const uint8x16_t lo = vorrq_u8(vandq_u8(v, vdupq_n_u8(0xF)), bits16(x->qh, 0x10));
    const uint8x16_t hi = vorrq_u8(vshrq_n_u8(v, 4), bits16(x->qh + 2, 0x10));
    const int8x16_t s16 = vdupq_n_s8(16);
    return dot2x16(vsubq_s8(vreinterpretq_s8_u8(lo), s16), y, vsubq_s8(vreinterpretq_s8_u8(hi), s16), y + 16);
}

static inline int dot_q8_0(const block_q8_0 *x, const int8_t *y) {
    return dot2x16(vld1q_s8(x->qs), y, vld1q_s8(x->qs + 16), y + 16);
}

/* Q4_K / Q5_K (qh NULL for Q4_K): the 8 sub-blocks' dots of their unsigned values with y. */
static inline void sub_dots_q45_K(const uint8_t *qs, const uint8_t *qh, const int8_t *y, int dots[8]) {
    const uint8x16_t m4 = vdupq_n_u8(0xF);
    uint8x16_t h0 = vdupq_n_u8(0), h1 = h0;
    if (qh) h0 = vld1q_u8(qh), h1 = vld1q_u8(qh + 16);
    for (int p = 0; p < 4; p++) { /* 32 bytes: sub-block 2p in the low nibbles, 2p + 1 in the high */
        const uint8x16_t b0 = vld1q_u8(qs + 32 * p), b1 = vld1q_u8(qs + 32 * p + 16);
        for (int h = 0; h < 2; h++) {
            const int j = 2 * p + h;
            uint8x16_t v0 = h ? vshrq_n_u8(b0, 4) : vandq_u8(b0, m4), v1 = h ? vshrq_n_u8(b1, 4) : vandq_u8(b1, m4);
            if (qh) {
                const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << j)), f = vdupq_n_u8(0x10);
                v0 = vorrq_u8(v0, vandq_u8(vtstq_u8(h0, bit), f));
                v1 = vorrq_u8(v1, vandq_u8(vtstq_u8(h1, bit), f));
            }
            dots[j] = dot2x16(vreinterpretq_s8_u8(v0), y + 32 * j, vreinterpretq_s8_u8(v1), y + 32 * j + 16);
        }
    }
}

/* Q6_K: the 16 groups' dots of their unsigned 6-bit values (q + 32) with y. */
static inline void sub_dots_q6_K(const block_q6_K *x, const int8_t *y, int dots[16]) {
    const uint8x16_t m4 = vdupq_n_u8(0xF), m3 = vdupq_n_u8(3);
    for (int h = 0; h < 2; h++) /* 128 elements: quarter k4 of 32 from ql's nibbles and qh's bit pairs */
        for (int k4 = 0; k4 < 4; k4++)
            for (int half = 0; half < 2; half++) {
                const uint8x16_t l = vld1q_u8(x->ql + 64 * h + 32 * (k4 & 1) + 16 * half);
                const uint8x16_t hb = vld1q_u8(x->qh + 32 * h + 16 * half);
                const uint8x16_t lo = k4 >> 1 ? vshrq_n_u8(l, 4) : vandq_u8(l, m4);
                const uint8x16_t hi = vandq_u8(vshlq_u8(hb, vdupq_n_s8((int8_t)(-2 * k4))), m3);
                const uint8x16_t q = vorrq_u8(lo, vshlq_n_u8(hi, 4));
                const int e = 128 * h + 32 * k4 + 16 * half;
                dots[e / 16] = vaddvq_s32(dot16(vdupq_n_s32(0), vreinterpretq_s8_u8(q), vld1q_s8(y + e)));
            }
}

/* Q2_K / Q3_K: the 16 groups' dots of their values (Q2_K 0..3, Q3_K -4..3) with y. */
static inline void sub_dots_q23_K(int type, const uint8_t *qs, const uint8_t *hmask, const int8_t *y, int dots[16]) {
    for (int g = 0; g < 16; g++) { /* group g: half g / 8 of 128, 2-bit plane (g % 8) / 2, bytes 16 (g % 2) on */
        const int h = g / 8, s = (g % 8) / 2, l0 = 16 * (g % 2);
        const uint8x16_t lo = vandq_u8(vshlq_u8(vld1q_u8(qs + 32 * h + l0), vdupq_n_s8((int8_t)(-2 * s))), vdupq_n_u8(3));
        int8x16_t v = vreinterpretq_s8_u8(lo);
        if (type == T_Q3_K) {
            const uint8x16_t set = vtstq_u8(vld1q_u8(hmask + l0), vdupq_n_u8((uint8_t)(1u << (4 * h + s))));
            v = vsubq_s8(v, vreinterpretq_s8_u8(vbicq_u8(vdupq_n_u8(4), set)));
        }
        dots[g] = vaddvq_s32(dot16(vdupq_n_s32(0), v, vld1q_s8(y + 16 * g)));
    }
}

/* IQ4_NL / IQ4_XS: 32 values from 16 bytes of nibbles (low nibbles first) dotted with y. */
static inline int dot_iq4(const uint8_t *qs, const int8_t *y) {
    const int8x16_t values = vld1q_s8(iq4_values());
    const uint8x16_t b = vld1q_u8(qs);
    return dot2x16(vqtbl1q_s8(values, vandq_u8(b, vdupq_n_u8(0xF))), y, vqtbl1q_s8(values, vshrq_n_u8(b, 4)), y + 16);
}

/* Dots of 16 and of 32 signed bytes (decoded weights: qpanel_c.c). */
static inline int dot16_i8(const int8_t *a, const int8_t *b) {
    return vaddvq_s32(dot16(vdupq_n_s32(0), vld1q_s8(a), vld1q_s8(b)));
}

static inline int dot32_i8(const int8_t *a, const int8_t *b) { return dot2x16(vld1q_s8(a), b, vld1q_s8(a + 16), b + 16); }

#else
/* ---- portable C ---- */

static inline int dot_q4_0(const block_q4_0 *x, const int8_t *y) {
    int sumi = 0;
    for (int j = 0; j < QK8 / 2; j++) sumi += ((x->qs[j] & 0xF) - 8) * y[j] + ((x->qs[j] >> 4) - 8) * y[j + QK8 / 2];
    return sumi;
}

static inline int dot_q4_1(const block_q4_1 *x, const int8_t *y) {
    int sumi = 0;
    for (int j = 0; j < QK8 / 2; j++) sumi += (x->qs[j] & 0xF) * y[j] + (x->qs[j] >> 4) * y[j + QK8 / 2];
    return sumi;
}

static inline int dot_q5_0(const block_q5_0 *x, const int8_t *y) {
    uint32_t qh;
    memcpy(&qh, x->qh, 4);
    int sumi = 0;
    for (int j = 0; j < QK8 / 2; j++) {
        const int lo = (x->qs[j] & 0xF) | (((qh >> j) & 1) << 4);
        const int hi = (x->qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        sumi += (lo - 16) * y[j] + (hi - 16) * y[j + QK8 / 2];
    }
    return sumi;
}

static inline int dot_q8_0(const block_q8_0 *x, const int8_t *y) {
    int sumi = 0;
    for (int j = 0; j < QK8; j++) sumi += x->qs[j] * y[j];
    return sumi;
}

static inline void sub_dots_q45_K(const uint8_t *qs, const uint8_t *qh, const int8_t *y, int dots[8]) {
    for (int j = 0; j < 8; j++) {
        int dot = 0;
        for (int l = 0; l < 32; l++) {
            int v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
            if (qh) v |= ((qh[l] >> j) & 1) << 4;
            dot += v * y[32 * j + l];
        }
        dots[j] = dot;
    }
}

static inline void sub_dots_q6_K(const block_q6_K *x, const int8_t *y, int dots[16]) {
    for (int g = 0; g < 16; g++) dots[g] = 0;
    for (int e = 0; e < QK_K; e++) { /* element e: half e / 128, within it l and quarter e % 128 / 32 */
        const int h = e / 128, k4 = (e % 128) / 32, l = e % 32;
        const uint8_t lo = x->ql[64 * h + l + 32 * (k4 & 1)] >> (4 * (k4 >> 1));
        dots[e / 16] += ((lo & 0xF) | (((x->qh[32 * h + l] >> (2 * k4)) & 3) << 4)) * y[e];
    }
}

static inline void sub_dots_q23_K(int type, const uint8_t *qs, const uint8_t *hmask, const int8_t *y, int dots[16]) {
    for (int g = 0; g < 16; g++) {
        int dot = 0;
        for (int e = 16 * g; e < 16 * g + 16; e++) {
            const int h = e / 128, s = (e % 128) / 32, l = e % 32;
            int q = (qs[32 * h + l] >> (2 * s)) & 3;
            if (type == T_Q3_K) q -= (hmask[l] >> (4 * h + s)) & 1 ? 0 : 4;
            dot += q * y[e];
        }
        dots[g] = dot;
    }
}

static inline int dot_iq4(const uint8_t *qs, const int8_t *y) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += iq4_values()[qs[j] & 0xF] * y[j] + iq4_values()[qs[j] >> 4] * y[16 + j];
    return s;
}

static inline int dot16_i8(const int8_t *a, const int8_t *b) {
    int s = 0;
    for (int j = 0; j < 16; j++) s += a[j] * b[j];
    return s;
}

static inline int dot32_i8(const int8_t *a, const int8_t *b) {
    int s = 0;
    for (int j = 0; j < 32; j++) s += a[j] * b[j];
    return s;
}
#endif

#endif
