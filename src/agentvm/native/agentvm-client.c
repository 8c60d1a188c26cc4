/* agentvm: the command's entry point, compiled (scripts/install.sh builds it as the venv's
 * bin/agentvm).
 *
 * One job of its own: `agentvm run [--] CMD...` with no options and no terminal, while a daemon
 * is up - the hot path. With /dev/null (or nothing) on stdin it is POST /v1/run/frames; with a
 * pipe or a socket on stdin, an interactive session (POST /v1/run/attach upgraded to
 * agentvm-frames/1, docs/daemon.md): stdin relayed as frames (its end as "c"), SIGINT, SIGTERM,
 * SIGHUP and SIGQUIT forwarded as "s" frames, output frames relayed until "x". It sends the command line to the daemon exactly as
 * agent-vm's Python thin client would (agentvm/cli/fastrun.py: the same JSON document, asking
 * for frames), relays the run's output as it comes, prints the report the daemon rendered and
 * exits with the run's exit code. A Python interpreter's start alone costs more than the whole
 * round trip to the daemon.
 *
 * Everything else - every other command, any option, a terminal, a regular file on stdin, an
 * argument that is not UTF-8, no daemon listening, a refusal - is not decided here: it execs
 * the Python entry point (AGENTVM_PY_ENTRY, run by AGENTVM_PYTHON -S) with the same arguments,
 * which does all of it the one way it is done everywhere. Only an answer that is not a 200 is
 * handed over after asking the daemon: a refusal (or a daemon without /v1/run/frames, 404)
 * comes before anything runs, so asking again there runs nothing twice. After a 200, never.
 *
 * What the daemon sends is bounded before it is believed: chunk and frame sizes are digits
 * only, at most MAX_PIECE, and every chunk ends in CRLF.
 *
 * The socket's path follows agentvm/locations.py (tests/unit/test_client_c.py checks the two
 * agree).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_PIECE (16u << 20) /* bytes of one chunk or one frame: the daemon's are at most 64 KiB */

#ifndef AGENTVM_PYTHON
#error "build with -DAGENTVM_PYTHON=\"/path/to/python\" -DAGENTVM_PY_ENTRY=\"/path/to/entry.py\""
#endif

static char **g_argv;

/* Not ours to decide: the Python entry point, same arguments. */
static void fallback(void) {
    signal(SIGPIPE, SIG_DFL); /* as it found it */
    int n = 0;
    while (g_argv[n]) n++;
    char **args = calloc((size_t)n + 4, sizeof *args);
    if (!args) _exit(125);
    args[0] = AGENTVM_PYTHON;
    args[1] = "-S";
    args[2] = AGENTVM_PY_ENTRY;
    for (int i = 1; i < n; i++) args[i + 2] = g_argv[i];
    execv(AGENTVM_PYTHON, args);
    fprintf(stderr, "agentvm: error [install.broken]: cannot run %s: %s\n  hint: reinstall: bash scripts/install.sh\n",
            AGENTVM_PYTHON, strerror(errno));
    _exit(125);
}

/* ---------------------------------------------------------------- a growable buffer */
struct buf {
    char *p;
    size_t len, cap;
};

static void put(struct buf *b, const void *data, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (b->len + n + 1 > cap) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) _exit(125);
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void puts_(struct buf *b, const char *s) { put(b, s, strlen(s)); }

/* A JSON string of a strictly valid UTF-8 argument (what Python's json.dumps of the decoded
 * argument means); 0 when it is not valid UTF-8 (then Python decides: surrogateescape). */
static int json_string(struct buf *b, const unsigned char *s) {
    put(b, "\"", 1);
    while (*s) {
        unsigned c = *s;
        if (c < 0x80) {
            char esc[8];
            if (c == '"' || c == '\\') {
                esc[0] = '\\';
                esc[1] = (char)c;
                put(b, esc, 2);
            } else if (c < 0x20 || c == 0x7f) {
                snprintf(esc, sizeof esc, "\\u%04x", c);
                put(b, esc, 6);
            } else {
                put(b, s, 1);
            }
            s++;
            continue;
        }
        int n;
        unsigned cp;
        if (c >= 0xc2 && c <= 0xdf) {
            n = 1;
            cp = c & 0x1f;
        } else if (c >= 0xe0 && c <= 0xef) {
            n = 2;
            cp = c & 0x0f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            n = 3;
            cp = c & 0x07;
        } else {
            return 0;
        }
        for (int i = 1; i <= n; i++) {
            if ((s[i] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i] & 0x3f);
        }
        if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return 0; /* overlong, out of range, or a surrogate: not UTF-8 */
        put(b, s, (size_t)n + 1);
        s += n + 1;
    }
    put(b, "\"", 1);
    return 1;
}

