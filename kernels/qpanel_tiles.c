/* The panel kernel's multiply (qpanel.h): tiles of PANEL_TILE activation rows against one panel.
 * With AVX-512 VNNI a zmm holds 16 weight rows' 4 bytes and vpdpbusd adds each step's products
 * straight into int32; with AVX2 a ymm holds 8 rows and vpmaddubsw's int16 sums go to int32
 * every few steps (8 steps of at most 2 * 15 * 127 for 4-bit values, 4 for 5-bit, 2 for Q6_K's 6
 * bits), through the sub-block scale where the format has one. The epilogue is shared: per block
 * or super-block the integer sums are scaled as the row kernels scale them. */

#include <string.h>

#include "qpanel.h"
#include "qrows.h"

#ifdef KV_AVX2
#ifdef PANEL_VNNI
typedef __m512 vf;
typedef __m512i vi;
#define VI_ZERO() _mm512_setzero_si512()
#define VF_ZERO() _mm512_setzero_ps()
#define VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VF_LOAD(p) _mm512_loadu_ps(p)
#define VI_SET1(x) _mm512_set1_epi32(x)
#define VF_SET1(x) _mm512_set1_ps(x)
#define VI_ADD(a, b) _mm512_add_epi32(a, b)
#define VI_SUB(a, b) _mm512_sub_epi32(a, b)
#define VI_MULLO(a, b) _mm512_mullo_epi32(a, b)
#define VI_MADD16(a, b) _mm512_madd_epi16(a, b)
#define VI_SLLI(a, n) _mm512_slli_epi32(a, n)
#define VI_OR(a, b) _mm512_or_si512(a, b)
#define VI_AND(a, b) _mm512_and_si512(a, b)
#define VF_CVT(a) _mm512_cvtepi32_ps(a)
#define VF_MUL(a, b) _mm512_mul_ps(a, b)
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VF_STORE(p, a) _mm512_storeu_ps(p, a)
#else
typedef __m256 vf;
typedef __m256i vi;
#define VI_ZERO() _mm256_setzero_si256()
#define VF_ZERO() _mm256_setzero_ps()
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VF_LOAD(p) _mm256_loadu_ps(p)
#define VI_SET1(x) _mm256_set1_epi32(x)
#define VF_SET1(x) _mm256_set1_ps(x)
#define VI_ADD(a, b) _mm256_add_epi32(a, b)
#define VI_SUB(a, b) _mm256_sub_epi32(a, b)
#define VI_MULLO(a, b) _mm256_mullo_epi32(a, b)
#define VI_MADD16(a, b) _mm256_madd_epi16(a, b)
#define VI_SLLI(a, n) _mm256_slli_epi32(a, n)
#define VI_OR(a, b) _mm256_or_si256(a, b)
#define VI_AND(a, b) _mm256_and_si256(a, b)
#define VF_CVT(a) _mm256_cvtepi32_ps(a)
#define VF_MUL(a, b) _mm256_mul_ps(a, b)
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VF_STORE(p, a) _mm256_storeu_ps(p, a)
#endif

#define PANEL_TILE 4 /* activation rows per pass over a panel */

/* s[r][v] = the integer sums of steps [s0, s1) of block u for R activation rows and the panel's
 * vectors v, each step's products times `scale[v]` (int16 pairs; AVX2) or plain (VNNI, scaled by
 * the caller). */
static inline __attribute__((always_inline)) void block_steps(const uint8_t *pb, const int8_t *const *qx, int s0,
                                                              int s1, const int R, const int flush,
                                                              const vi *scale, vi (*s)[PANEL_NV]) {
    for (int r = 0; r < R; r++)
        for (int v = 0; v < PANEL_NV; v++) s[r][v] = VI_ZERO();
#ifdef PANEL_VNNI
    (void)flush, (void)scale;
    for (int st = s0; st < s1; st++) {
        vi w[PANEL_NV];
        for (int v = 0; v < PANEL_NV; v++) w[v] = VI_LOAD(pb + st * 4 * PANEL_W + v * 4 * PANEL_VW);
        for (int r = 0; r < R; r++) {
            int32_t x;
            memcpy(&x, qx[r] + 4 * st, 4);
            const vi xb = VI_SET1(x);
            for (int v = 0; v < PANEL_NV; v++) s[r][v] = _mm512_dpbusd_epi32(s[r][v], w[v], xb);
        }
    }
#else
    for (int f0 = s0; f0 < s1; f0 += flush) {
        __m256i a16[PANEL_TILE][PANEL_NV];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < PANEL_NV; v++) a16[r][v] = _mm256_setzero_si256();
        for (int st = f0; st < f0 + flush; st++) {
            vi w[PANEL_NV];
            for (int v = 0; v < PANEL_NV; v++) w[v] = VI_LOAD(pb + st * 4 * PANEL_W + v * 4 * PANEL_VW);
            for (int r = 0; r < R; r++) {
                int32_t x;
                memcpy(&x, qx[r] + 4 * st, 4);
                for (int v = 0; v < PANEL_NV; v++)
                    a16[r][v] = _mm256_add_epi16(a16[r][v], _mm256_maddubs_epi16(w[v], VI_SET1(x)));
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < PANEL_NV; v++) s[r][v] = VI_ADD(s[r][v], VI_MADD16(a16[r][v], scale[v]));
    }
#endif
}

