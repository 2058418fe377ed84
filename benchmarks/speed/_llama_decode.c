// llama.cpp's decode, measured as bench_outofmem.py measures Colibri's: one sequence,
// `warmup` tokens, then `runs` runs of `tokens` tokens each, one token a decode call, the
// token fed at each step read from IDS (a file of whitespace-separated ids; greedy argmax
// fed back collapses to one repeated token in a random-weight model),
// the bytes this process read from storage per run (/proc/self/io read_bytes), and every
// MoE layer's routed experts (the graph's "ffn_moe_topk-<layer>" tensors, read by the
// scheduler's eval callback) counted per layer.
//
//   _llama_decode MODEL.gguf THREADS WARMUP TOKENS RUNS REPACK(0|1) MMAP(0|1) IDS
//
// Prints one line "RESULT {json}". Built by bench_outofmem.py against the vendored
// llama.cpp of _llamacpp_tools.py (libllama in build/llamacpp/build/bin).
#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_LAYERS 256
#define MAX_EXPERTS 1024

static long long counts[MAX_LAYERS][MAX_EXPERTS];
static int n_layers_seen = 0, n_experts = 0;

static long long read_bytes(void) {
    FILE *f = fopen("/proc/self/io", "r");
    char line[256];
    long long v = -1;
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "read_bytes: %lld", &v) == 1) break;
    fclose(f);
    return v;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static bool on_tensor(struct ggml_tensor *t, bool ask, void *ud) {
    (void)ud;
    if (strncmp(t->name, "ffn_moe_topk-", 13) != 0) return ask ? false : true;
    if (ask) return true;
    int layer = atoi(t->name + 13);
    if (layer < 0 || layer >= MAX_LAYERS || t->type != GGML_TYPE_I32) return true;
    size_t n = ggml_nelements(t);
    int32_t *ids = malloc(n * sizeof(int32_t));
    ggml_backend_tensor_get(t, ids, 0, n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= 0 && ids[i] < MAX_EXPERTS) {
            counts[layer][ids[i]]++;
            if (ids[i] + 1 > n_experts) n_experts = ids[i] + 1;
        }
    if (layer + 1 > n_layers_seen) n_layers_seen = layer + 1;
    free(ids);
    return true;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

int main(int argc, char **argv) {
    if (argc < 9) {
        fprintf(stderr, "usage: %s MODEL THREADS WARMUP TOKENS RUNS REPACK MMAP IDS\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    int threads = atoi(argv[2]), warmup = atoi(argv[3]), tokens = atoi(argv[4]);
    int runs = atoi(argv[5]), repack = atoi(argv[6]), use_mmap = atoi(argv[7]);
    static int ids[1 << 16];
    int n_ids = 0;
    FILE *fi = fopen(argv[8], "r");
    if (!fi) { fprintf(stderr, "cannot open %s\n", argv[8]); return 2; }
    while (n_ids < (1 << 16) && fscanf(fi, "%d", &ids[n_ids]) == 1) n_ids++;
    fclose(fi);
    if (n_ids < warmup + runs * tokens + 1) { fprintf(stderr, "too few ids\n"); return 2; }
    llama_backend_init();
    double t0 = now();
    long long r0 = read_bytes();
    struct llama_model_params mp = llama_model_default_params();
    mp.load_mode = use_mmap ? LLAMA_LOAD_MODE_MMAP : LLAMA_LOAD_MODE_NONE;
    mp.use_extra_bufts = repack;
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 64;
    cp.n_ubatch = 64;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.cb_eval = on_tensor;
    cp.cb_eval_user_data = NULL;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int V = llama_vocab_n_tokens(vocab);
    double t_load = now() - t0;
    long long r_load = read_bytes() - r0;

    llama_token tok = ids[0] % V;
    int pos = 0;
    printf("RESULT {\"load_s\": %.3f, \"load_read\": %lld, \"runs\": [", t_load, r_load);
    for (int r = -1; r < runs; r++) {        // r == -1: the warm-up
        int n = r < 0 ? warmup : tokens;
        long long rb = read_bytes();
        double ts = now();
        for (int i = 0; i < n; i++) {
            struct llama_batch b = llama_batch_get_one(&tok, 1);
            if (llama_decode(ctx, b) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
            const float *lg = llama_get_logits_ith(ctx, -1);
            if (!(lg[argmax(lg, V)] == lg[argmax(lg, V)])) { fprintf(stderr, "NaN logits\n"); return 1; }
            pos++;
            tok = ids[pos] % V;
        }
        double dt = now() - ts;
        long long rd = read_bytes() - rb;
        if (r >= 0)
            printf("%s{\"s\": %.4f, \"tok_s\": %.4f, \"read\": %lld}", r ? ", " : "", dt, n / dt, rd);
        else
            fprintf(stderr, "warm-up: %d tokens in %.2f s, %lld bytes read\n", n, dt, rd);
    }
    printf("], \"routed\": [");
    for (int l = 0; l < n_layers_seen; l++) {
        printf("%s[", l ? ", " : "");
        for (int e = 0; e < n_experts; e++) printf("%s%lld", e ? ", " : "", counts[l][e]);
        printf("]");
    }
    printf("], \"positions\": %d}\n", pos);
    fflush(stdout);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
