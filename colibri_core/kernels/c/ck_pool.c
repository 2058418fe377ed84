/* ck_pool.c -- the pipeline's threads: parallel loops whose caller never waits for a
 * thread that has not started.
 *
 * Why not an OpenMP region: its barriers wait for every thread of the team. On a busy
 * 2-CPU machine the second thread is often not running (another process holds its CPU),
 * and a decode step then waits a scheduler time slice per barrier (measured: 54 ms per
 * token instead of 10.5 ms on one thread). Here a loop is split into chunks; each thread
 * owns a contiguous range (so its reads stream in order and the prefetchers follow), takes
 * chunks from the front of its own range and, when done, steals from the back of the
 * others'. The caller is a participant too and returns once every chunk is done, so a
 * thread that never shows up costs nothing: the caller does its share.
 *
 * Workers spin for a while between loops (a decode step is a few dozen loops with a few
 * microseconds of Python between them), then sleep on a condition variable.
 *
 * A range is one 64-bit word: tag (20 bits) | front (22) | back (22). The tag is the
 * loop's generation, so a thread still holding an old loop's function can never claim a
 * chunk of a newer loop (its compare-and-swap fails). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif
#include "ck_internal.h"

/* ck.h's cycle counter: the pool times its loops with it (ck_pool_stats), the Python side
 * its stages */
uint64_t ck_rdtsc(void) {
#if defined(__x86_64__) || defined(__i386__)
    return __rdtsc();
#elif defined(__aarch64__)
    uint64_t v;
    __asm__ __volatile__("mrs %0, cntvct_el0" : "=r"(v));
    return v;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
#endif
}

const char *ck_cycle_counter_name(void) {
#if defined(__x86_64__) || defined(__i386__)
    return "rdtsc";
#elif defined(__aarch64__)
    return "cntvct_el0";
#else
    return "clock_gettime_ns";
#endif
}

#define MAX_THREADS 64
#define SPIN_ROUNDS 40000          /* ~100-200 us of pause instructions */
#define F_BITS 22
#define F_MASK ((1ull << F_BITS) - 1)
#define TAG_MASK ((1ull << 20) - 1)

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline uint64_t mk(uint64_t tag, uint64_t f, uint64_t b) {
    return ((tag & TAG_MASK) << (2 * F_BITS)) | (f << F_BITS) | b;
}

