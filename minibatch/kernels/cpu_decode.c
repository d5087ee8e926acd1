/*
 * The whole model of a small decode step in one call (CPU, float32).
 *
 * A decode step of one or two sequences is ~60 small ops: per layer RMSNorm, the QKV
 * projection, RoPE, the KV store, paged attention, the output projection, the residual
 * add, RMSNorm, gate|up, the SwiGLU gate, the down projection and the residual add;
 * then the final norm and the LM head. Each op's work is microseconds, and from Python
 * each also costs ~10 us of dispatch (argument checks, an output tensor, a ctypes call),
 * so at one sequence the dispatch was as large as the work. decode_model_f32 runs the
 * same ops in the same order with the same arithmetic (it calls the very kernels the
 * per-op path calls) in C, from the embedding rows to the logits.
 *
 * Threads. At one sequence the step reads every weight once (16 MiB for tiny) and does
 * little else, so two cores read it nearly twice as fast as one. But an OpenMP parallel
 * region per projection costs a futex wake-up of the sleeping threads each time
 * (OMP_WAIT_POLICY=PASSIVE, minibatch's default, ~20 regions a step), and spinning
 * threads (ACTIVE) are ruinous when another process wants the cores. So the step is a
 * list of phases (a serial op, or a projection cut into panels of 32 outputs), and the
 * calling thread and one helper thread claim work from it with an atomic counter:
 *  - the caller never waits for the helper to arrive; whatever the helper has not
 *    claimed, the caller does, so a helper that sleeps, wakes late or is not scheduled
 *    at all costs nothing but its share of the work;
 *  - a phase ends when its last item is done; a thread waits for an item the other
 *    holds by spinning up to WAIT_SPIN_US, then yielding the CPU;
 *  - the helper spins HELPER_SPIN_US for the next step, then sleeps on a condition
 *    variable (between steps of a decode loop it is usually still spinning);
 *  - when the caller had to wait longer than CONTENDED_US (the helper was descheduled
 *    holding an item: the cores are shared), the next steps run on the caller alone for
 *    BACKOFF_MIN_US, doubling up to BACKOFF_MAX_US while it recurs (a quiet machine
 *    sees it about once a second, from the hypervisor or a kernel thread; a loaded
 *    one nearly every step with the helper).
 * Each panel is computed by one thread in a fixed order, so the results do not depend
 * on which thread ran what: they equal the one-thread results bit for bit.
 *
 * Weights are the panel-packed projections (pack_panels_f32) and the norms' weights,
 * DL_PTRS pointers per layer in the order of the enum below.
 */
#define _GNU_SOURCE
#include "cpu_common.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* Exported by cpu_ops.c and cpu_paged.c (the same shared object). */
void rms_norm_f32(const float *x, long x_stride, const float *w, float *out, long out_stride, long rows, int dim,
                  float eps, int num_threads);
void linear_panels_range_f32(const float *x, long x_stride, const float *wp, const float *bias, float *y,
                             long y_stride, int M, int N, int K, int p0, int p1);
void rope_f32(float *x, long stride, long n, int heads, int head_dim, const float *cos_cache, const float *sin_cache,
              const int64_t *positions, int num_threads);
long store_kv_f32(const float *key, long key_stride, const float *value, long value_stride, float *k_cache,
                  float *v_cache, const int64_t *slots, long n, int row, long num_slots, int num_threads);
void silu_mul_f32(const float *gu, float *out, long rows, int inter, int num_threads);
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, const int32_t *context_lens, float *out, int num_seqs,
                               int num_heads, int num_kv_heads, int head_dim, int block_size, int table_width,
                               float scale, int num_threads);

enum { DL_IN_NORM, DL_QKV, DL_QKV_BIAS, DL_O, DL_POST_NORM, DL_GATE_UP, DL_DOWN, DL_PTRS };
enum { DL_OK = 0, DL_BAD_SLOT = 1, DL_NO_MEMORY = 2, DL_BAD_ID = 3 };

