/* What a program that asked for merging sees, under LD_PRELOAD=libpageone_preload.so (KSM off):
 * the kernel's semantics where pageone answers for KSM. Each check prints a line; the program
 * exits non-zero on the first that fails.
 *
 *   behaviour CHECK    (CHECK: partial-dontneed | child-drop | userfaultfd | unmap | remap |
 *                              protnone | guard | protnone-forgotten | protnone-remap |
 *                              protnone-ksm | mlockall | mlockall-after | mlock-limited |
 *                              wipe-on-fork | advice | advice-moved)
 *
 * protnone-ksm alone runs with the kernel's KSM running (the caller starts it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
#define PAGES 512

static void fill(unsigned char *p, size_t pages) {
    for (size_t i = 0; i < pages; i++)
        memset(p + i * PAGE, (int)(i % 4) + 1, PAGE);
}

static int holds(const unsigned char *p, size_t i, int v) {
    for (size_t b = 0; b < PAGE; b++)
        if (p[i * PAGE + b] != v)
            return 0;
    return 1;
}

/* Pages of [p, p+pages) mapped from a file (merged: a mapping of the store). */
static size_t file_pages(const unsigned char *p, size_t pages) {
    int fd = open("/proc/self/pagemap", O_RDONLY);
    size_t n = 0;
    for (size_t i = 0; i < pages; i++) {
        uint64_t e = 0;
        if (pread(fd, &e, 8, (off_t)(((uintptr_t)p / PAGE + i) * 8)) == 8 && (e >> 61 & 1))
            n++;
    }
    close(fd);
    return n;
}

/* Touches every page of [p, p+pages) (reads map merged pages) and counts the merged ones. */
static size_t merged_pages(const unsigned char *p, size_t pages) {
    volatile unsigned char s = 0;
    for (size_t i = 0; i < pages; i++)
        s += p[i * PAGE];
    (void)s;
    return file_pages(p, pages);
}

/* Waits up to 30 s until more than `want` pages of [p, p+pages) are merged. */
static int merges(const unsigned char *p, size_t pages, size_t want) {
    for (int t = 0; t < 300; t++) {
        if (merged_pages(p, pages) > want)
            return 1;
        usleep(100000);
    }
    printf("merged %zu of %zu pages, wanted more than %zu\n", merged_pages(p, pages), pages, want);
    return 0;
}

