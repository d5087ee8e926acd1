/*
 * Paged causal prefill attention for the CPU, tiled over query tokens.
 *
 * A prefill chunk of n query tokens at positions p0 .. p0+n-1 attends to the keys
 * 0 .. p (its own K/V are already in the pages). Treating each query token as one
 * decode (cpu_paged.c) reads every key once per query token: n^2/2 row reads, from
 * L2 at best. Here a work item is (sequence, KV head, tile of TQ query tokens): it
 * reads each key row once for the whole tile, i.e. for TQ * group query heads:
 *
 *   pass 1  S[r, t] = scale * q_r . k_t      16 keys at a time, K transposed to [d][16];
 *                                            on AVX-512, four rows per key block so that
 *                                            four FMA chains are in flight
 *   softmax each row r over its causal range t <= pos(r)
 *   pass 2  out_r = sum_t S[r, t] v_t        16 registers of accumulators (8 rows at
 *                                            head_dim 32) per sweep over the V rows
 *
 * The AVX-512 code serves head_dim a multiple of 16; loops the compiler vectorises
 * serve everything else. Per call on this project's 2-core machine (python
 * benchmarks/cpu_attention.py, medians of 15): the tiny model's heads, 15 prompts of
 * 16-256 tokens, 1.6 ms, against 2.7 ms as one decode row per query token and 4.0 ms
 * for torch's gather + SDPA; one prompt of 2,048 tokens, 16 ms against 33 and 21 ms;
 * Llama-3-8B's heads (32/8, 128), two prompts of 512, 27 ms against 45 and 57 ms.
 *
 * Same layouts as cpu_paged.c, plus query_start_loc [num_seqs + 1] (int32): sequence s
 * owns query rows query_start_loc[s] .. query_start_loc[s+1]-1, the last tokens of its
 * context_lens[s].
 */
#include "cpu_common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#define TQ 64      /* query tokens per tile */
#define TK 16      /* keys per transposed block */
/* Query rows per pass-2 sweep: 256 accumulator floats (16 AVX-512 registers). */
#define RB(D) ((D) >= 256 ? 1 : 256 / (D))

typedef struct {
    float *s;      /* scores [rows][keys_padded] */
    float *kt;     /* one transposed key block [head_dim][TK], 64-byte aligned */
    const float **rows;  /* the item's cached rows, K then V: [2][keys] */
    long s_cap, kt_cap, rows_cap;
} scratch;

static int grow(scratch *w, long s_need, long kt_need, long rows_need) {
    if (rows_need > w->rows_cap) {
        free(w->rows);
        w->rows = malloc(sizeof(float *) * rows_need);
        w->rows_cap = w->rows ? rows_need : 0;
    }
    if (s_need > w->s_cap) {
        free(w->s);
        w->s = malloc(sizeof(float) * s_need);
        w->s_cap = w->s ? s_need : 0;
    }
    if (kt_need > w->kt_cap) {
        free(w->kt);
        w->kt = aligned_alloc(64, (sizeof(float) * kt_need + 63) / 64 * 64);
        w->kt_cap = w->kt ? kt_need : 0;
    }
    return w->s != NULL && w->kt != NULL && w->rows != NULL;
}

/* The item's K and V rows (this KV head's slice), in token order: one walk of the block
 * table instead of a division per row per use. */
INLINE void find_rows(const float *k_cache, const float *v_cache, const int32_t *table, const int nk,
                      const int block_size, const long row, const long offset, const float **kr,
                      const float **vr) {
    for (int b = 0, t = 0; t < nk; b++) {
        const long base = (long)table[b] * block_size * row + offset;
        for (int i = 0; i < block_size && t < nk; i++, t++) {
            kr[t] = k_cache + base + i * row;
            vr[t] = v_cache + base + i * row;
        }
    }
}

