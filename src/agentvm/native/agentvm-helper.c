/*
 * agentvm-helper: the small, ordered privileged steps of agent-vm (cf. Firecracker's jailer).
 *
 *   agentvm-helper launch [opts] -- BWRAP ARGS...     (host side, starts as root or the operator)
 *       1 validate   2 close fds   3 join cgroups   4 rlimits   5 stage grants (idmapped)
 *       6 drop privileges   7 no_new_privs   8 exec bwrap
 *
 *   agentvm-helper init [opts] -- CMD ARGS...         (inside the sandbox, after bwrap's mounts)
 *       1 validate   2 controlling tty   3 chdir   4 Landlock   5 no_new_privs + seccomp   6 exec
 *       (with --sysaudit-fd: the filter is loaded with a user-notification listener, which is
 *       sent to the supervisor over that unix socket and closed here before exec)
 *
 * Every failing step writes one line "STEP\tERRNO\tMESSAGE\n" to --status-fd (if given) and to
 * stderr, then exits 125 (126/127 when the command cannot be executed / is not found, like a
 * shell). The status fd is close-on-exec, so a successful exec closes it with nothing written.
 *
 * Landlock constants are defined here (not taken from linux/landlock.h) so the helper builds on
 * hosts whose headers are older than the kernel. Nothing here allocates after exec; this file
 * is deliberately small and boring.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <termios.h>
#include <unistd.h>

extern char **environ;

#ifndef __NR_landlock_create_ruleset
#define __NR_landlock_create_ruleset 444
#define __NR_landlock_add_rule 445
#define __NR_landlock_restrict_self 446
#endif
#ifndef __NR_close_range
#define __NR_close_range 436
#endif
#ifndef __NR_open_tree
#define __NR_open_tree 428
#define __NR_move_mount 429
#endif
#ifndef __NR_mount_setattr
#define __NR_mount_setattr 442
#endif
#ifndef __NR_openat2
#define __NR_openat2 437
#endif
#define AV_OPEN_TREE_CLONE 1
#define AV_MOVE_MOUNT_F_EMPTY_PATH 0x4
#define AV_MOVE_MOUNT_T_EMPTY_PATH 0x40
#define AV_RESOLVE_NO_XDEV 0x01
#define AV_RESOLVE_NO_MAGICLINKS 0x02
#define AV_RESOLVE_NO_SYMLINKS 0x04
#define AV_RESOLVE_BENEATH 0x08
struct av_open_how {
    uint64_t flags, mode, resolve;
};
#define AV_MOUNT_ATTR_RDONLY 0x1
#define AV_MOUNT_ATTR_NOSUID 0x2
#define AV_MOUNT_ATTR_NODEV 0x4
#define AV_MOUNT_ATTR_NOEXEC 0x8
#define AV_MOUNT_ATTR_IDMAP 0x100000
struct av_mount_attr {
    uint64_t attr_set, attr_clr, propagation, userns_fd;
};

#define LL_CREATE_RULESET_VERSION (1U << 0)
#define LL_RULE_PATH_BENEATH 1
#define LL_RULE_NET_PORT 2

#define FS_EXECUTE (1ULL << 0)
#define FS_WRITE_FILE (1ULL << 1)
#define FS_READ_FILE (1ULL << 2)
#define FS_READ_DIR (1ULL << 3)
#define FS_REMOVE_DIR (1ULL << 4)
#define FS_REMOVE_FILE (1ULL << 5)
#define FS_MAKE_CHAR (1ULL << 6)
#define FS_MAKE_DIR (1ULL << 7)
#define FS_MAKE_REG (1ULL << 8)
#define FS_MAKE_SOCK (1ULL << 9)
#define FS_MAKE_FIFO (1ULL << 10)
#define FS_MAKE_BLOCK (1ULL << 11)
#define FS_MAKE_SYM (1ULL << 12)
#define FS_REFER (1ULL << 13)    /* ABI 2 */
#define FS_TRUNCATE (1ULL << 14) /* ABI 3 */
#define FS_IOCTL_DEV (1ULL << 15) /* ABI 5 */
#define NET_BIND_TCP (1ULL << 0) /* ABI 4 */
#define NET_CONNECT_TCP (1ULL << 1)
#define SCOPE_ABSTRACT_UNIX (1ULL << 0) /* ABI 6 */
#define SCOPE_SIGNAL (1ULL << 1)

/* Rights that only make sense on directories. */
#define FS_DIR_ONLY                                                                            \
    (FS_READ_DIR | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_CHAR | FS_MAKE_DIR | FS_MAKE_REG | \
     FS_MAKE_SOCK | FS_MAKE_FIFO | FS_MAKE_BLOCK | FS_MAKE_SYM | FS_REFER)

struct ll_ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};
struct ll_path_beneath_attr {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));
struct ll_net_port_attr {
    uint64_t allowed_access;
    uint64_t port;
};

#define MAX_ITEMS 256
/* --protect: every host-trusted name of up to 32 rw grants (agentvm.grants.HOST_TRUSTED) */
#define MAX_PROTECTS 2048

static int status_fd = -1;

static void fail(const char *step, int err, const char *fmt, ...) __attribute__((noreturn, format(printf, 3, 4)));
static int fail_code = 125;

#include <stdarg.h>
static void fail(const char *step, int err, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    char line[1400];
    int n = snprintf(line, sizeof line, "%s\t%d\t%s%s%s\n", step, err, msg, err ? ": " : "",
                     err ? strerror(err) : "");
    if (n > (int)sizeof line - 1) n = sizeof line - 1;
    /* agent-vm reads the status fd and reports the step as a clean error; the raw line goes to
       stderr only when there is no status fd or it cannot be written (no line is ever lost) */
    if (status_fd < 0 || write(status_fd, line, (size_t)n) != (ssize_t)n)
        dprintf(2, "agentvm-helper: %s", line);
    _exit(fail_code);
}

static long parse_long(const char *step, const char *s, long lo, long hi) {
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || !end || *end || v < lo || v > hi) fail(step, 0, "bad number '%s'", s);
    return v;
}

static void set_cloexec(int fd) {
    int fl = fcntl(fd, F_GETFD);
    if (fl < 0 || fcntl(fd, F_SETFD, fl | FD_CLOEXEC) < 0) fail("validate", errno, "fd %d", fd);
}

/* Read a whole memfd/file from offset 0 (pread: independent of the fd's offset). */
static size_t read_all(int fd, char *buf, size_t cap, const char *step) {
    size_t len = 0;
    for (;;) {
        ssize_t n = pread(fd, buf + len, cap - len, (off_t)len);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) fail(step, errno, "read fd %d", fd);
        if (n == 0) break;
        len += (size_t)n;
        if (len == cap) fail(step, 0, "fd %d: too large", fd);
    }
    return len;
}

/* ------------------------------------------------------------------ launch */

static int resource_by_name(const char *n) {
    if (!strcmp(n, "nofile")) return RLIMIT_NOFILE;
    if (!strcmp(n, "nproc")) return RLIMIT_NPROC;
    if (!strcmp(n, "fsize")) return RLIMIT_FSIZE;
    if (!strcmp(n, "core")) return RLIMIT_CORE;
    if (!strcmp(n, "as")) return RLIMIT_AS;
    if (!strcmp(n, "memlock")) return RLIMIT_MEMLOCK;
    if (!strcmp(n, "sigpending")) return RLIMIT_SIGPENDING;
    if (!strcmp(n, "msgqueue")) return RLIMIT_MSGQUEUE;
    return -1;
}

