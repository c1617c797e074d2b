/* One block matmul's work as qmatmul.c hands it to its kernels (the row kernels, qrows_*.c, and
 * the panel kernel for many rows, qpanel.c). */
#ifndef KVTOOL_QMATMUL_JOB_H
#define KVTOOL_QMATMUL_JOB_H

#include <stdint.h>

#include "qformats.h"

#define MAX_SEGS 8 /* weights stacked along n_out (Q, K and V share one call) */

typedef struct {
    const qformat *f;
    int64_t row_bytes; /* of a weight row */
    const uint8_t *w[MAX_SEGS];
    int64_t seg_end[MAX_SEGS]; /* the first row past each weight */
    int nseg;
    int64_t n_out, k, n;
    const uint8_t *act; /* the n activation rows in the format's vec_dot type, act_row bytes apart */
    int64_t act_row;
    const uint8_t *pairs; /* the first 2 * (n / 2) rows laid out for the pair kernel, or NULL */
    float *y;
    int64_t ldy;
} job_t;

/* Weight row o of the stacked segments. */
static inline const uint8_t *job_row(const job_t *J, int64_t o) {
    int seg = 0;
    while (o >= J->seg_end[seg]) seg++;
    return J->w[seg] + (o - (seg ? J->seg_end[seg - 1] : 0)) * J->row_bytes;
}

/* Rows from which a format with the panel kernel takes it (backend/linear.py's QUANT_MAX_ROWS). */
#define PANEL_MIN_ROWS 33

int kvq_panels(int type);

/* The panel kernel over every activation row of J, on the pool; 0, or -1 without memory. */
int kvq_matmul_panels(const job_t *J);

#endif
