/* ck_avx512.c -- AVX-512 VNNI tiles (Zen 4, Ice Lake and later), selected at run time
 * like ck_avx2.c: compiled without -m flags, every function carries a target attribute,
 * and ck_core.c picks this backend only if __builtin_cpu_supports reports all of them.
 *
 * The three int8 dot-product tiles (q4, q6, q8) change: vpdpbusd (u8 x s8, four
 * products summed straight into an i32 lane) replaces AVX2's maddubs -> i16 -> madd ->
 * add chain. The nibbles (0..15; q6 values 0..63) are the u8 operand and the activations
 * the s8 one, as in AVX2;
 * everything else (activation quantization, float paths, attention) is the AVX2 code.
 * The tiles use 256-bit vectors: Zen 4 runs a 512-bit op as two 256-bit halves, and a zmm
 * q4 tile (one dpbusd per 64-value block on a broadcast of its 32 bytes, high half
 * shifted) measured no faster than AVX2, against 1.15-1.4x for the ymm tile below (in
 * cache). Batches of many tokens run the zmm panel kernel at the end of this file
 * instead (tokens in the lanes: 2.3-2.8x the tiles from 16 tokens on a Sapphire
 * Rapids-class core).
 *
 * Results are bit-identical to the AVX2 backend (tests/test_kernels.py checks it): the
 * integer dots are exact, and the float epilogues below follow AVX2's arithmetic in the
 * same order. Keep them in step with ck_avx2.c. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include "ck_internal.h"
#include "ck_tiles.h"

#define VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"
#define VNNI_FN static __attribute__((target(VNNI_TARGET)))
#define VNNI_INL static inline __attribute__((target(VNNI_TARGET), always_inline))

#define CK_PF_BYTES 8192   /* as ck_avx2.c: software prefetch distance past the tile */

VNNI_INL float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

CK_DEFINE_Q4_DOT_PASS(VNNI_INL)

/* ------------------------------------------------------------------ q4, int8 act */

/* RT rows x NT tokens, the structure of AVX2's q4_i8_tile with three changes:
 * - low and high nibbles get separate accumulators: two independent dpbusd chains per
 *   (row, token), not one dependent pair per block (AVX-512VL has 32 ymm registers);
 * - the block loop counts from 0 to bpg, so that GCC unrolls it for the constant BPG
 *   (with `b` from g*bpg it did not, and spilled and copied accumulators every block);
 * - the dots go through transpose_8x4 instead of 4-byte stores.
 * With maddubs + madd in place of dpbusd, these changes alone measured ~1.15x over the
 * AVX2 tile on Zen 4; dpbusd brings it to ~1.3x (matrix in cache, one thread). */
VNNI_INL void q4_i8_tile(const ck_q4 *w, int64_t r0, const ck_act *a, int64_t t0,
                         float *res, int ldr, const int RT, const int NT, const int BPG) {
    const int K = RT * NT, K4 = (K + 3) / 4 * 4;   /* K <= 8 */
    const int64_t rb = w->cp / 2, ng = w->ng, bpg = BPG ? BPG : w->group / 64;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m4h = _mm256_set1_epi8((char)0xF0);
    const uint8_t *wr = w->data + r0 * rb;
    const int8_t *xr = a->q + t0 * a->cp;
    const int64_t pf = RT * rb + CK_PF_BYTES;
    int32_t dq[2][CK_GCHUNK][4];   /* [k / 4][group][k % 4] */
    float acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < K; k++) acc[k] = 0.0f;

    for (int64_t gc = 0; gc < ng; gc += CK_GCHUNK) {
        const int gn = ng - gc < CK_GCHUNK ? (int)(ng - gc) : CK_GCHUNK;
        for (int gi = 0; gi < gn; gi++) {
            const int64_t g = gc + gi;
            __m256i ilo[8], ihi[8];
#pragma GCC unroll 8
            for (int k = 0; k < K4; k++) ilo[k] = ihi[k] = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int64_t j = 0; j < bpg; j++) {
                const int64_t b = g * bpg + j;
                __m256i lo[CK_MAX_RT], hi[CK_MAX_RT];
#pragma GCC unroll 4
                for (int r = 0; r < RT; r++) {
                    /* same prefetch as AVX2 (one line per 64 bytes, into L2) */
                    if (!(b & 1))
                        _mm_prefetch((const char *)(wr + r * rb + b * 32 + pf), _MM_HINT_T1);
                    __m256i v = _mm256_loadu_si256((const __m256i *)(wr + r * rb + b * 32));
                    lo[r] = _mm256_and_si256(v, m4);
                    hi[r] = _mm256_and_si256(v, m4h);      /* 16 x the high nibble */
                }
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const int8_t *xp = xr + t * a->cp + b * 64;
                    __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);
                    __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + 32));
