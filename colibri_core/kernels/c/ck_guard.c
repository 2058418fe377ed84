/* ck_guard.c -- a model file that shrinks under its mapping must not kill the engine.
 *
 * A model file truncated in place while it is mapped loses the pages past its new end:
 * the next read of one of them (by a kernel, a pool thread, or numpy) raises
 * SIGBUS, whose default action kills the process. This file installs one process-wide
 * SIGBUS handler that knows the engine's mappings (a table of address ranges, registered
 * by mapguard.py when modelfile.py maps a file and unregistered before the unmap):
 *
 * - a fault (BUS_ADRERR) inside a registered range: the lost pages, from the faulting one
 *   to the end of that mapping, are replaced by anonymous zero pages, so the access runs
 *   again and returns; the range is marked damaged and a global fault counter goes up.
 *   The engine reads that counter after every forward step, decode step and expert load
 *   (one integer read) and fails the request with ModelFileDamaged naming the file: the
 *   zeros are never returned as a result.
 * - every other SIGBUS (another mapping, a hardware error, kill -BUS) goes to the handler
 *   that was installed before ours (Python's faulthandler under pytest or -X faulthandler),
 *   or, when there was none, to the default action (the process dies as it would have).
 *
 * Signal stack: the handler is installed with SA_ONSTACK, so a thread with an alternate
 * signal stack (the main thread once faulthandler is enabled) runs it there; other threads
 * run it on their own stack. That is enough: a truncated file faults on a data read, not
 * on stack exhaustion (which is SIGSEGV, not ours), so the faulting thread's stack has the
 * room of an ordinary call, and the handler uses a few dozen bytes of it.
 *
 * Signal safety: the handler calls only mmap() and sigaction() (raise() when re-raising a
 * sent signal) and reads/writes lock-free atomics. sigaction and raise are on POSIX's list
 * of async-signal-safe functions; mmap is not listed, but on Linux it is a plain system
 * call (glibc and musl's wrappers take no lock and allocate nothing). The table is a
 * static array that is never reallocated, so the handler never follows a freed pointer;
 * registration takes a mutex that the handler never touches. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "ck.h"

#ifndef MAP_ANONYMOUS
#define MAP_ANONYMOUS MAP_ANON
#endif

/* A model maps one file per routed expert: 58 MoE layers x 256 experts is ~15k. Slots
 * are static (zero pages until used: a few hundred KiB of address space, no memory). */
#define GUARD_SLOTS 65536

_Static_assert(ATOMIC_POINTER_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2 &&
               ATOMIC_LLONG_LOCK_FREE == 2,
               "the signal handler needs lock-free atomics");

typedef struct {
    _Atomic uintptr_t start, end;  /* [start, end) mapped; end == 0: slot free */
    atomic_int damaged;            /* set by the handler (or ck_guard_mark_damaged) */
} guard_slot;

