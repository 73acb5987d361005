//! The C side of the fake: shared helpers of every export (state lock,
//! handle decoding, out-pointer writes) and the library and system calls.
//! Each export locks the run-time state, applies new control-file commands,
//! and answers from the machine.
//!
//! Device handles are small integers dressed as pointers, never
//! dereferenced: GPU `i` is `(i + 1) << 8`, MIG slot `s` of GPU `i` is
//! `((i + 1) << 8) | (s + 1)`. Event sets are `index + 1`.

use crate::machine;
use crate::state::Runtime;
use nvml_wrapper_sys::bindings::*;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

pub(crate) type Ret = nvmlReturn_t;
pub(crate) const SUCCESS: Ret = nvmlReturn_enum_NVML_SUCCESS;
pub(crate) const UNINITIALIZED: Ret = nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
pub(crate) const INVALID_ARGUMENT: Ret = nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
pub(crate) const NOT_SUPPORTED: Ret = nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
pub(crate) const NOT_FOUND: Ret = nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
pub(crate) const INSUFFICIENT_SIZE: Ret = nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
pub(crate) const DRIVER_NOT_LOADED: Ret = nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
pub(crate) const TIMEOUT: Ret = nvmlReturn_enum_NVML_ERROR_TIMEOUT;
pub(crate) const GPU_IS_LOST: Ret = nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST;
pub(crate) const VERSION_MISMATCH: Ret = nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
pub(crate) const UNKNOWN: Ret = nvmlReturn_enum_NVML_ERROR_UNKNOWN;
pub(crate) const MIB: u64 = 1024 * 1024;
/// How often a blocked `nvmlEventSetWait_v2` looks at the control file when
/// inotify is unavailable (normally it sleeps on an inotify watch instead).
pub(crate) const WAIT_POLL: Duration = Duration::from_millis(250);

static STATE: Mutex<Option<Runtime>> = Mutex::new(None);

pub(crate) fn lock() -> MutexGuard<'static, Option<Runtime>> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `f` on the initialised state inside a panic guard.
pub(crate) fn with_rt(f: impl FnOnce(&mut Runtime) -> Result<(), Ret>) -> Ret {
    catch_unwind(AssertUnwindSafe(|| {
        let mut guard = lock();
        let Some(rt) = guard.as_mut().filter(|rt| rt.init_count > 0) else { return UNINITIALIZED };
        rt.poll_control();
        f(rt).err().unwrap_or(SUCCESS)
    }))
    .unwrap_or(UNKNOWN)
}

/// Waits while `hold` holds the GPU of `handle`, reading the control file
/// (for its `release`) every few milliseconds and holding the lock only to
/// look, so that every other call (the event wait, other GPUs) goes on.
pub(crate) fn wait_while_held(handle: nvmlDevice_t) {
    let Some(gpu) = gpu_index(handle) else { return };
    loop {
        let held = catch_unwind(AssertUnwindSafe(|| {
            let mut guard = lock();
            let Some(rt) = guard.as_mut().filter(|rt| rt.init_count > 0) else { return false };
            rt.poll_control();
            rt.held.get(gpu).copied().unwrap_or(false)
        }))
        .unwrap_or(false);
        if !held {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// What a device handle points at.
#[derive(Clone, Copy)]
pub(crate) enum Target {
    Gpu(usize),
    /// GPU index, index into its `mig_devices`.
    Mig(usize, usize),
}

pub(crate) fn gpu_handle(gpu: usize) -> nvmlDevice_t {
    std::ptr::without_provenance_mut((gpu + 1) << 8)
}

pub(crate) fn mig_handle(gpu: usize, slot: u32) -> nvmlDevice_t {
    std::ptr::without_provenance_mut(((gpu + 1) << 8) | (slot as usize + 1))
}

/// The GPU index a handle (of a GPU or of one of its MIG devices) encodes, unchecked.
fn gpu_index(handle: nvmlDevice_t) -> Option<usize> {
    (handle.addr() >> 8).checked_sub(1)
}

/// Decodes a handle; lost GPUs (and their MIG devices) answer GPU_IS_LOST,
/// failing ones their failure code.
pub(crate) fn target(rt: &Runtime, handle: nvmlDevice_t) -> Result<Target, Ret> {
    let raw = handle.addr();
    let gpu = gpu_index(handle).filter(|&g| g < rt.machine.gpus.len()).ok_or(INVALID_ARGUMENT)?;
    if rt.lost[gpu] {
        return Err(GPU_IS_LOST);
    }
    if let Some(code) = rt.failing[gpu] {
        return Err(code);
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
pub(crate) fn whole_gpu(rt: &Runtime, handle: nvmlDevice_t) -> Result<usize, Ret> {
    match target(rt, handle)? {
        Target::Gpu(g) => Ok(g),
        Target::Mig(..) => Err(NOT_SUPPORTED),
    }
}

/// Writes `value` through an out-pointer.
///
/// # Safety
/// `out` must be NULL or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, value: T) -> Result<(), Ret> {
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
pub(crate) unsafe fn put_str(buf: *mut c_char, len: c_uint, text: &str) -> Result<(), Ret> {
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
pub(crate) fn pci_info(bdf: &machine::Bdf, device_id: u32, sub_system: u32) -> nvmlPciInfo_t {
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
    catch_unwind(|| {
        let mut guard = lock();
        let Some(rt) = guard.as_mut().filter(|rt| rt.init_count > 0) else { return UNINITIALIZED };
        rt.init_count -= 1;
        if rt.init_count == 0 {
            // Like the real library, the last shutdown releases all that init
            // took (event sets, the control file's inotify descriptor): the
            // caller may dlclose us next, and that drops no static.
            *guard = None;
        }
        SUCCESS
    })
    .unwrap_or(UNKNOWN)
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