/* ---------------------------------------------------------------- where the daemon is */
static int join(char *out, size_t size, const char *a, const char *b) {
    int n = snprintf(out, size, "%s/%s", a, b);
    return n > 0 && (size_t)n < size;
}

/* agentvm/locations.py default_dirs()[1] + "/agentvm.sock"; 0 when an unusual environment
 * (then Python decides). */
static int socket_path(char *out, size_t size) {
    const char *home = getenv("AGENTVM_HOME"), *runtime = getenv("AGENTVM_RUNTIME_DIR");
    if ((home && !*home) || (runtime && !*runtime)) return 0; /* "" is falsy in Python: rare, not ours */
    char rt[PATH_MAX];
    if (runtime) {
        if (strlen(runtime) >= sizeof rt) return 0;
        strcpy(rt, runtime);
    } else if (geteuid() == 0) {
        if (home) {
            if (!join(rt, sizeof rt, home, "run")) return 0;
        } else {
            strcpy(rt, "/run/agentvm");
        }
    } else {
        const char *xdg_run = getenv("XDG_RUNTIME_DIR");
        if (xdg_run && *xdg_run && !home) {
            if (!join(rt, sizeof rt, xdg_run, "agentvm")) return 0;
        } else {
            char h[PATH_MAX];
            if (home) {
                if (strlen(home) >= sizeof h) return 0;
                strcpy(h, home);
            } else {
                const char *xdg_data = getenv("XDG_DATA_HOME");
                if (xdg_data && *xdg_data) {
                    if (!join(h, sizeof h, xdg_data, "agentvm")) return 0;
                } else {
                    const char *uhome = getenv("HOME");
                    if (!uhome || !*uhome) return 0; /* expanduser's other cases: Python's */
                    if (snprintf(h, sizeof h, "%s/.local/share/agentvm", uhome) >= (int)sizeof h) return 0;
                }
            }
            if (!join(rt, sizeof rt, h, "run")) return 0;
        }
    }
    return join(out, size, rt, "agentvm.sock");
}

