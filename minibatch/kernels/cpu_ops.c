/*
 * Fused element-wise ops for the CPU float32 forward, built with cpu_paged.c into one
 * shared object (see cpu_paged.py).
 *
 * In torch each of these is several passes over memory and several op dispatches:
 * RMSNorm is pow, mean, add, rsqrt, mul, mul; RoPE is neg, cat, mul, mul, add; the
 * SwiGLU gate is silu then mul. Here each is one pass, parallel over rows with OpenMP
 * when the rows are many. The arithmetic is the same as the torch expressions they
 * replace (the models' reference code), up to summation order and contraction of
 * a * b + c into one fused multiply-add.
 */
#include "cpu_common.h"

/* Below this many floats a parallel region costs more than it saves. */
#define PARALLEL_MIN 32768

/* out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * w, for rows of dim floats.
 * x and out have row strides x_stride and out_stride (floats); they may be equal. */
void rms_norm_f32(const float *x, long x_stride, const float *w, float *out, long out_stride,
                  long rows, int dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int i = 0; i < dim; i++) o[i] = (xr[i] * inv) * w[i];
    }
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]: the SwiGLU gate over a fused
 * gate|up projection of width 2 * inter. silu(g) = g / (1 + exp(-g)). */
void silu_mul_f32(const float *gu, float *out, long rows, int inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2L * inter, *u = g + inter;
        float *o = out + r * (long)inter;
#pragma omp simd
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotary embedding in place, rotate-half convention (Llama, Qwen, Mistral):
 * for each token n and each of its `heads` heads x (head_dim floats, halves x1 and x2),
 *   x1' = x1 * cos[:d/2] - x2 * sin[:d/2],   x2' = x2 * cos[d/2:] + x1 * sin[d/2:],
 * with cos/sin rows [max_positions, head_dim] picked by positions[n]. Heads of a token
 * are contiguous from x + n * stride. */
void rope_f32(float *x, long stride, long n, int heads, int head_dim, const float *cos_cache,
              const float *sin_cache, const int64_t *positions, int num_threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (n * heads * head_dim >= PARALLEL_MIN) schedule(static)
    for (long t = 0; t < n; t++) {
        const float *c = cos_cache + positions[t] * head_dim, *s = sin_cache + positions[t] * head_dim;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * stride + (long)h * head_dim, *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* Paged KV store: key row t (num_kv_heads * head_dim floats, rows key_stride apart) goes
 * to flat slot slots[t] of k_cache, likewise value to v_cache; slot -1 is skipped.
 * One call instead of torch's two index_copy_ dispatches and the views around them.
 * Returns the number of slots outside [-1, num_slots) (rows not written). */
long store_kv_f32(const float *key, long key_stride, const float *value, long value_stride,
                  float *k_cache, float *v_cache, const int64_t *slots, long n, int row,
                  long num_slots, int num_threads) {
    long bad = 0;
#pragma omp parallel for num_threads(num_threads) if (n * row >= PARALLEL_MIN) schedule(static) reduction(+ : bad)
    for (long t = 0; t < n; t++) {
        const int64_t s = slots[t];
        if (s < 0 || s >= num_slots) {
            bad += s != -1;
            continue;
        }
        memcpy(k_cache + s * row, key + t * key_stride, sizeof(float) * row);
        memcpy(v_cache + s * row, value + t * value_stride, sizeof(float) * row);
    }
    return bad;
}

/* The index of the largest of v[0..cols), as torch.argmax: the first index of the
 * maximum; a NaN counts as the maximum (the first NaN wins). One vector pass finds the
 * maximum and, through a sum of v * 0, whether the row holds a NaN or an infinity; then
 * a vector search in chunks of 64 finds the maximum's first index. Rows with a NaN or an
 * infinity take the exact scalar rule instead. */
INLINE int64_t argmax_row(const float *v, const int cols) {
    float m = v[0], z = 0.0f;
#pragma omp simd reduction(max : m) reduction(+ : z)
    for (int i = 0; i < cols; i++) {
        m = v[i] > m ? v[i] : m;
        z += v[i] * 0.0f;
    }
    if (z != 0.0f) {                      /* NaN: a NaN or an infinity is in the row */
        int best = 0;
        for (int i = 0; i < cols; i++) {
            if (v[i] != v[i]) return i;
            if (v[i] > v[best]) best = i;
        }
        return best;
    }
    int i = 0;
    for (; i < cols; i += 64) {
        const int end = i + 64 < cols ? i + 64 : cols;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int j = i; j < end; j++) hit |= v[j] == m;
        if (hit) break;
    }
    while (v[i] != m) i++;
    return i;
}

/* out[r] = argmax_row(row r) for rows row_stride floats apart. Greedy sampling calls it
 * on the [num_seqs, vocab] logits, where torch's reduction takes ~0.8 ns a float. */
void argmax_rows_f32(const float *x, long row_stride, long rows, int cols, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * (long)cols >= 4 * PARALLEL_MIN) schedule(static)
    for (long r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_stride, cols);
}

/* y[m, :] = x[m, :] @ w^T (+ bias) for a few rows m < M: a linear layer at decode batch
 * sizes, where it is a matrix-vector product bound by reading w ([N, K], row-major, the
 * layer's own weight) once. Each work item takes four rows of w and, with them in L1,
 * runs the M rows of x over them; threads split w's rows. At M = 1 this reads the weights
 * at ~100 GB/s here from the last-level cache, against ~25 GB/s for oneDNN's prepacked
 * GEMM, whose fixed cost per call dominates at one row. */
void linear_small_m_f32(const float *x, long x_stride, const float *w, const float *bias, float *y,
                        long y_stride, int M, int N, int K, int num_threads) {
    const int groups = (N + 3) / 4;
#pragma omp parallel for num_threads(num_threads) if ((long)N * K >= PARALLEL_MIN) schedule(static)
    for (int g = 0; g < groups; g++) {
        const int n = 4 * g;
        if (n + 4 <= N) {
            const float *w0 = w + (long)n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
            for (int m = 0; m < M; m++) {
                const float *xm = x + m * x_stride;
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int k = 0; k < K; k++) {
                    const float xv = xm[k];
                    a0 += w0[k] * xv;
                    a1 += w1[k] * xv;
                    a2 += w2[k] * xv;
                    a3 += w3[k] * xv;
                }
                float *ym = y + m * y_stride + n;
                if (bias) {
                    a0 += bias[n];
                    a1 += bias[n + 1];
                    a2 += bias[n + 2];
                    a3 += bias[n + 3];
                }
                ym[0] = a0;
                ym[1] = a1;
                ym[2] = a2;
                ym[3] = a3;
            }
        } else {
            for (int r = n; r < N; r++)
                for (int m = 0; m < M; m++) {
                    const float a = dot(w + (long)r * K, x + m * x_stride, K);
                    y[m * y_stride + r] = bias ? a + bias[r] : a;
                }
        }
    }
}