/* A sub-block scale (int32 lanes) as the step sums' multiplier: the AVX2 sums are scaled as
 * int16 pairs (sc, sc) when they reach int32; the VNNI ones are multiplied after. */
static inline vi pair_of(vi sc) { return VI_OR(VI_AND(sc, VI_SET1(0xFFFF)), VI_SLLI(sc, 16)); }

#define EACH(r, v)                  \
    for (int r = 0; r < R; r++)     \
        for (int v = 0; v < PANEL_NV; v++)

/* y[i .. i + R)[o .. o + nw) of one panel of `type` (a constant where it is inlined). */
static inline __attribute__((always_inline)) void panel_tile(const int type, const job_t *J, const panel_t *P,
                                                             const acts_t *A, int64_t i, const int R, int64_t o,
                                                             int nw) {
    const int off = panel_offset(type);
    const int kq = type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
    const int vdt = kq ? VDT_Q8_K : type == T_Q4_1 ? VDT_Q8_1 : VDT_Q8_0;
    const int64_t nu = J->k / QK8, nb = kq ? nu / 8 : nu;
    const int flush = type == T_Q6_K ? 2 : (type == T_Q5_0 || type == T_Q5_K) ? 4 : 8; /* AVX2 only */
    vi ones[PANEL_NV];
    for (int v = 0; v < PANEL_NV; v++) ones[v] = VI_SET1(0x00010001);
    vf acc[PANEL_TILE][PANEL_NV];
    vi isb[PANEL_TILE][PANEL_NV];
    EACH(r, v) acc[r][v] = VF_ZERO(), isb[r][v] = VI_ZERO();
    for (int64_t u = 0; u < nu; u++) {
        const uint8_t *pb = P->pq + u * QK8 * PANEL_W;
        const int8_t *qx[PANEL_TILE];
        for (int r = 0; r < R; r++) qx[r] = act_block(J->act + (i + r) * J->act_row, vdt, u);
        vi a[PANEL_TILE][PANEL_NV], b[PANEL_TILE][PANEL_NV];
        if (type == T_Q6_K) { /* two scales of 16 elements, and the offset 32 through their sums */
            vi sa[PANEL_NV], sb[PANEL_NV];
            for (int v = 0; v < PANEL_NV; v++)
                sa[v] = VI_LOAD(P->psc + (2 * u) * PANEL_W + v * PANEL_VW),
                sb[v] = VI_LOAD(P->psc + (2 * u + 1) * PANEL_W + v * PANEL_VW);
#ifdef PANEL_VNNI
            block_steps(pb, qx, 0, 4, R, flush, ones, a);
            block_steps(pb, qx, 4, 8, R, flush, ones, b);
            EACH(r, v) a[r][v] = VI_ADD(VI_MULLO(a[r][v], sa[v]), VI_MULLO(b[r][v], sb[v]));
#else
            for (int v = 0; v < PANEL_NV; v++) sa[v] = pair_of(sa[v]), sb[v] = pair_of(sb[v]);
            block_steps(pb, qx, 0, 4, R, flush, sa, a);
            block_steps(pb, qx, 4, 8, R, flush, sb, b);
            EACH(r, v) a[r][v] = VI_ADD(a[r][v], b[r][v]);
#endif
            EACH(r, v) {
                const vi sp = VI_LOAD(P->ppair + u * PANEL_W + v * PANEL_VW);
                const vi o32 = VI_MADD16(sp, VI_SET1(A->bpair16[(i + r) * nu + u]));
                isb[r][v] = VI_ADD(isb[r][v], VI_SUB(a[r][v], VI_SLLI(o32, 5)));
            }
        } else if (kq) { /* Q4_K, Q5_K: one scale for the block */
            vi sc[PANEL_NV];
            for (int v = 0; v < PANEL_NV; v++) sc[v] = VI_LOAD(P->psc + u * PANEL_W + v * PANEL_VW);
#ifdef PANEL_VNNI
            block_steps(pb, qx, 0, 8, R, flush, ones, a);
            EACH(r, v) isb[r][v] = VI_ADD(isb[r][v], VI_MULLO(a[r][v], sc[v]));
#else
            for (int v = 0; v < PANEL_NV; v++) sc[v] = pair_of(sc[v]);
            block_steps(pb, qx, 0, 8, R, flush, sc, a);
            EACH(r, v) isb[r][v] = VI_ADD(isb[r][v], a[r][v]);
#endif
        } else {
            block_steps(pb, qx, 0, 8, R, flush, ones, a);
            EACH(r, v) {
                const vf d = VF_LOAD(P->pd + u * PANEL_W + v * PANEL_VW);
                const float dx = A->dx[(i + r) * nu + u];
                if (off) a[r][v] = VI_SUB(a[r][v], VI_SET1(off * A->qsum[(i + r) * nu + u]));
                acc[r][v] = VF_FMA(VF_CVT(a[r][v]), VF_MUL(d, VF_SET1(dx)), acc[r][v]);
                if (type == T_Q4_1)
                    acc[r][v] = VF_FMA(VF_LOAD(P->pm + u * PANEL_W + v * PANEL_VW),
                                       VF_SET1(A->sx[(i + r) * nu + u]), acc[r][v]);
            }
            continue;
        }
        if (u % 8 != 7) continue;
        const int64_t sb = u / 8; /* a K-quant super-block is done: its sums times d_w * d_x, and its mins */
        EACH(r, v) {
            const float dx = A->dx[(i + r) * nb + sb];
            const vf d = VF_LOAD(P->pd + sb * PANEL_W + v * PANEL_VW);
            acc[r][v] = VF_FMA(VF_CVT(isb[r][v]), VF_MUL(d, VF_SET1(dx)), acc[r][v]);
            isb[r][v] = VI_ZERO();
            if (type == T_Q6_K) continue;
            vi msum = VI_ZERO();
            for (int p = 0; p < 4; p++)
                msum = VI_ADD(msum, VI_MADD16(VI_LOAD(P->ppair + (sb * 4 + p) * PANEL_W + v * PANEL_VW),
                                              VI_SET1(A->bpair32[((i + r) * nb + sb) * 4 + p])));
            const vf dmin = VF_LOAD(P->pm + sb * PANEL_W + v * PANEL_VW);
            acc[r][v] = VF_FMA(VF_CVT(msum), VF_MUL(dmin, VF_SET1(-dx)), acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++) {
        float out[PANEL_W];
        for (int v = 0; v < PANEL_NV; v++) VF_STORE(out + v * PANEL_VW, acc[r][v]);
        memcpy(J->y + (i + r) * J->ldy + o, out, sizeof(float) * (size_t)nw);
    }
}

/* Every activation row, in tiles of PANEL_TILE, for a format known where it is inlined. */
static inline __attribute__((always_inline)) void panel_rows(const int type, const job_t *J, const panel_t *P,
                                                             const acts_t *A, int64_t o, int nw) {
    int64_t i = 0;
    for (; i + PANEL_TILE <= J->n; i += PANEL_TILE) panel_tile(type, J, P, A, i, PANEL_TILE, o, nw);
    for (; i < J->n; i++) panel_tile(type, J, P, A, i, 1, o, nw);
}

void kvq_panel_rows(const job_t *J, const panel_t *P, const acts_t *A, int64_t o, int nw) {
    switch (J->f->type) { /* one copy of the tiles per format: its branches and registers fixed */
    case T_Q4_0: panel_rows(T_Q4_0, J, P, A, o, nw); break;
    case T_Q4_1: panel_rows(T_Q4_1, J, P, A, o, nw); break;
    case T_Q5_0: panel_rows(T_Q5_0, J, P, A, o, nw); break;
    case T_Q8_0: panel_rows(T_Q8_0, J, P, A, o, nw); break;
    case T_Q4_K: panel_rows(T_Q4_K, J, P, A, o, nw); break;
    case T_Q5_K: panel_rows(T_Q5_K, J, P, A, o, nw); break;
    default: panel_rows(T_Q6_K, J, P, A, o, nw); break;
    }
}
#endif
