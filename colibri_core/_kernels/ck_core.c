/* ck_core.c -- backend dispatch, threads, cycle counter, and the portable drivers
 * (matmul, fused expert FFN) that split work into row x token tiles, run them on
 * OpenMP threads and apply the epilogues.
 *
 * Parallelism is over output rows only: a thread owns a contiguous row range and runs
 * every token through it, so each weight row is read from memory once per call (the
 * row tile stays in L1 while the token tiles go by). */
#include <math.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif
#include "ck.h"

/* Below this many multiply-adds (rows * cp * n) a call stays on one thread: waking the
 * OpenMP team costs a few microseconds, which ~256K int8 MACs take anyway on AVX2. */
#define CK_PAR_MIN_WORK (1 << 18)

static const ck_backend_t *g_be = &ck_backend_scalar;
static int g_threads = 1;
static int g_inited = 0;

static const ck_backend_t *backend_ptr(int b) {
    if (b == CK_SCALAR) return &ck_backend_scalar;
#if defined(__x86_64__) || defined(__i386__)
    if (b == CK_AVX2) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            return &ck_backend_avx2;
    }
#endif
#if defined(__aarch64__)
    if (b == CK_NEON) return &ck_backend_neon;
#endif
    return NULL;
}

void ck_init(void) {
    if (g_inited) return;
    g_inited = 1;
#ifdef _OPENMP
    g_threads = omp_get_max_threads();
#endif
    const char *env = getenv("COLIBRI_KERNELS");
    if (env && strcmp(env, "scalar") == 0) { g_be = &ck_backend_scalar; return; }
    const ck_backend_t *be = backend_ptr(CK_AVX2);
    if (!be) be = backend_ptr(CK_NEON);
    g_be = be ? be : &ck_backend_scalar;
}

