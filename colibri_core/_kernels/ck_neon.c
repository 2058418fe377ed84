/* ck_neon.c -- aarch64 NEON backend (baseline ARMv8.0, no dotprod extension).
 *
 * Deliberately simple: only the q4 int8-activation tile (the decode hot path) is
 * vectorized; everything else reuses the scalar code. Compile-checked with a cross
 * compiler, not run in CI (no ARM machine). */
#if defined(__aarch64__)
#include <arm_neon.h>
#include "ck_internal.h"

/* Per block: nibbles (0..15, fit s8) times s8 activations with vmull/vmlal into i16
 * (8 products per lane <= 8*15*127 = 15240 < 2^15), then pairwise-widened to i32. */
static void q4_i8(const ck_q4 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                  float *res) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const int64_t bpg = w->group / 64;
    for (int r = 0; r < rt; r++) {
        const uint8_t *row = w->data + (r0 + r) * (w->cp / 2);
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = a->q + (t0 + t) * a->cp;
            float acc = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                int32x4_t iacc = vdupq_n_s32(0);
                for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
                    uint8x16_t v0 = vld1q_u8(row + b * 32), v1 = vld1q_u8(row + b * 32 + 16);
                    int8x16_t l0 = vreinterpretq_s8_u8(vandq_u8(v0, m4));
                    int8x16_t l1 = vreinterpretq_s8_u8(vandq_u8(v1, m4));
                    int8x16_t h0 = vreinterpretq_s8_u8(vshrq_n_u8(v0, 4));
                    int8x16_t h1 = vreinterpretq_s8_u8(vshrq_n_u8(v1, 4));
                    const int8_t *xp = xq + b * 64;
                    int8x16_t x0 = vld1q_s8(xp), x1 = vld1q_s8(xp + 16);
                    int8x16_t x2 = vld1q_s8(xp + 32), x3 = vld1q_s8(xp + 48);
                    int16x8_t p = vmull_s8(vget_low_s8(l0), vget_low_s8(x0));
                    p = vmlal_s8(p, vget_high_s8(l0), vget_high_s8(x0));
                    p = vmlal_s8(p, vget_low_s8(l1), vget_low_s8(x1));
                    p = vmlal_s8(p, vget_high_s8(l1), vget_high_s8(x1));
                    p = vmlal_s8(p, vget_low_s8(h0), vget_low_s8(x2));
                    p = vmlal_s8(p, vget_high_s8(h0), vget_high_s8(x2));
                    p = vmlal_s8(p, vget_low_s8(h1), vget_low_s8(x3));
                    p = vmlal_s8(p, vget_high_s8(h1), vget_high_s8(x3));
                    iacc = vpadalq_s16(iacc, p);
                }
                int32_t corr = vaddvq_s32(iacc) -
                               (int32_t)w->zeros[(r0 + r) * w->ng + g] *
                                   ck_ldi(a->sum + (t0 + t) * a->ng + g);
                acc += (float)corr * (ck_ldf(w->scales + (r0 + r) * w->ng + g) *
                                      ck_ldf(a->s + (t0 + t) * a->ng + g));
            }
            res[r * nt + t] = acc;
        }
    }
}

const ck_backend_t ck_backend_neon = {
    "neon", ck_scalar_act_quant, q4_i8, ck_scalar_q4_f32, ck_scalar_q8_i8, ck_scalar_q8_f32,
    ck_scalar_attn, 1, 1,
};

#else
typedef int ck_neon_unused; /* not aarch64: nothing to compile here */
#endif
