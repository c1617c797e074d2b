/* llama.cpp's logits for tests/data/variants (made by tests/helpers/make_variant_refs.py, which
 * builds this against a llama.cpp build): decodes a prompt with every row an output, then greedy
 * tokens one at a time, F32 K/V, flash attention off, one unified stream.
 * usage: llama_logits MODEL OUT N_GEN TOKEN... ; OUT: int32 n_rows, n_vocab, the tokens, then the
 * rows of float32 logits. */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

int main(int argc, char **argv) {
    if (argc < 5) return 2;
    const int n_gen = atoi(argv[3]), n_prompt = argc - 4;
    llama_backend_init();
    struct llama_model *model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) return 3;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256, cp.n_batch = 256, cp.n_ubatch = 256, cp.n_seq_max = 1, cp.n_threads = 2;
    cp.n_threads_batch = 2, cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32, cp.type_v = GGML_TYPE_F32, cp.kv_unified = 1, cp.swa_full = 1;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return 4;
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_rows = n_prompt + n_gen;
    int *tokens = malloc(sizeof(int) * n_rows);
    float *logits = malloc(sizeof(float) * (size_t)n_rows * n_vocab);
    struct llama_batch b = llama_batch_init(n_prompt, 0, 1);
    for (int i = 0; i < n_prompt; i++) {
        tokens[i] = atoi(argv[4 + i]);
        b.token[i] = tokens[i], b.pos[i] = i, b.n_seq_id[i] = 1, b.seq_id[i][0] = 0, b.logits[i] = 1;
    }
    b.n_tokens = n_prompt;
    if (llama_decode(ctx, b)) return 5;
    for (int i = 0; i < n_prompt; i++)
        for (int j = 0; j < n_vocab; j++) logits[(size_t)i * n_vocab + j] = llama_get_logits_ith(ctx, i)[j];
    for (int s = 0; s < n_gen; s++) {
        const float *last = logits + (size_t)(n_prompt + s - 1) * n_vocab;
        int best = 0;
        for (int j = 1; j < n_vocab; j++)
            if (last[j] > last[best]) best = j;
        const int at = n_prompt + s;
        tokens[at] = best;
        b.token[0] = best, b.pos[0] = at, b.n_seq_id[0] = 1, b.seq_id[0][0] = 0, b.logits[0] = 1, b.n_tokens = 1;
        if (llama_decode(ctx, b)) return 6;
        for (int j = 0; j < n_vocab; j++) logits[(size_t)at * n_vocab + j] = llama_get_logits_ith(ctx, 0)[j];
    }
    FILE *f = fopen(argv[2], "wb");
    if (!f) return 7;
    const int head[2] = {n_rows, n_vocab};
    fwrite(head, sizeof(int), 2, f);
    fwrite(tokens, sizeof(int), n_rows, f);
    fwrite(logits, sizeof(float), (size_t)n_rows * n_vocab, f);
    fclose(f);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