/* Options shared by `launch` and `enter`: cgroups to join, rlimits, fds to keep. */
struct common_opts {
    const char *cgroups[32];
    int ncg;
    struct {
        int res;
        struct rlimit lim;
    } rl[16];
    int nrl;
    int keep[64];
    int nkeep;
};

/* Returns 1 when (a, v) was one of the shared options. */
static int parse_common(struct common_opts *o, const char *a, const char *v) {
    if (!strcmp(a, "--status-fd")) {
        /* stays open across exec: init inside the sandbox reports through it too */
        status_fd = (int)parse_long("validate", v, 3, 1 << 20);
        if (fcntl(status_fd, F_GETFD) < 0) fail("validate", errno, "status fd %d", status_fd);
        return 1;
    }
    if (!strcmp(a, "--cgroup-procs")) {
        if (o->ncg >= 32) fail("validate", 0, "too many cgroups");
        o->cgroups[o->ncg++] = v;
        return 1;
    }
    if (!strcmp(a, "--rlimit")) {
        /* NAME=SOFT:HARD */
        char name[32];
        unsigned long long so, h;
        if (o->nrl >= 16 || sscanf(v, "%31[a-z]=%llu:%llu", name, &so, &h) != 3) fail("validate", 0, "bad --rlimit '%s'", v);
        int res = resource_by_name(name);
        if (res < 0) fail("validate", 0, "unknown rlimit '%s'", name);
        o->rl[o->nrl].res = res;
        o->rl[o->nrl].lim.rlim_cur = so;
        o->rl[o->nrl].lim.rlim_max = h;
        o->nrl++;
        return 1;
    }
    if (!strcmp(a, "--keep-fd")) {
        if (o->nkeep >= 64) fail("validate", 0, "too many fds");
        o->keep[o->nkeep++] = (int)parse_long("validate", v, 0, 1 << 20);
        return 1;
    }
    return 0;
}

/* Join every cgroup before any fork, so every descendant is inside. */
static void join_cgroups(const struct common_opts *o) {
    for (int c = 0; c < o->ncg; c++) {
        int fd = open(o->cgroups[c], O_WRONLY | O_CLOEXEC);
        if (fd < 0) fail("cgroup", errno, "open %s", o->cgroups[c]);
        if (write(fd, "0\n", 2) != 2) fail("cgroup", errno, "join %s", o->cgroups[c]);
        close(fd);
    }
}

static void apply_rlimits(const struct common_opts *o) {
    for (int r = 0; r < o->nrl; r++)
        if (setrlimit(o->rl[r].res, &o->rl[r].lim) < 0) fail("rlimit", errno, "setrlimit %d", o->rl[r].res);
}

/* A granted folder, staged by `launch` (as root) before the sandbox exists: a clone of the
 * folder's mount (non-recursive: mounts inside a grant are not part of it), idmapped so that
 * the folder's owner on the host is the agent's uid inside and what the agent writes lands
 * owned by that owner, nosuid+nodev (+rdonly for ro), moved onto STAGE in a mount namespace of
 * this process that only the sandbox inherits. bwrap then binds STAGE to the grant's path. */
struct grant {
    int fd;     /* O_PATH fd of the folder, opened and checked by the supervisor */
    int ro;
    int plain;  /* "rp": read-only, not idmapped (ownership as on the host: extra read-only paths) */
    const char *stage;
};

/* An entry of a staged rw grant the host trusts (.git, .envrc...): made read-only right here,
 * on the very dentry found - no symlink followed, no mount crossed - so nothing can swap it
 * between the supervisor's check and the sandbox's view. bwrap's recursive bind carries it in. */
struct protect {
    int grant;
    char kind; /* 'd' or 'f' */
    const char *rel;
};

