/*
 * pageone from C: 64 MiB of memory holding only 4 distinct pages is registered with an engine,
 * merged, written to, unregistered, and checked byte for byte at every step.
 *
 * Build (after `cargo build --release -p pageone-ffi`), from the repository root:
 *     cc -O2 -Iinclude examples/c/dedup.c target/release/libpageone.a \
 *        -lpthread -ldl -lm -lrt -o dedup
 * or against the shared library:
 *     cc -O2 -Iinclude examples/c/dedup.c -Ltarget/release -lpageone \
 *        -Wl,-rpath,"$PWD/target/release" -o dedup
 * or, installed with scripts/install-c.sh:
 *     cc -O2 examples/c/dedup.c $(pkg-config --cflags --libs pageone) -o dedup
 *
 * Run: ./dedup [MiB]   (Linux >= 6.8; exits non-zero on any failure)
 */
#define _GNU_SOURCE
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "pageone.h"

#define PATTERNS 4
#define MAX_SHARING 4096 /* pages mapping one copy (default 256) */

static size_t page_size;

/* The 64-bit word `w` of a page of pattern `p`: distinct per pattern and per word. */
static uint64_t word(unsigned p, size_t w) {
    return (uint64_t)(p + 1) * 0x9E3779B97F4A7C15ull + (uint64_t)w * 0xD6E8FEB86659FD93ull;
}

static void fill(uint8_t *page, unsigned p) {
    uint64_t *q = (uint64_t *)page;
    for (size_t w = 0; w < page_size / 8; w++) q[w] = word(p, w);
}

/* The page number of the first page that differs from what was written, or -1. */
static long first_bad(const uint8_t *mem, size_t pages, long written_page, unsigned written) {
    for (size_t i = 0; i < pages; i++) {
        unsigned p = (long)i == written_page ? written : (unsigned)(i % PATTERNS);
        const uint64_t *q = (const uint64_t *)(mem + i * page_size);
        for (size_t w = 0; w < page_size / 8; w++)
            if (q[w] != word(p, w)) return (long)i;
    }
    return -1;
}

static int check(pageone_status s, const char *what) {
    if (s == PAGEONE_OK) return 0;
    fprintf(stderr, "dedup: %s failed: %s (%d)\n", what, pageone_status_message((int)s), (int)s);
    return 1;
}

static void print_stats(const char *when, const pageone_stats *s) {
    printf("%s: pages_shared=%" PRIu64 " pages_sharing=%" PRIu64 " pages_unshared=%" PRIu64
           " zero_pages=%" PRIu64 " merges=%" PRIu64 " cow_breaks=%" PRIu64 " full_scans=%" PRIu64
           " watch_mode=%s\n",
           when, s->pages_shared, s->pages_sharing, s->pages_unshared, s->zero_pages, s->merges,
           s->cow_breaks, s->full_scans,
           s->watch_mode == PAGEONE_WATCH_UFFD_WP ? "uffd-wp" : "checksum");
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 64;
    page_size = (size_t)sysconf(_SC_PAGESIZE);
    size_t len = mib << 20, pages = len / page_size;
    if (pages < 2 * PATTERNS) {
        fprintf(stderr, "dedup: need at least %d pages\n", 2 * PATTERNS);
        return 2;
    }
    printf("pageone %s: %zu MiB, %zu pages of %d patterns\n", pageone_version(), mib, pages,
           PATTERNS);

    /* A quick engine of its own: 50 ms periods, no daemon even if $PAGEONE_SOCKET is set. */
    pageone_config *cfg = NULL;
    if (check(pageone_config_new(&cfg), "pageone_config_new")) return 1;
    if (check(pageone_config_set_merge_period_ms(cfg, 50), "set_merge_period_ms") ||
        check(pageone_config_set_max_sharing(cfg, MAX_SHARING), "set_max_sharing") ||
        check(pageone_config_set_daemon(cfg, NULL), "set_daemon")) {
        pageone_config_free(cfg);
        return 1;
    }
    pageone_engine *engine = NULL;
    pageone_status s = pageone_engine_new(cfg, &engine);
    pageone_config_free(cfg);
    if (check(s, "pageone_engine_new")) return 1;

    uint8_t *mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
        perror("dedup: mmap");
        pageone_engine_free(engine);
        return 1;
    }
    for (size_t i = 0; i < pages; i++) fill(mem + i * page_size, (unsigned)(i % PATTERNS));

    int rc = 1;
    pageone_stats st;
    long bad;
    if (check(pageone_engine_register(engine, mem, len), "pageone_engine_register")) goto out;

    /* Pages unchanged for two periods are merged: wait until all are, onto as few copies as
     * MAX_SHARING allows (each copy's first page is not counted as saved). */
    size_t per_pattern = (pages + PATTERNS - 1) / PATTERNS;
    uint64_t want = pages - PATTERNS * ((per_pattern + MAX_SHARING - 1) / MAX_SHARING);
    for (int i = 0; i < 40; i++) {
        s = pageone_engine_wait_periods(engine, 1, 10000);
        if (s != PAGEONE_TIMEOUT && check(s, "pageone_engine_wait_periods")) goto out;
        if (check(pageone_engine_stats(engine, &st), "pageone_engine_stats")) goto out;
        if (st.pages_sharing >= want) break;
    }
    print_stats("merged", &st);
    if (st.pages_sharing == 0) {
        fprintf(stderr, "dedup: nothing was merged\n");
        goto out;
    }
    if ((bad = first_bad(mem, pages, -1, 0)) >= 0) {
        fprintf(stderr, "dedup: page %ld changed after merging\n", bad);
        goto out;
    }

    /* A write to a merged page copies it: only that page changes. */
    fill(mem, 1);
    if ((bad = first_bad(mem, pages, 0, 1)) >= 0) {
        fprintf(stderr, "dedup: page %ld wrong after writing page 0\n", bad);
        goto out;
    }

    if (check(pageone_engine_unregister(engine, mem, len), "pageone_engine_unregister")) goto out;
    if (check(pageone_engine_stats(engine, &st), "pageone_engine_stats")) goto out;
    print_stats("unregistered", &st);
    if ((bad = first_bad(mem, pages, 0, 1)) >= 0) {
        fprintf(stderr, "dedup: page %ld wrong after unregistering\n", bad);
        goto out;
    }
    printf("ok: every byte intact\n");
    rc = 0;
out:
    pageone_engine_free(engine);
    munmap(mem, len);
    return rc;
}
