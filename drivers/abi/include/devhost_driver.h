/*
 * devhost_driver.h — the devhost driver ABI, version 1.3.
 *
 * This header is the contract between the devhost host daemon and a driver
 * module (a shared object the host loads with dlopen). It is the single source
 * of truth: the Rust mirror in drivers/abi/src/lib.rs is checked against it by
 * a layout test that compiles this header.
 *
 * A module exports exactly one symbol, `devhost_driver_entry_v1`, returning a
 * pointer to a static `devhost_driver_desc`. Everything else goes through the
 * function pointers in that descriptor and the host API handed to `create`.
 *
 * Rules that hold for every call (see docs/driver-abi.md for the long form):
 *
 *  - Memory: the host owns all memory. A driver never returns heap data and
 *    never frees anything it got from the host. Strings are `devhost_str`
 *    (pointer + length, UTF-8, not NUL-terminated) borrowed for the duration
 *    of the call or callback that carries them; copy what you keep.
 *    The only NUL-terminated strings are the descriptor's static `name`,
 *    `version` and `description`.
 *  - Output: a driver reports results by calling the host's callbacks with the
 *    `devhost_call *` it was handed (emit a device, add an edit, propose an
 *    ID, set the error message). The call handle is valid only until the
 *    driver function that received it returns.
 *  - Status: every driver function returns a `devhost_status`. Anything other
 *    than DEVHOST_OK is a failure; attach a human-readable message with
 *    `host->set_error(call, msg)`. Unknown status values are treated as
 *    DEVHOST_ERR_INTERNAL.
 *  - Unwinding: nothing may unwind across this boundary (no C++ exceptions, no
 *    Rust panics). The Rust SDK catches panics and returns DEVHOST_ERR_PANIC.
 *  - Threading: this table is the whole contract (docs/driver-abi.md §11 has
 *    the same table with the reasons). "Host thread" is a thread the host
 *    owns for the instance, never an async runtime thread.
 *
 *    call                       thread        overlaps with      when
 *    create                     host thread   nothing            first
 *    watch_start                host thread   nothing            once, after create, before
 *                                                                any other call (daemon, sim)
 *    scan, allocate,            host thread   each other only    after create and watch_start
 *    preferred_allocation,                    with DEVHOST_CAP_
 *    pre_start, release                       CONCURRENT
 *    watch_stop                 host thread   nothing            once, before destroy, also
 *                                                                when watch_start never ran
 *    destroy                    host thread   nothing            last, exactly once
 *    host->log                  any thread    anything           from the start of create
 *                                                                until destroy returns
 *    host->devices_changed      any thread    anything           from create returning OK
 *                                                                until destroy returns
 *    set_error, device_*,       the thread    -                  until the call that got the
 *    add_*, prefer_device       of the call                      devhost_call * returns
 *    (device_* includes device_health_reason, 1.2)
 *    claim_parameters           the thread    -                  during allocate (1.3)
 *                               of the call
 *
 *    Without DEVHOST_CAP_CONCURRENT the host makes at most one call at a
 *    time into an instance. log and devices_changed are cheap, never block
 *    and never call back into the driver.
 *  - Emitter failures are not fatal: when a callback refuses something (an
 *    invalid device ID, a bad path), the host has already logged it and
 *    dropped that item; the driver should carry on with the rest of the
 *    call. The status a callback returns is for the driver's own checks.
 *  - Evolution: structs are append-only and start with a size field; each
 *    side reads only the fields that lie within the size the other side
 *    declared. Additions bump DEVHOST_ABI_MINOR; a major bump means a new
 *    entry symbol (`devhost_driver_entry_v2`). The host never unloads a module.
 *    1.1 appended `release` to the descriptor; a 1.0 module simply has none.
 *    1.2 appended `device_health_reason` to the host API; a driver checks
 *    host->struct_size before calling it (a 1.0 or 1.1 host has none).
 *    1.3 appended `claim_parameters` to the host API (same check: a 1.0 to
 *    1.2 host has none): the DRA claim's parameters for the driver, read
 *    from inside allocate.
 */
#ifndef DEVHOST_DRIVER_H
#define DEVHOST_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ABI version this header describes. */
#define DEVHOST_ABI_MAJOR 1u
#define DEVHOST_ABI_MINOR 3u

