//! The exported `nvml*` C functions. Each one locks the run-time state,
//! applies new control-file commands, and answers from the machine.
//!
//! Device handles are small integers dressed as pointers, never
//! dereferenced: GPU `i` is `(i + 1) << 8`, MIG slot `s` of GPU `i` is
//! `((i + 1) << 8) | (s + 1)`. Event sets are `index + 1`.

use crate::machine::{self, profile_slices};
use crate::state::{ALL_EVENTS, EventSet, OLD_GPU_EVENTS, Runtime};
use nvml_wrapper_sys::bindings::*;
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

type Ret = nvmlReturn_t;
const SUCCESS: Ret = nvmlReturn_enum_NVML_SUCCESS;
const UNINITIALIZED: Ret = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
const INVALID_ARGUMENT: Ret = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
const NOT_SUPPORTED: Ret = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
const NOT_FOUND: Ret = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
const INSUFFICIENT_SIZE: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
const DRIVER_NOT_LOADED: Ret = nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
const TIMEOUT: Ret = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
const GPU_IS_LOST: Ret = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
const VERSION_MISMATCH: Ret = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
const UNKNOWN: Ret = nvmlReturn_enum_NVML_ERROR_UNKNOWN;
const MIB: u64 = 1024 * 1024;
/// How often a blocked `nvmlEventSetWait_v2` looks at the control file.
const WAIT_POLL: Duration = Duration::from_millis(10);

