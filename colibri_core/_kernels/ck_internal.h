/* ck_internal.h -- what the kernel sources share beyond the public API (ck.h): the
 * backends' tile types and function table, the scalar pieces other backends reuse, the
 * thread helpers and the unaligned-access helpers. Not seen by cffi. */
#ifndef COLIBRI_CK_INTERNAL_H
#define COLIBRI_CK_INTERNAL_H

#include <math.h>
#include <string.h>
#include "ck.h"

#define CK_MAX_RT 4   /* rows per tile, at most */
#define CK_MAX_NT 4   /* tokens per tile, at most */

typedef struct {               /* a q4 matrix */
    const uint8_t *data;       /* [rows, cp/2] */
    const float *scales;       /* [rows, ng]   */
    const uint8_t *zeros;      /* [rows, ng]   */
    int64_t rows, cols, group, cp, ng;
} ck_q4;

/* A q6 matrix: q4's fields, with data [rows, cp/64*48] in the q6 layout (docs/FORMAT.md:
 * per 64-value block, 32 bytes of low nibbles in q4's order, then 16 bytes whose byte i
 * holds the top two bits of values i, 16+i, 32+i, 48+i); zero points 0..63. The q4 tiles'
 * zero-point dot pass applies to it unchanged. */
typedef ck_q4 ck_q6;
#define CK_Q6_BLOCK 48   /* bytes per 64 values */

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
    void (*q6_i8)(const ck_q6 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                  float *res);
    void (*q6_f32)(const ck_q6 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                   float *res);   /* the float parity path: ck_scalar_q6_f32 on every backend */
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
/* The token tiling of ck_core.c and ck_step*.c (inline: it is asked once per row tile):
 * calls of n >= ck_matmul_min_tokens tokens (and n > 1) run the backend's batch tiles of
 * nt_many tokens, fewer run the matrix-vector tiles once per token; a last partial tile
 * of fewer than ck_matmul_min_tokens tokens runs them too, one token each. */
extern int ck_matmul_min_tokens;       /* ck_core.c; ck_set_matmul_min_tokens */
static inline int ck_tokens_per_tile(const ck_backend_t *be, int64_t n) {
    return n > 1 && n >= ck_matmul_min_tokens ? be->nt_many : 1;
}
static inline int ck_tile_tokens(int ntp, int64_t left) {
    if (left >= ntp) return ntp;
    return left < ck_matmul_min_tokens ? 1 : (int)left;
}
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
extern const ck_backend_t ck_backend_neon;        /* ARMv8.0 NEON */
extern const ck_backend_t ck_backend_neon_sdot;   /* the same, int8 dots with sdot */
int ck_neon_has_dotprod(void);    /* the CPU has sdot (HWCAP_ASIMDDP): the sdot table runs */
/* ck_neon.c's vector exp and softmax, for tests/c/ck_neon_driver.c */
void ck_neon_exp(const float *x, int64_t n, float *out);
void ck_neon_softmax_rows(float *s, int g, int64_t len);
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
void ck_scalar_q6_f32(const ck_q6 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res);

/* the expert FFN's activation: silu(v) = v * sigmoid(v) */
static inline float ck_silu(float v) { return v / (1.0f + expf(-v)); }

/* unaligned scalar access to user memory (compiles to a plain mov) */
static inline float ck_ldf(const float *p) { float v; memcpy(&v, p, 4); return v; }
static inline void ck_stf(float *p, float v) { memcpy(p, &v, 4); }
static inline int32_t ck_ldi(const int32_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline void ck_sti(int32_t *p, int32_t v) { memcpy(p, &v, 4); }

#endif