/* ---------------------------------------------------------------- the answer */
struct conn {
    int fd;
    double deadline; /* CLOCK_MONOTONIC seconds by which the head must be in; 0: none */
    int timed_out;
    char buf[65536];
    size_t off, len;
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int fill(struct conn *c) {
    if (c->off == c->len) c->off = c->len = 0;
    if (c->len == sizeof c->buf) {
        if (c->off == 0) return -1; /* a line longer than the buffer: not a daemon's answer */
        memmove(c->buf, c->buf + c->off, c->len - c->off);
        c->len -= c->off;
        c->off = 0;
    }
    if (c->deadline > 0) { /* the whole head within the timeout, however it trickles in */
        int pr;
        do {
            double left = c->deadline - now();
            if (left <= 0) {
                c->timed_out = 1;
                return -1;
            }
            struct pollfd p = {.fd = c->fd, .events = POLLIN};
            pr = poll(&p, 1, (int)(left * 1000) + 1);
        } while (pr == 0 || (pr < 0 && errno == EINTR));
        if (pr < 0) return -1;
    }
    ssize_t r;
    do r = read(c->fd, c->buf + c->len, sizeof c->buf - c->len);
    while (r < 0 && errno == EINTR);
    if (r <= 0) return -1;
    c->len += (size_t)r;
    return 0;
}

/* The next CRLF-terminated line (NUL-terminated, CRLF removed), or NULL at the end. */
static char *line(struct conn *c) {
    for (;;) {
        char *start = c->buf + c->off;
        char *nl = memmem(start, c->len - c->off, "\r\n", 2);
        if (nl) {
            *nl = 0;
            c->off = (size_t)(nl - c->buf) + 2;
            return start;
        }
        if (fill(c) < 0) return NULL;
    }
}

/* Exactly n bytes of the body, into dst (may be NULL: skipped). */
static int take(struct conn *c, char *dst, size_t n) {
    while (n) {
        if (c->off == c->len && fill(c) < 0) return -1;
        size_t k = c->len - c->off < n ? c->len - c->off : n;
        if (dst) {
            memcpy(dst, c->buf + c->off, k);
            dst += k;
        }
        c->off += k;
        n -= k;
    }
    return 0;
}

static int write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* ---------------------------------------------------------------- what reaches a terminal */
/* When stdout (or stderr, each on its own) is a terminal, the sandbox's output goes through
 * this filter: agentvm/termfilter.py is the same state machine, documented there, and
 * tests/unit/test_termfilter.py holds the table both are tested with. It removes what makes the
 * terminal act for the sandbox - answer-back queries (DSR, DA, DECRQSS, XTGETTCAP, colour and
 * window reports, ENQ, DECID), the clipboard (OSC 52), titles, every DCS/SOS/PM/APC string and
 * the UTF-8-encoded C1 controls, every byte not in well-formed UTF-8, ESC % but ESC % G, screen's
 * ESC k title - and keeps text, SGR colours, cursor movement, modes, OSC 8.
 * A sequence is held until its end, at most TF_LIMIT bytes (then it is dropped, the rest is
 * text); one left incomplete at the end is dropped. AGENTVM_RAW_OUTPUT=1 passes bytes as they
 * are (the Python entry point's --raw-output); so does a pipe or a file. */
#define TF_LIMIT 4096u
enum { TF_GROUND, TF_ESC, TF_ESC_I, TF_CSI, TF_OSC, TF_OSC_ESC, TF_STR, TF_STR_ESC, TF_LEAD };
struct tf {
    int on, state;
    size_t n;
    unsigned char held[TF_LIMIT + 8];
};

static int tf_csi_keep(const unsigned char *s, size_t n) { /* ESC [ PARAMS INTERMEDIATES FINAL */
    unsigned char fin = s[n - 1];
    size_t i = n - 1;
    while (i > 2 && s[i - 1] >= 0x20 && s[i - 1] <= 0x2f) i--;
    const unsigned char *p = s + 2, *in = s + i;
    size_t np = i - 2, ni = n - 1 - i;
    for (size_t k = 0; k < np; k++)
        if (p[k] >= 0x20 && p[k] <= 0x2f) return 0;
    if (fin == 'n' || fin == 'c' || fin == 't') return 0;
    if (ni == 0) {
        if (fin == 'x') return 0;
        if (fin == 'q' && np && p[0] == '>') return 0;
        if ((fin == 'u' || fin == 'S' || fin == 'm') && np && p[0] == '?') return 0;
        return 1;
    }
    if (ni == 1) {
        static const char *const bad[] = {"$p", "$w", "$u", "*y", "'w", "&u", "\"v", "#|", "'|"};
        for (size_t k = 0; k < sizeof bad / sizeof *bad; k++)
            if (in[0] == (unsigned char)bad[k][0] && fin == (unsigned char)bad[k][1]) return 0;
    }
    return 1;
}

static int tf_osc_keep(const unsigned char *p, size_t n) { /* between ESC ] and the terminator */
    size_t i = 0;
    unsigned num = 0;
    while (i < n && p[i] >= '0' && p[i] <= '9' && i < 5) num = num * 10 + (unsigned)(p[i++] - '0');
    if (i == 0 || (i < n && p[i] != ';')) return 0;
    int keep = num == 8 || num == 133 || num == 4 || num == 104 || num == 105 ||
               (num >= 10 && num < 20) || (num >= 110 && num < 120);
    if (!keep) return 0;
    for (size_t k = 0; k < n; k++)
        if (p[k] < 0x20 || p[k] > 0x7e) return 0;
    if (num == 8 || num == 133) return 1;
    /* a colour: no item may be "?" (a query) */
    size_t a = i;
    while (a < n) {
        size_t b = a + 1;
        while (b < n && p[b] != ';') b++;
        size_t s = a + 1, e = b;
        while (s < e && p[s] == ' ') s++;
        while (e > s && p[e - 1] == ' ') e--;
        if (e - s == 1 && p[s] == '?') return 0;
        a = b;
    }
    return 1;
}

/* A UTF-8 lead byte: its sequence's length and the range of its second byte (Unicode table
 * 3-7); 0 if b starts no well-formed sequence (a continuation byte, c0, c1, f5-ff). */
static int tf_utf8(unsigned char b, unsigned char *lo, unsigned char *hi) {
    *lo = 0x80;
    *hi = 0xbf;
    if (b >= 0xc2 && b <= 0xdf) return 2;
    if (b == 0xe0) { *lo = 0xa0; return 3; }
    if (b >= 0xe1 && b <= 0xef) { if (b == 0xed) *hi = 0x9f; return 3; }
    if (b == 0xf0) { *lo = 0x90; return 4; }
    if (b >= 0xf1 && b <= 0xf3) return 4;
    if (b == 0xf4) { *hi = 0x8f; return 4; }
    return 0;
}

/* Filters n bytes of d into out (at most n + TF_LIMIT + 4 bytes: what was held may come out): its length. */
static size_t tf_feed(struct tf *f, const unsigned char *d, size_t n, unsigned char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned char b = d[i++];
        switch (f->state) {
        case TF_GROUND:
            if (b == 0x1b) {
                f->held[0] = b;
                f->n = 1;
                f->state = TF_ESC;
            } else if (b >= 0x80) { /* UTF-8: held until whole (termfilter.py); a byte starting none: dropped */
                unsigned char lo, hi;
                if (tf_utf8(b, &lo, &hi)) {
                    f->held[0] = b;
                    f->n = 1;
                    f->state = TF_LEAD;
                }
            } else if (b != 0x05) { /* ENQ: dropped */
                out[o++] = b;
            }
            continue;
        case TF_LEAD: {
            unsigned char lo, hi;
            int need = tf_utf8(f->held[0], &lo, &hi);
            if (f->n > 1) {
                lo = 0x80;
                hi = 0xbf;
            }
            if (b >= lo && b <= hi) {
                f->held[f->n++] = b;
                if ((int)f->n == need) { /* written only whole: nothing dropped later joins its bytes */
                    if (!(f->held[0] == 0xc2 && f->held[1] <= 0x9f)) { /* else a C1 control, UTF-8 encoded */
                        memcpy(out + o, f->held, f->n);
                        o += f->n;
                    }
                    f->n = 0;
                    f->state = TF_GROUND;
                }
            } else { /* malformed: what was held is dropped, the byte after it is in ground */
                f->n = 0;
                f->state = TF_GROUND;
                i--;
            }
            continue;
        }
        }
        if (b == 0x18 || b == 0x1a) { /* CAN, SUB */
            f->n = 0;
            f->state = TF_GROUND;
            continue;
        }
        switch (f->state) {
        case TF_ESC:
            if (b == '[') {
                f->held[f->n++] = b;
                f->state = TF_CSI;
            } else if (b == ']') {
                f->held[f->n++] = b;
                f->state = TF_OSC;
            } else if (b == 'P' || b == 'X' || b == '^' || b == '_' || b == 'k') { /* k: screen's title */
                f->n = 0;
                f->state = TF_STR;
            } else if (b >= 0x20 && b <= 0x2f) {
                f->held[f->n++] = b;
                f->state = TF_ESC_I;
            } else if (b >= 0x30 && b <= 0x7e) {
                if (b != 'Z') {
                    out[o++] = 0x1b;
                    out[o++] = b;
                }
                f->n = 0;
                f->state = TF_GROUND;
            } else {
                f->n = 0;
                f->state = TF_GROUND;
                i--;
            }
            continue;
        case TF_ESC_I:
            if (b >= 0x20 && b <= 0x2f) {
                f->held[f->n++] = b;
            } else if (b >= 0x30 && b <= 0x7e) {
                f->held[f->n++] = b;
                /* ESC % other than ESC % G would take the terminal out of UTF-8 (raw C1 then act) */
                if (f->held[1] != '%' || (f->n == 3 && b == 'G')) {
                    memcpy(out + o, f->held, f->n);
                    o += f->n;
                }
                f->n = 0;
                f->state = TF_GROUND;
                continue;
            } else {
                f->n = 0;
                f->state = TF_GROUND;
                i--;
                continue;
            }
            break;
        case TF_CSI:
            if (b >= 0x20 && b <= 0x3f) {
                f->held[f->n++] = b;
            } else if (b >= 0x40 && b <= 0x7e) {
                f->held[f->n++] = b;
                if (tf_csi_keep(f->held, f->n)) {
                    memcpy(out + o, f->held, f->n);
                    o += f->n;
                }
                f->n = 0;
                f->state = TF_GROUND;
                continue;
            } else {
                f->n = 0;
                f->state = TF_GROUND;
                i--;
                continue;
            }
            break;
        case TF_OSC:
            if (b == 0x07) {
                if (tf_osc_keep(f->held + 2, f->n - 2)) {
                    memcpy(out + o, f->held, f->n);
                    o += f->n;
                    out[o++] = b;
                }
                f->n = 0;
                f->state = TF_GROUND;
                continue;
            } else if (b == 0x1b) {
                f->state = TF_OSC_ESC;
                continue;
            }
            f->held[f->n++] = b;
            break;
        case TF_OSC_ESC:
            if (b == '\\') {
                if (tf_osc_keep(f->held + 2, f->n - 2)) {
                    memcpy(out + o, f->held, f->n);
                    o += f->n;
                    out[o++] = 0x1b;
                    out[o++] = '\\';
                }
                f->n = 0;
                f->state = TF_GROUND;
            } else { /* a new sequence: this one is dropped */
                f->held[0] = 0x1b;
                f->n = 1;
                f->state = TF_ESC;
                i--;
            }
            continue;
        case TF_STR:
            if (b == 0x1b) f->state = TF_STR_ESC;
            else if (b == 0x07) f->state = TF_GROUND;
            continue;
        case TF_STR_ESC:
            if (b == '\\') {
                f->state = TF_GROUND;
            } else {
                f->held[0] = 0x1b;
                f->n = 1;
                f->state = TF_ESC;
                i--;
            }
            continue;
        }
        if (f->n > TF_LIMIT) { /* too long to hold: dropped, the rest is text */
            f->n = 0;
            f->state = TF_GROUND;
        }
    }
    return o;
}

