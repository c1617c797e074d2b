/* y = x @ W.T for W in GGUF block formats, computed as llama.cpp's CPU backend computes it: each
 * row of x is quantized to the activation type of W's format (q8_act.c: Q8_0, Q8_1 or Q8_K, by
 * blocks of 32 or 256), then each weight block's integer dot product with it is scaled by both
 * blocks' scales. W stays in its file layout (the memory map), so a decoded token reads 4-8
 * bits per weight instead of 32.
 *
 * Formats (qformats.h): Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, and the low-bit Q2_K, Q3_K,
 * IQ4_XS, IQ4_NL. A row's result is ggml's vec_dot for the format, bit for bit on AVX2 (the
 * low-bit ones: the same integers, scaled per super-block as ggml does), whichever of the row
 * kernels (1, 2, 4 or 8 activation rows at once: qrows_0.c, qrows_k.c, qrows_lowbit.c; with
 * AVX-512 VNNI two rows a vector for 2 to 32 rows of five formats: qrows_pair*.c) computes it; many rows (prompts) take the panel kernel where the build has it for the format
 * (qpanel.c), whose sums are the same integers added in another order. Portable C elsewhere.
 *
 * Threads: the pool of cpu_pool.c. kernels/cpu_lib.py compiles the kernels for the machine they
 * run on; kernels/qmatmul.py calls this file, and its qmatmul_ref is the specification. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_kernels.h"
#include "cpu_pool.h"
#include "qmatmul_job.h"
#include "qpanel.h"
#include "qrows_pair.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KV_AVX2 1
#endif

static const qformat FORMATS[] = {
    {T_Q4_0, QK8, sizeof(block_q4_0), VDT_Q8_0, kvq_rows_q4_0},
    {T_Q4_1, QK8, sizeof(block_q4_1), VDT_Q8_1, kvq_rows_q4_1},
    {T_Q5_0, QK8, sizeof(block_q5_0), VDT_Q8_0, kvq_rows_q5_0},
    {T_Q8_0, QK8, sizeof(block_q8_0), VDT_Q8_0, kvq_rows_q8_0},
    {T_Q4_K, QK_K, sizeof(block_q4_K), VDT_Q8_K, kvq_rows_q4_K},
    {T_Q5_K, QK_K, sizeof(block_q5_K), VDT_Q8_K, kvq_rows_q5_K},
    {T_Q6_K, QK_K, sizeof(block_q6_K), VDT_Q8_K, kvq_rows_q6_K},
    {T_Q2_K, QK_K, sizeof(block_q2_K), VDT_Q8_K, kvq_rows_q2_K},
    {T_Q3_K, QK_K, sizeof(block_q3_K), VDT_Q8_K, kvq_rows_q3_K},
    {T_IQ4_XS, QK_K, sizeof(block_iq4_xs), VDT_Q8_K, kvq_rows_iq4_xs},
    {T_IQ4_NL, QK8, sizeof(block_iq4_nl), VDT_Q8_0, kvq_rows_iq4_nl},
};

const qformat *kvq_format(int type) {
    for (size_t i = 0; i < sizeof(FORMATS) / sizeof(FORMATS[0]); i++)
        if (FORMATS[i].type == type) return &FORMATS[i];
    return NULL;
}

int kvq_supported(int type) { return kvq_format(type) != NULL; }

/* The instruction set the block matmuls of this build use, for messages and tests. */
const char *kvq_simd(void) {
#if defined(PANEL_VNNI)
    return "avx512-vnni";
#elif defined(KV_AVX2)
    return "avx2";
#elif defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return "neon-dotprod";
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return "neon";
#else
    return "portable";
#endif
}

#define PREFETCH_ROWS 8 /* weight rows ahead that a pass asks memory for */

/* Weight rows [o0, o1) against every activation row, 8, 4, 2 or 1 activation rows a pass (the
 * pairs of rows in the pair kernel where J has them): a task of the pool. */
