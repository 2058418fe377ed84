/* ck_neon.c -- aarch64 Advanced SIMD (NEON) backend: every slot of the backend table.
 *
 * Baseline ARMv8.0 NEON everywhere; the int8 dots also come in an sdot version (FEAT_DotProd,
 * e.g. Cortex-A55/A76 and later), compiled under a target attribute and chosen at run time
 * when the kernel reports HWCAP_ASIMDDP (ck_core.c asks ck_neon_has_dotprod()). So the
 * build never uses -march flags and the extension runs on any aarch64 CPU, down to the
 * Cortex-A53 of small boards.
 *
 * What is exact and what is not (tests/c/ck_neon_driver.c checks both against ck_scalar.c
 * under qemu-aarch64 with a Cortex-A53 and with a dotprod CPU; docs/ARCHITECTURE.md has
 * the table):
 * - act_quant, q4_i8, q6_i8, q8_i8 (so int8 matmuls, expert FFNs and the decode path): bit for
 *   bit the scalar results. The integer dots are exact; the float steps are the scalar
 *   code's, in its order, one (row, token) pair per lane (ck_neon_int8.h).
 * - q4_f32, q8_f32 (the float parity path): the sums over a group are split over vector
 *   lanes and use fused multiply-adds, so they round differently from the scalar
 *   sequence (as AVX2's do); q6_f32 is the scalar code itself.
 * - attention: the q.k dots are split over lanes and exp is a polynomial (~2 ulp).
 * All loads are unaligned (weight parts may sit at any byte offset). */
#if defined(__aarch64__)
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#include "ck_internal.h"

/* The dotprod functions' target. GCC 12's arm_neon.h declares vdotq_s32 under
 * "arch=armv8.2-a+dotprod" and refuses to inline it into a "+dotprod" function; every CPU
 * with dotprod implements ARMv8.2 or later, so the two are the same here. */
#if defined(__clang__)
#define CK_DOTPROD_ATTR __attribute__((target("dotprod")))
#else
#define CK_DOTPROD_ATTR __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

/* ------------------------------------------------------------------ run-time check */

int ck_neon_has_dotprod(void) {
#if defined(__linux__) && defined(AT_HWCAP)
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)   /* asm/hwcap.h */
#endif
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------ activations */

/* Per-group int8 quantization of one row, bit for bit ck_scalar_act_quant: the group's
 * max |x| (order-free), s = amax / 127 and 1 / s as scalars, then per value
 * rint(x * inv) (FRINTN: to nearest, ties to even, as rintf in the default rounding mode),
 * clamped with FMAXNM / FMINNM, which turn NaN into -127 as the scalar comparisons do.
 * A partial last group (and a group size that is not a multiple of 16, which the
 * weight formats never have) goes to the scalar code. */
static void act_quant(const float *x, int64_t cols, int64_t group, int8_t *xq, float *xs,
                      int32_t *xsum) {
    const float32x4_t lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(127.0f);
    for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, g++) {
        if (cols - c0 < group || group % 16) {
            ck_scalar_act_quant(x + c0, cols - c0, group, xq + c0, xs + g, xsum + g);
            break;
        }
        float32x4_t m = vdupq_n_f32(0.0f);
        uint32x4_t num = vdupq_n_u32(~0u);          /* all lanes: no NaN seen */
        for (int64_t c = c0; c < c0 + group; c += 4) {
            const float32x4_t v = vld1q_f32(x + c);
            m = vmaxq_f32(m, vabsq_f32(v));
            num = vandq_u32(num, vceqq_f32(v, v));
        }
        const float s = vminvq_u32(num) ? vmaxvq_f32(m) / 127.0f : NAN;
        const float32x4_t inv = vdupq_n_f32(s > 0.0f ? 1.0f / s : 0.0f);
        int32x4_t vsum = vdupq_n_s32(0);
        for (int64_t c = c0; c < c0 + group; c += 16) {
            int32x4_t q[4];
            for (int k = 0; k < 4; k++) {
                float32x4_t v = vrndnq_f32(vmulq_f32(vld1q_f32(x + c + 4 * k), inv));
                q[k] = vcvtq_s32_f32(vminnmq_f32(vmaxnmq_f32(v, lo), hi));   /* exact */
                vsum = vaddq_s32(vsum, q[k]);
            }
            const int16x8_t q01 = vcombine_s16(vmovn_s32(q[0]), vmovn_s32(q[1]));
            const int16x8_t q23 = vcombine_s16(vmovn_s32(q[2]), vmovn_s32(q[3]));
            vst1q_s8(xq + c, vcombine_s8(vmovn_s16(q01), vmovn_s16(q23)));
        }
        ck_stf(xs + g, s);
        ck_sti(xsum + g, vaddvq_s32(vsum));
    }
}

