/* The decoder layers of a Llama-family model over a block of tokens in ONE native call (a decode step,
 * a verification block of K+1 tokens per sequence, a token tree, prompt chunks riding along).
 *
 * models/llama.py is the reference that documents the math; this is its twin for small blocks, where
 * PyTorch spends most of a forward in fixed per-call costs (a oneDNN product at one row, ~20 small
 * operations per layer, a thread wake-up each). Here one OpenMP parallel region runs every layer and
 * the threads meet at barriers (|) between the phases of a layer:
 *
 *   A   rows   n = RMSNorm(h) * w1 (quantized for a quantized qkv)       Block.forward's input_layernorm
 *   |   (only when the rows are split among the threads; see sd_forward)
 *   BC  heads  qkv = n Wqkv^T (+ b), a chunk of heads at a time, RoPE   Attention.qkv_proj, .attend,
 *              of its q and k heads, its k and v heads written to cache   KVCache.write
 *   |
 *   D   items  attention of each (token group, query heads of a kv head) cached_attention (attention.c)
 *              over its visible keys, quantized for a quantized o
 *   |
 *   E   tiles  delta = att Wo^T                                          Attention.o_proj
 *   |
 *   F   rows   h = h + delta; n = RMSNorm(h) * w2                        Block.forward, residual + norm
 *   |   (only when the rows are split)
 *   GH  tiles  a chunk of columns of gate and up = n Wgu^T, then         MLP.gate_up_proj, MLP.forward
 *              SiLU(gate) * up on them (quantized for a quantized down)
 *   |
 *   I   tiles  delta = n Wdown^T                                         MLP.down_proj
 *   |
 *   J   rows   h = h + delta (the next layer's A runs the same rows)     Block.forward's residual
 *
 * A hybrid model's recurrent layer (sd_layer.mixer 1: LFM2's short convolution, 2: Qwen3.5's gated
 * delta-net; models/recurrent.py) runs recurrent.c's phases in place of BC and D: in_proj's product, the
 * convolution over the row's earlier inputs (its ring in the HybridCache, sd_batch.ring_in) and the block's,
 * a delta-net's recurrence per (run of a row's tokens, value head) from the state before the run
 * (ring_state), each kept position's inputs and state into the rings; E is its out_proj. An attention layer
 * of a hybrid reads and writes its own layer of the KV cache (sd_layer.kv), and Qwen3.5's attention output
 * is gated per head (sd_model.gate_out: sigmoid of the query's twin columns, in D).
 *
 * A mixture-of-experts layer (sd_layer.moe; models/moe.py) runs moe.c's three phases in place of GH and
 * I: the router's product (and the shared expert's gate/up), then every thread routes every row on its
 * own and the (expert, chunk of tiles) units run each chosen expert's gate/up, then its down product,
 * over exactly the rows that chose it; J adds each row's weighted sum of its experts' outputs.
 *
 * Every elementwise step rounds to bf16 where the PyTorch reference does (it runs in bf16), so the two
 * paths agree to the last bits of the products' summation order. Products (products.c's sd_product_tiles,
 * moe.c's too): bf16 weights re-laid in tiles of 16 columns with input pairs interleaved, so one 64-byte
 * load feeds one vdpbf16ps per row (the weight read is paid once for up to 8 rows; on the avx512 rung,
 * without BF16, the load is widened once and feeds two FMAs per row: sd.h's sd_pairs); int8/int4/GGUF
 * weights go through qmm.c. The heads
 * and tiles of BC, E, GH and I: for one row, each thread's static share (one contiguous stream each);
 * for 2+ rows, where the products are bound by the cores, a static share of three quarters, then the
 * rest in chunks from a shared counter (next_chunk), so a thread on a slowed core does not hold the
 * others at the barrier.
 *
 * Batch invariance (what exact speculation rests on): a product's column is one chain of dpbf16 (or its
 * two FMAs) over the inputs in order, whatever the number of rows, the register block or the thread; the row phases
 * and attention items work on one row (one query) at a time. So a row's bits never depend on how many
 * rows share the block, which rows they are, or how many threads run.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "sd.h"

/* the layer's cache asked into L2 before its qkv product (sd_attn_prefetch): measured on AVX2 only (Zen 1:
 * 0.98x a SmolLM2 int4 token), so off on the AVX-512 build until it is measured there */
#ifndef SD_ATT_PREFETCH
#ifdef SD_AVX512
#define SD_ATT_PREFETCH 0
#else
#define SD_ATT_PREFETCH 1
#endif
#endif

/* sd_mat: sd.h */
typedef struct {
    sd_mat qkv, o, gate_up, down;         /* gate_up: the gate's N/2 columns, then the up's (unused with moe) */
    const uint16_t *ln1, *ln2;            /* (C,) bf16 norms before attention and before the MLP, or NULL (OLMo 2) */
    const uint16_t *post_attn, *post_ffn; /* (C,) norms of the attention and MLP outputs, or NULL (Gemma, OLMo 2) */
    const uint16_t *q_norm, *k_norm;      /* per head (hd,) or whole width (nh*hd,) / (nkv*hd,), or NULL */
    int64_t window;                       /* a sliding window (keys at positions > p - window), 0: none; such a
                                           * layer's attention reads the batch's windowed mask */
    int64_t rope;                         /* RoPE table: 0 the global one, 1 the windowed layers', -1 none (NoPE) */
    const sd_moe *moe;                    /* a mixture of experts in place of the dense MLP (moe.c), or NULL */
    const float *sinks;                   /* (nh,) fp32 each head's attention sink logit (gpt-oss), or NULL */
    /* a hybrid model's layers (recurrent.c): the token mixer, 0 attention (its keys and values in layer kv
     * of the cache), 1 LFM2's short convolution, 2 Qwen3.5's gated delta-net (qkv: in_proj, o: out_proj;
     * its rings: the batch's state layer `state`) */
    int64_t mixer, kv, state;
    const float *conv_wt, *conv_b;        /* (width, D) fp32 the convolution's weights tap-major, (D,) its bias or NULL */
    const float *neg_a, *dt_bias;         /* 2: (hv,) -exp(A_log) and dt_bias, fp32 */
    const uint16_t *gnorm;                /* 2: (dv,) bf16 the gated RMSNorm's weight */
} sd_layer;

typedef struct {
    int64_t n_layers, C, nh, nkv, hd, inter;
    double eps;
    const sd_layer *layers;
    const float *inv_freq; /* (rotary/2,) */
    const uint16_t *norm;  /* (C,) the final norm, bf16 */
    /* a family's switches (specdec/families.py; the math: models/llama.py) */
    int64_t qk_norm;         /* 0 none, 1 per head, 2 whole width */
    int64_t activation;      /* 0 SiLU (SwiGLU), 1 tanh GeLU (GeGLU), 2 gpt-oss's clamped SwiGLU (sd_act_mul) */
    int64_t rotary;          /* dimensions of each head RoPE turns (hd unless partial) */
    double attn_scale;       /* the scores' scale */
    double residual_scale;   /* each branch times it before its residual add (1: none) */
    double rope_factor;      /* cos and sin times it (YaRN, LongRoPE; 1: none) */
    const float *inv_freq_local; /* (rotary/2,) the windowed layers' own RoPE base, or NULL */
    double swiglu_limit, swiglu_alpha; /* activation 2's clamp and sigmoid scale */
    int64_t gate_out;        /* attention's output times sigmoid(gate) per head (Qwen3.5): qkv's query columns
                              * are each head's hd queries, then its hd gate values */
    int64_t width;           /* a hybrid's convolution taps (recurrent.c) */
    int64_t hk, hv, dk, dv;  /* its delta-nets' key and value heads and their sizes */
    double attn_softcap;     /* attention scores -> cap * tanh(score / cap) before the softmax (Gemma 2), 0: none */
} sd_model;

