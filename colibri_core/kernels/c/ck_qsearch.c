/* The converter's per-group scale / zero-point search for q4 and q6 (quant.py's
 * q4_group_params with clip "mse" or "minmax", then the group's codes), in C.
 *
 * quant.py's numpy code is the reference and this file reproduces it bit for bit: every
 * step is the same IEEE double operation in the same order (division, rint half to even,
 * the clamp, the float32 rounding of a scale), and a group's squared error is summed as
 * numpy sums a row (pairwise_sum below), so the candidates compare exactly as they do there.
 * Nothing here may be contracted into fused multiply-adds: the file is compiled for the
 * baseline ISA (x86-64 has no FMA there; aarch64 builds with -ffp-contract=off).
 * Groups are independent: ck_pool_for runs chunks of them on the kernels' threads. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ck.h"
#include "ck_internal.h"

#define QS_CHUNK 256            /* groups per pool chunk */
#define QS_IMPROVE 1e-12        /* quant._IMPROVE */

/* numpy's pairwise sum of a contiguous double row (loops_utils.h: 8 accumulators up to
 * 128 values, halves at multiples of 8 above), added to the reduction's initial 0.0 */
static double pairwise_sum(const double *a, int64_t n) {
    if (n < 8) {
        double r = -0.0;
        for (int64_t i = 0; i < n; i++) r += a[i];
        return r;
    }
    if (n <= 128) {
        double r[8];
        int64_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

static inline double clampd(double x, double lo, double hi) {   /* np.clip: min(max(x, lo), hi) */
    x = x < lo ? lo : x;
    return x > hi ? hi : x;
}

/* clamp(rint(x), lo, hi) for integers lo <= hi of magnitude < 2^52, as numpy's
 * np.clip(np.rint(x), lo, hi): the clamp first (rint is monotonic and keeps integers, so
 * the order does not matter), then rint of a value below 2^52 by adding and subtracting
 * 2^52 (round half to even, as rint in the default rounding mode), the sign put back.
 * No libm call (the baseline x86-64 ISA has no roundsd) and no branch: vectorizes. */
static inline double rint_clamp(double x, double lo, double hi) {
    const double big = 4503599627370496.0;        /* 2^52 */
    x = clampd(x, lo, hi);
    return copysign((fabs(x) + big) - big, x);
}

/* quant._sq_err for one group, t a scratch row of k doubles */
static double sq_err(const double *b, int64_t k, double s, double z, double qmax, double *t) {
    double lo = -z, hi = qmax - z;
    for (int64_t i = 0; i < k; i++) {
        double q = rint_clamp(b[i] / s, lo, hi);
        double d = q * s - b[i];
        t[i] = d * d;
    }
    return 0.0 + pairwise_sum(t, k);
}

typedef struct {
    const double *b;
    int64_t n, k;
    double qmax;
    const double *grid;
    int ngrid, mse;
    float *scale;
    uint8_t *zero, *q;
    int64_t nonfinite;          /* groups with a NaN / Inf (set by any thread) */
} qs_ctx;

static void qs_group(qs_ctx *c, int64_t g, double *t) {
    const double *b = c->b + g * c->k;
    const int64_t k = c->k;
    const double qmax = c->qmax;
    double lo = b[0], hi = b[0];
    int finite = 1;
    for (int64_t i = 0; i < k; i++) {
        finite &= isfinite(b[i]) != 0;
        lo = b[i] < lo ? b[i] : lo;
        hi = b[i] > hi ? b[i] : hi;
    }
    if (!finite) {               /* the caller redoes the block in numpy (its NaN rules) */
        __atomic_add_fetch(&c->nonfinite, 1, __ATOMIC_RELAXED);
        return;
    }
    double sc = (hi - lo) / qmax;
    if (sc <= 0) sc = lo != 0 ? fabs(lo) : 1.0;
    double s = (double)(float)sc;
    if (s == 0 && sc > 0) s = ldexp(1.0, -149);           /* float32's smallest subnormal */
    double z = rint_clamp(-lo / s, 0, qmax);
    if (c->mse) {
        double best_e = sq_err(b, k, s, z, qmax, t);
        double lo0 = lo < 0.0 ? lo : 0.0, hi0 = hi > 0.0 ? hi : 0.0;
        double span = hi0 - lo0, mid = (lo + hi) / 2.0;
        for (int j = 0; j < c->ngrid; j++) {
            double cs = (double)(float)(span * c->grid[j] / qmax);
            int ok = cs > 0 && isfinite(cs);
            if (!ok) continue;           /* numpy scores it with scale 1 and never keeps it */
            double cz = rint_clamp(qmax / 2 - mid / cs, 0, qmax);
            double e = sq_err(b, k, cs, cz, qmax, t);
            if (e < best_e * (1.0 - QS_IMPROVE)) {
                best_e = e;
                s = cs;
                z = cz;
            }
        }
    }
    c->scale[g] = (float)s;
    c->zero[g] = (uint8_t)z;
    uint8_t *q = c->q + g * k;
    for (int64_t i = 0; i < k; i++)
        q[i] = (uint8_t)(rint_clamp(b[i] / s, -z, qmax - z) + z);
}

static void qs_chunk(void *ctx, int64_t chunk) {
    qs_ctx *c = ctx;
    double t[1024];              /* scratch row: groups of up to 1,024 values (checked) */
    int64_t g1 = (chunk + 1) * QS_CHUNK < c->n ? (chunk + 1) * QS_CHUNK : c->n;
    for (int64_t g = chunk * QS_CHUNK; g < g1; g++) qs_group(c, g, t);
}

int64_t ck_q4_group_search(const double *b, int64_t n, int64_t k, int qmax, const double *grid,
                           int ngrid, int mse, float *scale, uint8_t *zero, uint8_t *q, int nth) {
    if (k <= 0 || k > 1024 || qmax < 1 || qmax > 255 || n < 0) return -1;
    qs_ctx c = {b, n, k, (double)qmax, grid, ngrid, mse, scale, zero, q, 0};
    int64_t chunks = (n + QS_CHUNK - 1) / QS_CHUNK;
    if (chunks) ck_pool_for(qs_chunk, &c, chunks, nth);
    return c.nonfinite;
}