static void matmul_rows(void *ctx, int64_t o0, int64_t o1) {
    const job_t *J = ctx;
    const int64_t nb = J->k / J->f->blck;
    int64_t i0 = 0;
    if (J->pairs) {
        kvq_pair_rows(J, J->pairs, o0, o1);
        i0 = J->n / 2 * 2;
    }
    while (i0 < J->n) {
        const int64_t left = J->n - i0;
        const int kind = left >= 8 ? 3 : left >= 4 ? 2 : left >= 2 ? 1 : 0, R = 1 << kind;
        const rows_fn fn = J->f->rows[kind];
        const uint8_t *act[8];
        for (int r = 0; r < R; r++) act[r] = J->act + (i0 + r) * J->act_row;
        for (int64_t o = o0; o < o1; o++) {
            if (i0 == 0 && o + PREFETCH_ROWS < o1) { /* weights come from memory once per call */
                const uint8_t *ahead = job_row(J, o + PREFETCH_ROWS);
                for (int64_t b = 0; b < J->row_bytes; b += 64) __builtin_prefetch(ahead + b);
            }
            float out[8];
            fn(job_row(J, o), nb, act, out);
            for (int r = 0; r < R; r++) J->y[(i0 + r) * J->ldy + o] = out[r];
        }
        i0 += R;
    }
}

/* Quantizing the activation rows (RMS-normed first where norm_w is given): a task of the pool,
 * whose items are rows, or with pairs the units of two rows [2u, 2u + 2) that it then lays out as
 * pair u (the pool's chunks may be any size: a pair is never split between tasks). */
typedef struct {
    const float *x;
    int64_t ldx, k;
    const float *norm_w;
    float eps;
    int vdt;
    uint8_t *act;
    int64_t act_row;
    const job_t *J;
    uint8_t *pairs;
    int failed;
} quant_t;

static void quantize_rows(void *ctx, int64_t u0, int64_t u1) {
    quant_t *Q = ctx;
    const int64_t unit = Q->pairs ? 2 : 1, i0 = u0 * unit, i1 = u1 * unit < Q->J->n ? u1 * unit : Q->J->n;
    float *normed = Q->norm_w ? malloc(sizeof(float) * (size_t)Q->k) : NULL;
    if (Q->norm_w && !normed) {
        Q->failed = 1; /* only ever set: a benign race */
        return;
    }
    for (int64_t i = i0; i < i1; i++) {
        const float *xi = Q->x + i * Q->ldx;
        if (normed) {
            rms_norm_row(xi, Q->k, Q->norm_w, Q->eps, normed);
            xi = normed;
        }
        kvq_quantize_row(Q->vdt, xi, Q->act + i * Q->act_row, Q->k);
    }
    for (int64_t u = u0; Q->pairs && u < u1 && 2 * u + 1 < Q->J->n; u++) kvq_pair_prepare(Q->J, u, Q->pairs);
    free(normed);
}

/* y = x @ W.T for x [n, k] float32 (rows ldx apart) and W the `nseg` weights ws[s] of
 * seg_rows[s] rows each (GGUF blocks, `row_bytes` a row), stacked along n_out; y [n, n_out]
 * float32 (rows ldy apart). k must be a multiple of the format's block. Returns 0, or -1 for a
 * bad call. */
