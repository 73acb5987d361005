//! A minimal in-process host for exercising a driver module through the raw
//! ABI: it loads the `.so`, hands the driver a `devhost_host_api` whose
//! callbacks record everything, and returns the records to the test.

use devhost_abi::*;
use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// One thing a driver reported through the call handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Device {
        id: String,
        health: u32,
        numa: i32,
    },
    Attr(String, String),
    Link(String, u32),
    DeviceNode {
        host: String,
        container: String,
        perms: String,
    },
    Mount {
        host: String,
        container: String,
        read_only: u32,
    },
    Env(String, String),
    Annotation(String, String),
    Cdi(String),
    Prefer(String),
}

/// A failed driver call: its status and the message it attached.
#[derive(Debug, PartialEq, Eq)]
pub struct Failure {
    pub status: devhost_status,
    pub message: String,
}

/// What `host_ctx` points at: things reported outside calls.
#[derive(Default)]
pub struct HostState {
    pub logs: Mutex<Vec<(devhost_log_level, String)>>,
    pub changes: AtomicUsize,
}

/// What a `devhost_call *` points at.
#[derive(Default)]
struct Call {
    events: Vec<Event>,
    error: Option<String>,
}

fn text(s: devhost_str) -> String {
    // SAFETY: the driver passes ptr/len of live memory for the callback.
    let bytes = unsafe { s.as_bytes() }.unwrap_or(b"<NULL>");
    String::from_utf8_lossy(bytes).into_owned()
}

fn record(call: *mut devhost_call, event: Event) -> devhost_status {
    // SAFETY: every call handle this host gives out points at a live `Call`.
    unsafe { &mut *call.cast::<Call>() }.events.push(event);
    DEVHOST_OK
}

unsafe extern "C" fn log(ctx: *mut c_void, level: devhost_log_level, message: devhost_str) {
    // SAFETY: host_ctx is the `HostState` owned by the `Instance`.
    let state = unsafe { &*ctx.cast::<HostState>() };
    state
        .logs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((level, text(message)));
}
unsafe extern "C" fn devices_changed(ctx: *mut c_void) {
    // SAFETY: as in `log`.
    unsafe { &*ctx.cast::<HostState>() }
        .changes
        .fetch_add(1, Ordering::SeqCst);
}
unsafe extern "C" fn set_error(call: *mut devhost_call, message: devhost_str) {
    // SAFETY: as in `record`.
    unsafe { &mut *call.cast::<Call>() }.error = Some(text(message));
}
unsafe extern "C" fn device_begin(
    c: *mut devhost_call,
    id: devhost_str,
    health: u32,
    numa: i32,
) -> devhost_status {
    record(
        c,
        Event::Device {
            id: text(id),
            health,
            numa,
        },
    )
}
unsafe extern "C" fn device_attr(
    c: *mut devhost_call,
    k: devhost_str,
    v: devhost_str,
) -> devhost_status {
    record(c, Event::Attr(text(k), text(v)))
}
unsafe extern "C" fn device_link(
    c: *mut devhost_call,
    other: devhost_str,
    score: u32,
) -> devhost_status {
    record(c, Event::Link(text(other), score))
}
unsafe extern "C" fn add_device_node(
    c: *mut devhost_call,
    host: devhost_str,
    container: devhost_str,
    perms: devhost_str,
) -> devhost_status {
    record(
        c,
        Event::DeviceNode {
            host: text(host),
            container: text(container),
            perms: text(perms),
        },
    )
}
unsafe extern "C" fn add_mount(
    c: *mut devhost_call,
    host: devhost_str,
    container: devhost_str,
    ro: u32,
) -> devhost_status {
    record(
        c,
        Event::Mount {
            host: text(host),
            container: text(container),
            read_only: ro,
        },
    )
}
unsafe extern "C" fn add_env(
    c: *mut devhost_call,
    k: devhost_str,
    v: devhost_str,
) -> devhost_status {
    record(c, Event::Env(text(k), text(v)))
}
unsafe extern "C" fn add_annotation(
    c: *mut devhost_call,
    k: devhost_str,
    v: devhost_str,
) -> devhost_status {
    record(c, Event::Annotation(text(k), text(v)))
}
unsafe extern "C" fn add_cdi_device(c: *mut devhost_call, name: devhost_str) -> devhost_status {
    record(c, Event::Cdi(text(name)))
}
unsafe extern "C" fn prefer_device(c: *mut devhost_call, id: devhost_str) -> devhost_status {
    record(c, Event::Prefer(text(id)))
}

/// A complete v1.0 host API table pointing at `state`.
pub fn host_api(state: *const HostState) -> devhost_host_api {
    devhost_host_api {
        struct_size: size_of::<devhost_host_api>() as u32,
        abi_major: DEVHOST_ABI_MAJOR,
        abi_minor: DEVHOST_ABI_MINOR,
        host_ctx: state.cast_mut().cast(),
        log: Some(log),
        devices_changed: Some(devices_changed),
        set_error: Some(set_error),
        device_begin: Some(device_begin),
        device_attr: Some(device_attr),
        device_link: Some(device_link),
        add_device_node: Some(add_device_node),
        add_mount: Some(add_mount),
        add_env: Some(add_env),
        add_annotation: Some(add_annotation),
        add_cdi_device: Some(add_cdi_device),
        prefer_device: Some(prefer_device),
    }
}

