//! The `extern "C"` side of the SDK: the descriptor, the entry-point shims
//! with their panic boundary, and the `log` forwarder. Used by
//! [`export_driver!`](crate::export_driver); not for driver code.

use crate::output::{Call, Edits, Preferred, PreferredRequest, Scan};
use crate::{Driver, Error, Host, Options};
use devhost_abi as abi;
use std::any::Any;
use std::cell::Cell;
use std::ffi::{c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// One live driver instance behind the opaque `void *`.
struct Instance<D> {
    driver: D,
    host: Host,
    poisoned: AtomicBool,
}

/// Builds the static descriptor for driver type `D`.
pub const fn descriptor<D: Driver>(
    name: *const c_char,
    version: *const c_char,
    description: *const c_char,
) -> abi::devhost_driver_desc {
    abi::devhost_driver_desc {
        magic: abi::DEVHOST_DRIVER_MAGIC,
        struct_size: std::mem::size_of::<abi::devhost_driver_desc>() as u32,
        abi_major: abi::DEVHOST_ABI_MAJOR,
        abi_minor: abi::DEVHOST_ABI_MINOR,
        reserved0: 0,
        capabilities: if D::CONCURRENT { abi::DEVHOST_CAP_CONCURRENT } else { 0 }
            | if D::READS_CLAIM_PARAMETERS { abi::DEVHOST_CAP_CLAIM_PARAMETERS } else { 0 }
            | if D::ALLOCATE_CLAIMS_ONLY { abi::DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY } else { 0 },
        name,
        version,
        description,
        create: Some(create::<D>),
        destroy: Some(destroy::<D>),
        scan: Some(scan::<D>),
        allocate: if D::HOOKS.allocate { Some(allocate::<D>) } else { None },
        preferred_allocation: if D::HOOKS.preferred_allocation { Some(preferred_allocation::<D>) } else { None },
        pre_start: if D::HOOKS.pre_start { Some(pre_start::<D>) } else { None },
        watch_start: if D::HOOKS.watch { Some(watch_start::<D>) } else { None },
        watch_stop: if D::HOOKS.watch { Some(watch_stop::<D>) } else { None },
        release: if D::HOOKS.release { Some(release::<D>) } else { None },
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

fn fail(call: Option<Call<'_>>, e: &Error) -> abi::devhost_status {
    if let Some(c) = call {
        c.set_error(&e.message);
    }
    e.status.code()
}

/// Runs `f` inside the panic boundary with the instance's host as the
/// thread's log target. A panic poisons the instance.
///
/// # Safety
/// `instance` must come from `create::<D>`; `call` must be a live handle.
unsafe fn with_instance<D: Driver>(
    instance: *mut c_void,
    call: *mut abi::devhost_call,
    f: impl FnOnce(&Instance<D>, Call<'_>) -> crate::Result<()>,
) -> abi::devhost_status {
    if instance.is_null() {
        return abi::DEVHOST_ERR_INVALID_ARGUMENT;
    }
    // SAFETY: the host passes back the pointer create returned.
    let inst = unsafe { &*(instance as *const Instance<D>) };
    let c = Call { api: inst.host.api(), call };
    if inst.poisoned.load(Ordering::Acquire) {
        c.set_error("driver instance is poisoned by an earlier panic");
        return abi::DEVHOST_ERR_PANIC;
    }
    let _guard = CurrentHost::enter(inst.host);
    match catch_unwind(AssertUnwindSafe(|| f(inst, c))) {
        Ok(Ok(())) => abi::DEVHOST_OK,
        Ok(Err(e)) => fail(Some(c), &e),
        Err(p) => {
            inst.poisoned.store(true, Ordering::Release);
            c.set_error(&format!("driver panicked: {}", panic_message(p.as_ref())));
            abi::DEVHOST_ERR_PANIC
        }
    }
}

/// # Safety
/// Called by the host per the ABI.
pub unsafe extern "C" fn create<D: Driver>(
    host: *const abi::devhost_host_api,
    options: *const abi::devhost_kv,
    option_count: usize,
    call: *mut abi::devhost_call,
    out_instance: *mut *mut c_void,
) -> abi::devhost_status {
    if host.is_null() || out_instance.is_null() || (options.is_null() && option_count > 0) {
        return abi::DEVHOST_ERR_INVALID_ARGUMENT;
    }
    // SAFETY: host API valid until destroy (ABI contract).
    let host = unsafe { Host::from_raw(host) };
    let c = Call { api: host.api(), call };
    let result = catch_unwind(AssertUnwindSafe(|| {
        install_logger(host);
        let _guard = CurrentHost::enter(host);
        let kvs: &[abi::devhost_kv] =
            // SAFETY: the host passes option_count valid pairs for this call.
            if option_count == 0 { &[] } else { unsafe { std::slice::from_raw_parts(options, option_count) } };
        let mut pairs = Vec::with_capacity(kvs.len());
        for kv in kvs {
            // SAFETY: strings borrowed for this call.
            let (k, v) = unsafe { (str_of(&kv.key), str_of(&kv.value)) };
            match (k, v) {
                (Some(k), Some(v)) => pairs.push((k.to_string(), v.to_string())),
                _ => return Err(Error::invalid_argument("option key or value is not valid UTF-8")),
            }
        }
        D::create(host, &Options::new(pairs))
    }));
    match result {
        Ok(Ok(driver)) => {
            let inst = Box::new(Instance { driver, host, poisoned: AtomicBool::new(false) });
            // SAFETY: out_instance checked non-null above.
            unsafe { *out_instance = Box::into_raw(inst).cast() };
            abi::DEVHOST_OK
        }
        Ok(Err(e)) => fail(Some(c), &e),
        Err(p) => {
            c.set_error(&format!("driver panicked in create: {}", panic_message(p.as_ref())));
            abi::DEVHOST_ERR_PANIC
        }
    }
}

/// # Safety
/// Called by the host per the ABI, exactly once per instance.
pub unsafe extern "C" fn destroy<D: Driver>(instance: *mut c_void) {
    if instance.is_null() {
        return;
    }
    // SAFETY: created by Box::into_raw in create::<D>; destroy is called once.
    let inst = unsafe { Box::from_raw(instance as *mut Instance<D>) };
    let host = inst.host;
    // A panicking Drop must not unwind into the host; the instance is gone either way.
    let _ = catch_unwind(AssertUnwindSafe(move || drop(inst)));
    forget_host(host);
}

/// # Safety
/// Called by the host per the ABI.
pub unsafe extern "C" fn scan<D: Driver>(instance: *mut c_void, call: *mut abi::devhost_call) -> abi::devhost_status {
    // SAFETY: forwarded from the host.
    unsafe { with_instance::<D>(instance, call, |i, c| i.driver.scan(&mut Scan { call: c })) }
}

/// # Safety
/// `ids` must point to `count` strings valid for the call.
unsafe fn id_list<'a>(ids: *const abi::devhost_str, count: usize) -> crate::Result<Vec<&'a str>> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if ids.is_null() {
        return Err(Error::invalid_argument("device ID list is NULL"));
    }
    // SAFETY: per the function contract.
    let raw = unsafe { std::slice::from_raw_parts(ids, count) };
    raw.iter()
        // SAFETY: each string borrowed for the call.
        .map(|s| unsafe { str_of(s) }.ok_or_else(|| Error::invalid_argument("device ID is not valid UTF-8")))
        .collect()
}

/// # Safety
/// Called by the host per the ABI.
pub unsafe extern "C" fn allocate<D: Driver>(
    instance: *mut c_void,
    ids: *const abi::devhost_str,
    count: usize,
    call: *mut abi::devhost_call,
) -> abi::devhost_status {
    // SAFETY: forwarded from the host.
    unsafe {
        with_instance::<D>(instance, call, |i, c| {
            let ids = id_list(ids, count)?;
            i.driver.allocate(&ids, &mut Edits { call: c })
        })
    }
}

/// # Safety
/// Called by the host per the ABI.
pub unsafe extern "C" fn preferred_allocation<D: Driver>(
    instance: *mut c_void,
    available: *const abi::devhost_str,
    available_count: usize,
    must_include: *const abi::devhost_str,
    must_include_count: usize,
    size: u32,
    call: *mut abi::devhost_call,
) -> abi::devhost_status {
    // SAFETY: forwarded from the host.
    unsafe {
        with_instance::<D>(instance, call, |i, c| {
            let request = PreferredRequest {
                available: id_list(available, available_count)?,
                must_include: id_list(must_include, must_include_count)?,
                size: size as usize,
            };
            i.driver.preferred_allocation(&request, &mut Preferred { call: c })
        })
    }
}

/// The shape of `pre_start` and `release`: the driver gets the device IDs.
///
/// # Safety
/// As the shims that call it: arguments forwarded from the host.
unsafe fn with_ids<D: Driver>(
    instance: *mut c_void,
    ids: *const abi::devhost_str,
    count: usize,
    call: *mut abi::devhost_call,
    hook: impl FnOnce(&D, &[&str]) -> crate::Result<()>,
) -> abi::devhost_status {
    // SAFETY: forwarded from the host.
    unsafe {
        with_instance::<D>(instance, call, |i, _| {
            let ids = id_list(ids, count)?;
            hook(&i.driver, &ids)
        })
    }
}

/// # Safety
/// Called by the host per the ABI.
pub unsafe extern "C" fn pre_start<D: Driver>(
    instance: *mut c_void,
    ids: *const abi::devhost_str,
    count: usize,
    call: *mut abi::devhost_call,
) -> abi::devhost_status {
    // SAFETY: forwarded from the host.
    unsafe { with_ids::<D>(instance, ids, count, call, |d, ids| d.pre_start(ids)) }
}

/// # Safety
/// Called by the host per the ABI.
pub unsafe extern "C" fn release<D: Driver>(
    instance: *mut c_void,
    ids: *const abi::devhost_str,
    count: usize,
    call: *mut abi::devhost_call,
) -> abi::devhost_status {
    // SAFETY: forwarded from the host.
    unsafe { with_ids::<D>(instance, ids, count, call, |d, ids| d.release(ids)) }
}

/// # Safety
/// Called by the host per the ABI.
pub unsafe extern "C" fn watch_start<D: Driver>(
    instance: *mut c_void,
    call: *mut abi::devhost_call,
) -> abi::devhost_status {
    // SAFETY: forwarded from the host.
    unsafe { with_instance::<D>(instance, call, |i, _| i.driver.watch_start()) }
}

/// # Safety
/// Called by the host per the ABI.
pub unsafe extern "C" fn watch_stop<D: Driver>(instance: *mut c_void) {
    if instance.is_null() {
        return;
    }
    // SAFETY: the host passes back the pointer create returned.
    let inst = unsafe { &*(instance as *const Instance<D>) };
    if inst.poisoned.load(Ordering::Acquire) {
        return;
    }
    let _guard = CurrentHost::enter(inst.host);
    if catch_unwind(AssertUnwindSafe(|| inst.driver.watch_stop())).is_err() {
        inst.poisoned.store(true, Ordering::Release);
    }
}

/// # Safety
/// `s` must describe bytes valid for `'a`.
unsafe fn str_of<'a>(s: &abi::devhost_str) -> Option<&'a str> {
    // SAFETY: per the function contract.
    let bytes = unsafe { s.as_bytes() }?;
    std::str::from_utf8(bytes).ok()
}

// ---- log forwarding -------------------------------------------------------
//
// `log` keeps one global logger per copy of the crate, and each cdylib has its
// own copy, so the SDK installs a forwarder in the driver's copy. Records go to
// the host of the instance whose call is running on this thread, or else to
// the most recently created instance (driver-owned threads).

thread_local! {
    static CURRENT: Cell<Option<Host>> = const { Cell::new(None) };
}

static LAST: RwLock<Option<Host>> = RwLock::new(None);

struct CurrentHost(Option<Host>);

impl CurrentHost {
    fn enter(host: Host) -> CurrentHost {
        CurrentHost(CURRENT.with(|c| c.replace(Some(host))))
    }
}

impl Drop for CurrentHost {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.0));
    }
}