/* First field of the descriptor: the bytes "DVHD" read as a little-endian u32. */
#define DEVHOST_DRIVER_MAGIC 0x44485644u

/* Marks the entry symbol as exported even under -fvisibility=hidden. */
#if defined(__GNUC__) || defined(__clang__)
#define DEVHOST_EXPORT __attribute__((visibility("default")))
#else
#define DEVHOST_EXPORT
#endif

/* Name of the entry symbol for this major version. */
#define DEVHOST_ENTRY_SYMBOL_V1 "devhost_driver_entry_v1"

/* ---- status codes ------------------------------------------------------ */

typedef uint32_t devhost_status;

#define DEVHOST_OK 0u
/* The request is malformed or names something the driver does not know. */
#define DEVHOST_ERR_INVALID_ARGUMENT 1u
/* A named device does not exist (any more). */
#define DEVHOST_ERR_NOT_FOUND 2u
/* The hardware or a library the driver needs is unavailable right now; retry. */
#define DEVHOST_ERR_UNAVAILABLE 3u
/* The driver gave up waiting on something. */
#define DEVHOST_ERR_TIMEOUT 4u
/* A bug or unexpected state inside the driver. */
#define DEVHOST_ERR_INTERNAL 5u
/* The driver panicked (set by the Rust SDK; the instance is then poisoned). */
#define DEVHOST_ERR_PANIC 6u
/* The operation is not supported by this driver or device. */
#define DEVHOST_ERR_UNSUPPORTED 7u
/* Not enough devices or capacity to satisfy the request. */
#define DEVHOST_ERR_RESOURCE_EXHAUSTED 8u
/* The request is valid but the device is not in a state that allows it. */
#define DEVHOST_ERR_FAILED_PRECONDITION 9u

/* ---- enumerations (fixed-width integers, never C enums) ------------------ */

typedef uint32_t devhost_health;
#define DEVHOST_HEALTH_HEALTHY 1u
#define DEVHOST_HEALTH_UNHEALTHY 2u
/* Any other value is read as unhealthy. */

typedef uint32_t devhost_log_level;
#define DEVHOST_LOG_ERROR 1u
#define DEVHOST_LOG_WARN 2u
#define DEVHOST_LOG_INFO 3u
#define DEVHOST_LOG_DEBUG 4u
#define DEVHOST_LOG_TRACE 5u

/* NUMA node value meaning "no NUMA affinity". */
#define DEVHOST_NUMA_NONE (-1)

/* Capability bits in devhost_driver_desc.capabilities. Unknown bits are ignored. */
typedef uint64_t devhost_caps;
/* The instance is thread-safe: scan, allocate, preferred_allocation,
 * pre_start and release may be called concurrently from several host
 * threads (the threading table at the top of this file). */
#define DEVHOST_CAP_CONCURRENT (1ull << 0)
/* allocate reads a DRA claim's parameters through host->claim_parameters
 * (1.3). Without it the host refuses a claim that carries opaque parameters
 * for the driver, instead of preparing it as if they were not there. */
#define DEVHOST_CAP_CLAIM_PARAMETERS (1ull << 1)
/* allocate is called only for DRA claims, never for a device-plugin
 * container (1.3): for a driver whose allocate has nothing to add without a
 * claim's parameters, this saves the call on every container start. A host
 * older than 1.3 ignores the bit and calls allocate for both. */
#define DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY (1ull << 2)

/* ---- shared types -------------------------------------------------------- */

/* A borrowed UTF-8 string: `len` bytes at `ptr`, no NUL terminator required.
 * `ptr` may be NULL only when `len` is 0. */
typedef struct devhost_str {
    const char *ptr;
    size_t len;
} devhost_str;

/* One driver option: a flattened key (nested TOML tables joined with '.')
 * and its value rendered as text (strings verbatim, numbers and booleans as
 * written in TOML, arrays of scalars joined with ','). */
typedef struct devhost_kv {
    devhost_str key;
    devhost_str value;
} devhost_kv;

/* Opaque handle for one driver call; results are reported through it. */
typedef struct devhost_call devhost_call;

/* ---- the host API (host → driver), valid from create until destroy ------ */

