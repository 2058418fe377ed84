/*
 * example_expert.c — a hot-pluggable Colibri expert written by hand in plain C.
 *
 * The fraud scenario of docs/HOTPLUG.md: a new pattern ("large amount, high velocity, new
 * device") shows up; this expert is routed to when the token's hidden state points along its
 * router row, and it answers with a gated transform of that state. Build it with
 *
 *     make -C experts_so                  # -> experts_so/example_expert.so (HIDDEN=128 LAYER=1)
 *
 * and it is picked up by a running engine whose model has hidden_size 128 and an MoE layer
 * 1, such as the built-in model (MoE layers 1-3); `make HIDDEN=... LAYER=... MODEL=...` for
 * others. The Makefile records the model's fingerprint (COLIBRI_BASE_MODEL, from
 * `python -m colibri_core.model.fingerprint --c MODEL`): another model refuses the expert.
 * Everything the engine needs is below: the metadata record, the router row and
 * ffn_forward. Read colibri_core/include/colibri_expert.h for the contract.
 */
#include <math.h>

#include "colibri_expert.h"

#ifndef COLIBRI_HIDDEN
#define COLIBRI_HIDDEN 128
#endif
#ifndef COLIBRI_LAYER
#define COLIBRI_LAYER 1
#endif
#ifndef EXPERT_NAME
#define EXPERT_NAME "example_fraud"
#endif
#ifndef EXPERT_VERSION
#define EXPERT_VERSION "1.0.0"
#endif
#ifndef EXPERT_TARGET
#define EXPERT_TARGET "unknown"
#endif

/* Read from the file by the engine before loading: constants only, no pointers. */
const colibri_expert_meta_t colibri_expert_meta = {
    .magic = COLIBRI_EXPERT_MAGIC,
    .abi_version = COLIBRI_EXPERT_ABI_VERSION,
    .struct_size = sizeof(colibri_expert_meta_t),
#ifdef COLIBRI_BASE_MODEL                     /* the model it is built for */
    .flags = COLIBRI_FLAG_THREAD_SAFE,          /* no shared state: safe on any thread */
    .base_model = COLIBRI_BASE_MODEL,
#else                                         /* make PORTABLE=1: any model of its shape */
    .flags = COLIBRI_FLAG_THREAD_SAFE | COLIBRI_FLAG_PORTABLE,
#endif
    .hidden_size = COLIBRI_HIDDEN,
    .n_layers = 1,
    .layers = {COLIBRI_LAYER},
    .router_bias = 0.0f,
    .name = EXPERT_NAME,
    .version = EXPERT_VERSION,
    .target = EXPERT_TARGET,
};

/* Its row of the router: the direction of hidden space this expert is responsible for. */
COLIBRI_EXPORT const float colibri_router_row[COLIBRI_HIDDEN] = {
    [0] = 1.0f, [1] = 0.5f, [2] = 0.5f, [3] = -0.25f,
};

/* y = silu(<x, r>) * tanh(x), row by row: a pattern score gating a bounded transform. */
int ffn_forward(const float *x, float *y, int n_tokens, int hidden)
{
    if (hidden != COLIBRI_HIDDEN || n_tokens < 1)
        return 1;
    for (int t = 0; t < n_tokens; t++) {
        const float *xr = x + (long)t * hidden;
        float *yr = y + (long)t * hidden;
        float s = 0.0f;
        for (int i = 0; i < hidden; i++)
            s += colibri_router_row[i] * xr[i];
        float gate = s / (1.0f + expf(-s));
        for (int i = 0; i < hidden; i++)
            yr[i] = gate * tanhf(xr[i]);
    }
    return 0;
}
