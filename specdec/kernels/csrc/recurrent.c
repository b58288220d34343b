/* The recurrent token mixers of hybrid models inside the native forward (forward.c runs them in place of
 * attention on a layer whose sd_layer.mixer is 1 or 2; models/recurrent.py is the reference):
 *
 *   LFM2's short convolution (1): b, c, x = in_proj(h); y = out_proj(c * conv(b * x))
 *   Qwen3.5's gated delta-net (2): qkv, z, b, a = in_proj(h); q, k, v = SiLU(conv(qkv)); per value head a
 *       state S (dk, dv) updated token by token, S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q, with
 *       q, k L2-normalised (q / sqrt(dk)), g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); the
 *       output RMS-normalised per head times SiLU(z), into out_proj
 *
 * A layer's work, between forward.c's barriers (|):
 *
 *   P    tiles   in_proj's product (forward.c)
 *   |
 *   X    units   (token, 32 or 16 channels): the depthwise convolution over the token's last width inputs,
 *                those before its run read from the row's ring, the others made from the block's own
 *                in_proj output; 1: bias, times c, into out (quantized per group of 32); 2: SiLU into mix
 *   |
 *   R    units   2: (run, value head): the recurrence over the run's tokens in order from the state after
 *                the position before it (the ring's, zeros at position 0), the state after each kept
 *                position into the ring, the gated norm into out
 *   |
 *   S    rows    the kept tokens' convolution inputs into the ring (every read of it is done), then
 *                out_proj's product (forward.c)
 *
 * Each step rounds to bf16 where the reference rounds to the model's dtype (the convolution's inputs and
 * its SiLU output, c times the convolution, the recurrence's output before the norm, the norm's steps),
 * and sums in fp32 in a fixed order otherwise (the taps in order, each product rounded before its add as
 * PyTorch's separate operations; the state's rows in order). Not bit-identical to the reference (its
 * reductions run in PyTorch's order), but every token's result is one fixed sequence of operations on
 * its own inputs and the state before it, whoever computes it: a block of T tokens gives the bits and
 * ring entries of T one-token steps, for any thread count and whatever the other rows of the batch.
 */
#include <math.h>
#include <string.h>

#include "sd.h"

/* v as computed: the compiler may not fuse the product that made it into a later add (the reference
 * rounds the product, then adds) */
static inline SDV_T no_fuse(SDV_T v) {
    __asm__("" : "+v"(v));
    return v;
}

/* channels [c, c + SDV_W) of token t's convolution input: 1: b * x rounded (the reference's bf16 product),
 * 2: in_proj's qkv columns */
static inline SDV_T conv_input(const sd_mixer_call *c, int64_t t, int64_t ch) {
    const uint16_t *p = c->proj + t * c->N;
    if (c->kind == 1) return sdv_round_bf16(SDV(mul_ps)(sdv_ld_bf16(p + ch), sdv_ld_bf16(p + 2 * c->D + ch)));
    return sdv_ld_bf16(p + ch);
}

int64_t sd_mixer_conv_units(const sd_mixer_call *c) { return c->M * (c->D / (c->kind == 1 ? 32 : 16)); }

