/* ck_tiles.h -- the tile-shape dispatch shared by the SIMD backends (ck_avx2.c,
 * ck_avx512.c). Each backend instantiates it in its own file, under its own target
 * attributes, so that its tile functions are inlined there:
 *
 *   CK_DEFINE_Q4_I8(ATTR, name, tile): tile(w, r0, a, t0, res, ldr, RT, NT, BPG) computes
 *     RT rows x NT tokens of a q4 matrix (BPG: 64-blocks per group when known at compile
 *     time, 2 or 1, else 0). Decode (nt == 1) runs 4 rows at a time, sharing the
 *     activation loads; batches run 1 row x up to 4 tokens, sharing each unpacked weight
 *     vector (measured faster than 2x4, 2x2 and 4x2 tiles, which spill registers).
 *     From ck_panel_min_tokens tokens the step and ck_matmul run the AVX-512 backend's
 *     panels instead (ck_avx512.c), which give these tiles' bits.
 *   CK_DEFINE_Q8_I8(ATTR, name, tile): tile(w, r0, xr, xs, res, ldr, RT) computes RT rows
 *     of a q8 matrix against one token's activations; tokens go one by one.
 *   CK_DEFINE_Q6_I8_TILE / CK_DEFINE_Q6_I8: the q6 tile (below) and its dispatch, in the
 *     q4 shapes (4 rows x 1 token for decode, 1 row x up to 4 tokens for batches). */
#ifndef COLIBRI_CK_TILES_H
#define COLIBRI_CK_TILES_H

/* CK_DEFINE_Q4_DOT_PASS(INL): the two q4 int8 tiles' shared second half.
 * - transpose_8x4: dq 8 groups x 4 dots, [group][dot] -> col[j] = dot j of the 8 groups.
 *   The tiles store each group's 4 dots as 16 bytes and transpose them in registers:
 *   4-byte stores read back as one 32-byte load cannot be store-forwarded, and stalled
 *   once per row and token of a tile.
 * - q4_dot_pass: acc[k] += sum_g sw[g]*xs[g]*(dot[g] - z[g]*xsum[g]) for the K = RT*NT
 *   (row, token) pairs of a tile over a chunk of gn groups starting at gc, with the
 *   zero-point correction in exact integer math (as quant.matvec_q4_q8_ref), 8 groups per
 *   step and then a scalar tail of fmas. One order for every backend: bit-identical
 *   floats (ck_avx512.c's q4_panels runs the same order with tokens in lanes).
 * Needs CK_GCHUNK and hsum_ps. */
#define CK_GCHUNK 32   /* groups whose integer dots are buffered before the float pass */

