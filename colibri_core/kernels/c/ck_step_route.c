/* ck_step_route.c -- the pipeline step's router (ck.h, "pipeline step"; shared pieces in
 * ck_step.h): router logits and each token's choice of experts and their weights. The
 * expert block is ck_step_moe.c. */
#include "ck_step.h"

/* ------------------------------------------------------------------ routing */

typedef struct { const ck_router *r; const float *xn; float *logits; int bad; } logit_ctx;

static void logit_row(void *p, int64_t t) {
    logit_ctx *c = p;
    const ck_router *r = c->r;
    for (int64_t i = 0; i < r->e; i++) {
        float v = dot_f32(c->xn + t * r->h, r->weight + i * r->h, r->h);
        if (r->bias) v += ck_ldf(r->bias + i);
        if (!isfinite(v)) c->bad = 1;
        c->logits[t * r->e + i] = v;
    }
}

/* one token's top-k and fixed-point softmax weights (routing.route, mode "fixed") */
static void route_fixed(const ck_router *r, const float *logits, int k, int64_t *ids,
                        float *weights, int have_ids) {
    const int64_t e = r->e;
    const int64_t *exp2_q30 = r->exp2_q30;
    float m = -INFINITY;
    for (int64_t i = 0; i < e; i++) m = logits[i] > m ? logits[i] : m;
    /* top k, largest first, ties to the lower index (ops.top_k) */
    for (int j = 0; j < k && !have_ids; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < e; i++) {
            int taken = 0;
            for (int q = 0; q < j; q++) taken |= ids[q] == i;
            if (!taken && (best < 0 || logits[i] > logits[best])) best = i;
        }
        ids[j] = best;
    }
    /* fixed-point softmax over all experts (routing.fixed_point_softmax_weights) */
    int64_t total = 0, sel[256];
    for (int64_t i = 0; i < e; i++) {
        double dd = (double)(logits[i] - m) * 1.4426950408889634;
        double fx = nearbyint(-dd * 1024.0);
        if (fx > 62.0 * 1024.0) fx = 62.0 * 1024.0;
        int64_t f = (int64_t)fx, shift = f >> 10;
        int64_t ex = exp2_q30[f & 1023] >> (shift < 62 ? shift : 62);
        total += ex;
        for (int j = 0; j < k; j++)
            if (ids[j] == i) sel[j] = ex;
    }
    double w[256], sum = 0.0;
    for (int j = 0; j < k; j++) {
        int64_t wq = (sel[j] << 16) / (total > 1 ? total : 1);
        w[j] = (double)(float)((double)wq / 65536.0);
        sum += w[j];
    }
    for (int j = 0; j < k; j++) {
        double v = r->norm_topk ? w[j] / (sum > 1e-20 ? sum : 1e-20) : w[j];
        weights[j] = (float)(v * r->scaling);
    }
}

/* largest of v[0..e) not yet taken, ties to the lower index; -inf only when nothing
 * else is left (ops.top_k: a stable sort of -v) */
static int64_t best_of(const double *v, int64_t e, const int64_t *taken, int ntaken) {
    int64_t best = -1;
    for (int64_t i = 0; i < e; i++) {
        int used = 0;
        for (int q = 0; q < ntaken; q++) used |= taken[q] == i;
        if (!used && (best < 0 || v[i] > v[best])) best = i;
    }
    return best;
}

/* Phi-3.5-MoE's two experts (routing.sparsemixer): the best logit m, its weight its
 * softmax among the logits s with (m - s) / max(|s|, m) <= 2 eps; then the same over the
 * others. Slots from the third on stay unused. */
static void route_sparsemixer(const ck_router *r, const float *logits, int k, int64_t *ids,
                              float *weights) {
    const int64_t e = r->e;
    const float two_eps = (float)(2.0 * (double)r->jitter_eps);
    double w[2] = {0.0, 0.0}, tot = 0.0;
    for (int j = 0; j < k; j++) { ids[j] = -1; weights[j] = 0.0f; }
    for (int j = 0; j < k && j < 2; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < e; i++)
            if ((j == 0 || i != ids[0]) && (best < 0 || logits[i] > logits[best])) best = i;
        const float m = logits[best];
        double sum = 0.0;
        for (int64_t i = 0; i < e; i++) {
            if (j == 1 && i == ids[0]) continue;
            const float f = fabsf(logits[i]) > m ? fabsf(logits[i]) : m;
            if ((m - logits[i]) / f > two_eps) continue;
            sum += exp((double)logits[i] - (double)m);
        }
        ids[j] = best;
        w[j] = 1.0 / sum;
        tot += w[j];
    }
    for (int j = 0; j < k && j < 2; j++)
        weights[j] = (float)((r->norm_topk ? w[j] / (tot > 1e-20 ? tot : 1e-20) : w[j]) * r->scaling);
}

