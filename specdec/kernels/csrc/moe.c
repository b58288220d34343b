/* The mixture-of-experts MLP of a block of rows inside the native forward (forward.c runs it in place of
 * the dense MLP's phases GH and I on a layer with an sd_moe; models/moe.py is the reference).
 *
 * A layer's work, between forward.c's barriers (|):
 *
 *   R   units  the router's tiles (logits = n Wr^T, bf16), the shared expert's gate (1, C; Qwen2-MoE's, none for
 *              GLM-4.5's ungated one) and its gate/up columns with the activation: none of them needs the routing
 *   |
 *       plan   every thread on its own, for every row (the same bits in every thread: no barrier): the
 *              k experts of the row (ties to the lower index) and their weights in fp32, then the rows
 *              grouped by expert (counting sort: an expert's rows in row order), the active experts
 *   GU  units  (active expert, chunk of its gate/up columns) over exactly the rows that chose it, with the
 *              activation (quantized for a quantized down); the shared expert's down product
 *   |
 *   D   units  (active expert, chunk of its down tiles) over those rows
 *   |
 *       rows   a row's output = the sum over its k choices in rank order, in fp32 (a product, then an add:
 *              never fused), rounded to bf16, + round(sigmoid(gate) * shared), or + shared when ungated
 *              (GLM-4.5) (forward.c's J adds it)
 *
 * So each chosen expert's weights stream from memory once per forward, however many rows chose it, and
 * the work units are (expert, chunk of tiles): with 1 or 8 experts active the threads all get a share
 * (about SD_MOE_CHUNKS units per thread; forward.c's next_chunk hands them out). A unit gathers its
 * expert's rows into the thread's own buffer (kept while the thread's next unit is of the same expert).
 *
 * Batch invariance: a product's column is one chain over the inputs whatever the rows beside it (products.c),
 * so an expert's output for a row does not depend on which other rows chose that expert; the routing and
 * the combination of a row read that row alone. A row's bits therefore never depend on the block, the
 * thread count or the chunks.
 */
#include <math.h>
#include <string.h>

#include "sd.h"

#ifndef SD_MOE_CHUNKS
#define SD_MOE_CHUNKS 4 /* units per thread, about, in each phase */
#endif

static inline size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }


/* v as computed: the compiler may not fuse the product that made it into a later add (the reference
 * rounds the product, then adds) */
static inline SDV_T no_fuse(SDV_T v) {
    __asm__("" : "+v"(v));
    return v;
}

/* ---- buffers ------------------------------------------------------------------------------------ */

/* The shared buffers of one forward's MoE layers, for the largest sizes d of any layer. */
typedef struct {
    uint16_t *logits, *sgate, *gu, *act, *ys, *gus, *acts, *yss;
    int8_t *axq, *asq;
    float *axa, *axam, *asa, *asam, *part_gu, *part_dn, *part_sgu, *part_sdn;
} shared_buf;

/* A thread's own: the plan of the layer's routing and its gathered rows. */
typedef struct {
    int64_t *hdr;     /* experts active, tiles per unit (gate/up, down, shared down), the expert gathered */
    int32_t *idx;     /* (M, k) each row's experts in rank order */
    float *w;         /* (M, k) their weights */
    int32_t *slot;    /* (M, k) where choice (t, j) sits in the grouped order */
    int32_t *rows;    /* (M k) the row of each slot */
    int32_t *off;     /* (E + 1) expert e's slots: [off[e], off[e + 1]) */
    int32_t *active;  /* (E) the experts chosen by some row, ascending */
    int32_t *cur;     /* (E) a cursor per expert */
    float *sc;        /* (E) a row's scores */
    float *ch;        /* (E) router 2: a row's scores for choosing (the correction bias added, groups masked) */
    float *gs;        /* (E) router 2: its groups' scores (n_group <= E) */
    int32_t *gi;      /* (E) router 2: the groups kept */
    uint8_t *taken;   /* (E) */
    uint16_t *gx;     /* (M, C) an expert's rows, gathered */
    int8_t *gq;
    float *ga, *gam;
} own_buf;

enum { N_ACT, CH_GU, CH_DN, CH_SDN, GATHERED, HDR };

