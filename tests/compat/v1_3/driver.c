/*
 * driver.c — a driver built against ABI v1.3, frozen.
 *
 * It is compiled against the copy of the v1.3 header next to it, never the
 * current one, so the host's tests prove that a module built for v1.3 keeps
 * loading and working as the ABI grows. Do not edit (see ../README.md).
 *
 * Name "compat-v1.3"; devices compat-0..compat-2, no NUMA affinity,
 * attribute abi=1.3. It declares DEVHOST_CAP_CLAIM_PARAMETERS, and its
 * allocate reads `claim_parameters` (the host callback 1.3 added) when the
 * host's table has it: a DRA claim's parameters become the env
 * COMPAT_PARAMETERS=<the JSON text>, a device-plugin container gets
 * COMPAT_PARAMETERS=none. Parameters holding the text "refuse" are refused
 * with DEVHOST_ERR_INVALID_ARGUMENT. Options are ignored.
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
    *out_instance = instance;
    return DEVHOST_OK;
}

static void compat_destroy(void *instance) { free(instance); }

static devhost_status compat_scan(void *instance, devhost_call *call) {
    compat *c = instance;
    for (int i = 0; i < DEVICE_COUNT; i++) {
        char id[16];
        snprintf(id, sizeof id, "compat-%d", i);
        devhost_status st = c->host->device_begin(call, str_of(id), DEVHOST_HEALTH_HEALTHY, DEVHOST_NUMA_NONE);
        if (st == DEVHOST_OK) st = c->host->device_attr(call, str_of("abi"), str_of("1.3"));
        if (st != DEVHOST_OK) return st;
    }
    return DEVHOST_OK;
}

static devhost_status compat_allocate(void *instance, const devhost_str *ids, size_t count,
                                      devhost_call *call) {
    compat *c = instance;
    (void)ids;
    (void)count;
    /* Optional: an older host has no claim parameters, as for a container. */
    devhost_str json = {NULL, 0};
    devhost_status st = DEVHOST_ERR_NOT_FOUND;
    if (HOST_HAS(c->host, claim_parameters)) st = c->host->claim_parameters(call, &json);
    if (st == DEVHOST_ERR_NOT_FOUND) return c->host->add_env(call, str_of("COMPAT_PARAMETERS"), str_of("none"));
    if (st != DEVHOST_OK) return st;
    for (size_t i = 0; i + 6 <= json.len; i++) {
        if (memcmp(json.ptr + i, "refuse", 6) == 0) {
            c->host->set_error(call, str_of("compat-v1.3 refuses these parameters"));
            return DEVHOST_ERR_INVALID_ARGUMENT;
        }
    }
    return c->host->add_env(call, str_of("COMPAT_PARAMETERS"), json);
}

static const devhost_driver_desc DESCRIPTOR = {
    .magic = DEVHOST_DRIVER_MAGIC,
    .struct_size = sizeof(devhost_driver_desc),
    .abi_major = DEVHOST_ABI_MAJOR,
    .abi_minor = DEVHOST_ABI_MINOR,
    .reserved0 = 0,
    .capabilities = DEVHOST_CAP_CLAIM_PARAMETERS,
    .name = "compat-v1.3",
    .version = "1.3.0",
    .description = "A driver frozen at ABI v1.3, for compatibility tests",
    .create = compat_create,
    .destroy = compat_destroy,
    .scan = compat_scan,
    .allocate = compat_allocate,
    .preferred_allocation = NULL,
    .pre_start = NULL,
    .watch_start = NULL,
    .watch_stop = NULL,
    .release = NULL,
};

DEVHOST_EXPORT const devhost_driver_desc *devhost_driver_entry_v1(void) { return &DESCRIPTOR; }