/* one token's choice as routing.route for every other mode: float softmax or sigmoid
 * scores (double), the selection bias, group-limited selection (groups scored by their
 * best value, or with sigmoid scores the sum of their best two), weights = the chosen
 * scores (or the fixed-point softmax), renormalized when norm_topk, times scaling */
static void route_general(const ck_router *r, const float *logits, int k, int64_t *ids,
                          float *weights) {
    const int64_t e = r->e;
    if (r->scoring == CK_ROUTE_SPARSEMIXER) {
        route_sparsemixer(r, logits, k, ids, weights);
        return;
    }
    double prob[e > 0 ? e : 1], sel[e > 0 ? e : 1];
    double m = -INFINITY, sum = 0.0;
    for (int64_t i = 0; i < e; i++) m = logits[i] > m ? logits[i] : m;
    for (int64_t i = 0; i < e; i++) {
        const double l = (double)logits[i], b = r->select_bias ? (double)ck_ldf(r->select_bias + i) : 0.0;
        if (r->scoring == CK_ROUTE_SIGMOID) {
            prob[i] = 1.0 / (1.0 + exp(-l));
            sel[i] = prob[i] + b;
        } else {
            prob[i] = exp(l - m);
            sum += prob[i];
            sel[i] = l + b;
        }
    }
    if (r->scoring != CK_ROUTE_SIGMOID)
        for (int64_t i = 0; i < e; i++) {
            prob[i] /= sum;
            if (r->bias_on_probs)
                sel[i] = prob[i] + (r->select_bias ? (double)ck_ldf(r->select_bias + i) : 0.0);
        }
    if (r->n_group > 1 && r->topk_group < r->n_group) {
        const int64_t gsz = e / r->n_group;
        double gs[r->n_group];
        int64_t keep[r->n_group];
        for (int64_t g = 0; g < r->n_group; g++) {
            double b1 = -INFINITY, b2 = -INFINITY;
            for (int64_t i = g * gsz; i < (g + 1) * gsz; i++) {
                if (sel[i] > b1) { b2 = b1; b1 = sel[i]; } else if (sel[i] > b2) b2 = sel[i];
            }
            gs[g] = r->scoring == CK_ROUTE_SIGMOID ? b2 + b1 : b1;   /* np.sort's top two */
        }
        for (int q = 0; q < r->topk_group; q++) keep[q] = best_of(gs, r->n_group, keep, q);
        for (int64_t g = 0; g < r->n_group; g++) {
            int kept = 0;
            for (int q = 0; q < r->topk_group; q++) kept |= keep[q] == g;
            if (!kept)
                for (int64_t i = g * gsz; i < (g + 1) * gsz; i++) sel[i] = -INFINITY;
        }
    }
    for (int j = 0; j < k; j++) ids[j] = best_of(sel, e, ids, j);
    if (r->scoring == CK_ROUTE_FIXED) {          /* the fixed-point weights, then as below */
        route_fixed(r, logits, k, ids, weights, 1);
        return;
    }
    double w[256], tot = 0.0;
    for (int j = 0; j < k; j++) { w[j] = prob[ids[j]]; tot += w[j]; }
    for (int j = 0; j < k; j++) {
        double v = r->norm_topk ? w[j] / (tot > 1e-20 ? tot : 1e-20) : w[j];
        weights[j] = (float)(v * r->scaling);
    }
}

int ck_step_route(const ck_router *r, const float *xn, int64_t n, const int32_t *k, int kmax,
                  float *logits, int64_t *ids, float *weights, int from_logits) {
    logit_ctx c = {r, xn, logits, 0};
    if (kmax < 0 || kmax > 256 || kmax > r->e) return CK_E_SCRATCH;
    if (from_logits) {
        for (int64_t i = 0; i < n * r->e; i++) c.bad |= !isfinite(logits[i]);
    } else {
        ck_pool_for(logit_row, &c, n, n >= 16 ? ck_threads_for(n * r->e * r->h) : 1);
    }
    if (c.bad) return CK_E_NONFINITE;
    if (!ids) return 0;                         /* logits only: pipeline.py routes */
    const int plain = r->scoring == CK_ROUTE_FIXED && !r->select_bias &&
                      !(r->n_group > 1 && r->topk_group < r->n_group);
    for (int64_t t = 0; t < n; t++) {
        int kt = k[t];
        if (kt < 1 || kt > kmax) return CK_E_SCRATCH;
        if (plain) route_fixed(r, logits + t * r->e, kt, ids + t * kmax, weights + t * kmax, 0);
        else route_general(r, logits + t * r->e, kt, ids + t * kmax, weights + t * kmax);
        for (int j = kt; j < kmax; j++) { ids[t * kmax + j] = -1; weights[t * kmax + j] = 0.0f; }
    }
    return 0;
}