typedef struct {
    int64_t M;
    uint16_t *x;              /* (M, C) bf16: in the embeddings, out the final norm's output */
    const int64_t *pos;       /* (M,) RoPE positions */
    const int64_t *slot;      /* (M,) cache slots written */
    const int64_t *row;       /* (M,) table rows */
    const uint8_t *mask;      /* (M, L) visible keys, or NULL: the slots [0, slot] */
    int64_t L;                /* mask width, or 1 + the largest slot */
    uint16_t *kc, *vc;        /* (layers, blocks, nkv, 1 << bshift, hd) */
    int64_t layer_stride;     /* elements per layer of kc / vc */
    const int64_t *table;     /* (table rows, max_blocks) */
    int64_t max_blocks, bshift;
    const uint8_t *skip;      /* (n_layers,) layers not run, or NULL */
    const uint8_t *mask_win;  /* (M, L) the visible keys of windowed layers (mask AND a sliding window), or NULL */
    uint16_t *const *hidden;  /* (n_layers,) (M, C) outputs of x after each layer (entries may be NULL), or NULL */
    void *work;
    int64_t work_bytes;
    int64_t *moe_stats;       /* (n_layers, E, 3) += per expert: rows routed to it, gate/up and down tiles
                               * computed (each chosen expert's once per forward), or NULL */
    uint16_t *const *ring_in; /* per state layer: (table rows, slots, D) its convolution inputs by position (a
                               * hybrid's HybridCache.inputs), or NULL without recurrent layers */
    float *const *ring_state; /* per state layer: (table rows, slots, hv, dk, dv) its states, or NULL entries */
    int64_t slots;            /* the rings' entries per row */
    uint16_t *kc_win, *vc_win; /* the windowed layers' keys and values (KVCache.local: a layer with a window reads
                                * and writes these, with table_win), or NULL: every layer's are in kc / vc */
    int64_t win_stride;       /* elements per layer of kc_win / vc_win */
    const int64_t *table_win; /* (table rows, max_blocks_win) */
    int64_t max_blocks_win;
} sd_batch;

/* An entry point's status: -4 where a thread's scratch could not grow (AVX2 only, sd.h's sd_xf_failed; the
 * AVX-512 products need none). */
#ifdef SD_AVX512
#define XF_RESET()
#define XF_STATUS() 0
#else
#define XF_RESET() __atomic_store_n(&sd_xf_failed, 0, __ATOMIC_RELAXED)
#define XF_STATUS() (__atomic_load_n(&sd_xf_failed, __ATOMIC_RELAXED) ? -4 : 0)
#endif

/* ---- work split --------------------------------------------------------------------------------- */

static inline void split(int64_t n, int64_t align, int id, int nt, int64_t *a, int64_t *b) {
    const int64_t units = (n + align - 1) / align;
    *a = units * id / nt * align;
    *b = units * (id + 1) / nt * align;
    if (*a > n) *a = n;
    if (*b > n) *b = n;
}

/* Dynamic work: a phase's units (tiles, heads) taken by the threads in chunks from a shared counter, as
 * llama.cpp's matrix products take theirs, so a thread whose core is slowed (a busy sibling hyperthread,
 * another tenant of the host) does not leave the others waiting at the barrier. What a unit computes does
 * not depend on the thread that takes it, so no result changes. Two counters take turns: thread 0 zeroes
 * the next phase's while this one runs; the barrier after each phase orders the zeroing before its use
 * and after the counter's previous use. */
typedef struct {
    int64_t next;
    char pad[56];
} sd_counter;

#ifndef SD_DYNAMIC
#define SD_DYNAMIC 1
#endif
#ifndef SD_CHUNKS
#define SD_CHUNKS 4 /* chunks per thread, about */
#endif

#ifndef SD_STATIC_EIGHTHS
#define SD_STATIC_EIGHTHS 6
#endif
#ifndef SD_DYNAMIC_ROWS
#define SD_DYNAMIC_ROWS 2
#endif
/* The next chunk [*a, *b) of a phase's units (in multiples of align), or 0 when none is left: first the
 * thread's own share of the first SD_STATIC_EIGHTHS / 8 of them (one contiguous stream, no atomic), then
 * chunks of about 1 / SD_CHUNKS of a thread's share of the rest, from the counter. SD_DYNAMIC 0: the
 * thread's static share of all. turn: 0 before the first call. */
static inline int next_chunk(sd_counter *ctr, int64_t units, int64_t align, int64_t M, int id, int nt, int *turn,
                             int64_t *a, int64_t *b) {
    const int dyn = SD_DYNAMIC && M >= SD_DYNAMIC_ROWS;
    const int64_t fixed = dyn ? (units * SD_STATIC_EIGHTHS / 8) / ((int64_t)nt * align) * nt * align : units;
    if (!(*turn)++) {
        split(fixed, align, id, nt, a, b);
        if (*a < *b) return 1;
    }
    if (!dyn) return 0;
    int64_t chunk = (units - fixed) / ((int64_t)nt * SD_CHUNKS * align) * align;
    chunk = chunk > align ? chunk : align;
    *a = fixed + __atomic_fetch_add(&ctr->next, chunk, __ATOMIC_RELAXED);
    if (*a >= units) return 0;
    *b = *a + chunk < units ? *a + chunk : units;
    return 1;
}

/* y (M, N) = x W^T, the tiles taken in chunks from ctr (zeroed for this product) by every thread. */
static void product(const sd_mat *m, const uint16_t *x, const int8_t *xq, const float *xa, const float *xam,
                    int64_t M, void *y, int out_f32, float *part, sd_counter *ctr, int id, int nt) {
    const int64_t tiles = (m->N + 15) / 16, align = m->kind == 0 ? 8 : 1;
    int64_t t0, t1;
    int turn = 0;
    while (next_chunk(ctr, tiles, align, M, id, nt, &turn, &t0, &t1))
        sd_product_tiles(m, x, xq, xa, xam, M, y, out_f32, part, t0, t1);
}


/* ---- row operations (one body for both widths: SDV, sd.h) ----------------------------------------- */

/* out = RMSNorm(h) * w as models.llama.RMSNorm: fp32 statistics, the normalized row rounded to bf16,
 * times the bf16 weight rounded again. */
static void rms_norm(const uint16_t *h, const uint16_t *w, int64_t C, float eps, uint16_t *out) {
    SDV_T ss = SDV(setzero_ps)();
    for (int64_t c = 0; c < C; c += SDV_W) {
        const SDV_T v = sdv_ld_bf16(h + c);
        ss = SDV(fmadd_ps)(v, v, ss);
    }
    const float r = 1.0f / sqrtf(sdv_hsum(ss) / (float)C + eps);
    const SDV_T vr = SDV(set1_ps)(r);
    for (int64_t c = 0; c < C; c += SDV_W)
        sdv_st_bf16(out + c, SDV(mul_ps)(sdv_round_bf16(SDV(mul_ps)(sdv_ld_bf16(h + c), vr)), sdv_ld_bf16(w + c)));
}

/* x = x + d, rounded (a residual add in bf16). */
static void add_rows(uint16_t *x, const uint16_t *d, int64_t C) {
    for (int64_t c = 0; c < C; c += SDV_W) sdv_st_bf16(x + c, SDV(add_ps)(sdv_ld_bf16(x + c), sdv_ld_bf16(d + c)));
}