#pragma GCC unroll 4
                    for (int r = 0; r < RT; r++) {
                        ilo[r * NT + t] = _mm256_dpbusd_epi32(ilo[r * NT + t], lo[r], x0);
                        ihi[r * NT + t] = _mm256_dpbusd_epi32(ihi[r * NT + t], hi[r], x1);
                    }
                }
            }
#pragma GCC unroll 2
            for (int k = 0; k < K4; k += 4) {   /* 4 x (8 lanes) -> 4 sums */
                /* ihi holds 16 x the high nibbles' dots: exact multiples of 16 */
                __m256i h = _mm256_hadd_epi32(
                    _mm256_hadd_epi32(_mm256_add_epi32(ilo[k], _mm256_srai_epi32(ihi[k], 4)),
                                      _mm256_add_epi32(ilo[k + 1], _mm256_srai_epi32(ihi[k + 1], 4))),
                    _mm256_hadd_epi32(_mm256_add_epi32(ilo[k + 2], _mm256_srai_epi32(ihi[k + 2], 4)),
                                      _mm256_add_epi32(ilo[k + 3], _mm256_srai_epi32(ihi[k + 3], 4))));
                _mm_storeu_si128((__m128i *)dq[k / 4][gi],
                                 _mm_add_epi32(_mm256_castsi256_si128(h),
                                               _mm256_extracti128_si256(h, 1)));
            }
        }
        q4_dot_pass(w, r0, a, t0, dq, gc, gn, acc, K, NT);
    }
#pragma GCC unroll 8
    for (int k = 0; k < K; k++) res[(k / NT) * ldr + k % NT] = acc[k];
}

CK_DEFINE_Q4_I8(VNNI_FN, q4_i8, q4_i8_tile)

/* ------------------------------------------------------------------ q8, int8 act */

/* dpbusd in place of maddubs + madd. This matvec is memory-bound: on Zen 4 (32000x1024)
 * ~5% faster than AVX2 from L3, 5-9% slower from DRAM on one thread, even on two;
 * variants (two accumulators per row, 64-byte steps, other prefetch distances, prefetch
 * by the first token only) measured no better. */
CK_DEFINE_Q8_I8_TILE(VNNI_INL, q8_i8_tile, _mm256_dpbusd_epi32)

CK_DEFINE_Q8_I8(VNNI_FN, q8_i8, q8_i8_tile)

/* ------------------------------------------------------------------ q6, int8 act */

/* two dpbusd in place of AVX2's maddubs pair + madd: the same integers (ck_tiles.h) */
#define VNNI_DOT2(acc, lo, x0, hi, x1) \
    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32((acc), (lo), (x0)), (hi), (x1))
CK_DEFINE_Q6_I8_TILE(VNNI_INL, q6_i8_tile, VNNI_DOT2)

CK_DEFINE_Q6_I8(VNNI_FN, q6_i8, q6_i8_tile)

