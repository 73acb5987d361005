//! Safe wrappers over the host's emitter callbacks: what a driver reports
//! from `scan`, `allocate` and `preferred_allocation`.

use crate::Health;
use devhost_abi as abi;
use std::mem::offset_of;

/// Borrowed call context: the host API and the call handle.
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    pub(crate) api: &'a abi::devhost_host_api,
    pub(crate) call: *mut abi::devhost_call,
}

fn s(v: &str) -> abi::devhost_str {
    abi::devhost_str::from_str(v)
}

macro_rules! callback {
    ($api:expr, $field:ident) => {{
        let api: &abi::devhost_host_api = $api;
        if abi::field_present(
            api.struct_size as usize,
            offset_of!(abi::devhost_host_api, $field),
            std::mem::size_of::<usize>(),
        ) {
            api.$field
        } else {
            None
        }
    }};
}

impl Call<'_> {
    pub(crate) fn set_error(&self, message: &str) {
        if let Some(f) = callback!(self.api, set_error) {
            // SAFETY: call handle valid for this call; message borrowed.
            unsafe { f(self.call, s(message)) }
        }
    }
}

/// Container edits, shared by devices in `scan` and responses in `allocate`.
macro_rules! edit_methods {
    () => {
        /// A device node for the container; `permissions` ⊆ "rwm".
        pub fn device_node(&mut self, host_path: &str, container_path: &str, permissions: &str) -> &mut Self {
            if let Some(f) = callback!(self.call.api, add_device_node) {
                // SAFETY: strings borrowed for the call; handle valid.
                unsafe { f(self.call.call, s(host_path), s(container_path), s(permissions)) };
            }
            self
        }
        /// A bind mount for the container.
        pub fn mount(&mut self, host_path: &str, container_path: &str, read_only: bool) -> &mut Self {
            if let Some(f) = callback!(self.call.api, add_mount) {
                // SAFETY: as above.
                unsafe { f(self.call.call, s(host_path), s(container_path), u32::from(read_only)) };
            }
            self
        }
        /// An environment variable for the container.
        pub fn env(&mut self, key: &str, value: &str) -> &mut Self {
            if let Some(f) = callback!(self.call.api, add_env) {
                // SAFETY: as above.
                unsafe { f(self.call.call, s(key), s(value)) };
            }
            self
        }
        /// An annotation for the container runtime.
        pub fn annotation(&mut self, key: &str, value: &str) -> &mut Self {
            if let Some(f) = callback!(self.call.api, add_annotation) {
                // SAFETY: as above.
                unsafe { f(self.call.call, s(key), s(value)) };
            }
            self
        }
        /// A fully-qualified CDI device name (`vendor.com/class=name`).
        pub fn cdi(&mut self, name: &str) -> &mut Self {
            if let Some(f) = callback!(self.call.api, add_cdi_device) {
                // SAFETY: as above.
                unsafe { f(self.call.call, s(name)) };
            }
            self
        }
    };
}

/// The output of `scan`.
pub struct Scan<'a> {
    pub(crate) call: Call<'a>,
}

impl Scan<'_> {
    /// Starts reporting a device; describe it through the returned builder.
    pub fn device(&mut self, id: &str, health: Health, numa_node: Option<u32>) -> DeviceBuilder<'_> {
        let h = match health {
            Health::Healthy => abi::DEVHOST_HEALTH_HEALTHY,
            Health::Unhealthy => abi::DEVHOST_HEALTH_UNHEALTHY,
        };
        let numa = numa_node.and_then(|n| i32::try_from(n).ok()).unwrap_or(abi::DEVHOST_NUMA_NONE);
        if let Some(f) = callback!(self.call.api, device_begin) {
            // SAFETY: id borrowed for the call; handle valid during scan.
            unsafe { f(self.call.call, s(id), h, numa) };
        }
        DeviceBuilder { call: self.call, _scan: std::marker::PhantomData }
    }
}

/// Describes the device most recently started with [`Scan::device`].
pub struct DeviceBuilder<'s> {
    call: Call<'s>,
    _scan: std::marker::PhantomData<&'s mut ()>,
}

impl DeviceBuilder<'_> {
    /// An attribute, matched by the manifest's `match` globs.
    pub fn attr(&mut self, key: &str, value: &str) -> &mut Self {
        if let Some(f) = callback!(self.call.api, device_attr) {
            // SAFETY: strings borrowed for the call; handle valid.
            unsafe { f(self.call.call, s(key), s(value)) };
        }
        self
    }
    /// Why the device has the health it was reported with, e.g. `"critical Xid 79"` for an
    /// Unhealthy one (ABI 1.2). The host logs it with the device's next health change and shows
    /// it in `devhost list` and `/status`. A host older than 1.2 has no such callback: the
    /// reason is then dropped and the health still counts.
    pub fn reason(&mut self, reason: &str) -> &mut Self {
        if let Some(f) = callback!(self.call.api, device_health_reason) {
            // SAFETY: as above.
            unsafe { f(self.call.call, s(reason)) };
        }
        self
    }
    /// How well this device is connected to `other_id` (higher is better).
    pub fn link(&mut self, other_id: &str, score: u32) -> &mut Self {
        if let Some(f) = callback!(self.call.api, device_link) {
            // SAFETY: as above.
            unsafe { f(self.call.call, s(other_id), score) };
        }
        self
    }
    edit_methods!();
}

/// Container edits added by the `allocate` hook.
pub struct Edits<'a> {
    pub(crate) call: Call<'a>,
}

impl Edits<'_> {
    edit_methods!();

    /// The vendor parameters of the DRA claim this allocate prepares (ABI 1.3): a JSON array
    /// of the `parameters` objects of every opaque config entry for this driver that applies
    /// to the claim, the DeviceClass's first, then the claim's (a later entry overrides an
    /// earlier one), compact with sorted keys; `"[]"` when the claim has none. `None` when the
    /// allocate is for a device-plugin container, or the host is older than 1.3. Validate it
    /// and refuse bad parameters with [`Error::invalid_argument`](crate::Error::invalid_argument):
    /// the claim's NodePrepareResources fails with that message.
    pub fn claim_parameters(&self) -> Option<&str> {
        let f = callback!(self.call.api, claim_parameters)?;
        let mut out = s("");
        // SAFETY: call handle valid for this call; `out` is a writable slot.
        if unsafe { f(self.call.call, &mut out) } != abi::DEVHOST_OK {
            return None;
        }
        // SAFETY: the host's text stays valid until the allocate returns, which outlives `self`.
        let bytes = unsafe { out.as_bytes() }?;
        std::str::from_utf8(bytes).ok()
    }
}

/// The question asked of the `preferred_allocation` hook.
#[derive(Debug)]
pub struct PreferredRequest<'a> {
    pub available: Vec<&'a str>,
    pub must_include: Vec<&'a str>,
    pub size: usize,
}

/// The answer of the `preferred_allocation` hook.
pub struct Preferred<'a> {
    pub(crate) call: Call<'a>,
}

impl Preferred<'_> {
    /// Proposes one device, in order of preference.
    pub fn prefer(&mut self, id: &str) -> &mut Self {
        if let Some(f) = callback!(self.call.api, prefer_device) {
            // SAFETY: id borrowed for the call; handle valid.
            unsafe { f(self.call.call, s(id)) };
        }
        self
    }
}
