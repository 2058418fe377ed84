/* ck_step.c -- the pipeline's C calls: n tokens of m sequences through one layer in
 * three calls (attention block, router, expert block), then the lm_head. The API is in
 * ck.h ("pipeline step"); colibri_core/pipeline.py drives it.
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
#include <math.h>
#include <stdlib.h>
#include "ck_internal.h"

static inline int64_t rup(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Chunks of a loop over `n` items of `item_bytes` of weights each: ~64 KB per chunk,
 * enough for the prefetchers to run ahead and for a claim (an atomic) to cost nothing. */
typedef struct { int64_t n, per; } chunks;

static chunks chunking(int64_t n, int64_t item_bytes) {
    int64_t per = 65536 / (item_bytes > 0 ? item_bytes : 1);
    per = per < 1 ? 1 : per > 64 ? 64 : per;
    return (chunks){n, per};
}

static inline int64_t nchunks(chunks c) { return (c.n + c.per - 1) / c.per; }
static inline int64_t chunk_end(chunks c, int64_t ch) { return min64((ch + 1) * c.per, c.n); }

/* threads for `work` multiply-adds, under the caller's cap (pipeline.py's thread control) */
static inline int nthreads(const ck_sscratch *s, int64_t work) {
    int n = ck_threads_for(work);
    return s->threads > 0 && s->threads < n ? s->threads : n;
}

static inline int64_t mat_bytes_per_row(const ck_mat *m) {
    return m->kind == CK_W_Q4 ? m->cols / 2 : m->cols;
}

/* ------------------------------------------------------------------ matrices */

typedef struct { int kind; ck_q4 q4; ck_q8 q8; int64_t rows, cols, group; } wmat;

static wmat to_w(const ck_mat *m) {
    wmat w;
    int64_t cp = rup(m->cols, m->group);
    memset(&w, 0, sizeof w);
    w.kind = m->kind;
    w.rows = m->rows; w.cols = m->cols; w.group = m->group;
    if (m->kind == CK_W_Q4)
        w.q4 = (ck_q4){m->data, m->scales, m->zeros, m->rows, m->cols, m->group, cp, cp / m->group};
    else
        w.q8 = (ck_q8){m->data, m->scales, m->rows, m->cols, m->group, cp, cp / m->group};
    return w;
}

static inline int64_t ntiles(int64_t rows, int rtp) { return (rows + rtp - 1) / rtp; }

/* rows r0..r0+rt of w against tokens 0..n of activations `a`, in token tiles (the
 * batch tiles from ck_core.c's switch point on, a short last tile token by token, as
 * ck_matmul); emit(ctx, t, r, value) receives each result. */
typedef void (*emit_fn)(void *ctx, int64_t t, int64_t r, float v);

static inline __attribute__((always_inline))
void rows_x_tokens(const ck_backend_t *be, const wmat *w, int64_t r0, int rt,
                          const ck_act *a, int64_t n, emit_fn emit, void *ctx) {
    const int ntp = ck_tokens_per_tile(be, n);
    float res[CK_MAX_RT * CK_MAX_NT];
    for (int64_t t0 = 0; t0 < n;) {
        int nt = ck_tile_tokens(ntp, n - t0);
        if (w->kind == CK_W_Q4) be->q4_i8(&w->q4, r0, rt, a, t0, nt, res);
        else be->q8_i8(&w->q8, r0, rt, a, t0, nt, res);
        for (int r = 0; r < rt; r++)
            for (int t = 0; t < nt; t++) emit(ctx, t0 + t, r0 + r, res[r * nt + t]);
        t0 += nt;
    }
}

/* ------------------------------------------------------------------ serial helpers */

/* out = x / sqrt(mean(x^2) + eps) * w (the sum of squares in double) */
static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *out) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] / r) * w[i];
}

static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};   /* eight independent sums: the compiler vectorizes them */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += ck_ldf(a + i + j) * ck_ldf(b + i + j);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += ck_ldf(a + i) * ck_ldf(b + i);
    return s;
}

/* rotate-half rope of one head (Hugging Face layout), in place */
static void rope(float *x, const float *cs, const float *sn, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cs[i] - b * sn[i];
        x[i + half] = b * cs[i] + a * sn[i];
    }
}

/* Int8 activations of n rows for up to two group sizes (scratch buffers a and b), each
 * row quantized on its own (per token: batch invariance). */
typedef struct { int n; int64_t group[2]; ck_act a[2]; } act_set;

typedef struct {
    const ck_backend_t *be;
    const float *x; int64_t ld, cols, group, cp, ng;
    int8_t *q; float *s; int32_t *sum;
} quant_ctx;

static void quant_row(void *p, int64_t t) {
    quant_ctx *c = p;
    c->be->act_quant(c->x + t * c->ld, c->cols, c->group, c->q + t * c->cp, c->s + t * c->ng,
                     c->sum + t * c->ng);
}

static void quantize_rows(const ck_backend_t *be, const float *x, int64_t n, int64_t ld,
                          int64_t cols, int64_t group, int8_t *q, float *s, int32_t *sum,
                          int nth) {
    int64_t cp = rup(cols, group);
    quant_ctx c = {be, x, ld, cols, group, cp, cp / group, q, s, sum};
    ck_pool_for(quant_row, &c, n, n >= 16 ? nth : 1);
}

static const ck_act *act_for(act_set *A, ck_sscratch *s, const ck_backend_t *be,
                             const float *x, int64_t n, int64_t cols, int64_t group,
                             int nth, int *err) {
    for (int i = 0; i < A->n; i++)
        if (A->group[i] == group) return &A->a[i];
    int64_t cp = rup(cols, group);
    if (A->n == 2) { *err = CK_E_GROUPS; return NULL; }
    if (cp > s->cp_max || n > s->n_max) { *err = CK_E_SCRATCH; return NULL; }
    int i = A->n++;
    int8_t *q = i ? s->bq : s->aq;
    float *sc = i ? s->bs : s->as;
    int32_t *sum = i ? s->bsum : s->asum;
    quantize_rows(be, x, n, cols, cols, group, q, sc, sum, nth);
    A->group[i] = group;
    A->a[i] = (ck_act){q, sc, sum, cp, cp / group};
    return &A->a[i];
}

/* ------------------------------------------------------------------ KV rows: f16, q8
 *
 * A cache stores its rows as f32, f16 or q8 (ck.h, CK_KV_*). f16 and q8 rows are written
 * once (when the token's key and value are made) and dequantized to float32 whenever a
 * later token attends over them; the attention is then the f32 one's arithmetic on the
 * dequantized rows (portable C, GCC vectorizes the row loops), so its result depends on
 * nothing but the token's own rows: batch invariant as the f32 path. The numpy
 * reference of the formats is quant.quantize_kv_q8 / dequantize_kv_q8 and numpy's
 * float16. */

/* float -> IEEE half, round to nearest even (as numpy's astype(float16)); no F16C or
 * FP16 instructions, so the same code runs on every x86-64 and aarch64 CPU */
