/* ck_step_moe.c -- the pipeline step's expert block (ck.h, "pipeline step"; shared pieces in
 * ck_step.h). The router is ck_step_route.c. */
#include "ck_step.h"

/* ------------------------------------------------------------------ expert block
 *
 * The (token, expert) pairs of the step are grouped by expert, ascending id: a job is one
 * expert (or the shared one) with its tokens, whose rows sit side by side in the scratch
 * (pairs off .. off + cnt), so each expert's weights stream once per step for all of
 * its tokens. Jobs go in pieces of at most `pairs_max` pairs:
 *   gather: each pair's token's quantized xn row, copied to the pair's scratch row;
 *   stage 1: gate and up, row tiles x the job's tokens: h = silu(gate) * up;
 *   hquant: h quantized per pair;
 *   stage 2: down, per output row tile, the piece's jobs in order, added to x.
 * A job of at least ck_panel_min_tokens tokens runs the backend's panel kernel where it
 * has one (AVX-512: tokens in the lanes, ck_avx512.c): its gathered rows and its h rows
 * are also packed into panels, and each row tile is unpacked once for all its tokens. The
 * results are bit for bit the tiles' (so the switch is free to move): a job of fewer
 * tokens, or one whose panels do not fit the scratch, runs the tiles. */

/* Measured on the 2-core Sapphire Rapids-class VM of docs/BENCHMARKS.md ("Prefill
 * through panels"), q4_matmul 1024x2816, 1 thread, hot, best of runs: n = 8 (one half
 * empty panel) 65.8 G multiply-adds/s through either, n = 12 93.5 against 64.1 for the
 * tiles, n = 16 124 against 70, n = 32 148 against 70; on 2 threads n = 8 was ~20%
 * slower through the panels (bench_prefill.py's q4_matmul N=8), so they start at 12. */
#define CK_PANEL_MIN_TOKENS 12
int ck_panel_min_tokens = CK_PANEL_MIN_TOKENS;   /* ck_step.h */

int ck_set_panel_min_tokens(int n) {
    ck_panel_min_tokens = n <= 0 ? CK_PANEL_MIN_TOKENS : n;
    return ck_panel_min_tokens;
}

typedef struct {
    wmat w1, w3, w2;
    int i8x, i8h;             /* int8 inputs of gate/up and of down, else float rows */
    int own;                  /* its input rows prepared per pair, not copied from xa */
    int64_t off, cnt;         /* its pairs in the scratch */
    int64_t t1, t2;           /* its first stage-1 item, first hquant item */
    int64_t pan;              /* its first panel in the scratch's panel rows, or -1: tiles */
    const float *b1, *b3, *b2; /* its biases (ck_ffn), or NULL */
    int win;                  /* its pairs' weights scale its input, not its output (Llama 4) */
} ffn_job;

typedef struct {
    const ck_backend_t *be;
    ck_sscratch *s;
    ffn_job *jobs;
    int m;                    /* jobs in this piece */
    chunks s1, s2;
    int64_t hidden;
    const int64_t *pair_tok;  /* [pairs_max] the token of scratch row p */
    float *pair_w;            /* [pairs_max] its routing weight (an input-weighted job's:
                                 the input's in stage 1, then oscale) */
    const float *xn;          /* [n, hidden] */
    const ck_act *xa;         /* xn quantized per token (the plain jobs' group), or NULL */
    ck_act ga;                /* gathered int8 rows: row p = xa's row pair_tok[p] (cp, ng:
                                 strides, the largest of the jobs') */
    int64_t gld;              /* float rows: row p of s->gf, gld apart */
    int mixed;                /* some job prepares its own rows (gather_row looks it up) */
    float *x;
    int rt2;                  /* output rows per stage-2 item */
    int act;                  /* CK_ACT_*, its limit and alpha (ck_ffn_block) */
    float limit, alpha;
    float oscale;             /* the output factor of a job whose weights scale its input */
} ffn_ctx;

/* a job whose weights scale its input (f->win, Llama 4: expert(w x) = down(act(w gate(x),
 * w up(x))) without biases): gate and up values times their pair's weight, in place; rt
 * rows of nt tokens ld apart, token t of pair row q0 + t. Other jobs never come here. */
static void weigh_inputs(const ffn_ctx *c, int64_t q0, int rt, int64_t nt, float *g, float *u,
                         int64_t ld) {
    for (int r = 0; r < rt; r++)
        for (int64_t t = 0; t < nt; t++) {
            const float w = c->pair_w[q0 + t];
            g[r * ld + t] *= w;
            u[r * ld + t] *= w;
        }
}