int ck_backend(void) {
    ck_init();
    if (g_be == &ck_backend_scalar) return CK_SCALAR;
    return g_be == backend_ptr(CK_AVX2) ? CK_AVX2 : CK_NEON;
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

uint64_t ck_rdtsc(void) {
#if defined(__x86_64__) || defined(__i386__)
    return __rdtsc();
#elif defined(__aarch64__)
    uint64_t v;
    __asm__ __volatile__("mrs %0, cntvct_el0" : "=r"(v));
    return v;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
#endif
}

const char *ck_cycle_counter_name(void) {
#if defined(__x86_64__) || defined(__i386__)
    return "rdtsc";
#elif defined(__aarch64__)
    return "cntvct_el0";
#else
    return "clock_gettime_ns";
#endif
}

/* ------------------------------------------------------------------ helpers */

static inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static int nthreads_for(int64_t work) {
    return work >= CK_PAR_MIN_WORK ? g_threads : 1;
}

static ck_q4 mk_q4(const uint8_t *d, const float *s, const uint8_t *z,
                   int64_t rows, int64_t cols, int64_t group) {
    ck_q4 w = {d, s, z, rows, cols, group, round_up(cols, group), 0};
    w.ng = w.cp / group;
    return w;
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

/* one group-quantized activation buffer, owned or borrowed */
typedef struct { int8_t *q; float *s; int32_t *sum; int owned; } act_buf;

static int act_buf_get(act_buf *b, int8_t *q, float *s, int32_t *sum, int64_t n, int64_t cp,
                       int64_t ng) {
    b->owned = !(q && s && sum);
    if (!b->owned) { b->q = q; b->s = s; b->sum = sum; return 0; }
    b->q = malloc((size_t)(n * cp));
    b->s = malloc((size_t)(n * ng) * sizeof(float));
    b->sum = malloc((size_t)(n * ng) * sizeof(int32_t));
    return (b->q && b->s && b->sum) ? 0 : -1;
}

static void act_buf_free(act_buf *b) {
    if (b->owned) { free(b->q); free(b->s); free(b->sum); }
}

void ck_act_quantize(const float *x, int64_t n, int64_t cols, int64_t group,
                     int8_t *xq, float *xs, int32_t *xsum) {
    ck_init();
    const ck_backend_t *be = g_be;
    int64_t cp = round_up(cols, group), ng = cp / group;
    int nth = nthreads_for(n * cp * 16);
#pragma omp parallel for num_threads(nth) if (nth > 1) schedule(static)
    for (int64_t t = 0; t < n; t++)
        be->act_quant(x + t * cols, cols, group, xq + t * cp, xs + t * ng, xsum + t * ng);
}

/* ------------------------------------------------------------------ matmul */

/* Tile driver shared by q4/q8 and int8/float: computes out[t*ldo + r] for rows
 * [r_lo, r_hi) and all n tokens, calling `tile` on (rt x nt) tiles. Runs inside
 * an omp parallel region (the `omp for` splits the rows). */
enum { K_Q4_I8, K_Q4_F32, K_Q8_I8, K_Q8_F32 };

static inline void run_tile(const ck_backend_t *be, int kind, const void *w, int64_t r0,
                            int rt, const void *act, int64_t t0, int nt, float *res) {
    switch (kind) {
    case K_Q4_I8: be->q4_i8(w, r0, rt, act, t0, nt, res); break;
    case K_Q4_F32: be->q4_f32(w, r0, rt, act, t0, nt, res); break;
    case K_Q8_I8: be->q8_i8(w, r0, rt, act, t0, nt, res); break;
    default: be->q8_f32(w, r0, rt, act, t0, nt, res); break;
    }
}

static void rows_all_tokens(const ck_backend_t *be, int kind, const void *w, int64_t rows,
                            const void *act, int64_t n, int nt_pref, float *out, int64_t ldo) {
    int rt_pref = be->rt;
    int64_t ntiles = (rows + rt_pref - 1) / rt_pref;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < ntiles; i++) {
        int64_t r0 = i * rt_pref;
        int rt = rows - r0 < rt_pref ? (int)(rows - r0) : rt_pref;
        float res[CK_MAX_RT * CK_MAX_NT];
        for (int64_t t0 = 0; t0 < n; t0 += nt_pref) {
            int nt = n - t0 < nt_pref ? (int)(n - t0) : nt_pref;
            run_tile(be, kind, w, r0, rt, act, t0, nt, res);
            for (int t = 0; t < nt; t++)
                for (int r = 0; r < rt; r++) ck_stf(out + (t0 + t) * ldo + r0 + r, res[r * nt + t]);
        }
    }
}

static int matmul(const void *w, int is_q4, int64_t rows, int64_t cols, int64_t group,
                   const float *x, int64_t n, float *out, int act_int8,
                   int8_t *xq, float *xs, int32_t *xsum) {
    ck_init();
    const ck_backend_t *be = g_be;
    int64_t cp = round_up(cols, group), ng = cp / group;
    int nth = nthreads_for(rows * cp * n);
    int nt_pref = n > 1 ? be->nt_many : 1;
    int rc = 0;
    if (act_int8) {
        act_buf b;
        if (act_buf_get(&b, xq, xs, xsum, n, cp, ng) == 0) {
            ck_act a = {b.q, b.s, b.sum, cp, ng};
#pragma omp parallel num_threads(nth) if (nth > 1)
            {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < n; t++)
                    be->act_quant(x + t * cols, cols, group, b.q + t * cp, b.s + t * ng,
                                  b.sum + t * ng);
                rows_all_tokens(be, is_q4 ? K_Q4_I8 : K_Q8_I8, w, rows, &a, n, nt_pref, out,
                                rows);
            }
        } else {
            rc = -1;
        }
        act_buf_free(&b);
    } else {
        float *tail = make_tail(x, n, cols);
        ck_xf xf = {x, cols, cols, tail};
        if (tail || cols % 64 == 0) {
#pragma omp parallel num_threads(nth) if (nth > 1)
            rows_all_tokens(be, is_q4 ? K_Q4_F32 : K_Q8_F32, w, rows, &xf, n, nt_pref, out,
                            rows);
        } else {
            rc = -1;
        }
        free(tail);
    }
    return rc;
}

int ck_q4_matmul(const uint8_t *wd, const float *ws, const uint8_t *wz,
                  int64_t rows, int64_t cols, int64_t group,
                  const float *x, int64_t n, float *out, int act_int8,
                  int8_t *xq, float *xs, int32_t *xsum) {
    ck_q4 w = mk_q4(wd, ws, wz, rows, cols, group);
    return matmul(&w, 1, rows, cols, group, x, n, out, act_int8, xq, xs, xsum);
}

int ck_q8_matmul(const int8_t *wd, const float *ws,
                  int64_t rows, int64_t cols, int64_t group,
                  const float *x, int64_t n, float *out, int act_int8,
                  int8_t *xq, float *xs, int32_t *xsum) {
    ck_q8 w = {wd, ws, rows, cols, group, round_up(cols, group), round_up(cols, group) / group};
    return matmul(&w, 0, rows, cols, group, x, n, out, act_int8, xq, xs, xsum);
}

/* ------------------------------------------------------------------ expert FFN */

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

