/* ck_core.c -- backend dispatch, threads, and the general drivers (matmul, fused expert
 * FFN: tests, benchmarks, the aarch64 driver; decode attention's is in ck_step_attn.c,
 * the cycle counter in ck_pool.c) that split work into row x token tiles, run them as parallel
 * loops on ck_pool.c's threads, the pipeline step's, and apply the epilogues.
 *
 * Parallelism is over output rows only: a thread owns a contiguous row range and runs
 * every token through it, so each weight row is read from memory once per call (the
 * row tile stays in L1 while the token tiles go by). A call is a few loops in a row;
 * each returns once all its chunks are done, which is the barrier between them. */
#define _GNU_SOURCE            /* sched_getaffinity, CPU_COUNT */
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>
#include "ck_internal.h"

/* Below this many multiply-adds (rows * cp * n) a call stays on one thread. Measured on
 * 2 cores (AVX2, int8, hot cache) when the threads were an OpenMP team (waking it cost
 * 2-4 us): a 256x1024 matvec (5.5 us) was still faster on 1 thread, 512x1024 broke even,
 * 1024x1024 gained. The pipeline step's calls use the same threshold. */
#define CK_PAR_MIN_WORK (1 << 19)
static int64_t g_par_min_work = CK_PAR_MIN_WORK;

/* From this many tokens a matmul or expert FFN runs the backend's batch tiles (1 row x
 * nt_many tokens, sharing each unpacked weight vector); fewer tokens run the
 * matrix-vector tiles (rt rows x 1 token, sharing each activation load) once per token.
 * Either way a weight tile stays in L1 while its tokens go by, so weights are read from
 * memory once per call, and each (row, token) result is the same bit for bit.
 * Measured: `nice -n 5 python -m benchmarks.speed.bench_prefill_switch --reps 7 --backends
 * avx512vnni avx2` on 2 shared Zen 4 cores (tables in docs/BENCHMARKS.md). Matvec vs batch
 * tiles, 1 thread, hot, expert FFN 1024->2816->1024 / 1024x1024 q4_matmul, avx512vnni
 * (avx2): n = 2: 278 vs 289 us (362 vs 374) / 36 vs 36 (46 vs 49): the 1x2 batch tile
 * loses to two 4x1 matvec tiles; n = 3: 409 vs 377 (545 vs 479) / 52 vs 45 (67 vs 57),
 * and 1.1-1.3x for the batch tiles at every n >= 3. Cold weights and 2 threads give the
 * same switch point in all 16 configurations. A last partial tile of 2 tokens (n = 6,
 * 10, 14) goes per token by the same rule: FFN n = 6 713 us against 726 with a 1x2 tile. */
#define CK_MATMUL_MIN_TOKENS 3
int ck_matmul_min_tokens = CK_MATMUL_MIN_TOKENS;   /* ck_internal.h: the tiles' switch point */

static const ck_backend_t *g_be = &ck_backend_scalar;
static int g_threads = 1;
static int g_inited = 0;

/* The default thread count: OMP_NUM_THREADS when set (its first number, as when the
 * threads were OpenMP's: probe processes and tests set it to 1), else the CPUs this
 * process may run on. */
static int default_threads(void) {
    const char *env = getenv("OMP_NUM_THREADS");
    if (env) {
        char *end;
        long v = strtol(env, &end, 10);
        if (end != env && v >= 1) return v > 512 ? 512 : (int)v;
    }
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n >= 1 ? (int)n : 1;
}