/* One work item. D (head_dim) is a compile-time constant at each instance. */
INLINE void tile(const float *q, const float *k_cache, const float *v_cache, const int32_t *table,
                 const int p0, const int i0, const int nq, const int g, float *out, const int num_heads,
                 const int group, const int D, const int block_size, const long row, const float scale,
                 float *restrict S, float *restrict KT, const float **kr, const float **vr) {
    const int R = nq * group;                      /* query rows: token-major, then head */
    const int nk = p0 + i0 + nq;                   /* keys the last query token sees */
    const int nkp = (nk + TK - 1) / TK * TK;
    const long qstride = (long)num_heads * D;
#define QROW(r) (q + (long)((r) / group) * qstride + (long)(g * group + (r) % group) * D)
    find_rows(k_cache, v_cache, table, nk, block_size, row, (long)g * D, kr, vr);

    /* Pass 1: scores, a block of 16 keys at a time, skipping blocks past a row's reach. */
    for (int kb = 0; kb < nk; kb += TK) {
        const int n = nk - kb < TK ? nk - kb : TK;
        for (int k = 0; k < n; k++) {
            const float *key = kr[kb + k];
            for (int c = 0; c < D; c++) KT[c * TK + k] = key[c];
        }
        for (int k = n; k < TK; k++)
            for (int c = 0; c < D; c++) KT[c * TK + k] = 0.0f;
        /* Rows whose position is below kb never see this block: start at the first that does. */
        const int first_tok = kb - (p0 + i0) > 0 ? kb - (p0 + i0) : 0;
        int r = first_tok * group;
#if defined(__AVX512F__)
        if (D % 16 == 0) {
            /* Four rows at a time: four independent FMA chains per key block. */
            const __m512 vscale = _mm512_set1_ps(scale);
            for (; r + 4 <= R; r += 4) {
                const float *q0 = QROW(r), *q1 = QROW(r + 1), *q2 = QROW(r + 2), *q3 = QROW(r + 3);
                __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int c = 0; c < D; c++) {
                    const __m512 kt = _mm512_load_ps(KT + c * TK);
                    a0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[c]), kt, a0);
                    a1 = _mm512_fmadd_ps(_mm512_set1_ps(q1[c]), kt, a1);
                    a2 = _mm512_fmadd_ps(_mm512_set1_ps(q2[c]), kt, a2);
                    a3 = _mm512_fmadd_ps(_mm512_set1_ps(q3[c]), kt, a3);
                }
                _mm512_storeu_ps(S + (long)r * nkp + kb, _mm512_mul_ps(a0, vscale));
                _mm512_storeu_ps(S + (long)(r + 1) * nkp + kb, _mm512_mul_ps(a1, vscale));
                _mm512_storeu_ps(S + (long)(r + 2) * nkp + kb, _mm512_mul_ps(a2, vscale));
                _mm512_storeu_ps(S + (long)(r + 3) * nkp + kb, _mm512_mul_ps(a3, vscale));
            }
        }
#endif
        for (; r < R; r++) {
            const float *qr = QROW(r);
            float acc[TK] = {0};
            for (int c = 0; c < D; c++) {
                const float qc = qr[c] * scale;
#pragma omp simd
                for (int k = 0; k < TK; k++) acc[k] += qc * KT[c * TK + k];
            }
            memcpy(S + (long)r * nkp + kb, acc, sizeof acc);
        }
    }
    /* Softmax of each row over its causal range. */
    for (int r = 0; r < R; r++) softmax_row(S + (long)r * nkp, p0 + i0 + r / group + 1);
    /* Pass 2: RB rows at a time; their accumulators stay in registers over the keys. */
#if defined(__AVX512F__)
    if (D % 16 == 0 && D <= 256) {
        enum { NV = 16 };                          /* accumulator registers */
        const int DV = D / 16, rb = NV / DV;
        for (int r0 = 0; r0 < R; r0 += rb) {
            const int rn = R - r0 < rb ? R - r0 : rb;
            __m512 acc[NV];
            for (int i = 0; i < NV; i++) acc[i] = _mm512_setzero_ps();
            const int common = p0 + i0 + r0 / group + 1;
            for (int t = 0; t < common; t++) {
                const float *val = vr[t];
                for (int i = 0; i < rb; i++) {
                    const __m512 w = _mm512_set1_ps(i < rn ? S[(long)(r0 + i) * nkp + t] : 0.0f);
                    for (int c = 0; c < DV; c++)
                        acc[i * DV + c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(val + c * 16), acc[i * DV + c]);
                }
            }
            for (int i = 0; i < rn; i++) {
                const int r = r0 + i, len = p0 + i0 + r / group + 1;
                for (int t = common; t < len; t++) {
                    const __m512 w = _mm512_set1_ps(S[(long)r * nkp + t]);
                    for (int c = 0; c < DV; c++)
                        acc[i * DV + c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr[t] + c * 16), acc[i * DV + c]);
                }
                float *o = QROW(r) - q + out;
                for (int c = 0; c < DV; c++) _mm512_storeu_ps(o + c * 16, acc[i * DV + c]);
            }
        }
        return;
    }
