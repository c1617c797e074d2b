/* llama.cpp teacher-forced, as the oracle's README section 6 describes, for
 * benchmarks/weights_oracle.py --llama: each prompt decoded as one batch with every row an
 * output after the memory is cleared, in the oracle's context (llama_oracle.h: no weight
 * repacking) with the K/V type and flash-attention setting given.
 *   cc -O2 benchmarks/llama_teacher.c -I$LLAMA/include -I$LLAMA/ggml/include \
 *      -L$LLAMA/build/bin -lllama -lggml -lggml-base -Wl,-rpath,$LLAMA/build/bin -o llama_teacher
 * usage: llama_teacher MODEL f32|f16 0|1 OUT < PROMPTS ; PROMPTS holds one prompt a line (token
 * ids, space-separated), OUT gets the float32 logits [rows of all prompts, n_vocab]. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama_oracle.h"

int main(int argc, char **argv) {
    if (argc != 5) return 2;
    const enum ggml_type type = strcmp(argv[2], "f16") == 0 ? GGML_TYPE_F16 : GGML_TYPE_F32;
    if (type == GGML_TYPE_F32 && strcmp(argv[2], "f32") != 0) return 2;
    struct llama_model *model = NULL;
    struct llama_context *ctx = oracle_context(argv[1], &model, type, atoi(argv[3]), NULL, NULL);
    if (!ctx) return 5;
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE *out = fopen(argv[4], "wb");
    if (!out) return 3;
    struct llama_batch b = llama_batch_init(512, 0, 1);
    static char line[1 << 16];
    while (fgets(line, sizeof line, stdin)) {
        int n = 0;
        for (char *s = strtok(line, " \n"); s && n < 512; s = strtok(NULL, " \n"), n++) {
            b.token[n] = atoi(s), b.pos[n] = n, b.n_seq_id[n] = 1, b.seq_id[n][0] = 0, b.logits[n] = 1;
        }
        if (n == 0) continue;
        b.n_tokens = n;
        llama_memory_clear(llama_get_memory(ctx), true);
        if (llama_decode(ctx, b)) return 6;
        for (int i = 0; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, out);
    }
    fclose(out);
    llama_batch_free(b);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