static int matmul(int type, const uint8_t *const *ws, const int64_t *seg_rows, int nseg, int64_t row_bytes,
                  int64_t k, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy, const float *norm_w,
                  float eps) {
    const qformat *f = kvq_format(type);
    if (!f || k % f->blck || n < 0 || nseg < 1 || nseg > MAX_SEGS || row_bytes != k / f->blck * f->type_size)
        return -1;
    job_t J = {.f = f, .row_bytes = row_bytes, .nseg = nseg, .k = k, .n = n, .y = y, .ldy = ldy};
    int64_t n_out = 0;
    for (int s = 0; s < nseg; s++) {
        if (seg_rows[s] < 0) return -1;
        J.w[s] = ws[s];
        n_out += seg_rows[s];
        J.seg_end[s] = n_out;
    }
    J.n_out = n_out;
    if (n == 0 || n_out == 0) return 0;
    J.act_row = kvq_act_row_bytes(f->vdt, k);
    const int panels = n >= PANEL_MIN_ROWS && kvq_panels(type);
    uint8_t *act = malloc((size_t)(n * J.act_row));
    const int paired = !panels && n >= 2 && kvq_pair_format(type);
    uint8_t *pairs = paired ? malloc((size_t)kvq_pair_bytes(type, n, k)) : NULL;
    if (!act || (paired && !pairs)) {
        free(act);
        free(pairs);
        return -1;
    }
    J.act = act;
    quant_t Q = {.x = x, .ldx = ldx, .k = k, .norm_w = norm_w, .eps = eps, .vdt = f->vdt, .act = act,
                 .act_row = J.act_row, .J = &J, .pairs = pairs};
    kv_parallel(quantize_rows, &Q, pairs ? (n + 1) / 2 : n, 1);
    int rc = Q.failed ? -1 : 0;
    J.pairs = pairs;
    if (rc == 0 && panels)
        rc = kvq_matmul_panels(&J);
    else if (rc == 0)
        kv_parallel(matmul_rows, &J, n_out, 4);
    free(pairs);
    free(act);
    return rc;
}

/* Threads (the caller included) that the kernels use; returns the number set. */
int kvq_set_threads(int n) { return kv_set_threads(n); }

/* The same call with the weight's description (cpu_kernels.h) made once: fewer arguments to
 * convert per call from Python, where a call costs microseconds. */
int kvq_matmul_w(const kvq_weight *w, const float *x, int64_t ldx, int64_t n, float *y) {
    return matmul(w->type, w->ws, w->seg_rows, w->nseg, w->row_bytes, w->k, x, ldx, n, y, w->n_out, NULL, 0.0f);
}

/* y = rms_norm(x) * norm_w @ W.T: the norm applied to each row on its way to quantization (in
 * the models a normed row feeds only the matmul after it). */
int kvq_matmul_norm(const kvq_weight *w, const float *x, int64_t ldx, int64_t n, float *y, const float *norm_w,
                    float eps) {
    return matmul(w->type, w->ws, w->seg_rows, w->nseg, w->row_bytes, w->k, x, ldx, n, y, w->n_out, norm_w, eps);
}

/* y = rms_norm(x) * norm_w @ W.T into rows `ldy` floats apart (a column block of a wider y). */
int kvq_matmul_ld(const kvq_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                  const float *norm_w, float eps) {
    if (ldy < w->n_out) return -1;
    return matmul(w->type, w->ws, w->seg_rows, w->nseg, w->row_bytes, w->k, x, ldx, n, y, ldy, norm_w, eps);
}

/* act(gate) * up over rows of [gate | up] (n_ff each), the hidden row overwriting the gate half:
 * items are the hidden elements, row by row. act is silu, or with `gelu` ggml's CPU GELU: the
 * gate rounded to a half and looked up in `gelu` (65536 floats, one per half's bits), except
 * gate <= -10 -> 0 and gate >= 10 -> gate. A task of the pool. */
typedef struct {
    float *g;
    int64_t n_ff;
    const float *gelu;
} glu_t;

static float gelu_lookup(const float *table, float x) {
    return x <= -10.0f ? 0.0f : x >= 10.0f ? x : table[float_to_half(x)];
}