/* ------------------------------------------------------------------ q4 panels
 *
 * Batches of many tokens (ck_step_moe.c, from CK_PANEL_MIN_TOKENS tokens per expert):
 * tokens in the lanes, rows unpacked. The tiles above (1 row x 4 tokens, ymm) load 8
 * activation vectors per 64 weights and reduce every (row, token) accumulator across
 * its lanes once per group; from L2 (a job's activations outgrow L1) that ran at ~30
 * multiply-adds per cycle. Here a zmm lane is one token of a panel (ck_internal.h:
 * bytes k..k+3 of 16 tokens per 64-byte load, stored as x + 128), and the weights are
 * unpacked once per row tile into int8 (w - z) (q4_unpack), whose 4 bytes at k are
 * broadcast to all lanes: one vpdpbusd is 16 tokens x 4 values of one row, and after a
 * group's k steps lane t holds the exact integer
 *   sum (w - z)(x + 128) - 128 sum (w - z) = dot - z * xsum
 * (the accumulator starts at wzs = -128 sum (w - z)): the zero-point-corrected dot of
 * q4_dot_pass, without any horizontal reduction. The float pass then runs q4_dot_pass's
 * arithmetic with tokens in lanes: per (row, token) eight partial sums over groups
 * g % 8 (fma of the dot by scale_w * scale_x), the rest of the chunk's groups in a
 * tail fma chain, hsum_ps's tree ((0+4)+(2+6))+((1+5)+(3+7)), then acc += hsum + tail
 * per chunk of CK_GCHUNK groups: every value bit for bit the tiles' (tests/
 * test_kernels.py). A tile is 8 rows x 2 panels (16 zmm accumulators; per 4 values, 2
 * panel loads and 8 broadcasts for 16 vpdpbusd). */

/* one 64-value block of unpacked values (lo: 0..31, hi: 32..63) stored as w - z, their
 * sum added to sad; and a group's wzs from that sum (q4_unpack and q6_unpack) */
VNNI_INL void unpack_store(int8_t *dst, __m256i lo, __m256i hi, __m256i zv, __m256i *sad) {
    const __m256i zero = _mm256_setzero_si256();
    *sad = _mm256_add_epi64(*sad, _mm256_add_epi64(_mm256_sad_epu8(lo, zero),
                                                   _mm256_sad_epu8(hi, zero)));
    _mm256_storeu_si256((__m256i *)dst, _mm256_sub_epi8(lo, zv));
    _mm256_storeu_si256((__m256i *)(dst + 32), _mm256_sub_epi8(hi, zv));
}

VNNI_INL int32_t unpack_wzs(__m256i sad, uint8_t z, int64_t group) {
    __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
    int64_t sum = _mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1);
    return (int32_t)(-128 * (sum - (int64_t)z * group));
}

VNNI_FN void q4_unpack(const ck_q4 *w, int64_t r0, int rt, int slot, int8_t *wbuf,
                       int32_t *wzs) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    const int64_t rb = w->cp / 2, ng = w->ng, bpg = w->group / 64;
    for (int r = 0; r < rt; r++) {
        const uint8_t *row = w->data + (r0 + r) * rb;
        const uint8_t *zp = w->zeros + (r0 + r) * ng;
        int8_t *dst = wbuf + (slot + r) * w->cp;
        for (int64_t g = 0; g < ng; g++) {
            const __m256i zv = _mm256_set1_epi8((char)zp[g]);
            __m256i sad = zero;
            for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(row + b * 32));
                unpack_store(dst + b * 64, _mm256_and_si256(v, m4),
                             _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), zv, &sad);
            }
            wzs[(slot + r) * ng + g] = unpack_wzs(sad, zp[g], w->group);
        }
    }
}

/* q4_unpack for a q6 matrix: each 64-value block's low nibbles and top two bits put
 * together as the q6 tile does (ck_tiles.h, CK_DEFINE_Q6_I8_TILE), then w - z */
