/* ck.h -- Colibri CPU kernels: public C API (mirrored in _kernels_build.py's cdef) and
 * the internal types shared by the backends (scalar, AVX2, NEON).
 *
 * Layouts are those of docs/FORMAT.md: q4 rows are `cp/2` packed bytes (blocks of 64
 * values in 32 bytes: low nibble = value j, high nibble = value 32+j), q8 rows are `cp`
 * int8, scales/zeros are [rows, ng]. Activations quantized to int8 are [n, cp] with
 * [n, ng] scales and int32 group sums (see quant.quantize_act_q8).
 *
 * No pointer is assumed aligned: SIMD code uses unaligned loads and scalar code reads
 * user floats through memcpy (ck_ldf/ck_stf), since weight parts may sit at any byte
 * offset of a mapped file. */
#ifndef COLIBRI_CK_H
#define COLIBRI_CK_H

#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------ public API */

enum { CK_SCALAR = 0, CK_AVX2 = 1, CK_NEON = 2 };

void ck_init(void);                 /* reads COLIBRI_KERNELS, picks the backend */
int ck_backend(void);               /* active backend, CK_* */
int ck_backend_available(int b);
int ck_set_backend(int b);          /* 0 on success, -1 if not available here */
void ck_set_threads(int n);
void ck_set_par_min_work(int64_t w); /* calls below w MACs run on one thread; <0: default */
int ck_get_threads(void);
uint64_t ck_rdtsc(void);
const char *ck_cycle_counter_name(void);

/* x [n, cols] f32 -> xq [n, cp] int8, xs [n, ng] f32, xsum [n, ng] int32 */
void ck_act_quantize(const float *x, int64_t n, int64_t cols, int64_t group,
                     int8_t *xq, float *xs, int32_t *xsum);

/* out [n, rows] = x [n, cols] @ W^T. The int8 variants quantize x into (xq, xs, xsum)
 * when given (sizes n*cp, n*ng, n*ng) or into malloc'ed buffers when NULL.
 * These return 0, or -1 when a buffer could not be allocated (out is then unspecified). */
int ck_q4_matmul(const uint8_t *wd, const float *ws, const uint8_t *wz,
                  int64_t rows, int64_t cols, int64_t group,
                  const float *x, int64_t n, float *out, int act_int8,
                  int8_t *xq, float *xs, int32_t *xsum);
int ck_q8_matmul(const int8_t *wd, const float *ws,
                  int64_t rows, int64_t cols, int64_t group,
                  const float *x, int64_t n, float *out, int act_int8,
                  int8_t *xq, float *xs, int32_t *xsum);

/* Expert FFN: w1, w3 [I, H] (same group), w2 [H, I].
 * h = silu(x W1^T) * (x W3^T);  y = h W2^T;  out = y * rw[:,None] (or out += ..).
 * rw may be NULL (weights 1). Scratch (all may be NULL -> malloc):
 *   xq [n*cp(H,g1)], xs/xsum [n*ng(H,g1)], h [n*round64(I)] f32,
 *   hq [n*cp(I,g2)], hs/hsum [n*ng(I,g2)]. */
int ck_expert_ffn(const uint8_t *w1d, const float *w1s, const uint8_t *w1z,
                   const uint8_t *w3d, const float *w3s, const uint8_t *w3z, int64_t g13,
                   const uint8_t *w2d, const float *w2s, const uint8_t *w2z, int64_t g2,
                   int64_t hidden, int64_t inter,
                   const float *x, int64_t n, float *out, const float *rw,
                   int accumulate, int act_int8,
                   int8_t *xq, float *xs, int32_t *xsum,
                   float *h, int8_t *hq, float *hs, int32_t *hsum);

/* Decode attention of one token over a KV cache laid out [capacity, nkv, d] (row p of kv
 * head j at k + (p*nkv + j)*d): out[h] = softmax(scale * q[h] . k[:len, h/(nh/nkv)]) @ v.
 * q, out: [nh, d]. scores: [nh*len] scratch or NULL (malloc). Returns 0, or -1 (memory). */