#define PANEL 32                 /* as in cpu_ops.c */
#define MAX_LAYERS 256
#define PHASES_PER_LAYER 8
#define MAX_PHASES (PHASES_PER_LAYER * MAX_LAYERS + 2)
#define WAIT_SPIN_US 50.0         /* spin this long for the other thread's item, then yield */
#define CONTENDED_US 300.0        /* a wait this long: the other thread was descheduled */
#define HELPER_SPIN_US 200.0      /* the helper spins this long for the next step, then sleeps */
#define BACKOFF_MIN_US 10000.0    /* then steps run alone this long, doubling while it recurs */
#define BACKOFF_MAX_US 320000.0

/* Work items the helper thread has run, steps run with it, the times a long wait made the
 * next steps run alone, and steps of at most ADAPT_MAX_M rows run alone by choice (below):
 * over the process (tests and benchmarks read them). */
atomic_long decode_helper_items = 0, decode_helper_steps = 0, decode_backoffs = 0, decode_alone_steps = 0;

/* At one or two rows the helper's half of the work is ~0.1 ms, and whether a second thread
 * pays for its synchronisation depended on the VM's state: in one decode_sweep run a batch-1
 * step took 0.53 ms with the helper and 0.66 alone, in another 0.61 with it (joining 98% of
 * the steps) and 0.52 alone. So for these sizes each mode keeps a moving average of its step
 * time, the faster one runs, and every EXPLORE_EVERY-th step runs the other to keep its
 * average current. Results do not depend on the mode (each panel is one thread's). */
#define ADAPT_MAX_M 2
#define EXPLORE_EVERY 16
#define EMA_WEIGHT 0.125
static struct {
    long steps;
    double ema[2];              /* [0]: with the helper, [1]: alone; 0 until measured */
} adapt[ADAPT_MAX_M];

typedef struct {
    /* the step */
    const int64_t *ids;
    const float *embed, *final_norm, *lm_head, *cos_cache, *sin_cache;
    const float *const *weights;
    float *const *kv;
    float *hidden_out, *logits;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *context_lens;
    long num_slots;
    int M, H, num_layers, vocab, table_width, num_heads, num_kv_heads, head_dim, inter, block_size;
    float eps, scale;
    /* scratch: x, h, normed [M, H]; qkv; q, attn [M, q_size]; gate|up, act */
    float *x, *h, *normed, *qkv, *q, *attn, *gu, *act;
    /* progress */
    int num_phases;
    atomic_int status;
    atomic_int next[MAX_PHASES], done[MAX_PHASES];
    atomic_int waited_long;
} job_t;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

/* Phase p of a step: 0..8L-1 are the layers' (layer p / 8, kind p % 8); then the final
 * norm (serial) and the LM head (panels). Returns the number of work items. */
static int phase_items(const job_t *j, const int p) {
    const int q_size = j->num_heads * j->head_dim, qkv_size = q_size + 2 * j->num_kv_heads * j->head_dim;
    if (p == j->num_layers * PHASES_PER_LAYER) return 1;
    if (p > j->num_layers * PHASES_PER_LAYER) return (j->vocab + PANEL - 1) / PANEL;
    switch (p % PHASES_PER_LAYER) {
        case 1: return (qkv_size + PANEL - 1) / PANEL;
        case 3: return (j->H + PANEL - 1) / PANEL;
        case 5: return (2 * j->inter + PANEL - 1) / PANEL;
        case 7: return (j->H + PANEL - 1) / PANEL;
        case 2: return j->M;                                   /* one sequence an item */
        default: return 1;
    }
}

