/* ck_neon_int8.h -- the NEON int8 tiles (q4, q6, q8, mxfp4 weights x int8 activations) and their
 * dot pass. ck_neon.c includes this file twice, once per way of forming the integer dots,
 * after defining:
 *   NEON_ATTR                      attributes of every function below (a target, or none)
 *   NEON_NAME(n)                   n with the variant's suffix
 *   NEON_Q4_BLOCK(acc, w, x)       acc (int32x4) + the 64 products w[j][i] * x[j][i] of one
 *                                  q4 block (w: 4 x 16 nibbles 0..15, x: 4 x 16 int8)
 *   NEON_Q6_BLOCK(acc, w, x)       the same for a q6 block (w: 4 x 16 values 0..63)
 *   NEON_DOT16(acc, a, b)          acc + the 16 products a[i] * b[i] (int8 x int8)
 * Both spread the products over the 4 lanes in any way: only the lanes' total is used.
 *
 * Exactness: the group dots are exact integers whichever instructions form them, and the
 * dot pass reproduces ck_scalar.c's float epilogue lane by lane -- lane k is the (row,
 * token) pair k, groups are added one by one in ascending order, each as
 * (float)(dot - zero * xsum) * (scale_w * scale_x) with a separate multiply and add (the
 * build has -ffp-contract=off on aarch64) -- so every result equals the scalar tile's bit
 * for bit, whatever the tile shape. */

/* Tiles of RT rows x NT tokens with RT * NT <= 4 (RT, NT constants after inlining: the
 * accumulators stay in registers); res[r * ldr + t]. */

/* Lane k of acc += (float)(dot_k - z_k * xsum_k) * (sw_k * xs_k) for group g of pair k
 * (row r0 + k / NT, token t0 + k % NT); xsum, z are NULL for q8 (no zero point). */
static inline __attribute__((always_inline)) NEON_ATTR float32x4_t
NEON_NAME(dot_pass)(float32x4_t acc, int32x4_t dot, const float *wscales,
                    const uint8_t *wzeros, int64_t wng, int64_t r0, const ck_act *a,
                    int64_t t0, int64_t g, const int RT, const int NT) {
    int32_t z[4] = {0}, xsum[4] = {0};
    float sw[4] = {0}, xs[4] = {0};
    for (int k = 0; k < RT * NT; k++) {
        const int64_t wo = (r0 + k / NT) * wng + g, ao = (t0 + k % NT) * a->ng + g;
        sw[k] = ck_ldf(wscales + wo);
        xs[k] = ck_ldf(a->s + ao);
        if (wzeros) {
            z[k] = wzeros[wo];
            xsum[k] = ck_ldi(a->sum + ao);
        }
    }
    const int32x4_t corr = vmlsq_s32(dot, vld1q_s32(z), vld1q_s32(xsum));   /* exact */
    const float32x4_t c = vmulq_f32(vld1q_f32(sw), vld1q_f32(xs));
    return vaddq_f32(acc, vmulq_f32(vcvtq_f32_s32(corr), c));
}

/* the four pairs' lane totals as one vector: lane k = sum of i[k]'s lanes (exact) */
static inline __attribute__((always_inline)) NEON_ATTR int32x4_t
NEON_NAME(totals)(const int32x4_t i[4]) {
    return vpaddq_s32(vpaddq_s32(i[0], i[1]), vpaddq_s32(i[2], i[3]));
}

static inline __attribute__((always_inline)) NEON_ATTR void
NEON_NAME(store_pairs)(float32x4_t acc, float *res, int ldr, const int RT, const int NT) {
    float out[4];
    vst1q_f32(out, acc);
    for (int k = 0; k < RT * NT; k++) res[(k / NT) * ldr + k % NT] = out[k];
}

/* q4: per 64-value block, RT rows of 32 packed bytes are split into low nibbles (values
 * 0..31) and high nibbles (32..63), and dotted with each token's 64 activations. The
 * decode shape (4 rows x 1 token) shares each activation load between the rows, the
 * batch shape (1 row x up to 4 tokens) each unpacked weight vector between the tokens. */