/* The end of a stream: a sequence left incomplete is dropped. */
static void tf_finish(struct tf *f) {
    f->n = 0;
    f->state = TF_GROUND;
}

static struct tf g_tf[3]; /* [1] stdout's, [2] stderr's */

static void tf_setup(void) {
    const char *raw = getenv("AGENTVM_RAW_OUTPUT");
    int r = raw && strcmp(raw, "1") == 0;
    g_tf[1].on = !r && isatty(1);
    g_tf[2].on = !r && isatty(2);
}

/* write_all of the sandbox's output to fd 1 or 2, through its filter when it has one. */
static int write_out(int fd, const char *p, size_t n) {
    struct tf *f = &g_tf[fd];
    if (!f->on) return write_all(fd, p, n);
    static unsigned char ob[65536 + TF_LIMIT + 64]; /* k bytes in; out: k, plus what was held */
    while (n) {
        size_t k = n < 65536 ? n : 65536;
        size_t o = tf_feed(f, (const unsigned char *)p, k, ob);
        if (o && write_all(fd, (const char *)ob, o) < 0) return -1;
        p += k;
        n -= k;
    }
    return 0;
}

/* The report the daemon rendered, after the run's output: the stream's filter ends (what the
 * sandbox left incomplete does not swallow it) and the report goes through a fresh one. */