static guard_slot slots[GUARD_SLOTS];
static atomic_int n_used;          /* slots [0, n_used) have been handed out at least once */
static int free_list[GUARD_SLOTS]; /* unregistered slots, reused first (under `lock`) */
static int n_free;
static _Atomic uint64_t faults;    /* damage seen, ever (faults + marks): the per-step check */
static struct sigaction previous;  /* the SIGBUS handler before ours */
static int installed;
static uintptr_t page_size;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* Hand the signal to whoever had it before us. */
static void chain(int sig, siginfo_t *info, void *ctx)
{
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != NULL) {
            previous.sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    } else if (previous.sa_handler == SIG_IGN && info != NULL && info->si_code <= 0) {
        return;                    /* a sent SIGBUS that was being ignored: still ignored */
    }
    /* No handler before ours: the default action. For a real fault, returning runs the
     * access again and the kernel delivers SIGBUS to the default action (the process
     * dies of SIGBUS, core dump and all). A sent signal is re-raised: it stays pending
     * (SIGBUS is blocked while we run) and is delivered when we return. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (info == NULL || info->si_code <= 0)
        raise(sig);
}

static void on_sigbus(int sig, siginfo_t *info, void *ctx)
{
    int saved_errno = errno;       /* mmap may set it; the interrupted code must not see it */
    if (info != NULL && info->si_code == BUS_ADRERR) {   /* a read past a file's end */
        uintptr_t a = (uintptr_t)info->si_addr;
        int n = atomic_load_explicit(&n_used, memory_order_acquire);
        for (int i = 0; i < n; i++) {
            /* end is published last at registration and cleared first at unregistration */
            uintptr_t end = atomic_load_explicit(&slots[i].end, memory_order_acquire);
            uintptr_t start = atomic_load_explicit(&slots[i].start, memory_order_relaxed);
            if (end == 0 || a < start || a >= end)
                continue;
            /* Every page from the faulting one to the mapping's end is past the file's new
             * end (the file shrank below this page), so replace them all at once: one
             * fault per damaged file instead of one per page. MAP_FIXED swaps the pages in
             * place; the mapping keeps its address and size, and its eventual munmap
             * releases these pages too. */
            uintptr_t lo = a & ~(page_size - 1);
            uintptr_t hi = (end + page_size - 1) & ~(page_size - 1);
            void *p = mmap((void *)lo, hi - lo, PROT_READ,
                           MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED)
                break;             /* cannot repair it: the fault is not ours to hide */
            atomic_store(&slots[i].damaged, 1);       /* the flag before the counter: */
            atomic_fetch_add(&faults, 1);             /* a reader that sees the count sees it */
            errno = saved_errno;
            return;                /* the faulting read runs again and reads zeros */
        }
    }
    chain(sig, info, ctx);
    errno = saved_errno;
}

/* Under `lock`. */
static int install_locked(void)
{
    if (installed)
        return 0;
    page_size = (uintptr_t)sysconf(_SC_PAGESIZE);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    /* `previous` is read before ours goes in: a fault on another thread at the moment of
     * the switch already finds it filled in. */
    if (sigaction(SIGBUS, NULL, &previous) != 0 || sigaction(SIGBUS, &sa, NULL) != 0)
        return -1;
    installed = 1;
    return 0;
}

int ck_guard_install(void)
{
    pthread_mutex_lock(&lock);
    int rc = install_locked();
    pthread_mutex_unlock(&lock);
    return rc;
}

int ck_guard_register(uintptr_t addr, uint64_t len)
{
    if (addr == 0 || len == 0 || addr + len < addr)
        return -1;
    pthread_mutex_lock(&lock);
    int slot = -1;
    if (install_locked() == 0) {
        if (n_free > 0) {
            slot = free_list[--n_free];
        } else if (atomic_load(&n_used) < GUARD_SLOTS) {
            slot = atomic_load(&n_used);
            atomic_store_explicit(&n_used, slot + 1, memory_order_release);
        }
    }
    if (slot >= 0) {
        atomic_store(&slots[slot].damaged, 0);
        atomic_store_explicit(&slots[slot].start, addr, memory_order_relaxed);
        atomic_store_explicit(&slots[slot].end, addr + (uintptr_t)len, memory_order_release);
    }
    pthread_mutex_unlock(&lock);
    return slot;
}

void ck_guard_unregister(int slot)
{
    if (slot < 0 || slot >= GUARD_SLOTS)
        return;
    pthread_mutex_lock(&lock);
    if (atomic_load(&slots[slot].end) != 0) {
        atomic_store_explicit(&slots[slot].end, 0, memory_order_release);
        atomic_store_explicit(&slots[slot].start, 0, memory_order_relaxed);
        free_list[n_free++] = slot;
    }
    pthread_mutex_unlock(&lock);
}

int ck_guard_damaged(int slot)
{
    if (slot < 0 || slot >= GUARD_SLOTS)
        return 0;
    return atomic_load(&slots[slot].damaged);
}

void ck_guard_mark_damaged(int slot)
{
    if (slot < 0 || slot >= GUARD_SLOTS)
        return;
    atomic_store(&slots[slot].damaged, 1);
    atomic_fetch_add(&faults, 1);
}

const uint64_t *ck_guard_counter(void)
{
    /* A plain aligned 64-bit load of it is atomic on the 64-bit targets we build for. */
    return (const uint64_t *)&faults;
}
