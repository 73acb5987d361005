//! The driver's handle on the host: logging and "devices changed".

use devhost_abi as abi;
use std::ffi::c_void;

/// A handle on the host for one driver instance. Cheap to clone; usable from
/// any thread until the instance's `watch_stop`/destroy has returned.
#[derive(Clone, Copy)]
pub struct Host {
    api: *const abi::devhost_host_api,
}

// SAFETY: the ABI guarantees that `log` and `devices_changed` may be called
// from any thread while the instance lives, and the API struct is immutable.
unsafe impl Send for Host {}
// SAFETY: as above; the host API is read-only and its callbacks thread-safe.
unsafe impl Sync for Host {}

impl Host {
    /// # Safety
    /// `api` must be the host API handed to `create`, valid until destroy.
    pub(crate) unsafe fn from_raw(api: *const abi::devhost_host_api) -> Self {
        Host { api }
    }

    pub(crate) fn api(&self) -> &abi::devhost_host_api {
        // SAFETY: valid for the life of the instance (ABI contract).
        unsafe { &*self.api }
    }

    fn has(&self, offset: usize) -> bool {
        abi::field_present(self.api().struct_size as usize, offset, std::mem::size_of::<usize>())
    }

    /// Whether this host takes a reason with a device's health
    /// ([`DeviceBuilder::reason`](crate::DeviceBuilder::reason), ABI 1.2).
    pub fn takes_health_reasons(&self) -> bool {
        self.has(std::mem::offset_of!(abi::devhost_host_api, device_health_reason))
            && self.api().device_health_reason.is_some()
    }

    /// Tells the host that devices or their health may have changed; the
    /// host re-scans soon after. Cheap, never blocks, safe from any thread.
    pub fn devices_changed(&self) {
        let api = self.api();
        if !self.has(std::mem::offset_of!(abi::devhost_host_api, devices_changed)) {
            return;
        }
        if let Some(f) = api.devices_changed {
            // SAFETY: host callback with its own context, per the ABI.
            unsafe { f(api.host_ctx) }
        }
    }

    /// Logs through the host's logger.
    pub fn log(&self, level: log::Level, message: &str) {
        let api = self.api();
        if !self.has(std::mem::offset_of!(abi::devhost_host_api, log)) {
            return;
        }
        if let Some(f) = api.log {
            let level = match level {
                log::Level::Error => abi::DEVHOST_LOG_ERROR,
                log::Level::Warn => abi::DEVHOST_LOG_WARN,
                log::Level::Info => abi::DEVHOST_LOG_INFO,
                log::Level::Debug => abi::DEVHOST_LOG_DEBUG,
                log::Level::Trace => abi::DEVHOST_LOG_TRACE,
            };
            // SAFETY: the message is borrowed for the duration of the call.
            unsafe { f(api.host_ctx, level, abi::devhost_str::from_str(message)) }
        }
    }

    pub(crate) fn ctx(&self) -> *mut c_void {
        self.api().host_ctx
    }
}
