/* A randomized model of a program using mergeable memory, checked against a shadow after every
 * step. Run under LD_PRELOAD=libpageone_preload.so (KSM off) with PAGEONE_MERGE_PERIOD_MS small:
 *
 *     model SEED SECONDS
 *
 * Writer threads keep writing pages (shared contents, zero pages, unique pages); the main thread
 * maps, unmaps (also through free() of large malloc blocks, which glibc unmaps internally),
 * mremaps, madvises (DONTNEED, FREE, MERGEABLE, UNMERGEABLE, DONTDUMP, DODUMP) parts of regions,
 * mprotects and mlocks them (or all memory: mlockall(MCL_CURRENT), munlockall), forks (children
 * check what they inherited, write, exec or exit, or live on a while
 * with an engine of their own) and signals itself (the handler writes registered memory). Every
 * page must read what the shadow says: the last bytes written, zeros after DONTNEED, zeros or the
 * old bytes after FREE.
 * With MODEL_RAW set, it also drops pages with MADV_DONTNEED through the system call itself,
 * which no shim sees: such a page must read zeros, as the kernel gives, merged or not.
 * Prints "OK steps=N merged_mappings=M"; on the first wrong page prints the seed, the step and
 * the page, and exits 1. With MODEL_MERGE_ALL set, the program first asks for
 * PR_SET_MEMORY_MERGE: every anonymous mapping (its shadow, its threads' stacks, its heap) is
 * registered too. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
#define SHARED 16   /* contents 1..SHARED are shared patterns, 0 is the zero page */
#define UNIQUE 255  /* a page of its own, derived from its version */
#define MAXREG 48
#define WRITERS 3

enum { F_RO = 1, F_MAYBE_ZERO = 2, F_LOCKED = 4, F_RAW = 8 };

struct region {
    unsigned char *addr;
    size_t pages;
    unsigned char *cid;  /* content per page */
    uint32_t *ver;       /* version per page (unique contents) */
    unsigned char *flag; /* F_* per page */
    uint32_t *hist;      /* shared contents (bit per content) each page ever held */
    void *malloc_block;  /* set when the region lies in a malloc'd block */
    int used;
};

static struct region R[MAXREG];
static pthread_rwlock_t big = PTHREAD_RWLOCK_INITIALIZER;
/* The last structural steps, printed with a failure (MODEL_TRACE set: as they happen). */
static int tracing;
/* MODEL_HUGE: regions are advised MADV_HUGEPAGE before they are filled, and MADV_HUGEPAGE is one
 * more advice given to parts of them (merged ones too). */
static int huge;
/* MODEL_RAW: see the top. */
static int raw;
static char trail[64][160];
static unsigned trail_n;
#define TRACE(...)                                                                                 \
    do {                                                                                           \
        snprintf(trail[trail_n++ % 64], sizeof trail[0], __VA_ARGS__);                             \
        if (tracing)                                                                               \
            fputs(trail[(trail_n - 1) % 64], stderr);                                              \
    } while (0)

static void print_trail(void) {
    unsigned from = trail_n > 64 ? trail_n - 64 : 0;
    for (unsigned i = from; i < trail_n; i++)
        fputs(trail[i % 64], stdout);
}
static volatile int stopping;
static uint64_t seed;
static long step;
static unsigned char patterns[SHARED + 1][PAGE];

/* The signal page: written only by the handler. */
static volatile uint64_t *sig_page;
static volatile uint64_t sig_count;

static uint64_t next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static void unique_page(unsigned char *out, uint32_t ver) {
    uint64_t s = 0x9e3779b97f4a7c15ULL ^ ((uint64_t)ver << 20) ^ seed;
    for (size_t i = 0; i < PAGE; i += 8) {
        uint64_t v = next(&s);
        memcpy(out + i, &v, 8);
    }
}

static void expected(const struct region *r, size_t i, unsigned char *out) {
    if (r->cid[i] == UNIQUE)
        unique_page(out, r->ver[i]);
    else
        memcpy(out, patterns[r->cid[i]], PAGE);
}

/* What a page holds, as far as the model can name it. */
static int name_content(const unsigned char *p) {
    for (int c = 0; c <= SHARED; c++)
        if (memcmp(p, patterns[c], PAGE) == 0)
            return c;
    return -1;
}

