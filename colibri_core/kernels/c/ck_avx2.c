/* ck_avx2.c -- AVX2+FMA tiles, selected at run time (ck_core.c checks
 * __builtin_cpu_supports), so the file is compiled without -mavx2 and every function
 * carries __attribute__((target("avx2,fma"))). All loads are unaligned.
 *
 * int8 path, per 64-value block: one 32-byte load of nibbles; `& 0x0F` gives values
 * 0..31, `>> 4` values 32..63 (FORMAT.md order). maddubs(u8 nibble, s8 activation)
 * gives i16 pair sums (|.| <= 2*15*127 = 3810), up to 4 blocks are summed in i16
 * (<= 30480, no saturation), then madd(., 1) widens to i32. Each group's i32 dot is
 * stored, and a vectorized pass over groups applies scale_w * xs * (dot - zero * xsum)
 * (integer zero-point correction, as quant.matvec_q4_q8_ref).
 * Measured on a 2-core Zen 4 VM: ~25 GB/s of q4 weights per core when the matrix is in
 * cache, ~20 GB/s from DRAM thanks to the software prefetch below. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <math.h>
#include "ck_internal.h"
#include "ck_tiles.h"

#define AVX2_FN static __attribute__((target("avx2,fma")))
/* the entries other backends reuse (declared in ck.h) */
#define AVX2_API __attribute__((target("avx2,fma")))
#define AVX2_INL static inline __attribute__((target("avx2,fma"), always_inline))

AVX2_INL float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2_INL int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* ------------------------------------------------------------------ activations */

/* Same arithmetic as the scalar version (float32 mul by 1/s, round half-even, clamp),
 * so results are bit-identical; partial last groups go to the scalar code. */
AVX2_API void ck_avx2_act_quant(const float *x, int64_t cols, int64_t group, int8_t *xq,
                                float *xs, int32_t *xsum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t c0 = 0, g = 0; c0 < cols; c0 += group, g++) {
        if (cols - c0 < group) {
            ck_scalar_act_quant(x + c0, cols - c0, group, xq + c0, xs + g, xsum + g);
            break;
        }
        __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int64_t c = c0; c < c0 + group; c += 8) {
            __m256 v = _mm256_loadu_ps(x + c);
            m = _mm256_max_ps(m, _mm256_and_ps(v, absmask));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float s = _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(m4) / 127.0f;
        __m256 inv = _mm256_set1_ps(s > 0.0f ? 1.0f / s : 0.0f);
        __m256i vsum = _mm256_setzero_si256();
        for (int64_t c = c0; c < c0 + group; c += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++) {
                __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + c + 8 * k), inv);
                v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
            }
            vsum = _mm256_add_epi32(vsum, _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                           _mm256_add_epi32(q[2], q[3])));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                           _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(xq + c), _mm256_permutevar8x32_epi32(p, perm));
        }
        ck_stf(xs + g, s);
        ck_sti(xsum + g, hsum_epi32(vsum));
    }
}

/* ------------------------------------------------------------------ q4, int8 act */

#define CK_PF_BYTES 8192   /* software prefetch runs this far past the current tile */

/* One 64-value block b of RT rows x NT tokens, added to the i16 accumulators: low
 * nibbles (values 0..31) into slo, high nibbles (32..63) into shi, two independent
 * maddubs chains per row and token. */
AVX2_INL void q4_i8_block(const uint8_t *wr, int64_t rb, int64_t pf, const int8_t *xr,
                          int64_t xcp, int64_t b, __m256i m4, __m256i *slo, __m256i *shi,
                          const int RT, const int NT) {
    __m256i lo[CK_MAX_RT], hi[CK_MAX_RT];
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++) {
        /* A tile walks RT rows side by side, in short streams the hardware prefetchers
         * follow poorly: prefetch (into L2: T0 measured much worse) one line per 64 bytes
         * read, `pf` bytes ahead, which covers the lines after this tile exactly once.
         * Doubles cold-cache speed. */
        if (!(b & 1))
            _mm_prefetch((const char *)(wr + r * rb + b * 32 + pf), _MM_HINT_T1);
        __m256i v = _mm256_loadu_si256((const __m256i *)(wr + r * rb + b * 32));
        lo[r] = _mm256_and_si256(v, m4);
        hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        const int8_t *xp = xr + t * xcp + b * 64;
        __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + 32));