#define CK_DEFINE_Q4_DOT_PASS(INL)                                                      \
    INL void transpose_8x4(const int32_t (*dq)[4], __m256i col[4]) {                    \
        const __m256i r04 = _mm256_inserti128_si256(_mm256_castsi128_si256(             \
            _mm_loadu_si128((const __m128i *)dq[0])), _mm_loadu_si128((const __m128i *)dq[4]), 1); \
        const __m256i r15 = _mm256_inserti128_si256(_mm256_castsi128_si256(             \
            _mm_loadu_si128((const __m128i *)dq[1])), _mm_loadu_si128((const __m128i *)dq[5]), 1); \
        const __m256i r26 = _mm256_inserti128_si256(_mm256_castsi128_si256(             \
            _mm_loadu_si128((const __m128i *)dq[2])), _mm_loadu_si128((const __m128i *)dq[6]), 1); \
        const __m256i r37 = _mm256_inserti128_si256(_mm256_castsi128_si256(             \
            _mm_loadu_si128((const __m128i *)dq[3])), _mm_loadu_si128((const __m128i *)dq[7]), 1); \
        const __m256i t0 = _mm256_unpacklo_epi32(r04, r15), t1 = _mm256_unpacklo_epi32(r26, r37); \
        const __m256i t2 = _mm256_unpackhi_epi32(r04, r15), t3 = _mm256_unpackhi_epi32(r26, r37); \
        col[0] = _mm256_unpacklo_epi64(t0, t1);                                         \
        col[1] = _mm256_unpackhi_epi64(t0, t1);                                         \
        col[2] = _mm256_unpacklo_epi64(t2, t3);                                         \
        col[3] = _mm256_unpackhi_epi64(t2, t3);                                         \
    }                                                                                   \
    INL void q4_dot_pass(const ck_q4 *w, int64_t r0, const ck_act *a, int64_t t0,       \
                         int32_t (*dq)[CK_GCHUNK][4], int64_t gc, int gn, float *acc,   \
                         const int K, const int NT) {                                   \
        const int K4 = (K + 3) / 4 * 4;                                                 \
        const int64_t ng = w->ng;                                                       \
        _Pragma("GCC unroll 2")                                                         \
        for (int q = 0; q < K4 / 4; q++) {                                              \
            const int nk = K - 4 * q < 4 ? K - 4 * q : 4;                               \
            __m256 facc[4];                                                             \
            _Pragma("GCC unroll 4")                                                     \
            for (int j = 0; j < nk; j++) facc[j] = _mm256_setzero_ps();                 \
            int g = 0;                                                                  \
            for (; g + 8 <= gn; g += 8) {                                               \
                __m256i col[4];                                                         \
                transpose_8x4(dq[q] + g, col);                                          \
                _Pragma("GCC unroll 4")                                                 \
                for (int j = 0; j < nk; j++) {                                          \
                    const int k = 4 * q + j;                                            \
                    const int64_t wo = (r0 + k / NT) * ng + gc + g;                     \
                    const int64_t ao = (t0 + k % NT) * a->ng + gc + g;                  \
                    __m256i zz = _mm256_cvtepu8_epi32(                                  \
                        _mm_loadl_epi64((const __m128i *)(w->zeros + wo)));             \
                    __m256i d = _mm256_sub_epi32(col[j], _mm256_mullo_epi32(            \
                        zz, _mm256_loadu_si256((const __m256i *)(a->sum + ao))));       \
                    __m256 c = _mm256_mul_ps(_mm256_loadu_ps(w->scales + wo),           \
                                             _mm256_loadu_ps(a->s + ao));               \
                    facc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), c, facc[j]);       \
                }                                                                       \
            }                                                                           \
            _Pragma("GCC unroll 4")                                                     \
            for (int j = 0; j < nk; j++) {                                              \
                const int k = 4 * q + j;                                                \
                const int64_t wo = (r0 + k / NT) * ng + gc, ao = (t0 + k % NT) * a->ng + gc; \
                const uint8_t *z = w->zeros + wo;                                       \
                const float *sw = w->scales + wo, *xs = a->s + ao;                      \
                const int32_t *xsum = a->sum + ao;                                      \
                float tail = 0.0f;                                                      \
                for (int gg = g; gg < gn; gg++)   /* one fma each (q4_panels' order) */ \
                    tail = __builtin_fmaf((float)(dq[q][gg][j] - (int32_t)z[gg] *       \
                                              ck_ldi(xsum + gg)),                       \
                                          ck_ldf(sw + gg) * ck_ldf(xs + gg), tail);     \
                acc[k] += hsum_ps(facc[j]) + tail;                                      \
            }                                                                           \
        }                                                                               \
    }

#define CK_Q4_TILE_(TILE, RT, NT)                                                       \
    do {                                                                                \
        if (bpg == 2) TILE(w, r0 + r, a, t0, res + r * nt, nt, RT, NT, 2);              \
        else if (bpg == 1) TILE(w, r0 + r, a, t0, res + r * nt, nt, RT, NT, 1);         \
        else TILE(w, r0 + r, a, t0, res + r * nt, nt, RT, NT, 0);                       \
    } while (0)