#define TAKE(dst, field, type, count)                 \
    do {                                              \
        if (dst) (dst)->field = (type *)(base + off); \
        off += up64(sizeof(type) * (size_t)(count));  \
    } while (0)

static size_t shared_layout(const sd_moe *d, int64_t M, int64_t C, shared_buf *b, char *base) {
    const int64_t S = M * d->k, I = d->inter, Is = d->shared_inter, C16 = (C + 15) / 16;
    size_t off = 0;
    TAKE(b, logits, uint16_t, M * d->E);
    TAKE(b, sgate, uint16_t, M);
    TAKE(b, gu, uint16_t, S * 2 * I);
    TAKE(b, act, uint16_t, S * I);
    TAKE(b, axq, int8_t, S * I);
    TAKE(b, axa, float, S * I / SD_GS);
    TAKE(b, axam, float, S * I / SD_GS);
    TAKE(b, ys, uint16_t, S * C);
    TAKE(b, part_gu, float, S * (2 * I / 16) * 16);
    TAKE(b, part_dn, float, S * C16 * 16);
    TAKE(b, gus, uint16_t, M * 2 * Is);
    TAKE(b, acts, uint16_t, M * Is);
    TAKE(b, asq, int8_t, M * Is);
    TAKE(b, asa, float, M * Is / SD_GS);
    TAKE(b, asam, float, M * Is / SD_GS);
    TAKE(b, yss, uint16_t, Is ? M * C : 0);
    TAKE(b, part_sgu, float, M * (2 * Is / 16) * 16);
    TAKE(b, part_sdn, float, Is ? M * C16 * 16 : 0);
    return off;
}

static size_t own_layout(const sd_moe *d, int64_t M, int64_t C, own_buf *o, char *base) {
    const int64_t S = M * d->k;
    size_t off = 0;
    TAKE(o, hdr, int64_t, HDR);
    TAKE(o, idx, int32_t, S);
    TAKE(o, w, float, S);
    TAKE(o, slot, int32_t, S);
    TAKE(o, rows, int32_t, S);
    TAKE(o, off, int32_t, d->E + 1);
    TAKE(o, active, int32_t, d->E);
    TAKE(o, cur, int32_t, d->E);
    TAKE(o, sc, float, d->E);
    TAKE(o, ch, float, d->E);
    TAKE(o, gs, float, d->E);
    TAKE(o, gi, int32_t, d->E);
    TAKE(o, taken, uint8_t, d->E);
    TAKE(o, gx, uint16_t, M * C);
    TAKE(o, gq, int8_t, M * C);
    TAKE(o, ga, float, M * C / SD_GS);
    TAKE(o, gam, float, M * C / SD_GS);
    return off;
}
#undef TAKE

int64_t sd_moe_shared_bytes(const sd_moe *d, int64_t M, int64_t C) {
    return (int64_t)shared_layout(d, M, C, NULL, NULL);
}

int64_t sd_moe_own_bytes(const sd_moe *d, int64_t M, int64_t C) { return (int64_t)own_layout(d, M, C, NULL, NULL); }

/* ---- work units --------------------------------------------------------------------------------- */

/* Tiles per unit for `total` tiles over the experts (`per` each): about SD_MOE_CHUNKS units per thread, a
 * multiple of pref where that many are left (the bf16 kernels' blocks of tiles), else of amin (a
 * quantized activation's groups of 32 columns: 2 tiles), at most one expert's. */
static int64_t chunk_of(int64_t total, int64_t per, int64_t amin, int64_t pref, int64_t nt) {
    int64_t c = total / (nt * SD_MOE_CHUNKS);
    c = c >= pref ? c / pref * pref : c / amin * amin;
    if (c < amin) c = amin;
    const int64_t cap = (per + amin - 1) / amin * amin;
    return c < cap ? c : cap;
}

static inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* the thread's plan of the call's layer */
static inline own_buf own_of(const sd_moe_call *c) {
    own_buf o;
    own_layout(c->dims, c->M, c->C, &o, c->own);
    return o;
}

static inline shared_buf shared_of(const sd_moe_call *c) {
    shared_buf b;
    shared_layout(c->dims, c->M, c->C, &b, c->shared);
    return b;
}

static inline int any_q(const sd_mat *m) { return m->kind != 0; }