#pragma GCC unroll 4
        for (int r = 0; r < RT; r++) {
            slo[r * NT + t] = _mm256_add_epi16(slo[r * NT + t], _mm256_maddubs_epi16(lo[r], x0));
            shi[r * NT + t] = _mm256_add_epi16(shi[r * NT + t], _mm256_maddubs_epi16(hi[r], x1));
        }
    }
}

CK_DEFINE_Q4_DOT_PASS(AVX2_INL)

/* RT rows x NT tokens (RT*NT <= 8); res[r*ldr + t]. RT, NT are compile-time constants
 * after inlining, so the accumulator arrays live in registers.
 * - Per group, chunks of <= 4 blocks are summed in i16 (lo + hi <= 4 * 2 * 3810, see
 *   the header), then widened with madd(., 1) into i32.
 * - Multi-token tiles (NT > 1) count the block loop from 0, so that GCC unrolls it for
 *   the constant BPG (~3% faster, measured on Zen 4); the 4-row decode tile keeps a
 *   rolled loop, which measured ~10% faster there than the unrolled one.
 * - Each group's dots are reduced four accumulators at a time with a hadd tree and
 *   stored 16 bytes per group for the float pass (q4_dot_pass, ck_tiles.h: shared
 *   with ck_avx512.c, so both give the same floats).
 * Together ~1.05-1.15x over the previous tile (4-byte dot stores, one combined i16
 * accumulator, block loop from g*bpg), Zen 4. */
AVX2_INL void q4_i8_tile(const ck_q4 *w, int64_t r0, const ck_act *a, int64_t t0,
                         float *res, int ldr, const int RT, const int NT, const int BPG) {
    const int K = RT * NT, K4 = (K + 3) / 4 * 4;   /* K <= 8 */
    /* BPG: 64-blocks per group when known at compile time (groups 64, 128), else 0 */
    const int64_t rb = w->cp / 2, ng = w->ng, bpg = BPG ? BPG : w->group / 64;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
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
            __m256i iacc[8];
#pragma GCC unroll 8
            for (int k = 0; k < K4; k++) iacc[k] = _mm256_setzero_si256();
            for (int64_t kb0 = 0; kb0 < bpg; kb0 += 4) {
                const int64_t b0 = g * bpg + kb0;
                const int64_t kn = bpg - kb0 < 4 ? bpg - kb0 : 4;   /* i16 limit: 4 blocks */
                __m256i slo[8], shi[8];
#pragma GCC unroll 8
                for (int k = 0; k < K; k++) slo[k] = shi[k] = _mm256_setzero_si256();
                if (NT == 1) {
                    for (int64_t b = b0; b < b0 + kn; b++)
                        q4_i8_block(wr, rb, pf, xr, a->cp, b, m4, slo, shi, RT, NT);
                } else {
#pragma GCC unroll 4
                    for (int64_t j = 0; j < kn; j++)
                        q4_i8_block(wr, rb, pf, xr, a->cp, b0 + j, m4, slo, shi, RT, NT);
                }
#pragma GCC unroll 8
                for (int k = 0; k < K; k++)
                    iacc[k] = _mm256_add_epi32(iacc[k], _mm256_madd_epi16(
                        _mm256_add_epi16(slo[k], shi[k]), ones));
            }
#pragma GCC unroll 2
            for (int k = 0; k < K4; k += 4) {   /* 4 x (8 lanes) -> 4 sums */
                __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(iacc[k], iacc[k + 1]),
                                              _mm256_hadd_epi32(iacc[k + 2], iacc[k + 3]));
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

CK_DEFINE_Q4_I8(AVX2_FN, q4_i8, q4_i8_tile)

/* ------------------------------------------------------------------ q4, float act */

/* 64 nibbles -> 8 x 8 floats (q - z), in value order */
AVX2_INL void q4_dequant_block(const uint8_t *p, __m256 zf, __m256 wf[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                       _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    for (int k = 0; k < 4; k++) {
        wf[2 * k] = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[k])), zf);
        wf[2 * k + 1] = _mm256_sub_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(part[k], 8))), zf);
    }
}

/* One row x NT tokens. Blocks wholly past `cols` are skipped (their weights are the zero
 * point, i.e. exactly 0); a partial last block reads x from the zero-padded tail copy. */