static void write_report(const char *p, size_t n) {
    struct tf *f = &g_tf[2];
    if (f->on) tf_finish(f);
    write_out(2, p, n);
    if (f->on) tf_finish(f);
}

/* ---------------------------------------------------------------- an interactive session */
#define IN_FRAME 65536u          /* stdin bytes per frame (the daemon's limit) */
#define OUT_PENDING (256u << 10) /* bytes queued for the daemon before stdin is no longer read */

static int g_wake[2] = {-1, -1};
static volatile sig_atomic_t g_sig;

static void on_signal(int sig) {
    int e = errno;
    g_sig = sig;
    if (g_wake[1] >= 0) (void)!write(g_wake[1], "s", 1);
    errno = e;
}

static void frame(struct buf *b, char kind, const void *p, size_t n) {
    char head[24];
    int h = snprintf(head, sizeof head, "%c%zu\n", kind, n);
    put(b, head, (size_t)h);
    if (n) put(b, p, n);
}

static int ended(const char *why);

/* One frame from the daemon, on either path (a framed run, an interactive session): output
   is written on (-1: read on), the end frame is the exit code, anything else ends the run. */
static int daemon_frame(char kind, const char *payload, size_t n) {
    if (kind == 'o' || kind == 'e') {
        if (write_out(kind == 'o' ? 1 : 2, payload, n) < 0) {
            if (errno == EPIPE) return 141; /* our reader went away: so does the run */
            return 125;
        }
        return -1;
    }
    if (kind != 'x') return ended("an unknown frame");
    const char *eol = memchr(payload, '\n', n);
    int rc = 0;
    if (!eol || eol == payload || eol - payload > 3) return ended("a malformed end frame");
    for (const char *d = payload; d < eol; d++) {
        if (*d < '0' || *d > '9') return ended("a malformed end frame");
        rc = rc * 10 + (*d - '0');
    }
    if (rc > 255) return ended("a malformed end frame");
    write_report(eol + 1, n - (size_t)(eol + 1 - payload));
    return rc;
}