static inline __attribute__((always_inline)) NEON_ATTR void
NEON_NAME(q4_i8_tile)(const ck_q4 *w, int64_t r0, const ck_act *a, int64_t t0, float *res,
                      int ldr, const int RT, const int NT) {
    const int64_t rb = w->cp / 2, bpg = w->group / 64;
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const uint8_t *wr = w->data + r0 * rb;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < w->ng; g++) {
        int32x4_t iacc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
            int8x16_t wv[CK_MAX_RT][4];
            for (int r = 0; r < RT; r++) {
                const uint8x16_t v0 = vld1q_u8(wr + r * rb + b * 32);
                const uint8x16_t v1 = vld1q_u8(wr + r * rb + b * 32 + 16);
                wv[r][0] = vreinterpretq_s8_u8(vandq_u8(v0, m4));
                wv[r][1] = vreinterpretq_s8_u8(vandq_u8(v1, m4));
                wv[r][2] = vreinterpretq_s8_u8(vshrq_n_u8(v0, 4));
                wv[r][3] = vreinterpretq_s8_u8(vshrq_n_u8(v1, 4));
            }
            for (int t = 0; t < NT; t++) {
                const int8_t *xp = a->q + (t0 + t) * a->cp + b * 64;
                const int8x16_t x[4] = {vld1q_s8(xp), vld1q_s8(xp + 16), vld1q_s8(xp + 32),
                                        vld1q_s8(xp + 48)};
                for (int r = 0; r < RT; r++)
                    iacc[r * NT + t] = NEON_Q4_BLOCK(iacc[r * NT + t], wv[r], x);
            }
        }
        acc = NEON_NAME(dot_pass)(acc, NEON_NAME(totals)(iacc), w->scales, w->zeros, w->ng,
                                  r0, a, t0, g, RT, NT);
    }
    NEON_NAME(store_pairs)(acc, res, ldr, RT, NT);
}

/* q6: per 64-value block, RT rows of 48 bytes: 32 bytes of low nibbles (q4's order: v0
 * holds values 0..15 and 32..47, v1 values 16..31 and 48..63) and 16 bytes h whose byte i
 * holds the top two bits of values i, 16+i, 32+i, 48+i (bits 0-1, 2-3, 4-5, 6-7), each
 * shifted into bits 4-5 and OR'd onto its nibble; then q4's dots and dot pass. */
static inline __attribute__((always_inline)) NEON_ATTR void
NEON_NAME(q6_i8_tile)(const ck_q6 *w, int64_t r0, const ck_act *a, int64_t t0, float *res,
                      int ldr, const int RT, const int NT) {
    const int64_t rb = w->cp / 64 * CK_Q6_BLOCK, bpg = w->group / 64;
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m2 = vdupq_n_u8(0x30);
    const uint8_t *wr = w->data + r0 * rb;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < w->ng; g++) {
        int32x4_t iacc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
            int8x16_t wv[CK_MAX_RT][4];
            for (int r = 0; r < RT; r++) {
                const uint8_t *p = wr + r * rb + b * CK_Q6_BLOCK;
                const uint8x16_t v0 = vld1q_u8(p), v1 = vld1q_u8(p + 16), h = vld1q_u8(p + 32);
                wv[r][0] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(v0, m4),
                                                        vandq_u8(vshlq_n_u8(h, 4), m2)));
                wv[r][1] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(v1, m4),
                                                        vandq_u8(vshlq_n_u8(h, 2), m2)));
                wv[r][2] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(v0, 4), vandq_u8(h, m2)));
                wv[r][3] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(v1, 4),
                                                        vandq_u8(vshrq_n_u8(h, 2), m2)));
            }
            for (int t = 0; t < NT; t++) {
                const int8_t *xp = a->q + (t0 + t) * a->cp + b * 64;
                const int8x16_t x[4] = {vld1q_s8(xp), vld1q_s8(xp + 16), vld1q_s8(xp + 32),
                                        vld1q_s8(xp + 48)};
                for (int r = 0; r < RT; r++)
                    iacc[r * NT + t] = NEON_Q6_BLOCK(iacc[r * NT + t], wv[r], x);
            }
        }
        acc = NEON_NAME(dot_pass)(acc, NEON_NAME(totals)(iacc), w->scales, w->zeros, w->ng,
                                  r0, a, t0, g, RT, NT);
    }
    NEON_NAME(store_pairs)(acc, res, ldr, RT, NT);
}

