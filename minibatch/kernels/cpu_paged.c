/*
 * Paged decode attention for the CPU, reading K/V straight from the pages.
 *
 * The torch path has to gather every sequence's pages into a padded tensor before it
 * can call scaled_dot_product_attention: a full copy of the context, every layer,
 * every step. This kernel walks the block table instead, the way vLLM's paged
 * attention kernel does on a GPU: for each (sequence, KV head) it reads each cached
 * token's key once, scores it against the query heads that share that KV head (GQA),
 * then reads each value once to form the softmax-weighted sum.
 *
 * Layouts (all contiguous, float32):
 *   q, out        [num_seqs, num_heads, head_dim]
 *   k/v_cache     [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [num_seqs, table_width]      int32, block ids
 *   context_lens  [num_seqs]                   int32, tokens to attend to
 *
 * out[s, h] = softmax(scale * q[s, h] . K_s^T) V_s, with query head h reading KV head
 * h / (num_heads / num_kv_heads).
 *
 * Built on first use with the machine's C compiler (-O3 -march=native -fopenmp) by
 * minibatch/kernels/cpu_paged.py; torch's own OpenMP runtime is the one that runs it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
/* glibc's libmvec has vector expf; its header only says so under -ffast-math, which we
 * avoid (in a shared object built by GCC 12 it would switch the whole process to
 * flush-to-zero). Declaring the vector variant ourselves keeps IEEE semantics elsewhere. */
float expf(float) __attribute__((__simd__("notinbranch")));
#endif

#define INLINE static inline __attribute__((always_inline))

INLINE float dot(const float *a, const float *b, const int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

INLINE void axpy(float *y, const float a, const float *x, const int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* One sequence, all heads. A cached token's K (or V) row holds all KV heads side by
 * side, so reading a token for every head streams one contiguous row.
 * scores: scratch of num_heads * ctx floats. */
INLINE void attend_one(const float *q, const float *k_cache, const float *v_cache,
                       const int32_t *table, const int ctx, float *out, float *scores,
                       const int num_heads, const int num_kv_heads, const int head_dim,
                       const int block_size, const float scale) {
    const int group = num_heads / num_kv_heads;
    const long row = (long)num_kv_heads * head_dim;    /* floats per cached token */
    memset(out, 0, sizeof(float) * num_heads * head_dim);

    /* Pass 1: scores[h, t] = scale * q[h] . k_t[h / group] */
    for (int t = 0; t < ctx; t++) {
        const float *k = k_cache + ((long)table[t / block_size] * block_size + t % block_size) * row;
        for (int h = 0; h < num_heads; h++)
            scores[(long)h * ctx + t] = scale * dot(q + (long)h * head_dim, k + (long)(h / group) * head_dim, head_dim);
    }
    /* Softmax over t for each head (max-subtracted). */
    for (int h = 0; h < num_heads; h++) {
        float *p = scores + (long)h * ctx;
        float m = p[0], sum = 0.0f;
#pragma omp simd reduction(max : m)
        for (int t = 1; t < ctx; t++) m = p[t] > m ? p[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < ctx; t++) { p[t] = expf(p[t] - m); sum += p[t]; }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int t = 0; t < ctx; t++) p[t] *= inv;
    }
    /* Pass 2: out[h] = sum_t p[h, t] * v_t[h / group] */
    for (int t = 0; t < ctx; t++) {
        const float *v = v_cache + ((long)table[t / block_size] * block_size + t % block_size) * row;
        for (int h = 0; h < num_heads; h++)
            axpy(out + (long)h * head_dim, scores[(long)h * ctx + t], v + (long)(h / group) * head_dim, head_dim);
    }
}

int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, const int32_t *context_lens,
                               float *out, int num_seqs, int num_heads, int num_kv_heads,
                               int head_dim, int block_size, int table_width, float scale,
                               int num_threads) {
    const long stride = (long)num_heads * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int capacity = 0;
        float *scores = NULL;     /* per-thread scratch, grown as needed */
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < num_seqs; s++) {
            const int ctx = context_lens[s];
            float *o = out + s * stride;
            if (ctx <= 0) { memset(o, 0, sizeof(float) * stride); continue; }
            if (ctx * num_heads > capacity) {
                free(scores);
                capacity = ctx * num_heads;
                scores = malloc(sizeof(float) * capacity);
                if (!scores) { capacity = 0; failed = 1; continue; }
            }
            const float *qs = q + s * stride;
            const int32_t *table = block_tables + (long)s * table_width;
            /* Constant head sizes let the compiler unroll the dot products fully. */
            switch (head_dim) {
            case 32: attend_one(qs, k_cache, v_cache, table, ctx, o, scores, num_heads, num_kv_heads, 32, block_size, scale); break;
            case 64: attend_one(qs, k_cache, v_cache, table, ctx, o, scores, num_heads, num_kv_heads, 64, block_size, scale); break;
            case 128: attend_one(qs, k_cache, v_cache, table, ctx, o, scores, num_heads, num_kv_heads, 128, block_size, scale); break;
            default: attend_one(qs, k_cache, v_cache, table, ctx, o, scores, num_heads, num_kv_heads, head_dim, block_size, scale);
            }
        }
        free(scores);
    }
    return failed;
}
