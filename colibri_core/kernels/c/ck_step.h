/* ck_step.h -- what the pipeline step's sources (ck_step*.c) share: chunked parallel
 * loops, matrix descriptors as the backends' tiles, a rows x tokens product, norms, rope
 * and per-token int8 activations. Not seen by cffi (the API is ck.h, "pipeline step").
 *
 * The step: n tokens of m sequences through one layer in three calls (attention block,
 * ck_step_attn.c; router and expert block, ck_step_moe.c), then the lm_head (ck_step.c).
 * colibri_core/forward/pipeline.py drives it.
 *
 * Why so few calls: a decode token is ~60 small matrix-vector products. Run one kernel
 * call each, with numpy between them, and half of the time went to starting thread teams
 * and Python glue (py-spy, docs/BENCHMARKS.md). Each call here is a handful of parallel
 * loops on ck_pool.c's threads (chunks of ~64 KB of weights, stolen when a thread is
 * late); the serial pieces (norms, rope, quantizing activations, routing) are per token
 * and allocate nothing.
 *
 * Batch invariance (the scheduler and speculative decoding rely on it): a token's results
 * never depend on which other tokens share its step. Activations are quantized per
 * token; every output value is computed by one tile, whose integer dots and per-group
 * float pass do not depend on how many tokens the tile holds (ck_tiles.h: one order for
 * every tile shape); a token's expert outputs are added to its hidden state one expert
 * at a time in ascending expert id, the shared expert last. tests/test_pipeline_kernels.py
 * checks a token's row alone and among 63 others bit for bit. */
#ifndef COLIBRI_CK_STEP_H
#define COLIBRI_CK_STEP_H

#include <math.h>
#include <stdlib.h>
#include "ck_internal.h"

static inline int64_t rup(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Chunks of a loop over `n` items of `item_bytes` of weights each: ~64 KB per chunk,
 * enough for the prefetchers to run ahead and for a claim (an atomic) to cost nothing. */
typedef struct { int64_t n, per; } chunks;

static inline chunks chunking(int64_t n, int64_t item_bytes) {
    int64_t per = 65536 / (item_bytes > 0 ? item_bytes : 1);
    per = per < 1 ? 1 : per > 64 ? 64 : per;
    return (chunks){n, per};
}

static inline int64_t nchunks(chunks c) { return (c.n + c.per - 1) / c.per; }
static inline int64_t chunk_end(chunks c, int64_t ch) { return min64((ch + 1) * c.per, c.n); }

/* A float multiply-add of attention over the context (scores, softmax, values) costs about
 * as much as 8 int8 multiply-adds of a weight matrix, the unit of the pool's threshold
 * (measured on Zen 4: 6.7 G float MACs/s against ~58 G int8 MACs/s per thread). Without
 * the weight a decode token's context ran on one thread up to position ~256. */
#define CK_ATTN_MAC_COST 8

/* threads for `work` multiply-adds, under the caller's cap (pipeline.py's thread control) */
static inline int nthreads(const ck_sscratch *s, int64_t work) {
    int n = ck_threads_for(work);
    return s->threads > 0 && s->threads < n ? s->threads : n;
}

static inline int is_float_kind(int kind) { return kind >= CK_W_F32 && kind <= CK_W_BF16; }

static inline int64_t mat_bytes_per_row(const ck_mat *m) {
    return m->kind == CK_W_Q4 ? m->cols / 2 : m->kind == CK_W_Q6 ? m->cols * 3 / 4 :
           m->kind == CK_W_Q5 ? m->cols * 5 / 8 :
           m->kind == CK_W_MXFP4 ? m->cols / 2 + m->cols / 32 :
           m->kind == CK_W_F32 ? 4 * m->cols : is_float_kind(m->kind) ? 2 * m->cols : m->cols;
}

/* ------------------------------------------------------------------ matrices */

/* a matrix as the tiles take it: q4, q5, q6 and mxfp4 in q4, q8 in q8, floats in f (row r at
 * f + r * cols, f32 / f16 / bf16 by kind); xs its AWQ activation scale or NULL */
typedef struct { int kind; ck_q4 q4; ck_q8 q8; const void *f; const float *xs; int64_t rows, cols, group; } wmat;

static inline wmat to_w(const ck_mat *m) {
    wmat w;
    int64_t cp = rup(m->cols, m->group);
    memset(&w, 0, sizeof w);
    w.kind = m->kind;
    w.rows = m->rows; w.cols = m->cols; w.group = m->group; w.xs = m->act_scale;
    if (m->kind == CK_W_Q4 || m->kind == CK_W_Q6 || m->kind == CK_W_Q5)
        w.q4 = (ck_q4){m->data, m->scales, m->zeros, m->rows, m->cols, m->group, cp, cp / m->group};
    else if (m->kind == CK_W_MXFP4) {          /* activations in groups of 64: two blocks */
        w.group = 64;
        cp = rup(m->cols, 64);
        w.q4 = (ck_q4){m->data, NULL, m->zeros, m->rows, m->cols, 64, cp, cp / 64};
    }
    else if (m->kind == CK_W_Q8)
        w.q8 = (ck_q8){m->data, m->scales, m->rows, m->cols, m->group, cp, cp / m->group};
    else
        w.f = m->data;
    return w;
}

static inline int64_t ntiles(int64_t rows, int rtp) { return (rows + rtp - 1) / rtp; }

/* IEEE half -> float, exact: the half's bits moved into a float and scaled by 2^112
 * (normals and subnormals alike), Inf/NaN given the float's all-ones exponent */
static inline float h2f(uint16_t h) {
    const uint32_t em = h & 0x7fffu;
    uint32_t u = em << 13;
    float f;
    memcpy(&f, &u, 4);
    f *= 0x1p112f;
    memcpy(&u, &f, 4);
    u = em >= 0x7c00u ? 0x7f800000u | (em << 13) : u;
    u |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &u, 4);
    return f;
}

