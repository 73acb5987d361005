/*
 * example.c — the devhost example driver in C, and the template to copy.
 *
 * It invents `count` devices, reports them in scan with their container
 * edits, adds an env var and an annotation in allocate, watches a text
 * file for health changes on a thread of its own (inotify: it sleeps until
 * the file changes, no polling), and "resets" devices in release (ABI 1.1)
 * when their pod is gone. A DRA claim may pass {"greeting": "<text>"} as its
 * opaque parameters (ABI 1.3): allocate validates them and adds
 * EXAMPLE_GREETING. Only libc and pthreads; it compiles cleanly with
 * -std=c11 -Wall -Wextra -Werror.
 *
 * Options (all optional, see README.md):
 *   count        number of devices, 0..1024 (default 2); IDs are <prefix>-<i>
 *   prefix       ID prefix (default "example")
 *   numa_nodes   device i is on NUMA node i % numa_nodes; 0 = no NUMA (default 1)
 *   health_file  text file whose lines name unhealthy device IDs
 *   model        value of the `model` attribute (default "example-v1")
 *   release_file       release appends "released <id>,<id>...\n" here
 *   release_fail_file  text file whose lines name devices whose release fails
 *                      (to watch the host retry; edit it to let a retry pass)
 *   release_delay_ms   how long a release takes, 0..600000 (default 0)
 *   dev_dir      folder of real device nodes: device i's host node is
 *                <dev_dir>/example<i> (default: /dev/null for every device)
 */
#define _POSIX_C_SOURCE 200809L /* getline, nanosleep, O_CLOEXEC */

#include "devhost_driver.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h> /* Linux, like the kubelet's device plugins */
#include <time.h>
#include <unistd.h>

#define MAX_COUNT 1024u
#define MAX_NUMA_NODES 1024u
/* Longest prefix that keeps "<prefix>-1023" within the ABI's 63-byte ID limit. */
#define MAX_PREFIX_LEN 58u
/* What can change the health file: a write finished, a file renamed onto it
 * (editors, `mv`, ConfigMap-style swaps), created, removed or renamed away. */
#define WATCH_EVENTS (IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_MOVED_FROM)
#define REWATCH_MS 1000 /* after the folder itself vanished: try again this often */
#define MAX_RELEASE_DELAY_MS 600000u /* 10 min: long enough to outlast any call deadline */
#define MAX_DEV_DIR_LEN 4000u /* leaves room for "/example1023" within PATH_MAX */

#if defined(__GNUC__)
#define PRINTF_LIKE(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define PRINTF_LIKE(fmt, args)
#endif

/*
 * True when the host's API table contains `field` and it is set. A host built
 * against an older minor passes a smaller table, so check the declared
 * struct_size before using any callback added after v1.0. Everything used
 * here is v1.0, so a v1 host always passes; the check is the pattern to copy.
 */
#define HOST_HAS(host, field)                                                          \
    ((host)->struct_size >= offsetof(devhost_host_api, field) + sizeof((host)->field) && \
     (host)->field != NULL)

/* printf arguments for a borrowed string: "%.*s", SHOW(s). Long values are cut. */
#define SHOW(s) (int)((s).len > 200 ? 200 : (s).len), ((s).ptr != NULL ? (s).ptr : "")

/* One driver instance: the parsed options, then the watch thread's state. */
typedef struct example {
    const devhost_host_api *host;
    unsigned count;
    unsigned numa_nodes;
    char *prefix;
    char *model;
    char *health_file; /* NULL: every device is healthy */
    char *release_file; /* NULL: releases are not recorded */
    char *release_fail_file; /* NULL: every release succeeds */
    unsigned release_delay_ms;
    char *dev_dir; /* NULL: every device's host node is /dev/null */

    pthread_t thread;  /* valid while `watching` */
    bool watching;     /* touched only by host calls, which never overlap */
    char *health_dir;  /* the health file's folder, which inotify watches */
    char *health_name; /* the file's name inside it */
    int inotify_fd;    /* -1 unless `watching`; owned by the watch thread */
    int stop_pipe[2];  /* watch_stop writes a byte to [1]; the thread polls [0] */
} example;

