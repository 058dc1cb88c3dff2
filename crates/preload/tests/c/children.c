/* Forked children of a process that asked for merging, under LD_PRELOAD=libpageone_preload.so
 * (KSM off): as under KSM, they keep merging what they inherited mergeable and what they map
 * (PR_SET_MEMORY_MERGE is inherited), and every byte in parent and child stays right. Each check
 * prints a line; the program exits non-zero on the first that fails.
 *
 *   children CHECK    (CHECK: merge | grandchild | protnone | merge-all | exec)
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#define PR_GET_MEMORY_MERGE 68
#endif

#define PAGE 4096UL
/* The parent's region: 32 MiB, its first half duplicates (merged in the parent), its second half
 * unique pages (registered, never merged there). */
#define PAGES 8192UL
#define HALF (PAGES / 2)
/* Pages of the second half the child overwrites with duplicates. */
#define WRITTEN 1024UL

static void check(int ok, const char *what) {
    printf("%s %s\n", ok ? "ok" : "FAIL", what);
    fflush(stdout);
    if (!ok)
        _exit(1);
}

/* The byte page i of the parent's region holds at offset b. */
static unsigned char expected(size_t i, size_t b) {
    if (i < HALF)
        return (unsigned char)(i % 4 + 1);
    /* Unique: the page number in its first bytes (no two pages alike), then a pattern. */
    if (b < sizeof(size_t))
        return (unsigned char)(i >> (8 * b));
    return (unsigned char)((b * 31) ^ (i * 7));
}

static void fill_pattern(unsigned char *p) {
    for (size_t i = 0; i < PAGES; i++)
        for (size_t b = 0; b < PAGE; b++)
            p[i * PAGE + b] = expected(i, b);
}

/* Whether pages [from, to) of p hold `v` in every byte. */
static int all(const unsigned char *p, size_t from, size_t to, int v) {
    for (size_t i = from * PAGE; i < to * PAGE; i++)
        if (p[i] != v)
            return 0;
    return 1;
}

/* Whether pages [from, to) of the parent's region hold the pattern. */
static int patterned(const unsigned char *p, size_t from, size_t to) {
    for (size_t i = from; i < to; i++)
        for (size_t b = 0; b < PAGE; b++)
            if (p[i * PAGE + b] != expected(i, b))
                return 0;
    return 1;
}

/* Pages of [p, p+pages) mapped from a file (merged: a mapping of a store), after touching each
 * (reads map merged pages). */
