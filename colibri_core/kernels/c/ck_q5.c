/* ck_q5.c -- the q5 tiles (CK_W_Q5, docs/FORMAT.md `q5`; colibri_core/format/q5.py is the
 * numpy reference): 5-bit asymmetric groups, per 64-value block q4's 32 bytes of nibbles
 * (byte j: value j low, value 32+j high) then the 64 values' fifth bits as one
 * little-endian 64-bit mask. The pipeline step runs them through ck_step.h's mat_tile.
 *
 * int8 activations: q4_i8's arithmetic (an exact integer dot per group, corrected by the
 * zero point times the activation group's sum, then one float multiply-add per group in
 * ascending order). The AVX2 and AVX-512 VNNI tiles compute the same integer dots, then the
 * same scalar float pass, so every backend's results are equal bit for bit (the
 * backend picked by ck_set_backend / COLIBRI_KERNELS decides which runs). Float
 * activations (the parity path): a scalar tile on every backend, as ck_scalar_q6_f32. */
#include <stdlib.h>
#include "ck_internal.h"

#define Q5_BLOCK 40   /* bytes per 64 values */

static inline uint64_t ld64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* value k (0 <= k < cp) of a q5 row */
static inline int q5_at(const uint8_t *row, int64_t k) {
    const uint8_t *blk = row + (k >> 6) * Q5_BLOCK;
    const int j = (int)(k & 63);
    const int lo = (j & 32) ? blk[j & 31] >> 4 : blk[j & 31] & 15;
    return lo | (int)((ld64(blk + 32) >> j) & 1) << 4;
}

/* the integer dot of q5 block `blk` with 64 int8 activations */
static inline int32_t block_dot_scalar(const uint8_t *blk, const int8_t *x) {
    const uint64_t h = ld64(blk + 32);
    int32_t dot = 0;
    for (int j = 0; j < 32; j++)
        dot += ((blk[j] & 15) | (int)((h >> j) & 1) << 4) * x[j] +
               ((blk[j] >> 4) | (int)((h >> (32 + j)) & 1) << 4) * x[32 + j];
    return dot;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define AVX2_FN static __attribute__((target("avx2,fma")))

/* 32 mask bits -> 32 bytes, 0x10 where the bit is set */
AVX2_FN inline __m256i fifth_bits(uint32_t m) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* the integer dots of four rows' groups (nblocks blocks of 64 each, rows at blk[i]) with
 * the same 64 * nblocks int8 activations: the activations loaded once for the four rows,
 * the four horizontal sums done together */
AVX2_FN inline void group_dot4_avx2(const uint8_t *const blk[4], const int8_t *x, int64_t nblocks,
                                    int32_t out[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                      _mm256_setzero_si256()};
    for (int64_t b = 0; b < nblocks; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + b * 64));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + b * 64 + 32));
        for (int i = 0; i < 4; i++) {
            const uint8_t *bp = blk[i] + b * Q5_BLOCK;
            const __m256i v = _mm256_loadu_si256((const __m256i *)bp);
            const uint64_t h = ld64(bp + 32);
            const __m256i q0 = _mm256_or_si256(_mm256_and_si256(v, low), fifth_bits((uint32_t)h));
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                               fifth_bits((uint32_t)(h >> 32)));
            /* values 0..31 times int8: a pair sums to at most 2 * 31 * 127, and p0 + p1 to
             * 4 * 31 * 127 = 15748: within int16 */
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(q0, x0),
                                               _mm256_maddubs_epi16(q1, x1));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, ones));
        }
    }
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]),
                                        _mm256_hadd_epi32(acc[2], acc[3]));
    const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    _mm_storeu_si128((__m128i *)out, t);
}

/* the same with AVX-512 VNNI: a block's 64 values in one register (the nibbles' two
 * halves side by side, the fifth bits set from the 64-bit mask as a byte mask), one
 * dpbusd per row and block */