typedef struct devhost_host_api {
    /* sizeof(devhost_host_api) as the host knows it. A driver checks that a
     * callback lies within struct_size before using one added in a later minor. */
    uint32_t struct_size;
    uint16_t abi_major;
    uint16_t abi_minor;
    /* Pass to log and devices_changed. Identifies this driver instance. */
    void *host_ctx;

    /* Log a message through the host's logger. Any thread, from the start
     * of create until destroy returns. */
    void (*log)(void *host_ctx, devhost_log_level level, devhost_str message);
    /* Tell the host that devices or their health may have changed. The host
     * re-runs scan soon after on its own thread; bursts are coalesced. Safe
     * from any thread, never blocks, never calls back into the driver. */
    void (*devices_changed)(void *host_ctx);

    /* Attach a message to the status the current call returns. The last one wins. */
    void (*set_error)(devhost_call *call, devhost_str message);

    /* scan: start a new device; the edit, attribute and link callbacks that
     * follow apply to it until the next device_begin.
     * id: 1 to 63 bytes of printable ASCII without spaces, unique within the
     * instance; "::" is reserved (the host uses it for shared replicas);
     * numa_node: DEVHOST_NUMA_NONE or >= 0.
     * A rejected device returns DEVHOST_ERR_INVALID_ARGUMENT here and from
     * the callbacks that describe it, until the next device_begin.
     */
    devhost_status (*device_begin)(devhost_call *call, devhost_str id,
                                   devhost_health health, int32_t numa_node);
    /* scan: an attribute of the current device (model, pci_address, ...),
     * used by the manifest's `match` globs and shown to operators. */
    devhost_status (*device_attr)(devhost_call *call, devhost_str key, devhost_str value);
    /* scan: how well the current device is connected to another device of this
     * instance (higher = better, e.g. number of NVLinks). Used by the host's
     * preferred allocation. */
    devhost_status (*device_link)(devhost_call *call, devhost_str other_id, uint32_t score);

    /* Container edits. In scan they belong to the current device and are what
     * the host hands out when that device is allocated; in allocate they are
     * added to (and override) the container response the host composed. */
    /* A device node; permissions is a subset of "rwm" (empty means "rw"). */
    devhost_status (*add_device_node)(devhost_call *call, devhost_str host_path,
                                      devhost_str container_path, devhost_str permissions);
    /* read_only: 0 = read-write, any other value = read-only. */
    devhost_status (*add_mount)(devhost_call *call, devhost_str host_path,
                                devhost_str container_path, uint32_t read_only);
    devhost_status (*add_env)(devhost_call *call, devhost_str key, devhost_str value);
    devhost_status (*add_annotation)(devhost_call *call, devhost_str key, devhost_str value);
    /* A fully-qualified CDI device name, "vendor.com/class=name". */
    devhost_status (*add_cdi_device)(devhost_call *call, devhost_str name);

    /* preferred_allocation: propose one device ID, in order of preference. */
    devhost_status (*prefer_device)(devhost_call *call, devhost_str id);

    /* ---- added in 1.2: check struct_size before use ---- */

    /* scan: why the current device has the health device_begin gave it,
     * e.g. "critical Xid 79" or "GPU lost" for an Unhealthy device. Short
     * text for operators (the host keeps at most 256 bytes, cut at a
     * character boundary); empty means no reason. The host logs it with the
     * device's next health change and shows it in `devhost list`, /status
     * and the health history. Calling it again for the same device replaces
     * the reason. */
    devhost_status (*device_health_reason)(devhost_call *call, devhost_str reason);

    /* ---- added in 1.3: check struct_size before use ---- */

    /* allocate: the vendor parameters of the DRA claim being prepared, for
     * this driver. Sets *out to a JSON array (compact UTF-8, object keys
     * sorted) of the `parameters` objects of every opaque config entry that
     * names this driver's DRA driver name and applies to the claim's
     * requests, in precedence order: the DeviceClass's entries first, then
     * the claim's, each in its listed order; a later entry overrides an
     * earlier one where they disagree. `[]` when the claim has none.
     * The text is host memory, valid until allocate returns; copy what you
     * keep. Returns DEVHOST_OK then, DEVHOST_ERR_NOT_FOUND (and *out empty)
     * when this allocate is for a device-plugin container (no claim), and
     * DEVHOST_ERR_FAILED_PRECONDITION outside allocate. A driver that finds
     * the parameters invalid refuses the allocate with
     * DEVHOST_ERR_INVALID_ARGUMENT and a message from set_error: the claim's
     * NodePrepareResources fails with that message. */
    devhost_status (*claim_parameters)(devhost_call *call, devhost_str *out);
} devhost_host_api;

