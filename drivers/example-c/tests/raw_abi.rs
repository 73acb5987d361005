//! The two things the host never does, so they are driven through the raw
//! ABI: handing the driver a host table that is too short, and destroying an
//! instance whose watch thread still runs (the host calls `watch_stop`
//! first). The table, call handles and callbacks are still the host's own,
//! from `devhost::driver::callbacks`; only the call sequence is made here.

mod common;

use common::{module, threads_named};
use devhost::driver::callbacks::{self, CallCtx, CallKind, HostCtx};
use devhost_abi::*;
use std::ffi::c_void;
use std::sync::Arc;
use tokio::sync::Notify;

/// Calls the driver's `create` with `api`; the status, the message it set and the instance.
fn create(api: &devhost_host_api, options: &[(&str, &str)]) -> (devhost_status, Option<String>, *mut c_void) {
    let kvs: Vec<devhost_kv> = options
        .iter()
        .map(|(k, v)| devhost_kv { key: devhost_str::from_str(k), value: devhost_str::from_str(v) })
        .collect();
    let create = module().desc.create.expect("the loader checked create");
    let call = CallCtx::new(CallKind::Create);
    let mut instance = std::ptr::null_mut();
    // SAFETY: the table, options and call handle outlive the call; `instance` is a valid slot.
    let status = unsafe { create(api, kvs.as_ptr(), kvs.len(), call.as_raw(), &mut instance) };
    (status, call.into_state().error, instance)
}

fn host_ctx(driver: &str) -> HostCtx {
    HostCtx { driver: driver.into(), changed: Arc::new(Notify::new()), notice: None }
}

#[test]
fn host_table_without_needed_callbacks_is_refused() {
    let mut ctx = host_ctx("short-table");
    let mut api = callbacks::host_api((&raw mut ctx).cast());
    // A table that ends right after set_error, as a (hypothetical) smaller host would pass.
    api.struct_size = std::mem::offset_of!(devhost_host_api, device_begin) as u32;
    let (status, message, instance) = create(&api, &[]);
    assert_eq!(status, DEVHOST_ERR_UNSUPPORTED);
    assert!(instance.is_null(), "an instance despite the refusal");
    let message = message.expect("the refusal has a message");
    assert!(message.contains("lacks a v1.0 callback"), "{message}");
}

#[test]
fn destroy_joins_a_running_watch_thread() {
    let dir = tempfile::tempdir().expect("temp dir");
    let health = dir.path().join("health");
    let health = health.to_str().expect("temp paths are UTF-8").to_owned();
    // A thread of our own, so its name (which the watch thread inherits) is unique.
    let name = "raw-destroy";
    let run = move || {
        let mut ctx = host_ctx(name);
        let api = callbacks::host_api((&raw mut ctx).cast());
        let (status, message, instance) = create(&api, &[("health_file", &health)]);
        assert_eq!(status, DEVHOST_OK, "create: {message:?}");
        let m = module();
        let watch_start = m.watch_start().expect("the example watches");
        let call = CallCtx::new(CallKind::Watch);
        // SAFETY: a live instance; the call handle outlives the call.
        let status = unsafe { watch_start(instance, call.as_raw()) };
        assert_eq!(status, DEVHOST_OK, "watch_start: {:?}", call.into_state().error);
        assert_eq!(threads_named(name), 2, "no watch thread started");
        let destroy = m.desc.destroy.expect("the loader checked destroy");
        // SAFETY: created above, destroyed once, no watch_stop on purpose.
        unsafe { destroy(instance) };
        // Checked at once: a thread told to stop but not joined would still
        // be asleep in its poll.
        assert_eq!(threads_named(name), 1, "the watch thread outlived destroy");
        // `ctx` drops only now: the joined thread can no longer reach it.
        drop(ctx);
    };
    let thread = std::thread::Builder::new().name(name.into()).spawn(run).expect("spawn");
    if let Err(panic) = thread.join() {
        std::panic::resume_unwind(panic);
    }
}