/* x = x * s, rounded (a bf16 tensor times a Python float: the product in fp32, then rounded) */
static void scale_row(uint16_t *x, float sc, int64_t C) {
    const SDV_T v = SDV(set1_ps)(sc);
    for (int64_t c = 0; c < C; c += SDV_W) sdv_st_bf16(x + c, SDV(mul_ps)(sdv_ld_bf16(x + c), v));
}

static void quantize_groups(const uint16_t *x, int64_t g0, int64_t g1, int8_t *xq, float *a, float *am) {
    for (int64_t g = g0; g < g1; g++) sd_quantize_group(x + g * SD_GS, xq + g * SD_GS, a + g, am + g);
}

#ifdef SD_AVX512
static inline __m512 ld_bf16_mask(const uint16_t *p, __mmask16 on) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(on, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* q' = q cos + rotate_half(q) sin on one head, each product and the sum rounded to bf16 as the
 * reference's bf16 tensors are; cs: cos (hd) then sin (hd), already bf16-rounded. */
static void rope_head(uint16_t *q, const float *cs, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t c = 0; c < half; c += 16) {
        const __mmask16 on = half - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (half - c)) - 1u);
        const __m512 a = ld_bf16_mask(q + c, on), b = ld_bf16_mask(q + half + c, on);
        const __m512 ca = _mm512_maskz_loadu_ps(on, cs + c), sa = _mm512_maskz_loadu_ps(on, cs + hd + c);
        const __m512 cb = _mm512_maskz_loadu_ps(on, cs + half + c), sb = _mm512_maskz_loadu_ps(on, cs + hd + half + c);
        const __m512 na = _mm512_sub_ps(_mm512_setzero_ps(), b); /* rotate_half: (-b, a) */
        const __m512 oa = _mm512_add_ps(sd_round_bf16(_mm512_mul_ps(a, ca)), sd_round_bf16(_mm512_mul_ps(na, sa)));
        const __m512 ob = _mm512_add_ps(sd_round_bf16(_mm512_mul_ps(b, cb)), sd_round_bf16(_mm512_mul_ps(a, sb)));
        _mm256_mask_storeu_epi16(q + c, on, sd_cvt_bf16(oa));
        _mm256_mask_storeu_epi16(q + half + c, on, sd_cvt_bf16(ob));
    }
}

#else
/* RoPE of one head (hd / 2 a multiple of 8), rounded as the AVX-512 build's rope_head */
static void rope_head(uint16_t *q, const float *cs, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t c = 0; c < half; c += 8) {
        const __m256 a = sd8_ld_bf16(q + c), b = sd8_ld_bf16(q + half + c);
        const __m256 ca = _mm256_loadu_ps(cs + c), sa = _mm256_loadu_ps(cs + hd + c);
        const __m256 cb = _mm256_loadu_ps(cs + half + c), sb = _mm256_loadu_ps(cs + hd + half + c);
        const __m256 na = _mm256_sub_ps(_mm256_setzero_ps(), b);
        const __m256 oa = _mm256_add_ps(sd8_round_bf16(_mm256_mul_ps(a, ca)), sd8_round_bf16(_mm256_mul_ps(na, sa)));
        const __m256 ob = _mm256_add_ps(sd8_round_bf16(_mm256_mul_ps(b, cb)), sd8_round_bf16(_mm256_mul_ps(a, sb)));
        sd8_st_bf16(q + c, oa);
        sd8_st_bf16(q + half + c, ob);
    }
}
#endif

/* ---- the forward -------------------------------------------------------------------------------- */

typedef struct {
    uint16_t *n, *qkv, *delta, *gu;
    int8_t *xq;
    float *xa, *xam, *part, *cs, *cs2;
    char *attn;
    int64_t attn_stride; /* bytes of attention scratch per thread */
    char *own;
    int64_t own_stride; /* bytes of a thread's own rows (its copy of the residual stream, its norms) */
    sd_moe moe_dims;    /* the largest E, k and sizes of the MoE layers (E 0: none) */
    char *moe, *moe_own; /* the MoE layers' shared buffers and the threads' own (moe.c) */
    int64_t moe_own_stride;
    uint16_t *mix;      /* (M, D) a delta-net's convolution output (recurrent.c) */
    int64_t *run0, *run1, *runs; /* per token: its run's first token and one past its last; the runs' first tokens */
    float *rec;         /* the threads' recurrence scratch, rec_stride floats each */
    int64_t rec_stride;
} workspace;

/* The rows' residual stream h and its normalized (and quantized) form: the threads' shared copy (h is
 * the batch's x), or a thread's own copy of every row. */
typedef struct {
    uint16_t *h, *n;
    int8_t *q;
    float *a, *am;
} own_rows;

static inline size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* The widest input of a product (the rows of n and its quantized form). */
static int64_t kmax(const sd_model *m) {
    int64_t k = max64(m->C, max64(m->nh * m->hd, m->inter));
    for (int64_t li = 0; li < m->n_layers; li++) k = max64(k, m->layers[li].o.K);
    return k;
}

/* The widest output of the layers' first products (qkv, or a recurrent mixer's in_proj). */
static int64_t max_qkv(const sd_model *m) {
    int64_t n = 0;
    for (int64_t li = 0; li < m->n_layers; li++) n = max64(n, m->layers[li].qkv.N);
    return n;
}

static int64_t max_tiles(const sd_model *m) {
    const int64_t n = max64(max_qkv(m), max64(2 * m->inter, m->C));
    return (n + 15) / 16;
}

/* Whether any layer is a recurrent mixer (recurrent.c). */
static int64_t has_mixers(const sd_model *m) {
    for (int64_t li = 0; li < m->n_layers; li++)
        if (m->layers[li].mixer) return 1;
    return 0;
}

/* The largest E, k and intermediate sizes of the model's MoE layers (all 0: none). */
static sd_moe moe_dims(const sd_model *m) {
    sd_moe d;
    memset(&d, 0, sizeof d);
    for (int64_t li = 0; li < m->n_layers; li++) {
        const sd_moe *e = m->layers[li].moe;
        if (!e) continue;
        d.E = e->E > d.E ? e->E : d.E;
        d.k = e->k > d.k ? e->k : d.k;
        d.inter = e->inter > d.inter ? e->inter : d.inter;
        d.shared_inter = e->shared_inter > d.shared_inter ? e->shared_inter : d.shared_inter;
    }
    return d;
}

/* The next piece of a layout: dst->field at base + off (when dst is not NULL), count elements of type. */
#define TAKE(dst, field, type, count)                            \
    do {                                                         \
        if (dst) (dst)->field = (type *)(base + off);            \
        off += up64(sizeof(type) * (size_t)(count));             \
    } while (0)

static size_t own_layout(const sd_model *m, int64_t M, own_rows *o, char *base) {
    const int64_t C = m->C;
    size_t off = 0;
    TAKE(o, h, uint16_t, M * C);
    TAKE(o, n, uint16_t, M * C);
    TAKE(o, q, int8_t, M * C);
    TAKE(o, a, float, M * C / SD_GS);
    TAKE(o, am, float, M * C / SD_GS);
    return off;
}