static void protect_entries(struct grant *g, int ng, struct protect *p, int np) {
    for (int k = 0; k < np; k++) {
        if (p[k].grant < 0 || p[k].grant >= ng) fail("validate", 0, "--protect names grant %d", p[k].grant);
        int sfd = open(g[p[k].grant].stage, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (sfd < 0) fail("grant", errno, "protect: open stage %s", g[p[k].grant].stage);
        struct av_open_how how = {
            .flags = O_PATH | O_NOFOLLOW | O_CLOEXEC,
            .resolve = AV_RESOLVE_BENEATH | AV_RESOLVE_NO_SYMLINKS | AV_RESOLVE_NO_MAGICLINKS | AV_RESOLVE_NO_XDEV,
        };
        int efd = (int)syscall(__NR_openat2, sfd, p[k].rel, &how, sizeof how);
        if (efd < 0) fail("grant", errno, "protect %s: it changed since it was checked", p[k].rel);
        struct stat st;
        if (fstat(efd, &st) < 0) fail("grant", errno, "protect %s: fstat", p[k].rel);
        if ((p[k].kind == 'd' && !S_ISDIR(st.st_mode)) || (p[k].kind == 'f' && !S_ISREG(st.st_mode)))
            fail("grant", 0, "protect %s: it changed since it was checked (now %s)", p[k].rel,
                 S_ISLNK(st.st_mode) ? "a symlink" : S_ISDIR(st.st_mode) ? "a directory" : "another kind of file");
        int t = (int)syscall(__NR_open_tree, efd, "", AV_OPEN_TREE_CLONE | O_CLOEXEC | AT_EMPTY_PATH);
        if (t < 0) fail("grant", errno, "protect %s: open_tree", p[k].rel);
        struct av_mount_attr attr = {.attr_set = AV_MOUNT_ATTR_RDONLY | AV_MOUNT_ATTR_NOSUID | AV_MOUNT_ATTR_NODEV};
        if (syscall(__NR_mount_setattr, t, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0)
            fail("grant", errno, "protect %s: read-only", p[k].rel);
        if (syscall(__NR_move_mount, t, "", efd, "", AV_MOVE_MOUNT_F_EMPTY_PATH | AV_MOVE_MOUNT_T_EMPTY_PATH) < 0)
            fail("grant", errno, "protect %s: move_mount", p[k].rel);
        close(t);
        close(efd);
        close(sfd);
    }
}

/* A user namespace whose only mapping is owner -> agent (uid and gid), for MOUNT_ATTR_IDMAP. */
/* With map_root (gVisor): the overflow id 65534 is mapped too (to itself, or to 65533 when the
 * folder's owner is 65534), because runsc's gofer runs as the container's root, which
 * agent-vm maps to host 65534, creates files as that id and then gives them to the agent's
 * uid: the gofer's own creations must be representable on the disk for that first step. */
static int idmap_userns(uid_t owner, gid_t group, long agent_uid, long agent_gid, int map_root) {
    int go[2], done[2];
    if (pipe2(go, O_CLOEXEC) < 0 || pipe2(done, O_CLOEXEC) < 0) fail("grant", errno, "pipe");
    pid_t pid = fork();
    if (pid < 0) fail("grant", errno, "fork");
    if (pid == 0) {
        close(go[0]);
        close(done[1]); /* so the parent's close of its end is our EOF */
        char c = unshare(CLONE_NEWUSER) == 0 ? 'y' : 'n';
        if (write(go[1], &c, 1) != 1) _exit(1);
        (void)!read(done[0], &c, 1); /* parked until the parent has its namespace */
        _exit(0);
    }
    close(go[1]);
    close(done[0]);
    char c = 0;
    if (read(go[0], &c, 1) != 1 || c != 'y') fail("grant", 0, "cannot create the user namespace of an idmapped grant");
    char path[64], map[96];
    int fd, ok = 1;
    unsigned long zu = owner == 65534 ? 65533 : 65534, zg = group == 65534 ? 65533 : 65534;
    const struct {
        const char *file, *fmt;
        unsigned long in, out, in2;
    } w[3] = {{"uid_map", map_root ? "%lu %lu 1\n%lu 65534 1\n" : "%lu %lu 1\n", owner, (unsigned long)agent_uid, zu},
              {"setgroups", "deny\n", 0, 0, 0},
              {"gid_map", map_root ? "%lu %lu 1\n%lu 65534 1\n" : "%lu %lu 1\n", group, (unsigned long)agent_gid, zg}};
    for (int k = 0; k < 3 && ok; k++) {
        snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, w[k].file);
        int n = snprintf(map, sizeof map, w[k].fmt, w[k].in, w[k].out, w[k].in2);
        fd = open(path, O_WRONLY | O_CLOEXEC);
        ok = fd >= 0 && write(fd, map, (size_t)n) == n;
        if (fd >= 0) close(fd);
    }
    int err = errno;
    snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
    int ns = ok ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    if (ok && ns < 0) err = errno;
    close(done[1]);
    close(go[0]);
    waitpid(pid, NULL, 0);
    if (ns < 0) fail("grant", err, "cannot map uid %lu to the agent's uid", (unsigned long)owner);
    return ns;
}

static void stage_grants(struct grant *g, int ng, long agent_uid, long agent_gid, int map_root) {
    if (ng == 0) return;
    if (agent_uid < 0) fail("validate", 0, "--grant needs --uid/--gid (idmapped grants are for a dedicated uid)");
    struct {
        uid_t uid;
        gid_t gid;
        int ns;
    } maps[8];
    int nmaps = 0, tree[32];
    /* clone each folder's mount while it is still in our mount namespace: detached copies */
    for (int k = 0; k < ng; k++) {
        struct stat st;
        if (fstat(g[k].fd, &st) < 0) fail("grant", errno, "grant %d: fstat", k);
        int ns = -1;
        for (int m = 0; m < nmaps && !g[k].plain; m++)
            if (maps[m].uid == st.st_uid && maps[m].gid == st.st_gid) ns = maps[m].ns;
        if (ns < 0 && !g[k].plain) {
            if (nmaps >= 8) fail("validate", 0, "grants with more than 8 distinct owners");
            ns = idmap_userns(st.st_uid, st.st_gid, agent_uid, agent_gid, map_root);
            maps[nmaps].uid = st.st_uid;
            maps[nmaps].gid = st.st_gid;
            maps[nmaps++].ns = ns;
        }
        int t = (int)syscall(__NR_open_tree, g[k].fd, "", AV_OPEN_TREE_CLONE | O_CLOEXEC | AT_EMPTY_PATH);
        if (t < 0) fail("grant", errno, "grant %d: open_tree", k);
        struct av_mount_attr attr = {
            .attr_set = (g[k].plain ? 0 : AV_MOUNT_ATTR_IDMAP) | AV_MOUNT_ATTR_NOSUID | AV_MOUNT_ATTR_NODEV |
                        (g[k].ro ? AV_MOUNT_ATTR_RDONLY : 0),
            .userns_fd = g[k].plain ? 0 : (uint64_t)ns,
        };
        if (syscall(__NR_mount_setattr, t, "", AT_EMPTY_PATH, &attr, sizeof attr) < 0)
            /* the one failure the caller explains with the filesystem's name (exit 77) */
            fail("grant-idmap", errno, "grant %d: the filesystem cannot be idmapped", k);
        tree[k] = t;
        close(g[k].fd);
    }
    for (int m = 0; m < nmaps; m++) close(maps[m].ns);
    /* a mount namespace of our own, slave to the host's: nothing staged here is seen there */
    if (unshare(CLONE_NEWNS) < 0) fail("grant", errno, "unshare(CLONE_NEWNS)");
    if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0) fail("grant", errno, "make / a slave mount");
    for (int k = 0; k < ng; k++) {
        if (syscall(__NR_move_mount, tree[k], "", AT_FDCWD, g[k].stage, AV_MOVE_MOUNT_F_EMPTY_PATH) < 0)
            fail("grant", errno, "grant %d: move_mount onto %s", k, g[k].stage);
        close(tree[k]);
    }
}