/* tile pairs per unit of the shared expert's gate/up (phase 0) */
static int64_t shared_gu_chunk(const sd_moe_call *c) {
    const sd_moe *L = c->moe;
    const int64_t Is16 = L->shared_inter / 16;
    return chunk_of(Is16, Is16, 2, any_q(&L->shared_gate_up) || any_q(&L->shared_down) ? 2 : 8, c->nt);
}

int64_t sd_moe_units(const sd_moe_call *c, int phase) {
    const sd_moe *L = c->moe;
    const int64_t I16 = L->inter / 16, Is16 = L->shared_inter / 16, C16 = (c->C + 15) / 16;
    if (phase == 0) {
        int64_t n = (L->E + 15) / 16;
        if (L->shared_inter) n += !L->shared_ungated + cdiv(Is16, shared_gu_chunk(c));
        return n;
    }
    const own_buf o = own_of(c);
    const int64_t n_act = o.hdr[N_ACT];
    if (phase == 1)
        return n_act * cdiv(I16, o.hdr[CH_GU]) + (L->shared_inter ? cdiv(C16, o.hdr[CH_SDN]) : 0);
    return n_act * cdiv(C16, o.hdr[CH_DN]);
}

/* the activation of rows [r0, r0 + n) of gu (2 I columns each) over tile pairs [c0, c1) into act (I
 * columns), quantized per group of 32 when q */
static void activate_rows(const sd_moe_call *c, const uint16_t *gu, uint16_t *act, int8_t *xq, float *xa, float *xam,
                          int64_t I, int64_t r0, int64_t n, int64_t c0, int64_t c1, int q) {
    for (int64_t r = r0; r < r0 + n; r++) {
        const uint16_t *gp = gu + r * 2 * I;
        uint16_t *o = act + r * I;
        sd_act_mul((int)c->act, c->limit, c->alpha, o, gp, gp + I, 16 * c0, 16 * c1);
        if (q)
            for (int64_t g = c0 / 2; g < c1 / 2; g++)
                sd_quantize_group(o + g * SD_GS, xq + r * I + g * SD_GS, xa + r * (I / SD_GS) + g,
                                  xam + r * (I / SD_GS) + g);
    }
}

static inline void count(const sd_moe_call *c, int64_t e, int64_t what, int64_t n) {
    if (c->stats) __atomic_fetch_add(&c->stats[e * 3 + what], n, __ATOMIC_RELAXED);
}

/* expert e's rows (its slots [s0, s0 + n)) into the thread's gather buffer, unless there already */
static void gather(const sd_moe_call *c, own_buf *o, int64_t e, const sd_mat *m) {
    if (o->hdr[GATHERED] == e) return;
    const int64_t C = c->C, G = C / SD_GS, s0 = o->off[e], n = o->off[e + 1] - s0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = o->rows[s0 + i];
        if (m->kind == 0) {
            memcpy(o->gx + i * C, c->x + t * C, sizeof(uint16_t) * (size_t)C);
        } else {
            memcpy(o->gq + i * C, c->xq + t * C, (size_t)C);
            memcpy(o->ga + i * G, c->xa + t * G, sizeof(float) * (size_t)G);
            memcpy(o->gam + i * G, c->xam + t * G, sizeof(float) * (size_t)G);
        }
    }
    o->hdr[GATHERED] = e;
}