AVX2_INL void q4_f32_tile(const ck_q4 *w, int64_t r, const ck_xf *x, int64_t t0, float *res,
                          int ldr, const int NT) {
    const int64_t bpg = w->group / 64, nblk = (x->cols + 63) / 64;
    const int64_t nfull = x->tail ? x->cols / 64 : nblk;
    const uint8_t *row = w->data + r * (w->cp / 2);
    __m256 facc[CK_MAX_NT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) facc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w->ng; g++) {
        /* two accumulators per token: halves the dependent FMA chain (latency-bound) */
        __m256 zf = _mm256_set1_ps((float)w->zeros[r * w->ng + g]), gacc[CK_MAX_NT][2], wf[8];
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) gacc[t][0] = gacc[t][1] = _mm256_setzero_ps();
        int64_t b1 = (g + 1) * bpg < nblk ? (g + 1) * bpg : nblk;
        for (int64_t b = g * bpg; b < b1; b++) {
            q4_dequant_block(row + b * 32, zf, wf);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const float *xp = b < nfull ? x->x + (t0 + t) * x->ld + b * 64
                                            : x->tail + (t0 + t) * 64;
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++)
                    gacc[t][k & 1] = _mm256_fmadd_ps(wf[k], _mm256_loadu_ps(xp + 8 * k),
                                                     gacc[t][k & 1]);
            }
        }
        __m256 sc = _mm256_set1_ps(ck_ldf(w->scales + r * w->ng + g));
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++)
            facc[t] = _mm256_fmadd_ps(_mm256_add_ps(gacc[t][0], gacc[t][1]), sc, facc[t]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) res[t] = hsum_ps(facc[t]);
    (void)ldr;
}

AVX2_API void ck_avx2_q4_f32(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0,
                             int nt, float *res) {
    for (int r = 0; r < rt; r++) {
        switch (nt) {
        case 4: q4_f32_tile(w, r0 + r, x, t0, res + r * nt, nt, 4); break;
        case 3: q4_f32_tile(w, r0 + r, x, t0, res + r * nt, nt, 3); break;
        case 2: q4_f32_tile(w, r0 + r, x, t0, res + r * nt, nt, 2); break;
        default: q4_f32_tile(w, r0 + r, x, t0, res + r * nt, nt, 1); break;
        }
    }
}

/* ------------------------------------------------------------------ q8 */

/* u8 x s8 byte products summed into i32 lanes: maddubs to i16 pairs, madd to i32 */
#define AVX2_DOT4(acc, u, s) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
CK_DEFINE_Q8_I8_TILE(AVX2_INL, q8_i8_tile, AVX2_DOT4)

CK_DEFINE_Q8_I8(AVX2_FN, q8_i8, q8_i8_tile)

/* ------------------------------------------------------------------ q6, int8 act */

/* two maddubs (u8 value 0..63 x s8 activation) summed in i16 (<= 2 * 2 * 63 * 127 = 32004),
 * widened to i32 by one madd */
#define AVX2_DOT2(acc, lo, x0, hi, x1)                                                  \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_add_epi16(                         \
        _mm256_maddubs_epi16((lo), (x0)), _mm256_maddubs_epi16((hi), (x1))), _mm256_set1_epi16(1)))
CK_DEFINE_Q6_I8_TILE(AVX2_INL, q6_i8_tile, AVX2_DOT2)

CK_DEFINE_Q6_I8(AVX2_FN, q6_i8, q6_i8_tile)

AVX2_API void ck_avx2_q8_f32(const ck_q8 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0,
                             int nt, float *res) {
    for (int r = 0; r < rt; r++) {
        const int8_t *row = w->data + (r0 + r) * w->cp;
        for (int t = 0; t < nt; t++) {
            const float *xr = x->x + (t0 + t) * x->ld;
            __m256 facc = _mm256_setzero_ps();
            float tail = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                int64_t k = g * w->group, k1 = k + w->group < x->cols ? k + w->group : x->cols;
                __m256 gacc = _mm256_setzero_ps();
                float gtail = 0.0f;
                for (; k + 8 <= k1; k += 8) {
                    __m128i b8 = _mm_loadl_epi64((const __m128i *)(row + k));
                    __m256 wf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
                    gacc = _mm256_fmadd_ps(wf, _mm256_loadu_ps(xr + k), gacc);
                }
                for (; k < k1; k++) gtail += (float)row[k] * ck_ldf(xr + k);
                float sc = ck_ldf(w->scales + (r0 + r) * w->ng + g);
                facc = _mm256_fmadd_ps(gacc, _mm256_set1_ps(sc), facc);
                tail += gtail * sc;
            }
            res[r * nt + t] = hsum_ps(facc) + tail;
        }
    }
}

/* ------------------------------------------------------------------ attention */

