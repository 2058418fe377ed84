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

/* An mxfp4 matrix (CK_W_MXFP4: gpt-oss's experts, docs/FORMAT.md) in ck_q4's fields:
 * data [rows, cp/2] the checkpoint's bytes (per 32-value block 16 bytes, byte j holding
 * the e2m1 codes of values 2j (low nibble) and 2j+1 (high)), zeros [rows, cp/32] the
 * blocks' e8m0 exponents, scales unused; group 64, cp = round_up(cols, 64): an activation
 * group is two blocks. */
typedef ck_q4 ck_mx;
/* ck_mx.c: an int8 activation row (cp values) put in place into the order the mxfp4 int8
 * tiles of every backend read: per 64-value group its 32 even values (block 2i's 16, then
 * block 2i+1's), then its 32 odd ones (the weight bytes' low, then high nibbles) */
void ck_mx_act_order(int8_t *q, int64_t cp);
extern const float ck_e8m0_half_tab[256];   /* ck_mx.c: ck_e8m0_half(e) for every e */
/* the e2m1 codes' values times 2, integers (+0, 0.5, 1, 1.5, 2, 3, 4, 6, then negated) */
#define CK_E2M1_X2 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

/* 2^(e - 128), exactly: an e8m0 block scale 2^(e - 127) halved for the doubled codes
 * (e 0 and 1 give float32 subnormals; 255, NaN in the OCP format, is refused where values
 * are checked: the converter's writer and `colibri inspect --verify`, validate.py) */
