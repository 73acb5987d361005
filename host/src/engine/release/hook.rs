//! The driver's release hook (ABI 1.1) as both fronts call it: the Device Plugin front when the
//! last container holding a device lets go of it (`engine/release`, following the PodResources API), the DRA front
//! in NodeUnprepareResources. [`Releaser`] is what a caller needs of a driver instance, and
//! [`outcome`] is how a call's result counts: NOT_FOUND means the devices are gone, so there is
//! nothing left to clean.

use std::future::Future;
use std::sync::Arc;

use devhost_abi as abi;

use crate::driver::instance::{CallError, Instance};
use crate::engine::telemetry::{self, Metrics};

/// What a release caller needs from a driver instance; [`DriverReleaser`] in the daemon (so that no
/// call of the hook goes uncounted), a fake in the tests.
pub trait Releaser: Send + Sync + 'static {
    /// Whether the driver has a release hook at all.
    fn has_release(&self) -> bool;
    /// Calls the hook with the instance's deadline, off the async runtime.
    fn release(&self, ids: Vec<String>) -> impl Future<Output = Result<bool, CallError>> + Send;
}

/// The releaser both fronts use: a driver instance, its release hook called for them and each call
/// counted in `devhost_driver_calls_total` (`call="release"`).
pub struct DriverReleaser {
    pub instance: Arc<Instance>,
    pub metrics: Arc<Metrics>,
}

impl Releaser for DriverReleaser {
    fn has_release(&self) -> bool {
        self.instance.module.release
    }

    fn release(&self, ids: Vec<String>) -> impl Future<Output = Result<bool, CallError>> + Send {
        let (instance, metrics) = (self.instance.clone(), self.metrics.clone());
        async move {
            let result = instance.release(ids).await;
            // Without a hook nothing was called.
            if instance.module.release {
                metrics.driver_call(&instance.name, "release", telemetry::call_outcome(&result));
            }
            result
        }
    }
}

/// How a release call ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The devices are clean.
    Done,
    /// The driver does not know the devices any more: nothing to clean.
    Gone(String),
    /// Anything else, with the message for the operator; retried.
    Failed(String),
}

/// How a call result counts: the driver saying NOT_FOUND means the devices are gone.
pub fn outcome(result: Result<bool, CallError>) -> Outcome {
    match result {
        Ok(_) => Outcome::Done,
        Err(e @ CallError::Status { code: abi::DEVHOST_ERR_NOT_FOUND, .. }) => Outcome::Gone(e.to_string()),
        Err(e) => Outcome::Failed(e.to_string()),
    }
}
