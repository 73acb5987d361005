//! The composition both kubelet fronts share: what a set of a resource's devices gives a
//! container. The devices' scanned edits are composed (conflicts logged: the first few in full,
//! then a count), turned into CDI names when the resource answers with CDI, and then amended by
//! the driver's allocate hook, whose call is counted in the metrics. The device plugin's Allocate
//! runs it once per container request, DRA's NodePrepareResources once per claim.

use crate::driver::device::{self, Edits};
use crate::driver::instance::{CallError, Instance};
use crate::engine::cdi;
use crate::engine::telemetry::{self, Metrics};

use super::View;

/// What one composition is asked for.
pub struct Ask<'a> {
    /// The physical devices (their devices are in the view; IDs not in it contribute nothing).
    pub physical: &'a [String],
    /// The answer carries the devices' CDI names instead of their raw edits (the `cdi` device
    /// list strategy).
    pub cdi_names: bool,
    /// A device whose own CDI names devhost defines gives those names instead of the edits they
    /// stand for (`View::through_cdi`).
    pub through_cdi: bool,
    /// The DRA claim's parameters for the allocate hook (ABI 1.3); `None` for a container.
    pub parameters: Option<String>,
}

/// The edits for `ask.physical` of resource `resource`, whose devices are in `view`. The
/// driver's allocate hook, if it has one, is called once with all of them (and the claim's
/// parameters) and its edits go on top.
pub async fn compose(
    resource: &str,
    view: &View,
    ask: Ask<'_>,
    driver: &Instance,
    metrics: &Metrics,
) -> Result<Edits, CallError> {
    let Ask { physical, cdi_names, through_cdi, parameters } = ask;
    let through = |id: &String| match through_cdi {
        true => view.through_cdi.get(id).or_else(|| view.physical(id)),
        false => view.physical(id),
    };
    let (mut edits, conflicts) = device::compose(physical.iter().filter_map(through));
    for conflict in conflicts.shown() {
        tracing::warn!(resource, "conflicting container edits: {conflict}");
    }
    if conflicts.unshown() > 0 {
        tracing::warn!(
            resource,
            "conflicting container edits: {} more in this request ({} in all; the first {} are logged above)",
            conflicts.unshown(),
            conflicts.total(),
            conflicts.shown().len()
        );
    }
    if cdi_names {
        edits = cdi::allocate_edits(resource, &view.devices, physical, edits);
    }
    let result = driver.allocate(physical.to_vec(), parameters).await;
    metrics.driver_call(&driver.name, "allocate", telemetry::call_outcome(&result));
    if let Some(hook) = result? {
        edits.amend(hook);
    }
    Ok(edits)
}
