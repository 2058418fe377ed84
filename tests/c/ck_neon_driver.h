/* ck_neon_driver.h -- what the aarch64 test driver's two files share: ck_neon_driver.c
 * (reports, random data, the backend slots' checks, main) and ck_neon_api.c (the public
 * C API's checks). See ck_neon_driver.c for what is checked and how it is reported. */
#ifndef CK_NEON_DRIVER_H
#define CK_NEON_DRIVER_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ck.h"
#include "ck_internal.h"

#if !defined(__aarch64__)
#error "the NEON driver tests the aarch64 NEON backend: build it with an aarch64 compiler"
#endif

#define LEN(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define FLOAT_TOL 1e-5     /* as tests/test_kernels.py's FLOAT_TOL */
#define ATTN_TOL 1e-5      /* relative to max |v| */

typedef struct {
    const char *kernel, *variant;
    double tol;            /* < 0: bit-exact */
    long cases, bad;
    double maxerr;
} report;

static inline void stf(void *p, int64_t i, float v) { memcpy((char *)p + 4 * i, &v, 4); }
static inline float ldf(const void *p, int64_t i) {
    float v;
    memcpy(&v, (const char *)p + 4 * i, 4);
    return v;
}
static inline int64_t rup(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* ck_neon_driver.c: reports */
report rep(const char *kernel, const char *variant, double tol);
void rep_print(const report *r);
void rep_err(report *r, double err, const char *what);
void rep_floats(report *r, const void *got, const void *ref, int64_t n, const double *scale,
                const char *what);

/* ck_neon_driver.c: random data, in a bump arena of blocks at odd addresses */
uint32_t rnd(void);
void seed(uint64_t s);
float uni(float lo, float hi);
extern size_t g_used;     /* the arena's bytes in use: 0 resets it */
void *odd(size_t n);
float *floats(int64_t n, float scale);
ck_mat q4_mat(int64_t rows, int64_t cols, int64_t group);
ck_mat q8_mat(int64_t rows, int64_t cols, int64_t group);
ck_mat q6_mat(int64_t rows, int64_t cols, int64_t group);
double abs_dot(const ck_mat *m, int64_t r, const float *x);
ck_act quantized(const float *x, int64_t n, int64_t cols, int64_t group);
const double *vscale(const float *v, int64_t m, int64_t n);

/* ck_neon_api.c: the public API, under NEON against scalar */
extern int g_step_f32;     /* api_step: float weights (CK_W_F32 / F16 / BF16) */
void both_threads(void (*fn)(report *, report *), report *exact, report *tol);
void api_matmul(report *exact, report *tol);
void api_ffn(report *exact, report *tol);
void api_attention(report *exact, report *tol);
void api_step(report *exact, report *tol);

#endif