/* ------------------------------------------------------------------ int8 tiles */

/* Plain NEON: widening multiplies into i16 lanes, then pairwise-widening adds into i32.
 * q4 block: eight products per i16 lane, |.| <= 8 * 15 * 127 = 15240 < 2^15. */
static inline __attribute__((always_inline)) int32x4_t
q4_block_mull(int32x4_t acc, const int8x16_t w[4], const int8x16_t x[4]) {
    int16x8_t p = vmull_s8(vget_low_s8(w[0]), vget_low_s8(x[0]));
    p = vmlal_high_s8(p, w[0], x[0]);
    for (int j = 1; j < 4; j++) {
        p = vmlal_s8(p, vget_low_s8(w[j]), vget_low_s8(x[j]));
        p = vmlal_high_s8(p, w[j], x[j]);
    }
    return vpadalq_s16(acc, p);
}

/* q6 block: values 0..63, so at most four products per i16 lane, |.| <= 4 * 63 * 127 =
 * 32004 < 2^15: two i16 accumulators of two vectors each */
static inline __attribute__((always_inline)) int32x4_t
q6_block_mull(int32x4_t acc, const int8x16_t w[4], const int8x16_t x[4]) {
    for (int j = 0; j < 4; j += 2) {
        int16x8_t p = vmull_s8(vget_low_s8(w[j]), vget_low_s8(x[j]));
        p = vmlal_high_s8(p, w[j], x[j]);
        p = vmlal_s8(p, vget_low_s8(w[j + 1]), vget_low_s8(x[j + 1]));
        p = vmlal_high_s8(p, w[j + 1], x[j + 1]);
        acc = vpadalq_s16(acc, p);
    }
    return acc;
}

/* q8: two products per i16 lane, |.| <= 2 * 128 * 127 < 2^15 (activations are >= -127) */
static inline __attribute__((always_inline)) int32x4_t
dot16_mull(int32x4_t acc, int8x16_t a, int8x16_t b) {
    return vpadalq_s16(acc, vmlal_high_s8(vmull_s8(vget_low_s8(a), vget_low_s8(b)), a, b));
}

#define NEON_ATTR
#define NEON_NAME(n) n##_plain
#define NEON_Q4_BLOCK(acc, w, x) q4_block_mull(acc, w, x)
#define NEON_Q6_BLOCK(acc, w, x) q6_block_mull(acc, w, x)
#define NEON_DOT16(acc, a, b) dot16_mull(acc, a, b)
#include "ck_neon_int8.h"
#undef NEON_ATTR
#undef NEON_NAME
#undef NEON_Q4_BLOCK
#undef NEON_Q6_BLOCK
#undef NEON_DOT16

/* sdot: four byte products summed straight into each i32 lane (exact) */
static inline __attribute__((always_inline)) CK_DOTPROD_ATTR int32x4_t
q4_block_sdot(int32x4_t acc, const int8x16_t w[4], const int8x16_t x[4]) {
    for (int j = 0; j < 4; j++) acc = vdotq_s32(acc, w[j], x[j]);
    return acc;
}

#define NEON_ATTR CK_DOTPROD_ATTR
#define NEON_NAME(n) n##_sdot
#define NEON_Q4_BLOCK(acc, w, x) q4_block_sdot(acc, w, x)
#define NEON_Q6_BLOCK(acc, w, x) q4_block_sdot(acc, w, x)   /* any int8 values */
#define NEON_DOT16(acc, a, b) vdotq_s32(acc, a, b)
#include "ck_neon_int8.h"
#undef NEON_ATTR
#undef NEON_NAME
#undef NEON_Q4_BLOCK
#undef NEON_Q6_BLOCK
#undef NEON_DOT16

/* ------------------------------------------------------------------ float tiles */

