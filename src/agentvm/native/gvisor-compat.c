/* agent-vm: compatibility shim for gVisor sandboxes, preloaded through /etc/ld.so.preload
 * (a file of the sandbox's own view; nothing on the host preloads it).
 *
 * The Debian build of gVisor (runsc 20221219) answers fstatat/statx with AT_NO_AUTOMOUNT
 * with EINVAL; glibc's coreutils (ls, stat, cp, find...) pass that flag on every call, so
 * they fail with "Invalid argument". There are no automount points inside a sandbox, so the
 * flag asks for nothing: this shim clears it and calls the kernel (the Sentry) directly.
 * It changes no permission and grants nothing; a program that makes the system call itself
 * still gets gVisor's EINVAL. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AT_NO_AUTOMOUNT
#define AT_NO_AUTOMOUNT 0x800
#endif

struct statx;

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf) {
    return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}

int fstatat(int dirfd, const char *path, struct stat *buf, int flags) {
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}

int fstatat64(int dirfd, const char *path, struct stat64 *buf, int flags) {
    return (int)syscall(SYS_newfstatat, dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}
