/* ck.h -- Colibri CPU kernels: public C API (mirrored in _kernels_build.py's cdef) and
 * the internal types shared by the backends (scalar, AVX2, AVX-512 VNNI, NEON).
 *
 * Layouts are those of docs/FORMAT.md: q4 rows are `cp/2` packed bytes (blocks of 64
 * values in 32 bytes: low nibble = value j, high nibble = value 32+j), q8 rows are `cp`
 * int8, scales/zeros are [rows, ng]. Activations quantized to int8 are [n, cp] with
 * [n, ng] scales and int32 group sums (see quant.quantize_act_q8).
 *
 * No pointer is assumed aligned: SIMD code uses unaligned loads and scalar code reads
 * user floats through memcpy (ck_ldf/ck_stf), since weight parts may sit at any byte
 * offset of a mapped file. */
#ifndef COLIBRI_CK_H
#define COLIBRI_CK_H

#include <stdint.h>
#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------ public API */

enum { CK_SCALAR = 0, CK_AVX2 = 1, CK_NEON = 2, CK_AVX512VNNI = 3 };

void ck_init(void);                 /* picks the best backend, or COLIBRI_KERNELS's */
int ck_backend(void);               /* active backend, CK_* */
int ck_backend_available(int b);
int ck_set_backend(int b);          /* 0 on success, -1 if not available here */
void ck_set_threads(int n);
void ck_set_par_min_work(int64_t w); /* calls below w MACs run on one thread; <0: default */
/* Benchmarks and tests: matmuls and expert FFNs of n >= this many tokens (and n > 1) run
 * the backend's batch (row x several tokens) tiles, fewer tokens run the matrix-vector
 * tiles once per token; <= 0 restores the default. Returns the value now in effect. */
int ck_set_matmul_min_tokens(int n);
int ck_get_threads(void);
uint64_t ck_rdtsc(void);
const char *ck_cycle_counter_name(void);

/* x [n, cols] f32 -> xq [n, cp] int8, xs [n, ng] f32, xsum [n, ng] int32 */
void ck_act_quantize(const float *x, int64_t n, int64_t cols, int64_t group,
                     int8_t *xq, float *xs, int32_t *xsum);

/* out [n, rows] = x [n, cols] @ W^T. The int8 variants quantize x into (xq, xs, xsum)
 * when given (sizes n*cp, n*ng, n*ng) or into malloc'ed buffers when NULL.
 * These return 0, or -1 when a buffer could not be allocated (out is then unspecified). */
int ck_q4_matmul(const uint8_t *wd, const float *ws, const uint8_t *wz,
                  int64_t rows, int64_t cols, int64_t group,
                  const float *x, int64_t n, float *out, int act_int8,
                  int8_t *xq, float *xs, int32_t *xsum);
int ck_q8_matmul(const int8_t *wd, const float *ws,
                  int64_t rows, int64_t cols, int64_t group,
                  const float *x, int64_t n, float *out, int act_int8,
                  int8_t *xq, float *xs, int32_t *xsum);

/* Expert FFN: w1, w3 [I, H] (same group), w2 [H, I].
 * h = silu(x W1^T) * (x W3^T);  y = h W2^T;  out = y * rw[:,None] (or out += ..).
 * rw may be NULL (weights 1). Scratch (all may be NULL -> malloc):
 *   xq [n*cp(H,g1)], xs/xsum [n*ng(H,g1)], h [n*round64(I)] f32,
 *   hq [n*cp(I,g2)], hs/hsum [n*ng(I,g2)]. */
int ck_expert_ffn(const uint8_t *w1d, const float *w1s, const uint8_t *w1z,
                   const uint8_t *w3d, const float *w3s, const uint8_t *w3z, int64_t g13,
                   const uint8_t *w2d, const float *w2s, const uint8_t *w2z, int64_t g2,
                   int64_t hidden, int64_t inter,
                   const float *x, int64_t n, float *out, const float *rw,
                   int accumulate, int act_int8,
                   int8_t *xq, float *xs, int32_t *xsum,
                   float *h, int8_t *hq, float *hs, int32_t *hsum);

/* Decode attention of one token over a KV cache laid out [capacity, nkv, d] (row p of kv
 * head j at k + (p*nkv + j)*d): out[h] = softmax(scale * q[h] . k[:len, h/(nh/nkv)]) @ v.
 * q, out: [nh, d]. scores: [nh*len] scratch or NULL (malloc). Returns 0, or -1 (memory). */
int ck_attention_decode(const float *q, int64_t nh, int64_t d, const float *k, const float *v,
                        int64_t nkv, int64_t len, float scale, float *out, float *scores);