static void fail(const char *what, int k, size_t i) {
    print_trail();
    printf("FAIL seed=%llu step=%ld: %s: region %d page %zu at %p (cid %u flag %u) differs: "
           "it holds content %d\n",
           (unsigned long long)seed, step, what, k, i, (void *)(R[k].addr + i * PAGE),
           R[k].cid[i], R[k].flag[i], name_content(R[k].addr + i * PAGE));
    fflush(stdout);
    _exit(1);
}

static void check_page(int k, size_t i, const char *what) {
    static __thread unsigned char want[PAGE];
    struct region *r = &R[k];
    const unsigned char *p = r->addr + i * PAGE;
    if (r->addr == (unsigned char *)sig_page && i == 0)
        return; /* checked separately */
    /* Dropped through the system call: zeros, as the kernel gives, whatever it held. */
    if (r->flag[i] & F_RAW) {
        if (memcmp(p, patterns[0], PAGE) != 0)
            fail(what, k, i);
        return;
    }
    expected(r, i, want);
    if (memcmp(p, want, PAGE) == 0)
        return;
    if ((r->flag[i] & F_MAYBE_ZERO) && memcmp(p, patterns[0], PAGE) == 0)
        return;
    fail(what, k, i);
}

static void check_region(int k, const char *what) {
    for (size_t i = 0; i < R[k].pages; i++)
        check_page(k, i, what);
}

static void check_all(const char *what) {
    for (int k = 0; k < MAXREG; k++)
        if (R[k].used)
            check_region(k, what);
    /* The handler writes the page, then counts: a read between the two sees one more. */
    uint64_t before = sig_count, v = sig_page ? sig_page[0] : 0, after = sig_count;
    if (sig_page && (v < before || v > after + 1)) {
        printf("FAIL seed=%llu step=%ld: %s: signal page reads %llu, %llu signals handled\n",
               (unsigned long long)seed, step, what, (unsigned long long)v,
               (unsigned long long)after);
        _exit(1);
    }
}

static void write_page(struct region *r, size_t i, uint64_t *rng, uint32_t ver) {
    unsigned kind = next(rng) % 10;
    unsigned char *p = r->addr + i * PAGE;
    if (kind < 6) {
        r->cid[i] = 1 + next(rng) % SHARED;
        r->hist[i] |= 1u << r->cid[i];
        memcpy(p, patterns[r->cid[i]], PAGE);
    } else if (kind < 8) {
        r->cid[i] = 0;
        memset(p, 0, PAGE);
    } else {
        r->cid[i] = UNIQUE;
        r->ver[i] = ver;
        unique_page(p, ver);
    }
    r->flag[i] &= ~(F_MAYBE_ZERO | F_RAW);
}

static void *writer(void *arg) {
    long t = (long)arg;
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &s, NULL);
    uint64_t rng = seed * 31 + t + 1;
    uint32_t ver = (uint32_t)t << 24;
    while (!stopping) {
        pthread_rwlock_rdlock(&big);
        for (int n = 0; n < 64; n++) {
            int k = next(&rng) % MAXREG;
            struct region *r = &R[k];
            if (!r->used || r->pages == 0)
                continue;
            size_t i = next(&rng) % r->pages;
            if ((size_t)(i % WRITERS) != (size_t)t || (r->flag[i] & F_RO))
                continue;
            if ((unsigned char *)sig_page == r->addr && i == 0)
                continue;
            write_page(r, i, &rng, ++ver);
        }
        pthread_rwlock_unlock(&big);
        usleep(200);
    }
    return NULL;
}

static void on_signal(int sig) {
    (void)sig;
    sig_page[0] = sig_page[0] + 1;
    sig_count++;
}

static int free_slot(void) {
    for (int k = 0; k < MAXREG; k++)
        if (!R[k].used)
            return k;
    return -1;
}

/* What heap pages held before their malloc block was freed: the heap is not unmapped, so a page
 * of a later block there may still lie over a copy of such bytes (bits as in region.hist, by
 * page address; a table with linear probing). */
#define HEAP_PAGES 262144
static uintptr_t heap_addr[HEAP_PAGES];
static uint32_t heap_hist[HEAP_PAGES];