fn forget_host(host: Host) {
    if let Ok(mut last) = LAST.write()
        && last.as_ref().is_some_and(|h| h.ctx() == host.ctx())
    {
        *last = None;
    }
}

struct Forwarder;

impl log::Log for Forwarder {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let host = CURRENT.with(Cell::get).or_else(|| LAST.read().ok().and_then(|g| *g));
        if let Some(host) = host {
            host.log(record.level(), &record.args().to_string());
        }
    }

    fn flush(&self) {}
}

static FORWARDER: Forwarder = Forwarder;

fn install_logger(host: Host) {
    if let Ok(mut last) = LAST.write() {
        *last = Some(host);
    }
    // Fails only when already installed, which is fine.
    if log::set_logger(&FORWARDER).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Hooks, Scan};

    struct Plain;
    struct Releasing;

    impl Driver for Plain {
        fn create(_: Host, _: &Options) -> crate::Result<Self> {
            Ok(Plain)
        }
        fn scan(&self, _: &mut Scan<'_>) -> crate::Result<()> {
            Ok(())
        }
    }

    impl Driver for Releasing {
        const HOOKS: Hooks = Hooks { release: true, ..Hooks::NONE };
        fn create(_: Host, _: &Options) -> crate::Result<Self> {
            Ok(Releasing)
        }
        fn scan(&self, _: &mut Scan<'_>) -> crate::Result<()> {
            Ok(())
        }
    }

    fn desc<D: Driver>() -> abi::devhost_driver_desc {
        descriptor::<D>(c"t".as_ptr(), c"0".as_ptr(), std::ptr::null())
    }

    #[test]
    fn release_is_in_the_descriptor_only_with_the_hook() {
        assert!(desc::<Plain>().release.is_none());
        assert!(desc::<Releasing>().release.is_some());
    }

    #[test]
    fn descriptor_declares_the_full_size_and_the_current_version() {
        let d = desc::<Releasing>();
        assert_eq!(d.struct_size as usize, std::mem::size_of::<abi::devhost_driver_desc>());
        assert!(d.struct_size as usize > abi::DESC_SIZE_V1_0, "release lies past the v1.0 descriptor");
        assert_eq!((d.abi_major, d.abi_minor), (1, 3));
    }
}
