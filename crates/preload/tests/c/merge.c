/* Run under LD_PRELOAD=libpageone_preload.so: madvise(MADV_MERGEABLE) and
 * prctl(PR_SET_MEMORY_MERGE) must save memory (KSM is off), every byte must stay what the
 * program wrote, and MADV_DONTNEED must still give zeros. Exits non-zero on any failure. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#define PAGE 4096UL
#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#define PR_GET_MEMORY_MERGE 68
#endif

static long pss_kib(void) {
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    long v = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "Pss: %ld kB", &v) == 1) break;
    if (f) fclose(f);
    return v;
}

static uint64_t content(size_t i) { return (i % 256) + 1; }

static void fill(unsigned char *p, size_t pages) {
    for (size_t i = 0; i < pages; i++) {
        uint64_t c = content(i);
        memcpy(p + i * PAGE + (c * 8) % (PAGE - 8), &c, 8);
    }
}

static int check(const unsigned char *p, size_t from, size_t pages, const char *what) {
    static unsigned char want[PAGE];
    for (size_t i = from; i < pages; i++) {
        memset(want, 0, PAGE);
        uint64_t c = content(i);
        memcpy(want + (c * 8) % (PAGE - 8), &c, 8);
        if (memcmp(p + i * PAGE, want, PAGE) != 0) {
            printf("FAIL %s: page %zu differs\n", what, i);
            return 1;
        }
    }
    return 0;
}

/* Waits up to $PAGEONE_TEST_WAIT (default 30) seconds for Pss to drop by `kib`. */
static int wait_saved(long before, long kib, const char *what) {
    const char *w = getenv("PAGEONE_TEST_WAIT");
    int tenths = (w ? atoi(w) : 30) * 10;
    for (int t = 0; t < tenths; t++) {
        long now = pss_kib();
        if (before - now >= kib) {
            printf("%s: Pss %ld -> %ld KiB\n", what, before, now);
            return 0;
        }
        usleep(100000);
    }
    printf("FAIL %s: Pss %ld -> %ld KiB, wanted -%ld\n", what, before, pss_kib(), kib);
    return 1;
}

/* How many of the pages at `pages` lie in mappings of a pageone store (merged). */
static size_t pages_merged(unsigned char **pages, size_t n) {
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    size_t merged = 0;
    while (f && fgets(line, sizeof line, f)) {
        unsigned long s, e;
        if (!strstr(line, "memfd:pageone") || sscanf(line, "%lx-%lx", &s, &e) != 2) continue;
        for (size_t i = 0; i < n; i++)
            if ((unsigned long)pages[i] >= s && (unsigned long)pages[i] < e) merged++;
    }
    if (f) fclose(f);
    return merged;
}

/* Waits up to $PAGEONE_TEST_WAIT (default 30) seconds for `want` of the pages to be merged. */
static int wait_pages_merged(const char *what, unsigned char **pages, size_t n, size_t want) {
    const char *w = getenv("PAGEONE_TEST_WAIT");
    int tenths = (w ? atoi(w) : 30) * 10;
    size_t got = 0;
    for (int t = 0; t < tenths; t++) {
        got = pages_merged(pages, n);
        if (got >= want) {
            printf("%s: %zu of %zu pages merged\n", what, got, n);
            return 0;
        }
        usleep(100000);
    }
    printf("FAIL %s: %zu of %zu pages merged, wanted %zu\n", what, got, n, want);
    return 1;
}

