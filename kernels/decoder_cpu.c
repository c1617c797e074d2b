/* Decoder layers for a small ubatch (decode) in one call, the llama family's and the Gemma
 * family's: per layer the RMS norm (unless the layer has none: olmo2) and the Q/K/V matmul
 * (qmatmul.c) with its bias (qwen2), the RMS norm of each Q and K head (Gemma 3, qwen3) or of the
 * whole of Q and K (olmo2), RoPE (Gemma: then Q scaled) and the K/V store into the layer's cache
 * (rope_store_cpu.c), attention per stream over the cache (attention_cpu.c; Gemma 2 soft-caps the
 * scores), the output projection (Gemma, olmo2: RMS-normed; granite: scaled) added to the residual
 * row, then the gated feed-forward (SwiGLU, or Gemma's GELU) added too (normed and scaled alike).
 *
 * These are the kernels in the order the op-by-op forwards (kvtool/models/llama.py, gemma3.py)
 * call them one by one, with ggml's norms and llama.cpp's order of scalings, so the result has
 * the same bits. At one token the calls between kernels cost more from Python than the kernels
 * themselves; here there are none. kernels/decoder_cpu.py builds the structs. */

#include <stdint.h>
#include <stdlib.h>

#include "cpu_half.h"
#include "cpu_kernels.h"
#include "kv_blocks.h"

/* One layer's weights and shape. */
typedef struct {
    const kvq_weight *wqkv, *wk, *wv; /* wqkv: Q rows, then K, then V; with wk and wv: Q alone */
    const kvq_weight *wo, *gate_up, *down;
    const float *attn_norm, *ffn_norm;                /* [n_embd] */
    const float *q_norm, *k_norm;                     /* [hd_k]: each Q and K head RMS-normed first, or NULL */
    const float *attn_post_norm, *ffn_post_norm;      /* [n_embd]: a sublayer's output normed, or NULL */
    const float *gelu;                                /* GELU table (kvq_ffn_glu), or NULL: SwiGLU */
    float eps, scale;                                 /* RMS norm epsilon, attention scale */
    int64_t n_head, n_head_kv, hd_k, hd_v, n_rot;
    int neox, ub; /* ub: which of the ubatch's views the layer attends with */
    const float *qkv_bias; /* [Q|K|V width] added after the projection (qwen2), or NULL */
    float res_scale;       /* each block's output times it before its residual add (granite); 0: not */
    float softcap;         /* attention scores soft-capped (Gemma 2); 0: not */
    int qk_norm_all;       /* q_norm / k_norm over a row's whole Q and K (olmo2), not per head */
    float q_scale;         /* Q times it after RoPE, before attention (Gemma's ggml_scale of Qcur); 1: not */
} kvl_layer;
/* One layer's cache: K [n_stream, n_cells, n_head_kv, hd_k] (a quantized type: a head's blocks
 * as bytes) at element strides (s, c, h) with a contiguous last dimension, V likewise; the cache
 * row of (stream s, cell c) is s * n_cells + c, `sk_c` elements apart (K) and `sv_c` (V). */
typedef struct {
    void *k, *v;
    int64_t sk_s, sk_c, sk_h, sv_s, sv_c, sv_h;
    int64_t n_cells;
    int type_k, type_v; /* kv_blocks.h's ids */
    int64_t rot_k, rot_v; /* llama.cpp's Hadamard rotations (kvr_rope_store), 0: none */
} kvl_cache;

/* A view of the ubatch the layers share (one per kind of cache: Gemma's sliding-window layers
 * have their own cells and rotation): n rows in n_stream blocks of n / n_stream rows, block b in
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

/* Each of `heads` heads of hd floats in each of n rows (ld floats apart) RMS-normed in place. */
static void norm_heads(float *x, int64_t ld, int64_t n, int64_t heads, int64_t hd, const float *w, float eps) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < heads; h++) rms_norm_row(x + i * ld + h * hd, hd, w, eps, x + i * ld + h * hd);
}

/* x += y (normed with w first unless w is NULL, then times scale unless it is 0), row by row; y
 * is overwritten. */
static void residual(float *x, int64_t ldx, float *y, int64_t n, int64_t n_embd, const float *w, float eps,
                     float scale) {
    for (int64_t i = 0; i < n; i++) {
        float *yi = y + i * n_embd;
        if (w) rms_norm_row(yi, n_embd, w, eps, yi);
        if (scale != 0.0f)
            for (int64_t j = 0; j < n_embd; j++) yi[j] *= scale;
        for (int64_t j = 0; j < n_embd; j++) x[i * ldx + j] += yi[j];
    }
}