static int cmd_launch(int argc, char **argv) {
    struct common_opts o = {0};
    long uid = -1, gid = -1, map_uid = -1, map_gid = -1;
    int runtime_root = 0;
    const char *argv0 = NULL;
    struct grant grants[32];
    int ngrants = 0;
    struct protect protects[MAX_PROTECTS];
    int nprotects = 0;
    int i = 0;

    /* 1. validate */
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) {
            i++;
            break;
        }
        if (i + 1 >= argc) fail("validate", 0, "option %s needs a value", a);
        const char *v = argv[++i];
        if (parse_common(&o, a, v)) {
            continue;
        } else if (!strcmp(a, "--argv0")) {
            argv0 = v; /* what the sandbox sees as bwrap's name in /proc/1/cmdline */
        } else if (!strcmp(a, "--idmap-to")) {
            /* UID:GID that granted folders' owners become (with --runtime-root: the host ids the
             * runtime maps the agent to; with --uid, those are used) */
            if (sscanf(v, "%ld:%ld", &map_uid, &map_gid) != 2 || map_uid <= 0 || map_gid <= 0)
                fail("validate", 0, "bad --idmap-to '%s'", v);
        } else if (!strcmp(a, "--runtime-root")) {
            /* the command is a container runtime that needs root on the host and isolates
             * the agent itself (gVisor's runsc: its Sentry and gofer drop to nobody in their
             * own namespaces under their own seccomp filters). VALUE must be "runsc". */
            if (strcmp(v, "runsc")) fail("validate", 0, "--runtime-root takes only 'runsc'");
            runtime_root = 1;
        } else if (!strcmp(a, "--uid")) {
            uid = parse_long("validate", v, 1, 0x7fffffff);
        } else if (!strcmp(a, "--gid")) {
            gid = parse_long("validate", v, 1, 0x7fffffff);
        } else if (!strcmp(a, "--grant")) {
            /* FD,ro|rw,STAGE (the fd must also be a --keep-fd) */
            int fd, n = 0;
            char mode[3];
            if (ngrants >= 32 || sscanf(v, "%d,%2[rwop],%n", &fd, mode, &n) != 2 || n == 0 || v[n] != '/' ||
                (strcmp(mode, "ro") && strcmp(mode, "rw") && strcmp(mode, "rp")))
                fail("validate", 0, "bad --grant '%s'", v);
            grants[ngrants].fd = fd;
            grants[ngrants].ro = strcmp(mode, "rw") != 0;
            grants[ngrants].plain = !strcmp(mode, "rp");
            grants[ngrants++].stage = v + n;
        } else if (!strcmp(a, "--protect")) {
            /* GRANT,d|f,REL (REL relative to that grant, never absolute, no "..") */
            int gi, n = 0;
            char kind;
            if (nprotects >= MAX_PROTECTS || sscanf(v, "%d,%c,%n", &gi, &kind, &n) != 2 || n == 0 ||
                (kind != 'd' && kind != 'f') || v[n] == '/' || v[n] == 0 || strstr(v + n, ".."))
                fail("validate", 0, "bad --protect '%s'", v);
            protects[nprotects].grant = gi;
            protects[nprotects].kind = kind;
            protects[nprotects++].rel = v + n;
        } else {
            fail("validate", 0, "unknown option %s", a);
        }
    }
    if (i >= argc) fail("validate", 0, "missing command after --");
    if ((uid < 0) != (gid < 0)) fail("validate", 0, "--uid and --gid go together");
    if (runtime_root && uid >= 0) fail("validate", 0, "--runtime-root and --uid exclude each other");
    if (runtime_root) {
        /* what runs as root is runsc by an absolute path, root-owned, writable by root only */
        const char *prog = argv[i], *base = strrchr(argv[i], '/');
        struct stat pst;
        if (prog[0] != '/' || !base || strcmp(base + 1, "runsc")) fail("validate", 0, "--runtime-root runs only an absolute path to runsc, not '%s'", prog);
        if (stat(prog, &pst) < 0) fail("validate", errno, "stat %s", prog);
        if (!S_ISREG(pst.st_mode) || pst.st_uid != 0 || (pst.st_mode & 022)) fail("validate", 0, "%s must be a root-owned file only root can write", prog);
        if (argv0) fail("validate", 0, "--argv0 does not go with --runtime-root");
        if (ngrants && map_uid < 0) fail("validate", 0, "--runtime-root with grants needs --idmap-to");
    }
    if (nprotects && !ngrants) fail("validate", 0, "--protect without --grant");
    for (int k = 0; k < ngrants; k++) {
        int kept = 0;
        for (int j = 0; j < o.nkeep; j++) kept |= o.keep[j] == grants[k].fd;
        if (!kept) fail("validate", 0, "--grant fd %d is not a --keep-fd", grants[k].fd);
    }

    /* 2. close every fd but stdio, the status fd and the kept ones (close_range over the
     * gaps between kept fds, sorted). */
    int *keep = o.keep, nkeep = o.nkeep;
    if (status_fd >= 0 && nkeep < 64) keep[nkeep++] = status_fd;
    for (int a = 1; a < nkeep; a++)
        for (int b = a; b > 0 && keep[b - 1] > keep[b]; b--) {
            int t = keep[b];
            keep[b] = keep[b - 1];
            keep[b - 1] = t;
        }
    unsigned int from = 3;
    for (int j = 0; j <= nkeep; j++) {
        unsigned int upto = (j < nkeep) ? (unsigned int)keep[j] : ~0U;
        if (j < nkeep && (unsigned int)keep[j] < from) continue;
        if (upto > from && syscall(__NR_close_range, from, upto == ~0U ? ~0U : upto - 1, 0) < 0) {
            for (unsigned int fd = from; fd < upto && fd < 65536; fd++) close((int)fd);
        }
        if (j < nkeep) from = (unsigned int)keep[j] + 1;
    }

    /* 3. join cgroups (before any fork, so every descendant is inside) */
    join_cgroups(&o);

    /* 4. rlimits (backstop to the cgroup limits) */
    apply_rlimits(&o);

    /* 5. stage the granted folders (needs root; the sandbox inherits the mount namespace) */
    stage_grants(grants, ngrants, map_uid >= 0 ? map_uid : uid, map_gid >= 0 ? map_gid : gid, runtime_root);
    protect_entries(grants, ngrants, protects, nprotects);

    /* 6. drop privileges: no supplementary groups, then gid, then uid; verify no way back. */
    if (uid >= 0) {
        if (setgroups(0, NULL) < 0) fail("drop-privileges", errno, "setgroups");
        if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) < 0) fail("drop-privileges", errno, "setresgid");
        if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0) fail("drop-privileges", errno, "setresuid");
        if (setuid(0) == 0 || geteuid() == 0) fail("drop-privileges", 0, "could regain root");
    }
    if (geteuid() == 0 && !runtime_root) fail("drop-privileges", 0, "refusing to start the sandbox as host root");

    /* 7. no_new_privs: nothing setuid can raise privileges from here on. */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("no-new-privs", errno, "prctl");

    /* 7b. runsc needs none of the kept fds (the grants are staged by now; the status fd is
     * ours until the exec): none may reach it. Go's exec passes an inherited fd that is not
     * close-on-exec on to runsc's own children at its number, and gVisor's sandbox process
     * remaps its stdio to fds 256 and up, refusing to start ("unable to remap stdios, FD 258
     * is already in use") when one is there - what a caller holding ~256 fds (a daemon with
     * many sandboxes, a long test run) handed down. */
    if (runtime_root)
        for (int j = 0; j < nkeep; j++) {
            int fl = fcntl(keep[j], F_GETFD); /* (a grant's fd is closed once staged: EBADF) */
            if (fl >= 0 && fcntl(keep[j], F_SETFD, fl | FD_CLOEXEC) < 0) fail("validate", errno, "fd %d", keep[j]);
        }

    /* 8. exec bwrap, with an empty environment: nothing of the agent's env (LD_PRELOAD...)
     * may act on a process that runs outside the sandbox's layers. */
    const char *path = argv[i];
    if (argv0) argv[i] = (char *)argv0;
    char *noenv[] = {NULL};
    execve(path, &argv[i], noenv);
    fail("exec-bwrap", errno, "exec %s", path);
}

/* ------------------------------------------------------------------ bridge
 * The sandbox's only way out: a loopback TCP port inside the sandbox, relayed to the egress
 * gate's unix socket (bind-mounted in). The gate identifies the sandbox by the socket, never
 * by anything the agent sends. Started by init *before* Landlock/seccomp, double-forked so it
 * is nobody's child but the sandbox's pid 1, with stdio on /dev/null: the agent cannot signal
 * or ptrace it (Landlock scoping), only use it. If the gate is down, connections are closed:
 * fail closed. */

#define BR_MAX 512
#define BR_BUF 65536

struct br_dir {
    char buf[BR_BUF];
    size_t len, off;
    int eof; /* read side saw EOF */
    int shut; /* write side shut down */
};
struct br_conn {
    int fd[2]; /* 0: client (inside), 1: gate */
    struct br_dir dir[2]; /* dir[0]: client->gate, dir[1]: gate->client */
};

static void br_close(struct br_conn *c) {
    close(c->fd[0]);
    close(c->fd[1]);
    c->fd[0] = c->fd[1] = -1;
}

/* The hand-off (--bridge-key-fd; a bwrap sandbox, whose sockets are the host kernel's): the
 * bridge leaves the data path. It opens one channel to the gate's socket (HELLO with the
 * bridge's key, then waits for the gate's ACK) and sends each connection it accepts over it as
 * one byte with the descriptor (SCM_RIGHTS), keeping no copy; the gate serves the sandbox's TCP
 * socket itself. The key is what makes the channel the bridge's alone: the agent can reach the
 * gate's socket too, and a socket it made itself - one it keeps a copy of, or set SO_LINGER on
 * - must never reach the gate's loop. init reads the key from a descriptor and closes it before
 * the agent exists; it lives only in the bridge's memory (not dumpable). Without a key (gVisor:
 * its sockets are the Sentry's, and cannot travel to a host process) every byte is relayed
 * below, as is a connection whose hand-off failed (ho_handoff). Must match
 * agentvm.gate.server's HANDOFF_*. */
