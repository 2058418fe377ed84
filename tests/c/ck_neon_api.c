/* ck_neon_api.c -- the aarch64 driver's checks of the public C API (ck_neon_driver.c has
 * the reports, the data, the backend slots' checks and main): ck_matmul, ck_expert_ffn,
 * ck_attention_decode and the pipeline step, each under ck_set_backend(CK_NEON) against
 * ck_set_backend(CK_SCALAR), on 1 and 2 threads of ck_pool.c. */
#include "ck_neon_driver.h"

/* fn(0) under the scalar backend, fn(1) under NEON, on 1 and 2 threads (2: even tiny
 * calls run on both); fn compares its outputs */
void both_threads(void (*fn)(report *, report *), report *exact, report *tol) {
    for (int th = 1; th <= 2; th++) {
        ck_set_threads(th);
        ck_set_par_min_work(th > 1 ? 0 : -1);
        fn(exact, tol);
    }
    ck_set_threads(1);
    ck_set_par_min_work(-1);
}

void api_matmul(report *exact, report *tol) {
    seed(6);
    static const int64_t shapes[][3] = {{3, 130, 64}, {37, 300, 128}, {259, 1000, 64},
                                        {5, 64 * 43, 128}, {9, 500, 192}};
    static const int64_t ns[] = {1, 2, 3, 5, 9};
    for (int si = 0; si < LEN(shapes); si++)
        for (int ni = 0; ni < LEN(ns); ni++) {
            g_used = 0;
            const int64_t rows = shapes[si][0], cols = shapes[si][1], G = shapes[si][2], n = ns[ni];
            ck_mat m[3] = {q4_mat(rows, cols, G), q8_mat(rows, cols, G), q6_mat(rows, cols, G)};
            float *x = floats(n * cols, 1.0f);
            double *sc = malloc((size_t)(n * rows) * sizeof *sc);
            for (int w = 0; w < 3; w++)
                for (int act = 0; act < 2; act++) {
                    float *out[2] = {odd((size_t)(n * rows) * 4), odd((size_t)(n * rows) * 4)};
                    for (int b = 0; b < 2; b++) {
                        ck_set_backend(b ? CK_NEON : CK_SCALAR);
                        if (ck_matmul(&m[w], x, n, out[b], act)) { printf("  ck_matmul failed\n"); exit(2); }
                    }
                    char what[80];
                    snprintf(what, sizeof what, "%s %ldx%ld g%ld n%ld %s threads %d",
                             w == 2 ? "q6" : w ? "q8" : "q4",
                             (long)rows, (long)cols, (long)G, (long)n, act ? "int8" : "float",
                             ck_get_threads());
                    for (int64_t t = 0; t < n; t++)
                        for (int64_t r = 0; r < rows; r++) sc[t * rows + r] = abs_dot(&m[w], r, x + t * cols);
                    rep_floats(act ? exact : tol, out[1], out[0], n * rows, sc, what);
                }
            free(sc);
        }
}

void api_ffn(report *exact, report *tol) {
    seed(7);
    static const int64_t dims[][4] = {{64, 128, 64, 128}, {130, 300, 128, 64}, {300, 259, 64, 128}};
    static const int64_t ns[] = {1, 2, 7};
    for (int di = 0; di < LEN(dims); di++)
        for (int ni = 0; ni < LEN(ns); ni++) {
            g_used = 0;
            const int64_t H = dims[di][0], I = dims[di][1], n = ns[ni];
            ck_ffn f = {q4_mat(I, H, dims[di][2]), q4_mat(I, H, dims[di][2]), q4_mat(H, I, dims[di][3])};
            float *x = floats(n * H, 1.0f), *rw = floats(n, 1.0f);
            for (int act = 0; act < 2; act++) {
                float *out[2] = {floats(n * H, 1.0f), NULL};
                out[1] = odd((size_t)(n * H) * 4);
                memcpy(out[1], out[0], (size_t)(n * H) * 4);
                for (int b = 0; b < 2; b++) {
                    ck_set_backend(b ? CK_NEON : CK_SCALAR);
                    if (ck_expert_ffn(&f, x, n, out[b], rw, 1, act)) { printf("  ck_expert_ffn failed\n"); exit(2); }
                }
                char what[80];
                snprintf(what, sizeof what, "ffn %ld->%ld n%ld %s threads %d", (long)H, (long)I,
                         (long)n, act ? "int8" : "float", ck_get_threads());
                rep_floats(act ? exact : tol, out[1], out[0], n * H, NULL, what);
            }
        }
}

