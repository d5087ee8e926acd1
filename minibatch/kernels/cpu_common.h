/*
 * Shared by the CPU kernels (cpu_paged.c, cpu_prefill.c, cpu_ops.c): the inline macro,
 * the vector expf declaration, a dot product and the softmax of one score row.
 */
#ifndef MINIBATCH_CPU_COMMON_H
#define MINIBATCH_CPU_COMMON_H

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

/* p[0..len) <- softmax(p[0..len)) (max-subtracted); returns the row's log-sum-exp. */
INLINE float softmax_row(float *p, const int len) {
    float m = p[0], sum = 0.0f;
#pragma omp simd reduction(max : m)
    for (int t = 1; t < len; t++) m = p[t] > m ? p[t] : m;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < len; t++) { p[t] = expf(p[t] - m); sum += p[t]; }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int t = 0; t < len; t++) p[t] *= inv;
    return m + logf(sum);
}

#endif
