/* ck_neon_driver.c -- the NEON backend (colibri_core/kernels/c/ck_neon.c) against the scalar
 * reference (ck_scalar.c), compiled into one aarch64 binary with the kernel sources and
 * run without Python. tests/test_neon_emulated.py builds it with Debian's cross compiler
 * and the package's own kernel flags (_kernels_build.kernel_flags) and runs it under
 * qemu-aarch64 with -cpu cortex-a53 (plain NEON) and -cpu max (sdot); by hand:
 * docs/ARCHITECTURE.md, "The NEON backend". Not part of the extension (_kernels_build.py
 * compiles the .c files of colibri_core/kernels/c only).
 *
 * Checked, on random data and odd shapes (partial groups and 64-blocks, groups of 64,
 * 128 and 192, more than 32 groups, every tile shape the dispatch can ask for, parts at
 * odd byte addresses):
 * - each slot of the backend table, the int8 tiles in both variants (sdot only where the
 *   CPU has it), and the vector exp and softmax;
 * - the public API the engine calls (ck_matmul, ck_expert_ffn, ck_attention_decode and
 *   the pipeline step ck_step_attention / _experts / _head), on 1 and 2 threads, with
 *   ck_set_backend(CK_NEON) against ck_set_backend(CK_SCALAR).
 * Bit-exact where the x86 backends are (act_quant; every int8 product, hence the int8
 * matmuls, FFNs and step blocks); elsewhere within the tolerance printed per kernel:
 * max |neon - scalar| / max |scalar| over a case's outputs, or per element relative for
 * exp (vs double exp) and softmax.
 *
 * Output: one line per kernel and variant,
 *   KERNEL <kernel> <variant> PASS|FAIL|SKIP cases=<n> exact | maxerr=<e> tol=<t> | <why>
 * then `SUMMARY dotprod=<0|1> selected=<plain|sdot> kernels=<n> failures=<n> seconds=<s>`.
 * Exit status 0 when nothing failed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ck.h"
#include "ck_internal.h"

#if !defined(__aarch64__)
#error "ck_neon_driver.c tests the aarch64 NEON backend: build it with an aarch64 compiler"
#endif

/* ------------------------------------------------------------------ reports */

typedef struct {
    const char *kernel, *variant;
    double tol;            /* < 0: bit-exact */
    long cases, bad;
    double maxerr;
} report;

static int g_kernels, g_failures;

static report rep(const char *kernel, const char *variant, double tol) {
    return (report){kernel, variant, tol, 0, 0, 0.0};
}

static void rep_print(const report *r) {
    g_kernels++;
    g_failures += r->bad > 0;
    if (r->tol < 0)
        printf("KERNEL %s %s %s cases=%ld exact\n", r->kernel, r->variant,
               r->bad ? "FAIL" : "PASS", r->cases);
    else
        printf("KERNEL %s %s %s cases=%ld maxerr=%.3g tol=%.3g\n", r->kernel, r->variant,
               r->bad ? "FAIL" : "PASS", r->cases, r->maxerr, r->tol);
    fflush(stdout);
}

static void rep_skip(const char *kernel, const char *variant, const char *why) {
    printf("KERNEL %s %s SKIP cases=0 %s\n", kernel, variant, why);
}

static void stf(void *p, int64_t i, float v) { memcpy((char *)p + 4 * i, &v, 4); }
static float ldf(const void *p, int64_t i) { float v; memcpy(&v, (const char *)p + 4 * i, 4); return v; }

/* one case with error err (NaN: fails) */
static void rep_err(report *r, double err, const char *what) {
    r->cases++;
    if (err != err) err = INFINITY;
    if (err > r->maxerr) r->maxerr = err;
    if (err > r->tol) {
        r->bad++;
        if (r->bad <= 3) printf("  error %.3g: %s %s %s\n", err, r->kernel, r->variant, what);
    }
}

/* One case: n values of got against ref (read with memcpy: they may be unaligned).
 * Bit-exact reports compare the bits. Others take max_i |got_i - ref_i| / scale_i, where
 * scale_i = scale[i] when scale is given (a dot product's sum of |terms|), else
 * max_i |ref_i| over the case. */
static void rep_floats(report *r, const void *got, const void *ref, int64_t n,
                       const double *scale, const char *what) {
    if (r->tol < 0) {
        r->cases++;
        if (memcmp(got, ref, (size_t)n * 4)) {
            r->bad++;
            if (r->bad <= 3) printf("  mismatch: %s %s %s\n", r->kernel, r->variant, what);
        }
        return;
    }
    double top = 0.0, err = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double b = ldf(ref, i);
        if (fabs(b) > top) top = fabs(b);
    }
    for (int64_t i = 0; i < n; i++) {
        const double sc = scale ? scale[i] : top;
        const double e = fabs((double)ldf(got, i) - (double)ldf(ref, i)) / (sc > 0 ? sc : 1.0);
        if (!(e <= err)) err = e;    /* a NaN sticks */
    }
    rep_err(r, err, what);
}