/* values k0..k0+m of row r of a float-kind matrix, as float32 */
static inline void wf_load(const wmat *w, int64_t r, int64_t k0, int64_t m, float *out) {
    if (w->kind == CK_W_F32) {
        memcpy(out, (const float *)w->f + r * w->cols + k0, (size_t)m * sizeof(float));
    } else {
        const uint16_t *p = (const uint16_t *)w->f + r * w->cols + k0;
        for (int64_t i = 0; i < m; i++) {
            uint16_t v;
            memcpy(&v, p + i, 2);
            if (w->kind == CK_W_F16) out[i] = h2f(v);
            else { uint32_t u = (uint32_t)v << 16; memcpy(out + i, &u, 4); }
        }
    }
}

/* A tile of a float-kind matrix against float rows (the scalar code of every backend):
 * res[r*nt + t] = dot(row r0+r, row t0+t of x), the row converted 256 values at a time. */
static inline void wf_tile(const wmat *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                           float *res) {
    float buf[256];
    for (int r = 0; r < rt; r++)
        for (int t = 0; t < nt; t++) {
            const float *xr = x->x + (t0 + t) * x->ld;
            float acc[8] = {0};
            for (int64_t k0 = 0; k0 < w->cols; k0 += 256) {
                const int64_t m = min64(256, w->cols - k0);
                wf_load(w, r0 + r, k0, m, buf);
                for (int64_t i = 0; i < m; i++) acc[i & 7] += buf[i] * ck_ldf(xr + k0 + i);
            }
            res[r * nt + t] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        }
}

/* A step's activations of a matrix: int8 rows (int8 mode, quantized weights), else float
 * rows (readable and finite up to round_up(cols, 64) for the quantized float tiles) */
typedef struct { ck_act q; ck_xf f; int int8; } sact;

/* ck_q5.c: the q5 tiles (every backend; AVX2 integer dots where the backend has them) */
void ck_q5_i8(const ck_q4 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt, float *res);
void ck_q5_f32(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt, float *res);