/* ---- strings: the host's are (pointer, length) views, not C strings ---- */

static devhost_str str_of(const char *s) {
    devhost_str out = {s, strlen(s)};
    return out;
}

static bool str_is(devhost_str s, const char *literal) {
    return s.len == strlen(literal) && (s.len == 0 || memcmp(s.ptr, literal, s.len) == 0);
}

/* A NUL-terminated copy: borrowed strings die with the call, so keep copies. */
static char *str_dup(devhost_str s) {
    char *out = malloc(s.len + 1);
    if (out != NULL) {
        if (s.len > 0) memcpy(out, s.ptr, s.len);
        out[s.len] = '\0';
    }
    return out;
}

/* Parses a decimal number in 0..=max; no sign, no spaces. */
static bool parse_uint(devhost_str s, unsigned max, unsigned *out) {
    unsigned value = 0;
    if (s.len == 0) return false;
    for (size_t i = 0; i < s.len; i++) {
        if (s.ptr[i] < '0' || s.ptr[i] > '9') return false;
        value = value * 10u + (unsigned)(s.ptr[i] - '0');
        if (value > max) return false; /* stops before it could overflow */
    }
    *out = value;
    return true;
}

/* ---- reporting errors and logging --------------------------------------- */

/* Attaches a formatted message to the current call and returns `status`. */
PRINTF_LIKE(4, 5)
static devhost_status fail(const devhost_host_api *host, devhost_call *call,
                           devhost_status status, const char *fmt, ...) {
    char message[512];
    va_list args;
    va_start(args, fmt);
    vsnprintf(message, sizeof message, fmt, args);
    va_end(args);
    host->set_error(call, str_of(message));
    return status;
}

PRINTF_LIKE(3, 4)
static void log_msg(const example *ex, devhost_log_level level, const char *fmt, ...) {
    char message[1024];
    va_list args;
    va_start(args, fmt);
    vsnprintf(message, sizeof message, fmt, args);
    va_end(args);
    ex->host->log(ex->host->host_ctx, level, str_of(message));
}

/* ---- devices --------------------------------------------------------------- */

static void format_id(const example *ex, unsigned index, char id[64]) {
    snprintf(id, 64, "%s-%u", ex->prefix, index);
}

/* Resolves "<prefix>-<i>" to i; false when `id` is not one of our devices. */
static bool device_index(const example *ex, devhost_str id, unsigned *out) {
    size_t plen = strlen(ex->prefix);
    if (ex->count == 0 || id.len < plen + 2 || memcmp(id.ptr, ex->prefix, plen) != 0 ||
        id.ptr[plen] != '-')
        return false;
    devhost_str digits = {id.ptr + plen + 1, id.len - plen - 1};
    if (digits.len > 1 && digits.ptr[0] == '0') return false; /* "x-01" is not "x-1" */
    return parse_uint(digits, ex->count - 1, out);
}

/* Marks the devices named by the lines of the file at `path` (the value of
 * option `option`). No path or a missing file marks nothing. */
static devhost_status read_id_file(const example *ex, devhost_call *call, const char *option,
                                   const char *path, bool *marked) {
    if (path == NULL) return DEVHOST_OK;
    FILE *file = fopen(path, "r");
    if (file == NULL) {
        if (errno == ENOENT) return DEVHOST_OK;
        return fail(ex->host, call, DEVHOST_ERR_UNAVAILABLE, "cannot open %s \"%s\": %s", option,
                    path, strerror(errno));
    }
    char *line = NULL;
    size_t capacity = 0;
    ssize_t n;
    while ((n = getline(&line, &capacity, file)) >= 0) {
        devhost_str s = {line, (size_t)n};
        while (s.len > 0 && strchr(" \t\r\n", s.ptr[s.len - 1]) != NULL) s.len--;
        while (s.len > 0 && (s.ptr[0] == ' ' || s.ptr[0] == '\t')) s.ptr++, s.len--;
        unsigned index;
        if (device_index(ex, s, &index)) marked[index] = true; /* other IDs: not ours */
    }
    free(line);
    bool failed = ferror(file) != 0;
    fclose(file);
    if (failed)
        return fail(ex->host, call, DEVHOST_ERR_UNAVAILABLE, "cannot read %s \"%s\"", option, path);
    return DEVHOST_OK;
}

