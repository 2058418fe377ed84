/* ck_tiles.h -- the tile-shape dispatch shared by the SIMD backends (ck_avx2.c,
 * ck_avx512.c). Each backend instantiates it in its own file, under its own target
 * attributes, so that its tile functions are inlined there:
 *
 *   CK_DEFINE_Q4_I8(ATTR, name, tile): tile(w, r0, a, t0, res, ldr, RT, NT, BPG) computes
 *     RT rows x NT tokens of a q4 matrix (BPG: 64-blocks per group when known at compile
 *     time, 2 or 1, else 0). Decode (nt == 1) runs 4 rows at a time, sharing the
 *     activation loads; batches run 1 row x up to 4 tokens, sharing each unpacked weight
 *     vector (measured faster than 2x4, 2x2 and 4x2 tiles, which spill registers).
 *   CK_DEFINE_Q8_I8(ATTR, name, tile): tile(w, r0, xr, xs, res, ldr, RT) computes RT rows
 *     of a q8 matrix against one token's activations; tokens go one by one. */
#ifndef COLIBRI_CK_TILES_H
#define COLIBRI_CK_TILES_H

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

#endif