/* one tile of any matrix kind against either kind of activations */
static inline __attribute__((always_inline))
void mat_tile(const ck_backend_t *be, const wmat *w, int64_t r0, int rt, const sact *a,
              int64_t t0, int nt, float *res) {
    if (is_float_kind(w->kind)) wf_tile(w, r0, rt, &a->f, t0, nt, res);
    else if (a->int8) {
        if (w->kind == CK_W_Q4) be->q4_i8(&w->q4, r0, rt, &a->q, t0, nt, res);
        else if (w->kind == CK_W_Q6) be->q6_i8(&w->q4, r0, rt, &a->q, t0, nt, res);
        else if (w->kind == CK_W_MXFP4) be->mx_i8(&w->q4, r0, rt, &a->q, t0, nt, res);
        else if (w->kind == CK_W_Q5) ck_q5_i8(&w->q4, r0, rt, &a->q, t0, nt, res);
        else be->q8_i8(&w->q8, r0, rt, &a->q, t0, nt, res);
    } else {
        if (w->kind == CK_W_Q4) be->q4_f32(&w->q4, r0, rt, &a->f, t0, nt, res);
        else if (w->kind == CK_W_Q6) be->q6_f32(&w->q4, r0, rt, &a->f, t0, nt, res);
        else if (w->kind == CK_W_MXFP4) ck_scalar_mx_f32(&w->q4, r0, rt, &a->f, t0, nt, res);
        else if (w->kind == CK_W_Q5) ck_q5_f32(&w->q4, r0, rt, &a->f, t0, nt, res);
        else be->q8_f32(&w->q8, r0, rt, &a->f, t0, nt, res);
    }
}

/* rows r0..r0+rt of w against tokens 0..n of activations `a`, in token tiles (the
 * batch tiles from ck_core.c's switch point on, a short last tile token by token, as
 * ck_matmul); emit(ctx, t, r, value) receives each result. */
typedef void (*emit_fn)(void *ctx, int64_t t, int64_t r, float v);

static inline __attribute__((always_inline))
void rows_x_tokens(const ck_backend_t *be, const wmat *w, int64_t r0, int rt,
                          const sact *a, int64_t n, emit_fn emit, void *ctx) {
    const int ntp = ck_tokens_per_tile(be, n);
    float res[CK_MAX_RT * CK_MAX_NT];
    for (int64_t t0 = 0; t0 < n;) {
        int nt = ck_tile_tokens(ntp, n - t0);
        mat_tile(be, w, r0, rt, a, t0, nt, res);
        for (int r = 0; r < rt; r++)
            for (int t = 0; t < nt; t++) emit(ctx, t0 + t, r0 + r, res[r * nt + t]);
        t0 += nt;
    }
}

/* ------------------------------------------------------------------ serial helpers */

/* out = x / sqrt(mean(x^2) + eps) * w (the sum of squares in double) */
static inline void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *out) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] / r) * w[i];
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};   /* eight independent sums: the compiler vectorizes them */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += ck_ldf(a + i + j) * ck_ldf(b + i + j);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += ck_ldf(a + i) * ck_ldf(b + i);
    return s;
}

/* rotate-half rope of one head (Hugging Face layout), in place */
static inline void rope(float *x, const float *cs, const float *sn, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cs[i] - b * sn[i];
        x[i + half] = b * cs[i] + a * sn[i];
    }
}

/* The activations of n rows for up to two matrices' needs (scratch buffers a and b),
 * each row prepared on its own (per token: batch invariance): int8 per group of the
 * matrix, or float rows; divided by the matrix's AWQ scale first where it has one (float
 * rows then copied, zero-padded to whole 64-blocks, into af / bf). A float-kind matrix
 * without a scale in int8 mode reads the source rows themselves. */
typedef struct { int n; int64_t group[2]; const float *xs[2]; int f32[2], mx[2]; sact a[2]; sact raw; } act_set;

typedef struct {
    const ck_backend_t *be;
    const float *x; int64_t ld, cols, group, cp, ng;
    int8_t *q; float *s; int32_t *sum;
    const float *xs; float *f; int64_t fld;   /* copy (/ xs) into f first, or f NULL */
    int mx;   /* for an mxfp4 matrix: the int8 rows then in ck_mx_act_order's order */
} quant_ctx;

/* row x (cols) / xs (or x) into f, zero-padded to fld */
static inline void scale_row(const float *x, const float *xs, int64_t cols, int64_t fld, float *f) {
    for (int64_t c = 0; c < cols; c++) f[c] = xs ? ck_ldf(x + c) / ck_ldf(xs + c) : ck_ldf(x + c);
    for (int64_t c = cols; c < fld; c++) f[c] = 0.0f;
}

