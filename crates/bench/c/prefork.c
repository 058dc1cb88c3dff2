/* A preforking server's memory under the shim: a parent merges 256 MiB (16 contents in turn), forks
 * four children, and each child writes 64 MiB of its inherited memory over with 8 contents in
 * turn. Each child prints how many of the pages it wrote are merged again (mapped from a store,
 * by /proc/self/pagemap) and its Anonymous and Pss (kB, /proc/self/smaps_rollup) 8 s later.
 *
 *   gcc -O2 -o prefork crates/bench/c/prefork.c
 *   LD_PRELOAD=target/release/libpageone_preload.so ./prefork
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#define PAGE 4096UL
#define PAGES 65536UL /* 256 MiB */
#define WRITTEN 16384UL /* 64 MiB each child writes */
#define CHILDREN 4
static size_t file_backed(unsigned char *p, size_t n) {
    volatile unsigned char s = 0;
    for (size_t i = 0; i < n; i++) s += p[i * PAGE];
    int fd = open("/proc/self/pagemap", O_RDONLY);
    size_t c = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t e = 0;
        if (pread(fd, &e, 8, (off_t)(((uintptr_t)p / PAGE + i) * 8)) == 8 && (e >> 61 & 1)) c++;
    }
    close(fd);
    return c;
}
static long rollup(const char *field) {
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':') v = atol(line + n + 1);
    fclose(f);
    return v;
}
int main(void) {
    unsigned char *p = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    for (size_t i = 0; i < PAGES; i++) memset(p + i * PAGE, (int)(i % 16 + 1), PAGE);
    madvise(p, PAGES * PAGE, MADV_MERGEABLE);
    for (int t = 0; t < 300 && file_backed(p, PAGES) < PAGES * 99 / 100; t++) usleep(100000);
    printf("parent: %zu of %lu pages merged\n", file_backed(p, PAGES), PAGES);
    fflush(stdout);
    for (int c = 0; c < CHILDREN; c++) {
        if (fork() == 0) {
            for (size_t i = 0; i < WRITTEN; i++) memset(p + i * PAGE, (int)(i % 8 + 100), PAGE);
            sleep(8);
            printf("child %d: %zu of %lu written pages merged again; Anonymous %ld kB, Pss %ld kB\n", c,
                   file_backed(p, WRITTEN), WRITTEN, rollup("Anonymous"), rollup("Pss"));
            fflush(stdout);
            _exit(0);
        }
    }
    while (wait(NULL) > 0) {}
    return 0;
}