/* ------------------------------------------------------------------ decode step
 * One token of one sequence through a layer in two calls (attention block, FFN block),
 * each one OpenMP region, with the routing in between: the whole decode path of a
 * model lives in ck_decode.c and colibri_core/decode.py. Nothing is allocated: the
 * caller sizes `ck_dscratch` once (decode.py). Every function returns 0, or a code:
 * CK_E_GROUPS (more than two activation group sizes in one call), CK_E_SCRATCH
 * (scratch too small), CK_E_NONFINITE (ck_decode_route: a router logit is NaN/Inf). */

enum { CK_W_Q4 = 1, CK_W_Q8 = 2 };
enum { CK_E_GROUPS = 1, CK_E_SCRATCH = 2, CK_E_NONFINITE = 3 };

typedef struct {               /* a q4 or q8 matrix in the docs/FORMAT.md layout */
    int kind;                  /* CK_W_Q4 or CK_W_Q8 */
    const void *data;          /* q4: uint8 [rows, cp/2]; q8: int8 [rows, cp] */
    const float *scales;       /* [rows, ng] */
    const uint8_t *zeros;      /* q4: [rows, ng]; q8: NULL */
    int64_t rows, cols, group;
} ck_mat;

typedef struct { ck_mat w1, w3, w2; } ck_ffn;   /* gate, up [I, H]; down [H, I] */

typedef struct {
    ck_mat wq, wk, wv, wo;
    const float *bq, *bk, *bv;   /* NULL: no bias */
    const float *norm;           /* the attention RMSNorm weight [H] */
    int64_t hidden, nh, nkv, d;
} ck_attn_layer;

typedef struct {
    float *xn;                               /* [H] a normed copy of x */
    int8_t *aq; float *as; int32_t *asum;    /* int8 activations, two group sizes: */
    int8_t *bq; float *bs; int32_t *bsum;    /*   [cp_max], [cp_max / 64] each */
    int64_t cp_max;
    float *q, *k, *v, *att;                  /* [nh*d], [nkv*d], [nkv*d], [nh*d] */
    float *cos, *sin;                        /* rope [d/2] */
    float *scores; int64_t max_len;          /* [nh * max_len] */
    float *h; int8_t *hq; float *hs; int32_t *hsum;  /* per FFN j: h + j*hld, hq + j*hcp,
                                                        hs/hsum + j*(hcp/64) */
    int64_t max_ffns, hld, hcp;
    int threads;                             /* at most this many threads (0: no cap) */
} ck_dscratch;

/* x [H] += o_proj(attention(rmsnorm(x))) for the token at position `pos`; its rotated
 * key and value are written to row pos of the layer's cache kc, vc [capacity, nkv, d];
 * attention runs over rows 0..pos. Then xn_out = rmsnorm(x, ffn_norm). */
int ck_decode_attention(const ck_attn_layer *a, float eps, const double *inv_freq,
                        double rope_factor, float *x, float *kc, float *vc, int64_t pos,
                        const float *ffn_norm, float *xn_out, ck_dscratch *s);

/* Router logits [E] = router [E, H] @ xn (+ bias [E] when not NULL) and the top-k choice
 * as routing.route(mode="fixed", scoring="softmax"): ids [k] largest logits first (ties:
 * lower index), weights [k] from the fixed-point softmax, renormalized over the k when
 * norm_topk, times scaling; exp2_q30 is routing._EXP2_TABLE; k <= 256. */
int ck_decode_route(const float *xn, const float *router, const float *bias, int64_t e,
                    int64_t h, int k, int norm_topk, float scaling, const int64_t *exp2_q30,
                    float *logits, int64_t *ids, float *weights);

/* x [H] += sum_j weights[j] * table[ids[j]](xn) over the j < k with ids[j] >= 0 (and a
 * table entry whose w1.data is not NULL: a vacant slot contributes nothing), in
 * ascending id order, then += sigmoid(xn . shared_gate) * shared(xn) when shared is not
 * NULL (shared_gate NULL: weight 1). A dense layer is table = its FFN, ids = {0}. */
int ck_decode_ffn(const ck_ffn *table, const int64_t *ids, const float *weights, int k,
                  const ck_ffn *shared, const float *shared_gate, const float *xn,
                  float *x, int64_t hidden, ck_dscratch *s);

/* logits [rows] = w @ rmsnorm(x, norm) */
int ck_decode_head(const ck_mat *w, const float *norm, float eps, const float *x,
                   float *logits, ck_dscratch *s);

/* out [cols] = row `r` of w, dequantized as quant.dequantize_q4 / dequantize_q8 */
void ck_mat_row(const ck_mat *w, int64_t r, float *out);

/* Since the last call: out[0] chunks the caller ran, out[1] chunks other threads ran,
 * out[2] cycles in parallel loops, out[3] of them the caller spent waiting for other
 * threads' chunks (decode.py's thread control reads it to see whether a second thread
 * is really running) */
void ck_pool_stats(int64_t *out);

/* Tests: `rounds` loops of n chunks on nth threads of the decode path's pool (ck_pool.c);
 * returns how many chunk counts were not exactly one per loop (0), or -1 (memory). */
