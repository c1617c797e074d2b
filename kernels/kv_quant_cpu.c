/* K/V rows stored into a cache of any type: kernels/kv_quant.py's `quantize` (ggml's
 * quantize_row_*_ref, for q8_0 its x86 quantizer: what llama.cpp's set_rows runs on the CPU) in
 * C, the same float operations in the same order, so the blocks have the same bytes; float types
 * are rounded to nearest even.
 * Multiply-adds are kept apart (as in rope_store_cpu.c): IQ4_NL's least-squares sums are
 * products then sums, as torch computes them. */

#if defined(__clang__)
#pragma clang fp contract(off)
#define KEEP_ROUNDING
#elif defined(__GNUC__)
#define KEEP_ROUNDING __attribute__((optimize("fp-contract=off")))
#else
#define KEEP_ROUNDING
#endif

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_kernels.h"
#include "kv_blocks.h"

static void put_half(uint8_t *p, float f) {
    const uint16_t h = float_to_half(f);
    memcpy(p, &h, 2);
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0; /* NaN */
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* The value of largest magnitude (the first on a tie), as ggml's q4_0/q5_0/iq4_nl loops find it. */
static float signed_max(const float *x) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < KV_QK; j++)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    return max;
}

/* ggml's x86 quantize_row_q8_0 (q8_0's from_float, which llama.cpp's set_rows runs): scale
 * 127 / max|x|, not the _ref's 1 / d; round to nearest even (as x86's cvtps_epi32, a NaN included), not
 * roundf's away from zero. */
KEEP_ROUNDING static void block_q8_0(const float *x, uint8_t *y) {
    float amax = 0.0f;
    for (int j = 0; j < KV_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    put_half(y, amax / 127.0f);
    for (int j = 0; j < KV_QK; j++) y[2 + j] = (uint8_t)saturate_i8(round_to_i32(x[j] * id));
}

/* q4_0 (levels 16, offset 8.5) and q5_0 (32, 16.5): d = max / -(levels / 2). */
KEEP_ROUNDING static void block_sym(const float *x, uint8_t *y, int five) {
    const float d = signed_max(x) / (five ? -16 : -8), id = d ? 1.0f / d : 0.0f;
    put_half(y, d);
    uint32_t qh = 0;
    uint8_t *qs = y + (five ? 6 : 2);
    for (int j = 0; j < 16; j++) {
        const float x0 = x[j] * id, x1 = x[16 + j] * id;
        const int hi = five ? 31 : 15;
        const float off = five ? 16.5f : 8.5f;
        const int a = (int8_t)(x0 + off), b = (int8_t)(x1 + off);
        const uint8_t xi0 = (uint8_t)(a < hi ? a : hi), xi1 = (uint8_t)(b < hi ? b : hi);
        qs[j] = (uint8_t)((xi0 & 15) | ((xi1 & 15) << 4));
        qh |= ((xi0 & 0x10u) >> 4) << j;
        qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
    }
    if (five) memcpy(y + 2, &qh, 4);
}

/* q4_1 (levels 15) and q5_1 (31): d = (max - min) / levels, m = min. */
KEEP_ROUNDING static void block_affine(const float *x, uint8_t *y, int five) {
    float lo = FLT_MAX, hi = -FLT_MAX;
    for (int j = 0; j < KV_QK; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    const float d = (hi - lo) / (five ? 31 : 15), id = d ? 1.0f / d : 0.0f;
    put_half(y, d);
    put_half(y + 2, lo);
    uint32_t qh = 0;
    uint8_t *qs = y + (five ? 8 : 4);
    for (int j = 0; j < 16; j++) {
        const float x0 = (x[j] - lo) * id, x1 = (x[16 + j] - lo) * id;
        uint8_t xi0, xi1;
        if (five) { /* ggml's (uint8_t) cast: below 32 */
            xi0 = (uint8_t)(x0 + 0.5f);
            xi1 = (uint8_t)(x1 + 0.5f);
        } else {
            const int a = (int8_t)(x0 + 0.5f), b = (int8_t)(x1 + 0.5f);
            xi0 = (uint8_t)(a < 15 ? a : 15);
            xi1 = (uint8_t)(b < 15 ? b : 15);
        }
        qs[j] = (uint8_t)((xi0 & 15) | ((xi1 & 15) << 4));
        qh |= ((xi0 & 0x10u) >> 4) << j;
        qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
    }
    if (five) memcpy(y + 4, &qh, 4);
}

/* ggml's best_index_int8 over the IQ4_NL values: the nearest, the upper one on a tie. */
static int nearest_iq4nl(float x) {
    if (x <= kvb_iq4nl[0]) return 0;
    if (x >= kvb_iq4nl[15]) return 15;
    int ml = 0, mu = 15;
    while (mu - ml > 1) {
        const int mav = (ml + mu) / 2;
        if (x < kvb_iq4nl[mav]) mu = mav;
        else ml = mav;
    }
    return x - kvb_iq4nl[mu - 1] < kvb_iq4nl[mu] - x ? mu - 1 : mu;
}

KEEP_ROUNDING static void block_iq4_nl(const float *x, uint8_t *y) {
    uint8_t L[KV_QK];
    float amax = 0.0f;
    for (int j = 0; j < KV_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = 0.0f;
    memset(L, 0, sizeof(L));
    if (amax >= 1e-15f) { /* ggml's GROUP_MAX_EPS: below, scale 0 */
        const float id = 1 / (signed_max(x) / kvb_iq4nl[0]);
        float sumqx = 0.0f, sumq2 = 0.0f;
        for (int j = 0; j < KV_QK; j++) {
            L[j] = (uint8_t)nearest_iq4nl(id * x[j]);
            const float q = kvb_iq4nl[L[j]], wq = x[j] * x[j] * q;
            sumqx += wq * x[j];
            sumq2 += wq * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.0f;
    }
    put_half(y, d);
    for (int j = 0; j < 16; j++) y[2 + j] = (uint8_t)(L[j] | (L[16 + j] << 4));
}

/* Row x of n values into dst as a cache of `type` stores it. Returns 0, or -1 for a bad call. */
int kvb_quantize_row(int type, const float *x, int64_t n, void *dst) {
    uint8_t *y = dst;
    if (!kv_valid(type) || n < 0 || (kv_quantized(type) && n % KV_QK)) return -1;
    switch (type) {
    case KV_F32: memcpy(y, x, sizeof(float) * (size_t)n); return 0;
    case KV_F16:
        for (int64_t j = 0; j < n; j++) put_half(y + 2 * j, x[j]);
        return 0;
    case KV_BF16:
        for (int64_t j = 0; j < n; j++) {
            const uint16_t h = float_to_bf16(x[j]);
            memcpy(y + 2 * j, &h, 2);
        }
        return 0;
    default: break;
    }
    const int bb = kv_unit_bytes(type);
    for (int64_t b = 0; b < n / KV_QK; b++) {
        const float *xb = x + b * KV_QK;
        uint8_t *yb = y + b * bb;
        switch (type) {
        case KV_Q8_0: block_q8_0(xb, yb); break;
        case KV_Q4_0: block_sym(xb, yb, 0); break;
        case KV_Q5_0: block_sym(xb, yb, 1); break;
        case KV_Q4_1: block_affine(xb, yb, 0); break;
        case KV_Q5_1: block_affine(xb, yb, 1); break;
        default: block_iq4_nl(xb, yb); break;
        }
    }
    return 0;
}