#define CK_DEFINE_Q4_I8(ATTR, NAME, TILE)                                               \
    ATTR void NAME(const ck_q4 *w, int64_t r0, int rt, const ck_act *a, int64_t t0,     \
                   int nt, float *res) {                                                \
        const int64_t bpg = w->group / 64;                                              \
        if (nt == 1) {                                                                  \
            const int r = 0;                                                            \
            switch (rt) {                                                               \
            case 4: CK_Q4_TILE_(TILE, 4, 1); break;                                     \
            case 3: CK_Q4_TILE_(TILE, 3, 1); break;                                     \
            case 2: CK_Q4_TILE_(TILE, 2, 1); break;                                     \
            default: CK_Q4_TILE_(TILE, 1, 1); break;                                    \
            }                                                                           \
            return;                                                                     \
        }                                                                               \
        for (int r = 0; r < rt; r++) {                                                  \
            switch (nt) {                                                               \
            case 4: CK_Q4_TILE_(TILE, 1, 4); break;                                     \
            case 3: CK_Q4_TILE_(TILE, 1, 3); break;                                     \
            default: CK_Q4_TILE_(TILE, 1, 2); break;                                    \
            }                                                                           \
        }                                                                               \
    }

#define CK_DEFINE_Q8_I8(ATTR, NAME, TILE)                                               \
    ATTR void NAME(const ck_q8 *w, int64_t r0, int rt, const ck_act *a, int64_t t0,     \
                   int nt, float *res) {                                                \
        for (int t = 0; t < nt; t++) {                                                  \
            const int8_t *xr = a->q + (t0 + t) * a->cp;                                 \
            const float *xs = a->s + (t0 + t) * a->ng;                                  \
            switch (rt) {                                                               \
            case 4: TILE(w, r0, xr, xs, res + t, nt, 4); break;                         \
            case 3: TILE(w, r0, xr, xs, res + t, nt, 3); break;                         \
            case 2: TILE(w, r0, xr, xs, res + t, nt, 2); break;                         \
            default: TILE(w, r0, xr, xs, res + t, nt, 1); break;                        \
            }                                                                           \
        }                                                                               \
    }

/* CK_DEFINE_Q8_I8_TILE(ATTR, name, DOT): the q8 tile, RT rows side by side sharing each
 * activation load, with the q4 tiles' software prefetch (one row at a time without it ran
 * at ~9 GB/s from DRAM on one core). s8 x s8 goes through the u8 x s8 instructions as
 * |w| times x with w's sign (pairs <= 2*128*127 < 2^15); DOT(acc, u8, s8) adds the four
 * byte products of each i32 lane to acc (AVX2: maddubs + madd; VNNI: dpbusd -- the same
 * integers, so the float epilogue (8 lanes, one fmadd per group, then the horizontal sum)
 * gives identical results). Needs hsum_ps and CK_PF_BYTES from the including file. */
#define CK_DEFINE_Q8_I8_TILE(ATTR, NAME, DOT)                                           \
    ATTR void NAME(const ck_q8 *w, int64_t r0, const int8_t *xr, const float *xs,       \
                   float *res, int ldr, const int RT) {                                 \
        const int64_t cp = w->cp, ng = w->ng, G = w->group;                             \
        const int8_t *row = w->data + r0 * cp;                                          \
        const int64_t pf = RT * cp + CK_PF_BYTES;                                       \
        __m256 facc[CK_MAX_RT];                                                         \
        _Pragma("GCC unroll 4")                                                         \
        for (int r = 0; r < RT; r++) facc[r] = _mm256_setzero_ps();                     \
        for (int64_t g = 0; g < ng; g++) {                                              \
            __m256i iacc[CK_MAX_RT];                                                    \
            _Pragma("GCC unroll 4")                                                     \
            for (int r = 0; r < RT; r++) iacc[r] = _mm256_setzero_si256();              \
            for (int64_t k = g * G; k < (g + 1) * G; k += 32) {                         \
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + k));             \
                _Pragma("GCC unroll 4")                                                 \
                for (int r = 0; r < RT; r++) {                                          \
                    if (!(k & 63))                                                      \
                        _mm_prefetch((const char *)(row + r * cp + k + pf), _MM_HINT_T1); \
                    __m256i wv = _mm256_loadu_si256((const __m256i *)(row + r * cp + k)); \
                    iacc[r] = DOT(iacc[r], _mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)); \
                }                                                                       \
            }                                                                           \
            _Pragma("GCC unroll 4")                                                     \
            for (int r = 0; r < RT; r++) {                                              \
                float c = ck_ldf(w->scales + (r0 + r) * ng + g) * ck_ldf(xs + g);       \
                facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r]), _mm256_set1_ps(c), \
                                          facc[r]);                                     \
            }                                                                           \
        }                                                                               \
        _Pragma("GCC unroll 4")                                                         \
        for (int r = 0; r < RT; r++) res[r * ldr] = hsum_ps(facc[r]);                   \
    }