int ck_expert_ffn(const uint8_t *w1d, const float *w1s, const uint8_t *w1z,
                   const uint8_t *w3d, const float *w3s, const uint8_t *w3z, int64_t g13,
                   const uint8_t *w2d, const float *w2s, const uint8_t *w2z, int64_t g2,
                   int64_t hidden, int64_t inter,
                   const float *x, int64_t n, float *out, const float *rw,
                   int accumulate, int act_int8,
                   int8_t *xq, float *xs, int32_t *xsum,
                   float *h, int8_t *hq, float *hs, int32_t *hsum) {
    ck_init();
    const ck_backend_t *be = g_be;
    ck_q4 w1 = mk_q4(w1d, w1s, w1z, inter, hidden, g13);
    ck_q4 w3 = mk_q4(w3d, w3s, w3z, inter, hidden, g13);
    ck_q4 w2 = mk_q4(w2d, w2s, w2z, hidden, inter, g2);
    int64_t hld = round_up(inter, 64);   /* h rows padded with zeros to whole 64-blocks */
    int nth = nthreads_for((2 * w1.cp + w2.cp) * inter * n);
    int nt_pref = n > 1 ? be->nt_many : 1;
    int rtp = be->rt;

    act_buf xb = {0}, hb = {0};
    int h_owned = h == NULL, ok = 1;
    float *tail = NULL;
    if (h_owned) h = malloc((size_t)(n * hld) * sizeof(float));
    if (!h) return -1;
    if (act_int8) {
        ok = act_buf_get(&xb, xq, xs, xsum, n, w1.cp, w1.ng) == 0 &&
             act_buf_get(&hb, hq, hs, hsum, n, w2.cp, w2.ng) == 0;
    } else {
        tail = make_tail(x, n, hidden);
        ok = tail || hidden % 64 == 0;
    }
    ck_act xa = {xb.q, xb.s, xb.sum, w1.cp, w1.ng};
    ck_act ha = {hb.q, hb.s, hb.sum, w2.cp, w2.ng};
    ck_xf xf = {x, hidden, hidden, tail};
    ck_xf hf = {h, hld, inter, NULL};

#pragma omp parallel num_threads(nth) if (nth > 1 && ok)
    if (ok) {
        if (act_int8) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < n; t++)
                be->act_quant(x + t * hidden, hidden, g13, xb.q + t * w1.cp,
                              xb.s + t * w1.ng, xb.sum + t * w1.ng);
        }
        /* stage 1: gate and up rows of the same tile in one pass over the tokens */
        int64_t ntiles = (inter + rtp - 1) / rtp;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < ntiles; i++) {
            int64_t r0 = i * rtp;
            int rt = inter - r0 < rtp ? (int)(inter - r0) : rtp;
            float g[CK_MAX_RT * CK_MAX_NT], u[CK_MAX_RT * CK_MAX_NT];
            for (int64_t t0 = 0; t0 < n; t0 += nt_pref) {
                int nt = n - t0 < nt_pref ? (int)(n - t0) : nt_pref;
                if (act_int8) {
                    be->q4_i8(&w1, r0, rt, &xa, t0, nt, g);
                    be->q4_i8(&w3, r0, rt, &xa, t0, nt, u);
                } else {
                    be->q4_f32(&w1, r0, rt, &xf, t0, nt, g);
                    be->q4_f32(&w3, r0, rt, &xf, t0, nt, u);
                }
                for (int t = 0; t < nt; t++)
                    for (int r = 0; r < rt; r++)
                        h[(t0 + t) * hld + r0 + r] = silu(g[r * nt + t]) * u[r * nt + t];
            }
        }
        /* zero h's padding columns (finite values are all the float tiles need) */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n; t++) {
            for (int64_t c = inter; c < hld; c++) h[t * hld + c] = 0.0f;
            if (act_int8)
                be->act_quant(h + t * hld, inter, g2, hb.q + t * w2.cp, hb.s + t * w2.ng,
                              hb.sum + t * w2.ng);
        }
        /* stage 2: down projection, epilogue scales by the routing weight */
        ntiles = (hidden + rtp - 1) / rtp;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < ntiles; i++) {
            int64_t r0 = i * rtp;
            int rt = hidden - r0 < rtp ? (int)(hidden - r0) : rtp;
            float y[CK_MAX_RT * CK_MAX_NT];
            for (int64_t t0 = 0; t0 < n; t0 += nt_pref) {
                int nt = n - t0 < nt_pref ? (int)(n - t0) : nt_pref;
                if (act_int8) be->q4_i8(&w2, r0, rt, &ha, t0, nt, y);
                else be->q4_f32(&w2, r0, rt, &hf, t0, nt, y);
                for (int t = 0; t < nt; t++) {
                    float s = rw ? ck_ldf(rw + t0 + t) : 1.0f;
                    float *o = out + (t0 + t) * hidden + r0;
                    for (int r = 0; r < rt; r++) {
                        float v = y[r * nt + t] * s;
                        ck_stf(o + r, accumulate ? ck_ldf(o + r) + v : v);
                    }
                }
            }
        }
    }
    if (h_owned) free(h);
    act_buf_free(&xb);
    act_buf_free(&hb);
    free(tail);
    return ok ? 0 : -1;
}