static size_t layout(const sd_model *m, int64_t M, int64_t L, int nt, workspace *ws, char *base) {
    const int64_t K = kmax(m), nqkv = max_qkv(m), G = m->nh / m->nkv;
    size_t off = 0;
    TAKE(ws, n, uint16_t, M * K);
    TAKE(ws, qkv, uint16_t, M * nqkv);
    TAKE(ws, delta, uint16_t, M * m->C);
    TAKE(ws, gu, uint16_t, M * 2 * m->inter);
    TAKE(ws, xq, int8_t, M * K);
    TAKE(ws, xa, float, M * K / SD_GS);
    TAKE(ws, xam, float, M * K / SD_GS);
    TAKE(ws, part, float, max_tiles(m) * M * 16);
    TAKE(ws, cs, float, M * 2 * m->hd);
    TAKE(ws, cs2, float, m->inv_freq_local ? M * 2 * m->hd : 1);
    const size_t per = up64(sizeof(float) * (size_t)(SD_MAXR * G * L)) + up64(sizeof(int64_t) * (size_t)(SD_MAXR * L))
                       + up64(sizeof(float) * (size_t)(SD_MAXR * G * m->hd));
    if (ws) ws->attn_stride = (int64_t)per;
    TAKE(ws, attn, char, per * (size_t)nt);
    const size_t own = own_layout(m, M, NULL, NULL);
    if (ws) ws->own_stride = (int64_t)own;
    TAKE(ws, own, char, own * (size_t)(nt + 1)); /* the threads' own copies, then the shared one */
    const sd_moe d = moe_dims(m);
    const size_t mown = d.E ? up64((size_t)sd_moe_own_bytes(&d, M, m->C)) : 0;
    if (ws) {
        ws->moe_dims = d;
        ws->moe_own_stride = (int64_t)mown;
    }
    TAKE(ws, moe, char, d.E ? sd_moe_shared_bytes(&d, M, m->C) : 0);
    TAKE(ws, moe_own, char, mown * (size_t)nt);
    const int64_t mixers = has_mixers(m), delta = mixers && m->dk > 0;
    TAKE(ws, mix, uint16_t, delta ? M * (2 * m->hk * m->dk + m->hv * m->dv) : 0);
    TAKE(ws, run0, int64_t, M);
    TAKE(ws, run1, int64_t, M);
    TAKE(ws, runs, int64_t, M);
    const int64_t rec = delta ? (int64_t)(up64(sizeof(float) * (size_t)sd_mixer_scratch_floats(m->dk, m->dv)) / sizeof(float)) : 0;
    if (ws) ws->rec_stride = rec;
    TAKE(ws, rec, float, rec * nt);
#undef TAKE
    return off;
}

/* Bytes of workspace sd_forward needs for M tokens, a key range of L and nt threads. */
int64_t sd_forward_work_bytes(const sd_model *m, int64_t M, int64_t L, int64_t nt) {
    return (int64_t)layout(m, M, L, (int)nt, NULL, NULL);
}

int64_t sd_num_threads(void) { return omp_get_max_threads(); }

/* sizeof sd_layer, sd_model, sd_batch and sd_moe: models/native.py checks its ctypes mirrors against them at load */
void sd_forward_struct_sizes(int64_t *out) {
    out[0] = (int64_t)sizeof(sd_layer);
    out[1] = (int64_t)sizeof(sd_model);
    out[2] = (int64_t)sizeof(sd_batch);
    out[3] = (int64_t)sizeof(sd_moe);
}

/* Tokens in the attention group starting at t0: consecutive tokens of t0's cache row, at most SD_MAXR
 * (groups start at token 0, at a change of row, and after SD_MAXR tokens of one group). */
static int64_t group_len(const sd_batch *b, int64_t t0, int64_t M) {
    int64_t n = 1;
    while (t0 + n < M && n < SD_MAXR && b->row[t0 + n] == b->row[t0]) n++;
    return n;
}

/* Whether an MoE layer's input rows go quantized to some expert. */
static int moe_quantized(const sd_moe *e) {
    int q = e->shared_inter && e->shared_gate_up.kind;
    for (int64_t i = 0; i < e->E; i++) q |= e->experts[2 * i].kind != 0;
    return q;
}

/* Rows [t0, t1): h += d (d NULL: none), n = RMSNorm(h) * w (w NULL: n = h), quantized when q. */
static void norm_rows(own_rows *o, const uint16_t *d, const uint16_t *w, int64_t t0, int64_t t1, int64_t C, float eps,
                      int q) {
    for (int64_t t = t0; t < t1; t++) {
        if (d) add_rows(o->h + t * C, d + t * C, C);
        if (w)
            rms_norm(o->h + t * C, w, C, eps, o->n + t * C);
        else /* no norm before the product (OLMo 2's post-norm blocks): the stream itself */
            memcpy(o->n + t * C, o->h + t * C, sizeof(uint16_t) * (size_t)C);
        if (q) quantize_groups(o->n + t * C, 0, C / SD_GS, o->q + t * C, o->a + t * (C / SD_GS), o->am + t * (C / SD_GS));
    }
}

/* The first key a group of R tokens from t0 can see in a layer of sliding window w (0: none): keys at slots
 * <= pos - w are outside every token's window; rounded down to a whole cache block and to 16 keys, so the
 * attention kernels skip (and never prefetch) the keys behind the window at the same bits. */
static inline int64_t window_start(const sd_batch *b, int64_t w, int64_t t0, int64_t R) {
    if (!w) return 0;
    int64_t p = b->pos[t0];
    for (int64_t r = 1; r < R; r++) p = b->pos[t0 + r] < p ? b->pos[t0 + r] : p;
    const int64_t align = ((int64_t)1 << b->bshift) > 16 ? ((int64_t)1 << b->bshift) : 16;
    const int64_t j = p - w + 1;
    return j > 0 ? j / align * align : 0;
}

/* h += the branch d, first normalized by post (NULL: not) and times rs (1: not), each step rounded as the
 * reference's; tmp: a row of scratch. */
static void add_branch(uint16_t *h, const uint16_t *d, const uint16_t *post, float rs, int64_t C, float eps,
                       uint16_t *tmp) {
    if (post) {
        rms_norm(d, post, C, eps, tmp);
        d = tmp;
    }
    if (rs != 1.0f) {
        if (d != tmp) memcpy(tmp, d, sizeof(uint16_t) * (size_t)C);
        scale_row(tmp, rs, C);
        d = tmp;
    }
    add_rows(h, d, C);
}

/* One token's new heads [u0, u1) of qkv (q heads, each followed by its gate head with gate_out, then k,
 * then v): the per-head q/k norm, RoPE of the q and k heads with the layer's table, and the k and v heads
 * written to the cache (a gate head stays as it is). */
static void finish_heads(const sd_model *m, const sd_layer *L, const sd_batch *b, const workspace *ws, int64_t t,
                         int64_t u0, int64_t u1, uint16_t *kl, uint16_t *vl, float eps) {
    const int64_t nh = m->nh, nkv = m->nkv, hd = m->hd, gq = m->gate_out ? 2 : 1, nqkv = (gq * nh + 2 * nkv) * hd;
    const int64_t sl = b->slot[t];
    const int64_t blk = b->table[b->row[t] * b->max_blocks + (sl >> b->bshift)];
    const int64_t in_blk = sl & (((int64_t)1 << b->bshift) - 1);
    const float *cs = (L->rope == 1 ? ws->cs2 : ws->cs) + t * 2 * hd;
    for (int64_t u = u0; u < u1; u++) {
        if (u < gq * nh && u % gq) continue; /* a gate head */
        const int64_t h = u < gq * nh ? u / gq : u - (gq - 1) * nh; /* q heads 0..nh-1, k heads, v heads */
        uint16_t *head = ws->qkv + t * nqkv + u * hd;
        if (m->qk_norm == 1 && h < nh + nkv) rms_norm(head, h < nh ? L->q_norm : L->k_norm, hd, eps, head);
        if (h < nh + nkv && L->rope >= 0) rope_head(head, cs, m->rotary);
        if (h >= nh) {
            const int64_t kh = h < nh + nkv ? h - nh : h - nh - nkv;
            const int64_t at = (((blk * nkv + kh) << b->bshift) | in_blk) * hd;
            memcpy((h < nh + nkv ? kl : vl) + at, head, sizeof(uint16_t) * (size_t)hd);
        }
    }
}