static size_t merged_pages(const unsigned char *p, size_t pages) {
    volatile unsigned char s = 0;
    for (size_t i = 0; i < pages; i++)
        s += p[i * PAGE];
    (void)s;
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

/* Waits up to 30 s until more than 9/10 of [p, p+pages) are merged. */
static int merges(const unsigned char *p, size_t pages) {
    size_t n = 0;
    for (int t = 0; t < 300; t++) {
        n = merged_pages(p, pages);
        if (n > pages * 9 / 10)
            return 1;
        usleep(100000);
    }
    printf("merged %zu of %zu pages\n", n, pages);
    return 0;
}

static unsigned char *anonymous(size_t pages) {
    unsigned char *p =
        mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        exit(2);
    return p;
}

/* The parent's region, registered, its first half merged. */
static unsigned char *parent_region(void) {
    unsigned char *p = anonymous(PAGES);
    fill_pattern(p);
    check(madvise(p, PAGES * PAGE, MADV_MERGEABLE) == 0, "parent: MADV_MERGEABLE");
    check(merges(p, HALF), "parent: its duplicates merge");
    check(merged_pages(p + HALF * PAGE, HALF) == 0, "parent: its unique pages stay unmerged");
    return p;
}

static void wait_child(pid_t c) {
    int status = 0;
    check(c > 0 && waitpid(c, &status, 0) == c, "the child ran");
    check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child's checks");
}

/* The child writes duplicates over inherited memory (copy-on-write) without any call the shim
 * sees, then maps fresh memory and marks it mergeable: both merge in the child. */
static void merge(void) {
    unsigned char *p = parent_region();
    pid_t c = fork();
    if (c == 0) {
        check(patterned(p, 0, PAGES), "child: the inherited pages hold the parent's bytes");
        memset(p + HALF * PAGE, 7, WRITTEN * PAGE);
        memset(p, 9, 16 * PAGE); /* over pages the parent merged */
        check(merges(p + HALF * PAGE, WRITTEN), "child: its writes over inherited memory merge");
        check(merges(p, 16), "child: its writes over pages the parent merged merge again");
        unsigned char *q = anonymous(2048);
        memset(q, 5, 2048 * PAGE);
        check(madvise(q, 2048 * PAGE, MADV_MERGEABLE) == 0, "child: MADV_MERGEABLE");
        check(merges(q, 2048), "child: its fresh mergeable memory merges");
        check(all(p, 0, 16, 9) && patterned(p, 16, HALF), "child: the first half is right");
        check(all(p, HALF, HALF + WRITTEN, 7) && patterned(p, HALF + WRITTEN, PAGES),
              "child: the second half is right");
        check(all(q, 0, 2048, 5), "child: the fresh memory is right");
        check(madvise(p + HALF * PAGE, PAGE, MADV_DONTNEED) == 0 && all(p, HALF, HALF + 1, 0),
              "child: a dropped page it merged reads zeros");
        check(madvise(p + 20 * PAGE, PAGE, MADV_DONTNEED) == 0 && all(p, 20, 21, 0),
              "child: a dropped page its parent merged reads zeros");
        check(madvise(p + 2 * PAGE, PAGE, MADV_DONTNEED) == 0 && all(p, 2, 3, 0),
              "child: a dropped page it wrote over its parent's merge reads zeros");
        check(all(p, 0, 2, 9) && all(p, 3, 16, 9) && all(p, HALF + 1, HALF + WRITTEN, 7) &&
                  all(p, 21, 22, 21 % 4 + 1),
              "child: the pages around them keep their bytes");
        _exit(0);
    }
    wait_child(c);
    check(patterned(p, 0, PAGES), "parent: every page keeps its bytes");
    check(merged_pages(p, HALF) > HALF * 9 / 10, "parent: its pages stay merged");
}

/* Pages [0, pages) of q hold their number (+ 2^20) in their first bytes, zeros after. */
static void number(unsigned char *q, size_t pages) {
    for (size_t i = 0; i < pages; i++)
        *(size_t *)(q + i * PAGE) = i + (1UL << 20);
}

static int numbered(const unsigned char *q, size_t from, size_t to) {
    for (size_t i = from; i < to; i++) {
        if (*(const size_t *)(q + i * PAGE) != i + (1UL << 20))
            return 0;
        for (size_t b = sizeof(size_t); b < PAGE; b++)
            if (q[i * PAGE + b])
                return 0;
    }
    return 1;
}

/* A child whose engine runs forks in turn: the grandchild merges its writes over mergeable
 * memory it inherited from the child (registered by the child's engine), and nobody's bytes
 * change. (Unique pages, so that no engine merges them before the grandchild writes.) */
static void grandchild(void) {
    unsigned char *p = parent_region();
    pid_t c = fork();
    if (c == 0) {
        memset(p + HALF * PAGE, 7, WRITTEN * PAGE);
        check(merges(p + HALF * PAGE, WRITTEN), "child: its writes over inherited memory merge");
        check(merges(p, 16), "child: its writes over pages the parent merged merge again");
        unsigned char *q = anonymous(2 * WRITTEN);
        number(q, 2 * WRITTEN);
        check(madvise(q, 2 * WRITTEN * PAGE, MADV_MERGEABLE) == 0, "child: MADV_MERGEABLE");
        pid_t g = fork();
        if (g == 0) {
            memset(q, 6, WRITTEN * PAGE);
            check(merges(q, WRITTEN), "grandchild: its writes merge");
            check(all(q, 0, WRITTEN, 6) && numbered(q, WRITTEN, 2 * WRITTEN) &&
                      all(p, HALF, HALF + WRITTEN, 7) && patterned(p, 0, HALF) &&
                      patterned(p, HALF + WRITTEN, PAGES),
                  "grandchild: every page is right");
            _exit(0);
        }
        wait_child(g);
        check(numbered(q, 0, 2 * WRITTEN) && all(p, HALF, HALF + WRITTEN, 7) &&
                  patterned(p, HALF + WRITTEN, PAGES) && patterned(p, 0, HALF),
              "child: every page is right");
        check(merged_pages(p + HALF * PAGE, WRITTEN) > WRITTEN * 9 / 10,
              "child: its pages stay merged");
        _exit(0);
    }
    wait_child(c);
    check(patterned(p, 0, PAGES), "parent: every page keeps its bytes");
}

/* Memory the parent marked mergeable while PROT_NONE merges in the child once the child makes it
 * read/write (KSM keeps VM_MERGEABLE on it across the fork), at once after the fork. */
static void protnone(void) {
    unsigned char *p = parent_region();
    unsigned char *r =
        mmap(NULL, WRITTEN * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(r != MAP_FAILED && madvise(r, WRITTEN * PAGE, MADV_MERGEABLE) == 0,
          "parent: MADV_MERGEABLE of PROT_NONE memory");
    pid_t c = fork();
    if (c == 0) {
        check(mprotect(r, WRITTEN * PAGE, PROT_READ | PROT_WRITE) == 0, "child: mprotect");
        memset(r, 3, WRITTEN * PAGE);
        check(merges(r, WRITTEN), "child: the memory made read/write merges");
        check(all(r, 0, WRITTEN, 3) && patterned(p, 0, PAGES), "child: every page is right");
        _exit(0);
    }
    wait_child(c);
    check(patterned(p, 0, PAGES), "parent: every page keeps its bytes");
}

/* PR_SET_MEMORY_MERGE in the parent: the child reads it on, and its new large mapping merges. */
static void merge_all(void) {
    check(prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0) == 0, "parent: PR_SET_MEMORY_MERGE");
    pid_t c = fork();
    if (c == 0) {
        check(prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0) == 1, "child: PR_GET_MEMORY_MERGE reads 1");
        size_t pages = 80UL << 20 >> 12, used = 4096;
        unsigned char *q = anonymous(pages);
        for (size_t i = 0; i < used; i++)
            memset(q + i * PAGE, (int)(i % 4) + 1, PAGE);
        check(merges(q, used), "child: its large mapping merges");
        int right = 1;
        for (size_t i = 0; i < used; i++)
            right &= all(q, i, i + 1, (int)(i % 4) + 1);
        check(right, "child: the mapping is right");
        _exit(0);
    }
    wait_child(c);
}

