/* ck_mx.c -- what the mxfp4 kernels of every backend share (ck_internal.h's ck_mx): the
 * activations' order, the block scales' table and the scalar tiles (the reference of the
 * SIMD ones; the float one is the parity path on every backend). */
#include "ck_internal.h"

/* 2^(e - 128) for every e8m0 byte e, exactly (ck_e8m0_half's values; e 0 and 1 are float32
 * subnormals): the SIMD tiles broadcast a block's scale from here */
const float ck_e8m0_half_tab[256] = {
    0x1p-128f, 0x1p-127f, 0x1p-126f, 0x1p-125f, 0x1p-124f, 0x1p-123f, 0x1p-122f, 0x1p-121f,
    0x1p-120f, 0x1p-119f, 0x1p-118f, 0x1p-117f, 0x1p-116f, 0x1p-115f, 0x1p-114f, 0x1p-113f,
    0x1p-112f, 0x1p-111f, 0x1p-110f, 0x1p-109f, 0x1p-108f, 0x1p-107f, 0x1p-106f, 0x1p-105f,
    0x1p-104f, 0x1p-103f, 0x1p-102f, 0x1p-101f, 0x1p-100f, 0x1p-99f, 0x1p-98f, 0x1p-97f,
    0x1p-96f, 0x1p-95f, 0x1p-94f, 0x1p-93f, 0x1p-92f, 0x1p-91f, 0x1p-90f, 0x1p-89f,
    0x1p-88f, 0x1p-87f, 0x1p-86f, 0x1p-85f, 0x1p-84f, 0x1p-83f, 0x1p-82f, 0x1p-81f,
    0x1p-80f, 0x1p-79f, 0x1p-78f, 0x1p-77f, 0x1p-76f, 0x1p-75f, 0x1p-74f, 0x1p-73f,
    0x1p-72f, 0x1p-71f, 0x1p-70f, 0x1p-69f, 0x1p-68f, 0x1p-67f, 0x1p-66f, 0x1p-65f,
    0x1p-64f, 0x1p-63f, 0x1p-62f, 0x1p-61f, 0x1p-60f, 0x1p-59f, 0x1p-58f, 0x1p-57f,
    0x1p-56f, 0x1p-55f, 0x1p-54f, 0x1p-53f, 0x1p-52f, 0x1p-51f, 0x1p-50f, 0x1p-49f,
    0x1p-48f, 0x1p-47f, 0x1p-46f, 0x1p-45f, 0x1p-44f, 0x1p-43f, 0x1p-42f, 0x1p-41f,
    0x1p-40f, 0x1p-39f, 0x1p-38f, 0x1p-37f, 0x1p-36f, 0x1p-35f, 0x1p-34f, 0x1p-33f,
    0x1p-32f, 0x1p-31f, 0x1p-30f, 0x1p-29f, 0x1p-28f, 0x1p-27f, 0x1p-26f, 0x1p-25f,
    0x1p-24f, 0x1p-23f, 0x1p-22f, 0x1p-21f, 0x1p-20f, 0x1p-19f, 0x1p-18f, 0x1p-17f,
    0x1p-16f, 0x1p-15f, 0x1p-14f, 0x1p-13f, 0x1p-12f, 0x1p-11f, 0x1p-10f, 0x1p-9f,
    0x1p-8f, 0x1p-7f, 0x1p-6f, 0x1p-5f, 0x1p-4f, 0x1p-3f, 0x1p-2f, 0x1p-1f,
    0x1p0f, 0x1p1f, 0x1p2f, 0x1p3f, 0x1p4f, 0x1p5f, 0x1p6f, 0x1p7f,
    0x1p8f, 0x1p9f, 0x1p10f, 0x1p11f, 0x1p12f, 0x1p13f, 0x1p14f, 0x1p15f,
    0x1p16f, 0x1p17f, 0x1p18f, 0x1p19f, 0x1p20f, 0x1p21f, 0x1p22f, 0x1p23f,
    0x1p24f, 0x1p25f, 0x1p26f, 0x1p27f, 0x1p28f, 0x1p29f, 0x1p30f, 0x1p31f,
    0x1p32f, 0x1p33f, 0x1p34f, 0x1p35f, 0x1p36f, 0x1p37f, 0x1p38f, 0x1p39f,
    0x1p40f, 0x1p41f, 0x1p42f, 0x1p43f, 0x1p44f, 0x1p45f, 0x1p46f, 0x1p47f,
    0x1p48f, 0x1p49f, 0x1p50f, 0x1p51f, 0x1p52f, 0x1p53f, 0x1p54f, 0x1p55f,
    0x1p56f, 0x1p57f, 0x1p58f, 0x1p59f, 0x1p60f, 0x1p61f, 0x1p62f, 0x1p63f,
    0x1p64f, 0x1p65f, 0x1p66f, 0x1p67f, 0x1p68f, 0x1p69f, 0x1p70f, 0x1p71f,
    0x1p72f, 0x1p73f, 0x1p74f, 0x1p75f, 0x1p76f, 0x1p77f, 0x1p78f, 0x1p79f,
    0x1p80f, 0x1p81f, 0x1p82f, 0x1p83f, 0x1p84f, 0x1p85f, 0x1p86f, 0x1p87f,
    0x1p88f, 0x1p89f, 0x1p90f, 0x1p91f, 0x1p92f, 0x1p93f, 0x1p94f, 0x1p95f,
    0x1p96f, 0x1p97f, 0x1p98f, 0x1p99f, 0x1p100f, 0x1p101f, 0x1p102f, 0x1p103f,
    0x1p104f, 0x1p105f, 0x1p106f, 0x1p107f, 0x1p108f, 0x1p109f, 0x1p110f, 0x1p111f,
    0x1p112f, 0x1p113f, 0x1p114f, 0x1p115f, 0x1p116f, 0x1p117f, 0x1p118f, 0x1p119f,
    0x1p120f, 0x1p121f, 0x1p122f, 0x1p123f, 0x1p124f, 0x1p125f, 0x1p126f, 0x1p127f
};

