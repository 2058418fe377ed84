/* ck_scalar.c -- portable C reference/fallback of every kernel tile.
 *
 * Written to mirror colibri_core/format/quant.py step by step (the int8 path computes the
 * same exact integer group dot products as matvec_q4_q8_ref); only the float
 * summation order differs. Every other backend is tested against these. */
#include <math.h>
#include "ck_internal.h"

/* Per-group symmetric int8 quantization of one activation row; must equal
 * quant.quantize_act_q8 bit for bit: float32 arithmetic, rint (half-even), clamp ±127. */
void ck_scalar_act_quant(const float *x, int64_t cols, int64_t group,
                         int8_t *xq, float *xs, int32_t *xsum) {
    int64_t cp = (cols + group - 1) / group * group;
    for (int64_t c0 = 0, g = 0; c0 < cp; c0 += group, g++) {
        int64_t c1 = c0 + group < cols ? c0 + group : cols;
        float amax = 0.0f;
        int nan = 0;
        for (int64_t c = c0; c < c1; c++) {
            float a = fabsf(ck_ldf(x + c));
            amax = fmaxf(amax, a);
            nan |= a != a;
        }
        /* a NaN makes the group scale NaN (as numpy's max does), so it reaches the output */
        float s = nan ? NAN : amax / 127.0f;
        float inv = s > 0.0f ? 1.0f / s : 0.0f;
        int32_t sum = 0;
        for (int64_t c = c0; c < c0 + group; c++) {
            float v = c < c1 ? rintf(ck_ldf(x + c) * inv) : 0.0f;
            v = v > -127.0f ? v : -127.0f;   /* NaN -> -127, like the SIMD max/min */
            v = v < 127.0f ? v : 127.0f;
            xq[c] = (int8_t)v;
            sum += (int8_t)v;
        }
        ck_stf(xs + g, s);
        ck_sti(xsum + g, sum);
    }
}

/* nibble k (0 <= k < cp) of a q4 row */
static inline int q4_at(const uint8_t *row, int64_t k) {
    uint8_t byte = row[(k >> 6) * 32 + (k & 31)];
    return (k & 32) ? byte >> 4 : byte & 15;
}

static void q4_i8(const ck_q4 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                  float *res) {
    for (int r = 0; r < rt; r++) {
        const uint8_t *row = w->data + (r0 + r) * (w->cp / 2);
        const float *sc = w->scales + (r0 + r) * w->ng;
        const uint8_t *zp = w->zeros + (r0 + r) * w->ng;
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = a->q + (t0 + t) * a->cp;
            float acc = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                int32_t dot = 0;   /* block-wise so that the compiler can vectorize it */
                for (int64_t b = g * w->group / 64; b < (g + 1) * w->group / 64; b++)
                    for (int j = 0; j < 32; j++)
                        dot += (row[b * 32 + j] & 15) * xq[b * 64 + j] +
                               (row[b * 32 + j] >> 4) * xq[b * 64 + 32 + j];
                int32_t corr = dot - (int32_t)zp[g] * ck_ldi(a->sum + (t0 + t) * a->ng + g);
                acc += (float)corr * (ck_ldf(sc + g) * ck_ldf(a->s + (t0 + t) * a->ng + g));
            }
            res[r * nt + t] = acc;
        }
    }
}

void ck_scalar_q4_f32(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res) {
    for (int r = 0; r < rt; r++) {
        const uint8_t *row = w->data + (r0 + r) * (w->cp / 2);
        const float *sc = w->scales + (r0 + r) * w->ng;
        const uint8_t *zp = w->zeros + (r0 + r) * w->ng;
        for (int t = 0; t < nt; t++) {
            const float *xr = x->x + (t0 + t) * x->ld;
            float acc = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                int64_t k1 = (g + 1) * w->group < w->cols ? (g + 1) * w->group : w->cols;
                float z = (float)zp[g], gacc = 0.0f;
                for (int64_t k = g * w->group; k < k1; k++)
                    gacc += ((float)q4_at(row, k) - z) * ck_ldf(xr + k);
                acc += gacc * ck_ldf(sc + g);
            }
            res[r * nt + t] = acc;
        }
    }
}

void ck_scalar_q8_i8(const ck_q8 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                     float *res) {
    for (int r = 0; r < rt; r++) {
        const int8_t *row = w->data + (r0 + r) * w->cp;
        const float *sc = w->scales + (r0 + r) * w->ng;
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = a->q + (t0 + t) * a->cp;
            float acc = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                int32_t dot = 0;
                for (int64_t k = g * w->group; k < (g + 1) * w->group; k++)
                    dot += (int32_t)row[k] * xq[k];
                acc += (float)dot * (ck_ldf(sc + g) * ck_ldf(a->s + (t0 + t) * a->ng + g));
            }
            res[r * nt + t] = acc;
        }
    }
}

void ck_scalar_q8_f32(const ck_q8 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res) {
    for (int r = 0; r < rt; r++) {
        const int8_t *row = w->data + (r0 + r) * w->cp;
        const float *sc = w->scales + (r0 + r) * w->ng;
        for (int t = 0; t < nt; t++) {
            const float *xr = x->x + (t0 + t) * x->ld;
            float acc = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                int64_t k1 = (g + 1) * w->group < w->cols ? (g + 1) * w->group : w->cols;
                float gacc = 0.0f;
                for (int64_t k = g * w->group; k < k1; k++)
                    gacc += (float)row[k] * ck_ldf(xr + k);
                acc += gacc * ck_ldf(sc + g);
            }
            res[r * nt + t] = acc;
        }
    }
}

