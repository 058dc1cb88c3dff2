/* What a program that asked for merging sees, under LD_PRELOAD=libpageone_preload.so (KSM off):
 * the kernel's semantics where pageone answers for KSM. Each check prints a line; the program
 * exits non-zero on the first that fails.
 *
 *   behaviour CHECK    (CHECK: partial-dontneed | child-drop | userfaultfd | unmap | remap)
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
    else
        return 2;
    printf("OK\n");
    return 0;
}