static inline float ck_e8m0_half(uint8_t e) {
    uint32_t u = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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

/* Activation panels (the AVX-512 batch kernel, q4_panels below): the int8 rows of
 * CK_PANEL tokens interleaved four bytes at a time, so that one 64-byte load holds bytes
 * k..k+3 of all 16 tokens (one token per i32 lane of a zmm register), each byte stored
 * as x + 128 (x ^ 0x80, an unsigned byte), with the group scales [ng][16]. Lanes past
 * the last token hold x = 0 and scale 0. Built by ck_step.h's pack_panel. */
#define CK_PANEL 16
typedef struct {
    const uint8_t *q;          /* [np][cp/4][16][4] */
    const float *s;            /* [np][ng][16] */
    int64_t cp, ng;
} ck_panel;

/* CK_PANEL_ROWS weight rows unpacked for q4_panels: row r's values minus its group's
 * zero point as int8 (-15..15) in value order, w[r * cp + k]; wzs[r * ng + g] =
 * -128 * sum over group g of those values; sw[r] its scales [ng]. */
#define CK_PANEL_ROWS 8
typedef struct {
    const int8_t *w;           /* [CK_PANEL_ROWS][cp] */
    const int32_t *wzs;        /* [CK_PANEL_ROWS][ng] */
    const float *sw[CK_PANEL_ROWS];
    int64_t cp, ng, group;
} ck_unpacked;

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
     * k + p*ld, v + p*ld; s: [g, len] scratch, left holding the softmax probabilities
     * (ck_step_attn.c's attention sinks read them) */
    void (*attn)(const float *q, int g, int64_t d, const float *k, const float *v, int64_t ld,
                 int64_t len, float scale, float *s, float *out);
    int rt;       /* preferred rows per tile */
    int nt_many;  /* tokens per tile for batches (n >= ck_core.c's switch point) */
    /* Batches of many tokens (AVX-512 only, else NULL): q4_unpack writes rows r0..r0+rt
     * (rt <= CK_PANEL_ROWS) of a q4 matrix into slots slot.. of u's buffers (wbuf, wzs:
     * [CK_PANEL_ROWS][cp], [CK_PANEL_ROWS][ng]); q4_panels computes the CK_PANEL_ROWS
     * unpacked rows against np panels: res[r * ldr + t], t < np * CK_PANEL. Each
     * (row, token) result is bit for bit the q4_i8 tiles' (the same integer group dots,
     * q4_dot_pass's float order lane by lane), so the switch costs no bit. */
    void (*q4_unpack)(const ck_q4 *w, int64_t r0, int rt, int slot, int8_t *wbuf,
                      int32_t *wzs);
    void (*q4_panels)(const ck_unpacked *u, const ck_panel *p, int64_t np, float *res,
                      int64_t ldr);
    /* q4_unpack's job for a q6 matrix (values 0..63: w - z fits int8 and q4_panels'
     * integer dots stay exact); its panels give the q6_i8 tiles' bits, whose integer dots
     * go through the same q4_dot_pass. NULL: q6 matrices run the tiles. */
    void (*q6_unpack)(const ck_q6 *w, int64_t r0, int rt, int slot, int8_t *wbuf,
                      int32_t *wzs);
    /* mxfp4 x int8 activations (group 64, in ck_mx_act_order's order): per 32-value block
     * an exact integer dot of the doubled codes, times 2^(e - 128) * xs (float
     * activations: ck_scalar_mx_f32 on every backend, the parity path) */
    void (*mx_i8)(const ck_mx *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                  float *res);
    /* MLA's absorbed attention of g heads sharing one latent cache (ck_step_mla.c; NULL:
     * its portable loop): scores ql[h] . c_p + qp[h] . kp_p (ql [g, r]; qp rows ldq
     * apart, [R] each; c rows r floats, kp rows R), times scale, softmax, out [g, r] =
     * sum_p s[h, p] c_p; s: [g, len] scratch */
    void (*mla)(const float *ql, const float *qp, int64_t ldq, int g, int64_t r, int64_t R,
                const float *c, const float *kp, int64_t len, float scale, float *s, float *out);
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
void ck_avx2_mla(const float *ql, const float *qp, int64_t ldq, int g, int64_t r, int64_t R,
              const float *c, const float *kp, int64_t len, float scale, float *s, float *out);
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
void ck_scalar_mx_f32(const ck_mx *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res);
void ck_scalar_mx_i8(const ck_mx *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                     float *res);

/* the expert FFN's activation: silu(v) = v * sigmoid(v) */
static inline float ck_silu(float v) { return v / (1.0f + expf(-v)); }

/* unaligned scalar access to user memory (compiles to a plain mov) */
static inline float ck_ldf(const float *p) { float v; memcpy(&v, p, 4); return v; }
static inline void ck_stf(float *p, float v) { memcpy(p, &v, 4); }
static inline int32_t ck_ldi(const int32_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline void ck_sti(int32_t *p, int32_t v) { memcpy(p, &v, 4); }

/* ------------------------------------------------------------------ panels */

/* From this many tokens (per expert in the step's expert block, per call in the
 * attention projections and ck_matmul) the backend's panels run (ck_step_moe.c;
 * ck_set_panel_min_tokens). The panel helpers below are shared by ck_core.c and
 * ck_step*.c. */
extern int ck_panel_min_tokens;

static inline int64_t npanels(int64_t n) { return (n + CK_PANEL - 1) / CK_PANEL; }

#define CK_PANEL_MAX_CP 16384   /* a row tile's unpacked rows live on the stack */

/* token row t (q [cp] int8, s [ng] scales) into lane t % 16 of panel t / 16 of `pq`/`ps`
 * (the ck_panel layout above), or x = 0, scale 0 when q is NULL (a padding lane) */
static inline void pack_panel_row(const int8_t *q, const float *s, int64_t cp, int64_t ng,
                                  uint8_t *pq, float *ps, int64_t t) {
    uint8_t *d = pq + (t / CK_PANEL) * cp * CK_PANEL + (t % CK_PANEL) * 4;
    float *ds = ps + (t / CK_PANEL) * ng * CK_PANEL + t % CK_PANEL;
    for (int64_t k = 0; k < cp / 4; k++) {
        uint32_t v = 0;
        if (q) memcpy(&v, q + 4 * k, 4);
        v ^= 0x80808080u;
        memcpy(d + k * 4 * CK_PANEL, &v, 4);
    }
    for (int64_t g = 0; g < ng; g++) ds[g * CK_PANEL] = q ? ck_ldf(s + g) : 0.0f;
}

/* rows r0..r0+rt of w into slots slot..slot+n of u, the last row repeated past rt (its
 * results are not used) */
typedef void (*ck_unpack_fn)(const ck_q4 *w, int64_t r0, int rt, int slot, int8_t *wbuf,
                             int32_t *wzs);

static inline void unpack_rows_with(ck_unpack_fn unpack, const ck_q4 *w, int64_t r0, int rt,
                                    int slot, int n, ck_unpacked *u, int8_t *wb, int32_t *wz) {
    unpack(w, r0, rt, slot, wb, wz);
    for (int r = 0; r < n; r++) {
        int64_t row = r0 + (r < rt ? r : rt - 1);
        if (r >= rt) unpack(w, row, 1, slot + r, wb, wz);
        u->sw[slot + r] = w->scales + row * w->ng;
    }
    u->w = wb; u->wzs = wz;
    u->cp = w->cp; u->ng = w->ng; u->group = w->group;
}

static inline void unpack_rows(const ck_backend_t *be, const ck_q4 *w, int64_t r0, int rt,
                               int slot, int n, ck_unpacked *u, int8_t *wb, int32_t *wz) {
    unpack_rows_with(be->q4_unpack, w, r0, rt, slot, n, u, wb, wz);
}


#endif