/* Frames both ways until "x": its exit code. */
static int attach_loop(struct conn *c) {
    struct buf out = {0}, in = {0};
    size_t out_off = 0, used = 0;
    int stdin_open = 1;
    if (c->len > c->off) put(&in, c->buf + c->off, c->len - c->off); /* frames that came with the head */
    if (pipe2(g_wake, O_CLOEXEC | O_NONBLOCK) < 0) return 125;
    struct sigaction sa = {.sa_handler = on_signal}; /* no SA_RESTART: poll wakes */
    sigemptyset(&sa.sa_mask);
    int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++) sigaction(sigs[i], &sa, NULL);
    int fl = fcntl(c->fd, F_GETFL);
    if (fl >= 0) fcntl(c->fd, F_SETFL, fl | O_NONBLOCK);
    static char rb[65536];
    for (;;) {
        /* whole frames from the daemon */
        for (;;) {
            char *nl = in.len > used ? memchr(in.p + used, '\n', in.len - used < 11 ? in.len - used : 11) : NULL;
            if (!nl) {
                if (in.len - used > 10) return ended("a malformed frame");
                break;
            }
            char kind = in.p[used];
            size_t n = 0;
            const char *d = in.p + used + 1;
            if (d == nl || nl - d > 9) return ended("a malformed frame");
            for (; d < nl; d++) {
                if (*d < '0' || *d > '9') return ended("a malformed frame");
                n = n * 10 + (size_t)(*d - '0');
            }
            if (n > MAX_PIECE) return ended("a frame over the size limit");
            size_t at = (size_t)(nl - in.p) + 1;
            if (in.len - at < n) break;
            const char *payload = in.p + at;
            used = at + n;
            int rc = daemon_frame(kind, payload, n);
            if (rc >= 0) return rc;
        }
        if (used == in.len) in.len = used = 0;
        if (g_sig) {
            int sig = g_sig;
            g_sig = 0;
            const char *name = sig == SIGINT ? "INT" : sig == SIGTERM ? "TERM" : sig == SIGHUP ? "HUP" : "QUIT";
            frame(&out, 's', name, strlen(name));
        }
        struct pollfd p[3] = {{.fd = c->fd, .events = POLLIN | (out.len > out_off ? POLLOUT : 0)},
                              {.fd = g_wake[0], .events = POLLIN},
                              {.fd = stdin_open && out.len - out_off < OUT_PENDING ? 0 : -1, .events = POLLIN}};
        if (poll(p, 3, -1) < 0) {
            if (errno == EINTR) continue;
            return 125;
        }
        if (p[1].revents) {
            char junk[64];
            while (read(g_wake[0], junk, sizeof junk) > 0) {
            }
        }
        if (p[2].revents) {
            static char ib[IN_FRAME];
            ssize_t r = read(0, ib, sizeof ib);
            if (r < 0 && errno == EINTR) continue;
            if (r > 0) {
                frame(&out, 'i', ib, (size_t)r);
            } else {
                frame(&out, 'c', NULL, 0);
                stdin_open = 0;
            }
        }
        if ((p[0].revents & POLLOUT) && out.len > out_off) {
            ssize_t w = write(c->fd, out.p + out_off, out.len - out_off);
            if (w > 0) out_off += (size_t)w;
            else if (w < 0 && errno != EAGAIN && errno != EINTR) return ended("the connection closed mid-session");
            if (out_off == out.len) out.len = out_off = 0;
        }
        if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
            ssize_t r = read(c->fd, rb, sizeof rb);
            if (r == 0) return ended("the connection closed mid-session");
            if (r < 0) {
                if (errno == EAGAIN || errno == EINTR) continue;
                return ended("the connection closed mid-session");
            }
            if (used) {
                memmove(in.p, in.p + used, in.len - used);
                in.len -= used;
                used = 0;
            }
            put(&in, rb, (size_t)r);
        }
    }
}

static int ended(const char *why) {
    fprintf(stderr, "agentvm: the daemon ended the run without a result (%s)\n", why);
    return 125;
}