void sd_mixer_conv(const sd_mixer_call *c, int64_t u0, int64_t u1) {
    const int64_t D = c->D, W = c->width, cu = c->kind == 1 ? 32 : 16, per = D / cu;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t t = u / per, c0 = (u % per) * cu;
        const int64_t p = c->pos[t], first = c->run0[t], p0 = c->pos[first];
        const uint16_t *ring = c->ring_in + c->row[t] * c->slots * D;
        for (int64_t ch = c0; ch < c0 + cu; ch += SDV_W) {
            SDV_T acc = SDV(setzero_ps)();
            for (int64_t j = 0; j < W; j++) {
                const int64_t q = p - W + 1 + j; /* the tap's position */
                SDV_T x;
                if (q < 0)
                    x = SDV(setzero_ps)();
                else if (q >= p0)
                    x = conv_input(c, t - (p - q), ch);
                else
                    x = sdv_ld_bf16(ring + (q % c->slots) * D + ch);
                const SDV_T prod = no_fuse(SDV(mul_ps)(x, SDV(loadu_ps)(c->conv_wt + j * D + ch)));
                acc = j ? SDV(add_ps)(acc, prod) : prod;
            }
            if (c->conv_b) acc = SDV(add_ps)(acc, SDV(loadu_ps)(c->conv_b + ch));
            if (c->kind == 1) /* c * y, y rounded to bf16 first */
                sdv_st_bf16(c->out + t * D + ch,
                            SDV(mul_ps)(sdv_ld_bf16(c->proj + t * c->N + D + ch), sdv_round_bf16(acc)));
            else
                sdv_st_bf16(c->mix + t * D + ch, silu_v(acc));
        }
        if (c->kind == 1 && c->xq)
            sd_quantize_group(c->out + t * D + c0, c->xq + t * D + c0, c->xa + t * (D / SD_GS) + c0 / SD_GS,
                              c->xam + t * (D / SD_GS) + c0 / SD_GS);
    }
}

void sd_mixer_store(const sd_mixer_call *c, int64_t t0, int64_t t1) {
    const int64_t D = c->D;
    for (int64_t t = t0; t < t1; t++) {
        if (c->run1[t] - t > c->slots) continue; /* not among its run's last `slots`: never read */
        uint16_t *dst = c->ring_in + (c->row[t] * c->slots + c->pos[t] % c->slots) * D;
        if (c->kind == 2) {
            memcpy(dst, c->proj + t * c->N, sizeof(uint16_t) * (size_t)D);
        } else {
            for (int64_t ch = 0; ch < D; ch += SDV_W) sdv_st_bf16(dst + ch, conv_input(c, t, ch));
        }
    }
}

int64_t sd_mixer_scratch_floats(int64_t dk, int64_t dv) { return dk * dv + 2 * dk + 2 * dv + 16; }

/* x (n bf16) L2-normalised in fp32 (eps 1e-6 inside the root), divided by div (1: not) */
static void l2norm(const uint16_t *x, int64_t n, float div, float *out) {
    SDV_T ss = SDV(setzero_ps)();
    for (int64_t i = 0; i < n; i += SDV_W) {
        const SDV_T v = sdv_ld_bf16(x + i);
        ss = SDV(fmadd_ps)(v, v, ss);
    }
    const SDV_T r = SDV(set1_ps)(1.0f / sqrtf(sdv_hsum(ss) + 1e-6f)), d = SDV(set1_ps)(div);
    for (int64_t i = 0; i < n; i += SDV_W) {
        SDV_T v = SDV(mul_ps)(sdv_ld_bf16(x + i), r);
        if (div != 1.0f) v = SDV(div_ps)(v, d);
        SDV(storeu_ps)(out + i, v);
    }
}

