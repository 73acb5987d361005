//! Overlapping calls into one instance, for a driver that claims
//! `DEVHOST_CAP_CONCURRENT`. Today's host serialises every call whatever the
//! bit says, so `Instance` cannot make them overlap; this drives the
//! descriptor's functions directly from several threads, with the host's real
//! callbacks, exactly as a host using the freedom would.

use super::{Report, Verdict};
use crate::driver::callbacks::{self, CallCtx, CallKind, HostCtx};
use crate::driver::device::Device;
use crate::driver::loader::Module;
use devhost_abi as abi;
use std::ffi::c_void;
use std::sync::{Arc, Barrier};

const THREADS: usize = 8;
const ROUNDS: usize = 50;

/// The host side one raw instance points into; boxed so its address is stable.
struct HostSide {
    ctx: HostCtx,
    api: abi::devhost_host_api,
}

/// The instance pointer, shared by the threads of a concurrent driver.
#[derive(Clone, Copy)]
struct Shared(*mut c_void);
// SAFETY: the driver declared DEVHOST_CAP_CONCURRENT: it is thread-safe.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

fn views(ids: &[String]) -> Vec<abi::devhost_str> {
    ids.iter().map(|s| abi::devhost_str::from_str(s)).collect()
}

/// One round of every concurrent call; the first problem, if any.
fn round(m: &Module, inst: Shared, expected: &[String], first: &[String]) -> Result<(), String> {
    let desc = m.desc;
    let ctx = CallCtx::new(CallKind::Scan);
    let status = {
        let _scanning = callbacks::ScanGuard::enter();
        // SAFETY: a live instance of a driver that allows overlapping calls; ctx outlives the call.
        desc.scan.map_or(abi::DEVHOST_ERR_INTERNAL, |f| unsafe { f(inst.0, ctx.as_raw()) })
    };
    let state = ctx.into_state();
    if status != abi::DEVHOST_OK {
        return Err(format!("scan returned {status}: {}", state.error.unwrap_or_default()));
    }
    let ids: Vec<String> = state.devices.iter().map(|d| d.id.clone()).collect();
    if ids != expected {
        return Err(format!("an overlapping scan reported {ids:?}, not {expected:?}"));
    }
    let v = views(first);
    let calls: [(&str, Option<abi::IdsFn>, CallKind); 3] = [
        ("allocate", m.allocate(), CallKind::Allocate),
        ("pre_start", m.pre_start(), CallKind::PreStart),
        ("release", m.release(), CallKind::Release),
    ];
    for (name, f, kind) in calls {
        let Some(f) = f else { continue };
        let ctx = CallCtx::new(kind);
        // SAFETY: as above; `v` borrows `first`, alive for the call.
        let status = unsafe { f(inst.0, v.as_ptr(), v.len(), ctx.as_raw()) };
        if status != abi::DEVHOST_OK && status != abi::DEVHOST_ERR_NOT_FOUND {
            return Err(format!("{name} returned {status}: {}", ctx.into_state().error.unwrap_or_default()));
        }
    }
    if let Some(f) = m.preferred_allocation() {
        let all = views(expected);
        let ctx = CallCtx::new(CallKind::Preferred);
        // SAFETY: as above.
        let status = unsafe { f(inst.0, all.as_ptr(), all.len(), v.as_ptr(), v.len(), v.len() as u32, ctx.as_raw()) };
        if status != abi::DEVHOST_OK {
            return Err(format!(
                "preferred_allocation returned {status}: {}",
                ctx.into_state().error.unwrap_or_default()
            ));
        }
    }
    Ok(())
}

pub(super) fn concurrent(r: &mut Report, m: Module, options: &[(String, String)], devices: &[Device]) {
    const CHECK: &str = "concurrent calls";
    if !m.concurrent() {
        return r.add(CHECK, Verdict::Skip, "the driver does not claim DEVHOST_CAP_CONCURRENT: calls never overlap");
    }
    let mut host = Box::new(HostSide {
        ctx: HostCtx {
            driver: "conformance-concurrent".into(),
            changed: Arc::new(tokio::sync::Notify::new()),
            notice: None,
        },
        api: callbacks::host_api(std::ptr::null_mut()),
    });
    let ctx_ptr: *mut HostCtx = &mut host.ctx;
    host.api.host_ctx = ctx_ptr.cast();
    // SAFETY: the API table lives in `host`, which outlives the instance (teardown below).
    let (status, state, inst) = unsafe { m.create_instance(&host.api, options) };
    if status != abi::DEVHOST_OK {
        return r.add(CHECK, Verdict::Fail, format!("create returned {status}: {}", state.error.unwrap_or_default()));
    }
    let inst = Shared(inst);
    let expected: Arc<Vec<String>> = Arc::new(devices.iter().map(|d| d.id.clone()).collect());
    let first: Arc<Vec<String>> = Arc::new(expected.iter().take(1).cloned().collect());
    let start = Arc::new(Barrier::new(THREADS));
    let (done, results) = std::sync::mpsc::channel::<Result<(), String>>();
    for _ in 0..THREADS {
        let (start, expected, first, done) = (start.clone(), expected.clone(), first.clone(), done.clone());
        std::thread::spawn(move || {
            start.wait();
            let _ = done.send((0..ROUNDS).try_for_each(|_| round(&m, inst, &expected, &first)));
        });
    }
    drop(done);
    // A driver that deadlocks under overlapping calls must not hang the battery.
    let limit = super::DEADLINE * 6;
    let until = std::time::Instant::now() + limit;
    let mut failures = Vec::new();
    for _ in 0..THREADS {
        match results.recv_timeout(until.saturating_duration_since(std::time::Instant::now())) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failures.push(e),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => failures.push("a calling thread panicked".into()),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                // The instance and its host side stay behind with the stuck threads.
                std::mem::forget(host);
                return r.add(
                    CHECK,
                    Verdict::Fail,
                    format!("overlapping calls did not return within {limit:?}: a deadlock?"),
                );
            }
        }
    }
    // SAFETY: every thread has returned; no other call runs on the instance.
    unsafe { m.teardown(inst.0) };
    drop(host);
    match failures.into_iter().next() {
        None => r.add(
            CHECK,
            Verdict::Pass,
            format!("{THREADS} threads x {ROUNDS} rounds of every concurrent call, all consistent"),
        ),
        Some(e) => r.add(CHECK, Verdict::Fail, e),
    }
}
