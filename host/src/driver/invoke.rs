//! One call into a driver module's hook: the unsafe call that both backends make, the
//! in-process driver thread (`instance`) and the worker process (`isolation/worker`), written
//! once because it is the one path where memory safety matters (the conformance kit's
//! overlapping calls use it too). `create` and `destroy` are the
//! module's own methods (`loader::Module::create_instance`, `teardown`), which both call too.

use crate::driver::callbacks::{CallCtx, CallKind, CallState, ScanGuard};
use crate::driver::loader::Module;
use devhost_abi as abi;
use std::ffi::c_void;

/// A hook call and what it passes: the driver reads the borrowed lists during the call only.
#[derive(Clone, Copy, Debug)]
pub enum Hook<'a> {
    Scan,
    WatchStart,
    /// The IDs, and the DRA claim's parameters (`None` for a device-plugin container).
    Allocate(&'a [String], Option<&'a str>),
    Preferred {
        available: &'a [String],
        must: &'a [String],
        size: u32,
    },
    PreStart(&'a [String]),
    Release(&'a [String]),
}

impl Hook<'_> {
    /// The hook's name in the ABI (and in every message about the call).
    pub fn name(&self) -> &'static str {
        match self {
            Hook::Scan => "scan",
            Hook::WatchStart => "watch_start",
            Hook::Allocate(..) => "allocate",
            Hook::Preferred { .. } => "preferred_allocation",
            Hook::PreStart(_) => "pre_start",
            Hook::Release(_) => "release",
        }
    }

    fn kind(&self) -> CallKind {
        match self {
            Hook::Scan => CallKind::Scan,
            Hook::WatchStart => CallKind::Watch,
            Hook::Allocate(..) => CallKind::Allocate,
            Hook::Preferred { .. } => CallKind::Preferred,
            Hook::PreStart(_) => CallKind::PreStart,
            Hook::Release(_) => CallKind::Release,
        }
    }
}

/// A call the host refuses before it reaches the driver.
pub fn refuse(message: String) -> (abi::devhost_status, CallState) {
    let mut state = CallState::default();
    state.error = Some(message);
    (abi::DEVHOST_ERR_INTERNAL, state)
}

/// Calls `hook` of `module` on instance `inst` and returns the driver's status with what it
/// emitted. No instance (create has not succeeded) or a module without the hook is refused
/// with `DEVHOST_ERR_INTERNAL` and a message, without a call.
///
/// # Safety
/// `inst` is null or the live instance that `module`'s create returned, not yet destroyed, and
/// no other call of that instance runs at the same time (the ABI's rule; only a module that
/// declares `DEVHOST_CAP_CONCURRENT` may be called from several threads at once, which the
/// conformance kit checks).
pub unsafe fn invoke(module: &Module, inst: *mut c_void, hook: Hook<'_>) -> (abi::devhost_status, CallState) {
    if inst.is_null() {
        return refuse(format!("module {}: no instance (create has not succeeded)", module.name));
    }
    let missing = || refuse(format!("module {} has no {} hook", module.name, hook.name()));
    let parameters = match hook {
        Hook::Allocate(_, parameters) => parameters.map(str::to_owned),
        _ => None,
    };
    let ctx = CallCtx::with_parameters(hook.kind(), parameters);
    let status = match hook {
        Hook::Scan | Hook::WatchStart => {
            let f = if matches!(hook, Hook::Scan) { module.desc.scan } else { module.watch_start() };
            let Some(f) = f else { return missing() };
            // A change notice from inside scan would only ask for the scan that is running.
            let _scanning = matches!(hook, Hook::Scan).then(ScanGuard::enter);
            // SAFETY: a live instance on its calling thread (the caller's promise); ctx outlives
            // the call.
            unsafe { f(inst, ctx.as_raw()) }
        }
        Hook::Allocate(ids, _) | Hook::PreStart(ids) | Hook::Release(ids) => {
            let f = match hook {
                Hook::Allocate(..) => module.allocate(),
                Hook::PreStart(_) => module.pre_start(),
                _ => module.release(),
            };
            let Some(f) = f else { return missing() };
            let views = str_views(ids);
            // SAFETY: as above; the views borrow `ids`, alive for the call.
            unsafe { f(inst, views.as_ptr(), views.len(), ctx.as_raw()) }
        }
        Hook::Preferred { available, must, size } => {
            let Some(f) = module.preferred_allocation() else { return missing() };
            let (a, m) = (str_views(available), str_views(must));
            // SAFETY: as above; the views borrow both lists, alive for the call.
            unsafe { f(inst, a.as_ptr(), a.len(), m.as_ptr(), m.len(), size, ctx.as_raw()) }
        }
    };
    (status, ctx.into_state())
}

/// Borrowed ID lists for one call, kept alive while the driver reads them.
fn str_views(ids: &[String]) -> Vec<abi::devhost_str> {
    ids.iter().map(|s| abi::devhost_str::from_str(s)).collect()
}
