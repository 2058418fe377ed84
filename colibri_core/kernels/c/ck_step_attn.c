/* ck_step_attn.c -- the pipeline step's attention block (ck.h, "pipeline step"; shared pieces
 * in ck_step.h): grouped-query attention over KV rows stored as f32, f16 or q8, with a
 * window or chunk per layer, attention sinks and layers without rope (issue 32).
 * DeepSeek's multi-head latent attention is ck_step_mla.c. */
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
/* with the output projection's bias (a function of its own: no test per value) */
static void emit_o_bias(void *p, int64_t t, int64_t r, float v) {
    attn_ctx *c = p;
    float *x = c->x + t * c->L->hidden + r;
    *x = *x + (v + c->L->bo[r]) * c->oscale;
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

/* x / sqrt(mean(x^2) + eps), in place (a weightless RMSNorm; the sum in double) */
static void unit_rms(float *x, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] / r;
}

/* the first position a token at `pos` attends to: its window's or its chunk's */
static inline int64_t span_start(const ck_attn_layer *L, int64_t pos) {
    int64_t s = 0;
    if (L->window > 0 && pos - L->window + 1 > s) s = pos - L->window + 1;
    if (L->chunk > 0 && pos - pos % L->chunk > s) s = pos - pos % L->chunk;
    return s;
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
    if (!L->no_rope) {
        float cs[half > 0 ? half : 1], sn[half > 0 ? half : 1];
        for (int64_t i = 0; i < half; i++) {
            double ang = (double)tk[0] * L->inv_freq[i];
            cs[i] = (float)(cos(ang) * L->rope_factor);
            sn[i] = (float)(sin(ang) * L->rope_factor);
        }
        for (int64_t h = 0; h < nh; h++) rope(q + h * d, cs, sn, half);
        for (int64_t h = 0; h < nkv; h++) rope(k + h * d, cs, sn, half);
    }
    if (L->qk_norm == 3) {                         /* weightless, per head, after rope */
        for (int64_t h = 0; h < nh; h++) unit_rms(q + h * d, d, L->eps);
        for (int64_t h = 0; h < nkv; h++) unit_rms(k + h * d, d, L->eps);
    }
    if (L->no_rope && L->temp_floor > 0.0f) {      /* Llama 4's temperature tuning */
        const float f = (float)(log1p(floor(((double)tk[0] + 1.0) / L->temp_floor)) *
                                L->temp_scale + 1.0);
        for (int64_t i = 0; i < nh * d; i++) q[i] *= f;
    }
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

/* An attention sink: the head's softmax had exp(sink) more in its denominator, which
 * scales its output by S / (S + e^sink), S the sum of exp(scores). The attention leaves
 * the probabilities p = exp(z - lse) in s (every backend's attn and kv_attn do), so
 * lse = z_m - log(p_m) from the best position m (p_m >= 1/len: no underflow), its score
 * z_m recomputed: the factor 1 / (1 + p_m exp(sink - z_m)), one dot product a head. */
static void apply_sink(int kind, const float *q, int64_t d, const void *k, const float *ks,
                       int64_t ld, int64_t len, float scale, const float *p, float sink,
                       float *out) {
    int64_t m = 0;
    for (int64_t j = 1; j < len; j++) m = p[j] > p[m] ? j : m;
    float row[d > 0 ? d : 1];
    kv_load_row(kind, (const char *)k + (size_t)(m * ld) * kv_elem(kind),
                ks ? ck_ldf(ks + m * (ld / d)) : 0.0f, d, row);
    const double z = (double)dot_f32(q, row, d) * scale;
    const float f = (float)(1.0 / (1.0 + (double)p[m] * exp((double)sink - z)));
    for (int64_t i = 0; i < d; i++) out[i] *= f;
}

/* kv head j = i / n, token t = i % n: attention of its query heads over rows p0..pos
 * (p0: span_start, 0 without a window or chunk).
 * Head-major: a thread's consecutive items are one head's consecutive tokens, which
 * re-read the rows the previous token read from cache; token-major, every item streamed
 * its rows from memory (a 2,048-token prompt of OLMoE-1B-7B: 34 GB a layer). */
static void head_chunk(void *p, int64_t i) {
    attn_ctx *c = p;
    const ck_attn_layer *L = c->L;
    ck_sscratch *s = c->s;
    const int64_t d = L->d, nkv = L->nkv, g = L->nh / nkv, t = i % c->n, j = i / c->n;
    const int64_t *tk = c->tok + CK_TOK_COLS * t;
    const int64_t p0 = span_start(L, tk[0]), len = tk[0] + 1 - p0;
    const int kind = (int)tk[4];
    const size_t es = kv_elem(kind);
    const char *kc = cache_layer(tk, 0, c->layer) + (size_t)((p0 * nkv + j) * d) * es;
    const char *vc = cache_layer(tk, 1, c->layer) + (size_t)((p0 * nkv + j) * d) * es;
    const float *ks = scales_layer(tk, 0, c->layer, d), *vs = scales_layer(tk, 1, c->layer, d);
    if (ks) { ks += p0 * nkv; vs += p0 * nkv; }
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
    if (L->sinks)
        for (int64_t h = 0; h < g; h++)
            apply_sink(kind, q + h * d, d, kc, ks ? ks + j : NULL, nkv * d, len, c->scale,
                       sc + h * len, L->sinks[j * g + h], out + h * d);
    if (sc != stack) free(sc);
}

static void o_chunk(void *p, int64_t ch) {
    attn_ctx *c = p;
    for (int64_t i = ch * c->o.per; i < chunk_end(c->o, ch); i++)
        item_rows(c, 3, i * c->rti, c->ao, emit_o);
}
static void o_chunk_bias(void *p, int64_t ch) {
    attn_ctx *c = p;
    for (int64_t i = ch * c->o.per; i < chunk_end(c->o, ch); i++)
        item_rows(c, 3, i * c->rti, c->ao, emit_o_bias);
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
    if (a->rot < 0 || a->rot > a->d || a->rot % 2 || a->window < 0 || a->chunk < 0)
        return CK_E_SCRATCH;
    c.w[0] = to_w(&a->wq); c.w[1] = to_w(&a->wk); c.w[2] = to_w(&a->wv); c.w[3] = to_w(&a->wo);
    if (rup(c.w[3].cols, is_float_kind(c.w[3].kind) ? 64 : c.w[3].group) > s->cp_max)
        return CK_E_SCRATCH;
    int64_t work = 0;
    for (int m = 0; m < 4; m++) work += c.w[m].rows * c.w[m].cols;
    work *= n;
    const int nth = nthreads(s, work);
    norm_rows_b(x, a->norm, a->norm_b, n, a->hidden, a->eps, s->xn, nth);
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
    for (int64_t t = 0; t < n; t++) {
        const int64_t pos = tok[CK_TOK_COLS * t];
        ctx_work += 2 * a->nh * a->d * (pos + 1 - span_start(a, pos));
    }
    s->failed = 0;
    ck_pool_for(head_chunk, &c, n * a->nkv, nthreads(s, CK_ATTN_MAC_COST * ctx_work));
    if (s->failed) return CK_E_MEMORY;
    /* the o projection's input, per token (buffers a, b: q, k, v are done with them) */
    act_set B = {0};
    c.ao = act_for(&B, s, be, s->att, n, c.w[3].cols, &c.w[3], nth, &err);
    if (err) return err;
    if (c.pan[3]) c.p = pack_panels(&c.ao->q, n, s, nth);
    ck_pool_for(a->bo ? o_chunk_bias : o_chunk, &c, nchunks(c.o), nth);
    norm_rows_b(x, a->ffn_norm, a->ffn_norm_b, n, a->hidden, a->eps, xn_out, nth);
    return 0;
}

/* ------------------------------------------------------------------ ck_attention_decode
 *
 * ck.h's standalone decode attention (tests, benchmarks): the active backend's attn per kv
 * head and its query heads, kv heads spread over the pool's threads */

typedef struct {
    const ck_backend_t *be;
    const float *q, *k, *v;
    float *out, *scores;
    int64_t nh, d, nkv, len;
    float scale;
} decode_attn_ctx;

static void decode_attn_head(void *p, int64_t j) {   /* one kv head and its g query heads */
    const decode_attn_ctx *c = p;
    const int g = (int)(c->nh / c->nkv);
    c->be->attn(c->q + j * g * c->d, g, c->d, c->k + j * c->d, c->v + j * c->d,
                c->nkv * c->d, c->len, c->scale, c->scores + j * g * c->len,
                c->out + j * g * c->d);
}

int ck_attention_decode(const float *q, int64_t nh, int64_t d, const float *k, const float *v,
                        int64_t nkv, int64_t len, float scale, float *out) {
    float *s = malloc((size_t)(nh * len) * sizeof(float));
    if (!s) return -1;
    decode_attn_ctx c = {ck_active_backend(), q, k, v, out, s, nh, d, nkv, len, scale};
    int nth = ck_threads_for(2 * nh * len * d);
    ck_pool_for(decode_attn_head, &c, nkv, nth);
    free(s);
    return 0;
}