static void run_item(job_t *j, const int p, const int i) {
    if (atomic_load_explicit(&j->status, memory_order_relaxed) != DL_OK) return;
    const int M = j->M, H = j->H, q_size = j->num_heads * j->head_dim, kv_size = j->num_kv_heads * j->head_dim;
    const int qkv_size = q_size + 2 * kv_size;
    const long MH = (long)M * H;
    if (p >= j->num_layers * PHASES_PER_LAYER) {
        if (p == j->num_layers * PHASES_PER_LAYER) {           /* x += h; final norm */
            for (long e = 0; e < MH; e++) j->x[e] += j->h[e];
            rms_norm_f32(j->x, H, j->final_norm, j->hidden_out, H, M, H, j->eps, 1);
        } else {
            linear_panels_range_f32(j->hidden_out, H, j->lm_head, NULL, j->logits, j->vocab, M, j->vocab, H, i, i + 1);
        }
        return;
    }
    const int l = p / PHASES_PER_LAYER;
    const float *const *w = j->weights + (long)l * DL_PTRS;
    switch (p % PHASES_PER_LAYER) {
        case 0:                                                /* x = embed or x + h; normed = norm(x) */
            if (l == 0)
                for (int m = 0; m < M; m++) memcpy(j->x + (long)m * H, j->embed + j->ids[m] * H, sizeof(float) * H);
            else
                for (long e = 0; e < MH; e++) j->x[e] += j->h[e];
            rms_norm_f32(j->x, H, w[DL_IN_NORM], j->normed, H, M, H, j->eps, 1);
            break;
        case 1:
            linear_panels_range_f32(j->normed, H, w[DL_QKV], w[DL_QKV_BIAS], j->qkv, qkv_size, M, qkv_size, H, i, i + 1);
            break;
        case 2: {                                              /* sequence i: RoPE, KV store, attention */
            float *k_cache = j->kv[2 * l], *v_cache = j->kv[2 * l + 1];
            float *row = j->qkv + (long)i * qkv_size, *q = j->q + (long)i * q_size;
            rope_f32(row, qkv_size, 1, j->num_heads + j->num_kv_heads, j->head_dim, j->cos_cache, j->sin_cache,
                     j->positions + i, 1);
            if (store_kv_f32(row + q_size, qkv_size, row + q_size + kv_size, qkv_size, k_cache, v_cache, j->slots + i,
                             1, kv_size, j->num_slots, 1)) {
                atomic_store(&j->status, DL_BAD_SLOT);
                break;
            }
            memcpy(q, row, sizeof(float) * q_size);
            if (paged_decode_attention_f32(q, k_cache, v_cache, j->block_tables + (long)i * j->table_width,
                                           j->context_lens + i, j->attn + (long)i * q_size, 1, j->num_heads,
                                           j->num_kv_heads, j->head_dim, j->block_size, j->table_width, j->scale, 1))
                atomic_store(&j->status, DL_NO_MEMORY);
            break;
        }
        case 3:
            linear_panels_range_f32(j->attn, q_size, w[DL_O], NULL, j->h, H, M, H, q_size, i, i + 1);
            break;
        case 4:                                                /* h += x; normed = norm(h) */
            for (long e = 0; e < MH; e++) j->h[e] += j->x[e];
            rms_norm_f32(j->h, H, w[DL_POST_NORM], j->normed, H, M, H, j->eps, 1);
            break;
        case 5:
            linear_panels_range_f32(j->normed, H, w[DL_GATE_UP], NULL, j->gu, 2L * j->inter, M, 2 * j->inter, H, i, i + 1);
            break;
        case 6:
            silu_mul_f32(j->gu, j->act, M, j->inter, 1);
            break;
        case 7:                                                /* x = down(act); the caller adds h next */
            linear_panels_range_f32(j->act, j->inter, w[DL_DOWN], NULL, j->x, H, M, H, j->inter, i, i + 1);
            break;
    }
}


/* Items claimed at once in phase p. Each claim is an atomic add on a cache line both threads
 * write: at one or two rows a panel is ~1 us of work, so claims of one panel would spend a
 * sizeable share of the step moving that line between the cores. */
static int claim_size(const job_t *j, const int p) {
    if (j->M > 2) return 1;
    if (p > j->num_layers * PHASES_PER_LAYER) return 4;           /* the LM head */
    const int kind = p % PHASES_PER_LAYER;
    return (kind == 1 || kind == 3 || kind == 5 || kind == 7) ? 2 : 1;
}

