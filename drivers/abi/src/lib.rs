//! The devhost driver ABI, version 1.2: a `#[repr(C)]` mirror of
//! `include/devhost_driver.h`, which is the contract. Nothing here has
//! behaviour; the host's loader and the SDK build on these types, and a layout
//! test compiles the header and compares every size, offset and constant.
#![no_std]
#![allow(non_camel_case_types)]

use core::ffi::{c_char, c_void};

pub const DEVHOST_ABI_MAJOR: u16 = 1;
pub const DEVHOST_ABI_MINOR: u16 = 3;
pub const DEVHOST_DRIVER_MAGIC: u32 = 0x4448_5644;
pub const DEVHOST_ENTRY_SYMBOL_V1: &str = "devhost_driver_entry_v1";

pub type devhost_status = u32;
pub const DEVHOST_OK: devhost_status = 0;
pub const DEVHOST_ERR_INVALID_ARGUMENT: devhost_status = 1;
pub const DEVHOST_ERR_NOT_FOUND: devhost_status = 2;
pub const DEVHOST_ERR_UNAVAILABLE: devhost_status = 3;
pub const DEVHOST_ERR_TIMEOUT: devhost_status = 4;
pub const DEVHOST_ERR_INTERNAL: devhost_status = 5;
pub const DEVHOST_ERR_PANIC: devhost_status = 6;
pub const DEVHOST_ERR_UNSUPPORTED: devhost_status = 7;
pub const DEVHOST_ERR_RESOURCE_EXHAUSTED: devhost_status = 8;
pub const DEVHOST_ERR_FAILED_PRECONDITION: devhost_status = 9;

pub type devhost_health = u32;
pub const DEVHOST_HEALTH_HEALTHY: devhost_health = 1;
pub const DEVHOST_HEALTH_UNHEALTHY: devhost_health = 2;

pub type devhost_log_level = u32;
pub const DEVHOST_LOG_ERROR: devhost_log_level = 1;
pub const DEVHOST_LOG_WARN: devhost_log_level = 2;
pub const DEVHOST_LOG_INFO: devhost_log_level = 3;
pub const DEVHOST_LOG_DEBUG: devhost_log_level = 4;
pub const DEVHOST_LOG_TRACE: devhost_log_level = 5;

pub const DEVHOST_NUMA_NONE: i32 = -1;

pub type devhost_caps = u64;
pub const DEVHOST_CAP_CONCURRENT: devhost_caps = 1 << 0;
/// `allocate` reads a DRA claim's parameters (`claim_parameters`, 1.3).
pub const DEVHOST_CAP_CLAIM_PARAMETERS: devhost_caps = 1 << 1;
/// `allocate` is called only for DRA claims, never for a device-plugin container (1.3).
pub const DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY: devhost_caps = 1 << 2;

/// A borrowed UTF-8 string: `len` bytes at `ptr`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct devhost_str {
    pub ptr: *const c_char,
    pub len: usize,
}

impl devhost_str {
    /// Borrows a Rust string. The result is valid only while `s` is.
    pub const fn from_str(s: &str) -> Self {
        Self { ptr: s.as_ptr().cast(), len: s.len() }
    }

    pub const fn empty() -> Self {
        Self { ptr: core::ptr::null(), len: 0 }
    }