/* q8: 16 weights x 16 activations per step, the rows sharing each activation load */
static inline __attribute__((always_inline)) NEON_ATTR void
NEON_NAME(q8_i8_tile)(const ck_q8 *w, int64_t r0, const ck_act *a, int64_t t0, float *res,
                      int ldr, const int RT, const int NT) {
    const int64_t cp = w->cp, G = w->group;
    const int8_t *wr = w->data + r0 * cp;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < w->ng; g++) {
        int32x4_t iacc[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int64_t k = g * G; k < (g + 1) * G; k += 16)
            for (int t = 0; t < NT; t++) {
                const int8x16_t x = vld1q_s8(a->q + (t0 + t) * a->cp + k);
                for (int r = 0; r < RT; r++)
                    iacc[r * NT + t] = NEON_DOT16(iacc[r * NT + t], vld1q_s8(wr + r * cp + k), x);
            }
        acc = NEON_NAME(dot_pass)(acc, NEON_NAME(totals)(iacc), w->scales, NULL, w->ng, r0,
                                  a, t0, g, RT, NT);
    }
    NEON_NAME(store_pairs)(acc, res, ldr, RT, NT);
}

/* The slots: one token runs rt rows at a time (rt <= 4), several tokens one row at a
 * time with up to 4 tokens (ck_core.c never asks for more: nt_many = 4). */
NEON_ATTR static void NEON_NAME(q4_i8)(const ck_q4 *w, int64_t r0, int rt, const ck_act *a,
                                       int64_t t0, int nt, float *res) {
    if (nt == 1) {
        switch (rt) {
        case 4: NEON_NAME(q4_i8_tile)(w, r0, a, t0, res, 1, 4, 1); break;
        case 3: NEON_NAME(q4_i8_tile)(w, r0, a, t0, res, 1, 3, 1); break;
        case 2: NEON_NAME(q4_i8_tile)(w, r0, a, t0, res, 1, 2, 1); break;
        default: NEON_NAME(q4_i8_tile)(w, r0, a, t0, res, 1, 1, 1); break;
        }
        return;
    }
    for (int r = 0; r < rt; r++) {
        switch (nt) {
        case 4: NEON_NAME(q4_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 4); break;
        case 3: NEON_NAME(q4_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 3); break;
        default: NEON_NAME(q4_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 2); break;
        }
    }
}

NEON_ATTR static void NEON_NAME(q8_i8)(const ck_q8 *w, int64_t r0, int rt, const ck_act *a,
                                       int64_t t0, int nt, float *res) {
    if (nt == 1) {
        switch (rt) {
        case 4: NEON_NAME(q8_i8_tile)(w, r0, a, t0, res, 1, 4, 1); break;
        case 3: NEON_NAME(q8_i8_tile)(w, r0, a, t0, res, 1, 3, 1); break;
        case 2: NEON_NAME(q8_i8_tile)(w, r0, a, t0, res, 1, 2, 1); break;
        default: NEON_NAME(q8_i8_tile)(w, r0, a, t0, res, 1, 1, 1); break;
        }
        return;
    }
    for (int r = 0; r < rt; r++) {
        switch (nt) {
        case 4: NEON_NAME(q8_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 4); break;
        case 3: NEON_NAME(q8_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 3); break;
        default: NEON_NAME(q8_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 2); break;
        }
    }
}

NEON_ATTR static void NEON_NAME(q6_i8)(const ck_q6 *w, int64_t r0, int rt, const ck_act *a,
                                       int64_t t0, int nt, float *res) {
    if (nt == 1) {
        switch (rt) {
        case 4: NEON_NAME(q6_i8_tile)(w, r0, a, t0, res, 1, 4, 1); break;
        case 3: NEON_NAME(q6_i8_tile)(w, r0, a, t0, res, 1, 3, 1); break;
        case 2: NEON_NAME(q6_i8_tile)(w, r0, a, t0, res, 1, 2, 1); break;
        default: NEON_NAME(q6_i8_tile)(w, r0, a, t0, res, 1, 1, 1); break;
        }
        return;
    }
    for (int r = 0; r < rt; r++) {
        switch (nt) {
        case 4: NEON_NAME(q6_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 4); break;
        case 3: NEON_NAME(q6_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 3); break;
        default: NEON_NAME(q6_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 2); break;
        }
    }
}