void sd_moe_run(const sd_moe_call *c, int phase, int64_t u0, int64_t u1) {
    const sd_moe *L = c->moe;
    const int64_t M = c->M, C = c->C, I = L->inter, I16 = I / 16, Is = L->shared_inter, Is16 = Is / 16;
    const int64_t C16 = (C + 15) / 16;
    shared_buf b = shared_of(c);
    if (phase == 0) {
        const int64_t RT = (L->E + 15) / 16, SG = RT + (Is && !L->shared_ungated); /* SG: the gate/up chunks' first */
        const int64_t ch = Is ? shared_gu_chunk(c) : 1;
        for (int64_t u = u0; u < u1; u++) {
            if (u < RT) {
                sd_product_tiles(&L->gate, c->x, NULL, NULL, NULL, M, b.logits, 0, NULL, u, u + 1);
            } else if (u < SG) {
                sd_product_tiles(&L->shared_gate, c->x, NULL, NULL, NULL, M, b.sgate, 0, NULL, 0, 1);
            } else {
                const int64_t c0 = (u - SG) * ch, c1 = c0 + ch < Is16 ? c0 + ch : Is16;
                const sd_mat *m = &L->shared_gate_up;
                sd_product_tiles(m, c->x, c->xq, c->xa, c->xam, M, b.gus, 0, b.part_sgu, c0, c1);
                sd_product_tiles(m, c->x, c->xq, c->xa, c->xam, M, b.gus, 0, b.part_sgu, Is16 + c0, Is16 + c1);
                activate_rows(c, b.gus, b.acts, b.asq, b.asa, b.asam, Is, 0, M, c0, c1, any_q(&L->shared_down));
            }
        }
        return;
    }
    own_buf o = own_of(c);
    const int64_t n_act = o.hdr[N_ACT];
    if (phase == 1) {
        const int64_t ch = o.hdr[CH_GU], per = cdiv(I16, ch), chs = o.hdr[CH_SDN];
        for (int64_t u = u0; u < u1; u++) {
            if (u >= n_act * per) { /* the shared expert's down product */
                const int64_t t0 = (u - n_act * per) * chs, t1 = t0 + chs < C16 ? t0 + chs : C16;
                sd_product_tiles(&L->shared_down, b.acts, b.asq, b.asa, b.asam, M, b.yss, 0, b.part_sdn, t0, t1);
                continue;
            }
            const int64_t e = o.active[u / per], c0 = (u % per) * ch, c1 = c0 + ch < I16 ? c0 + ch : I16;
            const sd_mat *gu = &L->experts[2 * e], *dn = &L->experts[2 * e + 1];
            const int64_t s0 = o.off[e], n = o.off[e + 1] - s0;
            gather(c, &o, e, gu);
            float *part = b.part_gu + s0 * (2 * I16) * 16;
            uint16_t *y = b.gu + s0 * 2 * I;
            sd_product_tiles(gu, o.gx, o.gq, o.ga, o.gam, n, y, 0, part, c0, c1);
            sd_product_tiles(gu, o.gx, o.gq, o.ga, o.gam, n, y, 0, part, I16 + c0, I16 + c1);
            activate_rows(c, b.gu, b.act, b.axq, b.axa, b.axam, I, s0, n, c0, c1, any_q(dn));
            count(c, e, 1, 2 * (c1 - c0));
        }
        return;
    }
    const int64_t ch = o.hdr[CH_DN], per = cdiv(C16, ch);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t e = o.active[u / per], t0 = (u % per) * ch, t1 = t0 + ch < C16 ? t0 + ch : C16;
        const int64_t s0 = o.off[e], n = o.off[e + 1] - s0;
        sd_product_tiles(&L->experts[2 * e + 1], b.act + s0 * I, b.axq + s0 * I, b.axa + s0 * (I / SD_GS),
                         b.axam + s0 * (I / SD_GS), n, b.ys + s0 * C, 0, b.part_dn + s0 * C16 * 16, t0, t1);
        count(c, e, 2, t1 - t0);
    }
}

/* ---- routing ------------------------------------------------------------------------------------ */

/* The k largest of v[0, n), the largest first, ties to the lower index (models/moe.py topk's stable sort):
 * their indices into idx; taken: n bytes of scratch. */
static void top_n(const float *v, int64_t n, int64_t k, uint8_t *taken, int32_t *idx) {
    for (int64_t e = 0; e < n; e++) taken[e] = 0;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++)
            if (!taken[e] && (best < 0 || v[e] > v[best])) best = e;
        taken[best] = 1;
        idx[j] = (int32_t)best;
    }
}

/* 2^e for a normal float's exponent e */
static inline float pow2i(int e) {
    const uint32_t u = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* torch.sigmoid of an fp32 x as PyTorch's vectorized CPU kernel computes it, bit for bit: 1 / (e^-x + 1) with
 * e^-x by SLEEF's expf_u10 (Sleef_expf8_u10 / expf16_u10, with FMA). (PyTorch's scalar loop, with the C
 * library's expf, takes the elements past a tensor's last whole vectors: those may be an ulp off.) */