    /// The bytes behind the view, or `None` for a NULL pointer with a
    /// non-zero length.
    ///
    /// # Safety
    /// `ptr` must point to `len` readable bytes that stay valid for `'a`.
    pub unsafe fn as_bytes<'a>(&self) -> Option<&'a [u8]> {
        if self.len == 0 {
            Some(&[])
        } else if self.ptr.is_null() {
            None
        } else {
            // SAFETY: the caller guarantees ptr/len describe live memory.
            Some(unsafe { core::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) })
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct devhost_kv {
    pub key: devhost_str,
    pub value: devhost_str,
}

/// Opaque handle for one driver call.
#[repr(C)]
pub struct devhost_call {
    _private: [u8; 0],
}

pub type LogFn = unsafe extern "C" fn(host_ctx: *mut c_void, level: devhost_log_level, message: devhost_str);
pub type DevicesChangedFn = unsafe extern "C" fn(host_ctx: *mut c_void);
pub type SetErrorFn = unsafe extern "C" fn(call: *mut devhost_call, message: devhost_str);
pub type DeviceBeginFn = unsafe extern "C" fn(
    call: *mut devhost_call,
    id: devhost_str,
    health: devhost_health,
    numa_node: i32,
) -> devhost_status;
pub type KeyValueFn =
    unsafe extern "C" fn(call: *mut devhost_call, key: devhost_str, value: devhost_str) -> devhost_status;
pub type DeviceLinkFn =
    unsafe extern "C" fn(call: *mut devhost_call, other_id: devhost_str, score: u32) -> devhost_status;
pub type AddDeviceNodeFn = unsafe extern "C" fn(
    call: *mut devhost_call,
    host_path: devhost_str,
    container_path: devhost_str,
    permissions: devhost_str,
) -> devhost_status;
pub type AddMountFn = unsafe extern "C" fn(
    call: *mut devhost_call,
    host_path: devhost_str,
    container_path: devhost_str,
    read_only: u32,
) -> devhost_status;
pub type OneStrFn = unsafe extern "C" fn(call: *mut devhost_call, value: devhost_str) -> devhost_status;
pub type StrOutFn = unsafe extern "C" fn(call: *mut devhost_call, out: *mut devhost_str) -> devhost_status;

/// Host → driver callbacks, valid from `create` until `destroy` returns.
#[repr(C)]
pub struct devhost_host_api {
    pub struct_size: u32,
    pub abi_major: u16,
    pub abi_minor: u16,
    pub host_ctx: *mut c_void,
    pub log: Option<LogFn>,
    pub devices_changed: Option<DevicesChangedFn>,
    pub set_error: Option<SetErrorFn>,
    pub device_begin: Option<DeviceBeginFn>,
    pub device_attr: Option<KeyValueFn>,
    pub device_link: Option<DeviceLinkFn>,
    pub add_device_node: Option<AddDeviceNodeFn>,
    pub add_mount: Option<AddMountFn>,
    pub add_env: Option<KeyValueFn>,
    pub add_annotation: Option<KeyValueFn>,
    pub add_cdi_device: Option<OneStrFn>,
    pub prefer_device: Option<OneStrFn>,
    // ---- added in 1.2 ----
    /// Why the current device has its health (`scan`, after `device_begin`).
    pub device_health_reason: Option<OneStrFn>,
    // ---- added in 1.3 ----
    /// The DRA claim's parameters for this driver (`allocate` only).
    pub claim_parameters: Option<StrOutFn>,
}

pub type CreateFn = unsafe extern "C" fn(
    host: *const devhost_host_api,
    options: *const devhost_kv,
    option_count: usize,
    call: *mut devhost_call,
    out_instance: *mut *mut c_void,
) -> devhost_status;
pub type DestroyFn = unsafe extern "C" fn(instance: *mut c_void);
pub type ScanFn = unsafe extern "C" fn(instance: *mut c_void, call: *mut devhost_call) -> devhost_status;
pub type IdsFn = unsafe extern "C" fn(
    instance: *mut c_void,
    device_ids: *const devhost_str,
    count: usize,
    call: *mut devhost_call,
) -> devhost_status;
pub type PreferredAllocationFn = unsafe extern "C" fn(
    instance: *mut c_void,
    available: *const devhost_str,
    available_count: usize,
    must_include: *const devhost_str,
    must_include_count: usize,
    size: u32,
    call: *mut devhost_call,
) -> devhost_status;
pub type WatchStopFn = unsafe extern "C" fn(instance: *mut c_void);

/// Driver → host: the static descriptor returned by the entry symbol.
#[repr(C)]
pub struct devhost_driver_desc {
    pub magic: u32,
    pub struct_size: u32,
    pub abi_major: u16,
    pub abi_minor: u16,
    pub reserved0: u32,
    pub capabilities: devhost_caps,
    pub name: *const c_char,
    pub version: *const c_char,
    pub description: *const c_char,
    pub create: Option<CreateFn>,
    pub destroy: Option<DestroyFn>,
    pub scan: Option<ScanFn>,
    pub allocate: Option<IdsFn>,
    pub preferred_allocation: Option<PreferredAllocationFn>,
    pub pre_start: Option<IdsFn>,
    pub watch_start: Option<ScanFn>,
    pub watch_stop: Option<WatchStopFn>,
    // ---- added in 1.1 ----
    /// Reset or scrub devices no container holds any more (optional).
    pub release: Option<IdsFn>,
}

// SAFETY: the descriptor is immutable static data (string literals and
// function pointers), so sharing it between threads is sound.
unsafe impl Sync for devhost_driver_desc {}

pub type EntryFn = unsafe extern "C" fn() -> *const devhost_driver_desc;

/// The smallest descriptor the host accepts: everything up to and including
/// `scan`, the last required field of v1.0.
pub const DESC_MIN_SIZE_V1: usize = core::mem::offset_of!(devhost_driver_desc, scan) + core::mem::size_of::<usize>();

/// `struct_size` of a v1.0 descriptor: everything up to and including
/// `watch_stop`. A driver declaring this size has no `release`.
pub const DESC_SIZE_V1_0: usize =
    core::mem::offset_of!(devhost_driver_desc, watch_stop) + core::mem::size_of::<usize>();

/// `struct_size` of a v1.0 and v1.1 host API table: everything up to and
/// including `prefer_device`. A host declaring this size has no
/// `device_health_reason`.
pub const HOST_API_SIZE_V1_1: usize =
    core::mem::offset_of!(devhost_host_api, prefer_device) + core::mem::size_of::<usize>();

/// `struct_size` of a v1.2 host API table: everything up to and including
/// `device_health_reason`. A host declaring this size has no `claim_parameters`.
pub const HOST_API_SIZE_V1_2: usize =
    core::mem::offset_of!(devhost_host_api, device_health_reason) + core::mem::size_of::<usize>();

/// Whether a field at `offset` of width `width` lies within a struct whose
/// other side declared `declared` bytes.
pub const fn field_present(declared: usize, offset: usize, width: usize) -> bool {
    offset + width <= declared
}

/// Every constant, by its C name, for the layout conformance test.
pub const CONSTANTS: &[(&str, i128)] = &[
    ("DEVHOST_ABI_MAJOR", DEVHOST_ABI_MAJOR as i128),
    ("DEVHOST_ABI_MINOR", DEVHOST_ABI_MINOR as i128),
    ("DEVHOST_DRIVER_MAGIC", DEVHOST_DRIVER_MAGIC as i128),
    ("DEVHOST_OK", DEVHOST_OK as i128),
    ("DEVHOST_ERR_INVALID_ARGUMENT", DEVHOST_ERR_INVALID_ARGUMENT as i128),
    ("DEVHOST_ERR_NOT_FOUND", DEVHOST_ERR_NOT_FOUND as i128),
    ("DEVHOST_ERR_UNAVAILABLE", DEVHOST_ERR_UNAVAILABLE as i128),
    ("DEVHOST_ERR_TIMEOUT", DEVHOST_ERR_TIMEOUT as i128),
    ("DEVHOST_ERR_INTERNAL", DEVHOST_ERR_INTERNAL as i128),
    ("DEVHOST_ERR_PANIC", DEVHOST_ERR_PANIC as i128),
    ("DEVHOST_ERR_UNSUPPORTED", DEVHOST_ERR_UNSUPPORTED as i128),
    ("DEVHOST_ERR_RESOURCE_EXHAUSTED", DEVHOST_ERR_RESOURCE_EXHAUSTED as i128),
    ("DEVHOST_ERR_FAILED_PRECONDITION", DEVHOST_ERR_FAILED_PRECONDITION as i128),
    ("DEVHOST_HEALTH_HEALTHY", DEVHOST_HEALTH_HEALTHY as i128),
    ("DEVHOST_HEALTH_UNHEALTHY", DEVHOST_HEALTH_UNHEALTHY as i128),
    ("DEVHOST_LOG_ERROR", DEVHOST_LOG_ERROR as i128),
    ("DEVHOST_LOG_WARN", DEVHOST_LOG_WARN as i128),
    ("DEVHOST_LOG_INFO", DEVHOST_LOG_INFO as i128),
    ("DEVHOST_LOG_DEBUG", DEVHOST_LOG_DEBUG as i128),
    ("DEVHOST_LOG_TRACE", DEVHOST_LOG_TRACE as i128),
    ("DEVHOST_NUMA_NONE", DEVHOST_NUMA_NONE as i128),
    ("DEVHOST_CAP_CONCURRENT", DEVHOST_CAP_CONCURRENT as i128),
    ("DEVHOST_CAP_CLAIM_PARAMETERS", DEVHOST_CAP_CLAIM_PARAMETERS as i128),
    ("DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY", DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY as i128),
];