/* Reports device `index`: identity, attributes, container edits and links. */
static devhost_status report_device(const example *ex, devhost_call *call, unsigned index,
                                    bool unhealthy) {
    const devhost_host_api *host = ex->host;
    char id[64], number[16], node[32], partner_id[64], host_node[MAX_DEV_DIR_LEN + 32];
    format_id(ex, index, id);
    snprintf(number, sizeof number, "%u", index);
    snprintf(node, sizeof node, "/dev/example%u", index);
    if (ex->dev_dir != NULL)
        snprintf(host_node, sizeof host_node, "%s/example%u", ex->dev_dir, index);
    else
        snprintf(host_node, sizeof host_node, "/dev/null");
    int32_t numa = ex->numa_nodes == 0 ? DEVHOST_NUMA_NONE : (int32_t)(index % ex->numa_nodes);

    devhost_status st = host->device_begin(
        call, str_of(id), unhealthy ? DEVHOST_HEALTH_UNHEALTHY : DEVHOST_HEALTH_HEALTHY, numa);
    if (st == DEVHOST_OK) st = host->device_attr(call, str_of("model"), str_of(ex->model));
    if (st == DEVHOST_OK) st = host->device_attr(call, str_of("index"), str_of(number));
    if (st == DEVHOST_OK) st = host->device_attr(call, str_of("vendor"), str_of("example.com"));
    /* What a container that gets this device sees: the host hands these out. */
    if (st == DEVHOST_OK)
        st = host->add_device_node(call, str_of(host_node), str_of(node), str_of("rw"));
    if (st == DEVHOST_OK) st = host->add_env(call, str_of("EXAMPLE_VISIBLE_DEVICES"), str_of(id));
    /* Devices 2k and 2k+1 are a pair (say, two chips on one board). */
    unsigned partner = index ^ 1u;
    if (st == DEVHOST_OK && partner < ex->count) {
        format_id(ex, partner, partner_id);
        st = host->device_link(call, str_of(partner_id), 10);
    }
    return st;
}

/* Comma-joins IDs into a new heap string; NULL when out of memory. */
static char *join_ids(const devhost_str *ids, size_t count) {
    size_t total = 1;
    for (size_t i = 0; i < count; i++) total += ids[i].len + 1;
    char *out = malloc(total), *end = out;
    if (out == NULL) return NULL;
    for (size_t i = 0; i < count; i++) {
        if (i > 0) *end++ = ',';
        if (ids[i].len > 0) memcpy(end, ids[i].ptr, ids[i].len);
        end += ids[i].len;
    }
    *end = '\0';
    return out;
}

/* ---- the health watch thread ----------------------------------------------- */

/*
 * The thread sleeps in poll(2) on two descriptors: the inotify one, which
 * watches the health file's folder (the folder, not the file, so that the
 * file may be created, replaced by a rename or removed at any time), and the
 * read end of a pipe that watch_stop writes to. No timer, no busy loop: an
 * idle driver costs no CPU, and a change is seen at once.
 */

/* Splits `path` into its folder and name; false when out of memory. */
static bool split_path(const char *path, char **dir, char **name) {
    const char *slash = strrchr(path, '/');
    /* "/tmp/health" -> "/tmp"; "/health" -> "/"; "health" -> "." */
    devhost_str d = str_of(".");
    if (slash != NULL) d = (devhost_str){path, slash == path ? 1 : (size_t)(slash - path)};
    *dir = str_dup(d);
    *name = str_dup(str_of(slash == NULL ? path : slash + 1));
    return *dir != NULL && *name != NULL;
}

/* Reads every queued inotify event; true when one concerns the health file
 * (or the kernel dropped events, so it might). Sets *lost when the watch is
 * gone (the folder was removed or unmounted). */