/* y = y * sigmoid(g) over one head, the sigmoid rounded to bf16, then the product (the reference's bf16 ops:
 * Qwen3.5's gated attention output) */
static void gate_head(uint16_t *y, const uint16_t *g, int64_t hd) {
    for (int64_t c = 0; c < hd; c += SDV_W)
        sdv_st_bf16(y + c, SDV(mul_ps)(sdv_ld_bf16(y + c), sdv_round_bf16(sigmoid_v(sdv_ld_bf16(g + c)))));
}

/* One thread's part of a forward, inside sd_forward's parallel region: what its stages share. */
typedef struct {
    const sd_model *m;
    const sd_batch *b;
    const workspace *ws;
    sd_counter *ctr;  /* the two counters of the dynamic phases, taking turns (next_chunk) */
    int64_t phase;    /* the dynamic phases run so far: every thread counts the same */
    int id, n_t;      /* this thread and the number of threads */
    int64_t r0, r1;   /* this thread's share of the rows */
    int own_mode;     /* fewer rows than threads: the thread keeps its own copy of every row */
    int64_t q0, q1;   /* the rows of its row steps: r0 .. r1, or every row (own_mode) */
    own_rows own;     /* the residual stream and its normalized form: its own copy, or the shared one */
    float *s, *ao;    /* its attention scratch (sd_attn_rows' s and o) */
    int64_t *idx;
    int64_t ngroups;  /* attention groups of the block (group_len) */
    int64_t nruns;    /* the recurrent mixers' runs (ws->runs) */
    float scale, eps, rs, lim, alpha;
} fwd_thread;

/* The counter of the dynamic phase starting now; thread 0 zeroes the next phase's. */
static inline sd_counter *phase_counter(fwd_thread *f) {
    if (f->id == 0) __atomic_store_n(&f->ctr[(f->phase + 1) & 1].next, 0, __ATOMIC_RELAXED);
    return &f->ctr[f->phase++ & 1];
}

/* A recurrent mixer's phases (recurrent.c) in place of B, C and D, by every thread: in_proj's product into
 * qkv, the convolution (units of a token's channels), a delta-net's recurrence ((run, value head) units),
 * then, every read of the rings done, the kept tokens' convolution inputs into the ring (this thread's rows
 * r0 .. r1); the output (quantized for a quantized out_proj) in n for E. */
static void recurrent_mixer(fwd_thread *f, const sd_layer *L) {
    const sd_model *m = f->m;
    const sd_batch *b = f->b;
    const workspace *ws = f->ws;
    const own_rows *own = &f->own;
    const int64_t M = b->M, r0 = f->r0, r1 = f->r1;
    const int id = f->id, n_t = f->n_t;
    float *scratch = ws->rec + ws->rec_stride * id;
    const int64_t K = L->o.K, D = L->mixer == 1 ? m->C : 2 * m->hk * m->dk + m->hv * m->dv;
    const sd_mixer_call c = {L->mixer, M, D, L->qkv.N, m->width, m->hk, m->hv, m->dk, m->dv, f->eps, L->conv_wt,
                             L->conv_b, L->neg_a, L->dt_bias, L->gnorm, ws->qkv, b->pos, b->row, ws->run0, ws->run1,
                             b->ring_in[L->state], b->ring_state ? b->ring_state[L->state] : NULL, b->slots, ws->mix,
                             ws->n, L->o.kind ? ws->xq : NULL, ws->xa, ws->xam};
    product(&L->qkv, own->n, own->q, own->a, own->am, M, ws->qkv, 0, ws->part, phase_counter(f), id, n_t);
#pragma omp barrier
    {
        sd_counter *pc = phase_counter(f);
        int64_t u0, u1;
        int turn = 0;
        while (next_chunk(pc, sd_mixer_conv_units(&c), 1, M, id, n_t, &turn, &u0, &u1)) sd_mixer_conv(&c, u0, u1);
    }
#pragma omp barrier
    if (L->mixer == 2) {
        sd_counter *pc = phase_counter(f);
        int64_t u0, u1;
        int turn = 0;
        while (next_chunk(pc, f->nruns * m->hv, 1, M, id, n_t, &turn, &u0, &u1))
            for (int64_t u = u0; u < u1; u++) {
                const int64_t t0 = ws->runs[u / m->hv];
                sd_mixer_delta(&c, t0, ws->run1[t0] - t0, u % m->hv, scratch);
            }
#pragma omp barrier
        if (L->o.kind && m->dv % SD_GS) { /* a head's output is not whole groups: quantized by rows */
            for (int64_t t = r0; t < r1; t++)
                quantize_groups(ws->n + t * K, 0, K / SD_GS, ws->xq + t * K, ws->xa + t * (K / SD_GS),
                                ws->xam + t * (K / SD_GS));
#pragma omp barrier
        }
    }
    sd_mixer_store(&c, r0, r1);
}

/* Whether layer L's shapes are the ones this call can run (0: they are). */
static int bad_layer(const sd_model *m, const sd_layer *L, const sd_batch *b) {
    const int64_t C = m->C, gq = m->gate_out ? 2 : 1, nqkv = (gq * m->nh + 2 * m->nkv) * m->hd;
    if (L->mixer == 0) return L->qkv.N != nqkv || L->o.K != m->nh * m->hd || L->kv < 0;
    if (!b->ring_in || !b->ring_in[L->state] || b->slots < 1 || m->width < 1 || !L->conv_wt || L->o.N != C) return 1;
    if (L->mixer == 1) return L->qkv.N != 3 * C || L->o.K != C;
    const int64_t D = 2 * m->hk * m->dk + m->hv * m->dv;
    return L->mixer != 2 || m->hk < 1 || m->hv % m->hk || m->dk % 16 || m->dv % 16 || !b->ring_state ||
           !b->ring_state[L->state] || !L->neg_a || !L->dt_bias || !L->gnorm ||
           L->qkv.N != D + m->hv * m->dv + 2 * m->hv || L->o.K != m->hv * m->dv;
}

/* ---- the forward's stages, by every thread of sd_forward's parallel region ------------------------ */

/* Before the first layer: this thread's rows (its own copy of every row, or its share of the shared ones),
 * the attention groups, the recurrent mixers' runs of its rows and the RoPE tables of its rows. A barrier
 * follows (the runs and tables are read by every thread). */