VNNI_FN void q6_unpack(const ck_q6 *w, int64_t r0, int rt, int slot, int8_t *wbuf,
                       int32_t *wzs) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i shl = _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2);
    const __m256i shr = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
    const __m256i zero = _mm256_setzero_si256();
    const int64_t rb = w->cp / 64 * CK_Q6_BLOCK, ng = w->ng, bpg = w->group / 64;
    for (int r = 0; r < rt; r++) {
        const uint8_t *row = w->data + (r0 + r) * rb;
        const uint8_t *zp = w->zeros + (r0 + r) * ng;
        int8_t *dst = wbuf + (slot + r) * w->cp;
        for (int64_t g = 0; g < ng; g++) {
            const __m256i zv = _mm256_set1_epi8((char)zp[g]);
            __m256i sad = zero;
            for (int64_t b = g * bpg; b < (g + 1) * bpg; b++) {
                const uint8_t *p = row + b * CK_Q6_BLOCK;
                const __m256i ql = _mm256_loadu_si256((const __m256i *)p);
                const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 32)));
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(ql, m4),
                                                   _mm256_and_si256(_mm256_sllv_epi32(h, shl), m2));
                const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), m4),
                                                   _mm256_and_si256(_mm256_srlv_epi32(h, shr), m2));
                unpack_store(dst + b * 64, lo, hi, zv, &sad);
            }
            wzs[(slot + r) * ng + g] = unpack_wzs(sad, zp[g], w->group);
        }
    }
}

/* acc[r][tt] = the exact dots (w - z) . x of unpacked row r and the 16 tokens of panel
 * tt over group g. Named accumulators and a straight inner loop: with arrays GCC copied
 * every accumulator through another register on each step (see dpbusd512). */
#define PDOT(r, A0, A1)                                                                 \
    do {                                                                                \
        const __m512i b = _mm512_set1_epi32(ck_ldi((const int32_t *)(wk + (r) * cp)));  \
        dpbusd512(&A0, a0, b);                                                          \
        if (TT > 1) dpbusd512(&A1, a1, b);                                              \
    } while (0)

/* acc += the four u8 x s8 products of each lane, as _mm512_dpbusd_epi32; in asm because
 * GCC 12 copied each accumulator through a second register around the builtin */
VNNI_INL void dpbusd512(__m512i *acc, __m512i u8, __m512i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(u8), "v"(s8));
}

VNNI_INL void group_dots(const ck_unpacked *u, const uint8_t *const *pq, int64_t g,
                         __m512i acc[][2], const int TT) {
    const int64_t cp = u->cp, ng = u->ng, kpg = u->group / 4;
    const int32_t *z = u->wzs + g;
    __m512i c00 = _mm512_set1_epi32(z[0]), c10 = _mm512_set1_epi32(z[ng]);
    __m512i c20 = _mm512_set1_epi32(z[2 * ng]), c30 = _mm512_set1_epi32(z[3 * ng]);
    __m512i c40 = _mm512_set1_epi32(z[4 * ng]), c50 = _mm512_set1_epi32(z[5 * ng]);
    __m512i c60 = _mm512_set1_epi32(z[6 * ng]), c70 = _mm512_set1_epi32(z[7 * ng]);
    __m512i c01 = c00, c11 = c10, c21 = c20, c31 = c30, c41 = c40, c51 = c50, c61 = c60, c71 = c70;
    const int8_t *wk = u->w + g * u->group;
    const uint8_t *p0 = pq[0] + g * kpg * 64, *p1 = TT > 1 ? pq[1] + g * kpg * 64 : p0;
    for (int64_t kd = 0; kd < kpg; kd++, wk += 4) {
        const __m512i a0 = _mm512_loadu_si512((const void *)(p0 + kd * 64));
        const __m512i a1 = TT > 1 ? _mm512_loadu_si512((const void *)(p1 + kd * 64)) : a0;
        PDOT(0, c00, c01); PDOT(1, c10, c11); PDOT(2, c20, c21); PDOT(3, c30, c31);
        PDOT(4, c40, c41); PDOT(5, c50, c51); PDOT(6, c60, c61); PDOT(7, c70, c71);
    }
    acc[0][0] = c00; acc[1][0] = c10; acc[2][0] = c20; acc[3][0] = c30;
    acc[4][0] = c40; acc[5][0] = c50; acc[6][0] = c60; acc[7][0] = c70;
    acc[0][1] = c01; acc[1][1] = c11; acc[2][1] = c21; acc[3][1] = c31;
    acc[4][1] = c41; acc[5][1] = c51; acc[6][1] = c61; acc[7][1] = c71;
}
#undef PDOT