/* In place, per 64-value group of an int8 activation row of cp values: the 32 even values
 * (block 2i's 16, then block 2i+1's), then the 32 odd ones -- the order of the low and the
 * high nibbles of the group's 32 weight bytes, so that the tiles look the codes up where
 * they lie and need no shuffle per row (the group's sum is unchanged) */
void ck_mx_act_order(int8_t *q, int64_t cp) {
    for (int64_t g = 0; g < cp; g += 64) {
        int8_t v[64];
        memcpy(v, q + g, 64);
        for (int j = 0; j < 32; j++) {
            q[g + j] = v[2 * j];
            q[g + 32 + j] = v[2 * j + 1];
        }
    }
}

/* res[r*nt + t] for the scalar tiles: per 32-value block the sum of the doubled codes
 * (CK_E2M1_X2) times the activations, then acc + sum * scale in ascending block order.
 * int8 (i8 = 1, activations in ck_mx_act_order's order): an exact integer dot, scale
 * 2^(e-128) * xs (quant's mxfp4 reference: matvec_mxfp4_q8_ref); float: a float sum of
 * the pairs, scale 2^(e-128). */
static inline void mx_rows(const ck_mx *w, int64_t r0, int rt, const void *act, int64_t t0,
                           int nt, float *res, const int i8) {
    static const int8_t lut[16] = {CK_E2M1_X2};
    const ck_act *a = act;
    const ck_xf *x = act;
    const int64_t rb = w->cp / 2, nb = w->cp / 32;
    for (int r = 0; r < rt; r++) {
        const uint8_t *row = w->data + (r0 + r) * rb, *e = w->zeros + (r0 + r) * nb;
        for (int t = 0; t < nt; t++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb && (i8 || b * 32 < w->cols); b++) {
                const uint8_t *p = row + b * 16;
                if (i8) {   /* block b's even values at 16 * (b & 1), its odd ones 32 later */
                    const int8_t *xq = a->q + (t0 + t) * a->cp + b / 2 * 64 + (b & 1) * 16;
                    int32_t dot = 0;
                    for (int j = 0; j < 16; j++)
                        dot += lut[p[j] & 15] * xq[j] + lut[p[j] >> 4] * xq[32 + j];
                    acc += (float)dot * (ck_e8m0_half(e[b]) *
                                         ck_ldf(a->s + (t0 + t) * a->ng + b / 2));
                } else {
                    const float *xr = x->x + (t0 + t) * x->ld + b * 32;
                    float sum = 0.0f;
                    for (int j = 0; j < 16; j++)
                        sum += (float)lut[p[j] & 15] * ck_ldf(xr + 2 * j) +
                               (float)lut[p[j] >> 4] * ck_ldf(xr + 2 * j + 1);
                    acc += sum * ck_e8m0_half(e[b]);
                }
            }
            res[r * nt + t] = acc;
        }
    }
}

void ck_scalar_mx_i8(const ck_mx *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                     float *res) {
    mx_rows(w, r0, rt, a, t0, nt, res, 1);
}

void ck_scalar_mx_f32(const ck_mx *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res) {
    mx_rows(w, r0, rt, x, t0, nt, res, 0);
}
