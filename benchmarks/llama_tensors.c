/* llama.cpp's intermediate tensors for one prompt, for benchmarks/ops_vs_llama.py: the prompt
 * decoded as one batch with every row an output (flash attention off, F32 K/V, 2 threads, one
 * unified stream: the oracle's teacher-forced settings, llama_oracle.h, no weight repacking),
 * every F32 graph tensor written through the `cb_eval` callback, and the logits.
 *   cc -O2 benchmarks/llama_tensors.c -I$LLAMA/include -I$LLAMA/ggml/include \
 *      -L$LLAMA/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA/build/bin -o llama_tensors
 * usage: llama_tensors MODEL OUTDIR TOKEN... ; OUTDIR gets index.txt (one line a tensor: its
 * number, name, op, ne0..ne3), NNNNN.bin (its float32 data, contiguous), logits.bin (float32
 * [n_tokens, n_vocab]) and tokens.txt. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama_oracle.h"

struct dump {
    const char *dir;
    FILE *index;
    int n;
};

static bool on_tensor(struct ggml_tensor *t, bool ask, void *user) {
    struct dump *d = user;
    if (ask || t->type != GGML_TYPE_F32) return t->type == GGML_TYPE_F32;
    const size_t n = ggml_nelements(t);
    float *buf = malloc(n * sizeof(float));
    struct ggml_tensor *c = t;
    if (!ggml_is_contiguous(t)) {  // views: read row by row in ggml's element order
        for (int64_t i3 = 0, k = 0; i3 < t->ne[3]; i3++)
            for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
                for (int64_t i1 = 0; i1 < t->ne[1]; i1++, k += t->ne[0])
                    for (int64_t i0 = 0; i0 < t->ne[0]; i0++)
                        ggml_backend_tensor_get(c, buf + k + i0,
                                                i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3],
                                                sizeof(float));
    } else {
        ggml_backend_tensor_get(c, buf, 0, n * sizeof(float));
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%05d.bin", d->dir, d->n);
    FILE *f = fopen(path, "wb");
    fwrite(buf, sizeof(float), n, f);
    fclose(f);
    free(buf);
    fprintf(d->index, "%05d\t%s\t%s\t%lld %lld %lld %lld\n", d->n, t->name, ggml_op_desc(t), (long long)t->ne[0],
            (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3]);
    d->n++;
    return true;
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    const int n = argc - 3;
    struct dump d = {argv[2], NULL, 0};
    char path[4096];
    snprintf(path, sizeof path, "%s/index.txt", d.dir);
    if (!(d.index = fopen(path, "w"))) return 3;
    snprintf(path, sizeof path, "%s/tokens.txt", d.dir);
    FILE *tok = fopen(path, "w");
    if (!tok) return 3;
    for (int i = 0; i < n; i++) fprintf(tok, "%s\n", argv[3 + i]);
    fclose(tok);
    struct llama_model *model = NULL;
    struct llama_context *ctx = oracle_context(argv[1], &model, GGML_TYPE_F32, 0, on_tensor, &d);
    if (!ctx) return 5;
    struct llama_batch b = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        b.token[i] = atoi(argv[3 + i]), b.pos[i] = i, b.n_seq_id[i] = 1, b.seq_id[i][0] = 0, b.logits[i] = 1;
    }
    b.n_tokens = n;
    if (llama_decode(ctx, b)) return 6;
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    snprintf(path, sizeof path, "%s/logits.bin", d.dir);
    FILE *f = fopen(path, "wb");
    for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, f);
    fclose(f);
    fclose(d.index);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