int main(void) {
    size_t pages = (64UL << 20) / PAGE;
    unsigned char *p = mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 2;
    fill(p, pages);
    long before = pss_kib();
    if (madvise(p, pages * PAGE, MADV_MERGEABLE) != 0) { perror("FAIL madvise"); return 1; }
    /* 16384 pages of 256 contents: nearly all of 64 MiB can go. */
    if (wait_saved(before, 48 << 10, "madvise(MADV_MERGEABLE)")) return 1;
    if (check(p, 0, pages, "after merging")) return 1;
    /* Discarded pages read as zeros, as anonymous memory does. */
    if (madvise(p, 1 << 20, MADV_DONTNEED) != 0) { perror("FAIL DONTNEED"); return 1; }
    for (size_t i = 0; i < (1 << 20); i++)
        if (p[i] != 0) { printf("FAIL DONTNEED: byte %zu is %d\n", i, p[i]); return 1; }
    fill(p, 256); /* the first MiB again */
    if (check(p, 0, pages, "after DONTNEED and refill")) return 1;
    /* Writes to merged pages are private. */
    p[5 * PAGE + 100] = 0x5a;
    if (p[5 * PAGE + 100] != 0x5a || p[(5 + 256) * PAGE + 100] != 0) { printf("FAIL COW\n"); return 1; }
    p[5 * PAGE + 100] = 0;
    if (madvise(p, pages * PAGE, MADV_UNMERGEABLE) != 0) { perror("FAIL UNMERGEABLE"); return 1; }
    if (check(p, 0, pages, "after MADV_UNMERGEABLE")) return 1;
    munmap(p, pages * PAGE);

    /* prctl: large anonymous mappings, existing and new, are merged. */
    size_t big = (96UL << 20) / PAGE;
    unsigned char *q = mmap(NULL, big * PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (q == MAP_FAILED) return 2;
    fill(q, big);
    before = pss_kib();
    if (prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) != 0) { perror("FAIL prctl"); return 1; }
    if (prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0) != 1) { printf("FAIL PR_GET_MEMORY_MERGE\n"); return 1; }
    if (wait_saved(before, 72 << 10, "prctl(PR_SET_MEMORY_MERGE)")) return 1;
    if (check(q, 0, big, "after prctl merging")) return 1;
    /* Unmapping part of a registered mapping leaves the rest correct (and registered). */
    if (munmap(q, 8 << 20) != 0) { perror("FAIL munmap"); return 1; }
    if (check(q, (8 << 20) / PAGE, big, "after partial munmap")) return 1;
    /* The new mapping is registered as it appears, so merging may start while it is filled:
     * the figure to save against is the Pss before it plus its full size. */
    long base = pss_kib();
    unsigned char *r = mmap(NULL, big * PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) return 2;
    fill(r, big);
    before = base + (long)(big * PAGE >> 10);
    if (wait_saved(before, 72 << 10, "a new mapping after prctl")) return 1;
    if (check(r, 0, big, "new mapping")) return 1;
    /* Small mappings and the heap merge too, as KSM marks every anonymous mapping: with the
     * engine's own memory kept apart, nothing needs to keep them out. Each page is looked up in
     * the process's mappings (the Pss of the regions above may still be falling). */
    size_t small = (4UL << 20) / PAGE;
    unsigned char *sm = mmap(NULL, small * PAGE, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (sm == MAP_FAILED) return 2;
    fill(sm, small);
    static unsigned char *sm_pages[(4UL << 20) / PAGE];
    for (size_t i = 0; i < small; i++) sm_pages[i] = sm + i * PAGE;
    if (wait_pages_merged("a small mapping after prctl", sm_pages, small, small * 9 / 10))
        return 1;
    if (check(sm, 0, small, "small mapping")) return 1;
    /* Heap blocks: glibc grows the heap with calls the shim does not see. */
    size_t heap_pages = 1024;
    unsigned char *blocks[1024];
    for (size_t i = 0; i < heap_pages; i++) {
        if (posix_memalign((void **)&blocks[i], PAGE, PAGE) != 0) return 2;
        memset(blocks[i], 0, PAGE);
        fill(blocks[i], 1);
    }
    if (wait_pages_merged("heap blocks after prctl", blocks, heap_pages, heap_pages * 9 / 10))
        return 1;
    for (size_t i = 0; i < heap_pages; i++)
        if (check(blocks[i], 0, 1, "malloc'ed block")) return 1;
    printf("OK\n");
    return 0;
}