int64_t ck_pool_check(int64_t n, int nth, int rounds);

/* ------------------------------------------------------------------ internals */

#define CK_MAX_RT 4   /* rows per tile, at most */
#define CK_MAX_NT 4   /* tokens per tile, at most */

typedef struct {               /* a q4 matrix */
    const uint8_t *data;       /* [rows, cp/2] */
    const float *scales;       /* [rows, ng]   */
    const uint8_t *zeros;      /* [rows, ng]   */
    int64_t rows, cols, group, cp, ng;
} ck_q4;

typedef struct {               /* a q8 matrix */
    const int8_t *data;        /* [rows, cp] */
    const float *scales;       /* [rows, ng] */
    int64_t rows, cols, group, cp, ng;
} ck_q8;

typedef struct {               /* int8 activations, as quant.quantize_act_q8 */
    const int8_t *q;           /* [n, cp] */
    const float *s;            /* [n, ng] */
    const int32_t *sum;        /* [n, ng] */
    int64_t cp, ng;
} ck_act;

typedef struct {               /* float activations */
    const float *x;            /* row t at x + t*ld, `cols` real values */
    int64_t ld, cols;
    /* tail: [n, 64] zero-padded copy of each row's last partial 64-block, or NULL when
     * the rows are readable and finite up to round_up(cols, 64). */
    const float *tail;
} ck_xf;

/* A tile computes res[r*nt + t] = dot(W row r0+r, activation row t0+t), r < rt, t < nt,
 * with rt <= CK_MAX_RT, nt <= CK_MAX_NT. */
typedef struct {
    const char *name;
    void (*act_quant)(const float *x, int64_t cols, int64_t group,
                      int8_t *xq, float *xs, int32_t *xsum);   /* one row */
    void (*q4_i8)(const ck_q4 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                  float *res);
    void (*q4_f32)(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                   float *res);
    void (*q8_i8)(const ck_q8 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                  float *res);
    void (*q8_f32)(const ck_q8 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                   float *res);
    /* attention of g query heads sharing one kv head: q, out [g, d]; key/value row p at
     * k + p*ld, v + p*ld; s: [g, len] scratch */
    void (*attn)(const float *q, int g, int64_t d, const float *k, const float *v, int64_t ld,
                 int64_t len, float scale, float *s, float *out);
    int rt;       /* preferred rows per tile */
    int nt_many;  /* tokens per tile for batches (n >= ck_core.c's switch point) */
} ck_backend_t;

extern const ck_backend_t ck_backend_scalar;
const ck_backend_t *ck_active_backend(void);   /* ck_core.c */
int ck_threads_for(int64_t work);              /* threads for a call of `work` MACs */
/* ck_pool.c: fn(ctx, c) for every c in [0, n) on up to nth threads (the caller is one of
 * them); returns when all are done, without waiting for a thread that never started */
typedef void (*ck_chunk_fn)(void *ctx, int64_t chunk);
void ck_pool_for(ck_chunk_fn fn, void *ctx, int64_t n, int nth);
#if defined(__x86_64__) || defined(__i386__)
extern const ck_backend_t ck_backend_avx2;
extern const ck_backend_t ck_backend_avx512vnni;
/* AVX2 entries the AVX-512 VNNI backend reuses (target avx2,fma) */
void ck_avx2_act_quant(const float *x, int64_t cols, int64_t group,
                       int8_t *xq, float *xs, int32_t *xsum);
void ck_avx2_q4_f32(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                    float *res);
void ck_avx2_q8_f32(const ck_q8 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                    float *res);
void ck_avx2_attn(const float *q, int g, int64_t d, const float *k, const float *v, int64_t ld,
                  int64_t len, float scale, float *s, float *out);
#endif
#if defined(__aarch64__)
extern const ck_backend_t ck_backend_neon;
#endif

/* scalar pieces reused by other backends */
void ck_scalar_act_quant(const float *x, int64_t cols, int64_t group,
                         int8_t *xq, float *xs, int32_t *xsum);
void ck_scalar_q4_f32(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res);
void ck_scalar_q8_i8(const ck_q8 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                     float *res);
void ck_scalar_attn(const float *q, int g, int64_t d, const float *k, const float *v, int64_t ld,
                    int64_t len, float scale, float *s, float *out);
void ck_softmax_rows(float *s, int g, int64_t len);
void ck_scalar_q8_f32(const ck_q8 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res);

/* the expert FFN's activation: silu(v) = v * sigmoid(v) */
static inline float ck_silu(float v) { return v / (1.0f + expf(-v)); }

/* unaligned scalar access to user memory (compiles to a plain mov) */
static inline float ck_ldf(const float *p) { float v; memcpy(&v, p, 4); return v; }
static inline void ck_stf(float *p, float v) { memcpy(p, &v, 4); }
static inline int32_t ck_ldi(const int32_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline void ck_sti(int32_t *p, int32_t v) { memcpy(p, &v, 4); }

#endif