/* exp(x) for a vector (Cephes-style range reduction and degree-5 polynomial, ~2 ulp);
 * NaN stays NaN (min/max return their second operand on NaN). */
AVX2_INL __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
    x = _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x);
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

AVX2_INL void softmax_row(float *row, int64_t len) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t p = 0;
    for (; p + 8 <= len; p += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(row + p));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float m = _mm_cvtss_f32(m4);
    for (; p < len; p++) m = row[p] > m ? row[p] : m;
    const __m256 mm = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (p = 0; p + 8 <= len; p += 8) {
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(row + p), mm));
        _mm256_storeu_ps(row + p, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum_ps(sv);
    for (; p < len; p++) sum += row[p] = expf(row[p] - m);
    const float inv = 1.0f / sum;
    const __m256 iv = _mm256_set1_ps(inv);
    for (p = 0; p + 8 <= len; p += 8) _mm256_storeu_ps(row + p, _mm256_mul_ps(_mm256_loadu_ps(row + p), iv));
    for (; p < len; p++) row[p] *= inv;
}

/* out[h0 + u] (u < HN) = sum_p s[h0 + u, p] * v_p: 16 columns of HN heads stay in
 * registers while the positions go by, so each value row is loaded once for the HN heads
 * (the first version reloaded and stored out[h] for every position and head). */
AVX2_INL void attn_values(const float *s, int h0, int64_t d, const float *v, int64_t ld,
                          int64_t len, float *out, const int HN) {
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
        __m256 acc[4][2];
#pragma GCC unroll 4
        for (int u = 0; u < HN; u++) acc[u][0] = acc[u][1] = _mm256_setzero_ps();
        for (int64_t p = 0; p < len; p++) {
            if (p + 8 < len) _mm_prefetch((const char *)(v + (p + 8) * ld + c), _MM_HINT_T0);
            __m256 v0 = _mm256_loadu_ps(v + p * ld + c), v1 = _mm256_loadu_ps(v + p * ld + c + 8);
#pragma GCC unroll 4
            for (int u = 0; u < HN; u++) {
                __m256 w = _mm256_set1_ps(s[(h0 + u) * len + p]);
                acc[u][0] = _mm256_fmadd_ps(w, v0, acc[u][0]);
                acc[u][1] = _mm256_fmadd_ps(w, v1, acc[u][1]);
            }
        }
#pragma GCC unroll 4
        for (int u = 0; u < HN; u++) {
            _mm256_storeu_ps(out + (h0 + u) * d + c, acc[u][0]);
            _mm256_storeu_ps(out + (h0 + u) * d + c + 8, acc[u][1]);
        }
    }
    for (; c < d; c++)                       /* d % 16 columns */
        for (int u = 0; u < HN; u++) {
            float a = 0.0f;
            for (int64_t p = 0; p < len; p++) a += s[(h0 + u) * len + p] * ck_ldf(v + p * ld + c);
            ck_stf(out + (h0 + u) * d + c, a);
        }
}

/* the g heads' softmax over their scores s [g, len], then out = s v in blocks of 4 heads
 * (ck_avx2_attn and ck_avx2_mla: v rows of d values, ld apart) */
AVX2_INL void softmax_values(float *s, int g, int64_t d, const float *v, int64_t ld,
                             int64_t len, float *out) {
    for (int h = 0; h < g; h++) softmax_row(s + h * len, len);
    for (int h0 = 0; h0 < g; h0 += 4) {
        switch (g - h0 < 4 ? g - h0 : 4) {
        case 4: attn_values(s, h0, d, v, ld, len, out, 4); break;
        case 3: attn_values(s, h0, d, v, ld, len, out, 3); break;
        case 2: attn_values(s, h0, d, v, ld, len, out, 2); break;
        default: attn_values(s, h0, d, v, ld, len, out, 1); break;
        }
    }
}

/* Scores: four heads sharing a key row are dotted with it together and reduced by one
 * hadd tree (a horizontal sum per head and position cost more than the dot itself). */
