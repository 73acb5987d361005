//! Device calls of the fake: enumeration, facts, MIG, NVLink and topology.

use crate::ffi::*;
use crate::machine::{self, profile_slices};
use nvml_wrapper_sys::bindings::*;
use std::ffi::{CStr, c_char, c_int, c_uint};

// ---- enumeration -----------------------------------------------------------

/// # Safety
/// `count` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> Ret {
    // SAFETY: forwarded caller contract.
    with_rt(|rt| unsafe { put(count, rt.machine.gpus.len() as c_uint) })
}

/// # Safety
/// `device` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, device: *mut nvmlDevice_t) -> Ret {
    with_rt(|rt| {
        let gpu = index as usize;
        if gpu >= rt.machine.gpus.len() {
            return Err(INVALID_ARGUMENT);
        }
        whole_gpu(rt, gpu_handle(gpu))?;
        // SAFETY: forwarded caller contract.
        unsafe { put(device, gpu_handle(gpu)) }
    })
}

/// # Safety
/// `uuid` must be a NUL-terminated string; `device` valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, device: *mut nvmlDevice_t) -> Ret {
    with_rt(|rt| {
        if uuid.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: NUL-terminated per the contract.
        let wanted = unsafe { CStr::from_ptr(uuid) }.to_str().map_err(|_| INVALID_ARGUMENT)?;
        let mut found = None;
        for (g, gpu) in rt.machine.gpus.iter().enumerate() {
            if gpu.uuid == wanted {
                found = Some(gpu_handle(g));
            }
            if let Some(m) = gpu.mig_devices.iter().find(|m| m.uuid == wanted) {
                found = Some(mig_handle(g, m.slot));
            }
        }
        let handle = found.ok_or(NOT_FOUND)?;
        target(rt, handle)?;
        // SAFETY: forwarded caller contract.
        unsafe { put(device, handle) }
    })
}

/// # Safety
/// `uuid` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(device: nvmlDevice_t, uuid: *mut c_char, length: c_uint) -> Ret {
    with_rt(|rt| {
        let text = match target(rt, device)? {
            Target::Gpu(g) => &rt.machine.gpus[g].uuid,
            Target::Mig(g, j) => &rt.machine.gpus[g].mig_devices[j].uuid,
        };
        // SAFETY: forwarded caller contract.
        unsafe { put_str(uuid, length, text) }
    })
}

/// # Safety
/// `name` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(device: nvmlDevice_t, name: *mut c_char, length: c_uint) -> Ret {
    with_rt(|rt| {
        // Real NVML names a MIG device "<GPU name> MIG <profile>".
        let text = match target(rt, device)? {
            Target::Gpu(g) => rt.machine.gpus[g].name.clone(),
            Target::Mig(g, j) => {
                format!("{} MIG {}", rt.machine.gpus[g].name, rt.machine.gpus[g].mig_devices[j].profile)
            }
        };
        // SAFETY: forwarded caller contract.
        unsafe { put_str(name, length, &text) }
    })
}

/// # Safety
/// `index` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> Ret {
    // SAFETY: forwarded caller contract.
    with_rt(|rt| unsafe { put(index, whole_gpu(rt, device)? as c_uint) })
}

// ---- device facts ----------------------------------------------------------

/// # Safety
/// `memory` must be valid for a read and write of `nvmlMemory_v2_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> Ret {
    wait_while_held(device);
    with_rt(|rt| {
        let mib = match target(rt, device)? {
            Target::Gpu(g) => rt.machine.gpus[g].memory_mib,
            Target::Mig(g, j) => rt.machine.gpus[g].mig_devices[j].memory_mib,
        };
        if memory.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // Real NVML checks NVML_STRUCT_VERSION(Memory, 2) = size | 2 << 24.
        let expected = (std::mem::size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint;
        // SAFETY: non-null, valid per the contract.
        if unsafe { (*memory).version } != expected {
            return Err(VERSION_MISMATCH);
        }
        let total = mib * MIB;
        let reserved = (mib / 100).max(1) * MIB;
        let info = nvmlMemory_v2_t { version: expected, total, reserved, free: total - reserved, used: reserved };
        // SAFETY: as above.
        unsafe { put(memory, info) }
    })
}

/// # Safety
/// `memory` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> Ret {
    wait_while_held(device);
    with_rt(|rt| {
        let mib = match target(rt, device)? {
            Target::Gpu(g) => rt.machine.gpus[g].memory_mib,
            Target::Mig(g, j) => rt.machine.gpus[g].mig_devices[j].memory_mib,
        };
        let total = mib * MIB;
        // SAFETY: forwarded caller contract.
        unsafe { put(memory, nvmlMemory_t { total, free: total, used: 0 }) }
    })
}

/// # Safety
/// `pci` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(device: nvmlDevice_t, pci: *mut nvmlPciInfo_t) -> Ret {
    with_rt(|rt| {
        let g = whole_gpu(rt, device)?;
        let gpu = &rt.machine.gpus[g];
        // SAFETY: forwarded caller contract.
        unsafe { put(pci, pci_info(&rt.bus[g], gpu.pci_device_id, 0x1658_10de)) }
    })
}

/// # Safety
/// `minor` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minor: *mut c_uint) -> Ret {
    // SAFETY: forwarded caller contract.
    with_rt(|rt| unsafe { put(minor, rt.machine.gpus[whole_gpu(rt, device)?].minor) })
}

/// # Safety
/// `major` and `minor` must be valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> Ret {
    with_rt(|rt| {
        let g = match target(rt, device)? {
            Target::Gpu(g) | Target::Mig(g, _) => g,
        };
        let [a, b] = rt.machine.gpus[g].compute_capability;
        // SAFETY: forwarded caller contract.
        unsafe {
            put(major, a)?;
            put(minor, b)
        }
    })
}

