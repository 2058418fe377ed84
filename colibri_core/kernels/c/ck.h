/* ck.h -- Colibri CPU kernels: the public C API. kernels/build.py hands the text between
 * the "cdef begin" and "cdef end" markers to cffi, so it holds plain declarations only
 * (no #-lines, no inline code). The backends' shared types and helpers are in
 * ck_internal.h.
 *
 * Layouts are those of docs/FORMAT.md: q4 rows are `cp/2` packed bytes (blocks of 64
 * values in 32 bytes: low nibble = value j, high nibble = value 32+j), q6 rows are
 * `cp/64*48` bytes (per 64 values q4's 32 bytes of low nibbles, then 16 bytes of the
 * values' top two bits), q8 rows are `cp` int8, scales/zeros are [rows, ng] (cp = cols
 * rounded up to the group, ng = cp / group).
 * Activations quantized to int8 are [n, cp] with [n, ng] scales and int32 group sums
 * (see quant.quantize_act_q8).
 *
 * No pointer is assumed aligned: weight parts may sit at any byte offset of a mapped
 * file. */
#ifndef COLIBRI_CK_H
#define COLIBRI_CK_H

#include <stdint.h>

/* cdef begin */

enum { CK_SCALAR = 0, CK_AVX2 = 1, CK_NEON = 2, CK_AVX512VNNI = 3 };

void ck_init(void);                 /* picks the best backend, or COLIBRI_KERNELS's */
int ck_backend(void);               /* active backend, CK_* */
int ck_backend_available(int b);
int ck_set_backend(int b);          /* 0 on success, -1 if not available here */
void ck_set_threads(int n);          /* threads of every call (default: OMP_NUM_THREADS, else the
                                       CPUs this process may run on) */
void ck_set_par_min_work(int64_t w); /* calls below w MACs run on one thread; <0: default */
/* Benchmarks and tests: matmuls and expert FFNs of n >= this many tokens (and n > 1) run
 * the backend's batch (row x several tokens) tiles, fewer tokens run the matrix-vector
 * tiles once per token; <= 0 restores the default. Returns the value now in effect. */
int ck_set_matmul_min_tokens(int n);
int ck_get_threads(void);
uint64_t ck_rdtsc(void);
const char *ck_cycle_counter_name(void);

/* ------------------------------------------------------------------ descriptors */

enum { CK_W_Q4 = 1, CK_W_Q8 = 2, CK_W_Q6 = 3, CK_W_F32 = 4, CK_W_F16 = 5, CK_W_BF16 = 6,
       CK_W_MXFP4 = 7, CK_W_Q5 = 8 };   /* q5: q4's fields, data [rows, cp/64*40] (ck_q5.c);
                                           the step's products only (not ck_matmul, ck_mat_row) */

typedef struct {               /* a matrix [rows, cols]: q4, q6 or q8 in the docs/FORMAT.md
                                  layout, or floats (the step calls only) */
    int kind;                  /* CK_W_Q4, CK_W_Q6, CK_W_Q8, CK_W_F32, CK_W_F16, CK_W_BF16,
                                  CK_W_MXFP4 */
    const void *data;          /* q4: uint8 [rows, cp/2]; q6: uint8 [rows, cp/64*48];
                                  q8: int8 [rows, cp]; floats: [rows, cols] (bf16: uint16) */
    const float *scales;       /* [rows, ng]; floats: NULL */
    const uint8_t *zeros;      /* q4, q6: [rows, ng]; q8, floats: NULL; mxfp4: its e8m0
                                  block exponents [rows, cp/32] (data: the checkpoint's
                                  bytes [rows, cp/2], docs/FORMAT.md; scales NULL) */
    int64_t rows, cols, group; /* floats and mxfp4: group 64 */
    const float *act_scale;    /* AWQ (step calls): [cols], the input is divided by it; or NULL */
} ck_mat;

typedef struct {               /* an FFN: gate, up [I, H]; down [H, I] */
    ck_mat w1, w3, w2;
    const float *b1, *b3, *b2;   /* step calls: biases [I], [I], [H] (gpt-oss), or NULL */
} ck_ffn;

/* the step's gated activation of gate g and up u (ck_ffn_block.act) */
enum { CK_ACT_SILU = 0,          /* silu(g) * u */
       CK_ACT_SWIGLU_CLAMPED = 1 /* gpt-oss: g' = min(g, limit), u' = clamp(u, -limit, limit),
                                    g' * sigmoid(alpha * g') * (u' + 1) */ };