/* ---- projections of a few rows from panel-packed weights -----------------------------
 * linear_small_m_f32 above reads four weight rows side by side and reduces each dot
 * product across SIMD lanes at its end. Here the weight is re-laid once
 * (pack_panels_f32) as panels of PANEL output features, k-major:
 *   wp[(p * K + k) * PANEL + j] = w[p * PANEL + j, k]   (zero past N),
 * so a panel is one sequential stream, each k is one broadcast of x[m, k] and
 * PANEL / 8 FMAs into accumulators that stay in registers, and no lane reduction is
 * needed. The sum over k runs in order, one accumulator per output. */
#define PANEL 32

void pack_panels_f32(const float *w, float *wp, int N, int K) {
    const int panels = (N + PANEL - 1) / PANEL;
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < PANEL; j++) {
                const int n = p * PANEL + j;
                wp[((long)p * K + k) * PANEL + j] = n < N ? w[(long)n * K + k] : 0.0f;
            }
}

/* Rows m0 (and m0 + 1 when two) of x times one panel; writes the panel's cnt outputs.
 * GCC/Clang vector types keep the PANEL accumulators in registers (4 AVX registers a
 * row): written as float arrays with `omp simd`, GCC kept them on the stack. Each step
 * is a multiply then an add (no FMA contraction, as everywhere in these files). */
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8u __attribute__((vector_size(32), aligned(4)));

INLINE void panel_rows(const float *x0, const float *x1, const float *w, const int K, const float *bias,
                       float *y0, float *y1, const int cnt) {
    vec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    if (x1) {
        for (int k = 0; k < K; k++) {
            const vec8u *wk = (const vec8u *)(w + (long)k * PANEL);
            const vec8 w0 = wk[0], w1 = wk[1], w2 = wk[2], w3 = wk[3];
            const float u = x0[k], v = x1[k];
            a0 += w0 * u; a1 += w1 * u; a2 += w2 * u; a3 += w3 * u;
            b0 += w0 * v; b1 += w1 * v; b2 += w2 * v; b3 += w3 * v;
        }
    } else {
        for (int k = 0; k < K; k++) {
            const vec8u *wk = (const vec8u *)(w + (long)k * PANEL);
            const float u = x0[k];
            a0 += wk[0] * u; a1 += wk[1] * u; a2 += wk[2] * u; a3 += wk[3] * u;
        }
    }
    float ra[PANEL], rb[PANEL];
    memcpy(ra, &a0, 32); memcpy(ra + 8, &a1, 32); memcpy(ra + 16, &a2, 32); memcpy(ra + 24, &a3, 32);
    memcpy(rb, &b0, 32); memcpy(rb + 8, &b1, 32); memcpy(rb + 16, &b2, 32); memcpy(rb + 24, &b3, 32);
    for (int j = 0; j < cnt; j++) {
        y0[j] = bias ? ra[j] + bias[j] : ra[j];
        if (x1) y1[j] = bias ? rb[j] + bias[j] : rb[j];
    }
}