static const ck_backend_t *backend_ptr(int b) {
    if (b == CK_SCALAR) return &ck_backend_scalar;
#if defined(__x86_64__) || defined(__i386__)
    /* libgcc's checks include the OS's saving of the ymm/zmm state (XGETBV) */
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (b == CK_AVX2 && avx2) return &ck_backend_avx2;
    if (b == CK_AVX512VNNI && avx2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni"))
        return &ck_backend_avx512vnni;
#endif
#if defined(__aarch64__)
    /* one backend, two tables: the int8 dots with sdot where the CPU has it */
    if (b == CK_NEON) return ck_neon_has_dotprod() ? &ck_backend_neon_sdot : &ck_backend_neon;
#endif
    return NULL;
}

/* best first; also the CK_* values ck_backend() can return */
static const int k_preference[] = {CK_AVX512VNNI, CK_AVX2, CK_NEON, CK_SCALAR};
#define N_BACKENDS ((int)(sizeof k_preference / sizeof k_preference[0]))

/* COLIBRI_KERNELS=<backend name> forces that backend when this CPU has it; unset,
 * "auto", an unknown or an unavailable name all mean the best one available. */
void ck_init(void) {
    if (g_inited) return;
    g_inited = 1;
    g_threads = default_threads();
    const char *env = getenv("COLIBRI_KERNELS");
    const ck_backend_t *best = NULL;
    for (int i = 0; i < N_BACKENDS; i++) {
        const ck_backend_t *be = backend_ptr(k_preference[i]);
        if (!be) continue;
        if (env && strcmp(env, be->name) == 0) { best = be; break; }
        if (!best) best = be;
    }
    g_be = best;   /* scalar is always available */
}

int ck_backend(void) {
    ck_init();
    for (int i = 0; i < N_BACKENDS; i++)
        if (g_be == backend_ptr(k_preference[i])) return k_preference[i];
    return CK_SCALAR;
}

int ck_backend_available(int b) { return backend_ptr(b) != NULL; }

int ck_set_backend(int b) {
    const ck_backend_t *be = backend_ptr(b);
    ck_init();
    if (!be) return -1;
    g_be = be;
    return 0;
}

void ck_set_threads(int n) { ck_init(); g_threads = n < 1 ? 1 : n; }
int ck_get_threads(void) { ck_init(); return g_threads; }

/* ------------------------------------------------------------------ helpers */

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static int nthreads_for(int64_t work) {
    return work >= g_par_min_work ? g_threads : 1;
}

/* tests force tiny problems onto every thread with 0; < 0 restores the default */
void ck_set_par_min_work(int64_t w) { g_par_min_work = w < 0 ? CK_PAR_MIN_WORK : w; }

int ck_set_matmul_min_tokens(int n) {
    ck_matmul_min_tokens = n <= 0 ? CK_MATMUL_MIN_TOKENS : n;
    return ck_matmul_min_tokens;
}

static inline int tokens_per_tile(const ck_backend_t *be, int64_t n) {
    return ck_tokens_per_tile(be, n);
}

static inline int tile_tokens(int ntp, int64_t left) { return ck_tile_tokens(ntp, left); }

/* the backends' tile views of a matrix descriptor (ck.h) */
static ck_q4 q4_of(const ck_mat *m) {
    int64_t cp = round_up(m->cols, m->group);
    return (ck_q4){m->data, m->scales, m->zeros, m->rows, m->cols, m->group, cp, cp / m->group};
}

static ck_q8 q8_of(const ck_mat *m) {
    int64_t cp = round_up(m->cols, m->group);
    return (ck_q8){m->data, m->scales, m->rows, m->cols, m->group, cp, cp / m->group};
}

/* zero-padded copies of each row's partial last 64-block (NULL when cols % 64 == 0) */
static float *make_tail(const float *x, int64_t n, int64_t cols) {
    int64_t full = cols / 64 * 64;
    if (full == cols) return NULL;
    float *tail = calloc((size_t)(n * 64), sizeof(float));
    if (!tail) return NULL;
    for (int64_t t = 0; t < n; t++)
        memcpy(tail + t * 64, x + t * cols + full, (size_t)(cols - full) * sizeof(float));
    return tail;
}

/* one group-quantized activation buffer of n rows */
typedef struct { int8_t *q; float *s; int32_t *sum; } act_buf;

static int act_buf_get(act_buf *b, int64_t n, int64_t cp, int64_t ng) {
    b->q = malloc((size_t)(n * cp));
    b->s = malloc((size_t)(n * ng) * sizeof(float));
    b->sum = malloc((size_t)(n * ng) * sizeof(int32_t));
    return (b->q && b->s && b->sum) ? 0 : -1;
}

static void act_buf_free(act_buf *b) { free(b->q); free(b->s); free(b->sum); }

typedef struct {
    const ck_backend_t *be;
    const float *x;
    int64_t n, cols, group, cp, ng;
    int8_t *xq; float *xs; int32_t *xsum;
    int mx;   /* for an mxfp4 matrix: the rows then in ck_mx_act_order's order */
} quant_ctx;

static void quant_row(void *p, int64_t t) {
    const quant_ctx *c = p;
    c->be->act_quant(c->x + t * c->cols, c->cols, c->group, c->xq + t * c->cp,
                     c->xs + t * c->ng, c->xsum + t * c->ng);
    if (c->mx) ck_mx_act_order(c->xq + t * c->cp, c->cp);
}

void ck_act_quantize(const float *x, int64_t n, int64_t cols, int64_t group,
                     int8_t *xq, float *xs, int32_t *xsum) {
    ck_init();
    int64_t cp = round_up(cols, group);
    quant_ctx c = {g_be, x, n, cols, group, cp, cp / group, xq, xs, xsum, 0};
    ck_pool_for(quant_row, &c, n, nthreads_for(n * cp * 16));
}

/* ------------------------------------------------------------------ matmul */

enum { K_Q4_I8, K_Q4_F32, K_Q8_I8, K_Q8_F32, K_Q6_I8, K_Q6_F32, K_MX_I8, K_MX_F32 };

static inline void run_tile(const ck_backend_t *be, int kind, const void *w, int64_t r0,
                            int rt, const void *act, int64_t t0, int nt, float *res) {
    switch (kind) {
    case K_Q4_I8: be->q4_i8(w, r0, rt, act, t0, nt, res); break;
    case K_Q4_F32: be->q4_f32(w, r0, rt, act, t0, nt, res); break;
    case K_Q8_I8: be->q8_i8(w, r0, rt, act, t0, nt, res); break;
    case K_Q6_I8: be->q6_i8(w, r0, rt, act, t0, nt, res); break;
    case K_Q6_F32: be->q6_f32(w, r0, rt, act, t0, nt, res); break;
    case K_MX_I8: be->mx_i8(w, r0, rt, act, t0, nt, res); break;
    case K_MX_F32: ck_scalar_mx_f32(w, r0, rt, act, t0, nt, res); break;
    default: be->q8_f32(w, r0, rt, act, t0, nt, res); break;
    }
}

typedef struct {
    quant_ctx q;            /* int8 mode: quantize x first (q.n == 0: float mode) */
    int kind;
    const void *w, *act;
    int64_t rows;
    float *out;
    uint8_t *pq; float *ps; /* q4 int8 from ck_panel_min_tokens tokens: the panels */
} matmul_ctx;

/* The row loop of every matmul, one chunk per (rt x all tokens) row tile:
 * out[t*rows + r] for its rows and every token, in (rt x nt) tiles. */
static void row_tile(void *p, int64_t i) {
    const matmul_ctx *c = p;
    const ck_backend_t *be = c->q.be;
    const int64_t n = c->q.n, rows = c->rows;
    const int rtp = be->rt, ntp = tokens_per_tile(be, n);
    int64_t r0 = i * rtp;
    int rt = rows - r0 < rtp ? (int)(rows - r0) : rtp;
    float res[CK_MAX_RT * CK_MAX_NT];
    for (int64_t t0 = 0, nt; t0 < n; t0 += nt) {
        nt = tile_tokens(ntp, n - t0);
        run_tile(be, c->kind, c->w, r0, rt, c->act, t0, nt, res);
        for (int t = 0; t < nt; t++)
            for (int r = 0; r < rt; r++) ck_stf(c->out + (t0 + t) * rows + r0 + r, res[r * nt + t]);
    }
}

/* q4 x int8 through the backend's panels (the same bits as the tiles): the activation
 * rows packed into panels, then items of CK_PANEL_ROWS rows, each unpacked once for all
 * the tokens */
static void pack_row(void *p, int64_t t) {
    const matmul_ctx *c = p;
    const ck_act *a = c->act;
    pack_panel_row(t < c->q.n ? a->q + t * a->cp : NULL, a->s + t * a->ng, a->cp, a->ng, c->pq,
                   c->ps, t);
}

static void panel_item(void *p, int64_t i) {
    const matmul_ctx *c = p;
    const ck_backend_t *be = c->q.be;
    const ck_q4 *w = c->w;
    const ck_act *a = c->act;
    const int64_t n = c->q.n, np = npanels(n);
    const ck_panel pn = {c->pq, c->ps, a->cp, a->ng};
    int8_t wb[CK_PANEL_ROWS * w->cp];
    int32_t wz[CK_PANEL_ROWS * w->ng];
    float res[CK_PANEL_ROWS * 64 * CK_PANEL];
    ck_unpacked u;
    const int64_t r0 = i * CK_PANEL_ROWS;
    const int rt = c->rows - r0 < CK_PANEL_ROWS ? (int)(c->rows - r0) : CK_PANEL_ROWS;
    unpack_rows(be, w, r0, rt, 0, CK_PANEL_ROWS, &u, wb, wz);
    for (int64_t p0 = 0; p0 < np; p0 += 64) {   /* blocks of 64 panels */
        const int64_t nb = np - p0 < 64 ? np - p0 : 64, t0 = p0 * CK_PANEL;
        const ck_panel pb = {pn.q + p0 * CK_PANEL * pn.cp, pn.s + p0 * CK_PANEL * pn.ng,
                             pn.cp, pn.ng};
        be->q4_panels(&u, &pb, nb, res, nb * CK_PANEL);
        for (int64_t t = 0; t < nb * CK_PANEL && t0 + t < n; t++)
            for (int r = 0; r < rt; r++)
                ck_stf(c->out + (t0 + t) * c->rows + r0 + r, res[r * nb * CK_PANEL + t]);
    }
}

static void matmul_loops(matmul_ctx *c, int nth) {
    const int64_t n = c->q.n;
    if (c->kind == K_Q4_I8 || c->kind == K_Q8_I8 || c->kind == K_Q6_I8 || c->kind == K_MX_I8)
        ck_pool_for(quant_row, &c->q, n, nth);
    if (c->pq) {
        ck_pool_for(pack_row, c, npanels(n) * CK_PANEL, nth);
        ck_pool_for(panel_item, c, (c->rows + CK_PANEL_ROWS - 1) / CK_PANEL_ROWS, nth);
    } else {
        const int rtp = c->q.be->rt;
        ck_pool_for(row_tile, c, (c->rows + rtp - 1) / rtp, nth);
    }
}

int ck_matmul(const ck_mat *m, const float *x, int64_t n, float *out, int act_int8) {
    ck_init();
    const int is_q8 = m->kind == CK_W_Q8;   /* else q4, q6 or mxfp4: ck_q4's fields */
    const int is_mx = m->kind == CK_W_MXFP4;
    const int64_t rows = m->rows, cols = m->cols, group = is_mx ? 64 : m->group;
    ck_q4 w4 = is_q8 ? (ck_q4){0} : q4_of(m);
    if (is_mx) { w4.group = 64; w4.cp = round_up(cols, 64); w4.ng = w4.cp / 64; }
    const ck_q8 w8 = is_q8 ? q8_of(m) : (ck_q8){0};
    const void *w = is_q8 ? (const void *)&w8 : (const void *)&w4;
    const int k_i8 = m->kind == CK_W_Q4 ? K_Q4_I8 : m->kind == CK_W_Q6 ? K_Q6_I8 :
                     is_mx ? K_MX_I8 : K_Q8_I8;
    const int k_f32 = m->kind == CK_W_Q4 ? K_Q4_F32 : m->kind == CK_W_Q6 ? K_Q6_F32 :
                      is_mx ? K_MX_F32 : K_Q8_F32;
    int64_t cp = round_up(cols, group), ng = cp / group;
    int nth = nthreads_for(rows * cp * n), rc = 0;
    matmul_ctx c = {{g_be, x, n, cols, group, cp, ng, NULL, NULL, NULL, is_mx}, 0, w, NULL, rows,
                    out, NULL, NULL};
    if (act_int8) {
        act_buf b;
        if (m->kind == CK_W_Q4 && g_be->q4_panels && n >= ck_panel_min_tokens && cp <= CK_PANEL_MAX_CP) {
            c.pq = malloc((size_t)(npanels(n) * CK_PANEL * cp));
            c.ps = malloc((size_t)(npanels(n) * CK_PANEL * ng) * sizeof(float));
            if (!c.pq || !c.ps) { free(c.pq); free(c.ps); c.pq = NULL; c.ps = NULL; }
        }
        if (act_buf_get(&b, n, cp, ng) == 0) {
            ck_act a = {b.q, b.s, b.sum, cp, ng};
            c.q.xq = b.q; c.q.xs = b.s; c.q.xsum = b.sum;
            c.kind = k_i8;
            c.act = &a;
            matmul_loops(&c, nth);
        } else {
            rc = -1;
        }
        act_buf_free(&b);
        free(c.pq); free(c.ps);
    } else {
        float *tail = make_tail(x, n, cols);
        ck_xf xf = {x, cols, cols, tail};
        if (tail || cols % 64 == 0) {
            c.kind = k_f32;
            c.act = &xf;
            matmul_loops(&c, nth);
        } else {
            rc = -1;
        }
        free(tail);
    }
    return rc;
}


/* ------------------------------------------------------------------ expert FFN */

typedef struct {
    const ck_backend_t *be;
    ck_q4 w1, w3, w2;
    const float *x, *rw;
    float *out, *h;
    int64_t n, hidden, inter, hld;
    int accumulate, act_int8;
    ck_act xa, ha;          /* int8 mode */
    ck_xf xf, hf;           /* float mode */
} ffn_ctx;

static void ffn_quant_x(void *p, int64_t t) {
    const ffn_ctx *c = p;
    c->be->act_quant(c->x + t * c->hidden, c->hidden, c->w1.group,
                     (int8_t *)c->xa.q + t * c->xa.cp, (float *)c->xa.s + t * c->xa.ng,
                     (int32_t *)c->xa.sum + t * c->xa.ng);
}

/* stage 1: gate and up rows of the same tile in one pass over the tokens */
static void ffn_up_tile(void *p, int64_t i) {
    const ffn_ctx *c = p;
    const ck_backend_t *be = c->be;
    const int64_t n = c->n, hld = c->hld;
    const int rtp = be->rt, ntp = tokens_per_tile(be, n);
    int64_t r0 = i * rtp;
    int rt = c->inter - r0 < rtp ? (int)(c->inter - r0) : rtp;
    float g[CK_MAX_RT * CK_MAX_NT], u[CK_MAX_RT * CK_MAX_NT];
    for (int64_t t0 = 0, nt; t0 < n; t0 += nt) {
        nt = tile_tokens(ntp, n - t0);
        if (c->act_int8) {
            be->q4_i8(&c->w1, r0, rt, &c->xa, t0, nt, g);
            be->q4_i8(&c->w3, r0, rt, &c->xa, t0, nt, u);
        } else {
            be->q4_f32(&c->w1, r0, rt, &c->xf, t0, nt, g);
            be->q4_f32(&c->w3, r0, rt, &c->xf, t0, nt, u);
        }
        for (int t = 0; t < nt; t++)
            for (int r = 0; r < rt; r++)
                c->h[(t0 + t) * hld + r0 + r] = ck_silu(g[r * nt + t]) * u[r * nt + t];
    }
}

/* h's padding columns are zeroed (the float tiles read whole 64-blocks), then h is
 * quantized for the int8 down projection */
static void ffn_h_row(void *p, int64_t t) {
    const ffn_ctx *c = p;
    const int64_t hld = c->hld;
    for (int64_t col = c->inter; col < hld; col++) c->h[t * hld + col] = 0.0f;
    if (c->act_int8)
        c->be->act_quant(c->h + t * hld, c->inter, c->w2.group,
                         (int8_t *)c->ha.q + t * c->ha.cp, (float *)c->ha.s + t * c->ha.ng,
                         (int32_t *)c->ha.sum + t * c->ha.ng);
}

/* stage 2: down projection; the epilogue applies the routing weight */
static void ffn_down_tile(void *p, int64_t i) {
    const ffn_ctx *c = p;
    const ck_backend_t *be = c->be;
    const int64_t n = c->n;
    const int rtp = be->rt, ntp = tokens_per_tile(be, n);
    int64_t r0 = i * rtp;
    int rt = c->hidden - r0 < rtp ? (int)(c->hidden - r0) : rtp;
    float y[CK_MAX_RT * CK_MAX_NT];
    for (int64_t t0 = 0, nt; t0 < n; t0 += nt) {
        nt = tile_tokens(ntp, n - t0);
        if (c->act_int8) be->q4_i8(&c->w2, r0, rt, &c->ha, t0, nt, y);
        else be->q4_f32(&c->w2, r0, rt, &c->hf, t0, nt, y);
        for (int t = 0; t < nt; t++) {
            float s = c->rw ? ck_ldf(c->rw + t0 + t) : 1.0f;
            float *o = c->out + (t0 + t) * c->hidden + r0;
            for (int r = 0; r < rt; r++) {
                float v = y[r * nt + t] * s;
                ck_stf(o + r, c->accumulate ? ck_ldf(o + r) + v : v);
            }
        }
    }
}

static void ffn_loops(ffn_ctx *c, int nth) {
    const int rtp = c->be->rt;
    if (c->act_int8) ck_pool_for(ffn_quant_x, c, c->n, nth);
    ck_pool_for(ffn_up_tile, c, (c->inter + rtp - 1) / rtp, nth);
    ck_pool_for(ffn_h_row, c, c->n, nth);
    ck_pool_for(ffn_down_tile, c, (c->hidden + rtp - 1) / rtp, nth);
}

int ck_expert_ffn(const ck_ffn *f, const float *x, int64_t n, float *out, const float *rw,
                  int accumulate, int act_int8) {
    ck_init();
    const int64_t hidden = f->w1.cols, inter = f->w1.rows;
    ffn_ctx c;
    memset(&c, 0, sizeof c);
    c.be = g_be;
    c.w1 = q4_of(&f->w1);
    c.w3 = q4_of(&f->w3);
    c.w2 = q4_of(&f->w2);
    c.x = x; c.rw = rw; c.out = out;
    c.n = n; c.hidden = hidden; c.inter = inter;
    c.hld = round_up(inter, 64);   /* h rows padded with zeros to whole 64-blocks */
    c.accumulate = accumulate; c.act_int8 = act_int8;

    act_buf xb = {0}, hb = {0};
    int ok = 1;
    float *tail = NULL, *h = malloc((size_t)(n * c.hld) * sizeof(float));
    if (!h) return -1;
    c.h = h;
    if (act_int8) {
        ok = act_buf_get(&xb, n, c.w1.cp, c.w1.ng) == 0 &&
             act_buf_get(&hb, n, c.w2.cp, c.w2.ng) == 0;
        c.xa = (ck_act){xb.q, xb.s, xb.sum, c.w1.cp, c.w1.ng};
        c.ha = (ck_act){hb.q, hb.s, hb.sum, c.w2.cp, c.w2.ng};
    } else {
        tail = make_tail(x, n, hidden);
        ok = tail || hidden % 64 == 0;
        c.xf = (ck_xf){x, hidden, hidden, tail};
        c.hf = (ck_xf){h, c.hld, inter, NULL};
    }
    if (ok) ffn_loops(&c, nthreads_for((2 * c.w1.cp + c.w2.cp) * inter * n));
    free(h);
    act_buf_free(&xb);
    act_buf_free(&hb);
    free(tail);
    return ok ? 0 : -1;
}

const ck_backend_t *ck_active_backend(void) { ck_init(); return g_be; }

int ck_threads_for(int64_t work) { ck_init(); return nthreads_for(work); }
