/* ck_step_attn.c -- the pipeline step's attention blocks (ck.h, "pipeline step";
 * shared pieces in ck_step.h): grouped-query attention over KV rows stored as f32, f16 or
 * q8, and DeepSeek's multi-head latent attention. */
#include "ck_step.h"

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
    const sact *act[3];        /* xn for q, k, v */
    const sact *ao;            /* the attention output, for o */
    int64_t nt[3];             /* row items of q, k, v */
    int rti;                   /* rows per item: CK_PANEL_ROWS with panels, else be->rt */
    int pan[4];                /* matrix m runs the panels (of act[0], then of ao) */
    ck_panel p;
    chunks qkv, o;
    float *x;
    int64_t n, layer;
    const int64_t *tok;        /* [n, CK_TOK_COLS] (ck.h) */
    float scale;
    float oscale;              /* the output's factor (out_scale) */
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
    *x = *x + v * c->oscale;                        /* x 1.0f: the same bits */
}

/* rows r0..r0+rti of matrix m for all tokens: the panels, or tiles of be->rt rows */
static void item_rows(attn_ctx *c, int m, int64_t r0, const sact *a, emit_fn emit) {
    const int64_t r1 = min64(r0 + c->rti, c->w[m].rows);
    if (c->pan[m]) {
        rows_x_panels(c->be, &c->w[m], r0, (int)(r1 - r0), &c->p, c->n, emit, c);
        return;
    }
    for (; r0 < r1; r0 += c->be->rt)
        rows_x_tokens(c->be, &c->w[m], r0, (int)min64(c->be->rt, r1 - r0), a, c->n, emit, c);
}