static inline void quant_row(void *p, int64_t t) {
    quant_ctx *c = p;
    const float *x = c->x + t * c->ld;
    if (c->f) {
        scale_row(x, c->xs, c->cols, c->fld, c->f + t * c->fld);
        x = c->f + t * c->fld;
    }
    if (c->q)
        c->be->act_quant(x, c->cols, c->group, c->q + t * c->cp, c->s + t * c->ng,
                         c->sum + t * c->ng);
    if (c->q && c->mx) ck_mx_act_order(c->q + t * c->cp, c->cp);
}

static inline void quantize_rows(const ck_backend_t *be, const float *x, int64_t n, int64_t ld,
                          int64_t cols, int64_t group, int8_t *q, float *s, int32_t *sum,
                          int nth) {
    int64_t cp = rup(cols, group);
    quant_ctx c = {be, x, ld, cols, group, cp, cp / group, q, s, sum, NULL, NULL, 0, 0};
    ck_pool_for(quant_row, &c, n, n >= 16 ? nth : 1);
}

/* the activations of matrix w over rows x (n rows, ld apart, w->cols values each) */
static inline const sact *act_for(act_set *A, ck_sscratch *s, const ck_backend_t *be,
                             const float *x, int64_t n, int64_t ld, const wmat *w,
                             int nth, int *err) {
    const int f32 = s->act_f32 || is_float_kind(w->kind);
    const int64_t cols = w->cols, group = f32 ? 64 : w->group;
    const int mx = !f32 && w->kind == CK_W_MXFP4;   /* int8 rows in the mxfp4 tiles' order */
    if (f32 && !s->act_f32 && !w->xs) {      /* float weights, int8 mode: the rows as they are */
        A->raw = (sact){{0}, {x, ld, cols, NULL}, 0};
        return &A->raw;
    }
    for (int i = 0; i < A->n; i++)
        if (A->group[i] == group && A->xs[i] == w->xs && A->f32[i] == f32 && A->mx[i] == mx)
            return &A->a[i];
    int64_t cp = rup(cols, group);
    if (A->n == 2) { *err = CK_E_GROUPS; return NULL; }
    if (cp > s->cp_max || n > s->n_max) { *err = CK_E_SCRATCH; return NULL; }
    int i = A->n++;
    float *f = (f32 || w->xs) ? (i ? s->bf : s->af) : NULL;
    if ((f32 || w->xs) && !f) { *err = CK_E_SCRATCH; return NULL; }
    quant_ctx c = {be, x, ld, cols, group, cp, cp / group,
                   f32 ? NULL : i ? s->bq : s->aq, i ? s->bs : s->as, i ? s->bsum : s->asum,
                   w->xs, f, cp, mx};
    ck_pool_for(quant_row, &c, n, n >= 16 ? nth : 1);
    A->group[i] = group; A->xs[i] = w->xs; A->f32[i] = f32; A->mx[i] = mx;
    A->a[i] = (sact){{c.q, c.s, c.sum, cp, cp / group}, {f ? f : x, f ? cp : ld, cols, NULL}, !f32};
    return &A->a[i];
}

typedef struct { const float *x; const float *w; int64_t h; float eps; float *out; const float *b; } norm_ctx;

/* out = (x - mean) / sqrt(var + eps) * w + b (nn.LayerNorm; the sums in double) */
static inline void layernorm(const float *x, const float *w, const float *b, int64_t n,
                             float eps, float *out) {
    double s = 0.0, ss = 0.0;
    for (int64_t i = 0; i < n; i++) s += x[i];
    const double mean = s / (double)n;
    for (int64_t i = 0; i < n; i++) ss += ((double)x[i] - mean) * ((double)x[i] - mean);
    const double r = 1.0 / sqrt(ss / (double)n + (double)eps);
    for (int64_t i = 0; i < n; i++) out[i] = (float)(((double)x[i] - mean) * r) * w[i] + b[i];
}