#ifdef AGENTVM_TERMFILTER_TEST
#define main client_main
#endif
int main(int argc, char **argv) {
    g_argv = argv;
    if (argc < 3 || strcmp(argv[1], "run") != 0) fallback();
    int first = 2;
    if (strcmp(argv[2], "--") == 0)
        first = 3;
    else if (argv[2][0] == '-')
        fallback(); /* an option: Python parses it */
    if (first >= argc) fallback();
    const char *nd = getenv("AGENTVM_NO_DAEMON");
    if (nd && strcmp(nd, "1") == 0) fallback();
    if (isatty(0) && isatty(1)) fallback(); /* Python decides whether the sandbox gets a terminal */
    struct stat st;
    int attach = 0; /* a pipe or a socket on stdin: an interactive session */
    if (fstat(0, &st) == 0) {
        if (S_ISREG(st.st_mode)) fallback();
        if (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode)) attach = 1;
        if (S_ISCHR(st.st_mode)) {
            struct stat dn;
            if (stat("/dev/null", &dn) != 0 || st.st_rdev != dn.st_rdev || st.st_ino != dn.st_ino) fallback();
        }
    }

    struct buf body = {0};
    puts_(&body, "{\"command\":[");
    for (int i = first; i < argc; i++) {
        if (i > first) put(&body, ",", 1);
        if (!json_string(&body, (const unsigned char *)argv[i])) fallback();
    }
    puts_(&body, "],\"cli\":{\"mounts\":[],\"env\":[],\"timeout\":null,\"memory\":null,\"allow\":[],\"add_host\":[],"
                 "\"network\":null,\"substrate\":null,\"image\":null}}");

    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (!socket_path(sa.sun_path, sizeof sa.sun_path)) fallback();
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) fallback();
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        close(fd);
        fallback(); /* no daemon listening: the run is embedded (Python's) */
    }
    signal(SIGPIPE, SIG_IGN);
    tf_setup();

    struct buf req = {0};
    char head[256];
    if (attach)
        snprintf(head, sizeof head,
                 "POST /v1/run/attach HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\nConnection: Upgrade\r\nUpgrade: agentvm-frames/1\r\n\r\n",
                 body.len);
    else
        snprintf(head, sizeof head,
                 "POST /v1/run/frames HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                 body.len);
    puts_(&req, head);
    put(&req, body.p, body.len);
    if (write_all(fd, req.p, req.len) < 0) {
        close(fd);
        fallback();
    }

    /* the answer's head, within AGENTVM_CLIENT_TIMEOUT (as the Python client) */
    double timeout = 60.0; /* as fastrun._timeout: a positive finite number, else the default */
    const char *ts = getenv("AGENTVM_CLIENT_TIMEOUT");
    if (ts && *ts) {
        char *end;
        double v = strtod(ts, &end);
        if (*end == 0 && v > 0 && v < 1e9) timeout = v;
    }
    static struct conn c; /* 64 KiB: not on the stack */
    c.fd = fd;
    c.deadline = now() + timeout;
    char *status = line(&c);
    int code = 0;
    if (status && strncmp(status, "HTTP/1.1 ", 9) == 0 && status[9] >= '1' && status[9] <= '5' &&
        status[10] >= '0' && status[10] <= '9' && status[11] >= '0' && status[11] <= '9')
        code = (status[9] - '0') * 100 + (status[10] - '0') * 10 + (status[11] - '0');
    int frames = 0, chunked = 0, whole = 0;
    while (code) {
        char *h = line(&c);
        if (!h) break;
        if (!*h) {
            whole = 1;
            break;
        }
        if (strcasecmp(h, "content-type: application/x-agentvm-frames") == 0) frames = 1;
        if (strcasecmp(h, "transfer-encoding: chunked") == 0) chunked = 1;
    }
    if (c.timed_out) {
        char path[sizeof sa.sun_path];
        socket_path(path, sizeof path);
        fprintf(stderr, "agentvm: error [daemon.timeout]: the agent-vm daemon did not answer within %gs (%s)\n"
                        "  hint: it may be stopped or overloaded; AGENTVM_CLIENT_TIMEOUT sets the wait\n",
                timeout, path);
        return 125;
    }
    if (!code) return ended("not an HTTP answer");
    if (!whole) return ended("the connection closed mid-answer");
    if (code >= 300) {
        close(fd); /* a refusal before the run (or no /v1/run/frames: 404): Python asks again and says it */
        fallback();
    }
    if (attach) {
        if (code != 101) return ended("an answer this client does not read");
        return attach_loop(&c);
    }
    if (code != 200 || !frames || !chunked) return ended("an answer this client does not read");
    c.deadline = 0; /* the run is as long as it is */

    /* the body: chunks of frames "KIND LENGTH\n PAYLOAD" */
    struct buf fb = {0};
    size_t used = 0;
    for (;;) {
        /* a whole frame in fb? */
        char *nl = fb.len > used ? memchr(fb.p + used, '\n', fb.len - used) : NULL;
        if (!nl && fb.len - used > 11) return ended("a malformed frame"); /* a kind and 9 digits at most */
        if (nl) {
            char kind = fb.p[used];
            size_t n = 0;
            const char *d = fb.p + used + 1;
            if (d == nl || nl - d > 9) return ended("a malformed frame");
            for (; d < nl; d++) {
                if (*d < '0' || *d > '9') return ended("a malformed frame");
                n = n * 10 + (size_t)(*d - '0');
            }
            if (n > MAX_PIECE) return ended("a frame over the size limit");
            size_t at = (size_t)(nl - fb.p) + 1;
            if (fb.len - at >= n) {
                const char *payload = fb.p + at;
                used = at + n;
                int rc = daemon_frame(kind, payload, n);
                if (rc >= 0) return rc;
                if (used == fb.len) fb.len = used = 0;
                continue;
            }
        }
        /* more: one chunk */
        char *sz = line(&c);
        if (!sz) return ended("the connection closed mid-answer");
        size_t n = 0;
        const char *h = sz;
        for (; *h && *h != ';'; h++) { /* hex digits only (no sign, no 0x, no spaces), bounded */
            int v = *h >= '0' && *h <= '9' ? *h - '0' : *h >= 'a' && *h <= 'f' ? *h - 'a' + 10
                  : *h >= 'A' && *h <= 'F' ? *h - 'A' + 10 : -1;
            if (v < 0 || h - sz >= 8) return ended("a malformed chunk");
            n = n * 16 + (size_t)v;
        }
        if (h == sz) return ended("a malformed chunk");
        if (n > MAX_PIECE) return ended("a chunk over the size limit");
        if (n == 0) return ended("the answer ended before the run's result");
        if (used) { /* drop what was consumed */
            memmove(fb.p, fb.p + used, fb.len - used);
            fb.len -= used;
            used = 0;
        }
        size_t at = fb.len;
        char tmp[1];
        put(&fb, tmp, 0);
        if (fb.len + n + 1 > fb.cap) {
            size_t cap = fb.cap;
            while (fb.len + n + 1 > cap) cap *= 2;
            char *np = realloc(fb.p, cap);
            if (!np) return 125;
            fb.p = np;
            fb.cap = cap;
        }
        if (take(&c, fb.p + at, n) < 0) return ended("the connection closed mid-answer");
        fb.len = at + n;
        fb.p[fb.len] = 0;
        char crlf[2];
        if (take(&c, crlf, 2) < 0) return ended("the connection closed mid-answer");
        if (crlf[0] != '\r' || crlf[1] != '\n') return ended("a malformed chunk");
    }
}

