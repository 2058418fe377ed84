/* ck_q5.c -- the q5 tiles (CK_W_Q5, docs/FORMAT.md `q5`; colibri_core/format/q5.py is the
 * numpy reference): 5-bit asymmetric groups, per 64-value block q4's 32 bytes of nibbles
 * (byte j: value j low, value 32+j high) then 8 bytes of fifth bits (byte i: values i,
 * 8+i, .., 56+i in bits 0..7). The pipeline step runs them through ck_step.h's mat_tile.
 *
 * int8 activations: an exact integer dot per group, corrected by the zero point times the
 * activation group's sum, then one float multiply-add per group. The scalar tile (every
 * backend but AVX2 / AVX-512) adds the groups in ascending order as ck_scalar.c's q4_i8;
 * the AVX2 tile (run by the AVX2 and AVX-512 backends alike: the same bits) is ck_tiles.h's
 * q6 tile with q5's unpacking, and its float epilogue q4_dot_pass's: the q4 and q6 tiles'
 * order for every tile shape (batch invariance), within float rounding of the scalar one.
 * Float activations (the parity path): a scalar tile on every backend, as ck_scalar_q6_f32. */
#include <stdlib.h>
#include "ck_internal.h"

#define Q5_BLOCK 40   /* bytes per 64 values */

static inline uint64_t ld64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* value k (0 <= k < cp) of a q5 row */
static inline int q5_at(const uint8_t *row, int64_t k) {
    const uint8_t *blk = row + (k >> 6) * Q5_BLOCK;
    const int j = (int)(k & 63);
    const int lo = (j & 32) ? blk[j & 31] >> 4 : blk[j & 31] & 15;
    return lo | ((blk[32 + (j & 7)] >> (j >> 3)) & 1) << 4;
}

/* the integer dot of q5 block `blk` with 64 int8 activations */
static inline int32_t block_dot_scalar(const uint8_t *blk, const int8_t *x) {
    int32_t dot = 0;
    for (int j = 0; j < 32; j++) {
        const int h = blk[32 + (j & 7)];
        dot += ((blk[j] & 15) | ((h >> (j >> 3)) & 1) << 4) * x[j] +
               ((blk[j] >> 4) | ((h >> (4 + (j >> 3))) & 1) << 4) * x[32 + j];
    }
    return dot;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include "ck_tiles.h"

#define Q5_FN static __attribute__((target("avx2,fma")))
#define Q5_INL static inline __attribute__((target("avx2,fma"), always_inline))
#define CK_PF_BYTES 8192   /* as ck_avx2.c: software prefetch distance past the tile */

Q5_INL float hsum_ps(__m256 v) {          /* ck_avx2.c's order */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

CK_DEFINE_Q4_DOT_PASS(Q5_INL)

/* RT rows x NT tokens of a q5 matrix: ck_tiles.h's q6 tile with q5's unpacking (values
 * 0..31: two maddubs sum to at most 4 * 31 * 127 in i16), the groups' integer dots then
 * q4_dot_pass, the q4 / q6 tiles' float epilogue (so AVX2 and AVX-512 give the same bits) */
Q5_INL void q5_i8_tile(const ck_q4 *w, int64_t r0, const ck_act *a, int64_t t0, float *res,
                       int ldr, const int RT, const int NT) {
    const int K = RT * NT, K4 = (K + 3) / 4 * 4;
    const int64_t rb = w->cp / 64 * Q5_BLOCK, ng = w->ng, bpg = w->group / 64;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m5 = _mm256_set1_epi8(0x10), one = _mm256_set1_epi16(1);
    /* 64-bit lane L of a block's 8 fifth-bit bytes, broadcast: values 8L+i take bit L of
     * byte i (shift left 4 - L), values 32+8L+i bit 4+L (shift right L) */
    const __m256i shl = _mm256_setr_epi64x(4, 3, 2, 1), shr = _mm256_setr_epi64x(0, 1, 2, 3);
    const uint8_t *wr = w->data + r0 * rb;
    const int8_t *xr = a->q + t0 * a->cp;
    const int64_t pf = RT * rb + CK_PF_BYTES;
    int32_t dq[2][CK_GCHUNK][4];
    float acc[8];
    for (int k = 0; k < K; k++) acc[k] = 0.0f;
    for (int64_t gc = 0; gc < ng; gc += CK_GCHUNK) {
        const int gn = ng - gc < CK_GCHUNK ? (int)(ng - gc) : CK_GCHUNK;
        for (int gi = 0; gi < gn; gi++) {
            const int64_t g = gc + gi;
            __m256i iacc[8];
            for (int k = 0; k < K4; k++) iacc[k] = _mm256_setzero_si256();
            for (int64_t j = 0; j < bpg; j++) {
                const int64_t b = g * bpg + j;
                __m256i lo[CK_MAX_RT], hi[CK_MAX_RT];
                for (int r = 0; r < RT; r++) {
                    const uint8_t *p = wr + r * rb + b * Q5_BLOCK;
                    _mm_prefetch((const char *)(p + pf), _MM_HINT_T1);
                    const __m256i ql = _mm256_loadu_si256((const __m256i *)p);
                    const __m256i h = _mm256_set1_epi64x((long long)ld64(p + 32));
                    lo[r] = _mm256_or_si256(_mm256_and_si256(ql, m4),
                                            _mm256_and_si256(_mm256_sllv_epi64(h, shl), m5));
                    hi[r] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), m4),
                                            _mm256_and_si256(_mm256_srlv_epi64(h, shr), m5));
                }
                for (int t = 0; t < NT; t++) {
                    const int8_t *xp = xr + t * a->cp + b * 64;
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + 32));
                    for (int r = 0; r < RT; r++)
                        iacc[r * NT + t] = _mm256_add_epi32(iacc[r * NT + t], _mm256_madd_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], x0),
                                             _mm256_maddubs_epi16(hi[r], x1)), one));
                }
            }
            for (int k = 0; k < K4; k += 4) {
                __m256i hs = _mm256_hadd_epi32(_mm256_hadd_epi32(iacc[k], iacc[k + 1]),
                                               _mm256_hadd_epi32(iacc[k + 2], iacc[k + 3]));
                _mm_storeu_si128((__m128i *)dq[k / 4][gi], _mm_add_epi32(
                    _mm256_castsi256_si128(hs), _mm256_extracti128_si256(hs, 1)));
            }
        }
        q4_dot_pass(w, r0, a, t0, dq, gc, gn, acc, K, NT);
    }
    for (int k = 0; k < K; k++) res[(k / NT) * ldr + k % NT] = acc[k];
}

/* the q6 dispatch's shapes: decode 4 rows x 1 token, batches 1 row x up to 4 tokens */
CK_DEFINE_Q6_I8(Q5_FN, q5_i8_avx2, q5_i8_tile)
#endif

/* groups g0..g1 of rows row[0..3] (gb blocks of 64 each) against xq: dots[g - g0][i] */
static void group_dots(const uint8_t *const row[4], const int8_t *xq, int64_t g0, int64_t g1,
                       int64_t gb, int32_t (*dots)[4]) {
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
    if (be == &ck_backend_avx2 || be == &ck_backend_avx512vnni) {
        q5_i8_avx2(w, r0, rt, a, t0, nt, res);
        return;
    }
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
                group_dots(row, xq, g0, g1, gb, dots);
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