static bool drain_events(const example *ex, bool *lost) {
    _Alignas(struct inotify_event) char buf[4096];
    bool relevant = false;
    for (;;) {
        ssize_t n = read(ex->inotify_fd, buf, sizeof buf);
        if (n <= 0) return relevant; /* EAGAIN: drained (the descriptor is non-blocking) */
        for (char *at = buf; at < buf + n;) {
            const struct inotify_event *ev = (const struct inotify_event *)(void *)at;
            if (ev->mask & IN_Q_OVERFLOW) relevant = true;
            if (ev->mask & IN_IGNORED) { /* the folder went away: the watch with it */
                *lost = true;
                relevant = true;
            }
            if (ev->len > 0 && strcmp(ev->name, ex->health_name) == 0) relevant = true;
            at += sizeof *ev + ev->len;
        }
    }
}

static void *watch_main(void *arg) {
    example *ex = arg;
    bool watched = true;
    for (;;) {
        struct pollfd fds[2] = {{ex->stop_pipe[0], POLLIN, 0}, {ex->inotify_fd, POLLIN, 0}};
        int n = poll(fds, 2, watched ? -1 : REWATCH_MS);
        if (n < 0 && errno != EINTR) {
            log_msg(ex, DEVHOST_LOG_ERROR, "health watch: poll failed: %s; health_file \"%s\" is "
                    "only read on rescans now", strerror(errno), ex->health_file);
            return NULL;
        }
        if (fds[0].revents != 0) return NULL; /* watch_stop */
        bool lost = false;
        if (n > 0 && drain_events(ex, &lost))
            ex->host->devices_changed(ex->host->host_ctx); /* never blocks; the host rescans */
        if (lost) {
            watched = false;
            log_msg(ex, DEVHOST_LOG_WARN, "health watch: folder \"%s\" of health_file is gone; "
                    "watching again when it is back", ex->health_dir);
        }
        if (!watched && inotify_add_watch(ex->inotify_fd, ex->health_dir, WATCH_EVENTS) >= 0) {
            watched = true;
            log_msg(ex, DEVHOST_LOG_INFO, "health watch: watching \"%s\" again", ex->health_dir);
            ex->host->devices_changed(ex->host->host_ctx); /* it may have changed meanwhile */
        }
    }
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static void stop_watching(example *ex) {
    if (!ex->watching) return;
    ssize_t written;
    do written = write(ex->stop_pipe[1], "x", 1);
    while (written < 0 && errno == EINTR);
    pthread_join(ex->thread, NULL);
    close_fd(&ex->inotify_fd);
    close_fd(&ex->stop_pipe[0]);
    close_fd(&ex->stop_pipe[1]);
    ex->watching = false;
}

/* ---- the driver hooks -------------------------------------------------------- */

static devhost_status bad_option(const devhost_host_api *host, devhost_call *call, devhost_kv opt,
                                 const char *problem) {
    return fail(host, call, DEVHOST_ERR_INVALID_ARGUMENT, "option \"%.*s\": \"%.*s\" %s",
                SHOW(opt.key), SHOW(opt.value), problem);
}

static void example_destroy(void *instance) {
    example *ex = instance;
    stop_watching(ex); /* the host calls watch_stop first; destroy must join regardless */
    free(ex->health_dir);
    free(ex->health_name);
    free(ex->prefix);
    free(ex->model);
    free(ex->health_file);
    free(ex->release_file);
    free(ex->release_fail_file);
    free(ex->dev_dir);
    free(ex);
}

static devhost_status example_create(const devhost_host_api *host, const devhost_kv *options,
                                     size_t option_count, devhost_call *call, void **out_instance) {
    if (host->abi_major != DEVHOST_ABI_MAJOR || !HOST_HAS(host, set_error))
        return DEVHOST_ERR_UNSUPPORTED;
    if (!HOST_HAS(host, log) || !HOST_HAS(host, devices_changed) || !HOST_HAS(host, device_begin) ||
        !HOST_HAS(host, device_attr) || !HOST_HAS(host, device_link) ||
        !HOST_HAS(host, add_device_node) || !HOST_HAS(host, add_env) ||
        !HOST_HAS(host, add_annotation))
        return fail(host, call, DEVHOST_ERR_UNSUPPORTED, "the host API lacks a v1.0 callback");

    unsigned count = 2, numa_nodes = 1, release_delay_ms = 0;
    devhost_str prefix = str_of("example"), model = str_of("example-v1"), health_file = {NULL, 0};
    devhost_str release_file = {NULL, 0}, release_fail_file = {NULL, 0}, dev_dir = {NULL, 0};
    for (size_t i = 0; i < option_count; i++) {
        devhost_kv opt = options[i];
        if (str_is(opt.key, "count")) {
            if (!parse_uint(opt.value, MAX_COUNT, &count))
                return bad_option(host, call, opt, "is not a number between 0 and 1024");
        } else if (str_is(opt.key, "numa_nodes")) {
            if (!parse_uint(opt.value, MAX_NUMA_NODES, &numa_nodes))
                return bad_option(host, call, opt, "is not a number between 0 and 1024");
        } else if (str_is(opt.key, "prefix")) {
            bool ok = opt.value.len > 0 && opt.value.len <= MAX_PREFIX_LEN;
            for (size_t j = 0; ok && j < opt.value.len; j++) {
                char c = opt.value.ptr[j];
                ok = c > ' ' && c <= '~' && !(c == ':' && j > 0 && opt.value.ptr[j - 1] == ':');
            }
            if (!ok)
                return bad_option(host, call, opt,
                                  "is not 1 to 58 printable ASCII characters without spaces or \"::\"");
            prefix = opt.value;
        } else if (str_is(opt.key, "health_file")) {
            if (opt.value.len == 0 || memchr(opt.value.ptr, '\0', opt.value.len) != NULL)
                return bad_option(host, call, opt, "is not a file path");
            health_file = opt.value;
        } else if (str_is(opt.key, "model")) {
            model = opt.value;
        } else if (str_is(opt.key, "release_file") || str_is(opt.key, "release_fail_file")) {
            if (opt.value.len == 0 || memchr(opt.value.ptr, '\0', opt.value.len) != NULL)
                return bad_option(host, call, opt, "is not a file path");
            *(str_is(opt.key, "release_file") ? &release_file : &release_fail_file) = opt.value;
        } else if (str_is(opt.key, "release_delay_ms")) {
            if (!parse_uint(opt.value, MAX_RELEASE_DELAY_MS, &release_delay_ms))
                return bad_option(host, call, opt, "is not a number between 0 and 600000");
        } else if (str_is(opt.key, "dev_dir")) {
            if (opt.value.len == 0 || opt.value.len > MAX_DEV_DIR_LEN || opt.value.ptr[0] != '/' ||
                memchr(opt.value.ptr, '\0', opt.value.len) != NULL)
                return bad_option(host, call, opt, "is not an absolute folder path of at most 4000 bytes");
            dev_dir = opt.value;
        } else {
            return fail(host, call, DEVHOST_ERR_INVALID_ARGUMENT,
                        "unknown option \"%.*s\" (value \"%.*s\"); known options: count, prefix, "
                        "numa_nodes, health_file, model, release_file, release_fail_file, "
                        "release_delay_ms, dev_dir",
                        SHOW(opt.key), SHOW(opt.value));
        }
    }

    example *ex = calloc(1, sizeof *ex);
    if (ex == NULL) return fail(host, call, DEVHOST_ERR_INTERNAL, "out of memory");
    ex->host = host;
    ex->inotify_fd = ex->stop_pipe[0] = ex->stop_pipe[1] = -1;
    ex->count = count;
    ex->numa_nodes = numa_nodes;
    ex->prefix = str_dup(prefix);
    ex->model = str_dup(model);
    ex->health_file = health_file.len > 0 ? str_dup(health_file) : NULL;
    ex->release_file = release_file.len > 0 ? str_dup(release_file) : NULL;
    ex->release_fail_file = release_fail_file.len > 0 ? str_dup(release_fail_file) : NULL;
    ex->release_delay_ms = release_delay_ms;
    ex->dev_dir = dev_dir.len > 0 ? str_dup(dev_dir) : NULL;
    bool split = ex->health_file == NULL || split_path(ex->health_file, &ex->health_dir, &ex->health_name);
    if (ex->prefix == NULL || ex->model == NULL || (health_file.len > 0 && ex->health_file == NULL) || !split ||
        (release_file.len > 0 && ex->release_file == NULL) ||
        (release_fail_file.len > 0 && ex->release_fail_file == NULL) ||
        (dev_dir.len > 0 && ex->dev_dir == NULL)) {
        example_destroy(ex);
        return fail(host, call, DEVHOST_ERR_INTERNAL, "out of memory");
    }
    *out_instance = ex;
    return DEVHOST_OK;
}

static devhost_status example_scan(void *instance, devhost_call *call) {
    example *ex = instance;
    bool *unhealthy = calloc(ex->count + 1u, sizeof *unhealthy);
    if (unhealthy == NULL) return fail(ex->host, call, DEVHOST_ERR_INTERNAL, "out of memory");
    devhost_status st = read_id_file(ex, call, "health_file", ex->health_file, unhealthy);
    /* Emitter failures are not fatal: the host logs and drops what it
     * refuses, so report the remaining devices anyway. */
    for (unsigned i = 0; st == DEVHOST_OK && i < ex->count; i++)
        (void)report_device(ex, call, i, unhealthy[i]);
    free(unhealthy);
    return st;
}

/* ---- claim parameters (ABI 1.3) -------------------------------------------------- */

/* Longest greeting a claim may ask for. */
#define MAX_GREETING 64

/* Reads one JSON string at *p without escapes: printable ASCII other than '"'
 * and '\'. Enough here, as the host hands the parameters compact. */
static bool scan_string(const char **p, const char *end, const char **text, size_t *len) {
    const char *s = *p;
    if (s == end || *s++ != '"') return false;
    *text = s;
    while (s < end && *s != '"') {
        if (*s < 0x20 || *s > 0x7e || *s == '\\') return false;
        s++;
    }
    if (s == end) return false;
    *len = (size_t)(s - *text);
    *p = s + 1;
    return true;
}

/* The greeting of a DRA claim's parameters: a JSON array of objects whose
 * only key is "greeting", a string of 1 to MAX_GREETING characters; the last
 * entry that sets it wins. *found stays false for a device-plugin container,
 * a host older than 1.3 and a claim without one. A real driver would use a
 * JSON library; this scanner takes what the example needs and refuses the
 * rest with a message, which fails the claim's NodePrepareResources. */
static devhost_status claim_greeting(example *ex, devhost_call *call, char out[MAX_GREETING + 1],
                                     bool *found) {
    *found = false;
    if (!HOST_HAS(ex->host, claim_parameters)) return DEVHOST_OK;
    devhost_str json = {NULL, 0};
    devhost_status st = ex->host->claim_parameters(call, &json);
    if (st == DEVHOST_ERR_NOT_FOUND) return DEVHOST_OK; /* a device-plugin container */
    if (st != DEVHOST_OK) return fail(ex->host, call, st, "the host gave no claim parameters");
    const char *p = json.ptr, *end = json.ptr + json.len, *text;
    size_t len;
    if (p == end || *p++ != '[') goto bad;
    if (p < end && *p == ']') {
        p++;
        goto done;
    }
    for (;;) {
        if (p == end || *p++ != '{') goto bad;
        while (p < end && *p != '}') {
            if (!scan_string(&p, end, &text, &len) || p == end || *p++ != ':') goto bad;
            if (len != 8 || memcmp(text, "greeting", 8) != 0)
                return fail(ex->host, call, DEVHOST_ERR_INVALID_ARGUMENT,
                            "unknown parameter \"%.*s\"; example-c takes only \"greeting\"",
                            (int)(len > 64 ? 64 : len), text);
            if (!scan_string(&p, end, &text, &len) || len < 1 || len > MAX_GREETING)
                return fail(ex->host, call, DEVHOST_ERR_INVALID_ARGUMENT,
                            "parameter greeting must be a string of 1 to %d printable ASCII "
                            "characters without quotes or backslashes", MAX_GREETING);
            memcpy(out, text, len);
            out[len] = '\0';
            *found = true;
            if (p < end && *p == ',') p++;
        }
        if (p == end) goto bad;
        p++; /* '}' */
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        if (p < end && *p == ']') {
            p++;
            break;
        }
        goto bad;
    }
done:
    if (p == end) return DEVHOST_OK;
bad:
    return fail(ex->host, call, DEVHOST_ERR_INVALID_ARGUMENT,
                "claim parameters are not a list of objects of strings: %.*s", SHOW(json));
}

/* The host already hands out each device's scan edits; add what is per-request. */
static devhost_status example_allocate(void *instance, const devhost_str *ids, size_t count,
                                       devhost_call *call) {
    example *ex = instance;
    char greeting[MAX_GREETING + 1];
    bool greeted;
    /* Validate first: a refused claim gets no edits. */
    devhost_status checked = claim_greeting(ex, call, greeting, &greeted);
    if (checked != DEVHOST_OK) return checked;
    for (size_t i = 0; i < count; i++) {
        unsigned index;
        if (!device_index(ex, ids[i], &index))
            return fail(ex->host, call, DEVHOST_ERR_NOT_FOUND, "unknown device \"%.*s\"",
                        SHOW(ids[i]));
    }
    char *joined = join_ids(ids, count), number[24];
    if (joined == NULL) return fail(ex->host, call, DEVHOST_ERR_INTERNAL, "out of memory");
    snprintf(number, sizeof number, "%zu", count);
    devhost_status st = ex->host->add_env(call, str_of("EXAMPLE_ALLOCATED"), str_of(joined));
    if (st == DEVHOST_OK)
        st = ex->host->add_annotation(call, str_of("example.com/allocated-count"), str_of(number));
    if (st == DEVHOST_OK && greeted)
        st = ex->host->add_env(call, str_of("EXAMPLE_GREETING"), str_of(greeting));
    free(joined);
    return st;
}

static devhost_status example_pre_start(void *instance, const devhost_str *ids, size_t count,
                                        devhost_call *call) {
    example *ex = instance;
    char *joined = join_ids(ids, count);
    if (joined == NULL) return fail(ex->host, call, DEVHOST_ERR_INTERNAL, "out of memory");
    log_msg(ex, DEVHOST_LOG_INFO, "pre_start: devices %s are ready", joined);
    free(joined);
    return DEVHOST_OK;
}

/*
 * ABI 1.1: the devices one container held are free again. A real driver
 * resets or scrubs them here (it may block, within the call deadline); the
 * host reports them Unhealthy until this returns OK, and retries a failure.
 * The example "resets" by sleeping `release_delay_ms`, fails for the
 * devices `release_fail_file` names, and records the call in `release_file`.
 */
static devhost_status example_release(void *instance, const devhost_str *ids, size_t count,
                                      devhost_call *call) {
    example *ex = instance;
    if (ex->release_delay_ms > 0) { /* the "reset" */
        struct timespec delay = {(time_t)(ex->release_delay_ms / 1000u),
                                 (long)(ex->release_delay_ms % 1000u) * 1000000L};
        while (nanosleep(&delay, &delay) != 0 && errno == EINTR) {
        }
    }
    bool *failing = calloc(ex->count + 1u, sizeof *failing);
    if (failing == NULL) return fail(ex->host, call, DEVHOST_ERR_INTERNAL, "out of memory");
    devhost_status st =
        read_id_file(ex, call, "release_fail_file", ex->release_fail_file, failing);
    for (size_t i = 0; st == DEVHOST_OK && i < count; i++) {
        unsigned index;
        if (!device_index(ex, ids[i], &index)) /* NOT_FOUND: the host stops retrying */
            st = fail(ex->host, call, DEVHOST_ERR_NOT_FOUND, "unknown device \"%.*s\"",
                      SHOW(ids[i]));
        else if (failing[index])
            st = fail(ex->host, call, DEVHOST_ERR_UNAVAILABLE,
                      "device \"%.*s\" did not come back from its reset", SHOW(ids[i]));
    }
    free(failing);
    if (st != DEVHOST_OK) return st;
    if (ex->release_file == NULL) return DEVHOST_OK;
    char *joined = join_ids(ids, count);
    if (joined == NULL) return fail(ex->host, call, DEVHOST_ERR_INTERNAL, "out of memory");
    FILE *file = fopen(ex->release_file, "a");
    if (file == NULL) {
        free(joined);
        return fail(ex->host, call, DEVHOST_ERR_UNAVAILABLE, "cannot open release_file \"%s\": %s",
                    ex->release_file, strerror(errno));
    }
    bool written = fprintf(file, "released %s\n", joined) > 0;
    written = fclose(file) == 0 && written;
    free(joined);
    if (!written)
        return fail(ex->host, call, DEVHOST_ERR_UNAVAILABLE, "cannot write release_file \"%s\"",
                    ex->release_file);
    return DEVHOST_OK;
}

/* Watches before it returns, so no change after the host's first scan is
 * missed. On failure the host logs the message and rescans every poll_interval. */
static devhost_status example_watch_start(void *instance, devhost_call *call) {
    example *ex = instance;
    if (ex->health_file == NULL || ex->watching) return DEVHOST_OK; /* nothing to watch */
    const char *step = "inotify_init1";
    int err = 0;
    ex->inotify_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (ex->inotify_fd < 0) err = errno;
    if (err == 0) {
        step = "inotify_add_watch"; /* the folder: the file may not exist yet, or be replaced */
        if (inotify_add_watch(ex->inotify_fd, ex->health_dir, WATCH_EVENTS) < 0) err = errno;
    }
    if (err == 0) {
        step = "pipe";
        if (pipe(ex->stop_pipe) != 0) {
            err = errno;
            ex->stop_pipe[0] = ex->stop_pipe[1] = -1;
        }
    }
    if (err == 0) {
        (void)fcntl(ex->stop_pipe[0], F_SETFD, FD_CLOEXEC);
        (void)fcntl(ex->stop_pipe[1], F_SETFD, FD_CLOEXEC);
        step = "pthread_create";
        err = pthread_create(&ex->thread, NULL, watch_main, ex);
    }
    if (err != 0) {
        close_fd(&ex->inotify_fd);
        close_fd(&ex->stop_pipe[0]);
        close_fd(&ex->stop_pipe[1]);
        return fail(ex->host, call, DEVHOST_ERR_UNAVAILABLE,
                    "cannot watch health_file \"%s\" (folder \"%s\"): %s: %s", ex->health_file,
                    ex->health_dir, step, strerror(err));
    }
    ex->watching = true;
    return DEVHOST_OK;
}

static void example_watch_stop(void *instance) { stop_watching(instance); }

/* ---- the entry point ----------------------------------------------------------- */

static const devhost_driver_desc DESCRIPTOR = {
    .magic = DEVHOST_DRIVER_MAGIC,
    .struct_size = sizeof(devhost_driver_desc),
    .abi_major = DEVHOST_ABI_MAJOR,
    .abi_minor = DEVHOST_ABI_MINOR,
    .reserved0 = 0,
    /* Calls are serialised (no DEVHOST_CAP_CONCURRENT); allocate reads a DRA
     * claim's parameters (ABI 1.3; a 1.2 host ignores the bit). */
    .capabilities = DEVHOST_CAP_CLAIM_PARAMETERS,
    .name = "example-c",
    .version = "0.1.0",
    .description = "Fake devices for trying devhost; the template for C drivers",
    .create = example_create,
    .destroy = example_destroy,
    .scan = example_scan,
    .allocate = example_allocate,
    .preferred_allocation = NULL, /* the host's default: NUMA, then links */
    .pre_start = example_pre_start,
    .watch_start = example_watch_start,
    .watch_stop = example_watch_stop,
    .release = example_release, /* ABI 1.1; a 1.0 host ignores it */
};

/* The only exported symbol. Everything above is static. */
DEVHOST_EXPORT const devhost_driver_desc *devhost_driver_entry_v1(void) { return &DESCRIPTOR; }