/* Claim and run items of each phase in turn; wait for each phase's last item. */
static void run_phases(job_t *j, const int caller) {
    for (int p = 0; p < j->num_phases; p++) {
        const int n = phase_items(j, p), g = claim_size(j, p);
        for (;;) {
            const int i = atomic_fetch_add(&j->next[p], g);
            if (i >= n) break;
            const int end = i + g < n ? i + g : n;
            for (int k = i; k < end; k++) run_item(j, p, k);
            atomic_fetch_add(&j->done[p], end - i);
            if (!caller) atomic_fetch_add_explicit(&decode_helper_items, end - i, memory_order_relaxed);
        }
        if (atomic_load(&j->done[p]) < n) {
            const double t0 = now_us();
            int spin = 1;
            while (atomic_load(&j->done[p]) < n) {
                if (spin && now_us() - t0 > WAIT_SPIN_US) spin = 0;
                if (spin) CPU_RELAX();
                else sched_yield();
            }
            if (caller && !spin && now_us() - t0 > CONTENDED_US) atomic_store(&j->waited_long, 1);
        }
    }
}

/* ---- the helper thread ------------------------------------------------------------ */
static struct {
    pthread_mutex_t lock, submit;
    pthread_cond_t wake;
    int started, sleeping;
    atomic_int gen, busy;
    double contended_until, backoff;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0.0, 0.0};

/* Under the submit lock: a long wait happened (contended) or not; set when steps may use the helper again. */
static void note_contention(const int contended) {
    if (!contended) {
        pool.backoff = 0.0;
        return;
    }
    pool.backoff = pool.backoff == 0.0 ? BACKOFF_MIN_US : (2 * pool.backoff < BACKOFF_MAX_US ? 2 * pool.backoff
                                                                                            : BACKOFF_MAX_US);
    pool.contended_until = now_us() + pool.backoff;
    atomic_fetch_add(&decode_backoffs, 1);
}
static job_t the_job;

static void *helper_main(void *arg) {
    (void)arg;
    int seen = atomic_load(&pool.gen);
    for (;;) {
        const double t0 = now_us();
        while (atomic_load(&pool.gen) == seen && now_us() - t0 < HELPER_SPIN_US) CPU_RELAX();
        if (atomic_load(&pool.gen) == seen) {
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.gen) == seen) {
                pool.sleeping = 1;
                pthread_cond_wait(&pool.wake, &pool.lock);
                pool.sleeping = 0;
            }
            pthread_mutex_unlock(&pool.lock);
        }
        atomic_store(&pool.busy, 1);          /* then read gen: see decode_model_f32 */
        const int g = atomic_load(&pool.gen);
        if (g != seen) {
            seen = g;
            run_phases(&the_job, 0);
        }
        atomic_store(&pool.busy, 0);
    }
    return NULL;
}

static void after_fork_child(void) {
    /* The helper thread does not exist in a forked child: start afresh. */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.submit, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
    pool.sleeping = 0;
    atomic_store(&pool.busy, 0);
}

static int start_helper(void) {
    if (pool.started) return pool.started > 0;
    pthread_t t;
    pthread_atfork(NULL, NULL, after_fork_child);
    pool.started = pthread_create(&t, NULL, helper_main, NULL) == 0 ? 1 : -1;
    if (pool.started > 0) pthread_detach(t);
    return pool.started > 0;
}

