/* The density benchmark's workload inside each guest (built static by pageone-bench into the
 * guest's initramfs): the seed's allocate/fill/free churn, scaled down.
 *
 *   churn loop SEED GUEST PEAK_MIB SHARED_PCT HOLD_MS IDLE_MS
 *     Forever: a phase allocates a target (one phase in eight PEAK_MIB, else a sixteenth to a
 *     quarter of it), fills SHARED_PCT% of its pages with data every guest has (page i of the
 *     allocation: the same bytes in every guest, distinct within one) and the rest with data of
 *     this guest and phase alone, holds it HOLD_MS, checks it, frees it (munmap) and idles
 *     IDLE_MS. Prints one line per phase: "HB <phase> <mib> <fill_ms> <free_ms> <ok>".
 *   churn once MIB HOLD_MS WAIT_MS
 *     Allocates MIB of private data, prints "FILLED", holds it, frees it, prints
 *     "FREED <free_ms>", waits WAIT_MS, prints "ONCE-DONE".
 *
 * free_ms is the time munmap took: with init_on_free=1 the guest kernel zeroes every freed page
 * there, which is what the guest pays for handing the host zero pages.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096

static uint64_t rng_state;

static uint64_t next_rand(void)
{
    /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Fills a page with words derived from `key`: distinct keys give distinct pages. */
static void fill_page(uint64_t *p, uint64_t key)
{
    uint64_t x = key * 0x9e3779b97f4a7c15ULL + 1;
    for (int w = 0; w < PAGE / 8; w++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        p[w] = x;
    }
}

static int check_page(const uint64_t *p, uint64_t key)
{
    uint64_t x = key * 0x9e3779b97f4a7c15ULL + 1;
    for (int w = 0; w < PAGE / 8; w += 64) {
        for (int k = 0; k < 64; k++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if (k == 0 && p[w] != x)
                return 0;
        }
    }
    return 1;
}

static uint64_t key_of(uint64_t guest, uint64_t phase, size_t i, int shared)
{
    /* Shared pages: the same key in every guest and phase. Private: unique per guest and phase. */
    if (shared)
        return (1ULL << 62) | i;
    return (guest << 40) ^ (phase << 24) ^ i ^ (2ULL << 62);
}

static void *map(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        printf("CHURN-FAIL mmap %zu\n", bytes);
        fflush(stdout);
        exit(1);
    }
    return p;
}

static int loop(uint64_t seed, uint64_t guest, long peak_mib, long shared_pct, long hold_ms,
                long idle_ms)
{
    rng_state = seed ^ (guest * 0x100000001b3ULL);
    for (uint64_t phase = 0;; phase++) {
        long mib;
        if (phase == 1 || next_rand() % 8 == 0)
            mib = peak_mib;
        else
            mib = peak_mib / 16 + (long)(next_rand() % (uint64_t)(peak_mib / 4 - peak_mib / 16 + 1));
        if (mib < 1)
            mib = 1;
        size_t pages = (size_t)mib << 8;
        size_t shared = pages * (size_t)shared_pct / 100;
        double t0 = now_ms();
        uint64_t *p = map(pages * PAGE);
        for (size_t i = 0; i < pages; i++)
            fill_page(p + i * (PAGE / 8), key_of(guest, phase, i, i < shared));
        double fill = now_ms() - t0;
        sleep_ms(hold_ms);
        int ok = 1;
        for (size_t i = 0; i < pages; i++)
            ok &= check_page(p + i * (PAGE / 8), key_of(guest, phase, i, i < shared));
        double t1 = now_ms();
        munmap(p, pages * PAGE);
        double freed = now_ms() - t1;
        printf("HB %llu %ld %.1f %.2f %d\n", (unsigned long long)phase, mib, fill, freed, ok);
        fflush(stdout);
        if (!ok)
            return 2;
        sleep_ms(idle_ms + (long)(next_rand() % (uint64_t)(idle_ms / 4 + 1)));
    }
}

static int once(long mib, long hold_ms, long wait_ms)
{
    size_t pages = (size_t)mib << 8;
    uint64_t *p = map(pages * PAGE);
    for (size_t i = 0; i < pages; i++)
        fill_page(p + i * (PAGE / 8), key_of(7, 0, i, 0));
    printf("FILLED\n");
    fflush(stdout);
    sleep_ms(hold_ms);
    double t1 = now_ms();
    munmap(p, pages * PAGE);
    printf("FREED %.2f\n", now_ms() - t1);
    fflush(stdout);
    sleep_ms(wait_ms);
    printf("ONCE-DONE\n");
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 8 && strcmp(argv[1], "loop") == 0)
        return loop(strtoull(argv[2], 0, 10), strtoull(argv[3], 0, 10), atol(argv[4]),
                    atol(argv[5]), atol(argv[6]), atol(argv[7]));
    if (argc == 5 && strcmp(argv[1], "once") == 0)
        return once(atol(argv[2]), atol(argv[3]), atol(argv[4]));
    fprintf(stderr, "usage: churn loop SEED GUEST PEAK_MIB SHARED_PCT HOLD_MS IDLE_MS | "
                    "churn once MIB HOLD_MS WAIT_MS\n");
    return 64;
}
