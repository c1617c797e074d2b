/* The entry points of the compiled CPU kernels that other kernel files call (decoder_cpu.c
 * chains them into one call per decoder layer); each is documented where it is defined. */
#ifndef KVTOOL_CPU_KERNELS_H
#define KVTOOL_CPU_KERNELS_H

#include <stdint.h>

/* A weight (or several stacked along n_out) as qmatmul.c reads it: `nseg` GGUF weights ws[s]
 * of seg_rows[s] rows each, `row_bytes` a row, `k` inputs, `n_out` outputs in all. */
typedef struct {
    int type, nseg;
    const uint8_t *const *ws;
    const int64_t *seg_rows;
    int64_t row_bytes, k, n_out;
} kvq_weight;

int kvq_matmul_w(const kvq_weight *w, const float *x, int64_t ldx, int64_t n, float *y);
int kvq_matmul_norm(const kvq_weight *w, const float *x, int64_t ldx, int64_t n, float *y, const float *norm_w,
                    float eps);
int kvq_matmul_ld(const kvq_weight *w, const float *x, int64_t ldx, int64_t n, float *y, int64_t ldy,
                  const float *norm_w, float eps);
int kvq_ffn_glu(const kvq_weight *gate_up, const kvq_weight *down, const float *x, int64_t ldx, int64_t n,
                float *y, const float *norm_w, float eps, const float *gelu);

int kvb_quantize_row(int type, const float *x, int64_t n, void *dst);

int kvr_rope_store(float *q, int64_t ldq, int64_t n_head, float *k, int64_t ldk, int64_t n_head_kv, int64_t hd,
                   const float *v, int64_t ldv, int64_t width_v, int64_t n, const float *cs, int64_t ldcs,
                   int64_t n_rot, int neox, float q_scale, void *k_cache, int64_t ld_kc, void *v_cache, int64_t ld_vc,
                   int k_type, int v_type, int64_t rot_k, int64_t rot_v, const int64_t *rows);

int kva_attention(const float *q, int64_t sq_s, int64_t sq_i, int64_t sq_h, const void *k, int64_t sk_s,
                  int64_t sk_c, int64_t sk_h, const void *v, int64_t sv_s, int64_t sv_c, int64_t sv_h,
                  int k_type, int v_type, const float *mask, int64_t sm_s, int64_t sm_i, float *out, int64_t S,
                  int64_t n_q, int64_t H, int64_t Hkv, int64_t n_kv, int64_t D, int64_t Dv, float scale,
                  float softcap);

#endif
