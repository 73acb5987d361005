/*
 * driver.c — a driver built against ABI v1.2, frozen.
 *
 * It is compiled against the copy of the v1.2 header next to it, never the
 * current one, so the host's tests prove that a module built for v1.2 keeps
 * loading and working as the ABI grows. Do not edit (see ../README.md).
 *
 * Name "compat-v1.2"; devices compat-0..compat-2, no NUMA affinity,
 * attribute abi=1.2. compat-1 is Unhealthy with the reason "thermal trip"
 * given through `device_health_reason` (the host callback 1.2 added), which
 * the driver calls only when the host's table has it. Options are ignored.
 */
#include "devhost_driver.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEVICE_COUNT 3

#define HOST_HAS(host, field) \
    ((host)->struct_size >= offsetof(devhost_host_api, field) + sizeof((host)->field) && \
     (host)->field != NULL)

typedef struct compat {
    const devhost_host_api *host;
    int has_reasons;
} compat;

static devhost_str str_of(const char *s) {
    devhost_str out = {s, strlen(s)};
    return out;
}

static devhost_status compat_create(const devhost_host_api *host, const devhost_kv *options,
                                    size_t option_count, devhost_call *call, void **out_instance) {
    (void)options;
    (void)option_count;
    if (host->abi_major != DEVHOST_ABI_MAJOR ||
        host->struct_size < offsetof(devhost_host_api, prefer_device) + sizeof(host->prefer_device))
        return DEVHOST_ERR_UNSUPPORTED;
    compat *instance = calloc(1, sizeof *instance);
    if (instance == NULL) {
        host->set_error(call, str_of("out of memory"));
        return DEVHOST_ERR_INTERNAL;
    }
    instance->host = host;
    /* Optional: an older host has no reasons, and the device is Unhealthy all the same. */
    instance->has_reasons = HOST_HAS(host, device_health_reason);
    *out_instance = instance;
    return DEVHOST_OK;
}

static void compat_destroy(void *instance) { free(instance); }

static devhost_status compat_scan(void *instance, devhost_call *call) {
    compat *c = instance;
    for (int i = 0; i < DEVICE_COUNT; i++) {
        char id[16];
        snprintf(id, sizeof id, "compat-%d", i);
        devhost_health health = i == 1 ? DEVHOST_HEALTH_UNHEALTHY : DEVHOST_HEALTH_HEALTHY;
        devhost_status st = c->host->device_begin(call, str_of(id), health, DEVHOST_NUMA_NONE);
        if (st == DEVHOST_OK) st = c->host->device_attr(call, str_of("abi"), str_of("1.2"));
        if (st == DEVHOST_OK && i == 1 && c->has_reasons)
            st = c->host->device_health_reason(call, str_of("thermal trip"));
        if (st != DEVHOST_OK) return st;
    }
    return DEVHOST_OK;
}

static const devhost_driver_desc DESCRIPTOR = {
    .magic = DEVHOST_DRIVER_MAGIC,
    .struct_size = sizeof(devhost_driver_desc),
    .abi_major = DEVHOST_ABI_MAJOR,
    .abi_minor = DEVHOST_ABI_MINOR,
    .reserved0 = 0,
    .capabilities = 0,
    .name = "compat-v1.2",
    .version = "1.2.0",
    .description = "A driver frozen at ABI v1.2, for compatibility tests",
    .create = compat_create,
    .destroy = compat_destroy,
    .scan = compat_scan,
    .allocate = NULL,
    .preferred_allocation = NULL,
    .pre_start = NULL,
    .watch_start = NULL,
    .watch_stop = NULL,
    .release = NULL,
};

DEVHOST_EXPORT const devhost_driver_desc *devhost_driver_entry_v1(void) { return &DESCRIPTOR; }