#define HO_PREFIX "\0agentvm-bridge-handoff/2 "
#define HO_KEY_MAX 64
static char ho_hello[sizeof HO_PREFIX - 1 + HO_KEY_MAX + 4];
static size_t ho_hello_len;
#define HO_ACK 0x06
#define HO_CONN 'C'
#define HO_TIMEOUT_S 30 /* a gate that neither answers nor reads (its HEAD_TIMEOUT): the connection is dropped */

/* the key from its descriptor (lower-case hex, at most HO_KEY_MAX): the hello the bridge sends */
static void ho_read_key(int fd) {
    char key[HO_KEY_MAX + 1];
    ssize_t n;
    do n = pread(fd, key, sizeof key, 0);
    while (n < 0 && errno == EINTR);
    close(fd);
    if (n <= 0 || n > HO_KEY_MAX) fail("bridge", 0, "the bridge's key is missing or too long");
    for (ssize_t k = 0; k < n; k++)
        if (!((key[k] >= '0' && key[k] <= '9') || (key[k] >= 'a' && key[k] <= 'f')))
            fail("bridge", 0, "the bridge's key is not lower-case hex");
    memcpy(ho_hello, HO_PREFIX, sizeof HO_PREFIX - 1);
    memcpy(ho_hello + sizeof HO_PREFIX - 1, key, (size_t)n);
    memcpy(ho_hello + sizeof HO_PREFIX - 1 + n, "\r\n\r\n", 4);
    ho_hello_len = sizeof HO_PREFIX - 1 + (size_t)n + 4;
    explicit_bzero(key, sizeof key);
}

static int ho_open(const char *gate_path) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct timeval tv = {.tv_sec = HO_TIMEOUT_S};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    strncpy(sa.sun_path, gate_path, sizeof sa.sun_path - 1);
    unsigned char ack = 0;
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0 ||
        send(fd, ho_hello, ho_hello_len, MSG_NOSIGNAL) != (ssize_t)ho_hello_len ||
        recv(fd, &ack, 1, 0) != 1 || ack != HO_ACK) {
        close(fd);
        return -1;
    }
    return fd;
}

/* one byte and one descriptor (SCM_RIGHTS) on a unix socket: 0, or -1 with errno */
static int send_fd(int sock, char byte, int fd) {
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    ssize_t r;
    do r = sendmsg(sock, &m, MSG_NOSIGNAL);
    while (r < 0 && errno == EINTR);
    if (r == 1) return 0;
    if (r >= 0) errno = 0;
    return -1;
}

/* Hand ``cfd`` to the gate over the channel (opened, or opened again once if the gate went
 * away - a worker replaced): 0 when the gate holds it now. -1 otherwise - the gate is down, or
 * the kernel refused the descriptor in flight (ETOOMANYREFS: this uid has too many descriptors
 * parked in sockets nobody reads; the agent can do that, and where sandboxes share a host uid -
 * a non-root install, --degrade dedicated-uid - to its neighbours too): the caller relays it. */
static int ho_handoff(int *chan, const char *gate_path, int cfd) {
    for (int attempt = 0; attempt < 2; attempt++) {
        if (*chan < 0) *chan = ho_open(gate_path);
        if (*chan < 0) return -1;
        if (send_fd(*chan, HO_CONN, cfd) == 0) return 0;
        if (errno == ETOOMANYREFS) return -1; /* (the channel itself is fine) */
        close(*chan);
        *chan = -1;
    }
    return -1;
}

static void bridge_loop(int ls, const char *gate_path, int handoff) {
    int chan = -1;
    static struct br_conn conns[BR_MAX];
    static struct pollfd pfd[1 + 2 * BR_MAX];
    for (int k = 0; k < BR_MAX; k++) conns[k].fd[0] = conns[k].fd[1] = -1;
    signal(SIGPIPE, SIG_IGN);
    for (;;) {
        int n = 0;
        pfd[n].fd = ls;
        pfd[n].events = POLLIN;
        n++;
        for (int k = 0; k < BR_MAX; k++) {
            struct br_conn *c = &conns[k];
            for (int side = 0; side < 2; side++) {
                /* side s reads into dir[s] and writes dir[1-s] */
                short ev = 0;
                if (c->fd[side] >= 0) {
                    if (!c->dir[side].eof && c->dir[side].len == 0) ev |= POLLIN;
                    if (c->dir[1 - side].len > c->dir[1 - side].off) ev |= POLLOUT;
                }
                pfd[n].fd = ev ? c->fd[side] : -1;
                pfd[n].events = ev;
                pfd[n].revents = 0;
                n++;
            }
        }
        if (poll(pfd, (nfds_t)n, -1) < 0) {
            if (errno == EINTR) continue;
            _exit(3);
        }
        if (pfd[0].revents & POLLIN) {
            int cfd = accept4(ls, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (cfd >= 0 && handoff && ho_handoff(&chan, gate_path, cfd) == 0) {
                close(cfd); /* the gate holds it: out of the data path */
            } else if (cfd >= 0) { /* no key (gVisor), or the hand-off failed: relayed */
                int slot = -1;
                for (int k = 0; k < BR_MAX && slot < 0; k++)
                    if (conns[k].fd[0] < 0) slot = k;
                int gfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
                struct sockaddr_un sa = {.sun_family = AF_UNIX};
                strncpy(sa.sun_path, gate_path, sizeof sa.sun_path - 1);
                if (slot < 0 || gfd < 0 || connect(gfd, (struct sockaddr *)&sa, sizeof sa) < 0) {
                    close(cfd); /* gate down or too many connections: no route */
                    if (gfd >= 0) close(gfd);
                } else {
                    /* a relay must not add Nagle's wait: what the gate wrote as two pieces (a
                     * response head, then its body) would otherwise sit out a delayed ACK */
                    int nd = 1;
                    setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &nd, sizeof nd);
                    fcntl(gfd, F_SETFL, fcntl(gfd, F_GETFL) | O_NONBLOCK);
                    memset(&conns[slot], 0, sizeof conns[slot]);
                    conns[slot].fd[0] = cfd;
                    conns[slot].fd[1] = gfd;
                }
            } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                poll(NULL, 0, 10); /* out of descriptors for a moment: wait, do not spin on the listener */
            }
        }
        for (int k = 0, i = 1; k < BR_MAX; k++) {
            struct br_conn *c = &conns[k];
            for (int side = 0; side < 2; side++, i++) {
                if (c->fd[side] < 0 || !pfd[i].revents) continue;
                struct br_dir *in = &c->dir[side], *out = &c->dir[1 - side];
                if ((pfd[i].revents & (POLLIN | POLLHUP | POLLERR)) && !in->eof && in->len == 0) {
                    ssize_t r = read(c->fd[side], in->buf, BR_BUF);
                    if (r > 0) {
                        in->len = (size_t)r;
                        in->off = 0;
                    } else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
                        in->eof = 1;
                    }
                }
                if ((pfd[i].revents & POLLOUT) && out->len > out->off) {
                    ssize_t w = write(c->fd[side], out->buf + out->off, out->len - out->off);
                    if (w > 0) {
                        out->off += (size_t)w;
                        if (out->off == out->len) out->len = out->off = 0;
                    } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
                        br_close(c);
                        break;
                    }
                }
            }
            if (c->fd[0] < 0) continue;
            /* try to write freshly read data right away, and propagate half-closes */
            for (int side = 0; side < 2; side++) {
                struct br_dir *d = &c->dir[side];
                int to = c->fd[1 - side];
                if (d->len > d->off) {
                    ssize_t w = write(to, d->buf + d->off, d->len - d->off);
                    if (w > 0) {
                        d->off += (size_t)w;
                        if (d->off == d->len) d->len = d->off = 0;
                    }
                }
                if (d->eof && d->len == 0 && !d->shut) {
                    shutdown(to, SHUT_WR);
                    d->shut = 1;
                }
            }
            if (c->dir[0].shut && c->dir[1].shut) br_close(c);
        }
    }
}