/* CK_DEFINE_Q6_I8_TILE(INL, NAME, DOT2): RT rows x NT tokens of a q6 matrix (ck_internal.h,
 * docs/FORMAT.md), the q4 tile's structure: per 64-value block each row's 48 bytes are
 * unpacked to two vectors of 32 values 0..63 (values 0..31 and 32..63: the low nibbles as
 * q4's, OR'd with the top two bits, which sit in the block's last 16 bytes, broadcast to
 * both lanes and moved into bits 4-5 by one variable shift per half (sllv / srlv by
 * 32-bit lane: a shift below 8 moves each byte's own bits, and the mask drops the rest):
 * values j < 16 / 16 <= j < 32 of either half take bits 2*(j/16) of byte j % 16, shifts
 * 4 / 2 for the low half, 0 / -2 for the high half; measured 1.3x over two shifts and a
 * blend per half, one AVX2 thread, matrix in cache);
 * DOT2(acc, lo, x0, hi, x1) adds the byte products lo*x0 + hi*x1 to the i32 lanes of acc
 * (AVX2: two maddubs, |pair| <= 2 * 63 * 127, their i16 sum <= 32004, then one madd; VNNI:
 * two dpbusd -- the same integers). Each group's dots go through q4_dot_pass: the
 * zero-point correction and float epilogue of the q4 tiles, so every backend that shares
 * it gives the same floats. One prefetch per block `pf` bytes ahead (48-byte blocks: every
 * 64-byte line gets at least one). The row streams once: one part, 48 bytes per block.
 * Needs CK_PF_BYTES, hsum_ps and CK_DEFINE_Q4_DOT_PASS's q4_dot_pass. */