static inline uint16_t f2h(float x) {
    uint32_t f;
    memcpy(&f, &x, 4);
    const uint32_t sign = f & 0x80000000u;
    f ^= sign;
    uint16_t o;
    if (f >= (uint32_t)(127 + 16) << 23) {              /* overflow, Inf, NaN */
        o = f > 255u << 23 ? 0x7e00 : 0x7c00;
    } else if (f < 113u << 23) {                         /* half subnormal or zero */
        const uint32_t magic_u = 126u << 23;             /* 0.5: its ulp is the half's */
        float fv, magic;
        memcpy(&fv, &f, 4); memcpy(&magic, &magic_u, 4);
        fv += magic;                                     /* rounds to nearest even */
        uint32_t u;
        memcpy(&u, &fv, 4);
        o = (uint16_t)(u - magic_u);
    } else {
        const uint32_t odd = (f >> 13) & 1;
        f += ((uint32_t)(15 - 127) << 23) + 0xfff + odd; /* rebias, round half to even */
        o = (uint16_t)(f >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

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

static inline size_t kv_elem(int kind) { return kind == CK_KV_F32 ? 4 : kind == CK_KV_F16 ? 2 : 1; }

/* one row of d values into the storage type; q8: symmetric, scale max|x| / 127, codes
 * rint(x * (1/scale)) clamped to +-127 (ck_scalar_act_quant's rule for one group) */
static void kv_store_row(int kind, const float *x, int64_t d, void *dst, float *scale) {
    if (kind == CK_KV_F32) {
        memcpy(dst, x, (size_t)d * sizeof(float));
    } else if (kind == CK_KV_F16) {
        uint16_t *o = dst;
        for (int64_t i = 0; i < d; i++) o[i] = f2h(x[i]);
    } else {
        int8_t *o = dst;
        float amax = 0.0f;
        int nan = 0;
        for (int64_t i = 0; i < d; i++) {
            float a = fabsf(x[i]);
            amax = fmaxf(amax, a);
            nan |= a != a;
        }
        float s = nan ? NAN : amax / 127.0f;
        float inv = s > 0.0f ? 1.0f / s : 0.0f;
        for (int64_t i = 0; i < d; i++) {
            float v = rintf(x[i] * inv);
            v = v > -127.0f ? v : -127.0f;
            v = v < 127.0f ? v : 127.0f;
            o[i] = (int8_t)v;
        }
        ck_stf(scale, s);
    }
}

static void kv_load_row(int kind, const void *src, float scale, int64_t d, float *out) {
    if (kind == CK_KV_F16) {
        const uint16_t *h = src;
        for (int64_t i = 0; i < d; i++) out[i] = h2f(h[i]);
    } else if (kind == CK_KV_Q8) {
        const int8_t *q = src;
        for (int64_t i = 0; i < d; i++) out[i] = (float)q[i] * scale;
    } else {
        memcpy(out, src, (size_t)d * sizeof(float));
    }
}

/* attention of g query heads over len f16/q8 rows (row p at k + p*ld values, its scale
 * at ks[p * (ld/d)]): scores q.k * scale, softmax (ck_scalar.c's), the weighted sum of
 * the v rows; s [g, len] scratch */
static void kv_attn(int kind, const float *q, int g, int64_t d, const void *k, const void *v,
                    const float *ks, const float *vs, int64_t ld, int64_t len, float scale,
                    float *s, float *out) {
    const size_t es = kv_elem(kind);
    const int64_t sld = ld / d;
    float row[d > 0 ? d : 1];
    for (int64_t p = 0; p < len; p++) {
        kv_load_row(kind, (const char *)k + (size_t)(p * ld) * es, ks ? ck_ldf(ks + p * sld) : 0.0f,
                    d, row);
        for (int h = 0; h < g; h++) s[h * len + p] = dot_f32(q + h * d, row, d) * scale;
    }
    ck_softmax_rows(s, g, len);
    for (int64_t i = 0; i < g * d; i++) out[i] = 0.0f;
    for (int64_t p = 0; p < len; p++) {
        kv_load_row(kind, (const char *)v + (size_t)(p * ld) * es, vs ? ck_ldf(vs + p * sld) : 0.0f,
                    d, row);
        for (int h = 0; h < g; h++) {
            const float w = s[h * len + p];
            float *o = out + h * d;
            for (int64_t i = 0; i < d; i++) o[i] = o[i] + w * row[i];
        }
    }
}

void ck_kv_store(int kind, const float *src, int64_t n, int64_t d, void *dst, float *scales) {
    for (int64_t r = 0; r < n; r++)
        kv_store_row(kind, src + r * d, d, (char *)dst + (size_t)(r * d) * kv_elem(kind),
                     scales ? scales + r : NULL);
}

void ck_kv_load(int kind, const void *src, const float *scales, int64_t n, int64_t d, float *dst) {
    for (int64_t r = 0; r < n; r++)
        kv_load_row(kind, (const char *)src + (size_t)(r * d) * kv_elem(kind),
                    scales ? ck_ldf(scales + r) : 0.0f, d, dst + r * d);
}

int ck_kv_attention(int kind, const float *q, int g, int64_t d, const void *k, const void *v,
                    const float *ks, const float *vs, int64_t ld, int64_t len, float scale,
                    float *out) {
    if (kind != CK_KV_F16 && kind != CK_KV_Q8) return CK_E_SCRATCH;
    if (kind == CK_KV_Q8 && (!ks || !vs)) return CK_E_SCRATCH;
    float *s = malloc((size_t)(g * len) * sizeof(float));
    if (!s) return CK_E_MEMORY;
    kv_attn(kind, q, g, d, k, v, ks, vs, ld, len, scale, s, out);
    free(s);
    return 0;
}

/* ------------------------------------------------------------------ attention block */

typedef struct {
    const ck_backend_t *be;
    const ck_attn_layer *L;
    ck_sscratch *s;
    wmat w[4];                 /* q, k, v, o */
    const ck_act *act[3];      /* xn for q, k, v */
    ck_act ao;                 /* the attention output, for o */
    int64_t nt[3];             /* row tiles of q, k, v */
    chunks qkv, o;
    float *x;
    int64_t n, layer;
    const int64_t *tok;        /* [n, CK_TOK_COLS] (ck.h) */
    float scale;
    int m;                     /* the matrix being emitted (qkv) */
} attn_ctx;

static void emit_q(void *p, int64_t t, int64_t r, float v) {
    attn_ctx *c = p;
    ck_stf(c->s->q + t * c->L->nh * c->L->d + r, c->L->bq ? v + c->L->bq[r] : v);
}
static void emit_k(void *p, int64_t t, int64_t r, float v) {
    attn_ctx *c = p;
    ck_stf(c->s->k + t * c->L->nkv * c->L->d + r, c->L->bk ? v + c->L->bk[r] : v);
}
static void emit_v(void *p, int64_t t, int64_t r, float v) {
    attn_ctx *c = p;
    ck_stf(c->s->v + t * c->L->nkv * c->L->d + r, c->L->bv ? v + c->L->bv[r] : v);
}
static void emit_o(void *p, int64_t t, int64_t r, float v) {
    attn_ctx *c = p;
    float *x = c->x + t * c->L->hidden + r;
    *x = *x + v;
}

/* q, k, v: the three matrices' row tiles as one loop, all tokens per tile */
static void qkv_chunk(void *p, int64_t ch) {
    attn_ctx *c = p;
    static const emit_fn emits[3] = {emit_q, emit_k, emit_v};
    const int rtp = c->be->rt;
    for (int64_t i = ch * c->qkv.per; i < chunk_end(c->qkv, ch); i++) {
        int m = i < c->nt[0] ? 0 : i < c->nt[0] + c->nt[1] ? 1 : 2;
        int64_t r0 = (i - (m == 0 ? 0 : m == 1 ? c->nt[0] : c->nt[0] + c->nt[1])) * rtp;
        int rt = (int)min64(rtp, c->w[m].rows - r0);
        rows_x_tokens(c->be, &c->w[m], r0, rt, c->act[m], c->n, emits[m], c);
    }
}

/* the token's cache (which: 0 keys, 1 values) at layer `layer`, position 0 (bytes), and
 * its scales (q8; else NULL) */
static inline char *cache_layer(const int64_t *tk, int which, int64_t layer) {
    return (char *)(uintptr_t)tk[1 + which] + (size_t)(layer * tk[3]) * kv_elem((int)tk[4]);
}
static inline float *scales_layer(const int64_t *tk, int which, int64_t layer, int64_t d) {
    return tk[4] == CK_KV_Q8 ? (float *)(uintptr_t)tk[5 + which] + layer * (tk[3] / d) : NULL;
}

/* token t: q/k norms, rope, and its key and value into its cache row */
static void rope_chunk(void *p, int64_t t) {
    attn_ctx *c = p;
    const ck_attn_layer *L = c->L;
    ck_sscratch *s = c->s;
    const int64_t d = L->d, half = d / 2, nh = L->nh, nkv = L->nkv;
    const int64_t *tk = c->tok + CK_TOK_COLS * t;
    float *q = s->q + t * nh * d, *k = s->k + t * nkv * d, *v = s->v + t * nkv * d;
    if (L->qk_norm == 2) {                         /* over the whole projection */
        rmsnorm(q, L->q_norm, nh * d, L->eps, q);
        rmsnorm(k, L->k_norm, nkv * d, L->eps, k);
    } else if (L->qk_norm == 1) {                  /* per head */
        for (int64_t h = 0; h < nh; h++) rmsnorm(q + h * d, L->q_norm, d, L->eps, q + h * d);
        for (int64_t h = 0; h < nkv; h++) rmsnorm(k + h * d, L->k_norm, d, L->eps, k + h * d);
    }
    float cs[half > 0 ? half : 1], sn[half > 0 ? half : 1];
    for (int64_t i = 0; i < half; i++) {
        double ang = (double)tk[0] * L->inv_freq[i];
        cs[i] = (float)(cos(ang) * L->rope_factor);
        sn[i] = (float)(sin(ang) * L->rope_factor);
    }
    for (int64_t h = 0; h < nh; h++) rope(q + h * d, cs, sn, half);
    for (int64_t h = 0; h < nkv; h++) rope(k + h * d, cs, sn, half);
    const int kind = (int)tk[4];
    const size_t es = kv_elem(kind);
    char *kc = cache_layer(tk, 0, c->layer), *vc = cache_layer(tk, 1, c->layer);
    float *ks = scales_layer(tk, 0, c->layer, d), *vs = scales_layer(tk, 1, c->layer, d);
    for (int64_t h = 0; h < nkv; h++) {            /* row (pos, h) of the cache */
        int64_t r = tk[0] * nkv + h;
        kv_store_row(kind, k + h * d, d, kc + (size_t)(r * d) * es, ks ? ks + r : NULL);
        kv_store_row(kind, v + h * d, d, vc + (size_t)(r * d) * es, vs ? vs + r : NULL);
    }
}

/* token t = i / nkv, kv head j = i % nkv: attention of its query heads over rows 0..pos */
static void head_chunk(void *p, int64_t i) {
    attn_ctx *c = p;
    const ck_attn_layer *L = c->L;
    ck_sscratch *s = c->s;
    const int64_t d = L->d, nkv = L->nkv, g = L->nh / nkv, t = i / nkv, j = i % nkv;
    const int64_t *tk = c->tok + CK_TOK_COLS * t;
    const int64_t len = tk[0] + 1;
    const int kind = (int)tk[4];
    const size_t es = kv_elem(kind);
    const char *kc = cache_layer(tk, 0, c->layer) + (size_t)(j * d) * es;
    const char *vc = cache_layer(tk, 1, c->layer) + (size_t)(j * d) * es;
    const float *ks = scales_layer(tk, 0, c->layer, d), *vs = scales_layer(tk, 1, c->layer, d);
    float stack[g * len <= 16384 ? g * len : 1];
    float *sc = g * len <= 16384 ? stack : malloc((size_t)(g * len) * sizeof(float));
    if (!sc) { s->failed = 1; return; }
    const float *q = s->q + (t * L->nh + j * g) * d;
    float *out = s->att + (t * L->nh + j * g) * d;
    if (kind == CK_KV_F32)                         /* the backend's vector attention */
        c->be->attn(q, (int)g, d, (const float *)kc, (const float *)vc, nkv * d, len,
                    c->scale, sc, out);
    else
        kv_attn(kind, q, (int)g, d, kc, vc, ks ? ks + j : NULL, vs ? vs + j : NULL, nkv * d,
                len, c->scale, sc, out);
    if (sc != stack) free(sc);
}

static void o_chunk(void *p, int64_t ch) {
    attn_ctx *c = p;
    const int rtp = c->be->rt;
    for (int64_t i = ch * c->o.per; i < chunk_end(c->o, ch); i++) {
        int64_t r0 = i * rtp;
        rows_x_tokens(c->be, &c->w[3], r0, (int)min64(rtp, c->w[3].rows - r0), &c->ao, c->n,
                      emit_o, c);
    }
}

typedef struct { const float *x; const float *w; int64_t h; float eps; float *out; } norm_ctx;

static void norm_row(void *p, int64_t t) {
    norm_ctx *c = p;
    rmsnorm(c->x + t * c->h, c->w, c->h, c->eps, c->out + t * c->h);
}

static void norm_rows(const float *x, const float *w, int64_t n, int64_t h, float eps,
                      float *out, int nth) {
    norm_ctx c = {x, w, h, eps, out};
    ck_pool_for(norm_row, &c, n, n >= 16 ? nth : 1);
}

int ck_step_attention(const ck_attn_layer *a, int64_t layer, float *x, int64_t n,
                      const int64_t *tok, float *xn_out, ck_sscratch *s) {
    const ck_backend_t *be = ck_active_backend();
    attn_ctx c;
    int err = 0;
    memset(&c, 0, sizeof c);
    if (n > s->n_max) return CK_E_SCRATCH;
    if (n <= 0) return 0;
    for (int64_t t = 0; t < n; t++) {              /* the caches' storage types */
        const int64_t *tk = tok + CK_TOK_COLS * t;
        if (tk[4] < CK_KV_F32 || tk[4] > CK_KV_Q8 || (tk[4] == CK_KV_Q8 && (!tk[5] || !tk[6])))
            return CK_E_SCRATCH;
    }
    c.be = be; c.L = a; c.s = s; c.x = x; c.n = n; c.layer = layer; c.tok = tok;
    c.scale = a->scale;
    c.w[0] = to_w(&a->wq); c.w[1] = to_w(&a->wk); c.w[2] = to_w(&a->wv); c.w[3] = to_w(&a->wo);
    if (rup(c.w[3].cols, c.w[3].group) > s->cp_max) return CK_E_SCRATCH;
    int64_t work = 0;
    for (int m = 0; m < 4; m++) work += c.w[m].rows * c.w[m].cols;
    work *= n;
    const int nth = nthreads(s, work);
    norm_rows(x, a->norm, n, a->hidden, a->eps, s->xn, nth);
    act_set A = {0};
    for (int m = 0; m < 3 && !err; m++)
        c.act[m] = act_for(&A, s, be, s->xn, n, a->hidden, c.w[m].group, nth, &err);
    if (err) return err;
    const int rtp = be->rt;
    for (int m = 0; m < 3; m++) c.nt[m] = ntiles(c.w[m].rows, rtp);
    c.qkv = chunking(c.nt[0] + c.nt[1] + c.nt[2], n * rtp * mat_bytes_per_row(&a->wq));
    c.o = chunking(ntiles(c.w[3].rows, rtp), n * rtp * mat_bytes_per_row(&a->wo));
    ck_pool_for(qkv_chunk, &c, nchunks(c.qkv), nth);
    ck_pool_for(rope_chunk, &c, n, n >= 8 ? nth : 1);
    int64_t ctx_work = 0;
    for (int64_t t = 0; t < n; t++) ctx_work += 2 * a->nh * a->d * (tok[CK_TOK_COLS * t] + 1);
    s->failed = 0;
    ck_pool_for(head_chunk, &c, n * a->nkv, nthreads(s, ctx_work));
    if (s->failed) return CK_E_MEMORY;
    /* the o projection's input, quantized per token (buffer a: q, k, v are done with it) */
    const wmat *wo = &c.w[3];
    int64_t cpo = rup(wo->cols, wo->group);
    quantize_rows(be, s->att, n, wo->cols, wo->cols, wo->group, s->aq, s->as, s->asum, nth);
    c.ao = (ck_act){s->aq, s->as, s->asum, cpo, cpo / wo->group};
    ck_pool_for(o_chunk, &c, nchunks(c.o), nth);
    norm_rows(x, a->ffn_norm, n, a->hidden, a->eps, xn_out, nth);
    return 0;
}

/* ------------------------------------------------------------------ MLA attention block
 *
 * DeepSeek's multi-head latent attention in the absorbed form (mla.py has the math and
 * the reference): the cache holds per position the normed latent c [r] and the rotated
 * k_pe [rope]; per head the query's nope part is absorbed into latent space through
 * W_UK, scores are q_lat . c + q_pe . k_pe, and the output W_UV (sum p c). */

typedef struct {
    const ck_backend_t *be;
    const ck_mla_layer *L;
    ck_sscratch *s;
    int64_t n, layer, per;     /* tokens; the layer; floats of scratch per token */
    const int64_t *tok;
    float *x;
    /* projections of one loop: up to two matrices over the same activations */
    int nm;
    wmat w[2];
    const ck_act *act[2];
    float *out[2];
    int64_t ld[2], nt0;
    chunks ch;
} mla_ctx;

/* per-token scratch: q [nh*(nope+rope)], qa [q_lora], kv [r+rope], q_lat [nh*r],
 * o_lat [nh*r], out [nh*v] */
static inline float *mla_q(const mla_ctx *c, int64_t t) { return c->s->mla + t * c->per; }
static inline float *mla_qa(const mla_ctx *c, int64_t t) {
    const ck_mla_layer *L = c->L;
    return mla_q(c, t) + L->nh * (L->nope + L->rope);
}
static inline float *mla_kv(const mla_ctx *c, int64_t t) { return mla_qa(c, t) + c->L->q_lora; }
static inline float *mla_qlat(const mla_ctx *c, int64_t t) {
    return mla_kv(c, t) + c->L->r + c->L->rope;
}
static inline float *mla_olat(const mla_ctx *c, int64_t t) { return mla_qlat(c, t) + c->L->nh * c->L->r; }
static inline float *mla_out(const mla_ctx *c, int64_t t) { return mla_olat(c, t) + c->L->nh * c->L->r; }

int64_t ck_step_mla_floats(const ck_mla_layer *L) {
    return L->nh * (L->nope + L->rope) + L->q_lora + L->r + L->rope + 2 * L->nh * L->r + L->nh * L->v;
}

static void emit_m0(void *p, int64_t t, int64_t r, float v) {
    mla_ctx *c = p;
    c->out[0][t * c->ld[0] + r] = v;
}
static void emit_m1(void *p, int64_t t, int64_t r, float v) {
    mla_ctx *c = p;
    c->out[1][t * c->ld[1] + r] = v;
}
static void emit_mo(void *p, int64_t t, int64_t r, float v) {
    mla_ctx *c = p;
    float *x = c->x + t * c->L->hidden + r;
    *x = *x + v;
}

static void mla_mats_chunk(void *p, int64_t ch) {
    mla_ctx *c = p;
    const int rtp = c->be->rt;
    for (int64_t i = ch * c->ch.per; i < chunk_end(c->ch, ch); i++) {
        int m = c->nm > 1 && i >= c->nt0;
        int64_t r0 = (m ? i - c->nt0 : i) * rtp;
        rows_x_tokens(c->be, &c->w[m], r0, (int)min64(rtp, c->w[m].rows - r0), c->act[m], c->n,
                      m ? emit_m1 : emit_m0, c);
    }
}

static void mla_o_chunk(void *p, int64_t ch) {
    mla_ctx *c = p;
    const int rtp = c->be->rt;
    for (int64_t i = ch * c->ch.per; i < chunk_end(c->ch, ch); i++) {
        int64_t r0 = i * rtp;
        rows_x_tokens(c->be, &c->w[0], r0, (int)min64(rtp, c->w[0].rows - r0), c->act[0], c->n,
                      emit_mo, c);
    }
}

/* one or two matrices against the same token rows: out_m[t * ld_m + row] */
static void mla_project(mla_ctx *c, int nm, const ck_mat *m0, const ck_act *a0, float *o0,
                        int64_t ld0, const ck_mat *m1, const ck_act *a1, float *o1, int64_t ld1,
                        int nth) {
    const int rtp = c->be->rt;
    c->nm = nm;
    c->w[0] = to_w(m0); c->act[0] = a0; c->out[0] = o0; c->ld[0] = ld0;
    c->nt0 = ntiles(c->w[0].rows, rtp);
    int64_t items = c->nt0;
    if (nm > 1) {
        c->w[1] = to_w(m1); c->act[1] = a1; c->out[1] = o1; c->ld[1] = ld1;
        items += ntiles(c->w[1].rows, rtp);
    }
    c->ch = chunking(items, c->n * rtp * mat_bytes_per_row(m0));
    ck_pool_for(mla_mats_chunk, c, nchunks(c->ch), nth);
}

/* rope of one rope-part vector in place: rotate-half, or DeepSeek's interleaved pairs
 * written de-interleaved (ops.apply_rope) */
static void mla_rope(float *x, const float *cs, const float *sn, int64_t half, int interleave) {
    if (!interleave) { rope(x, cs, sn, half); return; }
    float tmp[half > 0 ? 2 * half : 1];
    for (int64_t i = 0; i < half; i++) {
        float a = x[2 * i], b = x[2 * i + 1];
        tmp[i] = a * cs[i] - b * sn[i];
        tmp[i + half] = b * cs[i] + a * sn[i];
    }
    memcpy(x, tmp, (size_t)(2 * half) * sizeof(float));
}

/* token t: latent c and k_pe into its cache row, rope of q_pe, q_lat = q_nope W_UK */
static void mla_token_chunk(void *p, int64_t t) {
    mla_ctx *c = p;
    const ck_mla_layer *L = c->L;
    const int64_t nh = L->nh, N = L->nope, R = L->rope, r = L->r, V = L->v, half = R / 2;
    const int64_t *tk = c->tok + CK_TOK_COLS * t;
    const int64_t cap = tk[3] / r;
    float *q = mla_q(c, t), *kv = mla_kv(c, t), *ql = mla_qlat(c, t);
    float cs[half > 0 ? half : 1], sn[half > 0 ? half : 1];
    for (int64_t i = 0; i < half; i++) {
        double ang = (double)tk[0] * L->inv_freq[i];
        cs[i] = (float)(cos(ang) * L->rope_factor);
        sn[i] = (float)(sin(ang) * L->rope_factor);
    }
    float *crow = (float *)(uintptr_t)tk[1] + c->layer * cap * r + tk[0] * r;
    float *krow = (float *)(uintptr_t)tk[2] + c->layer * cap * R + tk[0] * R;
    rmsnorm(kv, L->kv_a_norm, r, L->lora_eps, crow);
    memcpy(krow, kv + r, (size_t)R * sizeof(float));
    mla_rope(krow, cs, sn, half, L->interleave);
    for (int64_t h = 0; h < nh; h++) {
        float *qh = q + h * (N + R);
        mla_rope(qh + N, cs, sn, half, L->interleave);
        const float *wuk = L->wkv_b + h * (N + V) * r;          /* [N, r] of head h */
        float *o = ql + h * r;
        for (int64_t j = 0; j < r; j++) o[j] = 0.0f;
        for (int64_t i = 0; i < N; i++) {
            const float a = qh[i], *w = wuk + i * r;
            for (int64_t j = 0; j < r; j++) o[j] += a * w[j];
        }
    }
}

/* token t = i / nh, head h = i % nh: scores over rows 0..pos, o_lat, then out = W_UV o_lat */
static void mla_head_chunk(void *p, int64_t i) {
    mla_ctx *c = p;
    const ck_mla_layer *L = c->L;
    const int64_t nh = L->nh, N = L->nope, R = L->rope, r = L->r, V = L->v;
    const int64_t t = i / nh, h = i % nh;
    const int64_t *tk = c->tok + CK_TOK_COLS * t;
    const int64_t cap = tk[3] / r, len = tk[0] + 1;
    const float *cc = (const float *)(uintptr_t)tk[1] + c->layer * cap * r;
    const float *kp = (const float *)(uintptr_t)tk[2] + c->layer * cap * R;
    const float *ql = mla_qlat(c, t) + h * r, *qp = mla_q(c, t) + h * (N + R) + N;
    float stack[len <= 16384 ? len : 1];
    float *sc = len <= 16384 ? stack : malloc((size_t)len * sizeof(float));
    if (!sc) { c->s->failed = 1; return; }
    float m = -INFINITY;
    for (int64_t j = 0; j < len; j++) {
        float v = (dot_f32(ql, cc + j * r, r) + dot_f32(qp, kp + j * R, R)) * L->scale;
        sc[j] = v;
        m = v > m ? v : m;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < len; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
    const float inv = (float)(1.0 / sum);
    float *o = mla_olat(c, t) + h * r;
    for (int64_t k = 0; k < r; k++) o[k] = 0.0f;
    for (int64_t j = 0; j < len; j++) {
        const float pj = sc[j] * inv, *row = cc + j * r;
        for (int64_t k = 0; k < r; k++) o[k] += pj * row[k];
    }
    if (sc != stack) free(sc);
    const float *wuv = L->wkv_b + (h * (N + V) + N) * r;      /* [V, r] of head h */
    float *out = mla_out(c, t) + h * V;
    for (int64_t k = 0; k < V; k++) out[k] = dot_f32(wuv + k * r, o, r);
}

typedef struct { const mla_ctx *c; const float *w; int64_t off, cols; float eps; } lnorm_ctx;

static void qa_norm_row(void *p, int64_t t) {
    lnorm_ctx *k = p;
    float *qa = mla_qa(k->c, t);
    rmsnorm(qa, k->w, k->cols, k->eps, qa);
}

int ck_step_mla_attention(const ck_mla_layer *a, int64_t layer, float *x, int64_t n,
                          const int64_t *tok, float *xn_out, ck_sscratch *s) {
    const ck_backend_t *be = ck_active_backend();
    mla_ctx c;
    int err = 0;
    memset(&c, 0, sizeof c);
    if (n > s->n_max || ck_step_mla_floats(a) > s->mla_per_token) return CK_E_SCRATCH;
    if (n <= 0) return 0;
    c.be = be; c.L = a; c.s = s; c.n = n; c.layer = layer; c.tok = tok; c.x = x;
    c.per = s->mla_per_token;
    const int lora = a->wq_a.data != NULL;
    const ck_mat *wq_first = lora ? &a->wq_a : &a->wq;
    int64_t work = n * (wq_first->rows * wq_first->cols + a->wkv_a.rows * a->wkv_a.cols +
                        a->wo.rows * a->wo.cols + (lora ? a->wq_b.rows * a->wq_b.cols : 0));
    const int nth = nthreads(s, work);
    norm_rows(x, a->norm, n, a->hidden, a->eps, s->xn, nth);
    act_set A = {0};
    const ck_act *aq = act_for(&A, s, be, s->xn, n, a->hidden, wq_first->group, nth, &err);
    const ck_act *akv = err ? NULL : act_for(&A, s, be, s->xn, n, a->hidden, a->wkv_a.group, nth, &err);
    if (err) return err;
    /* q (or q_a) and kv_a in one loop */
    float *q0 = lora ? mla_qa(&c, 0) : mla_q(&c, 0);
    mla_project(&c, 2, wq_first, aq, q0, c.per, &a->wkv_a, akv, mla_kv(&c, 0), c.per, nth);
    if (lora) {                                    /* q = wq_b(rmsnorm(q_a)) */
        lnorm_ctx k = {&c, a->q_a_norm, 0, a->q_lora, a->lora_eps};
        ck_pool_for(qa_norm_row, &k, n, n >= 16 ? nth : 1);
        int64_t cp = rup(a->q_lora, a->wq_b.group);
        if (cp > s->cp_max) return CK_E_SCRATCH;
        quantize_rows(be, mla_qa(&c, 0), n, c.per, a->q_lora, a->wq_b.group, s->bq, s->bs,
                      s->bsum, nth);
        ck_act ab = {s->bq, s->bs, s->bsum, cp, cp / a->wq_b.group};
        mla_project(&c, 1, &a->wq_b, &ab, mla_q(&c, 0), c.per, NULL, NULL, NULL, 0, nth);
    }
    ck_pool_for(mla_token_chunk, &c, n, n >= 4 ? nth : 1);
    int64_t ctx_work = 0;
    for (int64_t t = 0; t < n; t++) ctx_work += a->nh * (a->r + a->rope) * 2 * (tok[CK_TOK_COLS * t] + 1);
    s->failed = 0;
    ck_pool_for(mla_head_chunk, &c, n * a->nh, nthreads(s, ctx_work));
    if (s->failed) return CK_E_MEMORY;
    /* o projection of out [n, nh*v], quantized per token */
    const int64_t vcols = a->nh * a->v, cpo = rup(vcols, a->wo.group);
    if (cpo > s->cp_max) return CK_E_SCRATCH;
    quantize_rows(be, mla_out(&c, 0), n, c.per, vcols, a->wo.group, s->aq, s->as, s->asum, nth);
    c.w[0] = to_w(&a->wo);
    ck_act ao = {s->aq, s->as, s->asum, cpo, cpo / a->wo.group};
    c.act[0] = &ao;
    c.ch = chunking(ntiles(a->wo.rows, be->rt), n * be->rt * mat_bytes_per_row(&a->wo));
    ck_pool_for(mla_o_chunk, &c, nchunks(c.ch), nth);
    norm_rows(x, a->ffn_norm, n, a->hidden, a->eps, xn_out, nth);
    return 0;
}

/* ------------------------------------------------------------------ routing */

typedef struct { const ck_router *r; const float *xn; float *logits; int bad; } logit_ctx;

static void logit_row(void *p, int64_t t) {
    logit_ctx *c = p;
    const ck_router *r = c->r;
    for (int64_t i = 0; i < r->e; i++) {
        float v = dot_f32(c->xn + t * r->h, r->weight + i * r->h, r->h);
        if (r->bias) v += ck_ldf(r->bias + i);
        if (!isfinite(v)) c->bad = 1;
        c->logits[t * r->e + i] = v;
    }
}

/* one token's top-k and fixed-point softmax weights (routing.route, mode "fixed") */
static void route_fixed(const ck_router *r, const float *logits, int k, int64_t *ids,
                        float *weights, int have_ids) {
    const int64_t e = r->e;
    const int64_t *exp2_q30 = r->exp2_q30;
    float m = -INFINITY;
    for (int64_t i = 0; i < e; i++) m = logits[i] > m ? logits[i] : m;
    /* top k, largest first, ties to the lower index (ops.top_k) */
    for (int j = 0; j < k && !have_ids; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < e; i++) {
            int taken = 0;
            for (int q = 0; q < j; q++) taken |= ids[q] == i;
            if (!taken && (best < 0 || logits[i] > logits[best])) best = i;
        }
        ids[j] = best;
    }
    /* fixed-point softmax over all experts (routing.fixed_point_softmax_weights) */
    int64_t total = 0, sel[256];
    for (int64_t i = 0; i < e; i++) {
        double dd = (double)(logits[i] - m) * 1.4426950408889634;
        double fx = nearbyint(-dd * 1024.0);
        if (fx > 62.0 * 1024.0) fx = 62.0 * 1024.0;
        int64_t f = (int64_t)fx, shift = f >> 10;
        int64_t ex = exp2_q30[f & 1023] >> (shift < 62 ? shift : 62);
        total += ex;
        for (int j = 0; j < k; j++)
            if (ids[j] == i) sel[j] = ex;
    }
    double w[256], sum = 0.0;
    for (int j = 0; j < k; j++) {
        int64_t wq = (sel[j] << 16) / (total > 1 ? total : 1);
        w[j] = (double)(float)((double)wq / 65536.0);
        sum += w[j];
    }
    for (int j = 0; j < k; j++) {
        double v = r->norm_topk ? w[j] / (sum > 1e-20 ? sum : 1e-20) : w[j];
        weights[j] = (float)(v * r->scaling);
    }
}

/* largest of v[0..e) not yet taken, ties to the lower index; -inf only when nothing
 * else is left (ops.top_k: a stable sort of -v) */
static int64_t best_of(const double *v, int64_t e, const int64_t *taken, int ntaken) {
    int64_t best = -1;
    for (int64_t i = 0; i < e; i++) {
        int used = 0;
        for (int q = 0; q < ntaken; q++) used |= taken[q] == i;
        if (!used && (best < 0 || v[i] > v[best])) best = i;
    }
    return best;
}

/* one token's choice as routing.route for every other mode: float softmax or sigmoid
 * scores (double), the selection bias, group-limited selection (groups scored by their
 * best value, or with sigmoid scores the sum of their best two), weights = the chosen
 * scores (or the fixed-point softmax), renormalized when norm_topk, times scaling */
static void route_general(const ck_router *r, const float *logits, int k, int64_t *ids,
                          float *weights) {
    const int64_t e = r->e;
    double prob[e > 0 ? e : 1], sel[e > 0 ? e : 1];
    double m = -INFINITY, sum = 0.0;
    for (int64_t i = 0; i < e; i++) m = logits[i] > m ? logits[i] : m;
    for (int64_t i = 0; i < e; i++) {
        const double l = (double)logits[i], b = r->select_bias ? (double)ck_ldf(r->select_bias + i) : 0.0;
        if (r->scoring == CK_ROUTE_SIGMOID) {
            prob[i] = 1.0 / (1.0 + exp(-l));
            sel[i] = prob[i] + b;
        } else {
            prob[i] = exp(l - m);
            sum += prob[i];
            sel[i] = l + b;
        }
    }
    if (r->scoring != CK_ROUTE_SIGMOID)
        for (int64_t i = 0; i < e; i++) prob[i] /= sum;
    if (r->n_group > 1 && r->topk_group < r->n_group) {
        const int64_t gsz = e / r->n_group;
        double gs[r->n_group];
        int64_t keep[r->n_group];
        for (int64_t g = 0; g < r->n_group; g++) {
            double b1 = -INFINITY, b2 = -INFINITY;
            for (int64_t i = g * gsz; i < (g + 1) * gsz; i++) {
                if (sel[i] > b1) { b2 = b1; b1 = sel[i]; } else if (sel[i] > b2) b2 = sel[i];
            }
            gs[g] = r->scoring == CK_ROUTE_SIGMOID ? b2 + b1 : b1;   /* np.sort's top two */
        }
        for (int q = 0; q < r->topk_group; q++) keep[q] = best_of(gs, r->n_group, keep, q);
        for (int64_t g = 0; g < r->n_group; g++) {
            int kept = 0;
            for (int q = 0; q < r->topk_group; q++) kept |= keep[q] == g;
            if (!kept)
                for (int64_t i = g * gsz; i < (g + 1) * gsz; i++) sel[i] = -INFINITY;
        }
    }
    for (int j = 0; j < k; j++) ids[j] = best_of(sel, e, ids, j);
    if (r->scoring == CK_ROUTE_FIXED) {          /* the fixed-point weights, then as below */
        route_fixed(r, logits, k, ids, weights, 1);
        return;
    }
    double w[256], tot = 0.0;
    for (int j = 0; j < k; j++) { w[j] = prob[ids[j]]; tot += w[j]; }
    for (int j = 0; j < k; j++) {
        double v = r->norm_topk ? w[j] / (tot > 1e-20 ? tot : 1e-20) : w[j];
        weights[j] = (float)(v * r->scaling);
    }
}

int ck_step_route(const ck_router *r, const float *xn, int64_t n, const int32_t *k, int kmax,
                  float *logits, int64_t *ids, float *weights, int from_logits) {
    logit_ctx c = {r, xn, logits, 0};
    if (kmax < 0 || kmax > 256 || kmax > r->e) return CK_E_SCRATCH;
    if (from_logits) {
        for (int64_t i = 0; i < n * r->e; i++) c.bad |= !isfinite(logits[i]);
    } else {
        ck_pool_for(logit_row, &c, n, n >= 16 ? ck_threads_for(n * r->e * r->h) : 1);
    }
    if (c.bad) return CK_E_NONFINITE;
    if (!ids) return 0;                         /* logits only: pipeline.py routes */
    const int plain = r->scoring == CK_ROUTE_FIXED && !r->select_bias &&
                      !(r->n_group > 1 && r->topk_group < r->n_group);
    for (int64_t t = 0; t < n; t++) {
        int kt = k[t];
        if (kt < 1 || kt > kmax) return CK_E_SCRATCH;
        if (plain) route_fixed(r, logits + t * r->e, kt, ids + t * kmax, weights + t * kmax, 0);
        else route_general(r, logits + t * r->e, kt, ids + t * kmax, weights + t * kmax);
        for (int j = kt; j < kmax; j++) { ids[t * kmax + j] = -1; weights[t * kmax + j] = 0.0f; }
    }
    return 0;
}

/* ------------------------------------------------------------------ expert block
 *
 * The (token, expert) pairs of the step are grouped by expert, ascending id: a job is one
 * expert (or the shared one) with its tokens, whose rows sit side by side in the scratch
 * (pairs off .. off + cnt), so each expert's weights stream once per step for all of
 * its tokens. Jobs go in pieces of at most `pairs_max` pairs:
 *   gather: each pair's token's quantized xn row, copied to the pair's scratch row;
 *   stage 1: gate and up, row tiles x the job's tokens: h = silu(gate) * up;
 *   hquant: h quantized per pair;
 *   stage 2: down, per output row tile, the piece's jobs in order, added to x. */

typedef struct {
    wmat w1, w3, w2;
    int64_t off, cnt;         /* its pairs in the scratch */
    int64_t t1, t2;           /* its first stage-1 item, first hquant item */
} ffn_job;

typedef struct {
    const ck_backend_t *be;
    ck_sscratch *s;
    ffn_job *jobs;
    int m;                    /* jobs in this piece */
    chunks s1, s2;
    int64_t hidden;
    const int64_t *pair_tok;  /* [pairs_max] the token of scratch row p */
    const float *pair_w;      /* [pairs_max] its routing weight */
    const ck_act *xa;         /* xn quantized per token (group of w1) */
    ck_act ga;                /* gathered: row p = xa's row pair_tok[p] */
    float *x;
} ffn_ctx;

static inline int job_of(const ffn_ctx *c, int64_t i, int first_stage) {
    int j = 0;
    while (j + 1 < c->m && i >= (first_stage ? c->jobs[j + 1].t1 : c->jobs[j + 1].t2)) j++;
    return j;
}

static void gather_row(void *p, int64_t q) {
    ffn_ctx *c = p;
    const ck_act *a = c->xa;
    int64_t t = c->pair_tok[q];
    memcpy((int8_t *)c->ga.q + q * a->cp, a->q + t * a->cp, (size_t)a->cp);
    memcpy((float *)c->ga.s + q * a->ng, a->s + t * a->ng, (size_t)a->ng * sizeof(float));
    memcpy((int32_t *)c->ga.sum + q * a->ng, a->sum + t * a->ng, (size_t)a->ng * sizeof(int32_t));
}

/* stage 1: rows r0..r0+rt of gate and up for the job's tokens */
static void up_tile(const ffn_ctx *c, const ffn_job *f, int64_t r0, int rt) {
    const ck_backend_t *be = c->be;
    const ck_sscratch *s = c->s;
    const int ntp = ck_tokens_per_tile(be, f->cnt);
    float g[CK_MAX_RT * CK_MAX_NT], u[CK_MAX_RT * CK_MAX_NT];
    ck_act a = c->ga;
    a.q += f->off * a.cp; a.s += f->off * a.ng; a.sum += f->off * a.ng;
    for (int64_t t0 = 0; t0 < f->cnt;) {
        int nt = ck_tile_tokens(ntp, f->cnt - t0);
        be->q4_i8(&f->w1.q4, r0, rt, &a, t0, nt, g);
        be->q4_i8(&f->w3.q4, r0, rt, &a, t0, nt, u);
        for (int r = 0; r < rt; r++)
            for (int t = 0; t < nt; t++)
                s->h[(f->off + t0 + t) * s->hld + r0 + r] = ck_silu(g[r * nt + t]) * u[r * nt + t];
        t0 += nt;
    }
}

static void up_chunk(void *p, int64_t ch) {
    ffn_ctx *c = p;
    const int rtp = c->be->rt;
    int64_t i0 = ch * c->s1.per, i1 = chunk_end(c->s1, ch);
    int j = job_of(c, i0, 1);
    for (int64_t i = i0; i < i1; i++) {
        while (j + 1 < c->m && i >= c->jobs[j + 1].t1) j++;
        const ffn_job *f = &c->jobs[j];
        int64_t r0 = (i - f->t1) * rtp;
        up_tile(c, f, r0, (int)min64(rtp, f->w1.rows - r0));
    }
}

/* h of pair row q quantized for its job's w2 */
static void hquant_chunk(void *p, int64_t i) {
    ffn_ctx *c = p;
    const ck_sscratch *s = c->s;
    int j = job_of(c, i, 0);
    const ffn_job *f = &c->jobs[j];
    int64_t q = f->off + (i - f->t2);
    c->be->act_quant(s->h + q * s->hld, f->w2.cols, f->w2.group, s->hq + q * s->hcp,
                     s->hs + q * (s->hcp / 64), s->hsum + q * (s->hcp / 64));
}

/* stage 2: output rows r0.. of every job of the piece, in job order, added to x */
static void down_chunk(void *p, int64_t ch) {
    ffn_ctx *c = p;
    const ck_backend_t *be = c->be;
    const ck_sscratch *s = c->s;
    const int rtp = be->rt;
    float y[CK_MAX_RT * CK_MAX_NT];
    for (int64_t i = ch * c->s2.per; i < chunk_end(c->s2, ch); i++) {
        int64_t r0 = i * rtp;
        int rt = (int)min64(rtp, c->hidden - r0);
        for (int q = 0; q < c->m; q++) {
            const ffn_job *f = &c->jobs[q];
            /* h rows are the scratch's hcp apart (the tile reads row t at q + t * cp and
             * its scales at s + t * ng; the group count is the matrix's) */
            const int64_t hng = s->hcp / 64;
            ck_act a = {s->hq + f->off * s->hcp, s->hs + f->off * hng, s->hsum + f->off * hng,
                        s->hcp, hng};
            const int ntp = ck_tokens_per_tile(be, f->cnt);
            for (int64_t t0 = 0; t0 < f->cnt;) {
                int nt = ck_tile_tokens(ntp, f->cnt - t0);
                be->q4_i8(&f->w2.q4, r0, rt, &a, t0, nt, y);
                for (int t = 0; t < nt; t++) {
                    int64_t pq = f->off + t0 + t;
                    float wt = c->pair_w[pq];
                    float *xr = c->x + c->pair_tok[pq] * c->hidden + r0;
                    for (int r = 0; r < rt; r++) xr[r] = xr[r] + y[r * nt + t] * wt;
                }
                t0 += nt;
            }
        }
    }
}

/* runs jobs [j0, j1) (their pairs fit the scratch) */
static int run_piece(ffn_ctx *c, ffn_job *jobs, int m, int nth) {
    const ck_backend_t *be = c->be;
    if (m == 0) return 0;
    int64_t np = jobs[m - 1].off + jobs[m - 1].cnt;   /* rows of h in the piece */
    int64_t t1 = 0, t2 = 0, work = 0, down_row = 0;
    for (int q = 0; q < m; q++) {
        jobs[q].t1 = t1; jobs[q].t2 = t2;
        t1 += ntiles(jobs[q].w1.rows, be->rt);
        t2 += jobs[q].cnt;
        work += 3 * jobs[q].w1.rows * c->hidden * jobs[q].cnt;
        down_row += jobs[q].w2.cols / 2;
    }
    c->jobs = jobs; c->m = m;
    c->s1 = chunking(t1, 2 * be->rt * c->hidden / 2 * (np / m > 0 ? np / m : 1));
    c->s2 = chunking(ntiles(c->hidden, be->rt), be->rt * down_row);
    nth = nthreads(c->s, work) < nth ? nthreads(c->s, work) : nth;
    ck_pool_for(up_chunk, c, nchunks(c->s1), nth);
    ck_pool_for(hquant_chunk, c, t2, np >= 16 ? nth : 1);
    ck_pool_for(down_chunk, c, nchunks(c->s2), nth);
    return 0;
}

int64_t ck_step_job_bytes(void) { return (int64_t)sizeof(ffn_job); }

int ck_step_experts(const ck_ffn_block *b, const float *xn, int64_t n, const int64_t *ids,
                    const float *weights, int kmax, float *x, ck_sscratch *s) {
    const ck_backend_t *be = ck_active_backend();
    const ck_ffn *table = b->table, *shared = b->shared;
    const int64_t hidden = b->hidden, ne = b->n_table;
    if (n <= 0) return 0;
    if (n > s->n_max) return CK_E_SCRATCH;
    /* count the pairs per expert (a pair: token t chose expert e in slot j) */
    int64_t *count = s->counts;                       /* [n_table + 1] */
    memset(count, 0, (size_t)(ne + 1) * sizeof(int64_t));
    int64_t npairs = 0;
    for (int64_t t = 0; t < n; t++)
        for (int j = 0; j < kmax; j++) {
            int64_t e = ids[t * kmax + j];
            if (e < 0 || e >= ne || !table[e].w1.data) continue;   /* none or a vacant slot */
            count[e]++;
            npairs++;
        }
    int64_t nsh = shared ? n : 0;
    if (npairs + nsh == 0) return 0;
    /* the jobs, ascending expert id, then the shared expert */
    int njobs = 0;
    for (int64_t e = 0; e < ne; e++) njobs += count[e] > 0;
    njobs += shared != NULL;
    if (njobs > s->jobs_max) return CK_E_SCRATCH;
    ffn_job *jobs = (ffn_job *)s->jobs;
    int64_t *first = s->counts + ne + 1;              /* [n_table]: each expert's first pair */
    int64_t off = 0;
    int q = 0;
    for (int64_t e = 0; e < ne; e++) {
        if (!count[e]) continue;
        const ck_ffn *f = &table[e];
        jobs[q] = (ffn_job){to_w(&f->w1), to_w(&f->w3), to_w(&f->w2), off, count[e], 0, 0};
        first[e] = off;
        off += count[e];
        q++;
    }
    /* the pair rows in token order within each expert */
    int64_t *pair_tok = s->pair_tok;
    float *pair_w = s->pair_w;
    int64_t total = npairs + nsh;
    if (total > s->pairs_total_max) return CK_E_SCRATCH;
    for (int64_t t = 0; t < n; t++)
        for (int j = 0; j < kmax; j++) {
            int64_t e = ids[t * kmax + j];
            if (e < 0 || e >= ne || !table[e].w1.data) continue;
            int64_t p = first[e]++;
            pair_tok[p] = t;
            pair_w[p] = ck_ldf(weights + t * kmax + j);
        }
    if (shared) {
        jobs[q] = (ffn_job){to_w(&shared->w1), to_w(&shared->w3), to_w(&shared->w2), off, n, 0, 0};
        for (int64_t t = 0; t < n; t++) {
            float gd = b->shared_gate ? dot_f32(xn + t * hidden, b->shared_gate, hidden) : 0.0f;
            pair_tok[off + t] = t;
            pair_w[off + t] = b->shared_gate ? 1.0f / (1.0f + expf(-gd)) : 1.0f;
        }
        q++;
    }
    /* checks: one input group for all, scratch sizes */
    int64_t group = jobs[0].w1.group;
    for (int i = 0; i < njobs; i++) {
        ffn_job *f = &jobs[i];
        if (f->w1.kind != CK_W_Q4 || f->w3.kind != CK_W_Q4 || f->w2.kind != CK_W_Q4)
            return CK_E_SCRATCH;
        if (f->w1.group != group || f->w3.group != group) return CK_E_GROUPS;
        if (f->w1.rows > s->hld || rup(f->w2.cols, f->w2.group) > s->hcp || f->w2.group % 64)
            return CK_E_SCRATCH;
    }
    int64_t work = 0;
    for (int i = 0; i < njobs; i++) work += 3 * jobs[i].w1.rows * hidden * jobs[i].cnt;
    int nth = nthreads(s, work);
    act_set A = {0};
    int err = 0;
    ffn_ctx c;
    memset(&c, 0, sizeof c);
    c.be = be; c.s = s; c.hidden = hidden; c.x = x; c.pair_tok = pair_tok; c.pair_w = pair_w;
    c.xa = act_for(&A, s, be, xn, n, hidden, group, nth, &err);
    if (err) return err;
    /* pieces of whole jobs within pairs_max rows of h (a job larger than that alone: its
     * tokens in turn, which changes nothing for any token: a token's sum is per expert) */
    int i = 0;
    while (i < njobs) {
        int j = i;
        int64_t rows = 0;
        while (j < njobs && (rows + jobs[j].cnt <= s->pairs_max || j == i)) rows += jobs[j++].cnt;
        if (rows > s->pairs_max) {                      /* one big job: split its tokens */
            ffn_job big = jobs[i];
            for (int64_t t0 = 0; t0 < big.cnt; t0 += s->pairs_max) {
                ffn_job part = big;
                part.off = 0;
                part.cnt = min64(s->pairs_max, big.cnt - t0);
                c.pair_tok = pair_tok + big.off + t0;
                c.pair_w = pair_w + big.off + t0;
                c.ga = (ck_act){s->gq, s->gs, s->gsum, c.xa->cp, c.xa->ng};
                ck_pool_for(gather_row, &c, part.cnt, part.cnt >= 64 ? nth : 1);
                run_piece(&c, &part, 1, nth);
            }
            c.pair_tok = pair_tok; c.pair_w = pair_w;
            i = j;
            continue;
        }
        int64_t base = jobs[i].off;                     /* the piece's rows from 0 */
        for (int q2 = i; q2 < j; q2++) jobs[q2].off -= base;
        c.pair_tok = pair_tok + base;
        c.pair_w = pair_w + base;
        c.ga = (ck_act){s->gq, s->gs, s->gsum, c.xa->cp, c.xa->ng};
        ck_pool_for(gather_row, &c, rows, rows >= 64 ? nth : 1);
        run_piece(&c, jobs + i, j - i, nth);
        c.pair_tok = pair_tok; c.pair_w = pair_w;
        i = j;
    }
    return 0;
}

/* ------------------------------------------------------------------ lm_head */

typedef struct { const ck_backend_t *be; wmat w; const ck_act *a; float *out; int64_t n; chunks ch; } head_ctx;

static void emit_logit(void *p, int64_t t, int64_t r, float v) {
    head_ctx *c = p;
    c->out[t * c->w.rows + r] = v;
}

static void lm_chunk(void *p, int64_t ch) {
    head_ctx *c = p;
    const int rtp = c->be->rt;
    for (int64_t i = ch * c->ch.per; i < chunk_end(c->ch, ch); i++) {
        int64_t r0 = i * rtp;
        rows_x_tokens(c->be, &c->w, r0, (int)min64(rtp, c->w.rows - r0), c->a, c->n, emit_logit, c);
    }
}

int ck_step_head(const ck_mat *w, const float *norm, float eps, const float *x, int64_t n,
                 float *logits, ck_sscratch *s) {
    const ck_backend_t *be = ck_active_backend();
    if (n > s->n_max) return CK_E_SCRATCH;
    if (n <= 0) return 0;
    head_ctx c = {be, to_w(w), NULL, logits, n,
                  chunking(ntiles(w->rows, be->rt), n * be->rt * mat_bytes_per_row(w))};
    act_set A = {0};
    int err = 0;
    int nth = nthreads(s, n * w->rows * w->cols);
    norm_rows(x, norm, n, w->cols, eps, s->xn, nth);
    c.a = act_for(&A, s, be, s->xn, n, w->cols, w->group, nth, &err);
    if (err) return err;
    ck_pool_for(lm_chunk, &c, nchunks(c.ch), nth);
    return 0;
}

/* ------------------------------------------------------------------ small pieces */

void ck_mat_row(const ck_mat *w, int64_t r, float *out) {
    int64_t cp = rup(w->cols, w->group), ng = cp / w->group;
    const float *s = w->scales + r * ng;
    if (w->kind == CK_W_Q4) {
        const uint8_t *d = (const uint8_t *)w->data + r * (cp / 2), *z = w->zeros + r * ng;
        for (int64_t c = 0; c < w->cols; c++) {
            int64_t j = c % 64;
            uint8_t b = d[(c / 64) * 32 + (j & 31)];
            double q = j < 32 ? (b & 0x0F) : (b >> 4);
            int64_t g = c / w->group;
            ck_stf(out + c, (float)((q - (double)z[g]) * (double)ck_ldf(s + g)));
        }
    } else {
        const int8_t *d = (const int8_t *)w->data + r * cp;
        for (int64_t c = 0; c < w->cols; c++)
            ck_stf(out + c, (float)((double)d[c] * (double)ck_ldf(s + c / w->group)));
    }
}