void sd_mixer_delta(const sd_mixer_call *c, int64_t t0, int64_t T, int64_t h, float *scratch) {
    const int64_t dk = c->dk, dv = c->dv, hv = c->hv, D = c->D, N = c->N, key_dim = c->hk * dk, vd = hv * dv;
    const int64_t kh = h / (hv / c->hk), r = c->row[t0], p0 = c->pos[t0], slots = c->slots, size = dk * dv;
    float *S = scratch, *qf = S + size, *kf = qf + dk, *dl = kf + dk, *o = dl + dv;
    if (p0 == 0)
        memset(S, 0, sizeof(float) * (size_t)size);
    else
        memcpy(S, c->ring_state + ((r * slots + (p0 - 1) % slots) * hv + h) * size, sizeof(float) * (size_t)size);
    const float qdiv = sqrtf((float)dk);
    for (int64_t t = t0; t < t0 + T; t++) {
        const uint16_t *mx = c->mix + t * D, *pr = c->proj + t * N;
        l2norm(mx + kh * dk, dk, qdiv, qf);
        l2norm(mx + key_dim + kh * dk, dk, 1.0f, kf);
        /* beta = sigmoid(b) in bf16; g = -exp(A_log) softplus(a + dt_bias) in fp32 (softplus: x past 20) */
        const float bb = bf16_f(pr[D + vd + h]), ax = bf16_f(pr[D + vd + hv + h]) + c->dt_bias[h];
        const float beta = round_bf16(1.0f / (1.0f + expf(-bb)));
        const float g = c->neg_a[h] * (ax > 20.0f ? ax : log1pf(expf(ax)));
        const SDV_T eg = SDV(set1_ps)(expf(g)), vb = SDV(set1_ps)(beta);
        /* S = e^g S, and the memory S^T k */
        for (int64_t j = 0; j < dv; j += SDV_W) SDV(storeu_ps)(dl + j, SDV(setzero_ps)());
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv;
            const SDV_T ki = SDV(set1_ps)(kf[i]);
            for (int64_t j = 0; j < dv; j += SDV_W) {
                const SDV_T s = SDV(mul_ps)(SDV(loadu_ps)(row + j), eg);
                SDV(storeu_ps)(row + j, s);
                SDV(storeu_ps)(dl + j, SDV(fmadd_ps)(s, ki, SDV(loadu_ps)(dl + j)));
            }
        }
        /* delta = (v - S^T k) beta; S += k delta^T; o = S^T q */
        const uint16_t *v = mx + 2 * key_dim + h * dv;
        for (int64_t j = 0; j < dv; j += SDV_W) {
            SDV(storeu_ps)(dl + j, SDV(mul_ps)(SDV(sub_ps)(sdv_ld_bf16(v + j), SDV(loadu_ps)(dl + j)), vb));
            SDV(storeu_ps)(o + j, SDV(setzero_ps)());
        }
        for (int64_t i = 0; i < dk; i++) {
            float *row = S + i * dv;
            const SDV_T ki = SDV(set1_ps)(kf[i]), qi = SDV(set1_ps)(qf[i]);
            for (int64_t j = 0; j < dv; j += SDV_W) {
                const SDV_T s = SDV(fmadd_ps)(ki, SDV(loadu_ps)(dl + j), SDV(loadu_ps)(row + j));
                SDV(storeu_ps)(row + j, s);
                SDV(storeu_ps)(o + j, SDV(fmadd_ps)(s, qi, SDV(loadu_ps)(o + j)));
            }
        }
        if (t0 + T - t <= slots) /* a kept position: the state after it */
            memcpy(c->ring_state + ((r * slots + c->pos[t] % slots) * hv + h) * size, S, sizeof(float) * (size_t)size);
        /* the gated norm: o rounded to bf16, RMS-normalised (rounded), times the weight (rounded), times
         * SiLU(z) in fp32, rounded */
        SDV_T ss = SDV(setzero_ps)();
        for (int64_t j = 0; j < dv; j += SDV_W) {
            const SDV_T x = sdv_round_bf16(SDV(loadu_ps)(o + j));
            SDV(storeu_ps)(o + j, x);
            ss = SDV(fmadd_ps)(x, x, ss);
        }
        const SDV_T rn = SDV(set1_ps)(1.0f / sqrtf(sdv_hsum(ss) / (float)dv + c->eps));
        const uint16_t *z = pr + D + h * dv;
        uint16_t *y = c->out + t * vd + h * dv;
        for (int64_t j = 0; j < dv; j += SDV_W) {
            const SDV_T hn = sdv_round_bf16(SDV(mul_ps)(sdv_round_bf16(SDV(mul_ps)(SDV(loadu_ps)(o + j), rn)),
                                                        sdv_ld_bf16(c->gnorm + j)));
            sdv_st_bf16(y + j, SDV(mul_ps)(hn, silu_v(sdv_ld_bf16(z + j))));
        }
        if (c->xq && dv % SD_GS == 0)
            for (int64_t g0 = h * dv / SD_GS; g0 < (h + 1) * dv / SD_GS; g0++)
                sd_quantize_group(c->out + t * vd + g0 * SD_GS, c->xq + t * vd + g0 * SD_GS,
                                  c->xa + t * (vd / SD_GS) + g0, c->xam + t * (vd / SD_GS) + g0);
    }
}