static float sigmoid_f32(float x) {
    const float d = -x;
    if (!(d >= -104.0f)) return d < -104.0f ? 1.0f : x; /* e^d 0 (or x NaN) */
    if (d > 100.0f) return 0.0f;                        /* e^d infinite */
    const float q = rintf(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
    float s = fmaf(q, -0.693145751953125f, d);
    s = fmaf(q, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    const int e = (int)q; /* in [-150, 145]: both halves' powers of two are normal floats */
    u = u * pow2i(e >> 1) * pow2i(e - (e >> 1)); /* SLEEF's ldexp2 */
    return 1.0f / (u + 1.0f);
}

/* Router 2 (sigmoid_group: GLM-4.5, DeepSeek-V3's noaux_tc), models/moe.py route_sigmoid_group in fp32 and in
 * its order, from the logits in sc: scores sc = sigmoid(logit); for choosing only ch = sc + correction; with
 * n_group groups of which topk_group compete, each group scored by its two best ch summed (the best first),
 * the topk_group best groups kept (ties to the lower group) and the others' ch -inf; the k best ch (ties to
 * the lower expert); their weights their sc, divided by (the sum of the k + 1e-20) when norm_topk, times
 * routed_scale. gs, gi, taken: E of scratch each. */
static void route_sigmoid_group(const sd_moe *L, float *sc, float *ch, float *gs, int32_t *gi, uint8_t *taken,
                                int32_t *idx, float *w) {
    const int64_t E = L->E, k = L->k, G = L->n_group > 1 ? L->n_group : 1, per = E / G;
    for (int64_t e = 0; e < E; e++) {
        sc[e] = sigmoid_f32(sc[e]);
        ch[e] = L->correction ? sc[e] + L->correction[e] : sc[e];
    }
    if (G > 1 && L->topk_group < G && per > 0) {
        const int64_t two = per < 2 ? per : 2;
        for (int64_t g = 0; g < G; g++) {
            int32_t best[2];
            top_n(ch + g * per, per, two, taken, best);
            gs[g] = ch[g * per + best[0]];
            if (two == 2) gs[g] = gs[g] + ch[g * per + best[1]];
        }
        top_n(gs, G, L->topk_group, taken, gi);
        for (int64_t g = 0; g < G; g++) taken[g] = 0;
        for (int64_t j = 0; j < L->topk_group; j++) taken[gi[j]] = 1; /* the groups kept */
        for (int64_t e = 0; e < E; e++)
            if (e / per >= G || !taken[e / per]) ch[e] = -INFINITY;
    }
    top_n(ch, E, k, taken, idx);
    const float scale = (float)L->routed_scale;
    for (int64_t j = 0; j < k; j++) w[j] = sc[idx[j]];
    if (L->norm_topk) {
        float s = 0.0f;
        for (int64_t j = 0; j < k; j++) s += w[j];
        s = s + 1e-20f;
        for (int64_t j = 0; j < k; j++) w[j] = w[j] / s;
    }
    for (int64_t j = 0; j < k; j++) w[j] = w[j] * scale;
}

/* Row t's k experts (rank order: the largest score first, ties to the lower index) and weights, as
 * models/moe.py route: softmax over every expert in fp32 then the k largest (renormalised by their sum
 * when norm_topk), the k largest logits then a softmax over them, or the grouped sigmoid router
 * (route_sigmoid_group). */
static void route_row(const sd_moe *L, const uint16_t *lg, float *sc, float *ch, float *gs, int32_t *gi,
                      uint8_t *taken, int32_t *idx, float *w) {
    const int64_t E = L->E, k = L->k;
    for (int64_t e = 0; e < E; e++) {
        float v = bf16_f(lg[e]);
        if (L->gate_bias) v = round_bf16(v + bf16_f(L->gate_bias[e])); /* a bf16 add */
        sc[e] = v;
    }
    if (L->router == 2) {
        route_sigmoid_group(L, sc, ch, gs, gi, taken, idx, w);
        return;
    }
    if (L->router == 0) {
        float mx = sc[0], s = 0.0f;
        for (int64_t e = 1; e < E; e++) mx = sc[e] > mx ? sc[e] : mx;
        for (int64_t e = 0; e < E; e++) {
            sc[e] = expf(sc[e] - mx);
            s += sc[e];
        }
        for (int64_t e = 0; e < E; e++) sc[e] = sc[e] / s;
    }
    top_n(sc, E, k, taken, idx);
    for (int64_t j = 0; j < k; j++) w[j] = sc[idx[j]];
    if (L->router == 1) { /* softmax over the k logits (the first the largest) */
        float s = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            w[j] = expf(w[j] - sc[idx[0]]);
            s += w[j];
        }
        for (int64_t j = 0; j < k; j++) w[j] = w[j] / s;
    } else if (L->norm_topk) {
        float s = 0.0f;
        for (int64_t j = 0; j < k; j++) s += w[j];
        for (int64_t j = 0; j < k; j++) w[j] = w[j] / s;
    }
}

void sd_moe_route(const sd_moe_call *c, int record) {
    const sd_moe *L = c->moe;
    const int64_t M = c->M, E = L->E, k = L->k;
    shared_buf b = shared_of(c);
    own_buf o = own_of(c);
    for (int64_t t = 0; t < M; t++)
        route_row(L, b.logits + t * E, o.sc, o.ch, o.gs, o.gi, o.taken, o.idx + t * k, o.w + t * k);
    /* group by expert: counts, offsets, then each expert's rows in row order */
    for (int64_t e = 0; e <= E; e++) o.off[e] = 0;
    for (int64_t s = 0; s < M * k; s++) o.off[o.idx[s] + 1]++;
    int64_t n_act = 0;
    for (int64_t e = 0; e < E; e++) {
        if (o.off[e + 1]) o.active[n_act++] = (int32_t)e;
        if (record && c->stats) c->stats[e * 3] += o.off[e + 1];
        o.off[e + 1] += o.off[e];
    }
    for (int64_t e = 0; e < E; e++) o.cur[e] = o.off[e];
    for (int64_t s = 0; s < M * k; s++) { /* (row, rank) ascending: an expert's slots fill in row order */
        const int32_t at = o.cur[o.idx[s]]++;
        o.rows[at] = (int32_t)(s / k);
        o.slot[s] = at;
    }
    const int64_t I16 = L->inter / 16, C16 = (c->C + 15) / 16;
    const int q_gu = any_q(&L->experts[0]) || any_q(&L->experts[1]);
    o.hdr[N_ACT] = n_act;
    o.hdr[CH_GU] = chunk_of(n_act * I16, I16, 2, q_gu ? 2 : 8, c->nt);
    o.hdr[CH_DN] = chunk_of(n_act * C16, C16, 1, any_q(&L->experts[1]) ? 1 : 8, c->nt);
    o.hdr[CH_SDN] = L->shared_inter ? chunk_of(C16, C16, 1, any_q(&L->shared_down) ? 1 : 8, c->nt) : 1;
    o.hdr[GATHERED] = -1;
}

/* ---- a row's output ----------------------------------------------------------------------------- */

void sd_moe_combine(const sd_moe_call *c, int64_t t, uint16_t *out) {
    const sd_moe *L = c->moe;
    const int64_t C = c->C, k = L->k;
    shared_buf b = shared_of(c);
    own_buf o = own_of(c);
    const float *w = o.w + t * k;
    const int32_t *sl = o.slot + t * k;
    float g = 0.0f;
    if (L->shared_inter && !L->shared_ungated) {
        const float x = bf16_f(b.sgate[t]);
        g = round_bf16(1.0f / (1.0f + expf(-x))); /* torch.sigmoid on bf16 */
    }
    for (int64_t cc = 0; cc < C; cc += SDV_W) {
        SDV_T acc = SDV(setzero_ps)();
        for (int64_t j = 0; j < k; j++) {
            const SDV_T y = sdv_ld_bf16(b.ys + (int64_t)sl[j] * C + cc);
            acc = SDV(add_ps)(acc, no_fuse(SDV(mul_ps)(SDV(set1_ps)(w[j]), y)));
        }
        SDV_T v = sdv_round_bf16(acc);
        if (L->shared_inter && L->shared_ungated) /* GLM-4.5's: the shared expert's output whole */
            v = SDV(add_ps)(v, sdv_ld_bf16(b.yss + t * C + cc));
        else if (L->shared_inter)
            v = SDV(add_ps)(v, sdv_round_bf16(SDV(mul_ps)(SDV(set1_ps)(g), sdv_ld_bf16(b.yss + t * C + cc))));
        sdv_st_bf16(out + cc, v);
    }
}