/* The bridge holds the sandbox's route out, so the agent must not be able to take it over:
 * it is not dumpable (no ptrace attach, no /proc/PID/mem by the same uid without
 * CAP_SYS_PTRACE - this matters where Landlock's scoping does not exist, e.g. gVisor, and
 * for agents allowed to ptrace their own processes) and it runs under the same seccomp filter
 * as the agent, so even a hijacked bridge has no more syscalls than the agent itself. With the
 * syscall audit (--sysaudit-fd) that filter's denials are user notifications; the bridge loads
 * it without a listener, so its own denied calls fail with ENOSYS (still refused, not recorded:
 * the listener belongs to the agent's filter, loaded later by init). */
static void start_bridge(const char *gate_path, long port, const struct sock_fprog *filter, int handoff) {
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ls < 0) fail("bridge", errno, "socket");
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&sa, sizeof sa) < 0) fail("bridge", errno, "bind 127.0.0.1:%ld", port);
    if (listen(ls, 128) < 0) fail("bridge", errno, "listen");
    pid_t p = fork();
    if (p < 0) fail("bridge", errno, "fork");
    if (p == 0) {
        /* hardened here, before the bridge process exists: it inherits all three, so there is
         * no moment in which it is dumpable or unfiltered; a failure is init's (exit != 0) */
#ifndef AGENTVM_SELFTEST_WEAK_BRIDGE /* defined only in the selftest's deliberately weakened build */
        if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) _exit(3);
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) _exit(4);
        if (filter && syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, filter) < 0) _exit(5);
#else
        (void)filter;
#endif
        pid_t q = fork();
        if (q != 0) _exit(q < 0 ? 1 : 0);
        setsid();
        int nul = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (nul >= 0) {
            dup2(nul, 0);
            dup2(nul, 1);
            dup2(nul, 2);
        }
        syscall(__NR_close_range, 3U, (unsigned int)(ls - 1), 0U);
        syscall(__NR_close_range, (unsigned int)(ls + 1), ~0U, 0U);
        bridge_loop(ls, gate_path, handoff);
        _exit(0);
    }
    int st;
    waitpid(p, &st, 0);
    close(ls);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) fail("bridge", 0, "could not start the egress bridge");
}

/* ------------------------------------------------------------------ init */

struct path_rule {
    const char *path;
    uint64_t access;
    int optional;
};

