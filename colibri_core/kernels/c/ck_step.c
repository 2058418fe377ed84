/* ck_step.c -- the pipeline step's lm_head and small pieces (ck.h, "pipeline step"); the
 * step's other calls are in ck_step_attn.c and ck_step_moe.c, what they share in
 * ck_step.h, which says how the step is built. */
#include "ck_step.h"

/* ------------------------------------------------------------------ lm_head */

typedef struct {
    const ck_backend_t *be; wmat w; const sact *a; float *out; int64_t n; chunks ch;
    int rti;          /* rows per item: CK_PANEL_ROWS with panels, else be->rt */
    int pan;          /* the panels (AVX-512 batches: q4 and q6 heads) */
    ck_panel p;
} head_ctx;

static void emit_logit(void *p, int64_t t, int64_t r, float v) {
    head_ctx *c = p;
    c->out[t * c->w.rows + r] = v;
}

static void lm_chunk(void *p, int64_t ch) {
    head_ctx *c = p;
    for (int64_t i = ch * c->ch.per; i < chunk_end(c->ch, ch); i++) {
        int64_t r0 = i * c->rti;
        int rt = (int)min64(c->rti, c->w.rows - r0);
        if (c->pan)
            rows_x_panels(c->be, &c->w, r0, rt, &c->p, c->n, emit_logit, c);
        else
            rows_x_tokens(c->be, &c->w, r0, rt, c->a, c->n, emit_logit, c);
    }
}

int ck_step_head(const ck_mat *w, const float *norm, float eps, const float *x, int64_t n,
                 float *logits, ck_sscratch *s) {
    return ck_step_head_b(w, norm, NULL, NULL, eps, x, n, logits, s);
}

int ck_step_head_b(const ck_mat *w, const float *norm, const float *norm_b, const float *bias,
                   float eps, const float *x, int64_t n, float *logits, ck_sscratch *s) {
    const ck_backend_t *be = ck_active_backend();
    if (n > s->n_max) return CK_E_SCRATCH;
    if (n <= 0) return 0;
    head_ctx c = {be, to_w(w), NULL, logits, n, {0, 0}, be->rt, 0, {0}};
    act_set A = {0};
    int err = 0;
    int nth = nthreads(s, n * w->rows * w->cols);
    norm_rows_b(x, norm, norm_b, n, w->cols, eps, s->xn, nth);
    c.a = act_for(&A, s, be, s->xn, n, w->cols, &c.w, nth, &err);
    if (err) return err;
    /* a batch's head through the panels: each row tile unpacked once for all tokens, the
     * tokens in the lanes (the same bits as the tiles) */
    c.pan = panels_fit(be, s, &c.w, n);
    if (c.pan) {
        c.p = pack_panels(&c.a->q, n, s, nth);
        c.rti = CK_PANEL_ROWS;
    }
    c.ch = chunking((w->rows + c.rti - 1) / c.rti, n * c.rti * mat_bytes_per_row(w));
    ck_pool_for(lm_chunk, &c, nchunks(c.ch), nth);
    for (int64_t t = 0; bias && t < n; t++)
        for (int64_t r = 0; r < w->rows; r++) logits[t * w->rows + r] += bias[r];
    return 0;
}

/* ------------------------------------------------------------------ small pieces */

void ck_mat_row(const ck_mat *w, int64_t r, float *out) {
    if (is_float_kind(w->kind)) {
        const wmat f = to_w(w);
        float buf[256];
        for (int64_t k0 = 0; k0 < w->cols; k0 += 256) {
            const int64_t m = min64(256, w->cols - k0);
            wf_load(&f, r, k0, m, buf);
            memcpy(out + k0, buf, (size_t)m * sizeof(float));
        }
        return;
    }
    if (w->kind == CK_W_MXFP4) {                /* code / 2 * 2^(e - 127) */
        static const int8_t lut[16] = {CK_E2M1_X2};
        const int64_t cp = rup(w->cols, 64);
        const uint8_t *d = (const uint8_t *)w->data + r * (cp / 2), *e = w->zeros + r * (cp / 32);
        for (int64_t c = 0; c < w->cols; c++) {
            const uint8_t b = d[c / 2];
            ck_stf(out + c, (float)lut[c & 1 ? b >> 4 : b & 15] * ck_e8m0_half(e[c / 32]));
        }
        return;
    }
    int64_t cp = rup(w->cols, w->group), ng = cp / w->group;
    const float *s = w->scales + r * ng;
    if (w->kind == CK_W_Q4) {
        const uint8_t *d = (const uint8_t *)w->data + r * (cp / 2), *z = w->zeros + r * ng;
        for (int64_t c = 0; c < w->cols; c++) {
            int64_t j = c % 64;
            uint8_t b = d[(c / 64) * 32 + (j & 31)];
            double q = j < 32 ? (b & 0x0F) : (b >> 4);
            int64_t g = c / w->group;
            ck_stf(out + c, (float)((q - (double)z[g]) * (double)ck_ldf(s + g)));
        }
    } else if (w->kind == CK_W_Q6) {
        const uint8_t *d = (const uint8_t *)w->data + r * (cp / 64 * CK_Q6_BLOCK), *z = w->zeros + r * ng;
        for (int64_t c = 0; c < w->cols; c++) {
            const uint8_t *blk = d + (c / 64) * CK_Q6_BLOCK;
            int64_t j = c % 64;
            int lo = j < 32 ? (blk[j & 31] & 0x0F) : (blk[j & 31] >> 4);
            double q = lo | (((blk[32 + (j & 15)] >> (2 * (j >> 4))) & 3) << 4);
            int64_t g = c / w->group;
            ck_stf(out + c, (float)((q - (double)z[g]) * (double)ck_ldf(s + g)));
        }
    } else {
        const int8_t *d = (const int8_t *)w->data + r * cp;
        for (int64_t c = 0; c < w->cols; c++)
            ck_stf(out + c, (float)((double)d[c] * (double)ck_ldf(s + c / w->group)));
    }
}