/* h of gate g and up u at row r of job f: the biases, then the block's activation
 * (ops.gated_act) */
static inline float gated(const ffn_ctx *c, const ffn_job *f, int64_t r, float g, float u) {
    if (f->b1) g += ck_ldf(f->b1 + r);
    if (f->b3) u += ck_ldf(f->b3 + r);
    if (c->act != CK_ACT_SWIGLU_CLAMPED) return ck_silu(g) * u;
    g = fminf(g, c->limit);
    u = fminf(fmaxf(u, -c->limit), c->limit);
    return g / (1.0f + expf(-c->alpha * g)) * (u + 1.0f);
}

/* down's output value y of row r of job f, with its bias */
static inline float down_out(const ffn_job *f, int64_t r, float y) {
    return f->b2 ? y + ck_ldf(f->b2 + r) : y;
}

/* job f's panels of activations of `cp` bytes and `ng` groups per token */
static inline ck_panel job_panel(const ffn_ctx *c, const ffn_job *f, int64_t cp, int64_t ng) {
    const ck_sscratch *s = c->s;
    return (ck_panel){s->pq + f->pan * CK_PANEL * s->p_cp,
                      s->ps + f->pan * CK_PANEL * (s->p_cp / 64), cp, ng};
}

static inline int job_of(const ffn_ctx *c, int64_t i, int first_stage) {
    int j = 0;
    while (j + 1 < c->m && i >= (first_stage ? c->jobs[j + 1].t1 : c->jobs[j + 1].t2)) j++;
    return j;
}

/* pair row q's input: its token's row of xa, or (a job with its own group, an AWQ scale
 * or float inputs) prepared from xn as act_for does */
static void gather_row(void *p, int64_t q) {
    ffn_ctx *c = p;
    const ck_act *a = c->xa;
    const int64_t t = c->pair_tok[q], H = c->hidden;
    const ffn_job *f = c->jobs;
    if (c->mixed)
        for (int j = 1; j < c->m && q >= c->jobs[j].off; j++) f = &c->jobs[j];
    int8_t *gq = (int8_t *)c->ga.q + q * c->ga.cp;
    float *gs = (float *)c->ga.s + q * c->ga.ng;
    int32_t *gsum = (int32_t *)c->ga.sum + q * c->ga.ng;
    if (f->i8x && !f->own) {
        memcpy(gq, a->q + t * a->cp, (size_t)a->cp);
        memcpy(gs, a->s + t * a->ng, (size_t)a->ng * sizeof(float));
        memcpy(gsum, a->sum + t * a->ng, (size_t)a->ng * sizeof(int32_t));
    } else if (f->i8x) {
        float row[H];
        scale_row(c->xn + t * H, f->w1.xs, H, H, row);
        c->be->act_quant(row, H, f->w1.group, gq, gs, gsum);
        if (f->w1.kind == CK_W_MXFP4) ck_mx_act_order(gq, rup(H, 64));
    } else {
        scale_row(c->xn + t * H, f->w1.xs, H, c->gld, c->s->gf + q * c->gld);
    }
}

/* job f's inputs of gate and up (its rows from 0), and of down */
static inline sact job_in(const ffn_ctx *c, const ffn_job *f) {
    const ck_act *g = &c->ga;
    sact a = {{g->q + f->off * g->cp, g->s + f->off * g->ng, g->sum + f->off * g->ng, g->cp, g->ng},
              {c->s->gf ? c->s->gf + f->off * c->gld : NULL, c->gld, c->hidden, NULL}, f->i8x};
    return a;
}

static inline sact job_h(const ffn_ctx *c, const ffn_job *f) {
    const ck_sscratch *s = c->s;
    const int64_t hng = s->hcp / 64;
    /* h rows are the scratch's hcp apart (the tile reads row t at q + t * cp and its
     * scales at s + t * ng; the group count is the matrix's) */
    sact a = {{s->hq + f->off * s->hcp, s->hs + f->off * hng, s->hsum + f->off * hng, s->hcp, hng},
              {s->h + f->off * s->hld, s->hld, f->w2.cols, NULL}, f->i8h};
    return a;
}

/* lane i of the piece's panel jobs (pairs off.. of the job, then padding to 16) */
static void pack_x_lane(void *p, int64_t i) {
    ffn_ctx *c = p;
    for (int q = 0; q < c->m; q++) {
        const ffn_job *f = &c->jobs[q];
        if (f->pan < 0) continue;
        int64_t l = i - f->pan * CK_PANEL;
        if (l < 0 || l >= npanels(f->cnt) * CK_PANEL) continue;
        const ck_act *a = &c->ga;
        ck_panel pn = job_panel(c, f, a->cp, a->ng);
        int64_t row = f->off + l;
        pack_panel_row(l < f->cnt ? a->q + row * a->cp : NULL, a->s + row * a->ng, a->cp,
                       a->ng, (uint8_t *)pn.q, (float *)pn.s, l);
        return;
    }
}