#define CK_DEFINE_Q6_I8_TILE(INL, NAME, DOT2)                                            \
    INL void NAME(const ck_q6 *w, int64_t r0, const ck_act *a, int64_t t0, float *res,   \
                  int ldr, const int RT, const int NT) {                                 \
        const int K = RT * NT, K4 = (K + 3) / 4 * 4;                                     \
        const int64_t rb = w->cp / 64 * CK_Q6_BLOCK, ng = w->ng, bpg = w->group / 64;    \
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);         \
        /* per 128-bit lane: values 0..15 / 16..31 take bits 0-1 / 2-3 (shift left 4 / 2), \
         * values 32..47 / 48..63 bits 4-5 / 6-7 (shift right 0 / 2) */                 \
        const __m256i shl = _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2);                   \
        const __m256i shr = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);                   \
        const uint8_t *wr = w->data + r0 * rb;                                           \
        const int8_t *xr = a->q + t0 * a->cp;                                            \
        const int64_t pf = RT * rb + CK_PF_BYTES;                                        \
        int32_t dq[2][CK_GCHUNK][4];                                                     \
        float acc[8];                                                                    \
        _Pragma("GCC unroll 8")                                                          \
        for (int k = 0; k < K; k++) acc[k] = 0.0f;                                       \
        for (int64_t gc = 0; gc < ng; gc += CK_GCHUNK) {                                 \
            const int gn = ng - gc < CK_GCHUNK ? (int)(ng - gc) : CK_GCHUNK;             \
            for (int gi = 0; gi < gn; gi++) {                                            \
                const int64_t g = gc + gi;                                               \
                __m256i iacc[8];                                                         \
                _Pragma("GCC unroll 8")                                                  \
                for (int k = 0; k < K4; k++) iacc[k] = _mm256_setzero_si256();           \
                _Pragma("GCC unroll 2")                                                  \
                for (int64_t j = 0; j < bpg; j++) {                                      \
                    const int64_t b = g * bpg + j;                                       \
                    __m256i lo[CK_MAX_RT], hi[CK_MAX_RT];                                \
                    _Pragma("GCC unroll 4")                                              \
                    for (int r = 0; r < RT; r++) {                                       \
                        const uint8_t *p = wr + r * rb + b * CK_Q6_BLOCK;                \
                        _mm_prefetch((const char *)(p + pf), _MM_HINT_T1);               \
                        const __m256i ql = _mm256_loadu_si256((const __m256i *)p);       \
                        const __m256i h = _mm256_broadcastsi128_si256(                   \
                            _mm_loadu_si128((const __m128i *)(p + 32)));                 \
                        lo[r] = _mm256_or_si256(_mm256_and_si256(ql, m4), _mm256_and_si256( \
                            _mm256_sllv_epi32(h, shl), m2));                             \
                        hi[r] = _mm256_or_si256(                                         \
                            _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4),              \
                            _mm256_and_si256(_mm256_srlv_epi32(h, shr), m2));            \
                    }                                                                    \
                    _Pragma("GCC unroll 4")                                              \
                    for (int t = 0; t < NT; t++) {                                       \
                        const int8_t *xp = xr + t * a->cp + b * 64;                      \
                        const __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);      \
                        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + 32)); \
                        _Pragma("GCC unroll 4")                                          \
                        for (int r = 0; r < RT; r++)                                     \
                            iacc[r * NT + t] = DOT2(iacc[r * NT + t], lo[r], x0, hi[r], x1); \
                    }                                                                    \
                }                                                                        \
                _Pragma("GCC unroll 2")                                                  \
                for (int k = 0; k < K4; k += 4) {                                        \
                    __m256i hs = _mm256_hadd_epi32(_mm256_hadd_epi32(iacc[k], iacc[k + 1]), \
                                                   _mm256_hadd_epi32(iacc[k + 2], iacc[k + 3])); \
                    _mm_storeu_si128((__m128i *)dq[k / 4][gi],                           \
                                     _mm_add_epi32(_mm256_castsi256_si128(hs),           \
                                                   _mm256_extracti128_si256(hs, 1)));    \
                }                                                                        \
            }                                                                            \
            q4_dot_pass(w, r0, a, t0, dq, gc, gn, acc, K, NT);                           \
        }                                                                                \
        _Pragma("GCC unroll 8")                                                          \
        for (int k = 0; k < K; k++) res[(k / NT) * ldr + k % NT] = acc[k];               \
    }

/* decode (one token): rt rows (1..4) in one TILE call, then return; the q6 and mxfp4
 * dispatches share it */
#define CK_DECODE_ROWS_(TILE)                                                            \
    if (nt == 1) {                                                                       \
        switch (rt) {                                                                    \
        case 4: TILE(w, r0, a, t0, res, 1, 4, 1); break;                                 \
        case 3: TILE(w, r0, a, t0, res, 1, 3, 1); break;                                 \
        case 2: TILE(w, r0, a, t0, res, 1, 2, 1); break;                                 \
        default: TILE(w, r0, a, t0, res, 1, 1, 1); break;                                \
        }                                                                                \
        return;                                                                          \
    }