static uint32_t *heap_entry(uintptr_t a, int add) {
    size_t i = (size_t)((a / PAGE) * 0x9E3779B97F4A7C15ULL >> 40) % HEAP_PAGES;
    for (size_t n = 0; n < HEAP_PAGES; n++, i = (i + 1) % HEAP_PAGES) {
        if (heap_addr[i] == a)
            return &heap_hist[i];
        if (heap_addr[i] == 0) {
            if (!add)
                return NULL;
            heap_addr[i] = a;
            return &heap_hist[i];
        }
    }
    return NULL;
}

static void track(int k, unsigned char *addr, size_t pages, void *block) {
    struct region *r = &R[k];
    r->addr = addr;
    r->pages = pages;
    r->cid = calloc(pages + 1, 1);
    r->ver = calloc(pages + 1, sizeof *r->ver);
    r->flag = calloc(pages + 1, 1);
    r->hist = calloc(pages + 1, sizeof *r->hist);
    for (size_t i = 0; block && i < pages; i++) {
        uint32_t *h = heap_entry((uintptr_t)addr + i * PAGE, 0);
        r->hist[i] = h ? *h : 0;
    }
    r->malloc_block = block;
    r->used = 1;
}

static void untrack(int k) {
    for (size_t i = 0; R[k].malloc_block && i < R[k].pages; i++) {
        uint32_t *h = heap_entry((uintptr_t)R[k].addr + i * PAGE, 1);
        if (h)
            *h |= R[k].hist[i];
    }
    free(R[k].cid);
    free(R[k].ver);
    free(R[k].flag);
    free(R[k].hist);
    memset(&R[k], 0, sizeof R[k]);
}

static void fill_region(int k, uint64_t *rng) {
    /* Unique contents never repeat (a region has fewer than 4096 pages, and several regions are
     * filled in one step), so they never merge. */
    static uint32_t fills;
    uint32_t ver = 0x80000000u | (fills++ & 0x7FFFFu) << 12;
    for (size_t i = 0; i < R[k].pages; i++)
        write_page(&R[k], i, rng, ver + (uint32_t)i);
}