/* stage 1 through the panels: gate rows in slots 0..3, up rows in 4..7 */
static void up_panels(const ffn_ctx *c, const ffn_job *f, int64_t r0, int rt) {
    const ck_backend_t *be = c->be;
    const ck_sscratch *s = c->s;
    const int64_t cp = f->w1.q4.cp, ng = f->w1.q4.ng, np = npanels(f->cnt), ld = np * CK_PANEL;
    int8_t wb[CK_PANEL_ROWS * cp];
    int32_t wz[CK_PANEL_ROWS * ng];
    float res[CK_PANEL_ROWS * ld];
    ck_unpacked u;
    unpack_rows(be, &f->w1.q4, r0, rt, 0, 4, &u, wb, wz);
    unpack_rows(be, &f->w3.q4, r0, rt, 4, 4, &u, wb, wz);
    ck_panel pn = job_panel(c, f, cp, ng);
    be->q4_panels(&u, &pn, np, res, ld);
    if (f->win) weigh_inputs(c, f->off, rt, f->cnt, res, res + 4 * ld, ld);
    for (int r = 0; r < rt; r++)
        for (int64_t t = 0; t < f->cnt; t++)
            s->h[(f->off + t) * s->hld + r0 + r] = gated(c, f, r0 + r, res[r * ld + t], res[(4 + r) * ld + t]);
}

/* stage 1 in tiles; win: a compile-time constant (two copies, the common one untouched) */
static inline __attribute__((always_inline))
void up_tiles(const ffn_ctx *c, const ffn_job *f, int64_t r0, int rt, const int win) {
    const ck_backend_t *be = c->be;
    const ck_sscratch *s = c->s;
    const int ntp = ck_tokens_per_tile(be, f->cnt);
    float g[CK_MAX_RT * CK_MAX_NT], u[CK_MAX_RT * CK_MAX_NT];
    const sact a = job_in(c, f);
    for (int64_t t0 = 0; t0 < f->cnt;) {
        int nt = ck_tile_tokens(ntp, f->cnt - t0);
        mat_tile(be, &f->w1, r0, rt, &a, t0, nt, g);
        mat_tile(be, &f->w3, r0, rt, &a, t0, nt, u);
        if (win) weigh_inputs(c, f->off + t0, rt, nt, g, u, nt);
        for (int r = 0; r < rt; r++)
            for (int t = 0; t < nt; t++)
                s->h[(f->off + t0 + t) * s->hld + r0 + r] = gated(c, f, r0 + r, g[r * nt + t], u[r * nt + t]);
        t0 += nt;
    }
}

/* stage 1: rows r0..r0+rt of gate and up for the job's tokens */
static void up_tile(const ffn_ctx *c, const ffn_job *f, int64_t r0, int rt) {
    if (f->pan >= 0) up_panels(c, f, r0, rt);
    else if (f->win) up_tiles(c, f, r0, rt, 1);
    else up_tiles(c, f, r0, rt, 0);
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
    float *h = s->h + q * s->hld;
    if (f->w2.xs)                                   /* AWQ: down's input / its scale */
        for (int64_t k = 0; k < f->w2.cols; k++) h[k] /= ck_ldf(f->w2.xs + k);
    if (!f->i8h) {                                  /* float rows: whole 64-blocks */
        for (int64_t k = f->w2.cols; k < s->hld; k++) h[k] = 0.0f;
        return;
    }
    c->be->act_quant(h, f->w2.cols, f->w2.group, s->hq + q * s->hcp,
                     s->hs + q * (s->hcp / 64), s->hsum + q * (s->hcp / 64));
    if (f->w2.kind == CK_W_MXFP4) ck_mx_act_order(s->hq + q * s->hcp, f->w2.q4.cp);
    if (f->pan < 0) return;
    const int64_t l = i - f->t2, cp = f->w2.q4.cp, ng = f->w2.q4.ng;
    ck_panel pn = job_panel(c, f, cp, ng);
    pack_panel_row(s->hq + q * s->hcp, s->hs + q * (s->hcp / 64), cp, ng, (uint8_t *)pn.q,
                   (float *)pn.s, l);
    if (l == f->cnt - 1)                              /* the last panel's padding lanes */
        for (int64_t p = l + 1; p < npanels(f->cnt) * CK_PANEL; p++)
            pack_panel_row(NULL, NULL, cp, ng, (uint8_t *)pn.q, (float *)pn.s, p);
}