#define Q5_VNNI static __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
Q5_VNNI inline void group_dot4_vnni(const uint8_t *const blk[4], const int8_t *x, int64_t nblocks,
                                    int32_t out[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m512i five = _mm512_set1_epi8(0x10);
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    for (int64_t b = 0; b < nblocks; b++) {
        const __m512i xv = _mm512_loadu_si512((const void *)(x + b * 64));
        for (int i = 0; i < 4; i++) {
            const uint8_t *bp = blk[i] + b * Q5_BLOCK;
            const __m256i v = _mm256_loadu_si256((const __m256i *)bp);
            const __m512i lohi = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_and_si256(v, low)),
                _mm256_and_si256(_mm256_srli_epi16(v, 4), low), 1);
            const __m512i q = _mm512_or_si512(lohi, _mm512_maskz_mov_epi8(ld64(bp + 32), five));
            acc[i] = _mm512_dpbusd_epi32(acc[i], q, xv);
        }
    }
    __m256i h[4];
    for (int i = 0; i < 4; i++)
        h[i] = _mm256_add_epi32(_mm512_castsi512_si256(acc[i]), _mm512_extracti64x4_epi64(acc[i], 1));
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(h[0], h[1]), _mm256_hadd_epi32(h[2], h[3]));
    _mm_storeu_si128((__m128i *)out, _mm_add_epi32(_mm256_castsi256_si128(s),
                                                   _mm256_extracti128_si256(s, 1)));
}
/* groups g0..g1 of four rows (row[i]) against one token's activations xq: dots[g - g0][i];
 * one call per row quad and token, the group loop inside the target function */
AVX2_FN void groups4_avx2(const uint8_t *const row[4], const int8_t *xq, int64_t g0, int64_t g1,
                          int64_t gb, int32_t (*dots)[4]) {
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *blk[4] = {row[0] + g * gb * Q5_BLOCK, row[1] + g * gb * Q5_BLOCK,
                                 row[2] + g * gb * Q5_BLOCK, row[3] + g * gb * Q5_BLOCK};
        group_dot4_avx2(blk, xq + g * gb * 64, gb, dots[g - g0]);
    }
}

Q5_VNNI void groups4_vnni(const uint8_t *const row[4], const int8_t *xq, int64_t g0, int64_t g1,
                          int64_t gb, int32_t (*dots)[4]) {
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t *blk[4] = {row[0] + g * gb * Q5_BLOCK, row[1] + g * gb * Q5_BLOCK,
                                 row[2] + g * gb * Q5_BLOCK, row[3] + g * gb * Q5_BLOCK};
        group_dot4_vnni(blk, xq + g * gb * 64, gb, dots[g - g0]);
    }
}
#endif

/* groups g0..g1 of rows row[0..3] (nblocks = gb blocks of 64 each) against xq: dots[g - g0][i];
 * simd 1: AVX2, 2: AVX-512 VNNI (the backends of those names) */
static void group_dots(int simd, const uint8_t *const row[4], const int8_t *xq, int64_t g0,
                       int64_t g1, int64_t gb, int32_t (*dots)[4]) {
#if defined(__x86_64__) || defined(__i386__)
    if (simd == 2) { groups4_vnni(row, xq, g0, g1, gb, dots); return; }
    if (simd) { groups4_avx2(row, xq, g0, g1, gb, dots); return; }
#endif
    (void)simd;
    for (int64_t g = g0; g < g1; g++)
        for (int i = 0; i < 4; i++) {
            int32_t dot = 0;
            for (int64_t b = g * gb; b < (g + 1) * gb; b++)
                dot += block_dot_scalar(row[i] + b * Q5_BLOCK, xq + b * 64);
            dots[g - g0][i] = dot;
        }
}

#define Q5_GROUPS 256   /* groups per group_dots call (a stack buffer of 4 KiB) */