int ck_attention_decode(const float *q, int64_t nh, int64_t d, const float *k, const float *v,
                        int64_t nkv, int64_t len, float scale, float *out, float *scores);

/* ------------------------------------------------------------------ internals */

#define CK_MAX_RT 4   /* rows per tile, at most */
#define CK_MAX_NT 4   /* tokens per tile, at most */

typedef struct {               /* a q4 matrix */
    const uint8_t *data;       /* [rows, cp/2] */
    const float *scales;       /* [rows, ng]   */
    const uint8_t *zeros;      /* [rows, ng]   */
    int64_t rows, cols, group, cp, ng;
} ck_q4;

typedef struct {               /* a q8 matrix */
    const int8_t *data;        /* [rows, cp] */
    const float *scales;       /* [rows, ng] */
    int64_t rows, cols, group, cp, ng;
} ck_q8;

typedef struct {               /* int8 activations, as quant.quantize_act_q8 */
    const int8_t *q;           /* [n, cp] */
    const float *s;            /* [n, ng] */
    const int32_t *sum;        /* [n, ng] */
    int64_t cp, ng;
} ck_act;

typedef struct {               /* float activations */
    const float *x;            /* row t at x + t*ld, `cols` real values */
    int64_t ld, cols;
    /* tail: [n, 64] zero-padded copy of each row's last partial 64-block, or NULL when
     * the rows are readable and finite up to round_up(cols, 64). */
    const float *tail;
} ck_xf;

/* A tile computes res[r*nt + t] = dot(W row r0+r, activation row t0+t), r < rt, t < nt,
 * with rt <= CK_MAX_RT, nt <= CK_MAX_NT. */
typedef struct {
    const char *name;
    void (*act_quant)(const float *x, int64_t cols, int64_t group,
                      int8_t *xq, float *xs, int32_t *xsum);   /* one row */
    void (*q4_i8)(const ck_q4 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                  float *res);
    void (*q4_f32)(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                   float *res);
    void (*q8_i8)(const ck_q8 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                  float *res);
    void (*q8_f32)(const ck_q8 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                   float *res);
    /* attention of g query heads sharing one kv head: q, out [g, d]; key/value row p at
     * k + p*ld, v + p*ld; s: [g, len] scratch */
    void (*attn)(const float *q, int g, int64_t d, const float *k, const float *v, int64_t ld,
                 int64_t len, float scale, float *s, float *out);
    int rt;       /* preferred rows per tile */
    int nt_many;  /* preferred tokens per tile when n > 1 */
} ck_backend_t;

extern const ck_backend_t ck_backend_scalar;
#if defined(__x86_64__) || defined(__i386__)
extern const ck_backend_t ck_backend_avx2;
#endif
#if defined(__aarch64__)
extern const ck_backend_t ck_backend_neon;
#endif

/* scalar pieces reused by other backends */
void ck_scalar_act_quant(const float *x, int64_t cols, int64_t group,
                         int8_t *xq, float *xs, int32_t *xsum);
void ck_scalar_q4_f32(const ck_q4 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res);
void ck_scalar_q8_i8(const ck_q8 *w, int64_t r0, int rt, const ck_act *a, int64_t t0, int nt,
                     float *res);
void ck_scalar_attn(const float *q, int g, int64_t d, const float *k, const float *v, int64_t ld,
                    int64_t len, float scale, float *s, float *out);
void ck_softmax_rows(float *s, int g, int64_t len);
void ck_scalar_q8_f32(const ck_q8 *w, int64_t r0, int rt, const ck_xf *x, int64_t t0, int nt,
                      float *res);

/* unaligned scalar access to user memory (compiles to a plain mov) */
static inline float ck_ldf(const float *p) { float v; memcpy(&v, p, 4); return v; }
static inline void ck_stf(float *p, float v) { memcpy(p, &v, 4); }
static inline int32_t ck_ldi(const int32_t *p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline void ck_sti(int32_t *p, int32_t v) { memcpy(p, &v, 4); }

#endif
