//! The callbacks of a driver instance rather than of one call, which a driver may make from any
//! thread while the instance lives: `log` and `devices_changed`, with the per-instance context
//! behind `host_ctx` and the guard that keeps a scan from asking for itself. `callbacks` puts
//! them in the host API table beside the per-call ones.

use devhost_abi as abi;
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    /// Set while this thread runs a driver's scan.
    pub static IN_SCAN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the current thread as running a scan until dropped.
pub struct ScanGuard;

impl ScanGuard {
    pub fn enter() -> ScanGuard {
        IN_SCAN.with(|c| c.set(true));
        ScanGuard
    }
}

impl Drop for ScanGuard {
    fn drop(&mut self) {
        IN_SCAN.with(|c| c.set(false));
    }
}

/// Per-instance context behind `host_ctx`: where logs and change
/// notifications go.
pub struct HostCtx {
    pub driver: String,
    pub changed: std::sync::Arc<tokio::sync::Notify>,
    /// Runs first on `devices_changed`: an in-process instance queues the
    /// scan on its own thread at once (see `instance::NoticeScan`).
    pub notice: Option<std::sync::Arc<dyn Fn() + Send + Sync>>,
}

/// # Safety
/// Called by a driver per the ABI: `host_ctx` is the context the host
/// handed to this instance, and `message` is readable for the call.
pub unsafe extern "C" fn log(host_ctx: *mut c_void, level: abi::devhost_log_level, message: abi::devhost_str) {
    if host_ctx.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: host_ctx is the HostCtx the host created for this instance.
        let ctx = unsafe { &*(host_ctx as *const HostCtx) };
        // SAFETY: borrowed for the callback.
        let bytes = unsafe { message.as_bytes() }.unwrap_or(b"(NULL message)");
        emit_log(&ctx.driver, level, &String::from_utf8_lossy(bytes));
    }));
}

/// Re-emits a driver's log record through `tracing`, with the instance name.
pub fn emit_log(driver: &str, level: abi::devhost_log_level, msg: &str) {
    match level {
        abi::DEVHOST_LOG_ERROR => tracing::error!(driver, "{msg}"),
        abi::DEVHOST_LOG_WARN => tracing::warn!(driver, "{msg}"),
        abi::DEVHOST_LOG_INFO => tracing::info!(driver, "{msg}"),
        abi::DEVHOST_LOG_DEBUG => tracing::debug!(driver, "{msg}"),
        _ => tracing::trace!(driver, "{msg}"),
    }
}

/// # Safety
/// Called by a driver per the ABI: `host_ctx` is the context the host
/// handed to this instance, and `message` is readable for the call.
pub unsafe extern "C" fn devices_changed(host_ctx: *mut c_void) {
    // From inside scan it would ask for the scan that is running: a rescan
    // loop. The scan's own output is what counts.
    if host_ctx.is_null() || IN_SCAN.with(std::cell::Cell::get) {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as in `log`.
        let ctx = unsafe { &*(host_ctx as *const HostCtx) };
        if let Some(notice) = &ctx.notice {
            notice();
        }
        // One stored permit: bursts collapse into a single rescan.
        ctx.changed.notify_one();
    }));
}