/* ------------------------------------------------------------------ general path
 * Any number of tokens, a few parallel loops per call on ck_pool.c's threads (those of
 * the pipeline step); they allocate their own buffers (tests, benchmarks). These return
 * 0, or -1 when a buffer could not be allocated (the output is then unspecified). */

/* x [n, cols] f32 -> xq [n, cp] int8, xs [n, ng] f32, xsum [n, ng] int32 */
void ck_act_quantize(const float *x, int64_t n, int64_t cols, int64_t group,
                     int8_t *xq, float *xs, int32_t *xsum);

/* out [n, rows] = x [n, cols] @ W^T. act_int8: x is quantized per group of W and the
 * products are integer dots; else W is dequantized on the fly (the parity path). */
int ck_matmul(const ck_mat *w, const float *x, int64_t n, float *out, int act_int8);

/* Expert FFN (f: w1, w3 with the same group): h = silu(x W1^T) * (x W3^T); y = h W2^T;
 * out [n, H] = y * rw[:,None] (out += .. when accumulate); rw NULL: weights 1. */
int ck_expert_ffn(const ck_ffn *f, const float *x, int64_t n, float *out, const float *rw,
                  int accumulate, int act_int8);

/* Decode attention of one token over a KV cache laid out [capacity, nkv, d] (row p of kv
 * head j at k + (p*nkv + j)*d): out[h] = softmax(scale * q[h] . k[:len, h/(nh/nkv)]) @ v.
 * q, out: [nh, d]. */
int ck_attention_decode(const float *q, int64_t nh, int64_t d, const float *k, const float *v,
                        int64_t nkv, int64_t len, float scale, float *out);

/* ------------------------------------------------------------------ pipeline step
 * n tokens of m sequences through a layer in three calls (attention block, router,
 * expert block), then the lm_head: the whole forward of colibri_core/forward/pipeline.py, in
 * ck_step*.c. Each call's parallel loops run on ck_pool.c's threads; nothing is allocated
 * (the caller sizes `ck_sscratch`, pipeline.py). A token's results do not depend on the
 * other tokens of the call (batch invariance, see ck_step.h). Every function returns 0,
 * or a code: CK_E_GROUPS (more than two activation group sizes in one call, or experts
 * of one layer with different input groups), CK_E_SCRATCH (scratch too small, or an
 * argument out of range), CK_E_NONFINITE (ck_step_route: a router logit is NaN/Inf),
 * CK_E_MEMORY (attention over a very long context could not get its scores buffer). */

enum { CK_E_GROUPS = 1, CK_E_SCRATCH = 2, CK_E_NONFINITE = 3, CK_E_MEMORY = 4 };

typedef struct {               /* one layer's attention block (grouped-query attention) */
    ck_mat wq, wk, wv, wo;
    const float *bq, *bk, *bv;   /* NULL: no bias */
    const float *q_norm, *k_norm;  /* Qwen3-style q/k RMSNorms, or NULL */
    int qk_norm;                 /* 0 none, 1 per head ([d] weights), 2 over the projection,
                                    3 weightless per head after rope (Llama 4's L2 norm) */
    const float *norm;           /* the attention RMSNorm weight [H] */
    const float *ffn_norm;       /* the FFN RMSNorm weight [H], applied to the result */
    int64_t hidden, nh, nkv, d;
    float eps;                   /* RMSNorm epsilon */
    float scale;                 /* softmax scale */
    const double *inv_freq;      /* rotate-half rope: inverse frequencies [rot/2] */
    double rope_factor;          /*   and the factor on cos/sin (ops.rope_frequencies) */
    int64_t rot;                 /* dims rotated per head, the first ones (partial rotary,
                                    GLM-4.5); 0: all d */
    float out_scale;             /* factor on the block's output before the residual add
                                    (Granite's residual_multiplier); 0: 1 */
    const float *bo;             /* the output projection's bias [H], or NULL */
    const float *sinks;          /* [nh] a learned logit per head added to each softmax's
                                    denominator (gpt-oss), or NULL */
    int64_t window;              /* > 0: a token attends to positions pos-window+1 .. pos */
    int64_t chunk;               /* > 0: to its own chunk, pos - pos % chunk .. pos */
    int no_rope;                 /* no rope on this layer (Llama 4's NoPE layers), and q
                                    times 1 + temp_scale * log1p(floor((pos+1) / temp_floor))
                                    when temp_floor > 0 */
    float temp_floor, temp_scale;
    const float *norm_b, *ffn_norm_b;  /* LayerNorm biases [H] (norm_type "layer": the two
                                    norms are LayerNorms), or NULL: RMSNorms */
} ck_attn_layer;

