/* Llama decoder layers for a small ubatch (decode) in one call: per layer the RMS norm and the
 * stacked Q/K/V matmul (qmatmul.c), RoPE and the K/V store into the layer's cache
 * (rope_store_cpu.c), attention per stream over the cache (attention_cpu.c), the output
 * projection added to the residual row, then the normed SwiGLU feed-forward added too.
 *
 * The same kernels in the same order as kvtool/models/llama.py calls them one by one, so the
 * result has the same bits; at one token the calls between kernels cost more from Python than
 * the kernels themselves, and here there are none. kernels/decoder_cpu.py builds the structs. */

#include <stdint.h>
#include <stdlib.h>

#include "cpu_kernels.h"

/* One layer's weights and shape. */
typedef struct {
    const kvq_weight *wqkv, *wo, *gate_up, *down; /* wqkv: Q rows, then K, then V */
    const float *attn_norm, *ffn_norm;            /* [n_embd] */
    float eps, scale;                             /* RMS norm epsilon, attention scale */
    int64_t n_head, n_head_kv, hd_k, hd_v, n_rot;
    int neox;
} kvl_layer;

/* One layer's cache: K [n_stream, n_cells, n_head_kv, hd_k] at element strides (s, c, h) with a
 * contiguous last dimension, V likewise; the cache row of (stream s, cell c) is s * n_cells + c,
 * `sk_c` elements apart (K) and `sv_c` (V). */
typedef struct {
    void *k, *v;
    int64_t sk_s, sk_c, sk_h, sv_s, sv_c, sv_h;
    int64_t n_cells;
    int type; /* 0 f32, 1 f16, 2 bf16 */
} kvl_cache;

/* The ubatch every layer shares: n rows in n_stream blocks of n / n_stream rows, block b in
 * stream stream0 + b; rows[i] the cache row of row i; cs [n, n_rot / 2, 2] (cos, sin), rows
 * `ldcs` floats apart; mask [n_stream, n / n_stream, n_kv] additive (0 / -inf) at strides
 * (sm_s, sm_i). */
typedef struct {
    int64_t n, n_stream, stream0, n_kv;
    const int64_t *rows;
    const float *cs;
    int64_t ldcs;
    const float *mask;
    int64_t sm_s, sm_i;
} kvl_ubatch;

static int layer(const kvl_layer *L, const kvl_cache *C, const kvl_ubatch *U, float *x, int64_t ldx, float *qkv,
                 float *att, float *y) {
    const int64_t n = U->n, per = U->n / U->n_stream, n_embd = L->wo->n_out;
    const int64_t wq = L->n_head * L->hd_k, wk = L->n_head_kv * L->hd_k, ldqkv = L->wqkv->n_out;
    const int es = C->type == 0 ? 4 : 2;
    int rc = kvq_matmul_norm(L->wqkv, x, ldx, n, qkv, L->attn_norm, L->eps);
    if (rc) return rc;
    rc = kvr_rope_store(qkv, ldqkv, L->n_head, qkv + wq, ldqkv, L->n_head_kv, L->hd_k, qkv + wq + wk, ldqkv,
                        L->n_head_kv * L->hd_v, n, U->cs, U->ldcs, L->n_rot, L->neox, C->k, C->sk_c, C->v,
                        C->sv_c, C->type, U->rows);
    if (rc) return rc;
    const uint8_t *k0 = (const uint8_t *)C->k + U->stream0 * C->sk_s * es;
    const uint8_t *v0 = (const uint8_t *)C->v + U->stream0 * C->sv_s * es;
    rc = kva_attention(qkv, per * ldqkv, ldqkv, L->hd_k, k0, C->sk_s, C->sk_c, C->sk_h, v0, C->sv_s, C->sv_c,
                       C->sv_h, C->type, U->mask, U->sm_s, U->sm_i, att, U->n_stream, per, L->n_head, L->n_head_kv,
                       U->n_kv, L->hd_k, L->hd_v, L->scale);
    if (rc) return rc;
    rc = kvq_matmul_w(L->wo, att, L->n_head * L->hd_v, n, y);
    if (rc) return rc;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n_embd; j++) x[i * ldx + j] += y[i * n_embd + j];
    rc = kvq_ffn_swiglu(L->gate_up, L->down, x, ldx, n, y, L->ffn_norm, L->eps);
    if (rc) return rc;
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n_embd; j++) x[i * ldx + j] += y[i * n_embd + j];
    return 0;
}

/* x [n, n_embd] (rows ldx floats apart) through layers L[0 .. n_layer - 1] with caches C[...],
 * in place. Returns 0, or -1 for a bad call (shapes that do not chain, no memory). */
int kvl_llama_layers(const kvl_layer *L, const kvl_cache *C, int64_t n_layer, const kvl_ubatch *U, float *x,
                     int64_t ldx) {
    if (n_layer < 0 || U->n < 0 || U->n_stream < 1 || U->n % U->n_stream) return -1;
    int64_t w_qkv = 0, w_att = 0, w_y = 0;
    for (int64_t il = 0; il < n_layer; il++) {
        const kvl_layer *l = L + il;
        const int64_t n_embd = l->wo->n_out;
        const int64_t wq = l->n_head * l->hd_k, wk = l->n_head_kv * l->hd_k, wv = l->n_head_kv * l->hd_v;
        if (l->wqkv->k != n_embd || l->wqkv->n_out != wq + wk + wv || l->wo->k != l->n_head * l->hd_v ||
            l->gate_up->k != n_embd || l->down->n_out != n_embd || n_embd > ldx)
            return -1;
        if (l->wqkv->n_out > w_qkv) w_qkv = l->wqkv->n_out;
        if (l->wo->k > w_att) w_att = l->wo->k;
        if (n_embd > w_y) w_y = n_embd;
    }
    float *buf = malloc(sizeof(float) * (size_t)(U->n * (w_qkv + w_att + w_y) + 1));
    if (!buf) return -1;
    int rc = 0;
    for (int64_t il = 0; il < n_layer && rc == 0; il++)
        rc = layer(L + il, C + il, U, x, ldx, buf, buf + U->n * w_qkv, buf + U->n * (w_qkv + w_att));
    free(buf);
    return rc;
}