static int layer(const kvl_layer *L, const kvl_cache *C, const kvl_ubatch *U, float *x, int64_t ldx, float *qkv,
                 float *att, float *y) {
    const int64_t n = U->n, per = U->n / U->n_stream, n_embd = L->wo->n_out;
    const int64_t wq = L->n_head * L->hd_k, wk = L->n_head_kv * L->hd_k, wv = L->n_head_kv * L->hd_v;
    const int64_t ldqkv = wq + wk + wv;
    const int ek = C->type_k == KV_F32 ? 4 : kv_quantized(C->type_k) ? 1 : 2;
    const int ev = C->type_v == KV_F32 ? 4 : kv_quantized(C->type_v) ? 1 : 2;
    /* Q|K|V stacked, or Q, K and V apart (each call norms x on its way in: 3 norms of one row) */
    int rc = kvq_matmul_ld(L->wqkv, x, ldx, n, qkv, ldqkv, L->attn_norm, L->eps);
    if (rc == 0 && L->wk) rc = kvq_matmul_ld(L->wk, x, ldx, n, qkv + wq, ldqkv, L->attn_norm, L->eps);
    if (rc == 0 && L->wk) rc = kvq_matmul_ld(L->wv, x, ldx, n, qkv + wq + wk, ldqkv, L->attn_norm, L->eps);
    if (rc) return rc;
    if (L->qkv_bias)
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < ldqkv; j++) qkv[i * ldqkv + j] += L->qkv_bias[j];
    const int all = L->qk_norm_all;
    if (L->q_norm) norm_heads(qkv, ldqkv, n, all ? 1 : L->n_head, all ? wq : L->hd_k, L->q_norm, L->eps);
    if (L->k_norm) norm_heads(qkv + wq, ldqkv, n, all ? 1 : L->n_head_kv, all ? wk : L->hd_k, L->k_norm, L->eps);
    rc = kvr_rope_store(qkv, ldqkv, L->n_head, qkv + wq, ldqkv, L->n_head_kv, L->hd_k, qkv + wq + wk, ldqkv, wv, n,
                        U->cs, U->ldcs, L->n_rot, L->neox, L->q_scale, C->k, C->sk_c, C->v, C->sv_c, C->type_k,
                        C->type_v, C->rot_k, C->rot_v, U->rows);
    if (rc) return rc;
    const uint8_t *k0 = (const uint8_t *)C->k + U->stream0 * C->sk_s * ek;
    const uint8_t *v0 = (const uint8_t *)C->v + U->stream0 * C->sv_s * ev;
    rc = kva_attention(qkv, per * ldqkv, ldqkv, L->hd_k, k0, C->sk_s, C->sk_c, C->sk_h, v0, C->sv_s, C->sv_c,
                       C->sv_h, C->type_k, C->type_v, U->mask, U->sm_s, U->sm_i, att, U->n_stream, per, L->n_head,
                       L->n_head_kv, U->n_kv, L->hd_k, L->hd_v, L->scale, L->softcap);
    if (rc) return rc;
    if (C->rot_v) kvb_fwht(att, n * L->n_head * L->hd_v, C->rot_v); /* the output rotated back */
    rc = kvq_matmul_w(L->wo, att, L->n_head * L->hd_v, n, y);
    if (rc) return rc;
    residual(x, ldx, y, n, n_embd, L->attn_post_norm, L->eps, L->res_scale);
    rc = kvq_ffn_glu(L->gate_up, L->down, x, ldx, n, y, L->ffn_norm, L->eps, L->gelu);
    if (rc) return rc;
    residual(x, ldx, y, n, n_embd, L->ffn_post_norm, L->eps, L->res_scale);
    return 0;
}

/* x [n, n_embd] (rows ldx floats apart) through layers L[0 .. n_layer - 1] with caches C[...],
 * in place, layer il attending with the ubatch view U[L[il].ub] of n_ub (all of n rows). Returns
 * 0, or -1 for a bad call (shapes that do not chain, a view that is not there, no memory). */
int kvl_layers(const kvl_layer *L, const kvl_cache *C, int64_t n_layer, const kvl_ubatch *U, int64_t n_ub,
               float *x, int64_t ldx) {
    if (n_layer < 0 || n_ub < 1) return -1;
    const int64_t n = U[0].n;
    for (int64_t u = 0; u < n_ub; u++)
        if (U[u].n != n || U[u].n < 0 || U[u].n_stream < 1 || U[u].n % U[u].n_stream) return -1;
    int64_t w_qkv = 0, w_att = 0, w_y = 0;
    for (int64_t il = 0; il < n_layer; il++) {
        const kvl_layer *l = L + il;
        const int64_t n_embd = l->wo->n_out;
        const int64_t wq = l->n_head * l->hd_k, wk = l->n_head_kv * l->hd_k, wv = l->n_head_kv * l->hd_v;
        const int split = l->wk != NULL;
        if (split && (!l->wv || l->wk->k != n_embd || l->wv->k != n_embd || l->wk->n_out != wk || l->wv->n_out != wv))
            return -1;
        if (l->ub < 0 || l->ub >= n_ub || l->wqkv->k != n_embd || l->wqkv->n_out != (split ? wq : wq + wk + wv) ||
            l->wo->k != l->n_head * l->hd_v || l->gate_up->k != n_embd || l->down->n_out != n_embd || n_embd > ldx)
            return -1;
        if (wq + wk + wv > w_qkv) w_qkv = wq + wk + wv;
        if (l->wo->k > w_att) w_att = l->wo->k;
        if (n_embd > w_y) w_y = n_embd;
    }
    float *buf = malloc(sizeof(float) * (size_t)(n * (w_qkv + w_att + w_y) + 1));
    if (!buf) return -1;
    int rc = 0;
    for (int64_t il = 0; il < n_layer && rc == 0; il++)
        rc = layer(L + il, C + il, U + L[il].ub, x, ldx, buf, buf + n * w_qkv, buf + n * (w_qkv + w_att));
    free(buf);
    return rc;
}
