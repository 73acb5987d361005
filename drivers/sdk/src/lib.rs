//! Safe Rust SDK for devhost driver modules.
//!
//! A driver implements [`Driver`] and exports it with [`export_driver!`]; the
//! macro builds the static ABI descriptor and every `extern "C"` entry point.
//! Driver code never writes `unsafe`: the SDK turns borrowed C strings into
//! `&str`, forwards `log` records to the host, and catches panics at every
//! export (a panic becomes `DEVHOST_ERR_PANIC` and poisons the instance).
//!
//! ```ignore
//! use devhost_sdk::{Driver, Host, Options, Result, Scan, Health};
//! struct Mine;
//! impl Driver for Mine {
//!     fn create(_host: Host, options: &Options) -> Result<Self> { options.deny_unknown(&[])?; Ok(Mine) }
//!     fn scan(&self, scan: &mut Scan<'_>) -> Result<()> {
//!         scan.device("dev-0", Health::Healthy, None).attr("model", "m1").env("MINE", "dev-0");
//!         Ok(())
//!     }
//! }
//! devhost_sdk::export_driver!(Mine, name = "mine", version = env!("CARGO_PKG_VERSION"));
//! ```

mod error;
mod export;
mod host;
mod options;
mod output;

pub use error::{Error, Result, Status};
pub use host::Host;
pub use options::Options;
pub use output::{DeviceBuilder, Edits, Preferred, PreferredRequest, Scan};

/// Re-exported so the export macro can name it from the driver crate.
pub use devhost_abi as abi;

#[doc(hidden)]
pub mod __private {
    pub use crate::export::*;
}

/// Health of a device as the driver sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy,
}

/// Which optional hooks a driver implements. Hooks left `false` are NULL in
/// the descriptor, so the host uses its own defaults. Write
/// `Hooks { allocate: true, ..Hooks::NONE }`: hooks added by later ABI minors
/// then leave your driver compiling unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hooks {
    pub allocate: bool,
    pub preferred_allocation: bool,
    pub pre_start: bool,
    pub watch: bool,
    /// ABI 1.1: reset devices no container holds any more ([`Driver::release`]).
    pub release: bool,
}

impl Hooks {
    pub const NONE: Hooks =
        Hooks { allocate: false, preferred_allocation: false, pre_start: false, watch: false, release: false };
}

/// A devhost driver. One value of the implementing type is one driver
/// instance (one `[driver.X]` table of the manifest).
pub trait Driver: Sized + Send + Sync + 'static {
    /// Optional hooks this driver implements.
    const HOOKS: Hooks = Hooks::NONE;
    /// Set when every method may run concurrently on several threads.
    const CONCURRENT: bool = false;
    /// Set when `allocate` reads a DRA claim's parameters ([`Edits::claim_parameters`], ABI
    /// 1.3). Without it the host refuses a claim that carries opaque parameters for the driver
    /// rather than prepare it as if they were not there.
    const READS_CLAIM_PARAMETERS: bool = false;
    /// Set when `allocate` has nothing to add without a DRA claim: the host then calls it only
    /// for claims (ABI 1.3), which saves a call on every device-plugin container start.
    const ALLOCATE_CLAIMS_ONLY: bool = false;

    /// Builds an instance from its options. Keep `host` to log from your own
    /// threads and to call [`Host::devices_changed`].
    fn create(host: Host, options: &Options) -> Result<Self>;

    /// Reports every device the driver sees.
    fn scan(&self, scan: &mut Scan<'_>) -> Result<()>;

    /// Adds or overrides container edits for the devices of one container
    /// (only called when `HOOKS.allocate`).
    fn allocate(&self, _device_ids: &[&str], _edits: &mut Edits<'_>) -> Result<()> {
        Ok(())
    }

    /// Proposes devices for one container (only called when
    /// `HOOKS.preferred_allocation`).
    fn preferred_allocation(&self, _request: &PreferredRequest<'_>, _out: &mut Preferred<'_>) -> Result<()> {
        Ok(())
    }

    /// Runs before a container with these devices starts (only called when
    /// `HOOKS.pre_start`).
    fn pre_start(&self, _device_ids: &[&str]) -> Result<()> {
        Ok(())
    }

    /// Starts the driver's own event threads (only called when `HOOKS.watch`).
    fn watch_start(&self) -> Result<()> {
        Ok(())
    }

    /// Stops and joins those threads (only called when `HOOKS.watch`).
    fn watch_stop(&self) {}

    /// Resets or scrubs devices that one container held and no container
    /// holds any more (only called when `HOOKS.release`; ABI 1.1). Runs on a
    /// host thread with the call deadline and may block for the reset. While
    /// it runs the host reports the devices Unhealthy; an error keeps them
    /// Unhealthy with its message, and the host retries with growing pauses.
    /// Return [`Error::not_found`] for devices that are gone (no retry). Must
    /// be safe to repeat on a device that is already clean.
    fn release(&self, _device_ids: &[&str]) -> Result<()> {
        Ok(())
    }
}

/// Exports a [`Driver`] implementation as a devhost module: defines the
/// `devhost_driver_entry_v1` symbol returning its static descriptor.
///
/// `export_driver!(MyDriver, name = "mine", version = env!("CARGO_PKG_VERSION"), description = "…")`
#[macro_export]
macro_rules! export_driver {
    ($ty:ty, name = $name:expr, version = $version:expr $(, description = $desc:expr)? $(,)?) => {
        /// The devhost ABI v1 entry point of this module.
        #[unsafe(no_mangle)]
        pub extern "C" fn devhost_driver_entry_v1() -> *const $crate::abi::devhost_driver_desc {
            static DESC: $crate::abi::devhost_driver_desc = $crate::__private::descriptor::<$ty>(
                concat!($name, "\0").as_ptr().cast(),
                concat!($version, "\0").as_ptr().cast(),
                $crate::export_driver!(@desc $($desc)?),
            );
            &DESC
        }
    };
    (@desc) => { ::core::ptr::null() };
    (@desc $desc:expr) => { concat!($desc, "\0").as_ptr().cast() };
}