static void rep_bytes(report *r, const void *got, const void *ref, size_t n, const char *what) {
    r->cases++;
    if (memcmp(got, ref, n)) {
        r->bad++;
        if (r->bad <= 3) printf("  mismatch: %s %s %s\n", r->kernel, r->variant, what);
    }
}

/* ------------------------------------------------------------------ data */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;

static uint32_t rnd(void) {           /* xorshift64* */
    g_rng ^= g_rng >> 12; g_rng ^= g_rng << 25; g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 2685821657736338717ull) >> 32);
}

static void seed(uint64_t s) { g_rng = (s + 1) * 0x9E3779B97F4A7C15ull; }

static float uni(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() >> 8) / 16777216.0f; }

static float gauss(void) {            /* Box-Muller */
    float u = uni(1e-7f, 1.0f), v = uni(0.0f, 6.2831853f);
    return sqrtf(-2.0f * logf(u)) * cosf(v);
}

/* A bump arena: every block starts at an odd address (parts of a mapped model file may
 * sit at any byte offset), never freed until reset. */
static unsigned char *g_arena;
static size_t g_used, g_cap = 64u << 20;

static void *odd(size_t n) {
    size_t at = (g_used + 15) / 16 * 16 + 1;
    if (at + n > g_cap) { fprintf(stderr, "arena full\n"); exit(2); }
    g_used = at + n;
    memset(g_arena + at, 0, n);
    return g_arena + at;
}