static void begin_rows(fwd_thread *f) {
    const sd_model *m = f->m;
    const sd_batch *b = f->b;
    const workspace *ws = f->ws;
    const int64_t M = b->M, C = m->C, hd = m->hd, G = m->nh / m->nkv, rd = m->rotary;
    split(M, 1, f->id, f->n_t, &f->r0, &f->r1);
    const int64_t r0 = f->r0, r1 = f->r1;
    f->s = (float *)((char *)ws->attn + ws->attn_stride * f->id);
    f->idx = (int64_t *)((char *)f->s + up64(sizeof(float) * (size_t)(SD_MAXR * G * b->L)));
    f->ao = (float *)((char *)f->idx + up64(sizeof(int64_t) * (size_t)(SD_MAXR * b->L)));
    /* rows: this thread's own copy of every row (q0, q1 = 0, M), or the shared rows r0 .. r1 */
    f->own_mode = M < f->n_t;
    own_layout(m, M, &f->own, ws->own + ws->own_stride * (f->own_mode ? f->id : f->n_t));
    f->q0 = f->own_mode ? 0 : r0;
    f->q1 = f->own_mode ? M : r1;
    if (f->own_mode)
        memcpy(f->own.h, b->x, sizeof(uint16_t) * (size_t)(M * C));
    else
        f->own.h = b->x;
    /* attention groups: runs of consecutive tokens of one cache row, at most SD_MAXR each */
    f->ngroups = 0;
    for (int64_t t = 0; t < M; t += group_len(b, t, M)) f->ngroups++;
    /* the recurrent mixers' runs: consecutive tokens of one row at consecutive positions */
    for (int64_t t = r0; t < r1; t++) {
        int64_t a = t, e = t + 1;
        while (a > 0 && b->row[a - 1] == b->row[a] && b->pos[a - 1] + 1 == b->pos[a]) a--;
        while (e < M && b->row[e] == b->row[e - 1] && b->pos[e] == b->pos[e - 1] + 1) e++;
        ws->run0[t] = a;
        ws->run1[t] = e;
    }
    /* RoPE tables of every token: cos then sin over the rotary dimensions (times the YaRN / LongRoPE
     * factor), rounded to bf16 as the reference's; the windowed layers' own table beside it */
    const float rf = (float)m->rope_factor;
    for (int tab = 0; tab < 2; tab++) {
        const float *inv = tab ? m->inv_freq_local : m->inv_freq;
        if (!inv) continue;
        for (int64_t t = r0; t < r1; t++)
            for (int64_t i = 0; i < rd / 2; i++) {
                const float ang = (float)b->pos[t] * inv[i];
                const float c = round_bf16(cosf(ang) * rf), sn = round_bf16(sinf(ang) * rf);
                float *cs = (tab ? ws->cs2 : ws->cs) + t * 2 * hd;
                cs[i] = cs[i + rd / 2] = c;
                cs[rd + i] = cs[rd + i + rd / 2] = sn;
            }
    }
}

/* After begin_rows' barrier: the number of runs, counted by every thread; thread 0 lists them (read after
 * the next barriers). */
static void count_runs(fwd_thread *f) {
    const workspace *ws = f->ws;
    f->nruns = 0;
    for (int64_t t = 0; t < f->b->M; t++)
        if (ws->run0[t] == t) {
            if (f->id == 0) ws->runs[f->nruns] = t;
            f->nruns++;
        }
}

/* The stream after layer li into the batch's hidden output, this thread's share of the rows (if asked). */
static void keep_hidden(const fwd_thread *f, int64_t li) {
    const sd_batch *b = f->b;
    const int64_t C = f->m->C;
    if (b->hidden && b->hidden[li])
        memcpy(b->hidden[li] + f->r0 * C, f->own.h + f->r0 * C, sizeof(uint16_t) * (size_t)((f->r1 - f->r0) * C));
}

/* The batch as layer L's attention reads its keys and values: a windowed layer's in the windowed group,
 * with its own table. */
static sd_batch layer_kv(const sd_batch *b, const sd_layer *L) {
    sd_batch kbv = *b;
    if (L->window && b->kc_win) {
        kbv.kc = b->kc_win;
        kbv.vc = b->vc_win;
        kbv.layer_stride = b->win_stride;
        kbv.table = b->table_win;
        kbv.max_blocks = b->max_blocks_win;
    }
    return kbv;
}

/* The cache this thread's attention items will read (see attend), asked for ahead into L2. */
static void prefetch_kv(const fwd_thread *f, const sd_layer *L, const sd_batch *kb) {
    const sd_model *m = f->m;
    const sd_batch *b = f->b;
    const int64_t M = b->M, nh = m->nh, nkv = m->nkv, hd = m->hd, G = nh / nkv;
    const uint16_t *kl = kb->kc + L->kv * kb->layer_stride, *vl = kb->vc + L->kv * kb->layer_stride;
    int64_t a0, a1;
    split(f->ngroups * nh, 1, f->id, f->n_t, &a0, &a1);
    int64_t t0 = 0, gi = 0, last = -1;
    for (int64_t it = a0; it < a1; it++) {
        const int64_t gr = it / nh, kh = (it % nh) / G;
        if (gr * nkv + kh == last) continue;
        last = gr * nkv + kh;
        for (; gi < gr; gi++) t0 += group_len(b, t0, M);
        const int64_t R = group_len(b, t0, M);
        const uint8_t *mk = L->window ? b->mask_win : b->mask;
        int64_t nk = mk ? b->L : 0; /* the keys of the group's tokens */
        for (int64_t r = 0; r < R && !mk; r++) nk = b->slot[t0 + r] + 1 > nk ? b->slot[t0 + r] + 1 : nk;
        sd_attn_prefetch(kl, vl, kb->table + b->row[t0] * kb->max_blocks, nkv, kh, b->bshift, hd,
                         window_start(b, L->window, t0, R), nk);
    }
}

/* B, C: a chunk of heads of qkv (bf16: whole groups of 8 tiles), then RoPE of its query and key heads and
 * the cache writes of its key and value heads, chunk after chunk; OLMo 2's whole-width q and k norms after
 * every head is made. Ends at a barrier. */
static void qkv_heads(fwd_thread *f, const sd_layer *L, const sd_batch *kb) {
    const sd_model *m = f->m;
    const workspace *ws = f->ws;
    const int64_t M = f->b->M, nh = m->nh, nkv = m->nkv, hd = m->hd, gq = m->gate_out ? 2 : 1;
    const int64_t q_size = nh * hd, nqkv = (gq * nh + 2 * nkv) * hd;
    const float eps = f->eps;
    uint16_t *kl = kb->kc + L->kv * kb->layer_stride, *vl = kb->vc + L->kv * kb->layer_stride;
    {
        sd_counter *pc = phase_counter(f);
        const int64_t units = gq * nh + 2 * nkv, align = L->qkv.kind == 0 && hd < 128 ? 128 / hd : 1;
        int64_t h0, h1;
        int turn = 0;
        while (next_chunk(pc, units, align, M, f->id, f->n_t, &turn, &h0, &h1)) {
            sd_product_tiles(&L->qkv, f->own.n, f->own.q, f->own.a, f->own.am, M, ws->qkv, 0, ws->part, h0 * hd / 16,
                             h1 * hd / 16);
            if (m->qk_norm != 2)
                for (int64_t t = 0; t < M; t++) finish_heads(m, L, kb, ws, t, h0, h1, kl, vl, eps);
        }
    }
#pragma omp barrier
    if (m->qk_norm == 2) { /* OLMo 2: q and k normalized over all their heads, so after every head is made */
        for (int64_t t = f->r0; t < f->r1; t++) {
            uint16_t *row = ws->qkv + t * nqkv;
            rms_norm(row, L->q_norm, q_size, eps, row);
            rms_norm(row + q_size, L->k_norm, nkv * hd, eps, row + q_size);
            finish_heads(m, L, kb, ws, t, 0, nh + 2 * nkv, kl, vl, eps);
        }
#pragma omp barrier
    }
}

