// llama-fidelity-dump: every graph tensor whose name matches a pattern, written whole, while
// llama.cpp (linked as a library, unmodified) runs a model on given token ids. Its public
// eval callback sees each node after it is computed; we copy matching ones out.
//
//   llama-fidelity-dump MODEL.gguf IDS.i32 OUT.bin prefill|decode REGEX
//
// IDS.i32: little-endian int32 token ids. prefill: one batch of all ids (one ubatch);
// decode: one id per llama_decode call (the path llama-server takes for a cached prefix).
// OUT.bin, one record per tensor per graph evaluation:
//   u32 name_len, name, u32 step, u32 type (0 = f32 values, 1 = i32 values),
//   i64 ne[4], then ne[0]*ne[1]*ne[2]*ne[3] values (f32 or i32), ne[0] fastest.
// Built by scripts/build_llama_cpp.sh against the pinned build; read by tensor_dump.py.
#include "ggml.h"
#include "ggml-backend.h"
#include "llama.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <regex>
#include <string>
#include <vector>

struct dump_state {
    std::regex pattern;
    FILE * out;
    uint32_t step;
    std::vector<uint8_t> host;
};

static float value_f32(const uint8_t * p, ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32:  return *(const float *) p;
        case GGML_TYPE_F16:  return ggml_fp16_to_fp32(*(const ggml_fp16_t *) p);
        case GGML_TYPE_BF16: return ggml_bf16_to_fp32(*(const ggml_bf16_t *) p);
        default:             return 0.0f;
    }
}

static bool on_tensor(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * st = (dump_state *) user_data;
    const bool wanted = std::regex_search(t->name, st->pattern) &&
        (t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16 ||
         t->type == GGML_TYPE_I32);
    if (ask) {
        return wanted;
    }
    if (!wanted) {
        return true;
    }
    const uint8_t * data = (const uint8_t *) t->data;
    if (!ggml_backend_buffer_is_host(t->buffer)) {
        st->host.resize(ggml_nbytes(t));
        ggml_backend_tensor_get(t, st->host.data(), 0, ggml_nbytes(t));
        data = st->host.data();
    }
    const uint32_t name_len = (uint32_t) strlen(t->name);
    const uint32_t kind = t->type == GGML_TYPE_I32 ? 1 : 0;
    fwrite(&name_len, 4, 1, st->out);
    fwrite(t->name, 1, name_len, st->out);
    fwrite(&st->step, 4, 1, st->out);
    fwrite(&kind, 4, 1, st->out);
    fwrite(t->ne, 8, 4, st->out);
    for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
    for (int64_t i1 = 0; i1 < t->ne[1]; ++i1)
    for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) {
        const uint8_t * p = data + i3*t->nb[3] + i2*t->nb[2] + i1*t->nb[1] + i0*t->nb[0];
        if (kind == 1) {
            fwrite(p, 4, 1, st->out);
        } else {
            const float v = value_f32(p, t->type);
            fwrite(&v, 4, 1, st->out);
        }
    }
    return true;
}

int main(int argc, char ** argv) {
    const char * cache = argc == 7 ? argv[6] : "f16";
    const bool known_cache = strcmp(cache, "f16") == 0 || strcmp(cache, "q8_0") == 0;
    if ((argc != 6 && argc != 7) || !known_cache ||
        (strcmp(argv[4], "prefill") != 0 && strcmp(argv[4], "decode") != 0)) {
        fprintf(stderr, "usage: %s MODEL.gguf IDS.i32 OUT.bin prefill|decode REGEX [f16|q8_0]\n", argv[0]);
        return 2;
    }
    std::vector<llama_token> ids;
    {
        FILE * f = fopen(argv[2], "rb");
        if (!f) { fprintf(stderr, "cannot read %s\n", argv[2]); return 2; }
        int32_t v;
        while (fread(&v, 4, 1, f) == 1) ids.push_back(v);
        fclose(f);
    }
    if (ids.empty()) { fprintf(stderr, "%s holds no token ids\n", argv[2]); return 2; }
    dump_state st{std::regex(argv[5]), fopen(argv[3], "wb"), 0, {}};
    if (!st.out) { fprintf(stderr, "cannot write %s\n", argv[3]); return 2; }

    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) ids.size() + 64;
    cp.n_batch = cp.n_ubatch = (uint32_t) ids.size();
    cp.n_threads = cp.n_threads_batch = 1;
    // the cache type, as llama-server's -ctk/-ctv (f16 by default)
    cp.type_k = cp.type_v = strcmp(cache, "q8_0") == 0 ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
    cp.cb_eval = on_tensor;
    cp.cb_eval_user_data = &st;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }

    const bool prefill = strcmp(argv[4], "prefill") == 0;
    const size_t n = prefill ? 1 : ids.size();
    for (size_t i = 0; i < n; ++i) {
        st.step = (uint32_t) i;
        llama_batch b = prefill ? llama_batch_get_one(ids.data(), (int32_t) ids.size())
                                : llama_batch_get_one(ids.data() + i, 1);
        if (llama_decode(ctx, b) != 0) { fprintf(stderr, "llama_decode failed at step %zu\n", i); return 1; }
    }
    fclose(st.out);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
