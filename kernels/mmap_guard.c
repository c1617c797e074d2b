/* A guard for memory-mapped model files: a read past the end of a file that was truncated while
 * mapped raises SIGBUS, which kills the process (a chat lost its session that way). Inside a
 * guarded range the handler maps a page of zeros where the file's page was and counts the fault,
 * so the read goes on with zeros and the caller, seeing the count move, refuses the result with
 * one error line. A SIGBUS outside every range goes to the handler that was there before. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MAX_RANGES 64

static volatile uintptr_t g_lo[MAX_RANGES], g_hi[MAX_RANGES]; /* [lo, hi): empty when lo == hi */
static volatile sig_atomic_t g_faults[MAX_RANGES];
static struct sigaction g_prev;
static int g_installed;

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    const uintptr_t a = (uintptr_t)si->si_addr;
    if (si->si_code > 0) { /* sent by the kernel for this access, not by kill() */
        for (int i = 0; i < MAX_RANGES; i++) {
            if (g_lo[i] <= a && a < g_hi[i]) {
                const uintptr_t page = a & ~((uintptr_t)sysconf(_SC_PAGESIZE) - 1);
                void *p = mmap((void *)page, (size_t)sysconf(_SC_PAGESIZE), PROT_READ,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
                if (p != MAP_FAILED) {
                    g_faults[i] = g_faults[i] + 1;
                    return; /* the read is done again, on zeros */
                }
            }
        }
    }
    if (g_prev.sa_flags & SA_SIGINFO) {
        if (g_prev.sa_sigaction) g_prev.sa_sigaction(sig, si, uc);
        return;
    }
    if (g_prev.sa_handler == SIG_IGN) return;
    if (g_prev.sa_handler != SIG_DFL) {
        g_prev.sa_handler(sig);
        return;
    }
    signal(SIGBUS, SIG_DFL); /* the access faults again on return: the default action ends it */
}

/* Guards [p, p + n); returns 0, or -1 when every slot is taken or the handler cannot be set. */
int kvg_guard(const void *p, int64_t n) {
    if (!g_installed) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGBUS, &sa, &g_prev) != 0) return -1;
        g_installed = 1;
    }
    for (int i = 0; i < MAX_RANGES; i++) {
        if (g_lo[i] == g_hi[i]) {
            g_hi[i] = 0; /* empty while it is being filled */
            g_faults[i] = 0;
            g_lo[i] = (uintptr_t)p;
            g_hi[i] = (uintptr_t)p + (uintptr_t)n;
            return 0;
        }
    }
    return -1;
}

/* Stops guarding the range that starts at p (before its mapping goes away). */
void kvg_unguard(const void *p) {
    for (int i = 0; i < MAX_RANGES; i++) {
        if (g_lo[i] == (uintptr_t)p && g_hi[i] != g_lo[i]) {
            g_hi[i] = g_lo[i];
        }
    }
}

/* Reads in the range that starts at p that found their page gone (-1: p is not guarded). */
int64_t kvg_faults(const void *p) {
    for (int i = 0; i < MAX_RANGES; i++) {
        if (g_lo[i] == (uintptr_t)p && g_hi[i] != g_lo[i]) return (int64_t)g_faults[i];
    }
    return -1;
}
