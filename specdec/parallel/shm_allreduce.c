/* The all-reduce of a tensor-parallel group whose ranks share one machine: through a mapped
 * region, in a fixed order, so every rank gets bitwise the same sums (vLLM's and SGLang's CPU
 * backends do the same for the same reason: gloo over loopback took 2.3 ms an all-reduce of one
 * hidden vector here, this ~10 us; docs/scaling.md).
 *
 * Region (`specdec.parallel.comm.ShmRegion` maps it): a header of SHM_HEADER bytes, rank r's
 * progress counter at r * 64 and its process id at SHM_PIDS + 4 r, then two sets (by the parity
 * of the call) of `world` slots of `slot_bytes` each. Call s (1, 2, ...) of every rank: copy its
 * part into its slot of set s % 2, publish s, wait until every rank published s, then sum the
 * slots in rank order. A rank writes set s % 2 again only at call s + 2, after every rank
 * published s + 1, which each does only after it finished reading call s: no second wait.
 * Vectors longer than a slot go in several calls. */
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernel_abi.h"

#define SHM_PIDS 2048

static inline volatile int64_t *progress(const struct specdec_group *g, int64_t r) {
    return (volatile int64_t *)(g->region + r * 64);
}

static inline float *slot(const struct specdec_group *g, int64_t call, int64_t r) {
    return (float *)(g->region + SPECDEC_SHM_HEADER + ((call & 1) * g->world + r) * g->slot_bytes);
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

/* Whether process `pid` is gone: no such process, or a zombie nobody has reaped yet. */
static int process_gone(int pid) {
    if (pid <= 0) return 0; /* not attached yet */
    if (kill(pid, 0) != 0) return 1;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *paren = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return paren && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
}

/* Wait until rank r published `call`: spin briefly, then yield, then sleep 20 us at a time;
 * every ~1 ms check that r's process lives and the clock against the timeout. */
static int wait_for(const struct specdec_group *g, int64_t r, int64_t call, double start) {
    const int *pids = (const int *)(g->region + SHM_PIDS);
    for (int64_t spin = 0;; spin++) {
        if (__atomic_load_n(progress(g, r), __ATOMIC_ACQUIRE) >= call) return SPECDEC_OK;
        if (spin < 4096) {
            __builtin_ia32_pause();
            continue;
        }
        if ((spin & 63) == 0) {
            const double waited = now_ms() - start;
            if (process_gone(__atomic_load_n(&pids[r], __ATOMIC_ACQUIRE))) return SPECDEC_ERR_PEER_GONE;
            if (waited > (double)g->timeout_ms) return SPECDEC_ERR_TIMEOUT;
            if (waited > 2.0) {
                const struct timespec nap = {0, 20000};
                nanosleep(&nap, NULL);
                continue;
            }
        }
        sched_yield();
    }
}

int group_allreduce(const struct specdec_group *g, float *x, int64_t n) {
    if (!g || !g->region || !g->calls || g->world < 1 || g->rank < 0 || g->rank >= g->world || n < 0 ||
        (n && !x) || g->slot_bytes < 64 || g->slot_bytes % 64)
        return SPECDEC_ERR_INVALID_ARGUMENT;
    if (g->world == 1) return SPECDEC_OK;
    const int64_t per = g->slot_bytes / (int64_t)sizeof(float);
    for (int64_t at = 0; at < n || (n == 0 && at == 0); at += per) {
        const int64_t len = n - at < per ? n - at : per;
        const int64_t call = ++*g->calls;
        if (len > 0) memcpy(slot(g, call, g->rank), x + at, (size_t)len * sizeof(float));
        __atomic_store_n(progress(g, g->rank), call, __ATOMIC_RELEASE);
        const double start = now_ms();
        for (int64_t r = 0; r < g->world; r++) {
            if (r == g->rank) continue;
            const int rc = wait_for(g, r, call, start);
            if (rc != SPECDEC_OK) return rc;
        }
        float *out = x + at;
        const float *first = slot(g, call, 0);
        for (int64_t i = 0; i < len; i++) out[i] = first[i];
        for (int64_t r = 1; r < g->world; r++) {
            const float *part = slot(g, call, r);
            for (int64_t i = 0; i < len; i++) out[i] += part[i];
        }
        if (n == 0) break;
    }
    return SPECDEC_OK;
}
