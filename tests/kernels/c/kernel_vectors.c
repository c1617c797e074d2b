/* Every compiled CPU kernel on fixed pseudo-random inputs, its outputs printed as the bits of
 * each value: tests/kernels/test_kernels_aarch64.py builds this with the portable C code for the
 * host (the reference) and for aarch64 (NEON, with and without the dot product instruction), runs
 * the latter under qemu-user and compares the lines.
 *
 * Output: a first line "isa <kvq_simd()>", then one line per case:
 * "<case> <hex words>" (float bits, or raw bytes for quantized activations). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_half.h"
#include "cpu_kernels.h"
#include "kv_blocks.h"
#include "qformats.h"
#include "qmatmul_job.h"
#include "qrows.h"

int kvq_set_threads(int n);
const char *kvq_simd(void);

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint32_t next32(void) { /* xorshift64* */
    rng ^= rng >> 12, rng ^= rng << 25, rng ^= rng >> 27;
    return (uint32_t)((rng * 0x2545F4914F6CDD1Dull) >> 32);
}

static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next32() >> 8) / 16777216.0f; }

static void fill_floats(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = scale * uniform(-1.0f, 1.0f);
}

static void print_floats(const char *name, const float *x, int64_t n) {
    printf("%s", name);
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        printf(" %08x", u);
    }
    printf("\n");
}

static void print_bytes(const char *name, const uint8_t *p, int64_t n) {
    printf("%s ", name);
    for (int64_t i = 0; i < n; i++) printf("%02x", p[i]);
    printf("\n");
}

/* A weight of `rows` rows of k elements in format f: random bytes, with every half scale a
 * small random value (a random half could be an infinity or a NaN). */
static uint8_t *random_weight(const qformat *f, int64_t rows, int64_t k) {
    const int64_t nb = rows * (k / f->blck);
    uint8_t *w = malloc((size_t)(nb * f->type_size));
    for (int64_t i = 0; i < nb * f->type_size; i++) w[i] = (uint8_t)next32();
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * f->type_size;
        /* d; Q4_1's m and the K-quants' dmin follow */
        const int off = f->type == T_Q6_K ? 208 : f->type == T_Q2_K ? 80 : f->type == T_Q3_K ? 108 : 0;
        const int halves = f->type == T_Q4_1 || f->type == T_Q4_K || f->type == T_Q5_K || f->type == T_Q2_K ? 2 : 1;
        for (int h = 0; h < halves; h++) {
            const uint16_t v = float_to_half(uniform(0.0005f, 0.02f));
            memcpy(blk + off + 2 * h, &v, 2);
        }
    }
    return w;
}

static const int TYPES[] = {T_Q4_0, T_Q4_1, T_Q5_0, T_Q8_0, T_Q4_K, T_Q5_K, T_Q6_K, T_Q2_K, T_Q3_K, T_IQ4_XS, T_IQ4_NL};
static const char *TYPE_NAMES[] = {"q4_0", "q4_1", "q5_0", "q8_0", "q4_K", "q5_K", "q6_K", "q2_K", "q3_K", "iq4_xs", "iq4_nl"};

static void quantized_activations(void) {
    enum { K = 512 };
    float x[2 * K];
    fill_floats(x, 2 * K, 3.0f);
    memset(x + K, 0, sizeof(float) * QK_K); /* an all-zero super-block */
    static const int vdts[] = {VDT_Q8_0, VDT_Q8_1, VDT_Q8_K};
    static const char *names[] = {"act_q8_0", "act_q8_1", "act_q8_K"};
    for (int v = 0; v < 3; v++) {
        uint8_t buf[2 * K * 2];
        const int64_t bytes = kvq_act_row_bytes(vdts[v], K);
        for (int r = 0; r < 2; r++) kvq_quantize_row(vdts[v], x + r * K, buf + r * bytes, K);
        print_bytes(names[v], buf, 2 * bytes);
    }
}

/* Activation rows at the edges: a NaN, infinities, a block whose 127 / max|x| overflows, exact
 * ties of the rounding, an all -0 block; each vec_dot type. One infinity a block: with two, Q8_1's
 * d * sum is inf * 0, a NaN whose sign the CPU picks (x86 sets it, ARM does not). */
