//! A validated module as the host calls it ([`Module`]: its descriptor, the optional hooks it
//! declared, `create` and teardown) and what it declared without its code ([`ModuleInfo`]),
//! which every instance carries, whether the module is mapped here or in a worker process.
//! Optional hooks are read only where the descriptor the driver declared reaches them.

use super::image::Source;
use devhost_abi as abi;

/// A validated driver module.
#[derive(Clone, Copy)]
pub struct Module {
    pub desc: &'static abi::devhost_driver_desc,
    /// Bytes of the descriptor the driver declared (fields past it are absent).
    pub declared: usize,
    pub name: &'static str,
    pub version: &'static str,
    pub description: &'static str,
    /// The file the bytes were read from, as it was then.
    pub source: &'static Source,
}

macro_rules! optional_field {
    ($self:ident, $field:ident) => {
        if abi::field_present(
            $self.declared,
            std::mem::offset_of!(abi::devhost_driver_desc, $field),
            std::mem::size_of::<usize>(),
        ) {
            $self.desc.$field
        } else {
            None
        }
    };
}

impl Module {
    pub fn allocate(&self) -> Option<abi::IdsFn> {
        optional_field!(self, allocate)
    }
    pub fn preferred_allocation(&self) -> Option<abi::PreferredAllocationFn> {
        optional_field!(self, preferred_allocation)
    }
    pub fn pre_start(&self) -> Option<abi::IdsFn> {
        optional_field!(self, pre_start)
    }
    pub fn watch_start(&self) -> Option<abi::ScanFn> {
        optional_field!(self, watch_start)
    }
    pub fn watch_stop(&self) -> Option<abi::WatchStopFn> {
        optional_field!(self, watch_stop)
    }
    /// ABI 1.1; a 1.0 descriptor ends before it, so a 1.0 module has none.
    pub fn release(&self) -> Option<abi::IdsFn> {
        optional_field!(self, release)
    }
    /// Calls the driver's `create` with `options`. The instance pointer is
    /// non-null only when the status is OK: a failed create owns nothing, so
    /// nothing it left must ever reach `destroy`.
    ///
    /// # Safety
    /// `api` must point to a host API table that outlives the instance.
    pub unsafe fn create_instance(
        &self,
        api: *const abi::devhost_host_api,
        options: &[(String, String)],
    ) -> (abi::devhost_status, crate::driver::callbacks::CallState, *mut std::ffi::c_void) {
        use crate::driver::callbacks::{CallCtx, CallKind};
        let kvs: Vec<abi::devhost_kv> = options
            .iter()
            .map(|(k, v)| abi::devhost_kv { key: abi::devhost_str::from_str(k), value: abi::devhost_str::from_str(v) })
            .collect();
        let ctx = CallCtx::new(CallKind::Create);
        let mut out: *mut std::ffi::c_void = std::ptr::null_mut();
        let Some(create) = self.desc.create else { return (abi::DEVHOST_ERR_INTERNAL, ctx.into_state(), out) };
        // SAFETY: the API table outlives the call (contract), the options live
        // for the call, and out is a valid slot.
        let status = unsafe { create(api, kvs.as_ptr(), kvs.len(), ctx.as_raw(), &mut out) };
        let mut st = ctx.into_state();
        if status != abi::DEVHOST_OK {
            return (status, st, std::ptr::null_mut());
        }
        if out.is_null() {
            st.error = Some("create returned OK but no instance".into());
            return (abi::DEVHOST_ERR_INTERNAL, st, out);
        }
        (status, st, out)
    }

    /// Stops and destroys a live instance: `watch_stop` (when the driver has
    /// it), then `destroy`.
    ///
    /// # Safety
    /// `inst` must come from this module's `create`, no other call may run on
    /// it, and it must not be used afterwards.
    pub unsafe fn teardown(&self, inst: *mut std::ffi::c_void) {
        if inst.is_null() {
            return;
        }
        if let Some(stop) = self.watch_stop() {
            // SAFETY: per the function contract.
            unsafe { stop(inst) };
        }
        if let Some(destroy) = self.desc.destroy {
            // SAFETY: per the function contract; destroy is called exactly once.
            unsafe { destroy(inst) };
        }
    }

    pub fn concurrent(&self) -> bool {
        self.desc.capabilities & abi::DEVHOST_CAP_CONCURRENT != 0
    }

    /// Human-readable list of hooks and capability bits, for `devhost drivers`.
    pub fn capabilities(&self) -> Vec<&'static str> {
        let mut caps = Vec::new();
        if self.allocate().is_some() {
            caps.push("allocate");
        }
        if self.preferred_allocation().is_some() {
            caps.push("preferred_allocation");
        }
        if self.pre_start().is_some() {
            caps.push("pre_start");
        }
        if self.watch_start().is_some() {
            caps.push("watch");
        }
        if self.release().is_some() {
            caps.push("release");
        }
        if self.concurrent() {
            caps.push("concurrent");
        }
        if self.desc.capabilities & abi::DEVHOST_CAP_CLAIM_PARAMETERS != 0 {
            caps.push("claim_parameters");
        }
        if self.desc.capabilities & abi::DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY != 0 {
            caps.push("allocate_claims_only");
        }
        caps
    }

    pub fn abi_version(&self) -> String {
        format!("{}.{}", self.desc.abi_major, self.desc.abi_minor)
    }

    /// The facts about this module that need no code: see [`ModuleInfo`].
    pub fn info(&self) -> ModuleInfo {
        ModuleInfo {
            name: self.name.to_string(),
            version: self.version.to_string(),
            description: self.description.to_string(),
            abi_major: self.desc.abi_major,
            abi_minor: self.desc.abi_minor,
            allocate: self.allocate().is_some(),
            preferred_allocation: self.preferred_allocation().is_some(),
            pre_start: self.pre_start().is_some(),
            watch: self.watch_start().is_some(),
            release: self.release().is_some(),
            concurrent: self.concurrent(),
            claim_parameters: self.desc.capabilities & abi::DEVHOST_CAP_CLAIM_PARAMETERS != 0,
            allocate_claims_only: self.desc.capabilities & abi::DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY != 0,
        }
    }
}

/// What a module declared about itself, without its code: which optional
/// hooks it has and how it names itself. Every driver instance carries one,
/// whether the module is mapped into this process or into an isolated
/// worker process (which reports it when it starts).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModuleInfo {
    pub name: String,
    pub version: String,
    pub description: String,
    pub abi_major: u16,
    pub abi_minor: u16,
    pub allocate: bool,
    pub preferred_allocation: bool,
    pub pre_start: bool,
    pub watch: bool,
    pub release: bool,
    pub concurrent: bool,
    /// The module declared `DEVHOST_CAP_CLAIM_PARAMETERS` (1.3): its allocate reads a DRA
    /// claim's parameters.
    pub claim_parameters: bool,
    /// The module declared `DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY` (1.3): its allocate is for DRA
    /// claims only.
    pub allocate_claims_only: bool,
}

impl ModuleInfo {
    /// Whether the driver reads a DRA claim's parameters: an allocate hook that declares
    /// `DEVHOST_CAP_CLAIM_PARAMETERS` (ABI 1.3).
    pub fn reads_claim_parameters(&self) -> bool {
        self.allocate && self.claim_parameters
    }
}