/* D: attention into n (M, q_size), the (token group, query head) pairs split evenly among the threads; a
 * thread's heads of one kv head run as one item, whose tokens and heads read each key once (sd_attn_rows).
 * A row's bits do not depend on the heads beside it, so the split (3 kv heads on 2 threads: 5 + 4 heads, not
 * 6 + 3) changes no result. An item quantizes its own output for a quantized output product (groups of 32
 * within a head); else, for a quantized one, the rows are quantized after the barrier. Ends at a barrier. */
static void attend(fwd_thread *f, const sd_layer *L, const sd_batch *kb) {
    const sd_model *m = f->m;
    const sd_batch *b = f->b;
    const workspace *ws = f->ws;
    const int64_t M = b->M, nh = m->nh, nkv = m->nkv, hd = m->hd, G = nh / nkv, gq = m->gate_out ? 2 : 1;
    const int64_t q_size = nh * hd, nqkv = (gq * nh + 2 * nkv) * hd;
    const int fuse_q = L->o.kind && hd % SD_GS == 0;
    {
        const uint16_t *kl = kb->kc + L->kv * kb->layer_stride, *vl = kb->vc + L->kv * kb->layer_stride;
        const uint8_t *mk = L->window ? b->mask_win : b->mask; /* a windowed layer's keys: its own mask */
        int64_t a0, a1;
        split(f->ngroups * nh, 1, f->id, f->n_t, &a0, &a1);
        int64_t t0 = 0, gi = 0; /* the first token of group gi */
        for (int64_t it = a0; it < a1;) {
            const int64_t gr = it / nh, kh = (it % nh) / G, g0 = it % G;
            const int64_t g1 = G - g0 < a1 - it ? G : g0 + (a1 - it);
            for (; gi < gr; gi++) t0 += group_len(b, t0, M);
            const int64_t R = group_len(b, t0, M);
            int64_t nkeys[SD_MAXR];
            for (int64_t r = 0; r < R; r++) nkeys[r] = b->slot[t0 + r] + 1;
            const int64_t c0 = (kh * G + g0) * hd, c1 = (kh * G + g1) * hd;
            sd_attn_rows(ws->qkv + t0 * nqkv + gq * c0, nqkv, gq * hd, f->scale, kl, vl,
                         kb->table + b->row[t0] * kb->max_blocks, nkv, kh, b->bshift, hd, g1 - g0,
                         mk ? mk + t0 * b->L : NULL, b->L, nkeys, R, f->s, f->idx, f->ao,
                         ws->n + t0 * q_size + c0, q_size, window_start(b, L->window, t0, R),
                         L->sinks ? L->sinks + kh * G + g0 : NULL, (float)m->attn_softcap);
            if (m->gate_out) /* Qwen3.5: each head's output times sigmoid(its gate), in bf16 */
                for (int64_t t = t0; t < t0 + R; t++)
                    for (int64_t hh = kh * G + g0; hh < kh * G + g1; hh++)
                        gate_head(ws->n + t * q_size + hh * hd, ws->qkv + t * nqkv + (2 * hh + 1) * hd, hd);
            if (fuse_q)
                for (int64_t t = t0; t < t0 + R; t++)
                    quantize_groups(ws->n + t * q_size, c0 / SD_GS, c1 / SD_GS, ws->xq + t * q_size,
                                    ws->xa + t * (q_size / SD_GS), ws->xam + t * (q_size / SD_GS));
            it += g1 - g0;
        }
    }
#pragma omp barrier
    if (L->o.kind && !fuse_q) {
        for (int64_t t = f->r0; t < f->r1; t++)
            quantize_groups(ws->n + t * q_size, 0, q_size / SD_GS, ws->xq + t * q_size, ws->xa + t * (q_size / SD_GS),
                            ws->xam + t * (q_size / SD_GS));
#pragma omp barrier
    }
}

/* The attention mixer in place of B, C, D: the layer's cache asked for ahead (SD_ATT_PREFETCH), the qkv
 * heads, attention. Ends at a barrier. */
static void attention_block(fwd_thread *f, const sd_layer *L) {
    const sd_batch kbv = layer_kv(f->b, L);
    if (SD_ATT_PREFETCH) prefetch_kv(f, L, &kbv);
    qkv_heads(f, L, &kbv);
    attend(f, L, &kbv);
}

/* The mixture of experts' phases (moe.c) in place of G, H and I, then J with its rows' outputs. */
static void moe_block(fwd_thread *f, const sd_layer *L, int64_t li) {
    const sd_model *m = f->m;
    const sd_batch *b = f->b;
    const workspace *ws = f->ws;
    const int64_t M = b->M, C = m->C;
    const own_rows *own = &f->own;
    const sd_moe_call mc = {L->moe, &ws->moe_dims, M, C, f->n_t, own->n, own->q, own->a, own->am, ws->moe,
                            ws->moe_own + ws->moe_own_stride * f->id, m->activation, f->lim, f->alpha,
                            b->moe_stats ? b->moe_stats + li * ws->moe_dims.E * 3 : NULL};
    for (int ph = 0; ph < 3; ph++) {
        if (ph == 1) sd_moe_route(&mc, f->id == 0);
        sd_counter *pc = phase_counter(f);
        const int64_t units = sd_moe_units(&mc, ph);
        int64_t u0, u1;
        int turn = 0;
        while (next_chunk(pc, units, 1, M, f->id, f->n_t, &turn, &u0, &u1)) sd_moe_run(&mc, ph, u0, u1);
#pragma omp barrier
    }
    for (int64_t t = f->q0; t < f->q1; t++) {
        sd_moe_combine(&mc, t, own->n + t * C);
        add_branch(own->h + t * C, own->n + t * C, L->post_ffn, f->rs, C, f->eps, own->n + t * C);
    }
}

/* The dense MLP: G, H (a chunk of columns of the gate and the same of the up half, then act(gate) * up on
 * them, each rounded as the reference's bf16 ops, quantized per group of 32 for the down product), I (the
 * down product), J (the residual: the same rows as this thread's next A, no barrier needed). */
static void mlp_block(fwd_thread *f, const sd_layer *L) {
    const sd_model *m = f->m;
    const workspace *ws = f->ws;
    const int64_t M = f->b->M, C = m->C, I = m->inter;
    const own_rows *own = &f->own;
    {
        sd_counter *pc = phase_counter(f);
        const int64_t units = I / 16, align = L->gate_up.kind || L->down.kind ? 2 : 8, gpr = I / SD_GS;
        int64_t c0, c1;
        int turn = 0;
        while (next_chunk(pc, units, align, M, f->id, f->n_t, &turn, &c0, &c1)) {
            sd_product_tiles(&L->gate_up, own->n, own->q, own->a, own->am, M, ws->gu, 0, ws->part, c0, c1);
            sd_product_tiles(&L->gate_up, own->n, own->q, own->a, own->am, M, ws->gu, 0, ws->part, I / 16 + c0,
                             I / 16 + c1);
            for (int64_t t = 0; t < M; t++) {
                const uint16_t *gp = ws->gu + t * 2 * I, *up = gp + I;
                uint16_t *o = ws->n + t * I;
                sd_act_mul((int)m->activation, f->lim, f->alpha, o, gp, up, 16 * c0, 16 * c1);
                if (L->down.kind) quantize_groups(o, c0 / 2, c1 / 2, ws->xq + t * I, ws->xa + t * gpr, ws->xam + t * gpr);
            }
        }
    }
#pragma omp barrier
    /* I */
    product(&L->down, ws->n, ws->xq, ws->xa, ws->xam, M, ws->delta, 0, ws->part, phase_counter(f), f->id, f->n_t);
#pragma omp barrier
    /* J (rows) */
    for (int64_t t = f->q0; t < f->q1; t++)
        add_branch(own->h + t * C, ws->delta + t * C, L->post_ffn, f->rs, C, f->eps, own->n + t * C);
}