static float *floats(int64_t n, float scale) {        /* gauss * scale, some outliers */
    float *p = odd((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) stf(p, i, gauss() * scale * (i % 17 == 3 ? 8.0f : 1.0f));
    return p;
}

static inline int64_t rup(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

static ck_mat q4_mat(int64_t rows, int64_t cols, int64_t group) {
    const int64_t cp = rup(cols, group), ng = cp / group;
    uint8_t *d = odd((size_t)(rows * cp / 2)), *z = odd((size_t)(rows * ng));
    float *s = odd((size_t)(rows * ng) * 4);
    for (int64_t i = 0; i < rows * cp / 2; i++) d[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < rows * ng; i++) { z[i] = (uint8_t)(rnd() % 16); stf(s, i, uni(0.001f, 0.05f)); }
    return (ck_mat){CK_W_Q4, d, s, z, rows, cols, group};
}

static ck_mat q8_mat(int64_t rows, int64_t cols, int64_t group) {
    const int64_t cp = rup(cols, group), ng = cp / group;
    int8_t *d = odd((size_t)(rows * cp));
    float *s = odd((size_t)(rows * ng) * 4);
    for (int64_t i = 0; i < rows * cp; i++) d[i] = (int8_t)(rnd() % 255 - 127);
    for (int64_t i = 0; i < rows * ng; i++) stf(s, i, uni(0.001f, 0.05f));
    return (ck_mat){CK_W_Q8, d, s, NULL, rows, cols, group};
}

static ck_mat q6_mat(int64_t rows, int64_t cols, int64_t group) {
    const int64_t cp = rup(cols, group), ng = cp / group, nb = rows * (cp / 64) * CK_Q6_BLOCK;
    uint8_t *d = odd((size_t)nb), *z = odd((size_t)(rows * ng));
    float *s = odd((size_t)(rows * ng) * 4);
    for (int64_t i = 0; i < nb; i++) d[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < rows * ng; i++) { z[i] = (uint8_t)(rnd() % 64); stf(s, i, uni(0.001f, 0.05f)); }
    return (ck_mat){CK_W_Q6, d, s, z, rows, cols, group};
}

static ck_q4 q4_view(const ck_mat *m) {
    int64_t cp = rup(m->cols, m->group);
    return (ck_q4){m->data, m->scales, m->zeros, m->rows, m->cols, m->group, cp, cp / m->group};
}

static ck_q8 q8_view(const ck_mat *m) {
    int64_t cp = rup(m->cols, m->group);
    return (ck_q8){m->data, m->scales, m->rows, m->cols, m->group, cp, cp / m->group};
}

/* sum_k |w[r, k] * x[k]| over the cols columns (double): the scale of a dot product's
 * rounding error, whatever the order of its sum */
static double abs_dot(const ck_mat *m, int64_t r, const float *x) {
    const int64_t cp = rup(m->cols, m->group), ng = cp / m->group;
    double acc = 0.0;
    for (int64_t k = 0; k < m->cols; k++) {
        const int64_t g = r * ng + k / m->group;
        double w;
        if (m->kind == CK_W_Q4) {
            const uint8_t b = ((const uint8_t *)m->data)[r * cp / 2 + (k / 64) * 32 + k % 32];
            w = (double)((k % 64 < 32 ? b & 15 : b >> 4) - m->zeros[g]);
        } else if (m->kind == CK_W_Q6) {
            const uint8_t *blk = (const uint8_t *)m->data + r * (cp / 64) * CK_Q6_BLOCK +
                                 (k / 64) * CK_Q6_BLOCK;
            const int j = (int)(k % 64), b = blk[j % 32];
            const int q = (j < 32 ? b & 15 : b >> 4) | (((blk[32 + j % 16] >> (2 * (j / 16))) & 3) << 4);
            w = (double)(q - m->zeros[g]);
        } else {
            w = ((const int8_t *)m->data)[r * cp + k];
        }
        acc += fabs(w * ldf(m->scales, g) * ldf(x, k));
    }
    return acc;
}

/* n activation rows quantized by the scalar reference, as ck_core.c does */
static ck_act quantized(const float *x, int64_t n, int64_t cols, int64_t group) {
    const int64_t cp = rup(cols, group), ng = cp / group;
    int8_t *q = odd((size_t)(n * cp));
    float *s = odd((size_t)(n * ng) * 4);
    int32_t *sum = odd((size_t)(n * ng) * 4);
    for (int64_t t = 0; t < n; t++)
        ck_scalar_act_quant(x + t * cols, cols, group, q + t * cp, s + t * ng, sum + t * ng);
    return (ck_act){q, s, sum, cp, ng};
}

/* ------------------------------------------------------------------ the slots */

static const int64_t COLS[] = {64, 100, 130, 300, 1000, 64 * 43};
static const int64_t GROUPS[] = {64, 128, 192};
#define LEN(a) ((int)(sizeof(a) / sizeof((a)[0])))

static void test_act_quant(const ck_backend_t *be) {
    seed(1);
    static const int64_t cols[] = {1, 15, 16, 63, 64, 100, 128, 130, 191, 300, 1000};
    report r = rep("act_quant", "neon", -1);
    for (int ci = 0; ci < LEN(cols); ci++)
        for (int gi = 0; gi < LEN(GROUPS); gi++)
            for (int kind = 0; kind < 6; kind++) {
                g_used = 0;
                const int64_t c = cols[ci], G = GROUPS[gi], cp = rup(c, G), ng = cp / G;
                float *x = floats(c, kind == 5 ? 1e-39f : powf(10.0f, (float)kind - 2.0f));
                if (kind == 1) for (int64_t i = 0; i < c && i < G; i++) stf(x, i, 0.0f);
                if (kind == 2 && c > 3) {         /* exact .5 ties after scaling: half-even */
                    stf(x, 0, 127.0f); stf(x, 1, 0.5f); stf(x, 2, -1.5f); stf(x, 3, -0.0f);
                }
                if (kind == 3) stf(x, c / 2, NAN);
                if (kind == 4) { stf(x, c - 1, INFINITY); stf(x, 0, -3e38f); }
                int8_t *q[2] = {odd((size_t)cp), odd((size_t)cp)};
                float *s[2] = {odd((size_t)ng * 4), odd((size_t)ng * 4)};
                int32_t *sum[2] = {odd((size_t)ng * 4), odd((size_t)ng * 4)};
                ck_scalar_act_quant(x, c, G, q[0], s[0], sum[0]);
                be->act_quant(x, c, G, q[1], s[1], sum[1]);
                char what[64];
                snprintf(what, sizeof what, "cols %ld group %ld kind %d", (long)c, (long)G, kind);
                rep_bytes(&r, q[1], q[0], (size_t)cp, what);
                rep_bytes(&r, s[1], s[0], (size_t)ng * 4, what);
                rep_bytes(&r, sum[1], sum[0], (size_t)ng * 4, what);
            }
    rep_print(&r);
}

/* every tile shape ck_core.c / ck_step*.c ask for: rt 1..4 x 1 token, rt x 2..4 tokens,
 * starting at row 1 and token 1 */
#define NSHAPES 16
static void shape(int i, int *rt, int *nt) { *rt = 1 + i % 4; *nt = 1 + i / 4; }

static void test_int8_tiles(const ck_backend_t *be, const char *variant) {
    seed(2);
    report r4 = rep("q4_i8", variant, -1), r8 = rep("q8_i8", variant, -1);
    report r6 = rep("q6_i8", variant, -1);
    for (int ci = 0; ci < LEN(COLS); ci++)
        for (int gi = 0; gi < LEN(GROUPS); gi++) {
            g_used = 0;
            const int64_t c = COLS[ci], G = GROUPS[gi];
            ck_mat m4 = q4_mat(5, c, G), m8 = q8_mat(5, c, G), m6 = q6_mat(5, c, G);
            ck_q4 w4 = q4_view(&m4);
            ck_q6 w6 = q4_view(&m6);   /* q6 uses ck_q4's fields */
            ck_q8 w8 = q8_view(&m8);
            ck_act a = quantized(floats(5 * c, 1.0f), 5, c, G);
            for (int i = 0; i < NSHAPES; i++) {
                int rt, nt;
                shape(i, &rt, &nt);
                float ref[16], got[16];
                char what[64];
                snprintf(what, sizeof what, "cols %ld group %ld tile %dx%d", (long)c, (long)G, rt, nt);
                ck_backend_scalar.q4_i8(&w4, 1, rt, &a, 1, nt, ref);
                be->q4_i8(&w4, 1, rt, &a, 1, nt, got);
                rep_floats(&r4, got, ref, rt * nt, NULL, what);
                ck_backend_scalar.q8_i8(&w8, 1, rt, &a, 1, nt, ref);
                be->q8_i8(&w8, 1, rt, &a, 1, nt, got);
                rep_floats(&r8, got, ref, rt * nt, NULL, what);
                ck_backend_scalar.q6_i8(&w6, 1, rt, &a, 1, nt, ref);
                be->q6_i8(&w6, 1, rt, &a, 1, nt, got);
                rep_floats(&r6, got, ref, rt * nt, NULL, what);
            }
        }
    rep_print(&r4);
    rep_print(&r8);
    rep_print(&r6);
}

#define FLOAT_TOL 1e-5     /* as tests/test_kernels.py's FLOAT_TOL */

static void test_float_tiles(const ck_backend_t *be) {
    seed(3);
    report r4 = rep("q4_f32", "neon", FLOAT_TOL), r8 = rep("q8_f32", "neon", FLOAT_TOL);
    for (int ci = 0; ci < LEN(COLS); ci++)
        for (int gi = 0; gi < LEN(GROUPS); gi++)
            for (int padded = 0; padded < 2; padded++) {
                g_used = 0;
                const int64_t c = COLS[ci], G = GROUPS[gi], full = c / 64 * 64;
                ck_mat m4 = q4_mat(5, c, G), m8 = q8_mat(5, c, G);
                ck_q4 w4 = q4_view(&m4);
                ck_q8 w8 = q8_view(&m8);
                /* packed rows with a zero-padded copy of each partial last 64-block (as
                 * ck_core.c), or rows padded with zeros to whole blocks (the FFN's h) */
                const int64_t ld = padded ? rup(c, 64) : c;
                float *x = odd((size_t)(5 * ld) * 4), *tail = NULL;
                for (int64_t t = 0; t < 5; t++)
                    for (int64_t k = 0; k < c; k++) stf(x, t * ld + k, gauss());
                if (!padded && full != c) {
                    tail = odd(5 * 64 * 4);
                    for (int64_t t = 0; t < 5; t++) memcpy(tail + t * 64, x + t * ld + full, (size_t)(c - full) * 4);
                }
                ck_xf xf = {x, ld, c, tail};
                double sc4[5][5], sc8[5][5];          /* [row][token] */
                for (int64_t r = 0; r < 5; r++)
                    for (int64_t t = 0; t < 5; t++) {
                        sc4[r][t] = abs_dot(&m4, r, x + t * ld);
                        sc8[r][t] = abs_dot(&m8, r, x + t * ld);
                    }
                for (int i = 0; i < NSHAPES; i++) {
                    int rt, nt;
                    shape(i, &rt, &nt);
                    float ref[16], got[16];
                    char what[80];
                    snprintf(what, sizeof what, "cols %ld group %ld tile %dx%d padded %d", (long)c,
                             (long)G, rt, nt, padded);
                    double s4[16], s8[16];
                    for (int k = 0; k < rt * nt; k++) {
                        s4[k] = sc4[1 + k / nt][1 + k % nt];
                        s8[k] = sc8[1 + k / nt][1 + k % nt];
                    }
                    ck_backend_scalar.q4_f32(&w4, 1, rt, &xf, 1, nt, ref);
                    be->q4_f32(&w4, 1, rt, &xf, 1, nt, got);
                    rep_floats(&r4, got, ref, rt * nt, s4, what);
                    ck_backend_scalar.q8_f32(&w8, 1, rt, &xf, 1, nt, ref);
                    be->q8_f32(&w8, 1, rt, &xf, 1, nt, got);
                    rep_floats(&r8, got, ref, rt * nt, s8, what);
                }
            }
    rep_print(&r4);
    rep_print(&r8);
}

#define EXP_TOL 1e-6       /* relative, against double exp */
/* relative, per weight, against ck_softmax_rows: the float sums of the len exps are
 * rounded in different orders (one sequential sum; four lanes), which alone makes them
 * differ by ~2e-6 at len 1031 */
#define SOFTMAX_TOL 1e-5
#define ATTN_TOL 1e-5      /* relative to max |v| */

static void test_exp_softmax(void) {
    seed(4);
    report re = rep("exp", "neon", EXP_TOL), rs = rep("softmax", "neon", SOFTMAX_TOL);
    enum { N = 4099 };
    static float x[N], y[N];
    for (int i = 0; i < N; i++) x[i] = i < 3000 ? -87.0f + 175.0f * (float)i / 3000.0f : uni(-20.0f, 5.0f);
    ck_neon_exp(x, N, y);
    for (int i = 0; i < N; i++) {
        const double e = exp((double)x[i]);
        char what[64];
        snprintf(what, sizeof what, "exp(%.9g) = %.9g", x[i], y[i]);
        rep_err(&re, fabs((double)y[i] - e) / e, what);
    }
    float sp[4] = {0.0f, NAN, -INFINITY, -200.0f}, so[4];
    ck_neon_exp(sp, 4, so);
    re.cases++;
    if (!(so[0] == 1.0f && so[1] != so[1] && so[2] == 0.0f && so[3] == 0.0f)) {
        re.bad++;
        printf("  exp(0, nan, -inf, -200) = %g %g %g %g\n", so[0], so[1], so[2], so[3]);
    }
    rep_print(&re);

    static const int64_t lens[] = {1, 2, 3, 4, 5, 7, 8, 77, 300, 1031};
    for (int li = 0; li < LEN(lens); li++) {
        const int64_t len = lens[li];
        const int g = 3;
        float *a = malloc((size_t)(g * len) * 4), *b = malloc((size_t)(g * len) * 4);
        for (int64_t i = 0; i < g * len; i++) a[i] = b[i] = gauss() * 4.0f;
        ck_softmax_rows(a, g, len);
        ck_neon_softmax_rows(b, g, len);
        char what[64];
        snprintf(what, sizeof what, "len %ld", (long)len);
        for (int64_t i = 0; i < g * len; i++) rep_err(&rs, fabs((double)b[i] - a[i]) / a[i], what);
        free(a);
        free(b);
    }
    rep_print(&rs);
}

/* n copies of max |v| over m values: an attention output is a weighted mean of value
 * rows, so its error is at most max |v| times the weights' (released by the next call) */
static const double *vscale(const float *v, int64_t m, int64_t n) {
    static double *buf;
    static int64_t cap;
    double top = 0.0;
    for (int64_t i = 0; i < m; i++) if (fabs(ldf(v, i)) > top) top = fabs(ldf(v, i));
    if (n > cap) { free(buf); buf = malloc((size_t)n * sizeof *buf); cap = n; }
    for (int64_t i = 0; i < n; i++) buf[i] = top;
    return buf;
}

static void test_attn_slot(const ck_backend_t *be) {
    seed(5);
    /* (g, d, len): head groups of 1..8, head sizes with a d % 4 and d % 8 tail */
    static const int64_t cases[][3] = {{1, 7, 1}, {4, 64, 3}, {1, 100, 77}, {2, 72, 300},
                                       {8, 32, 5}, {3, 40, 17}, {4, 64, 130}, {5, 128, 9}};
    report r = rep("attn", "neon", ATTN_TOL);
    for (int i = 0; i < LEN(cases); i++) {
        g_used = 0;
        const int g = (int)cases[i][0];
        const int64_t d = cases[i][1], len = cases[i][2], ld = 2 * d + 1;
        float *q = floats(g * d, 1.0f), *k = floats(len * ld, 1.0f), *v = floats(len * ld, 1.0f);
        float *o[2] = {odd((size_t)(g * d) * 4), odd((size_t)(g * d) * 4)};
        float *s = malloc((size_t)(g * len) * 4);
        const float scale = 1.0f / sqrtf((float)d);
        char what[64];
        snprintf(what, sizeof what, "g %d d %ld len %ld", g, (long)d, (long)len);
        ck_backend_scalar.attn(q, g, d, k, v, ld, len, scale, s, o[0]);
        be->attn(q, g, d, k, v, ld, len, scale, s, o[1]);
        rep_floats(&r, o[1], o[0], g * d, vscale(v, len * ld, g * d), what);
        free(s);
    }
    rep_print(&r);
}

/* ------------------------------------------------------------------ the public API */

/* fn(0) under the scalar backend, fn(1) under NEON, on 1 and 2 threads (2: even tiny
 * calls run on both); fn compares its outputs */
static void both_threads(void (*fn)(report *, report *), report *exact, report *tol) {
    for (int th = 1; th <= 2; th++) {
        ck_set_threads(th);
        ck_set_par_min_work(th > 1 ? 0 : -1);
        fn(exact, tol);
    }
    ck_set_threads(1);
    ck_set_par_min_work(-1);
}

static void api_matmul(report *exact, report *tol) {
    seed(6);
    static const int64_t shapes[][3] = {{3, 130, 64}, {37, 300, 128}, {259, 1000, 64},
                                        {5, 64 * 43, 128}, {9, 500, 192}};
    static const int64_t ns[] = {1, 2, 3, 5, 9};
    for (int si = 0; si < LEN(shapes); si++)
        for (int ni = 0; ni < LEN(ns); ni++) {
            g_used = 0;
            const int64_t rows = shapes[si][0], cols = shapes[si][1], G = shapes[si][2], n = ns[ni];
            ck_mat m[3] = {q4_mat(rows, cols, G), q8_mat(rows, cols, G), q6_mat(rows, cols, G)};
            float *x = floats(n * cols, 1.0f);
            double *sc = malloc((size_t)(n * rows) * sizeof *sc);
            for (int w = 0; w < 3; w++)
                for (int act = 0; act < 2; act++) {
                    float *out[2] = {odd((size_t)(n * rows) * 4), odd((size_t)(n * rows) * 4)};
                    for (int b = 0; b < 2; b++) {
                        ck_set_backend(b ? CK_NEON : CK_SCALAR);
                        if (ck_matmul(&m[w], x, n, out[b], act)) { printf("  ck_matmul failed\n"); exit(2); }
                    }
                    char what[80];
                    snprintf(what, sizeof what, "%s %ldx%ld g%ld n%ld %s threads %d",
                             w == 2 ? "q6" : w ? "q8" : "q4",
                             (long)rows, (long)cols, (long)G, (long)n, act ? "int8" : "float",
                             ck_get_threads());
                    for (int64_t t = 0; t < n; t++)
                        for (int64_t r = 0; r < rows; r++) sc[t * rows + r] = abs_dot(&m[w], r, x + t * cols);
                    rep_floats(act ? exact : tol, out[1], out[0], n * rows, sc, what);
                }
            free(sc);
        }
}

static void api_ffn(report *exact, report *tol) {
    seed(7);
    static const int64_t dims[][4] = {{64, 128, 64, 128}, {130, 300, 128, 64}, {300, 259, 64, 128}};
    static const int64_t ns[] = {1, 2, 7};
    for (int di = 0; di < LEN(dims); di++)
        for (int ni = 0; ni < LEN(ns); ni++) {
            g_used = 0;
            const int64_t H = dims[di][0], I = dims[di][1], n = ns[ni];
            ck_ffn f = {q4_mat(I, H, dims[di][2]), q4_mat(I, H, dims[di][2]), q4_mat(H, I, dims[di][3])};
            float *x = floats(n * H, 1.0f), *rw = floats(n, 1.0f);
            for (int act = 0; act < 2; act++) {
                float *out[2] = {floats(n * H, 1.0f), NULL};
                out[1] = odd((size_t)(n * H) * 4);
                memcpy(out[1], out[0], (size_t)(n * H) * 4);
                for (int b = 0; b < 2; b++) {
                    ck_set_backend(b ? CK_NEON : CK_SCALAR);
                    if (ck_expert_ffn(&f, x, n, out[b], rw, 1, act)) { printf("  ck_expert_ffn failed\n"); exit(2); }
                }
                char what[80];
                snprintf(what, sizeof what, "ffn %ld->%ld n%ld %s threads %d", (long)H, (long)I,
                         (long)n, act ? "int8" : "float", ck_get_threads());
                rep_floats(act ? exact : tol, out[1], out[0], n * H, NULL, what);
            }
        }
}

static void api_attention(report *exact, report *tol) {
    seed(8);
    static const int64_t shapes[][4] = {{4, 2, 64, 1}, {8, 8, 32, 77}, {6, 1, 100, 300},
                                        {1, 1, 7, 3}, {12, 2, 72, 40}};
    (void)exact;
    for (int i = 0; i < LEN(shapes); i++) {
        g_used = 0;
        const int64_t nh = shapes[i][0], nkv = shapes[i][1], d = shapes[i][2], len = shapes[i][3];
        float *q = floats(nh * d, 1.0f), *k = floats(len * nkv * d, 1.0f), *v = floats(len * nkv * d, 1.0f);
        float *out[2] = {odd((size_t)(nh * d) * 4), odd((size_t)(nh * d) * 4)};
        for (int b = 0; b < 2; b++) {
            ck_set_backend(b ? CK_NEON : CK_SCALAR);
            ck_attention_decode(q, nh, d, k, v, nkv, len, 0.3f, out[b]);
        }
        char what[80];
        snprintf(what, sizeof what, "nh %ld nkv %ld d %ld len %ld threads %d", (long)nh, (long)nkv,
                 (long)d, (long)len, ck_get_threads());
        rep_floats(tol, out[1], out[0], nh * d, vscale(v, len * nkv * d, nh * d), what);
    }
}

/* The pipeline step (ck_step*.c): a few steps of one layer over NT tokens of one sequence
 * (attention block, a routed expert block with a shared expert, the lm_head), scalar
 * and NEON each from the same start; with int8 activations, then (g_step_f32) float ones.
 * Experts 1 and 2 hold q8 and f32 / bf16 matrices (the float kinds' tile is portable C). */
static int g_step_f32;

static ck_mat float_mat(int64_t rows, int64_t cols, int kind) {
    float *f = floats(rows * cols, 1.0f / sqrtf((float)cols));
    if (kind == CK_W_BF16) {
        uint16_t *b = odd((size_t)(rows * cols) * 2);
        for (int64_t i = 0; i < rows * cols; i++) {
            uint32_t u;
            memcpy(&u, f + i, 4);
            b[i] = (uint16_t)(u >> 16);
        }
        return (ck_mat){kind, b, NULL, NULL, rows, cols, 64};
    }
    return (ck_mat){kind, f, NULL, NULL, rows, cols, 64};
}

static ck_sscratch scratch(int64_t n, int64_t H, int64_t nh, int64_t d, int64_t hld,
                           int64_t hcp, int64_t kmax, int64_t ne) {
    const int64_t cp_max = rup(H > nh * d ? H : nh * d, 384);   /* whole groups of 64, 128, 192 */
    const int64_t pairs = n * (kmax + 1);
    ck_sscratch s;
    memset(&s, 0, sizeof s);
    s.n_max = n;
    s.xn = odd((size_t)(n * H) * 4);
    s.aq = odd((size_t)(n * cp_max)); s.as = odd((size_t)(n * cp_max / 64) * 4);
    s.asum = odd((size_t)(n * cp_max / 64) * 4);
    s.bq = odd((size_t)(n * cp_max)); s.bs = odd((size_t)(n * cp_max / 64) * 4);
    s.bsum = odd((size_t)(n * cp_max / 64) * 4);
    s.cp_max = cp_max;
    s.q = odd((size_t)(n * nh * d) * 4); s.k = odd((size_t)(n * nh * d) * 4);
    s.v = odd((size_t)(n * nh * d) * 4); s.att = odd((size_t)(n * nh * d) * 4);
    s.pairs_max = pairs;
    s.gq = odd((size_t)(pairs * cp_max)); s.gs = odd((size_t)(pairs * cp_max / 64) * 4);
    s.gsum = odd((size_t)(pairs * cp_max / 64) * 4);
    s.h = odd((size_t)(pairs * hld) * 4); s.hq = odd((size_t)(pairs * hcp));
    s.hs = odd((size_t)(pairs * hcp / 64) * 4); s.hsum = odd((size_t)(pairs * hcp / 64) * 4);
    s.hld = hld; s.hcp = hcp;
    s.pairs_total_max = pairs;
    s.pair_tok = odd((size_t)pairs * 8); s.pair_w = odd((size_t)pairs * 4);
    s.counts = odd((size_t)(2 * ne + 1) * 8);
    s.jobs_max = ne + 2; s.jobs = odd((size_t)((ne + 2) * ck_step_job_bytes()));
    s.act_f32 = g_step_f32;
    s.af = odd((size_t)(n * cp_max) * 4); s.bf = odd((size_t)(n * cp_max) * 4);
    s.gf = odd((size_t)(pairs * cp_max) * 4);
    return s;
}

static void api_step(report *exact, report *tol) {
    seed(9);
    g_used = 0;
    enum { H = 192, NH = 6, NKV = 2, D = 32, I = 130, E = 4, K = 2, STEPS = 3, NT = 3, V = 67 };
    enum { CAP = STEPS * NT };
    ck_attn_layer L;
    memset(&L, 0, sizeof L);
    L.wq = q4_mat(NH * D, H, 64); L.wk = q8_mat(NKV * D, H, 64);
    L.wv = q6_mat(NKV * D, H, 64); L.wo = q4_mat(H, NH * D, 128);
    L.bq = floats(NH * D, 0.1f);
    L.norm = floats(H, 1.0f); L.ffn_norm = floats(H, 1.0f);
    L.hidden = H; L.nh = NH; L.nkv = NKV; L.d = D; L.eps = 1e-6f;
    L.scale = 1.0f / sqrtf((float)D);
    double inv_freq[D / 2];
    for (int i = 0; i < D / 2; i++) inv_freq[i] = pow(10000.0, -2.0 * i / D);
    L.inv_freq = inv_freq; L.rope_factor = 1.0;
    ck_ffn table[E + 1];
    for (int e = 0; e <= E; e++)
        table[e] = (ck_ffn){q4_mat(I, H, 64), q4_mat(I, H, 64), q4_mat(H, I, e % 2 ? 64 : 128)};
    table[1].w2 = q8_mat(H, I, 64);
    table[2] = (ck_ffn){float_mat(I, H, CK_W_F32), float_mat(I, H, CK_W_F32),
                        float_mat(H, I, CK_W_BF16)};
    ck_ffn_block fb = {table, E, &table[E], floats(H, 0.1f), H};
    ck_mat head = q8_mat(V, H, 64), head6 = q6_mat(V, H, 128);
    float *logits6[2];
    for (int b = 0; b < 2; b++) logits6[b] = odd((size_t)(NT * V) * 4);
    float *x0 = floats(NT * H, 1.0f);
    float *kc[2], *vc[2], *x[2], *xn[2], *logits[2];
    for (int b = 0; b < 2; b++) {
        kc[b] = odd((size_t)(CAP * NKV * D) * 4); vc[b] = odd((size_t)(CAP * NKV * D) * 4);
        x[b] = odd((size_t)(NT * H) * 4); xn[b] = odd((size_t)(NT * H) * 4);
        logits[b] = odd((size_t)(NT * V) * 4);
    }
    ck_sscratch s = scratch(NT, H, NH, D, rup(I, 64), rup(I, 128), K, E);
    for (int step = 0; step < STEPS; step++) {
        int64_t ids[NT * K];
        float wts[NT * K];
        for (int t = 0; t < NT; t++) {
            int p = step * NT + t;
            ids[t * K] = (p + 1) % E; ids[t * K + 1] = p % 2 ? -1 : (p + 3) % E;
            wts[t * K] = 0.7f; wts[t * K + 1] = 0.3f;
        }
        for (int b = 0; b < 2; b++) {
            int64_t tok[NT * CK_TOK_COLS];
            memset(tok, 0, sizeof tok);              /* kind CK_KV_F32, no scales */
            for (int t = 0; t < NT; t++) {
                int64_t *tk = tok + CK_TOK_COLS * t;
                tk[0] = step * NT + t;
                tk[1] = (int64_t)(uintptr_t)kc[b]; tk[2] = (int64_t)(uintptr_t)vc[b];
                tk[3] = CAP * NKV * D;
            }
            ck_set_backend(b ? CK_NEON : CK_SCALAR);
            memcpy(x[b], x0, NT * H * 4);
            int rc = ck_step_attention(&L, 0, x[b], NT, tok, xn[b], &s);
            char what[64];
            snprintf(what, sizeof what, "attention block step %d threads %d", step, ck_get_threads());
            if (rc) { printf("  ck_step_attention: %d\n", rc); exit(2); }
            if (b) {
                rep_floats(tol, x[1], x[0], NT * H, NULL, what);
                rep_floats(tol, xn[1], xn[0], NT * H, NULL, what);
                /* the expert block and the head from the scalar block's output, so that
                 * they are compared on the same input: int8 all through, bit-exact */
                memcpy(x[1], x[0], NT * H * 4);
                memcpy(xn[1], xn[0], NT * H * 4);
            }
        }
        for (int b = 0; b < 2; b++) {
            ck_set_backend(b ? CK_NEON : CK_SCALAR);
            int rc = ck_step_experts(&fb, xn[b], NT, ids, wts, K, x[b], &s);
            rc = rc ? rc : ck_step_head(&head, L.norm, 1e-6f, x[b], NT, logits[b], &s);
            rc = rc ? rc : ck_step_head(&head6, L.norm, 1e-6f, x[b], NT, logits6[b], &s);
            if (rc) { printf("  ck_step_experts/head: %d\n", rc); exit(2); }
        }
        char what[64];
        snprintf(what, sizeof what, "expert block + head step %d threads %d", step, ck_get_threads());
        report *r = g_step_f32 ? tol : exact;    /* float tiles: their own sum orders */
        rep_floats(r, x[1], x[0], NT * H, NULL, what);
        rep_floats(r, logits[1], logits[0], NT * V, NULL, what);
        rep_floats(r, logits6[1], logits6[0], NT * V, NULL, what);
        memcpy(x0, x[0], NT * H * 4);          /* the next step starts from this one */
    }
}

/* ------------------------------------------------------------------ main */

int main(void) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    g_arena = malloc(g_cap);
    if (!g_arena) return 2;
    ck_init();
    const int dotprod = ck_neon_has_dotprod();
    if (ck_set_backend(CK_NEON) != 0) { printf("the NEON backend is not available\n"); return 2; }
    const ck_backend_t *selected = ck_active_backend();
    const char *sel = selected == &ck_backend_neon_sdot ? "sdot" : "plain";
    if (selected != (dotprod ? &ck_backend_neon_sdot : &ck_backend_neon)) {
        printf("ck_set_backend(CK_NEON) picked the %s table on a CPU with dotprod=%d\n", sel, dotprod);
        g_failures++;
    }

    test_act_quant(&ck_backend_neon);
    test_int8_tiles(&ck_backend_neon, "plain");
    if (dotprod) test_int8_tiles(&ck_backend_neon_sdot, "sdot");
    else {
        rep_skip("q4_i8", "sdot", "(the CPU has no dotprod)");
        rep_skip("q8_i8", "sdot", "(the CPU has no dotprod)");
        rep_skip("q6_i8", "sdot", "(the CPU has no dotprod)");
    }
    test_float_tiles(&ck_backend_neon);
    test_exp_softmax();
    test_attn_slot(&ck_backend_neon);

    const char *v = dotprod ? "api-sdot" : "api-plain";
    report e = rep("matmul_int8", v, -1), t = rep("matmul_float", v, FLOAT_TOL);
    both_threads(api_matmul, &e, &t);
    rep_print(&e); rep_print(&t);
    e = rep("expert_ffn_int8", v, -1); t = rep("expert_ffn_float", v, FLOAT_TOL);
    both_threads(api_ffn, &e, &t);
    rep_print(&e); rep_print(&t);
    t = rep("attention_decode", v, ATTN_TOL);
    both_threads(api_attention, NULL, &t);
    rep_print(&t);
    e = rep("step_experts_head", v, -1); t = rep("step_attention", v, ATTN_TOL);
    both_threads(api_step, &e, &t);
    rep_print(&e); rep_print(&t);
    g_step_f32 = 1;
    t = rep("step_float", v, FLOAT_TOL);
    both_threads(api_step, &t, &t);
    rep_print(&t);

    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("SUMMARY dotprod=%d selected=%s kernels=%d failures=%d seconds=%.2f\n", dotprod, sel,
           g_kernels, g_failures,
           (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    free(g_arena);
    return g_failures ? 1 : 0;
}