static int cmd_init(int argc, char **argv) {
    struct path_rule rules[MAX_ITEMS];
    int nrules = 0;
    long ports_connect[64], ports_bind[64];
    int npc = 0, npb = 0;
    int want_scope = 0, want_net = 0, want_tty = 0, no_landlock = 0, bridge_key_fd = -1;
    long min_abi = 1;
    int seccomp_fd = -1, env_fd = -1, sysaudit_fd = -1;
    const char *chdir_to = NULL, *gate_socket = NULL;
    long gate_port = 0;
    int i = 0;

    const uint64_t ro = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR;
    const uint64_t rw_all = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_READ_DIR | FS_REMOVE_DIR |
                            FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG | FS_MAKE_SOCK | FS_MAKE_FIFO |
                            FS_MAKE_SYM | FS_REFER | FS_TRUNCATE;
    /* a host folder granted read-write: no FIFOs or sockets on the host's disk (the owner's
     * tools would find them, owned by the folder's owner), no device nodes */
    const uint64_t rw_host = rw_all & ~(FS_MAKE_SOCK | FS_MAKE_FIFO);
    const uint64_t dev = FS_READ_FILE | FS_WRITE_FILE | FS_READ_DIR | FS_IOCTL_DEV | FS_TRUNCATE;
    const uint64_t proc = FS_READ_FILE | FS_READ_DIR | FS_WRITE_FILE;
    const uint64_t list = FS_READ_DIR;

    /* 1. validate */
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) {
            i++;
            break;
        }
        if (!strcmp(a, "--scope")) {
            want_scope = 1;
            continue;
        }
        if (!strcmp(a, "--net")) {
            want_net = 1;
            continue;
        }
        if (!strcmp(a, "--tty")) {
            want_tty = 1;
            continue;
        }
        if (!strcmp(a, "--no-landlock")) { /* explicit, audited degrade only */
            no_landlock = 1;
            continue;
        }
        if (i + 1 >= argc) fail("validate", 0, "option %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--status-fd")) {
            status_fd = (int)parse_long("validate", v, 3, 1 << 20);
            set_cloexec(status_fd);
        } else if (!strcmp(a, "--seccomp-fd")) {
            seccomp_fd = (int)parse_long("validate", v, 3, 1 << 20);
            set_cloexec(seccomp_fd);
        } else if (!strcmp(a, "--sysaudit-fd")) {
            /* a unix socket to the supervisor (agentvm.sysaudit): the filter's listener goes there */
            sysaudit_fd = (int)parse_long("validate", v, 3, 1 << 20);
            set_cloexec(sysaudit_fd);
        } else if (!strcmp(a, "--seccomp-file")) {
            /* the compiled filter as a read-only file of the sandbox's view (a runtime such as
             * runsc passes no descriptors in) */
            seccomp_fd = open(v, O_RDONLY | O_CLOEXEC);
            if (seccomp_fd < 0) fail("seccomp", errno, "open %s", v);
        } else if (!strcmp(a, "--gate-socket")) {
            gate_socket = v;
        } else if (!strcmp(a, "--gate-port")) {
            gate_port = parse_long("validate", v, 1, 65535);
        } else if (!strcmp(a, "--bridge-key-fd")) {
            /* the bridge hands connections to the gate with this key (bwrap): see ho_read_key */
            bridge_key_fd = (int)parse_long("validate", v, 3, 1 << 20);
            set_cloexec(bridge_key_fd);
        } else if (!strcmp(a, "--env-fd")) {
            env_fd = (int)parse_long("validate", v, 3, 1 << 20);
            set_cloexec(env_fd);
        } else if (!strcmp(a, "--min-abi")) {
            min_abi = parse_long("validate", v, 1, 100);
        } else if (!strcmp(a, "--chdir")) {
            chdir_to = v;
        } else if (!strcmp(a, "--tcp-connect") || !strcmp(a, "--tcp-bind")) {
            long p = parse_long("validate", v, 1, 65535);
            if (a[6] == 'c') {
                if (npc >= 64) fail("validate", 0, "too many ports");
                ports_connect[npc++] = p;
            } else {
                if (npb >= 64) fail("validate", 0, "too many ports");
                ports_bind[npb++] = p;
            }
        } else if (!strcmp(a, "--ro") || !strcmp(a, "--rw") || !strcmp(a, "--rw-host") || !strcmp(a, "--dev") ||
                   !strcmp(a, "--proc") || !strcmp(a, "--ro-try") || !strcmp(a, "--list")) {
            if (nrules >= MAX_ITEMS) fail("validate", 0, "too many path rules");
            rules[nrules].path = v;
            rules[nrules].optional = !strcmp(a, "--ro-try");
            rules[nrules].access = !strcmp(a, "--rw")        ? rw_all
                                   : !strcmp(a, "--rw-host") ? rw_host
                                   : !strcmp(a, "--dev")  ? dev
                                   : !strcmp(a, "--proc") ? proc
                                   : !strcmp(a, "--list") ? list
                                                          : ro;
            nrules++;
        } else {
            fail("validate", 0, "unknown option %s", a);
        }
    }
    if (i >= argc) fail("validate", 0, "missing command after --");
    if ((gate_socket == NULL) != (gate_port == 0)) fail("validate", 0, "--gate-socket and --gate-port go together");
    if (sysaudit_fd >= 0 && seccomp_fd < 0) fail("validate", 0, "--sysaudit-fd needs a seccomp filter");
    /* Nothing the supervisor or bwrap opened may reach the command: every fd but stdio is
     * close-on-exec from here on (an inherited O_PATH fd of a grant would bypass its
     * read-only mount). */
    if (syscall(__NR_close_range, 3U, ~0U, 4U /* CLOSE_RANGE_CLOEXEC */) < 0) {
        for (int fd = 3; fd < 4096; fd++) {
            int fl = fcntl(fd, F_GETFD);
            if (fl >= 0) fcntl(fd, F_SETFD, fl | FD_CLOEXEC);
        }
    }

    /* 2. controlling terminal: bwrap --new-session put the sandbox in a session without a
     * terminal, led by its pid 1; we lead a session of our own and adopt the sandbox's pty. */
    if (want_tty) {
        if (setsid() < 0 && getsid(0) != getpid()) fail("tty", errno, "setsid");
        if (ioctl(0, TIOCSCTTY, 0) < 0) fail("tty", errno, "TIOCSCTTY");
    }

    /* 2b. the seccomp filter, read now: the bridge loads it too */
    static unsigned char filter_buf[1 << 16];
    struct sock_fprog prog = {0};
    if (seccomp_fd >= 0) {
        size_t len = read_all(seccomp_fd, (char *)filter_buf, sizeof filter_buf, "seccomp");
        if (len == 0 || len % sizeof(struct sock_filter)) fail("seccomp", 0, "bad filter length %zu", len);
        close(seccomp_fd);
        prog.len = (unsigned short)(len / sizeof(struct sock_filter));
        prog.filter = (struct sock_filter *)filter_buf;
    }

    /* 2c. the egress bridge, before Landlock and the agent's seccomp (see start_bridge) */
    if (bridge_key_fd >= 0) {
        if (!gate_socket) fail("validate", 0, "--bridge-key-fd needs --gate-socket");
        ho_read_key(bridge_key_fd); /* (closed: the agent never has it) */
    }
    if (gate_socket) start_bridge(gate_socket, gate_port, prog.len ? &prog : NULL, bridge_key_fd >= 0);
    explicit_bzero(ho_hello, sizeof ho_hello); /* the bridge has its copy; init's goes before the agent runs */

    /* 3. working directory (before Landlock, which may forbid walking to it) */
    if (chdir_to && chdir(chdir_to) < 0) fail("chdir", errno, "chdir %s", chdir_to);

    /* 4. Landlock: everything not listed is denied. */
    if (no_landlock) goto seccomp;
    int abi = (int)syscall(__NR_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
    if (abi < 0) fail("landlock", errno, "Landlock is not available");
    if (abi < min_abi) fail("landlock", 0, "kernel Landlock ABI %d < required %ld", abi, min_abi);
    struct ll_ruleset_attr attr = {0};
    size_t attr_size = sizeof(uint64_t);
    uint64_t fs_mask = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_READ_DIR | FS_REMOVE_DIR |
                       FS_REMOVE_FILE | FS_MAKE_CHAR | FS_MAKE_DIR | FS_MAKE_REG | FS_MAKE_SOCK |
                       FS_MAKE_FIFO | FS_MAKE_BLOCK | FS_MAKE_SYM;
    if (abi >= 2) fs_mask |= FS_REFER;
    if (abi >= 3) fs_mask |= FS_TRUNCATE;
    if (abi >= 5) fs_mask |= FS_IOCTL_DEV;
    attr.handled_access_fs = fs_mask;
    if (abi >= 4 && want_net) {
        attr.handled_access_net = NET_BIND_TCP | NET_CONNECT_TCP;
        attr_size = 2 * sizeof(uint64_t);
    }
    if (abi >= 6 && want_scope) {
        attr.scoped = SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL;
        attr_size = 3 * sizeof(uint64_t);
    }
    if (want_net && abi < 4) fail("landlock", 0, "TCP port rules need Landlock ABI 4 (kernel has %d)", abi);
    if (want_scope && abi < 6) fail("landlock", 0, "scoping needs Landlock ABI 6 (kernel has %d)", abi);
    int rs = (int)syscall(__NR_landlock_create_ruleset, &attr, attr_size, 0);
    if (rs < 0) fail("landlock", errno, "create ruleset");
    for (int r = 0; r < nrules; r++) {
        int fd = open(rules[r].path, O_PATH | O_CLOEXEC);
        if (fd < 0) {
            if (rules[r].optional && errno == ENOENT) continue;
            fail("landlock", errno, "open %s", rules[r].path);
        }
        struct stat st;
        if (fstat(fd, &st) < 0) fail("landlock", errno, "stat %s", rules[r].path);
        struct ll_path_beneath_attr pb = {.allowed_access = rules[r].access & fs_mask, .parent_fd = fd};
        if (!S_ISDIR(st.st_mode)) pb.allowed_access &= ~FS_DIR_ONLY;
        if (syscall(__NR_landlock_add_rule, rs, LL_RULE_PATH_BENEATH, &pb, 0) < 0)
            fail("landlock", errno, "rule for %s", rules[r].path);
        close(fd);
    }
    if (attr.handled_access_net) {
        for (int p = 0; p < npc; p++) {
            struct ll_net_port_attr na = {.allowed_access = NET_CONNECT_TCP, .port = (uint64_t)ports_connect[p]};
            if (syscall(__NR_landlock_add_rule, rs, LL_RULE_NET_PORT, &na, 0) < 0)
                fail("landlock", errno, "tcp connect rule %ld", ports_connect[p]);
        }
        for (int p = 0; p < npb; p++) {
            struct ll_net_port_attr na = {.allowed_access = NET_BIND_TCP, .port = (uint64_t)ports_bind[p]};
            if (syscall(__NR_landlock_add_rule, rs, LL_RULE_NET_PORT, &na, 0) < 0)
                fail("landlock", errno, "tcp bind rule %ld", ports_bind[p]);
        }
    }

    /* 5. no_new_privs (required by Landlock and seccomp), restrict, then seccomp last. */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("no-new-privs", errno, "prctl");
    if (syscall(__NR_landlock_restrict_self, rs, 0) < 0) fail("landlock", errno, "restrict self");
    close(rs);

seccomp:
    if (no_landlock && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("no-new-privs", errno, "prctl");
    /* not dumpable from here to exec: between loading the filter and handing its listener
     * away this process holds the fd that answers the sandbox's syscalls, and (with
     * allow_ptrace, no Landlock and Yama 0) another process of the agent could otherwise
     * take it with pidfd_getfd or ptrace. execve makes the command dumpable again. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) fail("dumpable", errno, "prctl(PR_SET_DUMPABLE, 0)");
    if (prog.len && sysaudit_fd >= 0) {
        /* the filter's denials of escape probes are user notifications: its listener goes to
         * the supervisor, which answers each with the deny-list's errno and records it. No
         * copy stays here: the command must never hold the fd that answers its own syscalls
         * (the listener is close-on-exec too). If the supervisor is gone, the kernel answers
         * ENOSYS: the call is still refused. */
        int listener = (int)syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, &prog);
        if (listener < 0) fail("seccomp", errno, "load filter with a listener");
        if (send_fd(sysaudit_fd, 'L', listener) < 0)
            fail("sysaudit", errno, "hand the syscall listener to the supervisor");
        close(listener);
        close(sysaudit_fd);
    } else if (prog.len && syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0) {
        fail("seccomp", errno, "load filter");
    }

    /* 6. exec the command with the sandbox's environment (PATH search like a shell; 127 not
     * found, 126 not executable). */
    if (env_fd >= 0) {
        static char envbuf[1 << 20];
        static char *envp[4096];
        size_t len = read_all(env_fd, envbuf, sizeof envbuf - 1, "environment");
        close(env_fd);
        envbuf[len] = 0;
        size_t n = 0;
        for (size_t off = 0; off < len && n < 4095;) {
            envp[n++] = envbuf + off;
            off += strlen(envbuf + off) + 1;
        }
        envp[n] = NULL;
        environ = envp;
    }
    /* every layer is in place: say so (a sandbox whose setup died inside bwrap never gets
     * here, and the supervisor must not take bwrap's exit code for the command's) */
    if (status_fd >= 0) {
        static const char ready[] = "ready\n";
        ssize_t w = write(status_fd, ready, sizeof ready - 1);
        (void)w;
    }
    execvp(argv[i], &argv[i]);
    int e = errno;
    fail_code = (e == ENOENT) ? 127 : 126;
    fail("exec", e, "%s", argv[i]);
}