/* mxfp4 (ck_internal.h's ck_mx): per 32-value block, each row's 16 bytes split into
 * nibbles and looked up as int8 where they lie (tbl over CK_E2M1_X2), dotted with the
 * token's 16 even and 16 odd activations (NEON_DOT16 twice; ck_mx_act_order put them in
 * the nibbles' order when they were quantized); the pairs' block dots
 * (lane k = pair k) are then added as ck_scalar.c's mx_i8 adds them, acc + (float)dot *
 * (2^(e-128) * xs), one block after the other: bit for bit the scalar tile. */
static inline __attribute__((always_inline)) NEON_ATTR void
NEON_NAME(mx_i8_tile)(const ck_mx *w, int64_t r0, const ck_act *a, int64_t t0, float *res,
                      int ldr, const int RT, const int NT) {
    static const int8_t lut_b[16] = {CK_E2M1_X2};
    const int8x16_t lut = vld1q_s8(lut_b);
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const int64_t rb = w->cp / 2, nb = w->cp / 32;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        int8x16_t wa[4], wb[4];
        for (int r = 0; r < RT; r++) {
            const uint8x16_t v = vld1q_u8(w->data + (r0 + r) * rb + b * 16);
            wa[r] = vqtbl1q_s8(lut, vandq_u8(v, m4));
            wb[r] = vqtbl1q_s8(lut, vshrq_n_u8(v, 4));
        }
        int32x4_t i[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
        for (int t = 0; t < NT; t++) {
            const int8_t *xp = a->q + (t0 + t) * a->cp + b / 2 * 64 + (b & 1) * 16;
            const int8x16_t x0 = vld1q_s8(xp), x1 = vld1q_s8(xp + 32);
            for (int r = 0; r < RT; r++)
                i[r * NT + t] = NEON_DOT16(NEON_DOT16(i[r * NT + t], wa[r], x0), wb[r], x1);
        }
        float sw[4] = {0}, xs[4] = {0};
        for (int k = 0; k < RT * NT; k++) {
            sw[k] = ck_e8m0_half(w->zeros[(r0 + k / NT) * nb + b]);
            xs[k] = ck_ldf(a->s + (t0 + k % NT) * a->ng + b / 2);
        }
        const float32x4_t c = vmulq_f32(vld1q_f32(sw), vld1q_f32(xs));
        acc = vaddq_f32(acc, vmulq_f32(vcvtq_f32_s32(NEON_NAME(totals)(i)), c));
    }
    NEON_NAME(store_pairs)(acc, res, ldr, RT, NT);
}

NEON_ATTR static void NEON_NAME(mx_i8)(const ck_mx *w, int64_t r0, int rt, const ck_act *a,
                                       int64_t t0, int nt, float *res) {
    if (nt == 1) {
        switch (rt) {
        case 4: NEON_NAME(mx_i8_tile)(w, r0, a, t0, res, 1, 4, 1); break;
        case 3: NEON_NAME(mx_i8_tile)(w, r0, a, t0, res, 1, 3, 1); break;
        case 2: NEON_NAME(mx_i8_tile)(w, r0, a, t0, res, 1, 2, 1); break;
        default: NEON_NAME(mx_i8_tile)(w, r0, a, t0, res, 1, 1, 1); break;
        }
        return;
    }
    for (int r = 0; r < rt; r++) {
        switch (nt) {
        case 4: NEON_NAME(mx_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 4); break;
        case 3: NEON_NAME(mx_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 3); break;
        default: NEON_NAME(mx_i8_tile)(w, r0 + r, a, t0, res + r * nt, nt, 1, 2); break;
        }
    }
}