/// Loads the module once per test process and never unloads it, as the host does.
pub fn descriptor(path: &str) -> &'static devhost_driver_desc {
    static DESC: OnceLock<usize> = OnceLock::new();
    let addr = *DESC.get_or_init(|| {
        // SAFETY: the module is our own example driver; its initialisers are trivial.
        let lib = unsafe { libloading::Library::new(path) }
            .unwrap_or_else(|e| panic!("loading {path}: {e}"));
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        // SAFETY: the symbol has the `EntryFn` signature by contract.
        let entry = unsafe { lib.get::<EntryFn>(DEVHOST_ENTRY_SYMBOL_V1.as_bytes()) }
            .expect("entry symbol");
        // SAFETY: the entry function has no preconditions.
        let desc = unsafe { entry() };
        assert!(!desc.is_null(), "{DEVHOST_ENTRY_SYMBOL_V1} returned NULL");
        desc as usize
    });
    // SAFETY: the descriptor is static data of a module that is never unloaded.
    unsafe { &*(addr as *const devhost_driver_desc) }
}

pub fn c_text(p: *const std::ffi::c_char) -> String {
    assert!(!p.is_null());
    // SAFETY: descriptor strings are static and NUL-terminated by contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn strs(items: &[&str]) -> Vec<devhost_str> {
    items.iter().map(|s| devhost_str::from_str(s)).collect()
}

fn finish(status: devhost_status, call: Call) -> Result<Vec<Event>, Failure> {
    match status {
        DEVHOST_OK => Ok(call.events),
        status => Err(Failure {
            status,
            message: call.error.unwrap_or_default(),
        }),
    }
}

/// A created driver instance; dropping it runs `destroy`.
pub struct Instance {
    desc: &'static devhost_driver_desc,
    ptr: *mut c_void,
    // Boxed so their addresses stay put while the driver holds them.
    _host: Box<devhost_host_api>,
    pub state: Box<HostState>,
}

impl Instance {
    pub fn create(
        desc: &'static devhost_driver_desc,
        options: &[(&str, &str)],
    ) -> Result<Self, Failure> {
        let state = Box::<HostState>::default();
        Self::create_with(desc, host_api(&*state), state, options)
    }

    pub fn create_with(
        desc: &'static devhost_driver_desc,
        api: devhost_host_api,
        state: Box<HostState>,
        options: &[(&str, &str)],
    ) -> Result<Self, Failure> {
        let host = Box::new(api);
        let kvs: Vec<devhost_kv> = options
            .iter()
            .map(|(k, v)| devhost_kv {
                key: devhost_str::from_str(k),
                value: devhost_str::from_str(v),
            })
            .collect();
        let mut call = Call::default();
        let mut ptr = std::ptr::null_mut();
        let create = desc.create.expect("create");
        // SAFETY: all pointers are live for the call; `host` outlives the instance.
        let status = unsafe {
            create(
                &*host,
                kvs.as_ptr(),
                kvs.len(),
                (&raw mut call).cast(),
                &mut ptr,
            )
        };
        finish(status, call)?;
        assert!(!ptr.is_null(), "create returned OK without an instance");
        Ok(Self {
            desc,
            ptr,
            _host: host,
            state,
        })
    }

    pub fn scan(&self) -> Result<Vec<Event>, Failure> {
        let mut call = Call::default();
        // SAFETY: the instance is live and the call handle outlives the call.
        let status = unsafe { self.desc.scan.expect("scan")(self.ptr, (&raw mut call).cast()) };
        finish(status, call)
    }

    pub fn allocate(&self, ids: &[&str]) -> Result<Vec<Event>, Failure> {
        self.ids_call(self.desc.allocate.expect("allocate"), ids)
    }

    pub fn pre_start(&self, ids: &[&str]) -> Result<Vec<Event>, Failure> {
        self.ids_call(self.desc.pre_start.expect("pre_start"), ids)
    }

    fn ids_call(&self, hook: IdsFn, ids: &[&str]) -> Result<Vec<Event>, Failure> {
        let ids = strs(ids);
        let mut call = Call::default();
        // SAFETY: as in `scan`; the ID array lives until the call returns.
        let status = unsafe { hook(self.ptr, ids.as_ptr(), ids.len(), (&raw mut call).cast()) };
        finish(status, call)
    }

    pub fn watch_start(&self) -> Result<Vec<Event>, Failure> {
        let mut call = Call::default();
        // SAFETY: as in `scan`.
        let status = unsafe {
            self.desc.watch_start.expect("watch_start")(self.ptr, (&raw mut call).cast())
        };
        finish(status, call)
    }

    pub fn watch_stop(&self) {
        // SAFETY: the instance is live.
        unsafe { self.desc.watch_stop.expect("watch_stop")(self.ptr) }
    }

    pub fn changes(&self) -> usize {
        self.state.changes.load(Ordering::SeqCst)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // SAFETY: created by `create` and destroyed exactly once.
        unsafe { self.desc.destroy.expect("destroy")(self.ptr) }
    }
}
