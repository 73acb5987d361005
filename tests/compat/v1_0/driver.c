/*
 * driver.c — a driver built against ABI v1.0, frozen.
 *
 * It is compiled against the copy of the v1.0 header next to it, never the
 * current one, so the host's tests prove that a module built for v1.0 keeps
 * loading and working as the ABI grows. Do not edit (see ../README.md).
 *
 * Name "compat-v1.0"; devices compat-0..compat-2, healthy, no NUMA affinity,
 * attribute abi=1.0, env COMPAT_DEVICE=<id> per device; allocate adds
 * COMPAT_ALLOCATED=<number of devices>. Options are ignored.
 */
#include "devhost_driver.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEVICE_COUNT 3

typedef struct compat {
    const devhost_host_api *host;
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
    compat *instance = malloc(sizeof *instance);
    if (instance == NULL) {
        host->set_error(call, str_of("out of memory"));
        return DEVHOST_ERR_INTERNAL;
    }
    instance->host = host;
    *out_instance = instance;
    return DEVHOST_OK;
}

static void compat_destroy(void *instance) { free(instance); }

static devhost_status compat_scan(void *instance, devhost_call *call) {
    const devhost_host_api *host = ((compat *)instance)->host;
    for (int i = 0; i < DEVICE_COUNT; i++) {
        char id[16];
        snprintf(id, sizeof id, "compat-%d", i);
        devhost_status st = host->device_begin(call, str_of(id), DEVHOST_HEALTH_HEALTHY,
                                               DEVHOST_NUMA_NONE);
        if (st == DEVHOST_OK) st = host->device_attr(call, str_of("abi"), str_of("1.0"));
        if (st == DEVHOST_OK) st = host->add_env(call, str_of("COMPAT_DEVICE"), str_of(id));
        if (st != DEVHOST_OK) return st;
    }
    return DEVHOST_OK;
}

static devhost_status compat_allocate(void *instance, const devhost_str *device_ids, size_t count,
                                      devhost_call *call) {
    const devhost_host_api *host = ((compat *)instance)->host;
    char number[24];
    (void)device_ids;
    snprintf(number, sizeof number, "%zu", count);
    return host->add_env(call, str_of("COMPAT_ALLOCATED"), str_of(number));
}

static const devhost_driver_desc DESCRIPTOR = {
    .magic = DEVHOST_DRIVER_MAGIC,
    .struct_size = sizeof(devhost_driver_desc),
    .abi_major = DEVHOST_ABI_MAJOR,
    .abi_minor = DEVHOST_ABI_MINOR,
    .reserved0 = 0,
    .capabilities = 0,
    .name = "compat-v1.0",
    .version = "1.0.0",
    .description = "A driver frozen at ABI v1.0, for compatibility tests",
    .create = compat_create,
    .destroy = compat_destroy,
    .scan = compat_scan,
    .allocate = compat_allocate,
    .preferred_allocation = NULL,
    .pre_start = NULL,
    .watch_start = NULL,
    .watch_stop = NULL,
};

DEVHOST_EXPORT const devhost_driver_desc *devhost_driver_entry_v1(void) { return &DESCRIPTOR; }