static void new_region(uint64_t *rng, void *hint) {
    int k = free_slot();
    if (k < 0)
        return;
    size_t pages = 16 + next(rng) % 2048;
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | (hint ? MAP_FIXED_NOREPLACE : 0);
    unsigned char *p = mmap(hint, pages * PAGE, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (p == MAP_FAILED)
        p = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return;
    track(k, p, pages, NULL);
    TRACE("step %ld new region %d at %p (%zu pages)\n", step, k, (void *)p, pages);
    if (huge)
        madvise(p, pages * PAGE, MADV_HUGEPAGE);
    fill_region(k, rng);
    madvise(p, pages * PAGE, MADV_MERGEABLE);
}

/* A large malloc block (glibc maps it, and unmaps it in free() with a call no shim sees). */
static void new_malloc_region(uint64_t *rng) {
    int k = free_slot();
    if (k < 0)
        return;
    size_t bytes = (64 + next(rng) % 1024) * PAGE;
    unsigned char *b = malloc(bytes);
    if (!b)
        return;
    unsigned char *p = (unsigned char *)(((uintptr_t)b + PAGE - 1) & ~(PAGE - 1));
    size_t pages = (bytes - (size_t)(p - b)) / PAGE - 1;
    track(k, p, pages, b);
    TRACE("step %ld new malloc region %d at %p (%zu pages)\n", step, k, (void *)p, pages);
    fill_region(k, rng);
    madvise(p, pages * PAGE, MADV_MERGEABLE);
}

/* A random page range [a, a+n) of region k. */
static void subrange(uint64_t *rng, int k, size_t *a, size_t *n) {
    *a = next(rng) % R[k].pages;
    *n = 1 + next(rng) % (R[k].pages - *a < 64 ? R[k].pages - *a : 64);
}

static int pick(uint64_t *rng) {
    for (int tries = 0; tries < 100; tries++) {
        int k = 1 + next(rng) % (MAXREG - 1);
        if (R[k].used && R[k].pages > 0)
            return k;
    }
    return -1;
}

static void op_unmap(uint64_t *rng, int k) {
    struct region *r = &R[k];
    TRACE("step %ld unmap region %d at %p (%zu pages)\n", step, k, (void *)r->addr, r->pages);
    if (r->malloc_block) {
        /* Protections outlive free(): the allocator writes its own bookkeeping there. */
        mprotect(r->addr, r->pages * PAGE, PROT_READ | PROT_WRITE);
        munlock(r->addr, r->pages * PAGE);
        free(r->malloc_block);
        untrack(k);
        new_malloc_region(rng); /* often at the same address */
        return;
    }
    size_t a, n;
    subrange(rng, k, &a, &n);
    munmap(r->addr + a * PAGE, n * PAGE);
    size_t tail = r->pages - a - n;
    int k2 = tail ? free_slot() : -1;
    if (tail && k2 >= 0) {
        track(k2, r->addr + (a + n) * PAGE, tail, NULL);
        memcpy(R[k2].cid, r->cid + a + n, tail);
        memcpy(R[k2].ver, r->ver + a + n, tail * sizeof *r->ver);
        memcpy(R[k2].flag, r->flag + a + n, tail);
        memcpy(R[k2].hist, r->hist + a + n, tail * sizeof *r->hist);
    } else if (tail) {
        munmap(r->addr + (a + n) * PAGE, tail * PAGE);
    }
    r->pages = a;
    if (a == 0)
        untrack(k);
}

static void op_remap(uint64_t *rng, int k) {
    struct region *r = &R[k];
    if (r->malloc_block)
        return;
    size_t pages = r->pages + (next(rng) % 2 ? 1 + next(rng) % 256 : 0);
    size_t shrink = next(rng) % 4 == 0 && r->pages > 2 ? r->pages / 2 : 0;
    if (shrink)
        pages = shrink;
    for (size_t i = 0; i < r->pages; i++)
        if (r->flag[i] & (F_RO | F_LOCKED))
            return; /* keep it simple: only plain regions move */
    unsigned char *p = mremap(r->addr, r->pages * PAGE, pages * PAGE, MREMAP_MAYMOVE);
    TRACE("step %ld mremap region %d %p+%zu -> %p+%zu\n", step, k, (void *)r->addr, r->pages,
          (void *)p, pages);
    if (p == MAP_FAILED)
        return;
    r->cid = realloc(r->cid, pages + 1);
    r->ver = realloc(r->ver, (pages + 1) * sizeof *r->ver);
    r->flag = realloc(r->flag, pages + 1);
    r->hist = realloc(r->hist, (pages + 1) * sizeof *r->hist);
    for (size_t i = r->pages; i < pages; i++)
        r->cid[i] = 0, r->ver[i] = 0, r->flag[i] = 0, r->hist[i] = 0;
    r->addr = p;
    r->pages = pages;
}

/* MADV_DONTNEED of pages [a, a+n) of region k through the system call, which no shim sees. */
static void drop_raw(int k, size_t a, size_t n) {
    struct region *r = &R[k];
    for (size_t i = a; i < a + n; i++)
        if (r->flag[i] & F_LOCKED)
            return;
    TRACE("step %ld raw madvise DONTNEED region %d pages %zu+%zu at %p\n", step, k, a, n,
          (void *)(r->addr + a * PAGE));
    /* Refused (a locked mapping the model does not know of: a block malloc placed in heap
     * memory locked by an earlier mlockall), the pages before the refusal may have been dropped:
     * zeros or their bytes, as after a refused MADV_DONTNEED through the shim. */
    int refused = syscall(SYS_madvise, r->addr + a * PAGE, n * PAGE, MADV_DONTNEED) != 0;
    for (size_t i = a; i < a + n; i++)
        r->flag[i] |= refused ? F_MAYBE_ZERO : F_RAW;
}

static void op_advise(uint64_t *rng, int k) {
    size_t a, n;
    subrange(rng, k, &a, &n);
    struct region *r = &R[k];
    if (raw && next(rng) % 3 == 0) {
        drop_raw(k, a, n);
        return;
    }
    /* DONTDUMP and DODUMP change no bytes: the engine carries them onto what it maps. */
    unsigned choice = next(rng) % (huge ? 7 : 6);
    int advice = choice == 0   ? MADV_DONTNEED
                 : choice == 1 ? MADV_FREE
                 : choice == 2 ? MADV_UNMERGEABLE
                 : choice == 3 ? MADV_MERGEABLE
                 : choice == 4 ? MADV_DONTDUMP
                 : choice == 5 ? MADV_DODUMP
                               : MADV_HUGEPAGE;
    for (size_t i = a; i < a + n; i++)
        if (r->flag[i] & F_LOCKED && advice == MADV_DONTNEED)
            return; /* DONTNEED on locked memory fails; not what this checks */
    TRACE("step %ld madvise %d region %d pages %zu+%zu at %p\n", step, advice, k, a, n,
          (void *)(r->addr + a * PAGE));
    if (madvise(r->addr + a * PAGE, n * PAGE, advice) != 0) {
        /* The kernel applies it mapping by mapping and stops at one it refuses (a locked one):
         * the pages before it may have been dropped. */
        if (advice == MADV_DONTNEED || advice == MADV_FREE)
            for (size_t i = a; i < a + n; i++)
                r->flag[i] |= F_MAYBE_ZERO;
        return;
    }
    for (size_t i = a; i < a + n; i++) {
        if (advice == MADV_DONTNEED)
            r->cid[i] = 0, r->flag[i] &= ~F_MAYBE_ZERO;
        else if (advice == MADV_FREE)
            r->flag[i] |= F_MAYBE_ZERO;
    }
}

static void op_protect(uint64_t *rng, int k) {
    size_t a, n;
    subrange(rng, k, &a, &n);
    struct region *r = &R[k];
    int ro = next(rng) % 2;
    TRACE("step %ld mprotect ro=%d region %d pages %zu+%zu\n", step, ro, k, a, n);
    if (mprotect(r->addr + a * PAGE, n * PAGE, ro ? PROT_READ : PROT_READ | PROT_WRITE) != 0)
        return;
    for (size_t i = a; i < a + n; i++)
        r->flag[i] = ro ? (r->flag[i] | F_RO) : (r->flag[i] & ~F_RO);
}

/* mlockall(MCL_CURRENT) or munlockall(): every page of every region locked, or none. */
static void lock_all(int lock) {
    TRACE("step %ld %s\n", step, lock ? "mlockall(MCL_CURRENT)" : "munlockall");
    if ((lock ? mlockall(MCL_CURRENT) : munlockall()) != 0)
        return;
    for (int k = 0; k < MAXREG; k++)
        for (size_t i = 0; R[k].used && i < R[k].pages; i++)
            R[k].flag[i] = lock ? (R[k].flag[i] | F_LOCKED) : (R[k].flag[i] & ~F_LOCKED);
}

static void op_lock(uint64_t *rng, int k) {
    size_t a, n;
    if (next(rng) % 8 == 0) {
        lock_all(next(rng) % 2);
        return;
    }
    subrange(rng, k, &a, &n);
    struct region *r = &R[k];
    int lock = next(rng) % 2;
    TRACE("step %ld mlock=%d region %d pages %zu+%zu\n", step, lock, k, a, n);
    if ((lock ? mlock : munlock)(r->addr + a * PAGE, n * PAGE) != 0)
        return;
    for (size_t i = a; i < a + n; i++)
        r->flag[i] = lock ? (r->flag[i] | F_LOCKED) : (r->flag[i] & ~F_LOCKED);
}

static void op_fork(uint64_t *rng) {
    unsigned what = next(rng) % 3;
    TRACE("step %ld fork %u\n", step, what);
    pid_t c = fork();
    if (c < 0)
        return;
    if (c == 0) {
        check_all("in a forked child");
        if (what == 0)
            execl("/bin/true", "true", (char *)NULL);
        if (what == 1) {
            uint64_t r2 = seed ^ 77;
            for (int n = 0; n < 256; n++) {
                int k = pick(&r2);
                if (k < 0)
                    break;
                size_t i = next(&r2) % R[k].pages;
                if (!(R[k].flag[i] & F_RO))
                    write_page(&R[k], i, &r2, 0x40000000u + n);
            }
            check_all("in a forked child after its writes");
            /* Its engine starts a merge period after the fork and merges what it inherited:
             * written again meanwhile and afterwards, every page stays right. */
            for (int round = 0; round < 3; round++) {
                usleep(60000);
                check_all("in a forked child while its engine runs");
                for (int n = 0; n < 64; n++) {
                    int k = pick(&r2);
                    if (k < 0)
                        break;
                    size_t i = next(&r2) % R[k].pages;
                    if (!(R[k].flag[i] & F_RO))
                        write_page(&R[k], i, &r2, 0x50000000u + round * 64 + n);
                }
            }
            check_all("in a forked child after more writes");
        }
        _exit(0);
    }
    int status = 0;
    waitpid(c, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        printf("FAIL seed=%llu step=%ld: a forked child failed (status %d)\n",
               (unsigned long long)seed, step, status);
        _exit(1);
    }
}

static int merged_mappings(void) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int n = 0;
    while (f && fgets(line, sizeof line, f))
        if (strstr(line, "pageone"))
            n++;
    if (f)
        fclose(f);
    return n;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: model SEED SECONDS\n");
        return 2;
    }
    seed = strtoull(argv[1], NULL, 0) | 1;
    tracing = getenv("MODEL_TRACE") != NULL;
    huge = getenv("MODEL_HUGE") != NULL;
    raw = getenv("MODEL_RAW") != NULL;
    double seconds = atof(argv[2]);
    uint64_t rng = seed;
    for (int c = 1; c <= SHARED; c++)
        for (size_t i = 0; i < PAGE; i += 8) {
            uint64_t v = next(&rng);
            memcpy(patterns[c] + i, &v, 8);
        }
    /* Region 0 holds the signal page and is never changed structurally. */
    new_region(&rng, NULL);
    sig_page = (volatile uint64_t *)R[0].addr;
    memset(R[0].addr, 0, PAGE);
    R[0].cid[0] = 0;
    signal(SIGUSR1, on_signal);
    if (getenv("MODEL_MERGE_ALL") && prctl(67 /* PR_SET_MEMORY_MERGE */, 1, 0, 0, 0) != 0) {
        printf("FAIL prctl(PR_SET_MEMORY_MERGE): %s\n", strerror(errno));
        return 1;
    }
    for (int i = 0; i < 8; i++)
        next(&rng) % 2 ? new_region(&rng, NULL) : new_malloc_region(&rng);
    pthread_t w[WRITERS];
    for (long t = 0; t < WRITERS; t++)
        pthread_create(&w[t], NULL, writer, (void *)t);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int most_merged = 0;
    for (step = 0;; step++) {
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (t1.tv_sec - t0.tv_sec + (t1.tv_nsec - t0.tv_nsec) * 1e-9 > seconds)
            break;
        unsigned op = next(&rng) % 100;
        if (op < 3) {
            /* A process-wide signal while this thread (and the writers) block it: only a thread
             * of the engine could take it now, and the handler writes registered memory. If no
             * thread can, it waits until this thread unblocks it. */
            sigset_t s;
            sigemptyset(&s);
            sigaddset(&s, SIGUSR1);
            pthread_sigmask(SIG_BLOCK, &s, NULL);
            kill(getpid(), SIGUSR1);
            usleep(1000);
            pthread_sigmask(SIG_UNBLOCK, &s, NULL);
            continue;
        }
        if (op < 40) {
            usleep(2000); /* let writes and merges happen */
            pthread_rwlock_wrlock(&big);
            int k = pick(&rng);
            if (k >= 0)
                check_region(k, "between writes");
            pthread_rwlock_unlock(&big);
            continue;
        }
        pthread_rwlock_wrlock(&big);
        check_all("before a change");
        int k = pick(&rng);
        if (op < 48)
            next(&rng) % 2 ? new_region(&rng, NULL) : new_malloc_region(&rng);
        else if (k < 0)
            ;
        else if (op < 58)
            op_unmap(&rng, k);
        else if (op < 64) {
            /* A new mapping where one was just unmapped. */
            void *at = R[k].addr;
            op_unmap(&rng, k);
            if (!R[k].used)
                new_region(&rng, at);
        } else if (op < 70)
            op_remap(&rng, k);
        else if (op < 84)
            op_advise(&rng, k);
        else if (op < 90)
            op_protect(&rng, k);
        else if (op < 94)
            op_lock(&rng, k);
        else
            op_fork(&rng);
        check_all("after a change");
        int m = merged_mappings();
        if (m > most_merged)
            most_merged = m;
        pthread_rwlock_unlock(&big);
    }
    stopping = 1;
    for (int t = 0; t < WRITERS; t++)
        pthread_join(w[t], NULL);
    check_all("at the end");
    printf("OK steps=%ld merged_mappings=%d signals=%llu\n", step, most_merged,
           (unsigned long long)sig_count);
    return 0;
}
