/*
 * colibri_expert.h — the C ABI of a Colibri hot-plugged expert (ABI version 2).
 *
 * A hot-plugged expert is a shared object (.so) dropped into the engine's watched folder
 * (`experts_so/` by default). The engine reads this file's metadata straight from the ELF
 * file, WITHOUT loading it, checks it, probes it in a separate process, and only then
 * dlopen()s it between two tokens. See docs/HOTPLUG.md for the whole life cycle.
 *
 * What an expert exports (default visibility, C linkage):
 *
 *   ffn_forward          the function below                                  (required)
 *   colibri_expert_meta  a const colibri_expert_meta_t                       (required)
 *   colibri_router_row   const float[hidden_size]: its row of the router    (required)
 *   colibri_w1_data, colibri_w1_scales, colibri_w1_zeros,                    (required when
 *   colibri_w3_data, colibri_w3_scales, colibri_w3_zeros,                     flags has
 *   colibri_w2_data, colibri_w2_scales, colibri_w2_zeros                      COLIBRI_FLAG_HAS_Q4)
 *
 * Because the engine reads these symbols from the file without loading it, they must be
 * plain initialized constant data: no pointers (a pointer is a relocation, only filled in by
 * the dynamic loader), not in .bss (zero-initialized data has no bytes in the file), and
 * their symbol sizes must be exact (the engine checks st_size against the metadata).
 *
 * The INT4 weights use Colibri's own `q4` layout (docs/FORMAT.md): asymmetric groups of
 * `group_size` values per row, two values per byte in 64-value blocks (byte j of a block holds
 * value j in its low nibble and value 32+j in its high nibble), float32 scales and uint8 zero
 * points per group. Shapes (I = intermediate_size, H = hidden_size, Hp/Ip padded to G):
 *     w1 (gate) [I, H]: data uint8[I][Hp/2], scales float[I][Hp/G], zeros uint8[I][Hp/G]
 *     w3 (up)   [I, H]: same as w1
 *     w2 (down) [H, I]: data uint8[H][Ip/2], scales float[H][Ip/G], zeros uint8[H][Ip/G]
 * When present the engine runs these with its own kernels and ffn_forward is the fallback.
 * `colibri expert build` (colibri_core/experts/hotplug/builder.py) writes all of this for you.
 */
#ifndef COLIBRI_EXPERT_H
#define COLIBRI_EXPERT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define COLIBRI_EXPERT_ABI_VERSION 2u  /* 1: no base_model (loads unbound, with a warning) */
#define COLIBRI_EXPERT_MAGIC       0x45584C43u  /* bytes "CLXE" in little-endian order */

#define COLIBRI_MAX_LAYERS   16   /* target layers per expert (global layer indices) */
#define COLIBRI_NAME_LEN     64   /* NUL-terminated, [A-Za-z0-9_.-], not empty        */
#define COLIBRI_VERSION_LEN  32   /* NUL-terminated, free text, e.g. "1.2.0"          */
#define COLIBRI_TARGET_LEN  128   /* NUL-terminated: compiler + flags it was built with */

/* flags */
#define COLIBRI_FLAG_THREAD_SAFE 0x1u  /* ffn_forward may run on several threads at once  */
#define COLIBRI_FLAG_HAS_Q4      0x2u  /* the nine colibri_w* symbols are present         */
#define COLIBRI_FLAG_PORTABLE    0x4u  /* ABI 2: runs on any model of its hidden size and
                                          layers, whatever base_model says               */

/*
 * The metadata record. Fixed layout, 360 bytes, every field 4-byte aligned, no padding,
 * little-endian on the platforms Colibri runs on. Offsets are part of the ABI.
 */
typedef struct colibri_expert_meta {
    uint32_t magic;                        /*   0: COLIBRI_EXPERT_MAGIC                     */
    uint32_t abi_version;                  /*   4: COLIBRI_EXPERT_ABI_VERSION               */
    uint32_t struct_size;                  /*   8: sizeof(colibri_expert_meta_t) = 360      */
    uint32_t flags;                        /*  12: COLIBRI_FLAG_*                           */
    uint32_t hidden_size;                  /*  16: H, must equal the model's hidden size    */
    uint32_t intermediate_size;            /*  20: I of the q4 weights (0 without them)     */
    uint32_t group_size;                   /*  24: G of the q4 weights (0 without them)     */
    uint32_t n_layers;                     /*  28: 1..COLIBRI_MAX_LAYERS                    */
    int32_t  layers[COLIBRI_MAX_LAYERS];   /*  32: global layer indices (MoE layers)        */
    float    router_bias;                  /*  96: added to its router logit                */
    uint32_t reserved0;                    /* 100: 0                                        */
    char     name[COLIBRI_NAME_LEN];       /* 104: identity of the expert (replace = same)  */
    char     version[COLIBRI_VERSION_LEN]; /* 168                                           */
    char     target[COLIBRI_TARGET_LEN];   /* 200: e.g. "x86_64 gcc 12.2.0 -O3"             */
    uint8_t  base_model[32];               /* 328: fingerprint (sha256) of the model it was
                                                   built for (docs/HOTPLUG.md "Binding"); all
                                                   zero only with COLIBRI_FLAG_PORTABLE. ABI 1:
                                                   reserved, zeros                              */
} colibri_expert_meta_t;                   /* 360                                           */

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(colibri_expert_meta_t) == 360, "colibri_expert_meta_t must be 360 bytes");
#endif

#define COLIBRI_EXPORT __attribute__((visibility("default")))

/*
 * The calling contract of ffn_forward:
 *   x  [n_tokens, hidden] float32, contiguous rows, read only;
 *   y  [n_tokens, hidden] float32, contiguous rows: OVERWRITE every value (never accumulate;
 *      y holds garbage on entry);
 *   hidden equals colibri_expert_meta.hidden_size; 1 <= n_tokens; rows are independent
 *      (row t of y depends on row t of x only);
 *   return 0 on success, anything else is an error (the engine raises, it does not crash);
 *   called by one thread at a time unless flags has COLIBRI_FLAG_THREAD_SAFE;
 *   assume no state survives between calls (the engine may load, unload, reload or run the
 *      expert in a helper process at any time); outputs must be finite.
 */
COLIBRI_EXPORT int ffn_forward(const float *x, float *y, int n_tokens, int hidden);

COLIBRI_EXPORT extern const colibri_expert_meta_t colibri_expert_meta;

#ifdef __cplusplus
}
#endif

#endif /* COLIBRI_EXPERT_H */
