/* Prints the result and errno of calls the shim answers for KSM, one line each. Run with and
 * without LD_PRELOAD=libpageone_preload.so: the two outputs must be identical (the shim answers
 * as the kernel does). */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/capability.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef PR_SET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#define PR_GET_MEMORY_MERGE 68
#endif
#define PAGE 4096UL

static void show(const char *what, long r) {
    printf("%s: %ld %s\n", what, r, r < 0 ? strerror(errno) : "-");
    fflush(stdout);
}

/* Clears CAP_SYS_RESOURCE from the effective set (the kernel's PR_SET_MEMORY_MERGE needs it). */
static int drop_sys_resource(void) {
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    if (syscall(SYS_capget, &h, d))
        return -1;
    d[CAP_SYS_RESOURCE / 32].effective &= ~(1u << (CAP_SYS_RESOURCE % 32));
    return (int)syscall(SYS_capset, &h, d);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "after-exec")) {
        show("get merge, after exec", prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0));
        return 0;
    }
    char *p = mmap(NULL, 8 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return 2;
    memset(p, 1, 8 * PAGE);
    /* A hole: pages 4..8 unmapped. */
    munmap(p + 4 * PAGE, 4 * PAGE);
    errno = 0;
    show("mergeable, mapped", madvise(p, 4 * PAGE, MADV_MERGEABLE));
    show("unmergeable, mapped", madvise(p, 4 * PAGE, MADV_UNMERGEABLE));
    show("mergeable, unmapped", madvise(p + 4 * PAGE, 4 * PAGE, MADV_MERGEABLE));
    show("unmergeable, unmapped", madvise(p + 4 * PAGE, 4 * PAGE, MADV_UNMERGEABLE));
    show("mergeable, partly unmapped", madvise(p, 8 * PAGE, MADV_MERGEABLE));
    show("unmergeable, partly unmapped", madvise(p, 8 * PAGE, MADV_UNMERGEABLE));
    show("mergeable, unaligned", madvise(p + 1, PAGE, MADV_MERGEABLE));
    show("unmergeable, unaligned", madvise(p + 1, PAGE, MADV_UNMERGEABLE));
    /* PROT_NONE memory (the shim registers it once it is made read/write), with a guard page. */
    char *n = mmap(NULL, 8 * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (n == MAP_FAILED)
        return 2;
    show("mergeable, PROT_NONE", madvise(n, 8 * PAGE, MADV_MERGEABLE));
    show("mprotect read/write, mergeable", mprotect(n, 8 * PAGE, PROT_READ | PROT_WRITE));
    show("mprotect a guard page", mprotect(n + 2 * PAGE, PAGE, PROT_NONE));
    errno = EDOM; /* a success leaves errno as it was */
    show("mergeable, guard page inside", madvise(n, 8 * PAGE, MADV_MERGEABLE));
    show("errno after it", errno);
    show("unmergeable, guard page inside", madvise(n, 8 * PAGE, MADV_UNMERGEABLE));
    show("mergeable, guard page again", madvise(n, 8 * PAGE, MADV_MERGEABLE));
    show("munmap, mergeable", munmap(n + 6 * PAGE, 2 * PAGE));
    show("mergeable, guard page, partly unmapped", madvise(n, 8 * PAGE, MADV_MERGEABLE));
    show("mprotect, mergeable, partly unmapped", mprotect(n, 8 * PAGE, PROT_READ | PROT_WRITE));
    errno = EDOM;
    show("mprotect the guard page, mergeable", mprotect(n + 2 * PAGE, PAGE, PROT_READ | PROT_WRITE));
    show("errno after it", errno);
    show("pkey_mprotect, mergeable", pkey_mprotect(n, 6 * PAGE, PROT_READ, -1));
    show("unmergeable, partly unmapped, read-only", madvise(n, 8 * PAGE, MADV_UNMERGEABLE));
    show("munmap, read-only", munmap(n, 6 * PAGE));
    show("set merge, extra argument", prctl(PR_SET_MEMORY_MERGE, 1, 1, 0, 0));
    show("get merge, extra argument", prctl(PR_GET_MEMORY_MERGE, 1, 0, 0, 0));
    show("get merge, initially", prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0));
    show("set merge on", prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0));
    show("get merge, on", prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0));
    show("set merge off", prctl(PR_SET_MEMORY_MERGE, 0, 0, 0, 0));
    show("get merge, off", prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0));
    pid_t k = fork();
    if (k == 0) {
        if (drop_sys_resource())
            _exit(3);
        show("set merge on, without CAP_SYS_RESOURCE", prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0));
        show("get merge, without CAP_SYS_RESOURCE", prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0));
        _exit(0);
    }
    int status = 0;
    waitpid(k, &status, 0);
    show("child exit", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    /* The flag survives execve (Linux keeps it since 6.x). */
    show("set merge on, before exec", prctl(PR_SET_MEMORY_MERGE, 1, 0, 0, 0));
    execl("/proc/self/exe", argv[0], "after-exec", (char *)NULL);
    show("exec", -1);
    return 1;
}