/* An engine's threads in this process (by their names). */
static int engine_threads(void) {
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char path[300], comm[32] = {0};
        if (e->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        int fd = open(path, O_RDONLY);
        if (fd >= 0 && read(fd, comm, sizeof comm - 1) > 0 &&
            (!strcmp(comm, "pageone-engine\n") || !strcmp(comm, "pageone-commit\n") ||
             !strcmp(comm, "pageone-faults\n")))
            n++;
        if (fd >= 0)
            close(fd);
    }
    if (d)
        closedir(d);
    return n;
}

/* Open file descriptors of this process. */
static int fds(void) {
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += e->d_name[0] != '.';
    if (d)
        closedir(d);
    return n;
}

/* A child that execs starts no engine before it; one that lives on starts one (a merge period
 * after the fork) and merges what it inherited. */
static void exec(void) {
    unsigned char *p = parent_region();
    check(engine_threads() > 0, "parent: an engine runs");
    /* A longer period for the children (read after the fork), so the checks below run first. */
    setenv("PAGEONE_MERGE_PERIOD_MS", "1000", 1);
    /* The parent's engine threads may hold a file open for a moment (reading /proc) when it
     * counts or when it forks, so the child may count one more or fewer; an engine of its own
     * would show threads and several files (its userfaultfd, store, epoll, eventfd...). */
    int parent_fds = fds();
    pid_t c = fork();
    if (c == 0) {
        int threads = engine_threads(), n = fds();
        if (threads != 0 || n > parent_fds + 1) {
            printf("FAIL child before exec: %d engine threads, %d fds (parent %d)\n", threads, n,
                   parent_fds);
            fflush(stdout);
            _exit(1);
        }
        execl("/bin/true", "true", (char *)NULL);
        _exit(3);
    }
    wait_child(c);
    c = fork();
    if (c == 0) {
        memset(p + HALF * PAGE, 7, WRITTEN * PAGE);
        int started = 0;
        for (int t = 0; t < 100 && !started; t++) {
            usleep(50000);
            started = engine_threads() > 0;
        }
        check(started, "child: an engine starts without any call");
        check(merges(p + HALF * PAGE, WRITTEN), "child: its writes over inherited memory merge");
        check(merges(p, 16), "child: its writes over pages the parent merged merge again");
        check(all(p, HALF, HALF + WRITTEN, 7) && patterned(p, HALF + WRITTEN, PAGES) &&
                  patterned(p, 0, HALF),
              "child: every page is right");
        _exit(0);
    }
    wait_child(c);
    check(patterned(p, 0, PAGES), "parent: every page keeps its bytes");
}

int main(int argc, char **argv) {
    if (argc < 2)
        return 2;
    if (!strcmp(argv[1], "merge"))
        merge();
    else if (!strcmp(argv[1], "grandchild"))
        grandchild();
    else if (!strcmp(argv[1], "protnone"))
        protnone();
    else if (!strcmp(argv[1], "merge-all"))
        merge_all();
    else if (!strcmp(argv[1], "exec"))
        exec();
    else
        return 2;
    printf("OK\n");
    return 0;
}