/* 16 nibbles (bytes 0..15) -> 4 x 4 floats (q - z) */
static inline void nibbles_to_f32(uint8x16_t n, float32x4_t z, float32x4_t out[4]) {
    const uint16x8_t l = vmovl_u8(vget_low_u8(n)), h = vmovl_high_u8(n);
    out[0] = vsubq_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(l))), z);
    out[1] = vsubq_f32(vcvtq_f32_u32(vmovl_high_u16(l)), z);
    out[2] = vsubq_f32(vcvtq_f32_u32(vmovl_u16(vget_low_u16(h))), z);
    out[3] = vsubq_f32(vcvtq_f32_u32(vmovl_high_u16(h)), z);
}

/* q4 x float activations, one row x NT tokens, as AVX2's q4_f32_tile: per group, the
 * products (q - z) * x go into two 4-lane fused accumulators per token; the group's sum
 * times its scale is added to the token's total. Blocks wholly past `cols` are skipped
 * (their weights are the zero point, i.e. exactly 0); a partial last block reads x from
 * the zero-padded tail copy. */
static inline __attribute__((always_inline)) void
q4_f32_tile(const ck_q4 *w, int64_t r, const ck_xf *x, int64_t t0, float *res, const int NT) {
    const int64_t bpg = w->group / 64, nblk = (x->cols + 63) / 64;
    const int64_t nfull = x->tail ? x->cols / 64 : nblk;
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const uint8_t *row = w->data + r * (w->cp / 2);
    float32x4_t facc[CK_MAX_NT];
    for (int t = 0; t < NT; t++) facc[t] = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < w->ng; g++) {
        const float32x4_t z = vdupq_n_f32((float)w->zeros[r * w->ng + g]);
        float32x4_t gacc[CK_MAX_NT][2];
        for (int t = 0; t < NT; t++) gacc[t][0] = gacc[t][1] = vdupq_n_f32(0.0f);
        const int64_t b1 = (g + 1) * bpg < nblk ? (g + 1) * bpg : nblk;
        for (int64_t b = g * bpg; b < b1; b++) {
            const uint8x16_t v0 = vld1q_u8(row + b * 32), v1 = vld1q_u8(row + b * 32 + 16);
            const uint8x16_t part[4] = {vandq_u8(v0, m4), vandq_u8(v1, m4), vshrq_n_u8(v0, 4),
                                        vshrq_n_u8(v1, 4)};   /* values 0, 16, 32, 48.. */
            for (int j = 0; j < 4; j++) {
                float32x4_t wf[4];
                nibbles_to_f32(part[j], z, wf);
                for (int t = 0; t < NT; t++) {
                    const float *xp = (b < nfull ? x->x + (t0 + t) * x->ld + b * 64
                                                 : x->tail + (t0 + t) * 64) + 16 * j;
                    for (int i = 0; i < 4; i++)
                        gacc[t][i & 1] = vfmaq_f32(gacc[t][i & 1], wf[i], vld1q_f32(xp + 4 * i));
                }
            }
        }
        const float sc = ck_ldf(w->scales + r * w->ng + g);
        for (int t = 0; t < NT; t++)
            facc[t] = vfmaq_n_f32(facc[t], vaddq_f32(gacc[t][0], gacc[t][1]), sc);
    }
    for (int t = 0; t < NT; t++) res[t] = vaddvq_f32(facc[t]);
}

static void q4_f32(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                   float *res) {
    for (int r = 0; r < rt; r++) {
        switch (nt) {
        case 4: q4_f32_tile(w, r0 + r, x, t0, res + r * nt, 4); break;
        case 3: q4_f32_tile(w, r0 + r, x, t0, res + r * nt, 3); break;
        case 2: q4_f32_tile(w, r0 + r, x, t0, res + r * nt, 2); break;
        default: q4_f32_tile(w, r0 + r, x, t0, res + r * nt, 1); break;
        }
    }
}

/* q8 x float activations, as AVX2's: per group 8 weights (int8 -> float) times 8
 * activations per step into fused accumulators, a scalar tail up to `cols` (x is read
 * up to `cols` only), the group's sum times its scale added to the total. */