void api_attention(report *exact, report *tol) {
    seed(8);
    static const int64_t shapes[][4] = {{4, 2, 64, 1}, {8, 8, 32, 77}, {6, 1, 100, 300},
                                        {1, 1, 7, 3}, {12, 2, 72, 40}};
    (void)exact;
    for (int i = 0; i < LEN(shapes); i++) {
        g_used = 0;
        const int64_t nh = shapes[i][0], nkv = shapes[i][1], d = shapes[i][2], len = shapes[i][3];
        float *q = floats(nh * d, 1.0f), *k = floats(len * nkv * d, 1.0f), *v = floats(len * nkv * d, 1.0f);
        float *out[2] = {odd((size_t)(nh * d) * 4), odd((size_t)(nh * d) * 4)};
        for (int b = 0; b < 2; b++) {
            ck_set_backend(b ? CK_NEON : CK_SCALAR);
            ck_attention_decode(q, nh, d, k, v, nkv, len, 0.3f, out[b]);
        }
        char what[80];
        snprintf(what, sizeof what, "nh %ld nkv %ld d %ld len %ld threads %d", (long)nh, (long)nkv,
                 (long)d, (long)len, ck_get_threads());
        rep_floats(tol, out[1], out[0], nh * d, vscale(v, len * nkv * d, nh * d), what);
    }
}

/* The pipeline step (ck_step*.c): a few steps of one layer over NT tokens of one sequence
 * (attention block, a routed expert block with a shared expert, the lm_head), scalar
 * and NEON each from the same start; with int8 activations, then (g_step_f32) float ones.
 * Experts 1 and 2 hold q8 and f32 / bf16 matrices (the float kinds' tile is portable C). */
int g_step_f32;

static ck_mat float_mat(int64_t rows, int64_t cols, int kind) {
    float *f = floats(rows * cols, 1.0f / sqrtf((float)cols));
    if (kind == CK_W_BF16) {
        uint16_t *b = odd((size_t)(rows * cols) * 2);
        for (int64_t i = 0; i < rows * cols; i++) {
            uint32_t u;
            memcpy(&u, f + i, 4);
            b[i] = (uint16_t)(u >> 16);
        }
        return (ck_mat){kind, b, NULL, NULL, rows, cols, 64};
    }
    return (ck_mat){kind, f, NULL, NULL, rows, cols, 64};
}

static ck_sscratch scratch(int64_t n, int64_t H, int64_t nh, int64_t d, int64_t hld,
                           int64_t hcp, int64_t kmax, int64_t ne) {
    const int64_t cp_max = rup(H > nh * d ? H : nh * d, 384);   /* whole groups of 64, 128, 192 */
    const int64_t pairs = n * (kmax + 1);
    ck_sscratch s;
    memset(&s, 0, sizeof s);
    s.n_max = n;
    s.xn = odd((size_t)(n * H) * 4);
    s.aq = odd((size_t)(n * cp_max)); s.as = odd((size_t)(n * cp_max / 64) * 4);
    s.asum = odd((size_t)(n * cp_max / 64) * 4);
    s.bq = odd((size_t)(n * cp_max)); s.bs = odd((size_t)(n * cp_max / 64) * 4);
    s.bsum = odd((size_t)(n * cp_max / 64) * 4);
    s.cp_max = cp_max;
    s.q = odd((size_t)(n * nh * d) * 4); s.k = odd((size_t)(n * nh * d) * 4);
    s.v = odd((size_t)(n * nh * d) * 4); s.att = odd((size_t)(n * nh * d) * 4);
    s.pairs_max = pairs;
    s.gq = odd((size_t)(pairs * cp_max)); s.gs = odd((size_t)(pairs * cp_max / 64) * 4);
    s.gsum = odd((size_t)(pairs * cp_max / 64) * 4);
    s.h = odd((size_t)(pairs * hld) * 4); s.hq = odd((size_t)(pairs * hcp));
    s.hs = odd((size_t)(pairs * hcp / 64) * 4); s.hsum = odd((size_t)(pairs * hcp / 64) * 4);
    s.hld = hld; s.hcp = hcp;
    s.pairs_total_max = pairs;
    s.pair_tok = odd((size_t)pairs * 8); s.pair_w = odd((size_t)pairs * 4);
    s.counts = odd((size_t)(2 * ne + 1) * 8);
    s.jobs_max = ne + 2; s.jobs = odd((size_t)((ne + 2) * ck_step_job_bytes()));
    s.act_f32 = g_step_f32;
    s.af = odd((size_t)(n * cp_max) * 4); s.bf = odd((size_t)(n * cp_max) * 4);
    s.gf = odd((size_t)(pairs * cp_max) * 4);
    return s;
}