/* Whether pages [from, to) of p hold what fill() wrote. */
static int intact(const unsigned char *p, size_t from, size_t to) {
    for (size_t i = from; i < to; i++)
        if (!holds(p, i, (int)(i % 4) + 1))
            return 0;
    return 1;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* Registers a fresh region of duplicates and waits until most of it is merged. */
static unsigned char *merged_region(void) {
    unsigned char *p =
        mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        exit(2);
    fill(p, PAGES);
    if (madvise(p, PAGES * PAGE, MADV_MERGEABLE) != 0)
        exit(3);
    for (int t = 0; t < 300; t++) {
        /* Touch every page (reads map merged pages), then count. */
        volatile unsigned char s = 0;
        for (size_t i = 0; i < PAGES; i++)
            s += p[i * PAGE];
        (void)s;
        if (file_pages(p, PAGES) > PAGES * 9 / 10)
            return p;
        usleep(100000);
    }
    printf("FAIL: nothing merged\n");
    exit(1);
}

static void check(int ok, const char *what) {
    printf("%s %s\n", ok ? "ok" : "FAIL", what);
    fflush(stdout);
    if (!ok)
        exit(1);
}

/* One page's MADV_DONTNEED: that page reads zeros, the others keep their bytes and stay merged. */
static void partial_dontneed(void) {
    unsigned char *p = merged_region();
    size_t before = file_pages(p, PAGES);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    check(madvise(p + 7 * PAGE, PAGE, MADV_DONTNEED) == 0, "MADV_DONTNEED of one merged page");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    check(holds(p, 7, 0), "the dropped page reads zeros");
    int intact = 1;
    for (size_t i = 0; i < PAGES; i++)
        if (i != 7 && !holds(p, i, (int)(i % 4) + 1))
            intact = 0;
    check(intact, "the other pages keep their bytes");
    size_t after = file_pages(p, PAGES);
    printf("merged pages %zu -> %zu, madvise took %.3f ms\n", before, after,
           (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
    check(after + 1 >= before, "the other merged pages stay merged");
    check(madvise(p + 9 * PAGE, 2 * PAGE, MADV_FREE) == 0, "MADV_FREE of merged pages");
    check((holds(p, 9, 0) || holds(p, 9, 2)) && (holds(p, 10, 0) || holds(p, 10, 3)),
          "freed pages read zeros or their bytes");
}

/* A forked child drops merged pages it inherited: zeros, as the kernel gives; MADV_FREE works. */
static void child_drop(void) {
    unsigned char *p = merged_region();
    pid_t c = fork();
    if (c == 0) {
        check(madvise(p + 3 * PAGE, PAGE, MADV_DONTNEED) == 0, "child: MADV_DONTNEED");
        check(holds(p, 3, 0), "child: the dropped page reads zeros");
        check(holds(p, 4, 1), "child: the next page keeps its bytes");
        check(madvise(p + 5 * PAGE, PAGE, MADV_FREE) == 0, "child: MADV_FREE");
        check(holds(p, 5, 0) || holds(p, 5, 2), "child: the freed page reads zeros or its bytes");
        _exit(0);
    }
    int status = 0;
    waitpid(c, &status, 0);
    check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child's checks");
    check(holds(p, 3, 4) && holds(p, 5, 2), "the parent's pages keep their bytes");
}

/* The program's own userfaultfd on memory it marked mergeable (QEMU's postcopy does this). */
static void userfaultfd_on_mergeable(void) {
    unsigned char *p = merged_region();
    int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    check(fd >= 0, "userfaultfd");
    struct uffdio_api api = {.api = UFFD_API, .features = 0};
    check(ioctl(fd, UFFDIO_API, &api) == 0, "UFFDIO_API");
    struct uffdio_register r = {
        .range = {.start = (uintptr_t)p, .len = PAGES * PAGE},
        .mode = UFFDIO_REGISTER_MODE_MISSING,
    };
    int rc = ioctl(fd, UFFDIO_REGISTER, &r);
    if (rc != 0)
        printf("UFFDIO_REGISTER: %s\n", strerror(errno));
    check(rc == 0, "UFFDIO_REGISTER of mergeable memory");
    int intact = 1;
    for (size_t i = 0; i < PAGES; i++)
        if (!holds(p, i, (int)(i % 4) + 1))
            intact = 0;
    check(intact, "the registered pages keep their bytes");
}

/* Unmapping merged memory: the memory is given back, quickly. */
static void unmap(void) {
    unsigned char *p = merged_region();
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    check(munmap(p, PAGES * PAGE) == 0, "munmap of merged memory");
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("munmap of %d merged pages took %.3f ms\n", PAGES,
           (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
    /* The same address range mapped again: fresh zero memory. */
    unsigned char *q = mmap(p, PAGES * PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    check(q == p, "the range maps again");
    check(holds(q, 0, 0) && holds(q, PAGES - 1, 0), "and reads zeros");
}

/* mremap of merged memory moves its bytes. */
static void remap(void) {
    unsigned char *p = merged_region();
    unsigned char *q = mremap(p, PAGES * PAGE, 2 * PAGES * PAGE, MREMAP_MAYMOVE);
    check(q != MAP_FAILED, "mremap of merged memory");
    int intact = 1;
    for (size_t i = 0; i < PAGES; i++)
        if (!holds(q, i, (int)(i % 4) + 1))
            intact = 0;
    check(intact, "the moved pages keep their bytes");
    check(holds(q, PAGES, 0) && holds(q, 2 * PAGES - 1, 0), "the grown part reads zeros");
    for (size_t i = 0; i < PAGES; i++)
        q[i * PAGE] = 9;
    check(q[0] == 9 && q[PAGE] == 9, "the moved pages take writes");
}

/* A fresh PROT_NONE mapping of `pages`, marked mergeable (which the kernel answers with 0). */
static unsigned char *mergeable_none(size_t pages) {
    unsigned char *p = mmap(NULL, pages * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        exit(2);
    check(madvise(p, pages * PAGE, MADV_MERGEABLE) == 0, "MADV_MERGEABLE of PROT_NONE memory");
    return p;
}

/* Memory marked mergeable while PROT_NONE or read-only merges once made read/write, a part at a
 * time as the program makes it so. */
static void protnone(void) {
    unsigned char *p = mmap(NULL, PAGES * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        exit(2);
    size_t half = PAGES / 2;
    check(mprotect(p + half * PAGE, half * PAGE, PROT_READ) == 0, "mprotect read-only");
    check(madvise(p, PAGES * PAGE, MADV_MERGEABLE) == 0,
          "MADV_MERGEABLE of PROT_NONE and read-only memory");
    check(mprotect(p, half * PAGE, PROT_READ | PROT_WRITE) == 0, "mprotect the first half");
    fill(p, half);
    check(merges(p, half, half * 9 / 10), "the first half merges");
    check(intact(p, 0, half), "its pages keep their bytes");
    check(holds(p, half, 0) && merged_pages(p + half * PAGE, half) == 0,
          "the read-only half is not merged yet");
    check(mprotect(p + half * PAGE, half * PAGE, PROT_READ | PROT_WRITE) == 0,
          "mprotect the read-only half read/write");
    for (size_t i = half; i < PAGES; i++)
        memset(p + i * PAGE, (int)(i % 4) + 1, PAGE);
    check(merges(p, PAGES, PAGES * 9 / 10), "the whole range merges");
    check(intact(p, 0, PAGES), "every page keeps its bytes");
    /* An mprotect refused at a hole after the memory (ENOMEM) has changed the memory before it. */
    unsigned char *q = mergeable_none(half + 1);
    check(munmap(q + half * PAGE, PAGE) == 0, "munmap the last page");
    errno = 0;
    check(mprotect(q, (half + 1) * PAGE, PROT_READ | PROT_WRITE) == -1 && errno == ENOMEM,
          "mprotect up to the hole: ENOMEM");
    fill(q, half);
    check(merges(q, half, half * 9 / 10), "the memory it made read/write merges");
    check(intact(q, 0, half), "its pages keep their bytes");
}

/* A range with a PROT_NONE guard page inside: the rest merges at once, the guard page once it is
 * made read/write. */
static void guard(void) {
    const size_t g = 100;
    unsigned char *p =
        mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        exit(2);
    check(mprotect(p + g * PAGE, PAGE, PROT_NONE) == 0, "mprotect a guard page");
    for (size_t i = 0; i < PAGES; i++)
        if (i != g)
            memset(p + i * PAGE, (int)(i % 4) + 1, PAGE);
    check(madvise(p, PAGES * PAGE, MADV_MERGEABLE) == 0,
          "MADV_MERGEABLE of memory with a guard page inside");
    check(merges(p, g, g * 9 / 10) && merges(p + (g + 1) * PAGE, PAGES - g - 1, (PAGES - g) * 9 / 10),
          "the read/write memory around the guard page merges");
    check(intact(p, 0, g) && intact(p, g + 1, PAGES), "its pages keep their bytes");
    check(mprotect(p + g * PAGE, PAGE, PROT_READ | PROT_WRITE) == 0, "mprotect the guard page");
    check(holds(p, g, 0), "the guard page reads zeros");
    memset(p + g * PAGE, (int)(g % 4) + 1, PAGE);
    check(merges(p + g * PAGE, 1, 0), "the guard page merges once read/write");
    check(intact(p, 0, PAGES), "every page keeps its bytes");
}

/* Mergeable PROT_NONE memory unmapped (then mapped again behind the shim's back), mapped over or
 * marked unmergeable before it is made read/write is not merged; memory kept as it was is. */
static void protnone_forgotten(void) {
    unsigned char *x = mergeable_none(PAGES), *y = mergeable_none(PAGES);
    unsigned char *z = mergeable_none(PAGES), *w = mergeable_none(PAGES);
    check(munmap(x, PAGES * PAGE) == 0, "munmap");
    /* Mapped again at the same place by a call the shim does not see. */
    void *x2 = (void *)syscall(SYS_mmap, x, PAGES * PAGE, PROT_NONE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    check(x2 == x, "the range maps again");
    check(mmap(w, PAGES * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == w,
          "mmap(MAP_FIXED) over it");
    check(madvise(z, PAGES * PAGE, MADV_UNMERGEABLE) == 0, "MADV_UNMERGEABLE");
    unsigned char *all[] = {x, y, z, w};
    for (int k = 0; k < 4; k++) {
        check(mprotect(all[k], PAGES * PAGE, PROT_READ | PROT_WRITE) == 0, "mprotect read/write");
        fill(all[k], PAGES);
    }
    double t0 = now_s();
    check(merges(y, PAGES, PAGES * 9 / 10), "the range kept merges");
    /* As long again (1 s at least): the others would have merged by then too. */
    double waited = now_s() - t0;
    usleep((useconds_t)((waited > 1 ? waited : 1) * 1e6));
    printf("merged pages: unmapped %zu, mapped over %zu, unmergeable %zu (kept: %zu, in %.2f s)\n",
           merged_pages(x, PAGES), merged_pages(w, PAGES), merged_pages(z, PAGES),
           merged_pages(y, PAGES), waited);
    check(merged_pages(x, PAGES) == 0, "the range unmapped and mapped again is not merged");
    check(merged_pages(w, PAGES) == 0, "the range mapped over is not merged");
    check(merged_pages(z, PAGES) == 0, "the range marked unmergeable is not merged");
    for (int k = 0; k < 4; k++)
        check(intact(all[k], 0, PAGES), "every page keeps its bytes");
}

/* Mergeable PROT_NONE memory moved and grown by mremap stays mergeable (the kernel's flag moves
 * with the mapping); its old place does not. */
static void protnone_remap(void) {
    unsigned char *p = mergeable_none(PAGES);
    unsigned char *dst =
        mmap(NULL, 2 * PAGES * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (dst == MAP_FAILED)
        exit(2);
    unsigned char *q = mremap(p, PAGES * PAGE, 2 * PAGES * PAGE, MREMAP_MAYMOVE | MREMAP_FIXED, dst);
    check(q == dst, "mremap moves and grows it");
    void *p2 = (void *)syscall(SYS_mmap, p, PAGES * PAGE, PROT_NONE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    check(p2 == p, "the old place maps again");
    check(mprotect(q, 2 * PAGES * PAGE, PROT_READ | PROT_WRITE) == 0, "mprotect read/write");
    check(mprotect(p, PAGES * PAGE, PROT_READ | PROT_WRITE) == 0, "mprotect the old place");
    fill(q, 2 * PAGES);
    fill(p, PAGES);
    double t0 = now_s();
    check(merges(q, PAGES, PAGES * 9 / 10), "the moved part merges");
    check(merges(q + PAGES * PAGE, PAGES, PAGES * 9 / 10), "the grown part merges");
    double waited = now_s() - t0;
    usleep((useconds_t)((waited > 1 ? waited : 1) * 1e6));
    check(merged_pages(p, PAGES) == 0, "the old place is not merged");
    check(intact(q, 0, 2 * PAGES) && intact(p, 0, PAGES), "every page keeps its bytes");
}

/* Pages of this process the kernel's KSM has merged. */
static long ksm_merging(void) {
    FILE *f = fopen("/proc/self/ksm_merging_pages", "r");
    long n = -1;
    if (f) {
        if (fscanf(f, "%ld", &n) != 1)
            n = -1;
        fclose(f);
    }
    return n;
}

/* Waits up to 30 s until the kernel's KSM merged at least `lo` and at most `hi` pages of this
 * process. */
static int ksm_between(long lo, long hi) {
    for (int t = 0; t < 300; t++) {
        long n = ksm_merging();
        if (n >= lo && n <= hi)
            return 1;
        usleep(100000);
    }
    printf("KSM merged %ld pages of this process, wanted %ld to %ld\n", ksm_merging(), lo, hi);
    return 0;
}

/* Where the kernel's KSM runs, mergeable memory that holds pages while it is not read/write is
 * merged by KSM, as it is without the shim (the shim marks it for the kernel too); made
 * read/write, it is unmerged there and merged by pageone. */
static void protnone_ksm(void) {
    unsigned char *r = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    unsigned char *n = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED || n == MAP_FAILED)
        exit(2);
    fill(r, PAGES);
    fill(n, PAGES);
    check(mprotect(r, PAGES * PAGE, PROT_READ) == 0 && mprotect(n, PAGES * PAGE, PROT_NONE) == 0,
          "mprotect read-only and PROT_NONE");
    check(madvise(r, PAGES * PAGE, MADV_MERGEABLE) == 0 &&
              madvise(n, PAGES * PAGE, MADV_MERGEABLE) == 0,
          "MADV_MERGEABLE of read-only and PROT_NONE memory holding pages");
    check(ksm_between(2 * PAGES * 9 / 10, 2 * PAGES), "KSM merges both");
    check(intact(r, 0, PAGES), "the read-only pages keep their bytes");
    check(mprotect(r, PAGES * PAGE, PROT_READ | PROT_WRITE) == 0, "mprotect read/write");
    check(ksm_between(0, PAGES), "KSM no longer merges the memory made read/write");
    check(merges(r, PAGES, PAGES * 9 / 10), "pageone merges it");
    check(intact(r, 0, PAGES), "its pages keep their bytes");
    check(mprotect(n, PAGES * PAGE, PROT_READ | PROT_WRITE) == 0, "mprotect PROT_NONE read/write");
    check(ksm_between(0, 0), "KSM merges nothing of this process any more");
    check(intact(n, 0, PAGES), "the PROT_NONE pages kept their bytes");
    check(merges(n, PAGES, PAGES * 9 / 10), "pageone merges them");
    for (size_t i = 0; i < PAGES; i++)
        n[i * PAGE] = 7;
    check(n[0] == 7 && n[(PAGES - 1) * PAGE] == 7, "they take writes");
}

/* Pages of [p, p+pages) in locked mappings ("lo" among the VmFlags of /proc/self/smaps). */
static size_t locked_pages(const unsigned char *p, size_t pages) {
    FILE *f = fopen("/proc/self/smaps", "r");
    char line[1024];
    uintptr_t a = 0, b = 0, lo = (uintptr_t)p, hi = lo + pages * PAGE;
    size_t n = 0;
    while (f && fgets(line, sizeof line, f)) {
        uintptr_t x, y;
        if (sscanf(line, "%lx-%lx ", &x, &y) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            a = x, b = y;
            continue;
        }
        if (!strncmp(line, "VmFlags:", 8) && strstr(line, " lo") && b > lo && a < hi)
            n += ((b < hi ? b : hi) - (a > lo ? a : lo)) / PAGE;
    }
    if (f) fclose(f);
    return n;
}

/* A program that locks all its memory, now and future (QEMU's mem-lock=on): its mergeable memory
 * merges, stays locked and keeps its bytes; a merged page takes writes. */
static void locked_all(void) {
    if (mlockall(MCL_CURRENT | MCL_FUTURE) != 0) {
        printf("skipped: mlockall refused (%s)\n", strerror(errno));
        return;
    }
    unsigned char *p = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(p != MAP_FAILED, "mmap");
    fill(p, PAGES);
    check(locked_pages(p, PAGES) == PAGES, "the memory is locked");
    check(madvise(p, PAGES * PAGE, MADV_MERGEABLE) == 0, "MADV_MERGEABLE");
    check(merges(p, PAGES, PAGES * 9 / 10), "the locked memory merges");
    check(intact(p, 0, PAGES), "its pages keep their bytes");
    check(locked_pages(p, PAGES) == PAGES, "it stays locked");
    p[5 * PAGE] = 9;
    check(p[5 * PAGE] == 9 && holds(p, 9, 2), "a merged page takes a write, its twin unchanged");
    check(munlockall() == 0, "munlockall");
}

/* The kB of a field of /proc/self/status, or -1. */
static long status_kib(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') {
            v = atol(line + n + 1);
            break;
        }
    if (f) fclose(f);
    return v;
}

/* A program that locks all its memory once pageone runs (merged pages, the engine's views of its
 * store): the views are not filled (the store is 256 MiB here; by default it is as large as the
 * memory), the merged pages stay merged and get locked, and memory mapped later merges locked. */
static void locked_all_after(void) {
    setenv("PAGEONE_STORE_PAGES", "65536", 1);
    unsigned char *p = merged_region();
    if (mlockall(MCL_CURRENT | MCL_FUTURE) != 0) {
        printf("skipped: mlockall refused (%s)\n", strerror(errno));
        return;
    }
    long shmem = status_kib("RssShmem");
    printf("RssShmem %ld kB after mlockall\n", shmem);
    check(shmem >= 0 && shmem < 64 * 1024, "the store's views are not filled");
    check(file_pages(p, PAGES) > PAGES * 9 / 10, "merged pages stay merged");
    check(locked_pages(p, PAGES) == PAGES, "and are locked");
    check(intact(p, 0, PAGES), "their bytes are kept");
    unsigned char *q = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(q != MAP_FAILED, "mmap after mlockall");
    fill(q, PAGES);
    check(madvise(q, PAGES * PAGE, MADV_MERGEABLE) == 0, "MADV_MERGEABLE");
    check(merges(q, PAGES, PAGES * 9 / 10), "memory mapped after mlockall merges");
    check(locked_pages(q, PAGES) == PAGES && intact(q, 0, PAGES), "locked, its bytes kept");
    check(munlockall() == 0, "munlockall");
}

/* A program with a limit on locked memory (run as nobody, 8 MiB, by the caller) that locks part
 * of its mergeable memory: pageone takes none of its limit (the engine's locked area is not
 * made), so the program can lock up to its limit; the locked pages keep their bytes. */
static void locked_under_a_limit(void) {
    struct rlimit lim;
    check(getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur == 8 << 20, "an 8 MiB limit");
    merged_region(); /* pageone runs here */
    unsigned char *p = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(p != MAP_FAILED, "mmap");
    fill(p, PAGES);
    check(mlock(p, PAGES * PAGE) == 0, "mlock 2 MiB");
    check(madvise(p, PAGES * PAGE, MADV_MERGEABLE) == 0, "MADV_MERGEABLE");
    sleep(2);
    check(intact(p, 0, PAGES), "the locked pages keep their bytes");
    check(locked_pages(p, PAGES) == PAGES, "and stay locked");
    size_t rest = (8 << 20) - PAGES * PAGE - 64 * 1024;
    unsigned char *q = mmap(NULL, rest, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(q != MAP_FAILED, "mmap the rest of the limit");
    if (mlock(q, rest) != 0)
        printf("mlock of the rest: %s (VmLck %ld kB)\n", strerror(errno), status_kib("VmLck"));
    check(mlock(q, rest) == 0, "the program locks up to its limit");
}

/* A child finds memory advised MADV_WIPEONFORK empty, merged or not (fork-safety checks of
 * crypto libraries rely on it): advised once merged, the kernel takes the advice (it refuses it
 * on file mappings, which merged pages are), and memory advised first is not merged after. */
static int child_sees_zeros(const unsigned char *p, size_t pages) {
    pid_t pid = fork();
    if (pid == 0) {
        for (size_t i = 0; i < pages; i++)
            if (!holds(p, i, 0))
                _exit(1);
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static void wipe_on_fork(void) {
    unsigned char *p = merged_region();
    check(madvise(p, PAGES * PAGE, MADV_WIPEONFORK) == 0, "MADV_WIPEONFORK of merged memory");
    check(intact(p, 0, PAGES), "the pages keep their bytes");
    check(child_sees_zeros(p, PAGES), "a child finds them empty");
    unsigned char *q =
        mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(q != MAP_FAILED, "mmap");
    check(madvise(q, PAGES * PAGE, MADV_WIPEONFORK) == 0, "MADV_WIPEONFORK of fresh memory");
    fill(q, PAGES);
    madvise(q, PAGES * PAGE, MADV_MERGEABLE);
    sleep(2);
    check(file_pages(q, PAGES) == 0, "memory advised first is not merged");
    check(intact(q, 0, PAGES), "and keeps its bytes");
    check(child_sees_zeros(q, PAGES), "a child finds it empty");
}

/* Pages of [p, p+pages) in mappings whose VmFlags (/proc/self/smaps) hold `flag`. */
static size_t flagged_pages(const unsigned char *p, size_t pages, const char *flag) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f)
        return 0;
    char line[1024];
    unsigned long a = 0, e = 0, lo = (uintptr_t)p, hi = lo + pages * PAGE;
    size_t n = 0, len = strlen(flag);
    while (fgets(line, sizeof line, f)) {
        unsigned long x, y;
        if (sscanf(line, "%lx-%lx ", &x, &y) == 2) {
            a = x;
            e = y;
            continue;
        }
        if (strncmp(line, "VmFlags:", 8) != 0 || e <= lo || a >= hi)
            continue;
        for (char *t = strtok(line + 8, " \n"); t; t = strtok(NULL, " \n"))
            if (strlen(t) == len && !strncmp(t, flag, len))
                n += ((e < hi ? e : hi) - (a > lo ? a : lo)) / PAGE;
    }
    fclose(f);
    return n;
}

/* Whether a child finds [p, p+pages) unmapped (not inherited). */
static int child_lacks(const unsigned char *p, size_t pages) {
    pid_t pid = fork();
    if (pid == 0)
        _exit(madvise((void *)p, pages * PAGE, MADV_NORMAL) == -1 && errno == ENOMEM ? 0 : 1);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* Memory advised MADV_DONTDUMP, MADV_DONTFORK and MADV_HUGEPAGE (as QEMU can advise guest RAM)
 * keeps the advice once merged, and after a written page merged again: a core dump leaves it out
 * and a child does not inherit it; given back, it wants huge pages again. (The engine's mappings
 * are its own; the kernel would give them none of it.) */
static void advice(void) {
    unsigned char *p =
        mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(p != MAP_FAILED, "mmap");
    fill(p, PAGES);
    check(madvise(p, PAGES * PAGE, MADV_DONTDUMP) == 0, "MADV_DONTDUMP");
    check(madvise(p, PAGES * PAGE, MADV_DONTFORK) == 0, "MADV_DONTFORK");
    check(madvise(p, PAGES * PAGE, MADV_HUGEPAGE) == 0, "MADV_HUGEPAGE");
    check(madvise(p, PAGES * PAGE, MADV_MERGEABLE) == 0, "MADV_MERGEABLE");
    check(merges(p, PAGES, PAGES - 1), "merged");
    check(flagged_pages(p, PAGES, "dd") == PAGES, "not dumped once merged");
    check(flagged_pages(p, PAGES, "dc") == PAGES, "not inherited once merged");
    check(child_lacks(p, PAGES), "a child does not have it");
    p[5 * PAGE] ^= 0xff;
    p[5 * PAGE] ^= 0xff;
    sleep(1);
    check(merges(p, PAGES, PAGES - 1), "merged again");
    check(flagged_pages(p, PAGES, "dd") == PAGES, "not dumped once merged again");
    check(flagged_pages(p, PAGES, "dc") == PAGES, "not inherited once merged again");
    check(madvise(p, PAGES * PAGE, MADV_DOFORK) == 0, "MADV_DOFORK");
    check(madvise(p, PAGES * PAGE, MADV_UNMERGEABLE) == 0, "MADV_UNMERGEABLE");
    check(file_pages(p, PAGES) == 0, "given back");
    check(flagged_pages(p, PAGES, "dd") == PAGES, "not dumped once given back");
    check(flagged_pages(p, PAGES, "dc") == 0, "inherited once advised so");
    check(flagged_pages(p, PAGES, "hg") == PAGES, "huge pages wanted once given back");
    check(intact(p, 0, PAGES), "the pages keep their bytes");
}

/* Memory advised MADV_DONTDUMP and moved (mremap): what the engine maps where it went carries
 * the advice. Moved through the C library (which the shim sees) before it is marked mergeable,
 * or once merged (merged memory is many mappings, which a raw mremap refuses to move); moved by
 * a raw system call (which only the kernel reports) once marked, before it merged. */
static void advice_moved(void) {
    for (int way = 0; way < 3; way++) {
        unsigned char *p =
            mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        unsigned char *to = mmap(NULL, PAGES * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        check(p != MAP_FAILED && to != MAP_FAILED, "mmap");
        fill(p, PAGES);
        check(madvise(p, PAGES * PAGE, MADV_DONTDUMP) == 0, "MADV_DONTDUMP");
        int flags = MREMAP_MAYMOVE | MREMAP_FIXED;
        if (way == 0) {
            check(mremap(p, PAGES * PAGE, PAGES * PAGE, flags, to) == to, "moved by mremap");
            check(madvise(to, PAGES * PAGE, MADV_MERGEABLE) == 0, "then MADV_MERGEABLE");
        } else if (way == 1) {
            check(madvise(p, PAGES * PAGE, MADV_MERGEABLE) == 0, "MADV_MERGEABLE");
            check(merges(p, PAGES, PAGES - 1), "merged");
            check(mremap(p, PAGES * PAGE, PAGES * PAGE, flags, to) == to, "moved by mremap");
            to[5 * PAGE] ^= 0xff;
            to[5 * PAGE] ^= 0xff;
            sleep(1);
        } else {
            check(madvise(p, PAGES * PAGE, MADV_MERGEABLE) == 0, "MADV_MERGEABLE");
            void *q = (void *)syscall(SYS_mremap, p, PAGES * PAGE, PAGES * PAGE, flags, to);
            check(q == to, "moved by a raw mremap before it merged");
        }
        check(merges(to, PAGES, PAGES - 1), "merged where it went");
        check(flagged_pages(to, PAGES, "dd") == PAGES, "not dumped there");
        check(intact(to, 0, PAGES), "the pages keep their bytes");
        check(munmap(to, PAGES * PAGE) == 0, "munmap");
    }
}

int main(int argc, char **argv) {
    if (argc < 2)
        return 2;
    if (!strcmp(argv[1], "partial-dontneed"))
        partial_dontneed();
    else if (!strcmp(argv[1], "child-drop"))
        child_drop();
    else if (!strcmp(argv[1], "userfaultfd"))
        userfaultfd_on_mergeable();
    else if (!strcmp(argv[1], "unmap"))
        unmap();
    else if (!strcmp(argv[1], "remap"))
        remap();
    else if (!strcmp(argv[1], "protnone"))
        protnone();
    else if (!strcmp(argv[1], "guard"))
        guard();
    else if (!strcmp(argv[1], "protnone-forgotten"))
        protnone_forgotten();
    else if (!strcmp(argv[1], "protnone-remap"))
        protnone_remap();
    else if (!strcmp(argv[1], "protnone-ksm"))
        protnone_ksm();
    else if (!strcmp(argv[1], "mlockall"))
        locked_all();
    else if (!strcmp(argv[1], "mlockall-after"))
        locked_all_after();
    else if (!strcmp(argv[1], "mlock-limited"))
        locked_under_a_limit();
    else if (!strcmp(argv[1], "wipe-on-fork"))
        wipe_on_fork();
    else if (!strcmp(argv[1], "advice"))
        advice();
    else if (!strcmp(argv[1], "advice-moved"))
        advice_moved();
    else
        return 2;
    printf("OK\n");
    return 0;
}