/* Layer li: A, the token mixer (attention or recurrent), E, F, the MLP (dense or experts) with J; the
 * stream after it into the batch's hidden output. A skipped layer leaves the stream as it is. */
static void layer(fwd_thread *f, int64_t li) {
    const sd_model *m = f->m;
    const sd_batch *b = f->b;
    const workspace *ws = f->ws;
    const sd_layer *L = m->layers + li;
    const int64_t M = b->M, C = m->C;
    if (b->skip && b->skip[li]) {
        keep_hidden(f, li);
        return;
    }
    /* A (rows): the input norm, quantized for a quantized qkv */
    norm_rows(&f->own, NULL, L->ln1, f->q0, f->q1, C, f->eps, (int)L->qkv.kind);
    if (!f->own_mode) {
#pragma omp barrier
    }
    if (L->mixer) /* a recurrent mixer (recurrent.c) in place of B, C, D */
        recurrent_mixer(f, L);
    else
        attention_block(f, L);
    /* E */
    product(&L->o, ws->n, ws->xq, ws->xa, ws->xam, M, ws->delta, 0, ws->part, phase_counter(f), f->id, f->n_t);
#pragma omp barrier
    /* F (rows): the residual and the post-attention norm */
    for (int64_t t = f->q0; t < f->q1; t++)
        add_branch(f->own.h + t * C, ws->delta + t * C, L->post_attn, f->rs, C, f->eps, f->own.n + t * C);
    norm_rows(&f->own, NULL, L->ln2, f->q0, f->q1, C, f->eps, L->moe ? moe_quantized(L->moe) : (int)L->gate_up.kind);
    if (!f->own_mode) {
#pragma omp barrier
    }
    if (L->moe)
        moe_block(f, L, li);
    else
        mlp_block(f, L);
    keep_hidden(f, li);
}

/* Returns 0, -1 on unsupported shapes, -3 when the workspace is too small, -4 when
 * a thread's scratch could not be allocated (AVX2).
 *
 * A chunk of the qkv product is whole heads, so the thread that computed it applies RoPE to them and
 * writes their keys and values to the cache itself; attention items quantize their own output for the
 * output product; a chunk of the gate/up product is the same columns of both halves, so its thread
 * applies SiLU to them itself. The row steps (residual adds, norms, their quantization) split the rows
 * among the threads, with a barrier after the two norms; with fewer rows than threads (a decode step:
 * one row), where a thread would have none, every thread keeps its own copy of the residual stream and
 * runs the row steps for every row itself, and those two barriers go: the threads then meet five times a layer
 * (after the qkv heads, attention, the output product, the gate/up columns and the down product), one
 * more when the output product's quantization groups straddle heads.
 *
 * The stages, each run by every thread: begin_rows (barrier) count_runs, then per layer (layer) A, the
 * mixer (attention_block: prefetch_kv, qkv_heads, attend; or recurrent_mixer), E, F, the MLP (mlp_block or
 * moe_block) with J, and at the end the final norm of the thread's rows. */
int sd_forward(const sd_model *m, const sd_batch *b) {
    const int64_t M = b->M, C = m->C, nh = m->nh, nkv = m->nkv, hd = m->hd, I = m->inter;
    const int64_t G = nh / nkv, q_size = nh * hd;
    if (hd % 16 || hd > SD_MAXHD || G > SD_MAXG || nh % nkv || C % 32 || I % 32 || q_size % 32 || b->bshift < 3 ||
        (m->gate_out && m->qk_norm == 2))
        return -1;
    for (int64_t li = 0; li < m->n_layers; li++)
        if (bad_layer(m, m->layers + li, b)) return -1;
    const int nt = omp_get_max_threads();
    workspace ws;
    if ((int64_t)layout(m, M, b->L, nt, &ws, (char *)b->work) > b->work_bytes) return -3;
    const float scale = (float)m->attn_scale, eps = (float)m->eps, rs = (float)m->residual_scale;
    const int64_t rd = m->rotary;
    if (rd > hd || rd % 16 || (m->qk_norm == 2 && (q_size % 16 || (nkv * hd) % 16))) return -1;
    for (int64_t li = 0; li < m->n_layers; li++) {
        const sd_moe *e = m->layers[li].moe;
        if (e && (e->k < 1 || e->k > e->E || e->gate.N != e->E || e->gate.kind || e->inter % 32 || e->shared_inter % 32))
            return -1;
    }
    const float lim = (float)m->swiglu_limit, alpha = (float)m->swiglu_alpha;
    sd_counter ctr[2] __attribute__((aligned(64))) = {{0}, {0}};
    XF_RESET();
#pragma omp parallel num_threads(nt)
    {
        fwd_thread f = {.m = m, .b = b, .ws = &ws, .ctr = ctr, .phase = 0, .id = omp_get_thread_num(),
                        .n_t = omp_get_num_threads(), .scale = scale, .eps = eps, .rs = rs, .lim = lim, .alpha = alpha};
        begin_rows(&f);
#pragma omp barrier
        count_runs(&f);
        for (int64_t li = 0; li < m->n_layers; li++) layer(&f, li);
        for (int64_t t = f.r0; t < f.r1; t++) rms_norm(f.own.h + t * C, m->norm, C, eps, b->x + t * C); /* in place: fine */
    }
    return XF_STATUS();
}

/* y (M, N) = x (M, K) W^T (+ b) for one matrix (an LM head, a head's linear): bf16 in, bf16 or fp32
 * out. work: sd_matmul_work_bytes(w, M) bytes. Returns 0, -3 when the workspace is too small, -4 (AVX2) out of memory. */
int64_t sd_matmul_work_bytes(const sd_mat *w, int64_t M) {
    if (w->kind == 0) return 0;
    const int64_t G = w->K / SD_GS, tiles = (w->N + 15) / 16;
    return (int64_t)(up64((size_t)(M * w->K)) + 2 * up64(sizeof(float) * (size_t)(M * G)) +
                     up64(sizeof(float) * (size_t)(tiles * M * 16)));
}

int sd_matmul(const sd_mat *w, const uint16_t *x, int64_t M, void *y, int out_f32, void *work, int64_t work_bytes) {
    if (sd_matmul_work_bytes(w, M) > work_bytes) return -3;
    const int64_t G = w->K / SD_GS;
    int8_t *xq = (int8_t *)work;
    float *xa = (float *)((char *)work + up64((size_t)(M * w->K)));
    float *xam = (float *)((char *)xa + up64(sizeof(float) * (size_t)(M * G)));
    float *part = (float *)((char *)xam + up64(sizeof(float) * (size_t)(M * G)));
    sd_counter ctr __attribute__((aligned(64))) = {0};
    XF_RESET();
#pragma omp parallel
    {
        const int id = omp_get_thread_num(), n_t = omp_get_num_threads();
        if (w->kind) {
            int64_t r0, r1;
            split(M * G, 1, id, n_t, &r0, &r1);
            for (int64_t it = r0; it < r1; it++) {
                const int64_t t = it / G, g = it % G;
                quantize_groups(x + t * w->K, g, g + 1, xq + t * w->K, xa + t * G, xam + t * G);
            }
#pragma omp barrier
        }
        product(w, x, xq, xa, xam, M, y, out_f32, part, &ctr, id, n_t);
    }
    return XF_STATUS();
}