void api_step(report *exact, report *tol) {
    seed(9);
    g_used = 0;
    enum { H = 192, NH = 6, NKV = 2, D = 32, I = 130, E = 4, K = 2, STEPS = 3, NT = 3, V = 67 };
    enum { CAP = STEPS * NT };
    ck_attn_layer L;
    memset(&L, 0, sizeof L);
    L.wq = q4_mat(NH * D, H, 64); L.wk = q8_mat(NKV * D, H, 64);
    L.wv = q6_mat(NKV * D, H, 64); L.wo = q4_mat(H, NH * D, 128);
    L.bq = floats(NH * D, 0.1f);
    L.norm = floats(H, 1.0f); L.ffn_norm = floats(H, 1.0f);
    L.hidden = H; L.nh = NH; L.nkv = NKV; L.d = D; L.eps = 1e-6f;
    L.scale = 1.0f / sqrtf((float)D);
    double inv_freq[D / 2];
    for (int i = 0; i < D / 2; i++) inv_freq[i] = pow(10000.0, -2.0 * i / D);
    L.inv_freq = inv_freq; L.rope_factor = 1.0;
    ck_ffn table[E + 1];
    for (int e = 0; e <= E; e++)
        table[e] = (ck_ffn){q4_mat(I, H, 64), q4_mat(I, H, 64), q4_mat(H, I, e % 2 ? 64 : 128)};
    table[1].w2 = q8_mat(H, I, 64);
    table[2] = (ck_ffn){float_mat(I, H, CK_W_F32), float_mat(I, H, CK_W_F32),
                        float_mat(H, I, CK_W_BF16)};
    ck_ffn_block fb = {table, E, &table[E], floats(H, 0.1f), H};
    ck_mat head = q8_mat(V, H, 64), head6 = q6_mat(V, H, 128);
    float *logits6[2];
    for (int b = 0; b < 2; b++) logits6[b] = odd((size_t)(NT * V) * 4);
    float *x0 = floats(NT * H, 1.0f);
    float *kc[2], *vc[2], *x[2], *xn[2], *logits[2];
    for (int b = 0; b < 2; b++) {
        kc[b] = odd((size_t)(CAP * NKV * D) * 4); vc[b] = odd((size_t)(CAP * NKV * D) * 4);
        x[b] = odd((size_t)(NT * H) * 4); xn[b] = odd((size_t)(NT * H) * 4);
        logits[b] = odd((size_t)(NT * V) * 4);
    }
    ck_sscratch s = scratch(NT, H, NH, D, rup(I, 64), rup(I, 128), K, E);
    for (int step = 0; step < STEPS; step++) {
        int64_t ids[NT * K];
        float wts[NT * K];
        for (int t = 0; t < NT; t++) {
            int p = step * NT + t;
            ids[t * K] = (p + 1) % E; ids[t * K + 1] = p % 2 ? -1 : (p + 3) % E;
            wts[t * K] = 0.7f; wts[t * K + 1] = 0.3f;
        }
        for (int b = 0; b < 2; b++) {
            int64_t tok[NT * CK_TOK_COLS];
            memset(tok, 0, sizeof tok);              /* kind CK_KV_F32, no scales */
            for (int t = 0; t < NT; t++) {
                int64_t *tk = tok + CK_TOK_COLS * t;
                tk[0] = step * NT + t;
                tk[1] = (int64_t)(uintptr_t)kc[b]; tk[2] = (int64_t)(uintptr_t)vc[b];
                tk[3] = CAP * NKV * D;
            }
            ck_set_backend(b ? CK_NEON : CK_SCALAR);
            memcpy(x[b], x0, NT * H * 4);
            int rc = ck_step_attention(&L, 0, x[b], NT, tok, xn[b], &s);
            char what[64];
            snprintf(what, sizeof what, "attention block step %d threads %d", step, ck_get_threads());
            if (rc) { printf("  ck_step_attention: %d\n", rc); exit(2); }
            if (b) {
                rep_floats(tol, x[1], x[0], NT * H, NULL, what);
                rep_floats(tol, xn[1], xn[0], NT * H, NULL, what);
                /* the expert block and the head from the scalar block's output, so that
                 * they are compared on the same input: int8 all through, bit-exact */
                memcpy(x[1], x[0], NT * H * 4);
                memcpy(xn[1], xn[0], NT * H * 4);
            }
        }
        for (int b = 0; b < 2; b++) {
            ck_set_backend(b ? CK_NEON : CK_SCALAR);
            int rc = ck_step_experts(&fb, xn[b], NT, ids, wts, K, x[b], &s);
            rc = rc ? rc : ck_step_head(&head, L.norm, 1e-6f, x[b], NT, logits[b], &s);
            rc = rc ? rc : ck_step_head(&head6, L.norm, 1e-6f, x[b], NT, logits6[b], &s);
            if (rc) { printf("  ck_step_experts/head: %d\n", rc); exit(2); }
        }
        char what[64];
        snprintf(what, sizeof what, "expert block + head step %d threads %d", step, ck_get_threads());
        report *r = g_step_f32 ? tol : exact;    /* float tiles: their own sum orders */
        rep_floats(r, x[1], x[0], NT * H, NULL, what);
        rep_floats(r, logits[1], logits[0], NT * V, NULL, what);
        rep_floats(r, logits6[1], logits6[0], NT * V, NULL, what);
        memcpy(x0, x[0], NT * H * 4);          /* the next step starts from this one */
    }
}