static void q8_f32(const ck_q8 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                   float *res) {
    for (int r = 0; r < rt; r++) {
        const int8_t *row = w->data + (r0 + r) * w->cp;
        for (int t = 0; t < nt; t++) {
            const float *xr = x->x + (t0 + t) * x->ld;
            float32x4_t facc = vdupq_n_f32(0.0f);
            float tail = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                int64_t k = g * w->group, k1 = k + w->group < x->cols ? k + w->group : x->cols;
                float32x4_t g0 = vdupq_n_f32(0.0f), g1 = vdupq_n_f32(0.0f);
                float gtail = 0.0f;
                for (; k + 8 <= k1; k += 8) {
                    const int16x8_t w16 = vmovl_s8(vld1_s8(row + k));
                    g0 = vfmaq_f32(g0, vcvtq_f32_s32(vmovl_s16(vget_low_s16(w16))), vld1q_f32(xr + k));
                    g1 = vfmaq_f32(g1, vcvtq_f32_s32(vmovl_high_s16(w16)), vld1q_f32(xr + k + 4));
                }
                for (; k < k1; k++) gtail += (float)row[k] * ck_ldf(xr + k);
                const float sc = ck_ldf(w->scales + (r0 + r) * w->ng + g);
                facc = vfmaq_n_f32(facc, vaddq_f32(g0, g1), sc);
                tail += gtail * sc;
            }
            res[r * nt + t] = vaddvq_f32(facc) + tail;
        }
    }
}

/* ------------------------------------------------------------------ attention */

/* exp(x) per lane: Cephes-style range reduction (x = n ln2 + r, ln2 in two parts) and a
 * degree-5 polynomial for e^r, times 2^n built in the exponent bits: within ~2 ulp of
 * expf for results above FLT_MIN (the test bound is 1e-6 relative); x <= -87.3 gives 0
 * or a tiny value, not a denormal exp. FMAX / FMIN propagate NaN, so NaN stays NaN. */
static inline float32x4_t exp_ps(float32x4_t x) {
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-88.3762626647949f)), vdupq_n_f32(88.3762626647949f));
    const float32x4_t n = vrndmq_f32(vfmaq_f32(vdupq_n_f32(0.5f), x, vdupq_n_f32(1.44269504088896341f)));
    x = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    x = vfmsq_f32(x, n, vdupq_n_f32(-2.12194440e-4f));
    float32x4_t y = vdupq_n_f32(1.9875691500e-4f);
    y = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), y, x);
    y = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), y, x);
    y = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), y, x);
    y = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), y, x);
    y = vfmaq_f32(vaddq_f32(x, vdupq_n_f32(1.0f)), y, vmulq_f32(x, x));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(y, vreinterpretq_f32_s32(e));
}

void ck_neon_exp(const float *x, int64_t n, float *out) {   /* tests */
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(out + i, exp_ps(vld1q_f32(x + i)));
    for (; i < n; i++) {
        float v[4] = {x[i], 0, 0, 0};
        vst1q_f32(v, exp_ps(vld1q_f32(v)));
        out[i] = v[0];
    }
}

/* In place: each of the g rows of s [g, len] becomes its softmax (max-subtracted, as
 * ck_softmax_rows): the max is exact, the exps and their sum are vector-wide. */
void ck_neon_softmax_rows(float *s, int g, int64_t len) {
    for (int h = 0; h < g; h++) {
        float *row = s + h * len, m = row[0];
        int64_t p = 0;
        if (len >= 4) {
            float32x4_t mv = vld1q_f32(row);
            for (p = 4; p + 4 <= len; p += 4) mv = vmaxq_f32(mv, vld1q_f32(row + p));
            m = vmaxvq_f32(mv);
        }
        for (; p < len; p++) m = row[p] > m ? row[p] : m;
        const float32x4_t mm = vdupq_n_f32(m);
        float32x4_t sv = vdupq_n_f32(0.0f);
        for (p = 0; p + 4 <= len; p += 4) {
            const float32x4_t e = exp_ps(vsubq_f32(vld1q_f32(row + p), mm));
            vst1q_f32(row + p, e);
            sv = vaddq_f32(sv, e);
        }
        float sum = vaddvq_f32(sv);
        for (; p < len; p++) sum += row[p] = expf(row[p] - m);
        const float inv = 1.0f / sum;
        for (p = 0; p + 4 <= len; p += 4) vst1q_f32(row + p, vmulq_n_f32(vld1q_f32(row + p), inv));
        for (; p < len; p++) row[p] *= inv;
    }
}