/* q, k, v: the three matrices' row items as one loop, all tokens per item */
static void qkv_chunk(void *p, int64_t ch) {
    attn_ctx *c = p;
    static const emit_fn emits[3] = {emit_q, emit_k, emit_v};
    for (int64_t i = ch * c->qkv.per; i < chunk_end(c->qkv, ch); i++) {
        int m = i < c->nt[0] ? 0 : i < c->nt[0] + c->nt[1] ? 1 : 2;
        int64_t r0 = (i - (m == 0 ? 0 : m == 1 ? c->nt[0] : c->nt[0] + c->nt[1])) * c->rti;
        item_rows(c, m, r0, c->act[m], emits[m]);
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
    const int64_t d = L->d, half = (L->rot > 0 ? L->rot : d) / 2, nh = L->nh, nkv = L->nkv;
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

/* kv head j = i / n, token t = i % n: attention of its query heads over rows 0..pos.
 * Head-major: a thread's consecutive items are one head's consecutive tokens, which
 * re-read the rows the previous token read from cache; token-major, every item streamed
 * its rows from memory (a 2,048-token prompt of OLMoE-1B-7B: 34 GB a layer). */
static void head_chunk(void *p, int64_t i) {
    attn_ctx *c = p;
    const ck_attn_layer *L = c->L;
    ck_sscratch *s = c->s;
    const int64_t d = L->d, nkv = L->nkv, g = L->nh / nkv, t = i % c->n, j = i / c->n;
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
    for (int64_t i = ch * c->o.per; i < chunk_end(c->o, ch); i++)
        item_rows(c, 3, i * c->rti, c->ao, emit_o);
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
    c.oscale = a->out_scale != 0.0f ? a->out_scale : 1.0f;
    if (a->rot < 0 || a->rot > a->d || a->rot % 2) return CK_E_SCRATCH;
    c.w[0] = to_w(&a->wq); c.w[1] = to_w(&a->wk); c.w[2] = to_w(&a->wv); c.w[3] = to_w(&a->wo);
    if (rup(c.w[3].cols, is_float_kind(c.w[3].kind) ? 64 : c.w[3].group) > s->cp_max)
        return CK_E_SCRATCH;
    int64_t work = 0;
    for (int m = 0; m < 4; m++) work += c.w[m].rows * c.w[m].cols;
    work *= n;
    const int nth = nthreads(s, work);
    norm_rows(x, a->norm, n, a->hidden, a->eps, s->xn, nth);
    act_set A = {0};
    for (int m = 0; m < 3 && !err; m++)
        c.act[m] = act_for(&A, s, be, s->xn, n, a->hidden, &c.w[m], nth, &err);
    if (err) return err;
    /* the panels (AVX-512 batches) for the matrices over the first activations, and o */
    for (int m = 0; m < 4; m++) c.pan[m] = panels_fit(be, s, &c.w[m], n) && (m == 3 || c.act[m] == c.act[0]);
    const int rti = c.rti = c.pan[0] || c.pan[3] ? CK_PANEL_ROWS : be->rt;
    if (c.pan[0]) c.p = pack_panels(&c.act[0]->q, n, s, nth);
    for (int m = 0; m < 3; m++) c.nt[m] = ntiles(c.w[m].rows, rti);
    c.qkv = chunking(c.nt[0] + c.nt[1] + c.nt[2], n * rti * mat_bytes_per_row(&a->wq));
    c.o = chunking(ntiles(c.w[3].rows, rti), n * rti * mat_bytes_per_row(&a->wo));
    ck_pool_for(qkv_chunk, &c, nchunks(c.qkv), nth);
    ck_pool_for(rope_chunk, &c, n, n >= 8 ? nth : 1);
    int64_t ctx_work = 0;
    for (int64_t t = 0; t < n; t++) ctx_work += 2 * a->nh * a->d * (tok[CK_TOK_COLS * t] + 1);
    s->failed = 0;
    ck_pool_for(head_chunk, &c, n * a->nkv, nthreads(s, CK_ATTN_MAC_COST * ctx_work));
    if (s->failed) return CK_E_MEMORY;
    /* the o projection's input, per token (buffers a, b: q, k, v are done with them) */
    act_set B = {0};
    c.ao = act_for(&B, s, be, s->att, n, c.w[3].cols, &c.w[3], nth, &err);
    if (err) return err;
    if (c.pan[3]) c.p = pack_panels(&c.ao->q, n, s, nth);
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
    const sact *act[2];
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
static void mla_project(mla_ctx *c, int nm, const ck_mat *m0, const sact *a0, float *o0,
                        int64_t ld0, const ck_mat *m1, const sact *a1, float *o1, int64_t ld1,
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

/* row i of wkv_b as float32: the float copy's, or (over the float budget) dequantized
 * into buf [r], its AWQ scale divided out */
static inline const float *wkv_b_row(const ck_mla_layer *L, int64_t i, float *buf) {
    if (L->wkv_b) return L->wkv_b + i * L->r;
    ck_mat_row(&L->wkv_b_q, i, buf);
    const float *xs = L->wkv_b_q.act_scale;
    if (xs)
        for (int64_t j = 0; j < L->r; j++) buf[j] /= ck_ldf(xs + j);
    return buf;
}

/* token t: latent c and k_pe into its cache row, rope of q_pe (q_lat: mla_absorb_chunk) */
static void mla_token_chunk(void *p, int64_t t) {
    mla_ctx *c = p;
    const ck_mla_layer *L = c->L;
    const int64_t nh = L->nh, N = L->nope, R = L->rope, r = L->r, half = R / 2;
    const int64_t *tk = c->tok + CK_TOK_COLS * t;
    const int64_t cap = tk[3] / r;
    float *q = mla_q(c, t), *kv = mla_kv(c, t);
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
    for (int64_t h = 0; h < nh; h++) mla_rope(q + h * (N + R) + N, cs, sn, half, L->interleave);
}

/* token t = i / nh, head h = i % nh: its q_nope absorbed into latent space through W_UK
 * (a loop of its own so that a decode token's heads run on every thread) */
static void mla_absorb_chunk(void *p, int64_t i) {
    mla_ctx *c = p;
    const ck_mla_layer *L = c->L;
    const int64_t nh = L->nh, N = L->nope, R = L->rope, r = L->r, V = L->v;
    const int64_t t = i / nh, h = i % nh;
    const float *qh = mla_q(c, t) + h * (N + R);
    float *o = mla_qlat(c, t) + h * r, buf[r];
    for (int64_t j = 0; j < r; j++) o[j] = 0.0f;
    for (int64_t k = 0; k < N; k++) {                   /* W_UK: rows h*(N+V) .. +N */
        const float a = qh[k], *w = wkv_b_row(L, h * (N + V) + k, buf);
        for (int64_t j = 0; j < r; j++) o[j] += a * w[j];
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
    float *out = mla_out(c, t) + h * V, buf[r];              /* W_UV: rows h*(N+V)+N .. +V */
    for (int64_t k = 0; k < V; k++) out[k] = dot_f32(wkv_b_row(L, h * (N + V) + N + k, buf), o, r);
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
    const wmat wq0 = to_w(wq_first), wkva = to_w(&a->wkv_a);
    const sact *aq = act_for(&A, s, be, s->xn, n, a->hidden, &wq0, nth, &err);
    const sact *akv = err ? NULL : act_for(&A, s, be, s->xn, n, a->hidden, &wkva, nth, &err);
    if (err) return err;
    /* q (or q_a) and kv_a in one loop */
    float *q0 = lora ? mla_qa(&c, 0) : mla_q(&c, 0);
    mla_project(&c, 2, wq_first, aq, q0, c.per, &a->wkv_a, akv, mla_kv(&c, 0), c.per, nth);
    if (lora) {                                    /* q = wq_b(rmsnorm(q_a)) */
        lnorm_ctx k = {&c, a->q_a_norm, 0, a->q_lora, a->lora_eps};
        ck_pool_for(qa_norm_row, &k, n, n >= 16 ? nth : 1);
        act_set B = {0};
        const wmat wqb = to_w(&a->wq_b);
        const sact *ab = act_for(&B, s, be, mla_qa(&c, 0), n, c.per, &wqb, nth, &err);
        if (err) return err;
        mla_project(&c, 1, &a->wq_b, ab, mla_q(&c, 0), c.per, NULL, NULL, NULL, 0, nth);
    }
    ck_pool_for(mla_token_chunk, &c, n, n >= 4 ? nth : 1);
    ck_pool_for(mla_absorb_chunk, &c, n * a->nh,
                nthreads(s, CK_ATTN_MAC_COST * n * a->nh * a->nope * a->r));
    int64_t ctx_work = 0;
    for (int64_t t = 0; t < n; t++) ctx_work += a->nh * (a->r + a->rope) * 2 * (tok[CK_TOK_COLS * t] + 1);
    s->failed = 0;
    ck_pool_for(mla_head_chunk, &c, n * a->nh, nthreads(s, CK_ATTN_MAC_COST * ctx_work));
    if (s->failed) return CK_E_MEMORY;
    /* o projection of out [n, nh*v], quantized per token */
    act_set B = {0};
    c.w[0] = to_w(&a->wo);
    c.act[0] = act_for(&B, s, be, mla_out(&c, 0), n, c.per, &c.w[0], nth, &err);
    if (err) return err;
    c.ch = chunking(ntiles(a->wo.rows, be->rt), n * be->rt * mat_bytes_per_row(&a->wo));
    ck_pool_for(mla_o_chunk, &c, nchunks(c.ch), nth);
    norm_rows(x, a->ffn_norm, n, a->hidden, a->eps, xn_out, nth);
    return 0;
}