/* logits: [M, vocab]; hidden_out: [M, H]. use_helper: 0 runs on the caller alone. */
int decode_model_f32(const int64_t *ids, const float *embed, int vocab, const float *lm_head, float *hidden_out,
                     float *logits, int M, int H, int num_layers, const float *const *weights, float *const *kv,
                     const float *final_norm, const float *cos_cache, const float *sin_cache,
                     const int64_t *positions, const int64_t *slots, long num_slots, const int32_t *block_tables,
                     int table_width, const int32_t *context_lens, int num_heads, int num_kv_heads, int head_dim,
                     int inter, int block_size, float eps, float scale, int use_helper) {
    for (int m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= vocab) return DL_BAD_ID;
    if (num_layers > MAX_LAYERS) return DL_NO_MEMORY;
    const int q_size = num_heads * head_dim, qkv_size = q_size + 2 * num_kv_heads * head_dim;
    const long floats = (long)M * (3L * H + qkv_size + 2L * q_size + 3L * inter);
    float *buf = malloc(sizeof(float) * floats);
    if (!buf) return DL_NO_MEMORY;
    /* One step at a time uses the helper; a second engine thread in the process runs alone. */
    int helper = use_helper && now_us() >= pool.contended_until && pthread_mutex_trylock(&pool.submit) == 0;
    if (helper && !start_helper()) {
        pthread_mutex_unlock(&pool.submit);
        helper = 0;
    }
    if (helper && atomic_load(&pool.busy)) {   /* the helper must leave the last step first */
        const double t0 = now_us();
        while (atomic_load(&pool.busy) && now_us() - t0 < WAIT_SPIN_US) CPU_RELAX();
        if (atomic_load(&pool.busy)) {         /* descheduled in there: run this step alone */
            note_contention(1);
            pthread_mutex_unlock(&pool.submit);
            helper = 0;
        }
    }
    /* Under the submit lock: for a small step, run alone if that has been faster lately. */
    int adapt_m = helper && M <= ADAPT_MAX_M ? M : 0, alone = 0;
    if (adapt_m) {
        const double *ema = adapt[adapt_m - 1].ema;
        const long n = ++adapt[adapt_m - 1].steps;
        const int prefer_alone = ema[0] > 0 && ema[1] > 0 && ema[1] < ema[0];
        alone = ema[1] == 0 ? n > 1 : (ema[0] == 0 ? 0 : prefer_alone ^ (n % EXPLORE_EVERY == 0));
    }
    const int with_helper = helper && !alone;
    job_t local;
    job_t *j = with_helper ? &the_job : &local;
    j->ids = ids; j->embed = embed; j->final_norm = final_norm; j->lm_head = lm_head;
    j->cos_cache = cos_cache; j->sin_cache = sin_cache; j->weights = weights; j->kv = kv;
    j->hidden_out = hidden_out; j->logits = logits; j->positions = positions; j->slots = slots;
    j->block_tables = block_tables; j->context_lens = context_lens; j->num_slots = num_slots;
    j->M = M; j->H = H; j->num_layers = num_layers; j->vocab = vocab; j->table_width = table_width;
    j->num_heads = num_heads; j->num_kv_heads = num_kv_heads; j->head_dim = head_dim; j->inter = inter;
    j->block_size = block_size; j->eps = eps; j->scale = scale;
    j->x = buf; j->h = j->x + (long)M * H; j->normed = j->h + (long)M * H; j->qkv = j->normed + (long)M * H;
    j->q = j->qkv + (long)M * qkv_size; j->attn = j->q + (long)M * q_size; j->gu = j->attn + (long)M * q_size;
    j->act = j->gu + 2L * M * inter;
    j->num_phases = num_layers * PHASES_PER_LAYER + 2;
    atomic_store(&j->status, DL_OK);
    atomic_store(&j->waited_long, 0);
    for (int p = 0; p < j->num_phases; p++) {
        atomic_store(&j->next[p], 0);
        atomic_store(&j->done[p], 0);
    }
    if (with_helper) {
        pthread_mutex_lock(&pool.lock);
        atomic_fetch_add(&pool.gen, 1);
        if (pool.sleeping) pthread_cond_signal(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    const double t0 = now_us();
    run_phases(j, 1);
    const int status = atomic_load(&j->status);
    if (adapt_m) {
        double *ema = &adapt[adapt_m - 1].ema[alone];
        const double dt = now_us() - t0;
        *ema = *ema == 0 ? dt : (1 - EMA_WEIGHT) * *ema + EMA_WEIGHT * dt;
        if (alone) atomic_fetch_add(&decode_alone_steps, 1);
    }
    if (with_helper) {
        atomic_fetch_add(&decode_helper_steps, 1);
        note_contention(atomic_load(&j->waited_long));
    }
    if (helper) pthread_mutex_unlock(&pool.submit);
    free(buf);
    return status;
}
