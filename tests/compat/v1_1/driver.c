/*
 * driver.c — a driver built against ABI v1.1, frozen.
 *
 * It is compiled against the copy of the v1.1 header next to it, never the
 * current one, so the host's tests prove that a module built for v1.1 keeps
 * loading and working as the ABI grows. Do not edit (see ../README.md).
 *
 * Name "compat-v1.1"; devices compat-0..compat-2, healthy, no NUMA affinity,
 * attribute abi=1.1 and attribute released=<n>, the number of times the
 * device went through `release` (the hook 1.1 added). Releasing an ID it
 * does not know is DEVHOST_ERR_NOT_FOUND. Options are ignored.
 */
#include "devhost_driver.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEVICE_COUNT 3

typedef struct compat {
    const devhost_host_api *host;
    /* Calls never overlap (no DEVHOST_CAP_CONCURRENT), so no lock. */
    unsigned released[DEVICE_COUNT];
} compat;

static devhost_str str_of(const char *s) {
    devhost_str out = {s, strlen(s)};
    return out;
}

/* "compat-<i>" to i, or -1. */
static int device_index(devhost_str id) {
    for (int i = 0; i < DEVICE_COUNT; i++) {
        char name[16];
        snprintf(name, sizeof name, "compat-%d", i);
        if (id.len == strlen(name) && memcmp(id.ptr, name, id.len) == 0) return i;
    }
    return -1;
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
    *out_instance = instance;
    return DEVHOST_OK;
}

static void compat_destroy(void *instance) { free(instance); }

static devhost_status compat_scan(void *instance, devhost_call *call) {
    compat *c = instance;
    for (int i = 0; i < DEVICE_COUNT; i++) {
        char id[16], count[16];
        snprintf(id, sizeof id, "compat-%d", i);
        snprintf(count, sizeof count, "%u", c->released[i]);
        devhost_status st = c->host->device_begin(call, str_of(id), DEVHOST_HEALTH_HEALTHY,
                                                  DEVHOST_NUMA_NONE);
        if (st == DEVHOST_OK) st = c->host->device_attr(call, str_of("abi"), str_of("1.1"));
        if (st == DEVHOST_OK) st = c->host->device_attr(call, str_of("released"), str_of(count));
        if (st != DEVHOST_OK) return st;
    }
    return DEVHOST_OK;
}

static devhost_status compat_release(void *instance, const devhost_str *device_ids, size_t count,
                                     devhost_call *call) {
    compat *c = instance;
    for (size_t i = 0; i < count; i++) {
        if (device_index(device_ids[i]) < 0) {
            c->host->set_error(call, str_of("release of a device this driver does not have"));
            return DEVHOST_ERR_NOT_FOUND;
        }
    }
    for (size_t i = 0; i < count; i++) c->released[device_index(device_ids[i])]++;
    return DEVHOST_OK;
}

static const devhost_driver_desc DESCRIPTOR = {
    .magic = DEVHOST_DRIVER_MAGIC,
    .struct_size = sizeof(devhost_driver_desc),
    .abi_major = DEVHOST_ABI_MAJOR,
    .abi_minor = DEVHOST_ABI_MINOR,
    .reserved0 = 0,
    .capabilities = 0,
    .name = "compat-v1.1",
    .version = "1.1.0",
    .description = "A driver frozen at ABI v1.1, for compatibility tests",
    .create = compat_create,
    .destroy = compat_destroy,
    .scan = compat_scan,
    .allocate = NULL,
    .preferred_allocation = NULL,
    .pre_start = NULL,
    .watch_start = NULL,
    .watch_stop = NULL,
    .release = compat_release,
};

DEVHOST_EXPORT const devhost_driver_desc *devhost_driver_entry_v1(void) { return &DESCRIPTOR; }