/* ggml's SiLU, x / (1 + e^-x), as ggml_vec_swiglu_f32 computes it on this machine: its vector
 * e^x (an Arm optimized-routines polynomial; the AVX-512 and AVX2 forms round differently) for
 * the first n - n % SILU_W elements of a row, libm's expf for the rest. */
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define SILU_W 16
static inline void silu_mul_vec(const float *g, const float *u, float *out) {
    const __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(g)); /* e^-g */
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
    const __m512 n = _mm512_sub_ps(z, r);
    const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
    const __mmask16 d = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
    const __m512 v = _mm512_mul_ps(b, b);
    const __m512 j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), v,
                        _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
        v, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
    __m512 e = _mm512_scalef_ps(j, n);
    if (!_mm512_kortestz(d, d)) {
        const __m512 alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ),
                                                _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
        e = _mm512_mask_blend_ps(d, e, alt);
    }
    const __m512 silu = _mm512_div_ps(_mm512_loadu_ps(g), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(out, _mm512_mul_ps(silu, _mm512_loadu_ps(u)));
}
#elif defined(KV_AVX2)
#define SILU_W 8
static inline void silu_mul_vec(const float *g, const float *u, float *out) {
    const __m256 x = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(g)); /* e^-g */
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i ei = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(ei, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256 absn = _mm256_andnot_ps(_mm256_set1_ps(-0.f), n);
    const __m256 c = _mm256_cmp_ps(absn, _mm256_set1_ps(126), _CMP_GT_OQ);
    const __m256 v = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), v,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        v, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    __m256 e;
    if (!_mm256_movemask_ps(c)) {
        e = _mm256_fmadd_ps(j, k, k);
    } else {
        const __m256i gs = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                            _mm256_set1_epi32((int)0x82000000u));
        const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(gs, _mm256_set1_epi32(0x7f000000)));
        const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(ei, gs));
        const __m256 dd = _mm256_cmp_ps(absn, _mm256_set1_ps(192), _CMP_GT_OQ);
        e = _mm256_or_ps(_mm256_and_ps(dd, _mm256_mul_ps(s1, s1)),
                         _mm256_andnot_ps(dd, _mm256_or_ps(_mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                                           _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)))));
    }
    const __m256 silu = _mm256_div_ps(_mm256_loadu_ps(g), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(out, _mm256_mul_ps(silu, _mm256_loadu_ps(u)));
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define SILU_W 4
/* ggml's ggml_v_expf / ggml_v_silu for NEON, as its ARM build computes them. */
static inline void silu_mul_vec(const float *g, const float *u, float *out) {
    const float32x4_t x = vsubq_f32(vdupq_n_f32(0.0f), vld1q_f32(g)); /* e^-g */
    const float32x4_t r = vdupq_n_f32(0x1.8p23f);
    const float32x4_t z = vfmaq_f32(r, x, vdupq_n_f32(0x1.715476p+0f));
    const float32x4_t n = vsubq_f32(z, r);
    const float32x4_t b = vfmsq_f32(vfmsq_f32(x, n, vdupq_n_f32(0x1.62e4p-1f)), n, vdupq_n_f32(0x1.7f7d1cp-20f));
    const uint32x4_t e = vshlq_n_u32(vreinterpretq_u32_f32(z), 23);
    const float32x4_t k = vreinterpretq_f32_u32(vaddq_u32(e, vreinterpretq_u32_f32(vdupq_n_f32(1))));
    const uint32x4_t c = vcagtq_f32(n, vdupq_n_f32(126));
    const float32x4_t v = vmulq_f32(b, b);
    const float32x4_t j =
        vfmaq_f32(vmulq_f32(vdupq_n_f32(0x1.ffffecp-1f), b),
                  vfmaq_f32(vfmaq_f32(vdupq_n_f32(0x1.fffdb6p-2f), vdupq_n_f32(0x1.555e66p-3f), b),
                            vfmaq_f32(vdupq_n_f32(0x1.573e2ep-5f), vdupq_n_f32(0x1.0e4020p-7f), b), v),
                  v);
    float32x4_t ex;
    if (!vpaddd_u64(vreinterpretq_u64_u32(c))) {
        ex = vfmaq_f32(k, j, k);
    } else {
        const uint32x4_t d = vandq_u32(vclezq_f32(n), vdupq_n_u32(0x82000000));
        const float32x4_t s1 = vreinterpretq_f32_u32(vaddq_u32(d, vdupq_n_u32(0x7f000000)));
        const float32x4_t s2 = vreinterpretq_f32_u32(vsubq_u32(e, d));
        ex = vbslq_f32(vcagtq_f32(n, vdupq_n_f32(192)), vmulq_f32(s1, s1),
                       vbslq_f32(c, vmulq_f32(vfmaq_f32(s2, s2, j), s1), vfmaq_f32(k, k, j)));
    }
    const float32x4_t silu = vdivq_f32(vld1q_f32(g), vaddq_f32(vdupq_n_f32(1.0f), ex));
    vst1q_f32(out, vmulq_f32(silu, vld1q_f32(u)));
}
#else
#define SILU_W 1
static inline void silu_mul_vec(const float *g, const float *u, float *out) { *out = *g / (1.0f + expf(-*g)) * *u; }
#endif

/* gate[j] = silu(gate[j]) * up[j] for j in [j0, j1) of a row of n_ff. */
static void silu_mul(float *gate, const float *up, int64_t n_ff, int64_t j0, int64_t j1) {
    const int64_t vec_end = n_ff - n_ff % SILU_W, v1 = j1 < vec_end ? j1 : vec_end;
    int64_t j = j0;
    for (; j + SILU_W <= v1; j += SILU_W) silu_mul_vec(gate + j, up + j, gate + j);
    if (j < v1) { /* the vector formula for the last few of the vector part (lanes are independent) */
        float g[SILU_W] = {0}, u[SILU_W] = {0};
        memcpy(g, gate + j, sizeof(float) * (size_t)(v1 - j));
        memcpy(u, up + j, sizeof(float) * (size_t)(v1 - j));
        silu_mul_vec(g, u, g);
        memcpy(gate + j, g, sizeof(float) * (size_t)(v1 - j));
        j = v1;
    }
    for (; j < j1; j++) gate[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}

static void glu_items(void *ctx, int64_t e0, int64_t e1) {
    const glu_t *S = ctx;
    for (int64_t e = e0; e < e1;) {
        const int64_t i = e / S->n_ff, j0 = e % S->n_ff;
        const int64_t j1 = S->n_ff < j0 + (e1 - e) ? S->n_ff : j0 + (e1 - e);
        float *gi = S->g + i * 2 * S->n_ff;
        int64_t j = j0;
        if (S->gelu) {
#ifdef KV_AVX2
            const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
            for (; j + 8 <= j1; j += 8) {
                const __m256 g = _mm256_loadu_ps(gi + j), u = _mm256_loadu_ps(gi + S->n_ff + j);
                const __m256i h = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT));
                __m256 a = _mm256_i32gather_ps(S->gelu, h, 4);
                a = _mm256_blendv_ps(a, g, _mm256_cmp_ps(g, hi, _CMP_GE_OQ));
                a = _mm256_andnot_ps(_mm256_cmp_ps(g, lo, _CMP_LE_OQ), a);
                _mm256_storeu_ps(gi + j, _mm256_mul_ps(a, u));
            }
#endif
            for (; j < j1; j++) gi[j] = gelu_lookup(S->gelu, gi[j]) * gi[S->n_ff + j];
        } else {
            silu_mul(gi, gi + S->n_ff, S->n_ff, j0, j1);
        }
        e += j1 - j0;
    }
}

/* A gated feed-forward in one call: y = down(act(gate(x)) * up(x)), `gate_up` holding the gate
 * rows then the up rows (n_out 2 * n_ff), `down` taking n_ff columns; act is silu (SwiGLU), or
 * ggml's CPU GELU with the table `gelu` (glu_items); x is RMS-normed with norm_w first unless
 * norm_w is NULL. The hidden rows are quantized like any activation. */
int kvq_ffn_glu(const kvq_weight *gate_up, const kvq_weight *down, const float *x, int64_t ldx, int64_t n,
                float *y, const float *norm_w, float eps, const float *gelu) {
    const int64_t n_ff = gate_up->n_out / 2;
    if (gate_up->n_out % 2 || down->k != n_ff) return -1;
    float *g = malloc(sizeof(float) * (size_t)(n * gate_up->n_out));
    if (!g) return -1;
    int rc = kvq_matmul_norm(gate_up, x, ldx, n, g, norm_w, eps);
    if (rc == 0) {
        glu_t S = {g, n_ff, gelu};
        kv_parallel(glu_items, &S, n * n_ff, 8192); /* a row or two: not worth waking a thread */
        rc = kvq_matmul_w(down, g, gate_up->n_out, n, y);
    }
    free(g);
    return rc;
}