// ---- MIG -------------------------------------------------------------------

/// # Safety
/// `current` and `pending` must be valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(device: nvmlDevice_t, current: *mut c_uint, pending: *mut c_uint) -> Ret {
    with_rt(|rt| {
        let mode = c_uint::from(rt.machine.gpus[whole_gpu(rt, device)?].mig_mode);
        // SAFETY: forwarded caller contract.
        unsafe {
            put(current, mode)?;
            put(pending, mode)
        }
    })
}

/// # Safety
/// `count` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(device: nvmlDevice_t, count: *mut c_uint) -> Ret {
    with_rt(|rt| {
        let gpu = &rt.machine.gpus[whole_gpu(rt, device)?];
        // Like NVML: the number of slots, 0 when MIG is off.
        let max = if gpu.mig_mode { gpu.max_mig_devices } else { 0 };
        // SAFETY: forwarded caller contract.
        unsafe { put(count, max) }
    })
}

/// # Safety
/// `mig` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> Ret {
    with_rt(|rt| {
        let g = whole_gpu(rt, device)?;
        let gpu = &rt.machine.gpus[g];
        if !gpu.mig_mode || index >= gpu.max_mig_devices {
            return Err(INVALID_ARGUMENT);
        }
        // Empty slots answer NOT_FOUND, as in NVML.
        let m = gpu.mig_devices.iter().find(|m| m.slot == index).ok_or(NOT_FOUND)?;
        // SAFETY: forwarded caller contract.
        unsafe { put(mig, mig_handle(g, m.slot)) }
    })
}

/// # Safety
/// `is_mig` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(device: nvmlDevice_t, is_mig: *mut c_uint) -> Ret {
    // SAFETY: forwarded caller contract.
    with_rt(|rt| unsafe { put(is_mig, c_uint::from(matches!(target(rt, device)?, Target::Mig(..)))) })
}

/// # Safety
/// `parent` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    device: nvmlDevice_t,
    parent: *mut nvmlDevice_t,
) -> Ret {
    with_rt(|rt| match target(rt, device)? {
        Target::Gpu(_) => Err(INVALID_ARGUMENT),
        // SAFETY: forwarded caller contract.
        Target::Mig(g, _) => unsafe { put(parent, gpu_handle(g)) },
    })
}

/// # Safety
/// `attributes` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> Ret {
    with_rt(|rt| {
        let (memory_mib, slices) = match target(rt, device)? {
            Target::Gpu(g) => (rt.machine.gpus[g].memory_mib, (7, 7)),
            Target::Mig(g, j) => {
                let m = &rt.machine.gpus[g].mig_devices[j];
                (m.memory_mib, profile_slices(&m.profile).unwrap_or((1, 1)))
            }
        };
        let attrs = nvmlDeviceAttributes_t {
            multiprocessorCount: 16 * slices.1,
            sharedCopyEngineCount: slices.0,
            sharedDecoderCount: slices.0,
            sharedEncoderCount: 0,
            sharedJpegCount: slices.0,
            sharedOfaCount: 0,
            gpuInstanceSliceCount: slices.0,
            computeInstanceSliceCount: slices.1,
            memorySizeMB: memory_mib,
        };
        // SAFETY: forwarded caller contract.
        unsafe { put(attributes, attrs) }
    })
}

/// # Safety
/// `id` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, id: *mut c_uint) -> Ret {
    with_rt(|rt| match target(rt, device)? {
        Target::Gpu(_) => Err(INVALID_ARGUMENT),
        // SAFETY: forwarded caller contract.
        Target::Mig(g, j) => unsafe { put(id, rt.machine.gpus[g].mig_devices[j].gpu_instance_id) },
    })
}

/// # Safety
/// `id` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(device: nvmlDevice_t, id: *mut c_uint) -> Ret {
    with_rt(|rt| match target(rt, device)? {
        Target::Gpu(_) => Err(INVALID_ARGUMENT),
        // SAFETY: forwarded caller contract.
        Target::Mig(g, j) => unsafe { put(id, rt.machine.gpus[g].mig_devices[j].compute_instance_id) },
    })
}

// ---- NVLink and topology ---------------------------------------------------

/// # Safety
/// `active` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    active: *mut nvmlEnableState_t,
) -> Ret {
    with_rt(|rt| {
        let gpu = &rt.machine.gpus[whole_gpu(rt, device)?];
        if link >= NVML_NVLINK_MAX_LINKS {
            return Err(INVALID_ARGUMENT);
        }
        if gpu.nvlinks.is_empty() {
            return Err(NOT_SUPPORTED);
        }
        let state = c_uint::from((link as usize) < gpu.nvlinks.len());
        // SAFETY: forwarded caller contract.
        unsafe { put(active, state) }
    })
}

/// # Safety
/// `pci` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> Ret {
    with_rt(|rt| {
        let gpu = &rt.machine.gpus[whole_gpu(rt, device)?];
        // Inactive links answer NOT_SUPPORTED, as on real hardware.
        let remote = gpu.nvlinks.get(link as usize).ok_or(NOT_SUPPORTED)?;
        let bdf = machine::Bdf::parse(remote).ok_or(UNKNOWN)?;
        // SAFETY: forwarded caller contract.
        unsafe { put(pci, pci_info(&bdf, 0, 0)) }
    })
}

/// # Safety
/// `level` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    level: *mut nvmlGpuTopologyLevel_t,
) -> Ret {
    with_rt(|rt| {
        let (a, b) = (whole_gpu(rt, device1)?, whole_gpu(rt, device2)?);
        let code = if a == b { 0 } else { rt.machine.level(a, b).code() };
        // SAFETY: forwarded caller contract.
        unsafe { put(level, code) }
    })
}
