/* The oracle's llama.cpp context for the benchmark drivers (llama_tensors.c, llama_teacher.c):
 * its teacher-forced settings (n_ctx 2048, n_batch = n_ubatch = 512, one unified stream, a
 * full-size window cache, 2 threads) with the K/V type and flash-attention setting given, and
 * weight repacking off (`use_extra_bufts`): a repacked kernel adds in another order, and a
 * -march=native build's AMX buffer type stops with an illegal instruction where the kernel does
 * not grant AMX. Returns NULL where the model or the context cannot be made. */
#ifndef KVTOOL_LLAMA_ORACLE_H
#define KVTOOL_LLAMA_ORACLE_H

#include "llama.h"

static struct llama_context *oracle_context(const char *path, struct llama_model **model, enum ggml_type type_kv,
                                            int flash_attn, ggml_backend_sched_eval_callback cb, void *cb_data) {
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.use_extra_bufts = false;
    if (!(*model = llama_model_load_from_file(path, mp))) return NULL;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 2048, cp.n_batch = 512, cp.n_ubatch = 512, cp.n_seq_max = 1, cp.n_threads = 2;
    cp.n_threads_batch = 2, cp.kv_unified = 1, cp.swa_full = 1, cp.type_k = type_kv, cp.type_v = type_kv;
    cp.flash_attn_type = flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.cb_eval = cb, cp.cb_eval_user_data = cb_data;
    return llama_init_from_model(*model, cp);
}

#endif