/* stage 2 through the panels: rows r0..r0+rt of job f's down projection, added to x */
static void down_panels(const ffn_ctx *c, const ffn_job *f, int64_t r0, int rt) {
    const ck_backend_t *be = c->be;
    const int64_t cp = f->w2.q4.cp, ng = f->w2.q4.ng, np = npanels(f->cnt), ld = np * CK_PANEL;
    int8_t wb[CK_PANEL_ROWS * cp];
    int32_t wz[CK_PANEL_ROWS * ng];
    float y[CK_PANEL_ROWS * ld];
    ck_unpacked u;
    unpack_rows(be, &f->w2.q4, r0, rt, 0, CK_PANEL_ROWS, &u, wb, wz);
    ck_panel pn = job_panel(c, f, cp, ng);
    be->q4_panels(&u, &pn, np, y, ld);
    for (int64_t t = 0; t < f->cnt; t++) {
        int64_t pq = f->off + t;
        float wt = c->pair_w[pq];
        float *xr = c->x + c->pair_tok[pq] * c->hidden + r0;
        for (int r = 0; r < rt; r++) xr[r] = xr[r] + down_out(f, r0 + r, y[r * ld + t]) * wt;
    }
}

/* stage 2: output rows r0.. of every job of the piece, in job order, added to x */
static void down_chunk(void *p, int64_t ch) {
    ffn_ctx *c = p;
    const ck_backend_t *be = c->be;
    float y[CK_MAX_RT * CK_MAX_NT];
    for (int64_t i = ch * c->s2.per; i < chunk_end(c->s2, ch); i++) {
        /* an item of rt2 rows: a panel job's all at once, the others' in tiles of be->rt;
         * each value of x gets its jobs' terms in job order either way */
        const int64_t r1 = min64((i + 1) * c->rt2, c->hidden);
        for (int q = 0; q < c->m; q++) {
            const ffn_job *f = &c->jobs[q];
            if (f->pan >= 0) {
                down_panels(c, f, i * c->rt2, (int)(r1 - i * c->rt2));
                continue;
            }
            const sact a = job_h(c, f);
            const int ntp = ck_tokens_per_tile(be, f->cnt);
            for (int64_t r0 = i * c->rt2; r0 < r1; r0 += be->rt) {
                const int rt = (int)min64(be->rt, r1 - r0);
                for (int64_t t0 = 0; t0 < f->cnt;) {
                    int nt = ck_tile_tokens(ntp, f->cnt - t0);
                    mat_tile(be, &f->w2, r0, rt, &a, t0, nt, y);
                    for (int t = 0; t < nt; t++) {
                        int64_t pq = f->off + t0 + t;
                        float wt = c->pair_w[pq];
                        float *xr = c->x + c->pair_tok[pq] * c->hidden + r0;
                        for (int r = 0; r < rt; r++) xr[r] = xr[r] + down_out(f, r0 + r, y[r * nt + t]) * wt;
                    }
                    t0 += nt;
                }
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
    /* the jobs that run the panels: enough tokens, room in the scratch's panel rows */
    const ck_sscratch *s = c->s;
    int64_t pans = 0;
    c->rt2 = be->rt;
    for (int q = 0; q < m; q++) {
        ffn_job *f = &jobs[q];
        /* w1 and w3 share their shape, and the panel rows hold this job too */
        const int fits = f->i8x && !f->own && c->ga.cp == f->w1.q4.cp && c->ga.ng == f->w1.q4.ng &&
                         f->w1.kind == CK_W_Q4 && f->w3.kind == CK_W_Q4 && f->w2.kind == CK_W_Q4 &&
                         panels_fit(be, s, &f->w1, f->cnt) && panels_fit(be, s, &f->w2, f->cnt) &&
                         (pans + npanels(f->cnt)) * CK_PANEL <= s->p_rows;
        f->pan = fits ? pans : -1;
        if (f->pan >= 0) {
            pans += npanels(f->cnt);
            c->rt2 = CK_PANEL_ROWS;
        }
    }
    c->jobs = jobs; c->m = m;
    c->s1 = chunking(t1, 2 * be->rt * c->hidden / 2 * (np / m > 0 ? np / m : 1));
    c->s2 = chunking(ntiles(c->hidden, c->rt2), c->rt2 * down_row);
    nth = nthreads(c->s, work) < nth ? nthreads(c->s, work) : nth;
    ck_pool_for(gather_row, c, np, np >= 64 ? nth : 1);
    if (pans) ck_pool_for(pack_x_lane, c, pans * CK_PANEL, nth);
    ck_pool_for(up_chunk, c, nchunks(c->s1), nth);
    for (int q = 0; q < m; q++)             /* weights that scaled the input: output at oscale */
        for (int64_t t = 0; jobs[q].win && t < jobs[q].cnt; t++) c->pair_w[jobs[q].off + t] = c->oscale;
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
    const float oscale = b->scale != 0.0f ? b->scale : 1.0f;   /* x 1.0f: the same bits */
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
        jobs[q] = (ffn_job){.w1 = to_w(&f->w1), .w3 = to_w(&f->w3), .w2 = to_w(&f->w2), .off = off,
                            .cnt = count[e], .b1 = f->b1, .b3 = f->b3, .b2 = f->b2,
                            .win = b->weight_input};
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
            pair_w[p] = ck_ldf(weights + t * kmax + j) * (b->weight_input ? 1.0f : oscale);
        }
    if (shared) {
        jobs[q] = (ffn_job){.w1 = to_w(&shared->w1), .w3 = to_w(&shared->w3), .w2 = to_w(&shared->w2),
                            .off = off, .cnt = n, .b1 = shared->b1, .b3 = shared->b3, .b2 = shared->b2};
        for (int64_t t = 0; t < n; t++) {
            float gd = b->shared_gate ? dot_f32(xn + t * hidden, b->shared_gate, hidden) : 0.0f;
            pair_tok[off + t] = t;
            pair_w[off + t] = (b->shared_gate ? 1.0f / (1.0f + expf(-gd)) : 1.0f) * oscale;
        }
        q++;
    }
    /* checks: gate and up alike, scratch sizes; what each job's inputs are */
    int64_t group = 0, G = 0, GN = 0;
    int gmx = 0;   /* the shared rows are for mxfp4 gates (in ck_mx_act_order's order) */
    for (int i = 0; i < njobs; i++) {
        ffn_job *f = &jobs[i];
        const int mx = f->w1.kind == CK_W_MXFP4;
        if (is_float_kind(f->w1.kind) != is_float_kind(f->w3.kind) || f->w1.xs != f->w3.xs ||
            (!is_float_kind(f->w1.kind) && f->w1.group != f->w3.group) ||
            mx != (f->w3.kind == CK_W_MXFP4))
            return CK_E_GROUPS;
        f->i8x = !s->act_f32 && !is_float_kind(f->w1.kind);
        f->i8h = !s->act_f32 && !is_float_kind(f->w2.kind);
        if (f->w1.rows > s->hld || f->w2.cols != f->w1.rows || (!f->i8x && !s->gf) ||
            (f->i8h && (rup(f->w2.cols, f->w2.group) > s->hcp || f->w2.group % 64)))
            return CK_E_SCRATCH;
        if (f->i8x && !f->w1.xs && !group) { group = f->w1.group; gmx = mx; }
        f->own = !f->i8x || f->w1.xs || f->w1.group != group || mx != gmx;
        if (f->i8x) {
            const int64_t cp = rup(hidden, f->w1.group);
            G = cp > G ? cp : G;
            GN = cp / f->w1.group > GN ? cp / f->w1.group : GN;
        }
    }
    if (G > s->cp_max || rup(hidden, 64) > s->cp_max) return CK_E_SCRATCH;
    int64_t work = 0;
    for (int i = 0; i < njobs; i++) work += 3 * jobs[i].w1.rows * hidden * jobs[i].cnt;
    int nth = nthreads(s, work);
    act_set A = {0};
    int err = 0;
    ffn_ctx c;
    memset(&c, 0, sizeof c);
    c.be = be; c.s = s; c.hidden = hidden; c.x = x; c.pair_tok = pair_tok; c.pair_w = pair_w;
    c.xn = xn;
    c.act = b->act; c.limit = b->act_limit; c.alpha = b->act_alpha;
    c.oscale = oscale;
    c.gld = rup(hidden, 64);
    for (int i = 0; i < njobs; i++) c.mixed |= jobs[i].own;
    if (group) {
        const wmat wx = {.kind = gmx ? CK_W_MXFP4 : CK_W_Q4, .rows = 1, .cols = hidden,
                         .group = group};
        c.xa = &act_for(&A, s, be, xn, n, hidden, &wx, nth, &err)->q;
        if (err) return err;
    }
    c.ga = (ck_act){s->gq, s->gs, s->gsum, G, GN};
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
        run_piece(&c, jobs + i, j - i, nth);
        c.pair_tok = pair_tok; c.pair_w = pair_w;
        i = j;
    }
    return 0;
}