AVX2_API void ck_avx2_attn(const float *q, int g, int64_t d, const float *k, const float *v,
                           int64_t ld, int64_t len, float scale, float *s, float *out) {
    const int64_t d8 = d / 8 * 8;
    for (int64_t p = 0; p < len; p++) {
        const float *kr = k + p * ld;
        /* the cache rows of one kv head are ld floats apart and were evicted by the
         * weights streamed since the last token: fetch the row 8 positions ahead */
        if (p + 8 < len)
            for (int64_t i = 0; i < d; i += 16) _mm_prefetch((const char *)(kr + 8 * ld + i), _MM_HINT_T0);
        int h = 0;
        for (; h + 4 <= g; h += 4) {
            const float *qh = q + h * d;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < d8; i += 8) {
                __m256 kv = _mm256_loadu_ps(kr + i);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), kv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d + i), kv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 2 * d + i), kv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 3 * d + i), kv, a3);
            }
            __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            float dots[4];
            _mm_storeu_ps(dots, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
            for (int u = 0; u < 4; u++) {
                float dot = dots[u];
                for (int64_t i = d8; i < d; i++) dot += ck_ldf(qh + u * d + i) * ck_ldf(kr + i);
                s[(h + u) * len + p] = dot * scale;
            }
        }
        for (; h < g; h++) {
            const float *qh = q + h * d;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < d8; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(kr + i), acc);
            float dot = hsum_ps(acc);
            for (int64_t i = d8; i < d; i++) dot += ck_ldf(qh + i) * ck_ldf(kr + i);
            s[h * len + p] = dot * scale;
        }
    }
    softmax_values(s, g, d, v, ld, len, out);
}

/* MLA (ck_internal.h's `mla`): ck_avx2_attn's blocking, scores over latent c [r] + rope
 * key [R]; past g, a 4-head block reads the last head's rows again and drops their dots */
AVX2_API void ck_avx2_mla(const float *ql, const float *qp, int64_t ldq, int g, int64_t r, int64_t R,
                          const float *c, const float *kp, int64_t len, float scale, float *s, float *out) {
    const int64_t r8 = r / 8 * 8, R8 = R / 8 * 8;
    for (int64_t p = 0; p < len; p++) {
        const float *cr = c + p * r, *kr = kp + p * R;
        if (p + 4 < len)
            for (int64_t i = 0; i < r; i += 16) _mm_prefetch((const char *)(cr + 4 * r + i), _MM_HINT_T0);
        for (int h = 0; h < g; h += 4) {
            const float *q[4], *e[4];
            for (int u = 0; u < 4; u++) {
                const int hu = h + u < g ? h + u : g - 1;
                q[u] = ql + hu * r; e[u] = qp + hu * ldq;
            }
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t i = 0; i < r8; i += 8) {
                __m256 kv = _mm256_loadu_ps(cr + i);
                for (int u = 0; u < 4; u++) a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q[u] + i), kv, a[u]);
            }
            for (int64_t i = 0; i < R8; i += 8) {
                __m256 kv = _mm256_loadu_ps(kr + i);
                for (int u = 0; u < 4; u++) a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(e[u] + i), kv, a[u]);
            }
            __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            float dots[4];
            _mm_storeu_ps(dots, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
            for (int u = 0; u < 4 && h + u < g; u++) {
                float d = dots[u];
                for (int64_t i = r8; i < r; i++) d += ck_ldf(q[u] + i) * ck_ldf(cr + i);
                for (int64_t i = R8; i < R; i++) d += ck_ldf(e[u] + i) * ck_ldf(kr + i);
                s[(h + u) * len + p] = d * scale;
            }
        }
    }
    softmax_values(s, g, r, c, r, len, out);
}

/* ------------------------------------------------------------------ mxfp4, int8 act */

/* c + the integer dots of one 64-value step (ck_tiles.h's CK_DEFINE_MX_I8_TILE): unsigned
 * bytes <= 24 x int8; i16 sums of four products stay within 4 * 24 * 127 < 2^15 */
AVX2_INL __m256i mx_dotc(__m256i c, __m256i wa, __m256i xa, __m256i wb, __m256i xb) {
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(wa, xa), _mm256_maddubs_epi16(wb, xb));
    return _mm256_add_epi32(c, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

CK_DEFINE_MX_I8_TILE(AVX2_INL, mx_i8_tile, mx_dotc)

CK_DEFINE_MX_I8(AVX2_FN, mx_i8, mx_i8_tile, 2)

const ck_backend_t ck_backend_avx2 = {"avx2", ck_avx2_act_quant, q4_i8, ck_avx2_q4_f32, q8_i8,
                                     ck_avx2_q8_f32, q6_i8, ck_scalar_q6_f32, ck_avx2_attn,
                                     4, 4, .mx_i8 = mx_i8, .mla = ck_avx2_mla};

#else
typedef int ck_avx2_unused; /* not x86: nothing to compile here */
#endif
