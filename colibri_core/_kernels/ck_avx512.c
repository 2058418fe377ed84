/* ck_avx512.c -- AVX-512 VNNI tiles (Zen 4, Ice Lake and later), selected at run time
 * like ck_avx2.c: compiled without -m flags, every function carries a target attribute,
 * and ck_core.c picks this backend only if __builtin_cpu_supports reports all of them.
 *
 * Only the three int8 dot-product tiles (q4, q6, q8) change: vpdpbusd (u8 x s8, four
 * products summed straight into an i32 lane) replaces AVX2's maddubs -> i16 -> madd -> add
 * chain. The nibbles (0..15; q6 values 0..63) are the u8 operand and the activations the s8 one, as in AVX2;
 * everything else (activation quantization, float paths, attention) is the AVX2 code.
 * Only 256-bit vectors: Zen 4 runs a 512-bit op as two 256-bit halves, and a zmm q4 tile
 * (one dpbusd per 64-value block on a broadcast of its 32 bytes, high half shifted)
 * measured no faster than AVX2, against 1.15-1.4x for the ymm tile below (in cache).
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
    const __m256i m4 = _mm256_set1_epi8(0x0F);
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
                    hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
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
                __m256i h = _mm256_hadd_epi32(
                    _mm256_hadd_epi32(_mm256_add_epi32(ilo[k], ihi[k]),
                                      _mm256_add_epi32(ilo[k + 1], ihi[k + 1])),
                    _mm256_hadd_epi32(_mm256_add_epi32(ilo[k + 2], ihi[k + 2]),
                                      _mm256_add_epi32(ilo[k + 3], ihi[k + 3])));
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

const ck_backend_t ck_backend_avx512vnni = {
    "avx512vnni", ck_avx2_act_quant, q4_i8, ck_avx2_q4_f32, q8_i8, ck_avx2_q8_f32,
    q6_i8, ck_scalar_q6_f32, ck_avx2_attn, 4, 4,
};

#else
typedef int ck_avx512_unused; /* not x86: nothing to compile here */
#endif