typedef struct {               /* one layer's MLA attention block (DeepSeek-V2/V3; mla.py) */
    ck_mat wq;                   /* [nh*(nope+rope), H], or data NULL when q is low-rank: */
    ck_mat wq_a, wq_b;           /*   [q_lora, H], [nh*(nope+rope), q_lora] */
    ck_mat wkv_a, wo;            /* [r + rope, H], [H, nh*v] */
    const float *q_a_norm;       /* [q_lora] (low-rank q) */
    const float *kv_a_norm;      /* [r] */
    const float *wkv_b;          /* [nh, nope + v, r] float32: W_UK rows then W_UV rows, */
    ck_mat wkv_b_q;              /*   or NULL: these rows [nh*(nope+v), r], read row by row */
    const float *norm, *ffn_norm;  /* the layer's RMSNorm weights [H] */
    int64_t hidden, nh, nope, rope, v, r, q_lora;
    float eps, lora_eps, scale;  /* RMSNorm eps, the q_a / kv_a norms' eps, softmax scale */
    const double *inv_freq;      /* rope over the rope part: [rope/2] */
    double rope_factor;
    int interleave;              /* DeepSeek's interleaved rope pairs (rope_interleave) */
} ck_mla_layer;

enum { CK_ROUTE_FIXED = 0, CK_ROUTE_FLOAT = 1, CK_ROUTE_SIGMOID = 2, CK_ROUTE_SPARSEMIXER = 3 };

typedef struct {               /* one MoE layer's router (routing.route) */
    const float *weight;         /* [e, h] */
    const float *bias;           /* [e] added to the logits, or NULL */
    int64_t e, h;
    int scoring;                 /* CK_ROUTE_*: fixed-point / float softmax, sigmoid scores */
    const float *select_bias;    /* [e] added to what the choice is made on (DeepSeek-V3's
                                    correction bias), or NULL */
    int64_t n_group, topk_group; /* group-limited choice when topk_group < n_group */
    int norm_topk;               /* renormalize the k weights */
    double scaling;              /* times this */
    const int64_t *exp2_q30;     /* routing._EXP2_TABLE */
    int bias_on_probs;           /* softmax: select_bias added to the probabilities, not the
                                    logits (ERNIE-4.5) */
    float jitter_eps;            /* CK_ROUTE_SPARSEMIXER's mask width (routing.sparsemixer) */
} ck_router;

typedef struct {               /* one layer's expert block */
    const ck_ffn *table;         /* by expert id (a dense layer: its FFN, id 0); all q4 */
    int64_t n_table;
    const ck_ffn *shared;        /* the shared expert, or NULL */
    const float *shared_gate;    /* [H]: its weight sigmoid(xn . gate), or NULL: 1 */
    int64_t hidden;
    float scale;                 /* factor on every FFN's output, routed, shared or dense
                                    (Granite's residual_multiplier); 0: 1 */
    int act;                     /* CK_ACT_*, and its limit and alpha */
    float act_limit, act_alpha;
    int weight_input;            /* a routed expert's weight scales its input, not its output:
                                    expert(w x) (Llama 4); the shared expert's is unchanged */
} ck_ffn_block;

