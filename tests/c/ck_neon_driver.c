/* ck_neon_driver.c -- the NEON backend (colibri_core/kernels/c/ck_neon.c) against the scalar
 * reference (ck_scalar.c), compiled with ck_neon_api.c (ck_neon_driver.h: what the two
 * share) into one aarch64 binary with the kernel sources and
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
 * - the public API (ck_matmul, ck_expert_ffn, ck_attention_decode and the pipeline step
 *   ck_step_attention / _experts / _head), on 1 and 2 threads of ck_pool.c, with
 *   ck_set_backend(CK_NEON) against ck_set_backend(CK_SCALAR): ck_neon_api.c.
 * Bit-exact where the x86 backends are (act_quant; every int8 product, hence the int8
 * matmuls, FFNs and step blocks); elsewhere within the tolerance printed per kernel:
 * max |neon - scalar| / max |scalar| over a case's outputs, or per element relative for
 * exp (vs double exp) and softmax.
 *
 * Output: one line per kernel and variant,
 *   KERNEL <kernel> <variant> PASS|FAIL|SKIP cases=<n> exact | maxerr=<e> tol=<t> | <why>
 * then `SUMMARY dotprod=<0|1> selected=<plain|sdot> kernels=<n> failures=<n> seconds=<s>`.
 * Exit status 0 when nothing failed. */
#include "ck_neon_driver.h"

/* ------------------------------------------------------------------ reports */

static int g_kernels, g_failures;

report rep(const char *kernel, const char *variant, double tol) {
    return (report){kernel, variant, tol, 0, 0, 0.0};
}

void rep_print(const report *r) {
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

/* one case with error err (NaN: fails) */
void rep_err(report *r, double err, const char *what) {
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
void rep_floats(report *r, const void *got, const void *ref, int64_t n,
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

uint32_t rnd(void) {           /* xorshift64* */
    g_rng ^= g_rng >> 12; g_rng ^= g_rng << 25; g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 2685821657736338717ull) >> 32);
}

void seed(uint64_t s) { g_rng = (s + 1) * 0x9E3779B97F4A7C15ull; }

float uni(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() >> 8) / 16777216.0f; }

static float gauss(void) {            /* Box-Muller */
    float u = uni(1e-7f, 1.0f), v = uni(0.0f, 6.2831853f);
    return sqrtf(-2.0f * logf(u)) * cosf(v);
}

/* A bump arena: every block starts at an odd address (parts of a mapped model file may
 * sit at any byte offset), never freed until reset. */
static unsigned char *g_arena;
size_t g_used;                       /* bytes in use: 0 resets the arena */
static size_t g_cap = 64u << 20;

void *odd(size_t n) {
    size_t at = (g_used + 15) / 16 * 16 + 1;
    if (at + n > g_cap) { fprintf(stderr, "arena full\n"); exit(2); }
    g_used = at + n;
    memset(g_arena + at, 0, n);
    return g_arena + at;
}


float *floats(int64_t n, float scale) {        /* gauss * scale, some outliers */
    float *p = odd((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) stf(p, i, gauss() * scale * (i % 17 == 3 ? 8.0f : 1.0f));
    return p;
}

ck_mat q4_mat(int64_t rows, int64_t cols, int64_t group) {
    const int64_t cp = rup(cols, group), ng = cp / group;
    uint8_t *d = odd((size_t)(rows * cp / 2)), *z = odd((size_t)(rows * ng));
    float *s = odd((size_t)(rows * ng) * 4);
    for (int64_t i = 0; i < rows * cp / 2; i++) d[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < rows * ng; i++) { z[i] = (uint8_t)(rnd() % 16); stf(s, i, uni(0.001f, 0.05f)); }
    return (ck_mat){CK_W_Q4, d, s, z, rows, cols, group};
}

ck_mat q8_mat(int64_t rows, int64_t cols, int64_t group) {
    const int64_t cp = rup(cols, group), ng = cp / group;
    int8_t *d = odd((size_t)(rows * cp));
    float *s = odd((size_t)(rows * ng) * 4);
    for (int64_t i = 0; i < rows * cp; i++) d[i] = (int8_t)(rnd() % 255 - 127);
    for (int64_t i = 0; i < rows * ng; i++) stf(s, i, uni(0.001f, 0.05f));
    return (ck_mat){CK_W_Q8, d, s, NULL, rows, cols, group};
}

ck_mat q6_mat(int64_t rows, int64_t cols, int64_t group) {
    const int64_t cp = rup(cols, group), ng = cp / group, nb = rows * (cp / 64) * CK_Q6_BLOCK;
    uint8_t *d = odd((size_t)nb), *z = odd((size_t)(rows * ng));
    float *s = odd((size_t)(rows * ng) * 4);
    for (int64_t i = 0; i < nb; i++) d[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < rows * ng; i++) { z[i] = (uint8_t)(rnd() % 64); stf(s, i, uni(0.001f, 0.05f)); }
    return (ck_mat){CK_W_Q6, d, s, z, rows, cols, group};
}

/* an mxfp4 matrix (ck_internal.h's ck_mx) of cols a multiple of 32: random codes,
 * exponents 110..140 */
static ck_mx mx_view(int64_t rows, int64_t cols) {
    const int64_t cp = rup(cols, 64);
    uint8_t *d = odd((size_t)(rows * cp / 2)), *e = odd((size_t)(rows * cp / 32));
    for (int64_t i = 0; i < rows * cp / 2; i++) d[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < rows * cp / 32; i++) e[i] = (uint8_t)(110 + rnd() % 31);
    return (ck_mx){d, NULL, e, rows, cols, 64, cp, cp / 64};
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
double abs_dot(const ck_mat *m, int64_t r, const float *x) {
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
ck_act quantized(const float *x, int64_t n, int64_t cols, int64_t group) {
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
    report r6 = rep("q6_i8", variant, -1), rm = rep("mx_i8", variant, -1);
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
            if (gi) continue;                  /* mxfp4: activations in groups of 64 */
            const int64_t cm = rup(c, 32);
            ck_mx wm = mx_view(5, cm);
            ck_act am = quantized(floats(5 * cm, 1.0f), 5, cm, 64);
            for (int i = 0; i < NSHAPES; i++) {
                int rt, nt;
                shape(i, &rt, &nt);
                float ref[16], got[16];
                char what[64];
                snprintf(what, sizeof what, "cols %ld tile %dx%d", (long)cm, rt, nt);
                ck_backend_scalar.mx_i8(&wm, 1, rt, &am, 1, nt, ref);
                be->mx_i8(&wm, 1, rt, &am, 1, nt, got);
                rep_floats(&rm, got, ref, rt * nt, NULL, what);
            }
        }
    rep_print(&r4);
    rep_print(&r8);
    rep_print(&r6);
    rep_print(&rm);
}


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
const double *vscale(const float *v, int64_t m, int64_t n) {
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
        rep_skip("mx_i8", "sdot", "(the CPU has no dotprod)");
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