static void edge_activations(void) {
    enum { K = 512 };
    float x[K];
    fill_floats(x, K, 3.0f);
    x[5] = NAN;
    x[40] = INFINITY, x[200] = -INFINITY;
    for (int j = 64; j < 96; j++) x[j] = 1e-39f * uniform(-1.0f, 1.0f);
    static const float ties[] = {127.0f, 2.5f, -3.5f, 0.5f, -0.5f, 1.5f, -126.5f, 0.49999997f};
    for (int j = 96; j < 128; j++) x[j] = ties[j % 8];
    for (int j = 128; j < 160; j++) x[j] = -0.0f;
    x[300] = INFINITY;
    static const int vdts[] = {VDT_Q8_0, VDT_Q8_1, VDT_Q8_K};
    static const char *names[] = {"act_edges_q8_0", "act_edges_q8_1", "act_edges_q8_K"};
    for (int v = 0; v < 3; v++) {
        uint8_t buf[2 * K];
        kvq_quantize_row(vdts[v], x, buf, K);
        print_bytes(names[v], buf, kvq_act_row_bytes(vdts[v], K));
    }
}

/* The half conversions (cpu_half.h) at their edges: NaNs with payloads, infinities, subnormals,
 * ties, the overflow boundary; and every half back to a float (signalling NaNs included). */
static void halves(void) {
    static const uint32_t bits[] = {0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA5A5A5, 0xFFFFFFFF, 0x7F800000, 0xFF800000,
                                    0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001, 0x337FFFFF, 0x38800000, 0x387FC000,
                                    0x387FE000, 0x3F801000, 0x3F803000, 0x80000000, 0x00000001, 0xC7800000};
    enum { N = sizeof(bits) / sizeof(bits[0]) };
    uint16_t h[N];
    for (int i = 0; i < N; i++) {
        float f;
        memcpy(&f, &bits[i], 4);
        h[i] = float_to_half(f);
    }
    print_bytes("half_from_float", (const uint8_t *)h, sizeof(h));
    static float all[65536];
    for (int i = 0; i < 65536; i++) all[i] = half_to_float((uint16_t)i);
    print_floats("half_to_float", all, 65536);
}

static void matmuls(void) {
    enum { K = 512, NOUT = 21, MAXN = 40 };
    static const int ns[] = {1, 2, 3, 5, 8, 11, 33, 40}; /* row kernels of 1-8 rows, then panels */
    float *x = malloc(sizeof(float) * MAXN * K), *y = malloc(sizeof(float) * MAXN * NOUT * 2);
    float norm_w[K];
    fill_floats(x, MAXN * K, 2.0f);
    fill_floats(norm_w, K, 1.5f);
    for (size_t t = 0; t < sizeof(TYPES) / sizeof(TYPES[0]); t++) {
        const qformat *f = kvq_format(TYPES[t]);
        const int64_t row_bytes = K / f->blck * f->type_size;
        uint8_t *w0 = random_weight(f, 13, K), *w1 = random_weight(f, NOUT - 13, K);
        const uint8_t *ws[2] = {w0, w1};
        const int64_t seg_rows[2] = {13, NOUT - 13};
        const kvq_weight W = {TYPES[t], 2, ws, seg_rows, row_bytes, K, NOUT};
        char name[64];
        for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
            if (kvq_matmul_w(&W, x, K, ns[i], y) != 0) printf("bad matmul %s %d\n", TYPE_NAMES[t], ns[i]);
            snprintf(name, sizeof(name), "matmul_%s_n%d", TYPE_NAMES[t], ns[i]);
            print_floats(name, y, ns[i] * NOUT);
        }
        if (kvq_matmul_norm(&W, x, K, 3, y, norm_w, 1e-6f) != 0) printf("bad matmul_norm\n");
        snprintf(name, sizeof(name), "matmul_norm_%s", TYPE_NAMES[t]);
        print_floats(name, y, 3 * NOUT);
        if (kvq_matmul_ld(&W, x, K, 40, y, 2 * NOUT, norm_w, 1e-6f) != 0) printf("bad matmul_ld\n");
        snprintf(name, sizeof(name), "matmul_ld_%s", TYPE_NAMES[t]);
        for (int r = 0; r < 40; r++) memset(y + r * 2 * NOUT + NOUT, 0, sizeof(float) * NOUT);
        print_floats(name, y, 40 * 2 * NOUT);
        free(w0), free(w1);
    }
    free(x), free(y);
}