static STATE: Mutex<Option<Runtime>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<Runtime>> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` on the initialised state inside a panic guard.
fn with_rt(f: impl FnOnce(&mut Runtime) -> Result<(), Ret>) -> Ret {
    catch_unwind(AssertUnwindSafe(|| {
        let mut guard = lock();
        let Some(rt) = guard.as_mut().filter(|rt| rt.init_count > 0) else { return UNINITIALIZED };
        rt.poll_control();
        f(rt).err().unwrap_or(SUCCESS)
    }))
    .unwrap_or(UNKNOWN)
}

/// What a device handle points at.
#[derive(Clone, Copy)]
enum Target {
    Gpu(usize),
    /// GPU index, index into its `mig_devices`.
    Mig(usize, usize),
}

fn gpu_handle(gpu: usize) -> nvmlDevice_t {
    std::ptr::without_provenance_mut((gpu + 1) << 8)
}

fn mig_handle(gpu: usize, slot: u32) -> nvmlDevice_t {
    std::ptr::without_provenance_mut(((gpu + 1) << 8) | (slot as usize + 1))
}

/// Decodes a handle; lost GPUs (and their MIG devices) answer GPU_IS_LOST.
fn target(rt: &Runtime, handle: nvmlDevice_t) -> Result<Target, Ret> {
    let raw = handle.addr();
    let gpu = (raw >> 8).checked_sub(1).filter(|&g| g < rt.machine.gpus.len()).ok_or(INVALID_ARGUMENT)?;
    if rt.lost[gpu] {
        return Err(GPU_IS_LOST);
    }
    match (raw & 0xff).checked_sub(1) {
        None => Ok(Target::Gpu(gpu)),
        Some(slot) => rt.machine.gpus[gpu]
            .mig_devices
            .iter()
            .position(|m| m.slot as usize == slot)
            .map(|j| Target::Mig(gpu, j))
            .ok_or(INVALID_ARGUMENT),
    }
}

/// Like [`target`] but only for whole GPUs.
fn whole_gpu(rt: &Runtime, handle: nvmlDevice_t) -> Result<usize, Ret> {
    match target(rt, handle)? {
        Target::Gpu(g) => Ok(g),
        Target::Mig(..) => Err(NOT_SUPPORTED),
    }
}

/// Writes `value` through an out-pointer.
///
/// # Safety
/// `out` must be NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), Ret> {
    if out.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and valid per the caller's contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Copies `text` with a NUL into a caller buffer of `len` bytes.
///
/// # Safety
/// `buf` must be NULL or valid for `len` bytes.
unsafe fn put_str(buf: *mut c_char, len: c_uint, text: &str) -> Result<(), Ret> {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    if text.len() + 1 > len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: the buffer holds len >= text.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, text.len());
        buf.add(text.len()).write(0);
    }
    Ok(())
}

/// A PCI info struct for a bus ID (`sub_system` 0 where NVML leaves it unset).
fn pci_info(bdf: &machine::Bdf, device_id: u32, sub_system: u32) -> nvmlPciInfo_t {
    let mut info = nvmlPciInfo_t {
        busIdLegacy: [0; 16],
        domain: bdf.domain,
        bus: bdf.bus,
        device: bdf.device,
        pciDeviceId: device_id,
        pciSubSystemId: sub_system,
        busId: [0; 32],
    };
    for (dst, src) in info.busIdLegacy.iter_mut().zip(bdf.legacy().bytes().take(15)) {
        *dst = src as c_char;
    }
    for (dst, src) in info.busId.iter_mut().zip(bdf.nvml().bytes().take(31)) {
        *dst = src as c_char;
    }
    info
}

/// The path of this library, for the machine file beside it.
fn own_library() -> Option<PathBuf> {
    // SAFETY: dladdr only reads the address and fills the struct; the
    // returned name points into the loader's data, copied at once.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let addr = own_library as *const c_void;
        if libc::dladdr(addr, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let name = CStr::from_ptr(info.dli_fname).to_str().ok()?;
        Some(PathBuf::from(name))
    }
}

// ---- library ---------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> Ret {
    catch_unwind(|| {
        let mut guard = lock();
        if guard.as_ref().is_none_or(|rt| rt.init_count == 0) {
            // (Re)load on the first init, so a fresh session sees the file as it is now.
            let path = machine::locate(own_library().as_deref());
            match Runtime::load(&path) {
                Ok(rt) => *guard = Some(rt),
                Err(e) => {
                    eprintln!("fake-nvml: {e} (set {} to a machine file)", machine::MACHINE_ENV);
                    return DRIVER_NOT_LOADED;
                }
            }
        }
        let Some(rt) = guard.as_mut() else { return UNKNOWN };
        if let Some(code) = rt.machine.init_error {
            return code;
        }
        rt.init_count += 1;
        SUCCESS
    })
    .unwrap_or(UNKNOWN)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> Ret {
    nvmlInit_v2()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> Ret {
    nvmlInit_v2()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> Ret {
    with_rt(|rt| {
        rt.init_count -= 1;
        if rt.init_count == 0 {
            rt.sets.clear();
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: Ret) -> *const c_char {
    let text: &'static CStr = match result {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        DRIVER_NOT_LOADED => c"Driver Not Loaded",
        TIMEOUT => c"Timeout",
        GPU_IS_LOST => c"GPU is lost",
        VERSION_MISMATCH => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

// ---- system ----------------------------------------------------------------

/// # Safety
/// `version` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> Ret {
    // SAFETY: forwarded caller contract.
    with_rt(|rt| unsafe { put_str(version, length, &rt.machine.driver_version) })
}

/// # Safety
/// `version` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> Ret {
    // SAFETY: forwarded caller contract.
    with_rt(|rt| unsafe { put_str(version, length, &format!("12.{}", rt.machine.driver_version)) })
}

/// # Safety
/// `out` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(out: *mut c_int) -> Ret {
    // SAFETY: forwarded caller contract.
    with_rt(|rt| unsafe { put(out, rt.machine.cuda_version) })
}

/// # Safety
/// `out` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(out: *mut c_int) -> Ret {
    // SAFETY: forwarded caller contract.
    unsafe { nvmlSystemGetCudaDriverVersion_v2(out) }
}

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
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(device: nvmlDevice_t, index: c_uint, mig: *mut nvmlDevice_t) -> Ret {
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
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device: nvmlDevice_t, parent: *mut nvmlDevice_t) -> Ret {
    with_rt(|rt| match target(rt, device)? {
        Target::Gpu(_) => Err(INVALID_ARGUMENT),
        // SAFETY: forwarded caller contract.
        Target::Mig(g, _) => unsafe { put(parent, gpu_handle(g)) },
    })
}

/// # Safety
/// `attributes` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(device: nvmlDevice_t, attributes: *mut nvmlDeviceAttributes_t) -> Ret {
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
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(device: nvmlDevice_t, link: c_uint, active: *mut nvmlEnableState_t) -> Ret {
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
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(device: nvmlDevice_t, link: c_uint, pci: *mut nvmlPciInfo_t) -> Ret {
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

// ---- events ----------------------------------------------------------------

fn set_index(rt: &Runtime, set: nvmlEventSet_t) -> Result<usize, Ret> {
    set.addr()
        .checked_sub(1)
        .filter(|&i| rt.sets.get(i).is_some_and(Option::is_some))
        .ok_or(INVALID_ARGUMENT)
}

/// # Safety
/// `set` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> Ret {
    with_rt(|rt| {
        if let Some(code) = rt.machine.event_set_error {
            return Err(code);
        }
        rt.sets.push(Some(EventSet::default()));
        // SAFETY: forwarded caller contract.
        unsafe { put(set, std::ptr::without_provenance_mut(rt.sets.len())) }
    })
}

/// # Safety
/// `types` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(device: nvmlDevice_t, types: *mut c_ulonglong) -> Ret {
    with_rt(|rt| {
        let gpu = &rt.machine.gpus[whole_gpu(rt, device)?];
        // SAFETY: forwarded caller contract.
        unsafe { put(types, if gpu.events { ALL_EVENTS } else { OLD_GPU_EVENTS }) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(device: nvmlDevice_t, types: c_ulonglong, set: nvmlEventSet_t) -> Ret {
    with_rt(|rt| {
        let g = whole_gpu(rt, device)?;
        let i = set_index(rt, set)?;
        let supported = if rt.machine.gpus[g].events { ALL_EVENTS } else { OLD_GPU_EVENTS };
        if types & !supported != 0 {
            return Err(NOT_SUPPORTED);
        }
        if let Some(s) = rt.sets[i].as_mut() {
            s.registered.push((g, types));
        }
        Ok(())
    })
}

/// # Safety
/// `data` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeout_ms: c_uint) -> Ret {
    if data.is_null() {
        return INVALID_ARGUMENT;
    }
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    loop {
        let mut event = None;
        let code = with_rt(|rt| {
            let i = set_index(rt, set)?;
            let Some(s) = rt.sets[i].as_mut() else { return Err(INVALID_ARGUMENT) };
            if std::mem::take(&mut s.lost_pending) {
                return Err(GPU_IS_LOST);
            }
            event = s.queue.pop_front();
            Ok(())
        });
        if code != SUCCESS {
            return code;
        }
        if let Some(e) = event {
            let out = nvmlEventData_t {
                device: gpu_handle(e.gpu),
                eventType: e.event_type,
                eventData: e.data,
                gpuInstanceId: e.gpu_instance,
                computeInstanceId: e.compute_instance,
            };
            // SAFETY: checked non-null; valid per the contract.
            unsafe { data.write(out) };
            return SUCCESS;
        }
        let now = Instant::now();
        if now >= deadline {
            return TIMEOUT;
        }
        // Sleep without holding the lock, so other calls proceed.
        std::thread::sleep(WAIT_POLL.min(deadline - now));
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> Ret {
    with_rt(|rt| {
        let i = set_index(rt, set)?;
        rt.sets[i] = None;
        Ok(())
    })
}
