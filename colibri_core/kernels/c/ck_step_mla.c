/* ck_step_mla.c -- the pipeline step's MLA attention block (ck.h, "pipeline step"; shared
 * pieces in ck_step.h): DeepSeek's multi-head latent attention. Grouped-query attention
 * is ck_step_attn.c. */
#include "ck_step.h"

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

/* W_UK / W_UV loops: item i = head i / blocks, tokens of block i % blocks; each row of
 * wkv_b is read (or dequantized) once for the block's MLA_TB tokens, not once per token
 * (per token the arithmetic is the same whatever the block: batch invariant) */
#define MLA_TB 16
static inline int64_t mla_blocks(const mla_ctx *c) { return (c->n + MLA_TB - 1) / MLA_TB; }

/* q_nope absorbed into latent space through W_UK (rows h*(N+V) .. +N): q_lat [r] */
static void mla_absorb_chunk(void *p, int64_t i) {
    mla_ctx *c = p;
    const ck_mla_layer *L = c->L;
    const int64_t N = L->nope, R = L->rope, r = L->r, V = L->v, nb = mla_blocks(c);
    const int64_t h = i / nb, t0 = i % nb * MLA_TB, t1 = min64(t0 + MLA_TB, c->n);
    float buf[r];
    for (int64_t t = t0; t < t1; t++) {
        float *o = mla_qlat(c, t) + h * r;
        for (int64_t j = 0; j < r; j++) o[j] = 0.0f;
    }
    for (int64_t k = 0; k < N; k++) {
        const float *w = wkv_b_row(L, h * (N + V) + k, buf);
        for (int64_t t = t0; t < t1; t++) {
            const float a = mla_q(c, t)[h * (N + R) + k];
            float *o = mla_qlat(c, t) + h * r;
            for (int64_t j = 0; j < r; j++) o[j] += a * w[j];
        }
    }
}

/* out [V] = W_UV (rows h*(N+V)+N .. +V) o_lat */
static void mla_uv_chunk(void *p, int64_t i) {
    mla_ctx *c = p;
    const ck_mla_layer *L = c->L;
    const int64_t N = L->nope, r = L->r, V = L->v, nb = mla_blocks(c);
    const int64_t h = i / nb, t0 = i % nb * MLA_TB, t1 = min64(t0 + MLA_TB, c->n);
    float buf[r];
    for (int64_t k = 0; k < V; k++) {
        const float *w = wkv_b_row(L, h * (N + V) + N + k, buf);
        for (int64_t t = t0; t < t1; t++)
            mla_out(c, t)[h * V + k] = dot_f32(w, mla_olat(c, t) + h * r, r);
    }
}

/* token t = i / nh, head h = i % nh: scores over rows 0..pos, then o_lat
 * (backends without an `mla` kernel: scalar, NEON) */
static void mla_head_chunk(void *p, int64_t i) {
    mla_ctx *c = p;
    const ck_mla_layer *L = c->L;
    const int64_t nh = L->nh, N = L->nope, R = L->rope, r = L->r;
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
}

/* the backend's MLA kernel (ck_internal.h) on MLA_HG heads of token t = i / groups: each
 * latent row is read once for the group */
#define MLA_HG 8
static void mla_group_chunk(void *p, int64_t i) {
    mla_ctx *c = p;
    const ck_mla_layer *L = c->L;
    const int64_t nh = L->nh, N = L->nope, R = L->rope, r = L->r;
    const int64_t groups = (nh + MLA_HG - 1) / MLA_HG, t = i / groups, h0 = i % groups * MLA_HG;
    const int g = (int)min64(MLA_HG, nh - h0);
    const int64_t *tk = c->tok + CK_TOK_COLS * t;
    const int64_t cap = tk[3] / r, len = tk[0] + 1;
    const float *cc = (const float *)(uintptr_t)tk[1] + c->layer * cap * r;
    const float *kp = (const float *)(uintptr_t)tk[2] + c->layer * cap * R;
    float stack[g * len <= 16384 ? g * len : 1];
    float *sc = g * len <= 16384 ? stack : malloc((size_t)(g * len) * sizeof(float));
    if (!sc) { c->s->failed = 1; return; }
    float *o = mla_olat(c, t) + h0 * r;
    c->be->mla(mla_qlat(c, t) + h0 * r, mla_q(c, t) + h0 * (N + R) + N, N + R, g, r, R, cc, kp,
               len, L->scale, sc, o);
    if (sc != stack) free(sc);
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
    const int64_t uk_work = CK_ATTN_MAC_COST * n * a->nh * a->nope * a->r;
    ck_pool_for(mla_absorb_chunk, &c, a->nh * mla_blocks(&c), nthreads(s, uk_work));
    int64_t ctx_work = 0;
    for (int64_t t = 0; t < n; t++) ctx_work += a->nh * (a->r + a->rope) * 2 * (tok[CK_TOK_COLS * t] + 1);
    s->failed = 0;
    if (be->mla)
        ck_pool_for(mla_group_chunk, &c, n * ((a->nh + MLA_HG - 1) / MLA_HG),
                    nthreads(s, CK_ATTN_MAC_COST * ctx_work));
    else
        ck_pool_for(mla_head_chunk, &c, n * a->nh, nthreads(s, CK_ATTN_MAC_COST * ctx_work));
    if (s->failed) return CK_E_MEMORY;
    ck_pool_for(mla_uv_chunk, &c, a->nh * mla_blocks(&c),
                nthreads(s, CK_ATTN_MAC_COST * n * a->nh * a->v * a->r));
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