static void ffns(void) {
    enum { K = 256, NFF = 512, N = 5 };
    const qformat *f = kvq_format(T_Q4_K);
    uint8_t *gu = random_weight(f, 2 * NFF, K), *dn = random_weight(f, K, NFF);
    const uint8_t *gws[1] = {gu}, *dws[1] = {dn};
    const int64_t grows[1] = {2 * NFF}, drows[1] = {K};
    const kvq_weight G = {T_Q4_K, 1, gws, grows, K / QK_K * f->type_size, K, 2 * NFF};
    const kvq_weight D = {T_Q4_K, 1, dws, drows, NFF / QK_K * f->type_size, NFF, K};
    float *gelu = malloc(sizeof(float) * 65536);
    for (int h = 0; h < 65536; h++) {
        const float v = half_to_float((uint16_t)h);
        gelu[h] = isfinite(v) ? 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v))) : 0.0f;
    }
    float x[N * K], y[N * K], norm_w[K];
    fill_floats(x, N * K, 2.0f);
    fill_floats(norm_w, K, 1.5f);
    if (kvq_ffn_glu(&G, &D, x, K, N, y, norm_w, 1e-6f, NULL) != 0) printf("bad ffn\n");
    print_floats("ffn_silu", y, N * K);
    if (kvq_ffn_glu(&G, &D, x, K, N, y, NULL, 0.0f, gelu) != 0) printf("bad ffn\n");
    print_floats("ffn_gelu", y, N * K);
    free(gu), free(dn), free(gelu);
}

static const char *KV_NAMES[KV_NTYPES] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"};

static void rope_stores(void) {
    enum { N = 3, NH = 4, NHKV = 2, HD = 64, ROWS = 8 };
    for (int neox = 0; neox < 2; neox++)
        for (int type = 0; type < KV_NTYPES; type++) {
            float q[N * NH * HD], k[N * NHKV * HD], v[N * NHKV * HD], cs[N * HD];
            fill_floats(q, N * NH * HD, 4.0f);
            fill_floats(k, N * NHKV * HD, 4.0f);
            fill_floats(v, N * NHKV * HD, 4.0f);
            for (int r = 0; r < N; r++)
                for (int i = 0; i < HD / 2 - 4; i++) { /* n_rot = HD - 8: the last dims pass through */
                    const float a = (float)(r + 7) * powf(10000.0f, -2.0f * (float)i / (float)HD);
                    cs[r * HD + 2 * i] = cosf(a), cs[r * HD + 2 * i + 1] = sinf(a);
                }
            uint8_t kc[ROWS * NHKV * HD * 4] = {0}, vc[ROWS * NHKV * HD * 4] = {0};
            const int64_t rows[N] = {5, 0, 3};
            /* a quantized cache with llama.cpp's Hadamard rotation in the neox cases, Q scaled (Gemma) there */
            const int64_t rot = kv_quantized(type) && neox ? 32 : 0;
            const int64_t ld = kv_quantized(type) ? kv_row_bytes(type, NHKV * HD) : NHKV * HD; /* elements */
            if (kvr_rope_store(q, NH * HD, NH, k, NHKV * HD, NHKV, HD, v, NHKV * HD, NHKV * HD, N, cs, HD, HD - 8, neox,
                               neox ? 0.17677669f : 1.0f, kc, ld, vc, ld, type, type, rot, rot, rows) != 0)
                printf("bad rope_store\n");
            char name[64];
            snprintf(name, sizeof(name), "rope_q_%s_neox%d", KV_NAMES[type], neox);
            print_floats(name, q, N * NH * HD);
            snprintf(name, sizeof(name), "store_k_%s_neox%d", KV_NAMES[type], neox);
            print_bytes(name, kc, ROWS * kv_row_bytes(type, NHKV * HD));
            snprintf(name, sizeof(name), "store_v_%s_neox%d", KV_NAMES[type], neox);
            print_bytes(name, vc, ROWS * kv_row_bytes(type, NHKV * HD));
        }
}

/* float -> the cache type's bits, row by row of n_row values (f16, bf16 by truncation: any bits
 * will do as inputs; a quantized type: its blocks). */
static void to_cache(const float *x, int64_t n, int64_t n_row, int type, uint8_t *out) {
    if (kv_quantized(type)) {
        for (int64_t r = 0; r < n / n_row; r++)
            kvb_quantize_row(type, x + r * n_row, n_row, out + r * kv_row_bytes(type, n_row));
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        if (type == 0) memcpy(out + 4 * i, &x[i], 4);
        else {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            const uint16_t h = type == 1 ? float_to_half(x[i]) : (uint16_t)(u >> 16);
            memcpy(out + 2 * i, &h, 2);
        }
    }
}