/* ------------------------------------------------------------------ enter
 * agentvm-helper enter --target PID --uid U --gid G [launch options] -- /.agentvm/init init ...
 * Runs a command inside a running sandbox (the daemon's `exec`): join its cgroups (as the
 * supervisor), set rlimits, enter all its namespaces (user first), move to its root, fork
 * into its pid namespace, become its uid, and exec the in-sandbox init - which applies
 * Landlock and seccomp exactly as for the sandbox's first process. The parent waits and
 * exits with the child's status. */

static int cmd_enter(int argc, char **argv) {
    struct common_opts o = {0};
    long target = -1, uid = -1, gid = -1;
    unsigned long long expect_userns = 0;
    int i = 0;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) {
            i++;
            break;
        }
        if (i + 1 >= argc) fail("validate", 0, "option %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--target")) {
            target = parse_long("validate", v, 2, 0x7fffffff);
        } else if (!strcmp(a, "--uid")) {
            uid = parse_long("validate", v, 0, 0x7fffffff);
        } else if (!strcmp(a, "--gid")) {
            gid = parse_long("validate", v, 0, 0x7fffffff);
        } else if (!strcmp(a, "--expect-userns")) {
            char *end = NULL;
            errno = 0;
            expect_userns = strtoull(v, &end, 10);
            if (errno || !end || *end || !expect_userns) fail("validate", 0, "bad --expect-userns %s", v);
        } else if (!parse_common(&o, a, v)) {
            fail("validate", 0, "unknown option %s", a);
        }
    }
    if (i >= argc || target < 0 || uid < 0 || gid < 0 || !expect_userns)
        fail("validate", 0, "need --target, --expect-userns, --uid, --gid and a command");
    /* namespaces and root of the target, opened before anything changes */
    /* host root owns every namespace below it: join the others first, the user namespace last */
    static const char *names[] = {"ipc", "uts", "net", "cgroup", "pid", "mnt", "user"};
    int nsfd[7];
    char path[64];
    for (int k = 0; k < 7; k++) {
        snprintf(path, sizeof path, "/proc/%ld/ns/%s", target, names[k]);
        nsfd[k] = open(path, O_RDONLY | O_CLOEXEC);
        if (nsfd[k] < 0) fail("enter", errno, "open %s", path);
    }
    snprintf(path, sizeof path, "/proc/%ld/root", target);
    int rootfd = open(path, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) fail("enter", errno, "open %s", path);
    /* the pid is a number that can be reused: what we opened must be the sandbox's user
     * namespace, and the pid must still be in it after the root was opened */
    struct stat nst;
    if (fstat(nsfd[6], &nst) < 0 || (unsigned long long)nst.st_ino != expect_userns)
        fail("enter", 0, "pid %ld is no longer in the sandbox (its user namespace differs)", target);
    snprintf(path, sizeof path, "/proc/%ld/ns/user", target);
    if (stat(path, &nst) < 0 || (unsigned long long)nst.st_ino != expect_userns)
        fail("enter", 0, "pid %ld left the sandbox while it was being entered", target);
    join_cgroups(&o);
    apply_rlimits(&o);
    /* no supplementary groups: dropped here, while still host root - inside the sandbox's user
     * namespace setgroups is denied, and the caller's groups (often gid 0) would ride along */
    if (setgroups(0, NULL) < 0) fail("drop-privileges", errno, "setgroups");
    for (int k = 0; k < 7; k++) {
        if (setns(nsfd[k], 0) < 0) fail("enter", errno, "setns %s", names[k]);
        close(nsfd[k]);
    }
    if (fchdir(rootfd) < 0 || chroot(".") < 0 || chdir("/") < 0) fail("enter", errno, "enter the sandbox root");
    close(rootfd);
    pid_t child = fork();
    if (child < 0) fail("enter", errno, "fork");
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
        if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) < 0) fail("drop-privileges", errno, "setresgid");
        if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0) fail("drop-privileges", errno, "setresuid");
        if (getgroups(0, NULL) != 0) fail("drop-privileges", 0, "supplementary groups survived");
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail("no-new-privs", errno, "prctl");
        execv(argv[i], &argv[i]);
        fail("exec", errno, "exec %s", argv[i]);
    }
    if (status_fd >= 0) {
        close(status_fd); /* the child keeps its copy for init's reports */
        status_fd = -1;
    }
    int st;
    while (waitpid(child, &st, 0) < 0) {
        if (errno != EINTR) fail("enter", errno, "waitpid");
    }
    if (WIFEXITED(st)) return WEXITSTATUS(st);
    return 128 + WTERMSIG(st);
}

int main(int argc, char **argv) {
    if (argc < 2) fail("validate", 0, "usage: agentvm-helper launch|init|abi [opts] -- cmd...");
    if (!strcmp(argv[1], "launch")) return cmd_launch(argc - 2, argv + 2);
    if (!strcmp(argv[1], "init")) return cmd_init(argc - 2, argv + 2);
    if (!strcmp(argv[1], "enter")) return cmd_enter(argc - 2, argv + 2);
    if (!strcmp(argv[1], "abi")) {
        int abi = (int)syscall(__NR_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
        printf("%d\n", abi < 0 ? 0 : abi);
        return 0;
    }
    fail("validate", 0, "unknown mode %s", argv[1]);
}