VNNI_INL void q4_panel_tile(const ck_unpacked *u, const ck_panel *p, int64_t p0, float *res,
                            int64_t ldr, const int TT) {
    enum { R = CK_PANEL_ROWS };
    const int64_t cp = u->cp, ng = u->ng;
    const uint8_t *pq[2];
    const float *ps[2];
    __m512 F[R][2][8], T[R][2];
#pragma GCC unroll 2
    for (int tt = 0; tt < TT; tt++) {
        pq[tt] = p->q + (p0 + tt) * cp * CK_PANEL;
        ps[tt] = p->s + (p0 + tt) * ng * CK_PANEL;
    }
    for (int64_t gc = 0; gc < ng; gc += CK_GCHUNK) {
        const int gn = ng - gc < CK_GCHUNK ? (int)(ng - gc) : CK_GCHUNK, gv = gn / 8 * 8;
        for (int r = 0; r < R; r++)
            for (int tt = 0; tt < TT; tt++) {
                T[r][tt] = _mm512_setzero_ps();
                for (int j = 0; j < 8; j++) F[r][tt][j] = _mm512_setzero_ps();
            }
        for (int gi = 0; gi < gn; gi++) {
            const int64_t g = gc + gi;
            __m512i acc[R][2];
            group_dots(u, pq, g, acc, TT);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m512 sw = _mm512_set1_ps(ck_ldf(u->sw[r] + g));
#pragma GCC unroll 2
                for (int tt = 0; tt < TT; tt++) {
                    const __m512 c = _mm512_mul_ps(sw, _mm512_loadu_ps(ps[tt] + g * CK_PANEL));
                    const __m512 d = _mm512_cvtepi32_ps(acc[r][tt]);
                    if (gi < gv) F[r][tt][gi & 7] = _mm512_fmadd_ps(d, c, F[r][tt][gi & 7]);
                    else T[r][tt] = _mm512_fmadd_ps(d, c, T[r][tt]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int tt = 0; tt < TT; tt++) {
                __m512 *f = F[r][tt];
                __m512 h = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(f[0], f[4]), _mm512_add_ps(f[2], f[6])),
                                         _mm512_add_ps(_mm512_add_ps(f[1], f[5]), _mm512_add_ps(f[3], f[7])));
                __m512 v = _mm512_add_ps(h, T[r][tt]);
                float *o = res + r * ldr + tt * CK_PANEL;
                __m512 prev = gc ? _mm512_loadu_ps(o) : _mm512_setzero_ps();
                _mm512_storeu_ps(o, _mm512_add_ps(prev, v));
            }
    }
}

VNNI_FN void q4_panels(const ck_unpacked *u, const ck_panel *p, int64_t np, float *res,
                       int64_t ldr) {
    int64_t p0 = 0;
    for (; p0 + 2 <= np; p0 += 2) q4_panel_tile(u, p, p0, res + p0 * CK_PANEL, ldr, 2);
    if (p0 < np) q4_panel_tile(u, p, p0, res + p0 * CK_PANEL, ldr, 1);
}

/* ------------------------------------------------------------------ mxfp4, int8 act */

/* two dpbusd from c in place of AVX2's maddubs pair + madd + add: the same i32 lanes, so
 * the same floats (ck_tiles.h's CK_DEFINE_MX_I8_TILE) */
VNNI_INL __m256i mx_dotc(__m256i c, __m256i wa, __m256i xa, __m256i wb, __m256i xb) {
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(c, wa, xa), wb, xb);
}

CK_DEFINE_MX_I8_TILE(VNNI_INL, mx_i8_tile, mx_dotc)

CK_DEFINE_MX_I8(VNNI_FN, mx_i8, mx_i8_tile, 4)

const ck_backend_t ck_backend_avx512vnni = {
    "avx512vnni", ck_avx2_act_quant, q4_i8, ck_avx2_q4_f32, q8_i8, ck_avx2_q8_f32,
    q6_i8, ck_scalar_q6_f32, ck_avx2_attn, 4, 4, q4_unpack, q4_panels, q6_unpack, mx_i8,
    ck_avx2_mla,
};

#else
typedef int ck_avx512_unused; /* not x86: nothing to compile here */
#endif