static inline void norm_row(void *p, int64_t t) {
    norm_ctx *c = p;
    if (c->b) layernorm(c->x + t * c->h, c->w, c->b, c->h, c->eps, c->out + t * c->h);
    else rmsnorm(c->x + t * c->h, c->w, c->h, c->eps, c->out + t * c->h);
}

/* RMSNorm rows, or LayerNorm rows where b (the bias) is not NULL */
static inline void norm_rows_b(const float *x, const float *w, const float *b, int64_t n,
                               int64_t h, float eps, float *out, int nth) {
    norm_ctx c = {x, w, h, eps, out, b};
    ck_pool_for(norm_row, &c, n, n >= 16 ? nth : 1);
}

static inline void norm_rows(const float *x, const float *w, int64_t n, int64_t h, float eps,
                      float *out, int nth) {
    norm_rows_b(x, w, NULL, n, h, eps, out, nth);
}

/* ------------------------------------------------------------------ panels */

/* whether a step may run w against n tokens through the panels: the backend has them,
 * w is q4, from ck_panel_min_tokens tokens, and the scratch's panel rows hold the n tokens */
static inline int panels_fit(const ck_backend_t *be, const ck_sscratch *s, const wmat *w,
                             int64_t n) {
    return be->q4_panels && s->pq && !s->act_f32 &&
           (w->kind == CK_W_Q4 || (w->kind == CK_W_Q6 && be->q6_unpack)) && be->rt * 2 == CK_PANEL_ROWS &&
           n >= ck_panel_min_tokens && npanels(n) * CK_PANEL <= s->p_rows && w->q4.cp <= s->p_cp &&
           w->q4.cp <= CK_PANEL_MAX_CP;
}

typedef struct { const ck_act *a; int64_t n; uint8_t *q; float *s; } pack_ctx;

static inline void pack_lane(void *p, int64_t t) {
    pack_ctx *c = p;
    const ck_act *a = c->a;
    pack_panel_row(t < c->n ? a->q + t * a->cp : NULL, a->s + t * a->ng, a->cp, a->ng, c->q,
                   c->s, t);
}

/* the n rows of a (cp and ng as its matrices') into the scratch's panels */
static inline ck_panel pack_panels(const ck_act *a, int64_t n, ck_sscratch *s, int nth) {
    pack_ctx c = {a, n, s->pq, s->ps};
    ck_pool_for(pack_lane, &c, npanels(n) * CK_PANEL, n >= 64 ? nth : 1);
    return (ck_panel){s->pq, s->ps, a->cp, a->ng};
}

/* rows r0..r0+rt (rt <= CK_PANEL_ROWS) of w against the n tokens of panels p, as
 * rows_x_tokens (the same bits), in blocks of at most 64 panels */
static inline void rows_x_panels(const ck_backend_t *be, const wmat *w, int64_t r0, int rt,
                                 const ck_panel *p, int64_t n, emit_fn emit, void *ctx) {
    enum { BLOCK = 64 };
    const int64_t cp = w->q4.cp, ng = w->q4.ng;
    int8_t wb[CK_PANEL_ROWS * cp];
    int32_t wz[CK_PANEL_ROWS * ng];
    float res[CK_PANEL_ROWS * BLOCK * CK_PANEL];
    ck_unpacked u;
    unpack_rows_with(w->kind == CK_W_Q6 ? be->q6_unpack : be->q4_unpack, &w->q4, r0, rt, 0,
                     CK_PANEL_ROWS, &u, wb, wz);
    for (int64_t p0 = 0; p0 < npanels(n); p0 += BLOCK) {
        const int64_t np = min64(BLOCK, npanels(n) - p0), t0 = p0 * CK_PANEL;
        ck_panel pb = {p->q + p0 * CK_PANEL * p->cp, p->s + p0 * CK_PANEL * p->ng, p->cp, p->ng};
        be->q4_panels(&u, &pb, np, res, np * CK_PANEL);
        for (int r = 0; r < rt; r++)
            for (int64_t t = 0; t < min64(np * CK_PANEL, n - t0); t++)
                emit(ctx, t0 + t, r0 + r, res[r * np * CK_PANEL + t]);
    }
}

#endif
