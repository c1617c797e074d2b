/* RMS norm of rows on the CPU as ggml computes it (the sum of squares in double, then (x * scale)
 * * w): cpu_half.h's rms_norm_row, the norm the compiled decoder call applies (decoder_cpu.c), for
 * the forwards that norm op by op and must give its bits. kernels/rms_norm_cpu.py calls it;
 * kernels/qmatmul.py's rms_norm_ref is its specification. */

#include <stdint.h>

#include "cpu_half.h"

/* y[i] = rms_norm(x[i]) * w for n rows of `width` floats (x rows ldx apart, y rows ldy apart; y
 * may be x). Returns 0, or -1 for a bad call. */
int kvn_rms_norm(const float *x, int64_t ldx, int64_t n, int64_t width, const float *w, float eps, float *y,
                 int64_t ldy) {
    if (n < 0 || width < 1 || ldx < width || ldy < width) return -1;
    for (int64_t i = 0; i < n; i++) rms_norm_row(x + i * ldx, width, w, eps, y + i * ldy);
    return 0;
}