static struct {
    _Atomic uint64_t gen;             /* loop generation; odd while being set up */
    _Atomic(ck_chunk_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int nth;                  /* participants of this loop, caller included */
    _Atomic int64_t done;
    _Atomic uint64_t range[MAX_THREADS];
    _Atomic int sleepers;
    _Atomic int busy;                 /* a caller is inside ck_pool_for */
    /* since the last ck_pool_stats: chunks run by the caller / by the others, and rdtsc
     * cycles of the parallel loops / of the caller waiting for others' chunks at the end */
    _Atomic int64_t st_mine, st_others;
    int64_t st_loop, st_wait;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int workers;                      /* started (caller is participant 0) */
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* claim one chunk of range r: from the front if own, else from the back */
static int64_t claim(int r, uint64_t tag, int own) {
    uint64_t w = atomic_load_explicit(&P.range[r], memory_order_acquire);
    for (;;) {
        uint64_t f = (w >> F_BITS) & F_MASK, b = w & F_MASK;
        if (((w >> (2 * F_BITS)) & TAG_MASK) != (tag & TAG_MASK) || f >= b) return -1;
        uint64_t nw = own ? mk(tag, f + 1, b) : mk(tag, f, b - 1);
        if (atomic_compare_exchange_weak_explicit(&P.range[r], &w, nw, memory_order_acq_rel,
                                                  memory_order_acquire))
            return (int64_t)(own ? f : b - 1);
    }
}

/* participant `me` of loop `gen`: its own range first, then the others' */
static void work(int me, uint64_t gen) {
    ck_chunk_fn fn = atomic_load_explicit(&P.fn, memory_order_acquire);
    void *ctx = atomic_load_explicit(&P.ctx, memory_order_acquire);
    int nth = atomic_load_explicit(&P.nth, memory_order_acquire);
    if (atomic_load_explicit(&P.gen, memory_order_acquire) != gen || me >= nth) return;
    for (int k = 0; k < nth; k++) {
        int r = (me + k) % nth;
        int64_t c;
        while ((c = claim(r, gen >> 1, k == 0)) >= 0) {
            fn(ctx, c);
            atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
            atomic_fetch_add_explicit(me ? &P.st_others : &P.st_mine, 1, memory_order_relaxed);
        }
    }
}

static void *worker(void *arg) {
    const int me = (int)(intptr_t)arg;
    uint64_t last = atomic_load(&P.gen);
    for (;;) {
        uint64_t g;
        int spins = 0;
        while (((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == last) || (g & 1)) {
            if (++spins < SPIN_ROUNDS) { relax(); continue; }
            pthread_mutex_lock(&P.mu);
            atomic_fetch_add(&P.sleepers, 1);
            while ((g = atomic_load(&P.gen)) == last || (g & 1)) pthread_cond_wait(&P.cv, &P.mu);
            atomic_fetch_sub(&P.sleepers, 1);
            pthread_mutex_unlock(&P.mu);
            break;
        }
        last = g;
        work(me, g);
    }
    return NULL;
}

/* a forked child has none of the workers, and a lock one of them held stays held */
static void after_fork_child(void) {
    P.workers = 0;
    atomic_store(&P.busy, 0);
    atomic_store(&P.sleepers, 0);
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.cv, NULL);
}

static int start_workers(int n) {
    static int registered = 0;
    if (!registered) { pthread_atfork(NULL, NULL, after_fork_child); registered = 1; }
    while (P.workers < n) {
        pthread_t t;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &at, worker, (void *)(intptr_t)(P.workers + 1));
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        P.workers++;
    }
    return P.workers + 1;
}

void ck_pool_for(ck_chunk_fn fn, void *ctx, int64_t n, int nth) {
    if (nth > MAX_THREADS) nth = MAX_THREADS;
    if (nth > n) nth = (int)n;
    int expected = 0;
    if (nth <= 1 || n > (int64_t)F_MASK ||
        !atomic_compare_exchange_strong(&P.busy, &expected, 1)) {   /* nested or concurrent */
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
        return;
    }
    int avail = start_workers(nth - 1);
    if (nth > avail) nth = avail;
    uint64_t gen = atomic_load(&P.gen) + 1;       /* odd: being set up, nobody claims */
    atomic_store(&P.gen, gen);
    atomic_store_explicit(&P.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&P.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&P.nth, nth, memory_order_relaxed);
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    gen++;                                        /* even: open */
    for (int t = 0; t < nth; t++)
        atomic_store_explicit(&P.range[t], mk(gen >> 1, n * t / nth, n * (t + 1) / nth),
                              memory_order_relaxed);
    atomic_store(&P.gen, gen);                    /* seq_cst: pairs with the sleepers' check */
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    uint64_t t0 = ck_rdtsc();
    work(0, gen);
    uint64_t t1 = ck_rdtsc();
    while (atomic_load_explicit(&P.done, memory_order_acquire) < n) relax();
    uint64_t t2 = ck_rdtsc();
    P.st_loop += (int64_t)(t2 - t0);
    P.st_wait += (int64_t)(t2 - t1);
    atomic_store(&P.busy, 0);
}

void ck_pool_stats(int64_t *out) {
    out[0] = atomic_exchange(&P.st_mine, 0);
    out[1] = atomic_exchange(&P.st_others, 0);
    out[2] = P.st_loop;
    out[3] = P.st_wait;
    P.st_loop = P.st_wait = 0;
}

/* ------------------------------------------------------------------ self-check (tests) */

typedef struct { _Atomic int *hits; } check_ctx;

static void check_chunk(void *p, int64_t c) {
    check_ctx *k = p;
    atomic_fetch_add_explicit(&k->hits[c], 1, memory_order_relaxed);
    if (c % 7 == 0) usleep(1);           /* uneven chunks: threads steal from each other */
}

int64_t ck_pool_check(int64_t n, int nth, int rounds) {
    _Atomic int *hits = calloc((size_t)n, sizeof *hits);
    if (!hits) return -1;
    int64_t bad = 0;
    for (int r = 0; r < rounds; r++) {
        check_ctx k = {hits};
        ck_pool_for(check_chunk, &k, n, nth);
        for (int64_t c = 0; c < n; c++) {
            bad += atomic_load(&hits[c]) != r + 1;
        }
    }
    free(hits);
    return bad;
}