#define CK_DEFINE_Q6_I8(ATTR, NAME, TILE)                                                \
    ATTR void NAME(const ck_q6 *w, int64_t r0, int rt, const ck_act *a, int64_t t0,      \
                   int nt, float *res) {                                                 \
        CK_DECODE_ROWS_(TILE)                                                            \
        for (int r = 0; r < rt; r++) {                                                   \
            switch (nt) {                                                                \
            case 4: TILE(w, r0 + r, a, t0, res + r * nt, nt, 1, 4); break;               \
            case 3: TILE(w, r0 + r, a, t0, res + r * nt, nt, 1, 3); break;               \
            default: TILE(w, r0 + r, a, t0, res + r * nt, nt, 1, 2); break;              \
            }                                                                            \
        }                                                                                \
    }

/* mxfp4 x int8 (ck_internal.h's ck_mx), RT rows x NT tokens (needs CK_PF_BYTES). Per 64 values
 * (two 32-value blocks, one activation group) a row's 32 bytes hold the codes of values 2j
 * (low nibbles) and 2j+1 (high) of block 2i in the low 128-bit lane and of block 2i+1 in
 * the high one: the nibbles are looked up where they lie (pshufb over 2 * E2M1 + 12,
 * unsigned 0..24: maddubs' and dpbusd's unsigned operand) against the activations in the
 * nibbles' order, which ck_mx_act_order made once per token when they were quantized (the
 * group's even values, then its odd ones). Per token and step -12 * sum(x) per i32 lane
 * (nc, made once for all the rows of the tile; measured faster than tabling it per call
 * for all rows) turns the offset dots back into exact integer dots:
 * DOTC(c, wa, xa, wb, xb) = c + the four-product sums per i32 lane (AVX2: maddubs + madd;
 * VNNI: dpbusd from c; the same integers), 8 lanes, four per block. They become floats and
 * go into one fma per lane with 2^(e-128) * xs, the blocks' 2^(e-128) broadcast from
 * ck_e8m0_half_tab to their lanes; the lanes are summed by hsum_ps at the end. Every (row,
 * token) takes the same float steps in every tile shape (batch-invariant) and on AVX2 and
 * AVX-512 (bit-identical, tests/test_kernels_mxfp4.py); within float rounding of the
 * scalar tile. The dispatch: CK_DEFINE_MX_I8 below. Needs hsum_ps. */
#define CK_DEFINE_MX_I8_TILE(INL, NAME, DOTC)                                            \
    INL void NAME(const ck_mx *w, int64_t r0, const ck_act *a, int64_t t0, float *res,   \
                  int ldr, const int RT, const int NT) {                                 \
        const __m256i m4 = _mm256_set1_epi8(0x0F), k12 = _mm256_set1_epi8(12);           \
        const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,              \
                                             12, 11, 10, 9, 8, 6, 4, 0,                  \
                                             12, 13, 14, 15, 16, 18, 20, 24,              \
                                             12, 11, 10, 9, 8, 6, 4, 0);                 \
        const int64_t rb = w->cp / 2, nb = w->cp / 32, n64 = w->cp / 64;                 \
        const int64_t pf = RT * rb + CK_PF_BYTES;   /* as the q4 tiles: the rows ahead */ \
        const float *e2 = ck_e8m0_half_tab;                                              \
        __m256 acc[CK_MAX_RT * CK_MAX_NT];                                               \
        _Pragma("GCC unroll 4")                                                          \
        for (int k = 0; k < RT * NT; k++) acc[k] = _mm256_setzero_ps();                  \
        for (int64_t o = 0; o < RT * nb; o += 64)    /* the exponents two tiles ahead */ \
            _mm_prefetch((const char *)(w->zeros + (r0 + 2 * RT) * nb + o), _MM_HINT_T0); \
        for (int64_t b = 0; b < n64; b++) {                                              \
            __m256i wa[CK_MAX_RT], wb[CK_MAX_RT];                                        \
            __m256 sw[CK_MAX_RT];                                                        \
            _Pragma("GCC unroll 4")                                                      \
            for (int r = 0; r < RT; r++) {                                               \
                const uint8_t *wp = w->data + (r0 + r) * rb + b * 32;                    \
                const uint8_t *ep = w->zeros + (r0 + r) * nb + 2 * b;                    \
                if (!(b & 1)) _mm_prefetch((const char *)(wp + pf), _MM_HINT_T1);       \
                const __m256i v = _mm256_loadu_si256((const __m256i *)wp);               \
                wa[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m4));               \
                wb[r] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)); \
                sw[r] = _mm256_blend_ps(_mm256_broadcast_ss(e2 + ep[0]),                 \
                                        _mm256_broadcast_ss(e2 + ep[1]), 0xF0);          \
            }                                                                            \
            _Pragma("GCC unroll 4")                                                      \
            for (int t = 0; t < NT; t++) {                                               \
                const int8_t *xp = a->q + (t0 + t) * a->cp + b * 64;                     \
                const __m256i xe = _mm256_loadu_si256((const __m256i *)xp);              \
                const __m256i xo = _mm256_loadu_si256((const __m256i *)(xp + 32));       \
                const __m256i nc = _mm256_sub_epi32(_mm256_setzero_si256(),              \
                    DOTC(_mm256_setzero_si256(), k12, xe, k12, xo));                     \
                const __m256 xs = _mm256_set1_ps(ck_ldf(a->s + (t0 + t) * a->ng + b));   \
                _Pragma("GCC unroll 4")                                                  \
                for (int r = 0; r < RT; r++) {                                           \
                    const __m256i d = DOTC(nc, wa[r], xe, wb[r], xo);                    \
                    acc[r * NT + t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),             \
                                                      _mm256_mul_ps(sw[r], xs),          \
                                                      acc[r * NT + t]);                  \
                }                                                                        \
            }                                                                            \
        }                                                                                \
        _Pragma("GCC unroll 4")                                                          \
        for (int k = 0; k < RT * NT; k++) res[(k / NT) * ldr + k % NT] = hsum_ps(acc[k]); \
    }

