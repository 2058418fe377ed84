/* ck_decode.c -- one decode token of one sequence (the API is in ck.h, "decode step";
 * colibri_core/decode.py drives it).
 *
 * Why a separate path: a decode token is ~60 small matrix-vector products. Run one kernel
 * call each, with numpy and Python between them, and half of the time went to starting
 * OpenMP teams and waking threads at barriers (py-spy, docs/BENCHMARKS.md). Here a layer
 * is two C calls -- attention block, FFN block -- whose parallel loops run on ck_pool.c's
 * threads (chunks of ~64 KB of weights, stolen when a thread is late), and the serial
 * pieces between the products (norms, rope, quantizing activations, routing) run on the
 * calling thread, allocating nothing.
 *
 * The arithmetic is that of the general path (model.py + ck_core.c): the same tiles,
 * the same order of the expert sums, the same fixed-point routing, so tokens agree with
 * it up to float rounding of the norms and router dot products. */
#include <math.h>
#include <stdlib.h>
#include "ck_internal.h"

static inline int64_t rup(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Chunks of a loop over `n` tiles of `tile_bytes` of weights each: ~64 KB per chunk,
 * enough for the prefetchers to run ahead and for a claim (an atomic) to cost nothing. */
typedef struct { int64_t n, per; } chunks;

static chunks chunking(int64_t n, int64_t tile_bytes) {
    int64_t per = 65536 / (tile_bytes > 0 ? tile_bytes : 1);
    per = per < 1 ? 1 : per > 64 ? 64 : per;
    return (chunks){n, per};
}

static inline int64_t nchunks(chunks c) { return (c.n + c.per - 1) / c.per; }

/* threads for `work` multiply-adds, under the caller's cap (decode.py's thread control) */
static inline int nthreads(const ck_dscratch *s, int64_t work) {
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

static inline void tile(const ck_backend_t *be, const wmat *w, int64_t r0, int rt,
                        const ck_act *a, float *res) {
    if (w->kind == CK_W_Q4) be->q4_i8(&w->q4, r0, rt, a, 0, 1, res);
    else be->q8_i8(&w->q8, r0, rt, a, 0, 1, res);
}

static inline int64_t ntiles(const wmat *w, int rtp) { return (w->rows + rtp - 1) / rtp; }

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

/* int8 activations of one vector for up to two group sizes (scratch buffers a and b) */
typedef struct { int n; int64_t group[2]; ck_act a[2]; } act_set;

static const ck_act *act_for(act_set *A, ck_dscratch *s, const ck_backend_t *be,
                             const float *x, int64_t cols, int64_t group, int *err) {
    for (int i = 0; i < A->n; i++)
        if (A->group[i] == group) return &A->a[i];
    int64_t cp = rup(cols, group);
    if (A->n == 2) { *err = CK_E_GROUPS; return NULL; }
    if (cp > s->cp_max) { *err = CK_E_SCRATCH; return NULL; }
    int i = A->n++;
    int8_t *q = i ? s->bq : s->aq;
    float *sc = i ? s->bs : s->as;
    int32_t *sum = i ? s->bsum : s->asum;
    be->act_quant(x, cols, group, q, sc, sum);
    A->group[i] = group;
    A->a[i] = (ck_act){q, sc, sum, cp, cp / group};
    return &A->a[i];
}

/* rotate-half rope of one head (Hugging Face layout): out may alias x */
static void rope(const float *x, float *out, const float *cs, const float *sn, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        out[i] = a * cs[i] - b * sn[i];
        out[i + half] = b * cs[i] + a * sn[i];
    }
}

/* ------------------------------------------------------------------ attention block */

typedef struct {
    const ck_backend_t *be;
    const ck_attn_layer *L;
    ck_dscratch *s;
    wmat w[4];                 /* q, k, v, o */
    const ck_act *act[3];      /* x for q, k, v */
    ck_act ao;                 /* the attention output, for o */
    int64_t nt[3];             /* row tiles of q, k, v */
    chunks qkv, o;
    float *x, *kc, *vc;
    int64_t pos;
    float scale;
} attn_ctx;

/* q, k, v: the three matrices' row tiles as one loop */
static void qkv_chunk(void *p, int64_t ch) {
    attn_ctx *c = p;
    const ck_backend_t *be = c->be;
    const int rtp = be->rt;
    float *outs[3] = {c->s->q, c->s->k, c->s->v};
    const float *bias[3] = {c->L->bq, c->L->bk, c->L->bv};
    float res[CK_MAX_RT * CK_MAX_NT];
    for (int64_t i = ch * c->qkv.per; i < min64((ch + 1) * c->qkv.per, c->qkv.n); i++) {
        int m = i < c->nt[0] ? 0 : i < c->nt[0] + c->nt[1] ? 1 : 2;
        int64_t r0 = (i - (m == 0 ? 0 : m == 1 ? c->nt[0] : c->nt[0] + c->nt[1])) * rtp;
        int rt = (int)min64(rtp, c->w[m].rows - r0);
        tile(be, &c->w[m], r0, rt, c->act[m], res);
        for (int r = 0; r < rt; r++)
            outs[m][r0 + r] = bias[m] ? res[r] + bias[m][r0 + r] : res[r];
    }
}

/* rope, the cache rows and attention of kv head j and its query heads */
static void head_chunk(void *p, int64_t j) {
    attn_ctx *c = p;
    const ck_attn_layer *L = c->L;
    ck_dscratch *s = c->s;
    const int64_t d = L->d, half = d / 2, nkv = L->nkv, g = L->nh / nkv, len = c->pos + 1;
    rope(s->k + j * d, c->kc + (c->pos * nkv + j) * d, s->cos, s->sin, half);
    memcpy(c->vc + (c->pos * nkv + j) * d, s->v + j * d, (size_t)d * sizeof(float));
    for (int64_t h = j * g; h < (j + 1) * g; h++) rope(s->q + h * d, s->q + h * d, s->cos, s->sin, half);
    c->be->attn(s->q + j * g * d, (int)g, d, c->kc + j * d, c->vc + j * d, nkv * d, len,
                c->scale, s->scores + j * g * len, s->att + j * g * d);
}

static void o_chunk(void *p, int64_t ch) {
    attn_ctx *c = p;
    const int rtp = c->be->rt;
    const wmat *wo = &c->w[3];
    float res[CK_MAX_RT * CK_MAX_NT];
    for (int64_t i = ch * c->o.per; i < min64((ch + 1) * c->o.per, c->o.n); i++) {
        int64_t r0 = i * rtp;
        int rt = (int)min64(rtp, wo->rows - r0);
        tile(c->be, wo, r0, rt, &c->ao, res);
        for (int r = 0; r < rt; r++) c->x[r0 + r] = c->x[r0 + r] + res[r];
    }
}

int ck_decode_attention(const ck_attn_layer *a, float *x, float *kc, float *vc, int64_t pos,
                        float *xn_out, ck_dscratch *s) {
    const ck_backend_t *be = ck_active_backend();
    attn_ctx c;
    int err = 0;
    memset(&c, 0, sizeof c);
    if (pos + 1 > s->max_len) return CK_E_SCRATCH;
    c.be = be; c.L = a; c.s = s; c.x = x; c.kc = kc; c.vc = vc; c.pos = pos;
    c.scale = (float)(1.0 / sqrt((double)a->d));
    c.w[0] = to_w(&a->wq); c.w[1] = to_w(&a->wk); c.w[2] = to_w(&a->wv); c.w[3] = to_w(&a->wo);
    if (rup(c.w[3].cols, c.w[3].group) > s->cp_max) return CK_E_SCRATCH;
    rmsnorm(x, a->norm, a->hidden, a->eps, s->xn);
    act_set A = {0};
    for (int m = 0; m < 3 && !err; m++)
        c.act[m] = act_for(&A, s, be, s->xn, a->hidden, c.w[m].group, &err);
    if (err) return err;
    for (int64_t i = 0; i < a->d / 2; i++) {
        double ang = (double)pos * a->inv_freq[i];
        s->cos[i] = (float)(cos(ang) * a->rope_factor);
        s->sin[i] = (float)(sin(ang) * a->rope_factor);
    }
    const int rtp = be->rt;
    for (int m = 0; m < 3; m++) c.nt[m] = ntiles(&c.w[m], rtp);
    c.qkv = chunking(c.nt[0] + c.nt[1] + c.nt[2], rtp * mat_bytes_per_row(&a->wq));
    c.o = chunking(ntiles(&c.w[3], rtp), rtp * mat_bytes_per_row(&a->wo));
    int64_t work = 0;
    for (int m = 0; m < 4; m++) work += c.w[m].rows * c.w[m].cols;
    int nth = nthreads(s, work);
    ck_pool_for(qkv_chunk, &c, nchunks(c.qkv), nth);
    ck_pool_for(head_chunk, &c, a->nkv, nthreads(s, 2 * a->nh * a->d * (pos + 1)));
    /* the o projection's input, quantized once (buffer a: q, k, v are done with it) */
    const wmat *wo = &c.w[3];
    int64_t cpo = rup(wo->cols, wo->group);
    be->act_quant(s->att, wo->cols, wo->group, s->aq, s->as, s->asum);
    c.ao = (ck_act){s->aq, s->as, s->asum, cpo, cpo / wo->group};
    ck_pool_for(o_chunk, &c, nchunks(c.o), nth);
    rmsnorm(x, a->ffn_norm, a->hidden, a->eps, xn_out);
    return 0;
}

/* ------------------------------------------------------------------ routing */

int ck_decode_route(const ck_router *r, const float *xn, int k, float *logits, int64_t *ids,
                    float *weights) {
    const float *router = r->weight, *bias = r->bias;
    const int64_t e = r->e, h = r->h;
    const int64_t *exp2_q30 = r->exp2_q30;
    float m = -INFINITY;
    if (k < 1 || k > e || k > 256) return CK_E_SCRATCH;
    for (int64_t i = 0; i < e; i++) {
        float v = dot_f32(xn, router + i * h, h);
        if (bias) v += ck_ldf(bias + i);
        if (!isfinite(v)) return CK_E_NONFINITE;
        logits[i] = v;
        m = v > m ? v : m;
    }
    /* top k, largest first, ties to the lower index (ops.top_k) */
    for (int j = 0; j < k; j++) {
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
        double d = (double)(logits[i] - m) * 1.4426950408889634;
        double fx = nearbyint(-d * 1024.0);
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
        weights[j] = (float)(v * (double)r->scaling);
    }
    return 0;
}

/* ------------------------------------------------------------------ FFN block */

typedef struct {
    wmat w1, w3, w2;
    float weight;
    const ck_act *x;          /* xn quantized for w1/w3 */
    float *h;                 /* [inter] silu(gate) * up */
    ck_act ha;                /* h quantized for w2 */
    int64_t t1, t2;           /* first stage-1 tile, first h group of this FFN */
} ffn_job;

typedef struct {
    const ck_backend_t *be;
    ffn_job *jobs;
    int m;
    chunks s1, s1b, s2;       /* gate/up tiles, h groups, down tiles */
    int64_t hidden;
    float *x;
} ffn_ctx;

/* the FFN that item i of a loop over the jobs' items belongs to (first[] ascending) */
static inline int job_of(const ffn_ctx *c, int64_t i, int first_stage) {
    int j = 0;
    while (j + 1 < c->m && i >= (first_stage ? c->jobs[j + 1].t1 : c->jobs[j + 1].t2)) j++;
    return j;
}

/* stage 1: gate and up of every FFN, h = silu(gate) * up */
static void up_chunk(void *p, int64_t ch) {
    ffn_ctx *c = p;
    const ck_backend_t *be = c->be;
    const int rtp = be->rt;
    float g[CK_MAX_RT * CK_MAX_NT], u[CK_MAX_RT * CK_MAX_NT];
    int64_t i0 = ch * c->s1.per, i1 = min64(i0 + c->s1.per, c->s1.n);
    int j = job_of(c, i0, 1);
    for (int64_t i = i0; i < i1; i++) {
        while (j + 1 < c->m && i >= c->jobs[j + 1].t1) j++;
        ffn_job *f = &c->jobs[j];
        int64_t r0 = (i - f->t1) * rtp;
        int rt = (int)min64(rtp, f->w1.rows - r0);
        tile(be, &f->w1, r0, rt, f->x, g);
        tile(be, &f->w3, r0, rt, f->x, u);
        for (int r = 0; r < rt; r++) f->h[r0 + r] = ck_silu(g[r]) * u[r];
    }
}

/* h quantized group by group (groups are independent) */
static void hquant_chunk(void *p, int64_t ch) {
    ffn_ctx *c = p;
    int64_t i0 = ch * c->s1b.per, i1 = min64(i0 + c->s1b.per, c->s1b.n);
    int j = job_of(c, i0, 0);
    for (int64_t i = i0; i < i1; i++) {
        while (j + 1 < c->m && i >= c->jobs[j + 1].t2) j++;
        ffn_job *f = &c->jobs[j];
        int64_t gi = i - f->t2, grp = f->w2.group, c0 = gi * grp;
        c->be->act_quant(f->h + c0, min64(grp, f->w2.cols - c0), grp, (int8_t *)f->ha.q + c0,
                         (float *)f->ha.s + gi, (int32_t *)f->ha.sum + gi);
    }
}

/* stage 2: down projections, summed per output row in the jobs' order */
static void down_chunk(void *p, int64_t ch) {
    ffn_ctx *c = p;
    const int rtp = c->be->rt;
    for (int64_t i = ch * c->s2.per; i < min64((ch + 1) * c->s2.per, c->s2.n); i++) {
        int64_t r0 = i * rtp;
        int rt = (int)min64(rtp, c->hidden - r0);
        float acc[CK_MAX_RT * CK_MAX_NT] = {0}, y[CK_MAX_RT * CK_MAX_NT];
        for (int q = 0; q < c->m; q++) {
            tile(c->be, &c->jobs[q].w2, r0, rt, &c->jobs[q].ha, y);
            for (int r = 0; r < rt; r++) acc[r] = acc[r] + y[r] * c->jobs[q].weight;
        }
        for (int r = 0; r < rt; r++) c->x[r0 + r] = c->x[r0 + r] + acc[r];
    }
}

int ck_decode_ffn(const ck_ffn_block *b, const int64_t *ids, const float *weights, int k,
                  const float *xn, float *x, ck_dscratch *s) {
    const ck_backend_t *be = ck_active_backend();
    const ck_ffn *table = b->table, *shared = b->shared;
    const float *shared_gate = b->shared_gate;
    const int64_t hidden = b->hidden;
    int64_t order[k > 0 ? k : 1];
    int n = 0, err = 0;
    for (int j = 0; j < k; j++) {          /* ascending expert id, as the general path */
        if (ids[j] < 0 || !table[ids[j]].w1.data) continue;    /* none, or a vacant slot */
        int q = n++;
        while (q > 0 && ids[order[q - 1]] > ids[j]) { order[q] = order[q - 1]; q--; }
        order[q] = j;
    }
    int m = n + (shared != NULL);
    if (m > s->max_ffns) return CK_E_SCRATCH;
    ffn_job jobs[m > 0 ? m : 1];
    act_set A = {0};
    int64_t t1 = 0, t2 = 0;
    for (int q = 0; q < m; q++) {
        const ck_ffn *f = q < n ? &table[ids[order[q]]] : shared;
        ffn_job *jb = &jobs[q];
        jb->w1 = to_w(&f->w1); jb->w3 = to_w(&f->w3); jb->w2 = to_w(&f->w2);
        if (q < n) {
            jb->weight = ck_ldf(weights + order[q]);
        } else {
            float gd = shared_gate ? dot_f32(xn, shared_gate, hidden) : 0.0f;
            jb->weight = shared_gate ? 1.0f / (1.0f + expf(-gd)) : 1.0f;
        }
        jb->x = act_for(&A, s, be, xn, hidden, jb->w1.group, &err);
        if (err) return err;
        int64_t cp2 = rup(jb->w2.cols, jb->w2.group);
        if (jb->w1.rows > s->hld || cp2 > s->hcp || jb->w3.group != jb->w1.group) return CK_E_SCRATCH;
        jb->h = s->h + q * s->hld;
        jb->ha = (ck_act){s->hq + q * s->hcp, s->hs + q * (s->hcp / 64), s->hsum + q * (s->hcp / 64),
                          cp2, cp2 / jb->w2.group};
        jb->t1 = t1;
        jb->t2 = t2;
        t1 += ntiles(&jb->w1, be->rt);
        t2 += cp2 / jb->w2.group;
    }
    if (m == 0) return 0;
    int64_t work = 0, down_row = 0;
    for (int q = 0; q < m; q++) {
        work += 3 * jobs[q].w1.rows * hidden;
        down_row += mat_bytes_per_row(q < n ? &table[ids[order[q]]].w2 : &shared->w2);
    }
    /* gate + up tiles: 2 * rt rows of `hidden` columns; h quantization: ~16 groups */
    ffn_ctx c = {be, jobs, m, chunking(t1, 2 * be->rt * hidden / 2), chunking(t2, 4096),
                 chunking((hidden + be->rt - 1) / be->rt, be->rt * down_row), hidden, x};
    int nth = nthreads(s, work);
    ck_pool_for(up_chunk, &c, nchunks(c.s1), nth);
    ck_pool_for(hquant_chunk, &c, nchunks(c.s1b), nth);
    ck_pool_for(down_chunk, &c, nchunks(c.s2), nth);
    return 0;
}

/* ------------------------------------------------------------------ lm_head */

typedef struct { const ck_backend_t *be; wmat w; const ck_act *a; float *out; chunks ch; } head_ctx;

static void lm_chunk(void *p, int64_t ch) {
    head_ctx *c = p;
    const int rtp = c->be->rt;
    float res[CK_MAX_RT * CK_MAX_NT];
    for (int64_t i = ch * c->ch.per; i < min64((ch + 1) * c->ch.per, c->ch.n); i++) {
        int64_t r0 = i * rtp;
        int rt = (int)min64(rtp, c->w.rows - r0);
        tile(c->be, &c->w, r0, rt, c->a, res);
        for (int r = 0; r < rt; r++) c->out[r0 + r] = res[r];
    }
}

int ck_decode_head(const ck_mat *w, const float *norm, float eps, const float *x,
                   float *logits, ck_dscratch *s) {
    const ck_backend_t *be = ck_active_backend();
    head_ctx c = {be, to_w(w), NULL, logits, chunking(ntiles(&(wmat){.rows = w->rows}, be->rt),
                                                      be->rt * mat_bytes_per_row(w))};
    act_set A = {0};
    int err = 0;
    rmsnorm(x, norm, w->cols, eps, s->xn);
    c.a = act_for(&A, s, be, s->xn, w->cols, w->group, &err);
    if (err) return err;
    ck_pool_for(lm_chunk, &c, nchunks(c.ch), nthreads(s, w->rows * w->cols));
    return 0;
}