/* Rows m0..m0+ROWS-1 of x times the half panel of HALF outputs at w (a panel's base plus
 * 0 or HALF: rows of the panel stay PANEL floats apart); writes its cnt outputs a row.
 * Register-blocked for decode steps of many sequences: ROWS * 2 accumulators, two
 * weight vectors, a broadcast and a product fill the 16 AVX registers, so each weight
 * load feeds ROWS rows. The arithmetic is panel_rows's: for each output, in order of k,
 * a multiply then an add; so any split into blocks gives the same bits.
 *
 * pf (the panel's base, in a panel's first block only) prefetches the whole panel row
 * PF_DIST k ahead. That first block reads one of each row's two cache lines every 6
 * cycles of arithmetic, a pattern the hardware prefetcher follows poorly: with weights
 * out of cache (a decode step streams 16 MiB of them) one thread ran 1376 x 256 at 8
 * rows in 229 us without and 160 us with it, at 6 rows 256 -> 129 us, with hot weights
 * no change; a fused decode step of 8 sequences 2.39 -> 1.24 ms, 32: 5.66 -> 4.76 ms.
 * The one- and two-row loop below streams whole rows in order, and prefetching there
 * made it slower (0.75-0.9x). */
#define HALF 16
#define ROWS 6
#define PF_DIST 32
INLINE void panel_block(const float *x, const long x_stride, const float *w, const int K, const float *bias,
                        float *y, const long y_stride, const int cnt, const float *pf) {
    vec8 a[ROWS][2];
    for (int r = 0; r < ROWS; r++) a[r][0] = a[r][1] = (vec8){0};
    for (int k = 0; k < K; k++) {
        if (pf) {
            __builtin_prefetch(pf + (long)(k + PF_DIST) * PANEL, 0, 3);
            __builtin_prefetch(pf + (long)(k + PF_DIST) * PANEL + 16, 0, 3);
        }
        const vec8u *wk = (const vec8u *)(w + (long)k * PANEL);
        const vec8 w0 = wk[0], w1 = wk[1];
#pragma GCC unroll 6
        for (int r = 0; r < ROWS; r++) {
            const float u = x[r * x_stride + k];
            a[r][0] += w0 * u;
            a[r][1] += w1 * u;
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float o[HALF];
        memcpy(o, &a[r][0], 32);
        memcpy(o + 8, &a[r][1], 32);
        float *yr = y + r * y_stride;
        for (int j = 0; j < cnt; j++) yr[j] = bias ? o[j] + bias[j] : o[j];
    }
}

/* Panels [p0, p1) of y = x @ w^T (+ bias), from pack_panels_f32's wp. */
void linear_panels_range_f32(const float *x, long x_stride, const float *wp, const float *bias, float *y,
                             long y_stride, int M, int N, int K, int p0, int p1) {
    for (int p = p0; p < p1; p++) {
        const int n0 = p * PANEL, cnt = N - n0 < PANEL ? N - n0 : PANEL;
        const float *w = wp + (long)p * K * PANEL;
        const int blocked = M - M % ROWS;
        for (int h = 0; h < cnt; h += HALF)          /* a half panel stays in L1 over the row blocks */
            for (int m = 0; m < blocked; m += ROWS)
                panel_block(x + m * x_stride, x_stride, w + h, K, bias ? bias + n0 + h : NULL,
                            y + m * y_stride + n0 + h, y_stride, cnt - h < HALF ? cnt - h : HALF,
                            h == 0 && m == 0 ? w : NULL);
        for (int m = blocked; m < M; m += 2) {
            const int two = m + 1 < M;
            panel_rows(x + m * x_stride, two ? x + (m + 1) * x_stride : NULL, w, K, bias ? bias + n0 : NULL,
                       y + m * y_stride + n0, two ? y + (m + 1) * y_stride + n0 : NULL, cnt);
        }
    }
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for M rows, from pack_panels_f32's wp. */
void linear_panels_f32(const float *x, long x_stride, const float *wp, const float *bias, float *y,
                       long y_stride, int M, int N, int K, int num_threads) {
    const int panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(num_threads) if ((long)N * K >= PARALLEL_MIN) schedule(static)
    for (int p = 0; p < panels; p++) linear_panels_range_f32(x, x_stride, wp, bias, y, y_stride, M, N, K, p, p + 1);
}