#ifdef AGENTVM_TERMFILTER_TEST
#undef main
/* tests/unit/test_client_c.py: stdin through the filter whole (to stdout); then split at every
 * byte boundary and a byte at a time, each of which must give the same bytes (else exit 3). */
int main(void) {
    static unsigned char in[1 << 16], a[(1 << 16) + TF_LIMIT + 64], b[(1 << 16) + TF_LIMIT + 64];
    size_t n = 0;
    ssize_t r;
    while ((r = read(0, in + n, sizeof in - n)) > 0) n += (size_t)r;
    static struct tf f;
    tf_finish(&f);
    size_t whole = tf_feed(&f, in, n, a);
    for (size_t k = 0; k <= n; k++) {
        tf_finish(&f);
        size_t o = tf_feed(&f, in, k, b);
        o += tf_feed(&f, in + k, n - k, b + o);
        if (o != whole || memcmp(a, b, o) != 0) {
            fprintf(stderr, "split at %zu differs\n", k);
            return 3;
        }
    }
    tf_finish(&f);
    size_t o = 0;
    for (size_t k = 0; k < n; k++) o += tf_feed(&f, in + k, 1, b + o);
    if (o != whole || memcmp(a, b, o) != 0) {
        fprintf(stderr, "a byte at a time differs\n");
        return 3;
    }
    write_all(1, (const char *)a, whole);
    return 0;
}
#endif