/* ---- the driver descriptor (driver → host), static and read-only -------- */

typedef struct devhost_driver_desc {
    uint32_t magic;       /* DEVHOST_DRIVER_MAGIC */
    uint32_t struct_size; /* sizeof(devhost_driver_desc) as the driver knows it */
    uint16_t abi_major;   /* DEVHOST_ABI_MAJOR the driver was built against */
    uint16_t abi_minor;   /* DEVHOST_ABI_MINOR the driver was built against */
    uint32_t reserved0;   /* 0 */
    devhost_caps capabilities;
    const char *name;        /* static, NUL-terminated, e.g. "example-c" */
    const char *version;     /* static, NUL-terminated semver of the driver */
    const char *description; /* static, NUL-terminated, may be NULL */

    /* Required. Build an instance from the options (the key/value array is
     * borrowed for the call). On success store the instance in *out_instance.
     * `host` stays valid until destroy returns. */
    devhost_status (*create)(const devhost_host_api *host, const devhost_kv *options,
                             size_t option_count, devhost_call *call, void **out_instance);
    /* Required. Release the instance; join every thread the driver started.
     * No callback may be made after it returns. */
    void (*destroy)(void *instance);
    /* Required. Report every device with device_begin and the device
     * callbacks. On failure the host keeps the previous list but reports
     * every device Unhealthy until a scan succeeds again. */
    devhost_status (*scan)(void *instance, devhost_call *call);

    /* Optional (NULL = host default). Given the IDs allocated to one container,
     * add or override edits, or refuse with a status. */
    devhost_status (*allocate)(void *instance, const devhost_str *device_ids, size_t count,
                               devhost_call *call);
    /* Optional. Propose `size` IDs from `available` that contain every ID in
     * `must_include`, with prefer_device. The host validates and repairs it. */
    devhost_status (*preferred_allocation)(void *instance, const devhost_str *available,
                                           size_t available_count,
                                           const devhost_str *must_include,
                                           size_t must_include_count, uint32_t size,
                                           devhost_call *call);
    /* Optional. Called before a container that got these devices starts. */
    devhost_status (*pre_start)(void *instance, const devhost_str *device_ids, size_t count,
                                devhost_call *call);
    /* Optional. Start the driver's own event threads (which then call
     * devices_changed). Called once after create, before any other call
     * (scan included); not called by `devhost list` and `check`. On failure the host logs the message and relies on its
     * own rescans (the manifest's poll_interval). */
    devhost_status (*watch_start)(void *instance, devhost_call *call);
    /* Optional. Stop those threads; called before destroy. */
    void (*watch_stop)(void *instance);

    /* ---- added in 1.1 ---- */

    /* Optional. The devices a container held are held by no container any
     * more (its pod is gone): reset or scrub them before the next tenant.
     * Called once per batch (the IDs one container let go of), on a host
     * thread, never on an async runtime, with the instance's call deadline;
     * it may block for the reset but must return before the deadline.
     * While it runs the host reports these devices Unhealthy, so the kubelet
     * does not hand them out half-clean. OK makes them Healthy again (as far
     * as scan says so). Any other status, with a message from set_error,
     * keeps them Unhealthy with that message; the host retries the whole
     * batch with growing pauses until it succeeds. DEVHOST_ERR_NOT_FOUND
     * means the devices are gone and ends the retries. It must be safe to
     * call again for a device already clean (a retry after a missed
     * deadline repeats it). Only called when the host can see which pods
     * hold devices (the kubelet's pod-resources socket). */
    devhost_status (*release)(void *instance, const devhost_str *device_ids, size_t count,
                              devhost_call *call);
} devhost_driver_desc;

/* The entry point every module exports. It returns a pointer to a static
 * descriptor, allocates nothing, has no side effects, and may be called
 * more than once. */
typedef const devhost_driver_desc *(*devhost_driver_entry_v1_fn)(void);

/* Module authors define it in exactly one translation unit. */
DEVHOST_EXPORT const devhost_driver_desc *devhost_driver_entry_v1(void);

#ifdef __cplusplus
}
#endif

#endif /* DEVHOST_DRIVER_H */