typedef struct {
    int64_t n_max;                           /* tokens per call, at most */
    float *xn;                               /* [n_max, H] normed rows */
    int8_t *aq; float *as; int32_t *asum;    /* int8 activations, two group sizes: */
    int8_t *bq; float *bs; int32_t *bsum;    /*   [n_max, cp_max], [n_max, cp_max / 64] */
    int64_t cp_max;
    float *q, *k, *v, *att;                  /* [n_max, nh*d], [n_max, nkv*d] x 2, [n_max, nh*d] */
    int64_t pairs_max;                       /* expert block: rows of h per piece */
    int8_t *gq; float *gs; int32_t *gsum;    /* [pairs_max, cp_max], [.., cp_max / 64] */
    float *h; int8_t *hq; float *hs; int32_t *hsum;  /* [pairs_max, hld], [pairs_max, hcp],
                                                        [pairs_max, hcp / 64] x 2 */
    int64_t hld, hcp;
    int64_t pairs_total_max;                 /* (token, expert) pairs of a call, at most */
    int64_t *pair_tok; float *pair_w;        /* [pairs_total_max] */
    int64_t *counts;                         /* [2 * table size + 1] */
    void *jobs; int64_t jobs_max;            /* jobs_max * ck_step_job_bytes() bytes */
    float *mla; int64_t mla_per_token;       /* MLA: [n_max, ck_step_mla_floats] */
    uint8_t *pq; float *ps;                  /* activation panels (AVX-512 batches): */
    int64_t p_rows, p_cp;                    /*   [p_rows, p_cp], [p_rows, p_cp / 64]; */
                                             /*   pq NULL: none (the tiles run) */
    int act_f32;                             /* float activations (no int8 rows) */
    float *af, *bf;                          /* float rows (float activations, AWQ):
                                                [n_max, cp_max] each, or NULL */
    float *gf;                               /* expert block, float rows: [pairs_max, cp_max] */
    int threads;                             /* at most this many threads (0: no cap) */
    int failed;                              /* set by a loop that could not finish */
} ck_sscratch;

int64_t ck_step_job_bytes(void);
/* From this many tokens per expert the expert block runs the backend's panel kernel
 * (AVX-512; ck_step_moe.c) if it has one; <= 0 restores the default. Never changes a
 * bit (tests). Returns the value now in force. */
int ck_set_panel_min_tokens(int n);

/* A token's KV cache in ck_step_attention: tok [n, CK_TOK_COLS] = (pos, address of the
 * sequence's k cache, of its v cache, values per layer (capacity * nkv * d), the caches'
 * storage type CK_KV_*, address of the k scales, of the v scales (q8; else 0)). A cache is
 * [layers, capacity, nkv, d] of f32, f16 (IEEE half) or q8 (int8, with a float32 scale per
 * (layer, position, kv head) row in the scales arrays [layers, capacity, nkv]: row =
 * q * scale, symmetric, as quant.quantize_kv_q8). */
enum { CK_KV_F32 = 0, CK_KV_F16 = 1, CK_KV_Q8 = 2, CK_TOK_COLS = 7 };

/* x [n, H] += o_proj(attention(rmsnorm(x))) for tokens whose positions and KV caches
 * are tok (above). Each token's rotated key and value go to row pos of layer `layer`,
 * in its cache's type (all tokens' before any attention: a token sees the earlier tokens
 * of its sequence in the same call), then it attends over rows 0..pos (f16 and q8 rows
 * dequantized to float32 first). Then xn_out [n, H] = rmsnorm(x, a->ffn_norm). */
int ck_step_attention(const ck_attn_layer *a, int64_t layer, float *x, int64_t n,
                      const int64_t *tok, float *xn_out, ck_sscratch *s);

/* The same for an MLA layer: its cache (mla.MLACache) is tok's k array = the latents c
 * [layers, capacity, r] and v array = the rotated k_pe [layers, capacity, rope]; tok's
 * floats per layer are those of c (capacity * r). ck_step_mla_floats: the scratch
 * floats per token it needs. */
int ck_step_mla_attention(const ck_mla_layer *a, int64_t layer, float *x, int64_t n,
                          const int64_t *tok, float *xn_out, ck_sscratch *s);
int64_t ck_step_mla_floats(const ck_mla_layer *a);

/* logits [n, e] = xn [n, h] @ r->weight^T (+ bias) (from_logits: the caller filled
 * them; only checked); ids NULL: that is all. Else each token's top-k[t] choice as
 * routing.route with the router's mode into ids/weights [n, kmax] (best first, ties to
 * the lower index; slots k[t].. get id -1, weight 0); kmax <= 256. */
int ck_step_route(const ck_router *r, const float *xn, int64_t n, const int32_t *k, int kmax,
                  float *logits, int64_t *ids, float *weights, int from_logits);

/* x [n, H] += weights[t, j] * table[ids[t, j]](xn[t]) over the j < kmax with ids >= 0 (a
 * table entry whose w1.data is NULL, a vacant slot, contributes nothing), added one
 * expert at a time in ascending id, then += sigmoid(xn . shared_gate) * shared(xn). */