/* out[h0 + u] (u < HN) = sum_p s[h0 + u, p] * v_p: 8 columns of HN heads stay in
 * registers while the positions go by, so each value row is loaded once for them. */
static inline __attribute__((always_inline)) void
attn_values(const float *s, int h0, int64_t d, const float *v, int64_t ld, int64_t len,
            float *out, const int HN) {
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
        float32x4_t acc[4][2];
        for (int u = 0; u < HN; u++) acc[u][0] = acc[u][1] = vdupq_n_f32(0.0f);
        for (int64_t p = 0; p < len; p++) {
            const float32x4_t v0 = vld1q_f32(v + p * ld + c), v1 = vld1q_f32(v + p * ld + c + 4);
            for (int u = 0; u < HN; u++) {
                const float wgt = s[(h0 + u) * len + p];
                acc[u][0] = vfmaq_n_f32(acc[u][0], v0, wgt);
                acc[u][1] = vfmaq_n_f32(acc[u][1], v1, wgt);
            }
        }
        for (int u = 0; u < HN; u++) {
            vst1q_f32(out + (h0 + u) * d + c, acc[u][0]);
            vst1q_f32(out + (h0 + u) * d + c + 4, acc[u][1]);
        }
    }
    for (; c < d; c++)                        /* d % 8 columns */
        for (int u = 0; u < HN; u++) {
            float a = 0.0f;
            for (int64_t p = 0; p < len; p++) a += s[(h0 + u) * len + p] * ck_ldf(v + p * ld + c);
            ck_stf(out + (h0 + u) * d + c, a);
        }
}

/* Attention of g query heads over one kv head (the slot's contract: ck_internal.h):
 * scores q_h . k_p * scale (4-lane fused dot, scalar tail), softmax, then the values. */
static void attn(const float *q, int g, int64_t d, const float *k, const float *v, int64_t ld,
                 int64_t len, float scale, float *s, float *out) {
    const int64_t d4 = d / 4 * 4;
    for (int64_t p = 0; p < len; p++) {
        const float *kr = k + p * ld;
        /* cache rows of one kv head are ld floats apart: fetch the row 8 positions ahead */
        if (p + 8 < len)
            for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(kr + 8 * ld + i);
        for (int h = 0; h < g; h++) {
            const float *qh = q + h * d;
            float32x4_t acc = vdupq_n_f32(0.0f);
            for (int64_t i = 0; i < d4; i += 4)
                acc = vfmaq_f32(acc, vld1q_f32(qh + i), vld1q_f32(kr + i));
            float dot = vaddvq_f32(acc);
            for (int64_t i = d4; i < d; i++) dot += ck_ldf(qh + i) * ck_ldf(kr + i);
            s[h * len + p] = dot * scale;
        }
    }
    ck_neon_softmax_rows(s, g, len);
    for (int h0 = 0; h0 < g; h0 += 4) {
        switch (g - h0 < 4 ? g - h0 : 4) {
        case 4: attn_values(s, h0, d, v, ld, len, out, 4); break;
        case 3: attn_values(s, h0, d, v, ld, len, out, 3); break;
        case 2: attn_values(s, h0, d, v, ld, len, out, 2); break;
        default: attn_values(s, h0, d, v, ld, len, out, 1); break;
        }
    }
}

/* ------------------------------------------------------------------ the tables */

/* rt 4: the decode tiles are 4 rows x 1 token; nt_many 4: batches 1 row x 4 tokens */
const ck_backend_t ck_backend_neon = {
    "neon", act_quant, q4_i8_plain, q4_f32, q8_i8_plain, q8_f32, q6_i8_plain, ck_scalar_q6_f32,
    attn, 4, 4, .mx_i8 = mx_i8_plain,
};

const ck_backend_t ck_backend_neon_sdot = {
    "neon", act_quant, q4_i8_sdot, q4_f32, q8_i8_sdot, q8_f32, q6_i8_sdot, ck_scalar_q6_f32,
    attn, 4, 4, .mx_i8 = mx_i8_sdot,
};

#else
typedef int ck_neon_unused; /* not aarch64: nothing to compile here */
#endif