#endif
    for (int r0 = 0; r0 < R; r0 += RB(D)) {
        const int rn = R - r0 < RB(D) ? R - r0 : RB(D);
        float acc[RB(D)][D];
        memset(acc, 0, sizeof acc);
        /* Keys both rows' ranges share, then the tail of each row on its own. */
        const int common = p0 + i0 + r0 / group + 1;
        for (int t = 0; t < common; t++) {
            const float *val = vr[t];
            for (int i = 0; i < RB(D); i++) {
                const float w = i < rn ? S[(long)(r0 + i) * nkp + t] : 0.0f;
#pragma omp simd
                for (int c = 0; c < D; c++) acc[i][c] += w * val[c];
            }
        }
        for (int i = 0; i < rn; i++) {
            const int r = r0 + i, len = p0 + i0 + r / group + 1;
            for (int t = common; t < len; t++) {
                const float *val = vr[t];
                const float w = S[(long)r * nkp + t];
#pragma omp simd
                for (int c = 0; c < D; c++) acc[i][c] += w * val[c];
            }
            float *o = out + (long)(r / group) * qstride + (long)(g * group + r % group) * D;
            memcpy(o, acc[i], sizeof(float) * D);
        }
    }
}

#define TILE_CASE(DD) case DD: tile(qt, k_cache, v_cache, table, p0, i0, nq, g, ot, num_heads, group, DD, \
                                    block_size, row, scale, w.s, w.kt, w.rows, w.rows + nk); break;

int paged_prefill_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                const int32_t *block_tables, const int32_t *context_lens,
                                const int32_t *query_start_loc, float *out, int num_seqs, int num_heads,
                                int num_kv_heads, int head_dim, int block_size, int table_width, float scale,
                                int num_threads) {
    const int group = num_heads / num_kv_heads;
    const long row = (long)num_kv_heads * head_dim;
    /* Work items (sequence, tile), later tiles (more keys) first for load balance. */
    long num_tiles = 0;
    for (int s = 0; s < num_seqs; s++)
        num_tiles += (query_start_loc[s + 1] - query_start_loc[s] + TQ - 1) / TQ;
    int32_t *items = malloc(sizeof(int32_t) * 2 * (num_tiles ? num_tiles : 1));
    if (!items) return 1;
    long at = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int nq_all = query_start_loc[s + 1] - query_start_loc[s];
        for (int i0 = (nq_all - 1) / TQ * TQ; nq_all > 0 && i0 >= 0; i0 -= TQ) {
            items[2 * at] = s;
            items[2 * at + 1] = i0;
            at++;
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        scratch w = {NULL, NULL, NULL, 0, 0, 0};
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (long it = 0; it < num_tiles; it++) {
            for (int g = 0; g < num_kv_heads; g++) {
                const int s = items[2 * it], i0 = items[2 * it + 1];
                const int nq_all = query_start_loc[s + 1] - query_start_loc[s];
                const int nq = nq_all - i0 < TQ ? nq_all - i0 : TQ;
                const int p0 = context_lens[s] - nq_all;
                const int nk = p0 + i0 + nq;
                if (!grow(&w, (long)nq * group * ((nk + TK - 1) / TK * TK), (long)head_dim * TK, 2L * nk)) {
                    failed = 1;
                    continue;
                }
                const int32_t *table = block_tables + (long)s * table_width;
                const float *qt = q + ((long)query_start_loc[s] + i0) * num_heads * head_dim;
                float *ot = out + ((long)query_start_loc[s] + i0) * num_heads * head_dim;
                switch (head_dim) {
                    TILE_CASE(32)
                    TILE_CASE(64)
                    TILE_CASE(128)
                    default: tile(qt, k_cache, v_cache, table, p0, i0, nq, g, ot, num_heads, group, head_dim,
                                  block_size, row, scale, w.s, w.kt, w.rows, w.rows + nk);
                }
            }
        }
        free(w.s);
        free(w.kt);
        free(w.rows);
    }
    free(items);
    return failed;
}