int ck_step_experts(const ck_ffn_block *b, const float *xn, int64_t n, const int64_t *ids,
                    const float *weights, int kmax, float *x, ck_sscratch *s);

/* logits [n, rows] = rmsnorm(x [n, cols], norm) @ w^T */
int ck_step_head(const ck_mat *w, const float *norm, float eps, const float *x, int64_t n,
                 float *logits, ck_sscratch *s);
/* the same with a LayerNorm (weight norm, bias norm_b) where norm_b is not NULL, and
 * bias [rows] added to the logits where not NULL (Phi-3.5-MoE) */
int ck_step_head_b(const ck_mat *w, const float *norm, const float *norm_b, const float *bias,
                   float eps, const float *x, int64_t n, float *logits, ck_sscratch *s);

/* Tests: n rows of d floats into a cache's storage type and back (kind CK_KV_F16: dst
 * uint16 [n, d]; CK_KV_Q8: dst int8 [n, d] and scales [n]), as ck_step_attention
 * stores and reads them; the f16/q8 attention of g query heads over len rows (q, out
 * [g, d]; row p of k at k + p*ld values, its scale at ks[p * ld / d]) */
void ck_kv_store(int kind, const float *src, int64_t n, int64_t d, void *dst, float *scales);
void ck_kv_load(int kind, const void *src, const float *scales, int64_t n, int64_t d, float *dst);
int ck_kv_attention(int kind, const float *q, int g, int64_t d, const void *k, const void *v,
                    const float *ks, const float *vs, int64_t ld, int64_t len, float scale,
                    float *out);

/* ck_q5.c (tests, benchmarks): out [n, rows] = x [n, cols] @ W^T for a CK_W_Q5 matrix on one
 * thread, through the step's q5 tiles (act_int8: x quantized per group of W); 0, or -1
 * (not q5, or no memory) */
int ck_q5_matmul(const ck_mat *w, const float *x, int64_t n, float *out, int act_int8);

/* out [cols] = row `r` of w, dequantized as quant.dequantize_q4 / _q6 / _q8 */
void ck_mat_row(const ck_mat *w, int64_t r, float *out);

/* Since the last call: out[0] chunks the caller ran, out[1] chunks other threads ran,
 * out[2] cycles in parallel loops, out[3] of them the caller spent waiting for other
 * threads' chunks (pipeline.py's thread control reads it to see whether a second thread
 * is really running) */
void ck_pool_stats(int64_t *out);

/* Tests: `rounds` loops of n chunks on nth threads of the pipeline's pool (ck_pool.c);
 * returns how many chunk counts were not exactly one per loop (0), or -1 (memory). */
int64_t ck_pool_check(int64_t n, int nth, int rounds);

/* ------------------------------------------------------------------ mapped-file guard */

/* ck_guard.c: a process-wide SIGBUS handler for model files truncated while mapped (see
 * that file). register: watch [addr, addr+len) (installs the handler on first use; returns
 * a slot >= 0, or -1: table full or sigaction failed); unregister before the unmap. A
 * fault in a watched range makes its pages read as zeros, sets the slot's damaged flag and
 * adds 1 to the counter (read it after each step: one load). mark_damaged: the same, for
 * damage found another way (MADV_POPULATE_READ's EFAULT). */
int ck_guard_install(void);          /* 0, or -1 if sigaction failed; idempotent */
int ck_guard_register(uintptr_t addr, uint64_t len);
void ck_guard_unregister(int slot);
int ck_guard_damaged(int slot);
void ck_guard_mark_damaged(int slot);
const uint64_t *ck_guard_counter(void);

/* ------------------------------------------------------------------ converter */

/* ck_qsearch.c: quant.q4_group_params + the codes for n groups of k doubles (b [n, k]),
 * levels 0..qmax (15: q4, 63: q6); mse != 0 also tries the shrink factors grid[ngrid]
 * (quant.Q4_CLIP_GRID). Writes scale [n] (float32), zero [n], q [n, k]. Returns the number
 * of groups holding a NaN / Inf (left unwritten: the caller uses numpy's rules for them),
 * or -1 for k outside 1..1024 or qmax outside 1..255. nth threads of ck_pool.c. */
int64_t ck_q4_group_search(const double *b, int64_t n, int64_t k, int qmax, const double *grid,
                           int ngrid, int mse, float *scale, uint8_t *zero, uint8_t *q, int nth);

/* cdef end */

#endif