/* One attention case: K of k_type, V of v_type, heads of D (a quantized type: a multiple of 32). */
static void attention(const char *name, int k_type, int v_type, int64_t D, float softcap, int nq) {
    enum { S = 2, H = 4, HKV = 2, NKV = 45 };
    const int64_t nk = S * NKV * HKV * D, nqv = S * nq * H * D;
    float *q = malloc(sizeof(float) * (size_t)nqv), *kf = malloc(sizeof(float) * (size_t)nk);
    float *vf = malloc(sizeof(float) * (size_t)nk), *out = malloc(sizeof(float) * (size_t)nqv);
    float mask[S * 3 * NKV];
    uint8_t *k = malloc(sizeof(float) * (size_t)nk), *v = malloc(sizeof(float) * (size_t)nk);
    fill_floats(q, nqv, 1.0f);
    fill_floats(kf, nk, 1.0f);
    fill_floats(vf, nk, 1.0f);
    to_cache(kf, nk, D, k_type, k);
    to_cache(vf, nk, D, v_type, v);
    /* strides in elements of each tensor (a quantized one: bytes) */
    const int64_t kh = kv_quantized(k_type) ? kv_row_bytes(k_type, D) : D;
    const int64_t vh = kv_quantized(v_type) ? kv_row_bytes(v_type, D) : D;
    for (int s = 0; s < S; s++)
        for (int i = 0; i < nq; i++)
            for (int c = 0; c < NKV; c++) /* causal, a hole, and stream 1's last row seeing nothing */
                mask[(s * nq + i) * NKV + c] =
                    (c > NKV - nq + i || c == 7 || (s == 1 && i == nq - 1 && nq > 1)) ? -INFINITY : 0.0f;
    if (kva_attention(q, nq * H * D, H * D, D, k, NKV * HKV * kh, HKV * kh, kh, v, NKV * HKV * vh, HKV * vh, vh,
                      k_type, v_type, mask, nq * NKV, NKV, out, S, nq, H, HKV, NKV, D, D, 0.125f, softcap) != 0)
        printf("bad attention\n");
    print_floats(name, out, nqv);
    free(q), free(kf), free(vf), free(out), free(k), free(v);
}

/* Float caches (the NEON code: "attention_" cases, compared within a tolerance), and quantized
 * ones: over a quantized K and V the same scalar code on every build, ggml's online softmax
 * ("online_attention_" cases, bit for bit). */
static void attentions(void) {
    static const int nqs[] = {1, 3};
    static const int pairs[][2] = {{KV_Q8_0, KV_Q8_0}, {KV_Q4_0, KV_Q4_0}, {KV_Q4_1, KV_Q5_1}, {KV_Q5_0, KV_IQ4_NL}};
    char name[80];
    for (int qi = 0; qi < 2; qi++) {
        const int nq = nqs[qi];
        for (int type = 0; type < 3; type++) {
            snprintf(name, sizeof(name), "attention_%s_nq%d", KV_NAMES[type], nq);
            attention(name, type, type, 72, 0.0f, nq);
        }
        snprintf(name, sizeof(name), "attention_f16_softcap_nq%d", nq);
        attention(name, KV_F16, KV_F16, 72, 2.0f, nq);
        snprintf(name, sizeof(name), "attention_q8_0_f16_nq%d", nq);
        attention(name, KV_Q8_0, KV_F16, 64, 0.0f, nq);
        for (int p = 0; p < 4; p++) {
            const int kt = pairs[p][0], vt = pairs[p][1];
            snprintf(name, sizeof(name), "online_attention_%s_%s_nq%d", KV_NAMES[kt], KV_NAMES[vt], nq);
            attention(name, kt, vt, 64, 0.0f, nq);
        }
        /* the C library's tanhf differs in last bits between x86-64 and aarch64: a tolerance */
        snprintf(name, sizeof(name), "attention_q8_0_q8_0_softcap_nq%d", nq);
        attention(name, KV_Q8_0, KV_Q8_0, 64, 2.0f, nq);
    }
}

int main(void) {
    printf("isa %s\n", kvq_simd());
    kvq_set_threads(2);
    quantized_activations();
    edge_activations();
    halves();
    matmuls();
    ffns();
    rope_stores();
    attentions();
    return 0;
}