/* CK_DEFINE_MX_I8(ATTR, NAME, TILE, BR): the mxfp4 dispatch: 4 rows x 1 token for decode,
 * BR rows (4 or 2, then what is left) x up to 4 tokens for batches: each row's lookups and
 * each token's correction serve several (row, token) pairs. 2880x2880, 8 tokens, one thread
 * in cache, against 1 row x 4 tokens (the q4 shape): VNNI 4 x 4 (its 32 registers hold the
 * 16 accumulators) 1.48x faster, 2 x 4 1.35x; AVX2 2 x 4 1.04-1.07x (16 registers). */
#define CK_MX_BATCH_(TILE, R, NT)                                                         \
    TILE(w, r0 + r, a, t0, res + r * nt, nt, R, NT)
#define CK_DEFINE_MX_I8(ATTR, NAME, TILE, BR)                                            \
    ATTR void NAME(const ck_mx *w, int64_t r0, int rt, const ck_act *a, int64_t t0,      \
                   int nt, float *res) {                                                 \
        CK_DECODE_ROWS_(TILE)                                                            \
        for (int r = 0; r < rt;) {                                                       \
            const int br = r + BR <= rt ? BR : r + 2 <= rt ? 2 : 1;                      \
            if (br == 4) {                                                               \
                if (nt == 4) CK_MX_BATCH_(TILE, 4, 4);                                   \
                else if (nt == 3) CK_MX_BATCH_(TILE, 4, 3);                              \
                else CK_MX_BATCH_(TILE, 4, 2);                                           \
            } else if (br == 2) {                                                        \
                if (nt == 4) CK_MX_BATCH_(TILE, 2, 4);                                   \
                else if (nt == 3) CK_MX_BATCH_(TILE, 2, 3);                              \
                else CK_MX_BATCH_(TILE, 2, 2);                                           \
            } else {                                                                     \
                if (nt == 4) CK_MX_BATCH_(TILE, 1, 4);                                   \
                else if (nt == 3) CK_MX_BATCH_(TILE, 1, 3);                              \
                else CK_MX_BATCH_(TILE, 1, 2);                                           \
            }                                                                            \
            r += br;                                                                     \
        }                                                                                \
    }

#endif