/* value k (0 <= k < cp) of a q6 row: its low nibble as q4_at within the block's first
 * 32 bytes, its top two bits from byte k % 16 of the block's last 16 */
static inline int q6_at(const uint8_t *row, int64_t k) {
    const uint8_t *blk = row + (k >> 6) * CK_Q6_BLOCK;
    int j = (int)(k & 63);
    int lo = (j & 32) ? blk[j & 31] >> 4 : blk[j & 31] & 15;
    return lo | (((blk[32 + (j & 15)] >> (2 * (j >> 4))) & 3) << 4);
}

/* q6 x int8 activations: q4_i8's arithmetic (exact group dots, the zero point corrected
 * with the group sums, one float multiply-add per group in ascending order) */
static void q6_i8(const ck_q6 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                  float *res) {
    const int64_t rb = w->cp / 64 * CK_Q6_BLOCK;
    for (int r = 0; r < rt; r++) {
        const uint8_t *row = w->data + (r0 + r) * rb;
        const float *sc = w->scales + (r0 + r) * w->ng;
        const uint8_t *zp = w->zeros + (r0 + r) * w->ng;
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = a->q + (t0 + t) * a->cp;
            float acc = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                int32_t dot = 0;   /* block-wise (values j, 16+j, 32+j, 48+j share a top-bits
                                      byte) so that the compiler can vectorize it */
                for (int64_t b = g * w->group / 64; b < (g + 1) * w->group / 64; b++) {
                    const uint8_t *blk = row + b * CK_Q6_BLOCK;
                    const int8_t *xb = xq + b * 64;
                    for (int j = 0; j < 16; j++) {
                        const int h = blk[32 + j];
                        dot += ((blk[j] & 15) | (h & 3) << 4) * xb[j] +
                               ((blk[16 + j] & 15) | (h >> 2 & 3) << 4) * xb[16 + j] +
                               ((blk[j] >> 4) | (h >> 4 & 3) << 4) * xb[32 + j] +
                               ((blk[16 + j] >> 4) | (h >> 6) << 4) * xb[48 + j];
                    }
                }
                int32_t corr = dot - (int32_t)zp[g] * ck_ldi(a->sum + (t0 + t) * a->ng + g);
                acc += (float)corr * (ck_ldf(sc + g) * ck_ldf(a->s + (t0 + t) * a->ng + g));
            }
            res[r * nt + t] = acc;
        }
    }
}

void ck_scalar_q6_f32(const ck_q6 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res) {
    const int64_t rb = w->cp / 64 * CK_Q6_BLOCK;
    for (int r = 0; r < rt; r++) {
        const uint8_t *row = w->data + (r0 + r) * rb;
        const float *sc = w->scales + (r0 + r) * w->ng;
        const uint8_t *zp = w->zeros + (r0 + r) * w->ng;
        for (int t = 0; t < nt; t++) {
            const float *xr = x->x + (t0 + t) * x->ld;
            float acc = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                int64_t k1 = (g + 1) * w->group < w->cols ? (g + 1) * w->group : w->cols;
                float z = (float)zp[g], gacc = 0.0f;
                for (int64_t k = g * w->group; k < k1; k++)
                    gacc += ((float)q6_at(row, k) - z) * ck_ldf(xr + k);
                acc += gacc * ck_ldf(sc + g);
            }
            res[r * nt + t] = acc;
        }
    }
}

/* In place: each of the g rows of s [g, len] becomes its softmax (max-subtracted). */
void ck_softmax_rows(float *s, int g, int64_t len) {
    for (int h = 0; h < g; h++) {
        float *row = s + h * len, m = row[0], sum = 0.0f;
        for (int64_t p = 1; p < len; p++) m = row[p] > m ? row[p] : m;
        for (int64_t p = 0; p < len; p++) sum += row[p] = expf(row[p] - m);
        float inv = 1.0f / sum;
        for (int64_t p = 0; p < len; p++) row[p] *= inv;
    }
}

/* Keys and values are each read once for the g query heads that share them. */
void ck_scalar_attn(const float *q, int g, int64_t d, const float *k, const float *v, int64_t ld,
                    int64_t len, float scale, float *s, float *out) {
    for (int64_t p = 0; p < len; p++)
        for (int h = 0; h < g; h++) {
            float dot = 0.0f;
            for (int64_t i = 0; i < d; i++) dot += ck_ldf(q + h * d + i) * ck_ldf(k + p * ld + i);
            s[h * len + p] = dot * scale;
        }
    ck_softmax_rows(s, g, len);
    for (int64_t i = 0; i < g * d; i++) ck_stf(out + i, 0.0f);
    for (int64_t p = 0; p < len; p++)
        for (int h = 0; h < g; h++) {
            float wgt = s[h * len + p];
            for (int64_t i = 0; i < d; i++)
                ck_stf(out + h * d + i, ck_ldf(out + h * d + i) + wgt * ck_ldf(v + p * ld + i));
        }
}

const ck_backend_t ck_backend_scalar = {
    "scalar", ck_scalar_act_quant, q4_i8, ck_scalar_q4_f32, ck_scalar_q8_i8,
    ck_scalar_q8_f32, q6_i8, ck_scalar_q6_f32, ck_scalar_attn, 1, 1, .mx_i8 = ck_scalar_mx_i8,
};