void ck_q5_i8(const ck_q4 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
              float *res) {
#if defined(__x86_64__) || defined(__i386__)
    const ck_backend_t *be = ck_active_backend();
    const int simd = be == &ck_backend_avx512vnni ? 2 : be == &ck_backend_avx2;
#else
    const int simd = 0;
#endif
    const int64_t rb = w->cp / 64 * Q5_BLOCK, gb = w->group / 64;
    for (int r1 = 0; r1 < rt; r1 += 4) {              /* four rows at a time (the last */
        const int m = rt - r1 < 4 ? rt - r1 : 4;      /* repeated past rt, unused) */
        const uint8_t *row[4];
        for (int i = 0; i < 4; i++) row[i] = w->data + (r0 + r1 + (i < m ? i : m - 1)) * rb;
        for (int t = 0; t < nt; t++) {
            const int8_t *xq = a->q + (t0 + t) * a->cp;
            const float *xs = a->s + (t0 + t) * a->ng;
            const int32_t *xsum = a->sum + (t0 + t) * a->ng;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int32_t dots[Q5_GROUPS][4];
            for (int64_t g0 = 0; g0 < w->ng; g0 += Q5_GROUPS) {
                const int64_t g1 = g0 + Q5_GROUPS < w->ng ? g0 + Q5_GROUPS : w->ng;
                group_dots(simd, row, xq, g0, g1, gb, dots);
                /* the four rows' sums interleaved (each its groups in ascending order):
                 * four independent chains of float adds */
                for (int64_t g = g0; g < g1; g++) {
                    const int32_t xsg = ck_ldi(xsum + g);
                    const float xsc = ck_ldf(xs + g);
                    for (int i = 0; i < m; i++) {
                        const int64_t k = (r0 + r1 + i) * w->ng + g;
                        const int32_t corr = dots[g - g0][i] - (int32_t)w->zeros[k] * xsg;
                        acc[i] += (float)corr * (ck_ldf(w->scales + k) * xsc);
                    }
                }
            }
            for (int i = 0; i < m; i++) res[(r1 + i) * nt + t] = acc[i];
        }
    }
}

void ck_q5_f32(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
               float *res) {
    const int64_t rb = w->cp / 64 * Q5_BLOCK;
    for (int r = 0; r < rt; r++) {
        const uint8_t *row = w->data + (r0 + r) * rb;
        const float *sc = w->scales + (r0 + r) * w->ng;
        const uint8_t *zp = w->zeros + (r0 + r) * w->ng;
        for (int t = 0; t < nt; t++) {
            const float *xr = x->x + (t0 + t) * x->ld;
            float acc = 0.0f;
            for (int64_t g = 0; g < w->ng; g++) {
                const int64_t k1 = (g + 1) * w->group < w->cols ? (g + 1) * w->group : w->cols;
                const float z = (float)zp[g];
                float gacc = 0.0f;
                for (int64_t k = g * w->group; k < k1; k++)
                    gacc += ((float)q5_at(row, k) - z) * ck_ldf(xr + k);
                acc += gacc * ck_ldf(sc + g);
            }
            res[r * nt + t] = acc;
        }
    }
}

/* Tests and benchmarks (ck.h): out [n, rows] = x [n, cols] @ W^T for a q5 matrix, one
 * thread, through the tiles above (int8: x quantized per group of W by ck_act_quantize). */
int ck_q5_matmul(const ck_mat *m, const float *x, int64_t n, float *out, int act_int8) {
    if (m->kind != CK_W_Q5 || m->group <= 0 || m->group % 64) return -1;
    const int64_t cp = (m->cols + m->group - 1) / m->group * m->group, ng = cp / m->group;
    const ck_q4 w = {m->data, m->scales, m->zeros, m->rows, m->cols, m->group, cp, ng};
    int8_t *xq = NULL; float *xs = NULL, *xf = NULL; int32_t *xsum = NULL;
    if (act_int8) {
        xq = malloc((size_t)(n * cp)); xs = malloc((size_t)(n * ng) * 4);
        xsum = malloc((size_t)(n * ng) * 4);
        if (!xq || !xs || !xsum) { free(xq); free(xs); free(xsum); return -1; }
        ck_act_quantize(x, n, m->cols, m->group, xq, xs, xsum);
    } else {                        /* rows readable up to cp (ck_xf), zero padded */
        xf = calloc((size_t)(n * cp), 4);
        if (!xf) return -1;
        for (int64_t t = 0; t < n; t++) memcpy(xf + t * cp, x + t * m->cols, (size_t)m->cols * 4);
    }
    const ck_act a = {xq, xs, xsum, cp, ng};
    const ck_xf f = {xf, cp, m->cols, NULL};
    float res[CK_MAX_RT];
    for (int64_t t = 0; t < n; t++)
        for (int64_t r0 = 0; r0 < m->rows; r0 += CK_MAX_RT) {
            const int rt = (int)(m->rows - r0 < CK_MAX_RT ? m->rows - r0 : CK_MAX_RT);
            if (act_int8) ck_q5_i8(&w, r0, rt, &a, t, 1, res);
            else ck_q5_f32(&w, r0, rt, &f, t, 1, res);
            for (int r = 0; r < rt; r++) out[t * m->rows + r0 + r] = res[r];
        }
    free(xq); free(xs); free(xsum); free(xf);
    return 0;
}
