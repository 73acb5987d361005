//! The kubelet's DRA resource health service (`DRAResourceHealth.NodeWatchResources`, v1 and
//! v1alpha1), served on the plugin socket beside the plugin service. The kubelet opens one
//! stream per registered driver (when the registration lists the service) and puts each
//! allocated device's health, with its message, in the pod's
//! `status.containerStatuses[].allocatedResourcesStatus`.
//!
//! Each report is the full list of the resource's devices in its one pool (the node), healthy or
//! not, the message being the driver's health reason (ABI 1.2). A report goes out at once, on
//! every change of the resource's devices, and every [`REPORT_EVERY`] in between: the kubelet
//! reads a device as Unknown once [`TIMEOUT_SECONDS`] pass without one. The stream ends when
//! the front stops (the kubelet then opens a new one to the next registration).

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use devhost_proto::dra_health::{v1, v1alpha1};
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::prepare::dra_device_name;
use crate::engine::registry::{Resource, View};

/// How long the kubelet may go without a report before it reads the devices as Unknown.
pub const TIMEOUT_SECONDS: i64 = 30;
/// How often a report goes out when nothing changed: well within [`TIMEOUT_SECONDS`].
pub const REPORT_EVERY: Duration = Duration::from_secs(10);
/// Longest message the kubelet keeps whole.
const MAX_MESSAGE: usize = 1024;

/// The health service of one DRA driver.
#[derive(Clone)]
pub struct Health {
    pool: String,
    resource: Arc<Resource>,
    stop: watch::Receiver<bool>,
}

impl Health {
    /// The health of `resource`'s devices in pool `pool`, reported until `stop` turns true.
    pub fn new(pool: &str, resource: Arc<Resource>, stop: watch::Receiver<bool>) -> Health {
        Health { pool: pool.to_owned(), resource, stop }
    }

    /// The report of `view`: every device, with its health and reason.
    pub fn report(&self, view: &View) -> v1::NodeWatchResourcesResponse {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        let devices = view.devices.iter().map(|d| v1::DeviceHealth {
            device: Some(v1::DeviceIdentifier { pool_name: self.pool.clone(), device_name: dra_device_name(&d.id) }),
            health: if d.healthy { v1::HealthStatus::Healthy } else { v1::HealthStatus::Unhealthy } as i32,
            last_updated_time: now,
            health_check_timeout_seconds: TIMEOUT_SECONDS,
            message: d.health_reason.as_deref().map(shortened).unwrap_or_default(),
        });
        v1::NodeWatchResourcesResponse { devices: devices.collect() }
    }

    /// A stream of reports, each turned into the version's message by `into`.
    fn stream<T: Send + 'static>(
        &self,
        into: fn(v1::NodeWatchResourcesResponse) -> T,
    ) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
        let (tx, rx) = mpsc::channel(1);
        let (me, mut view, mut stop) = (self.clone(), self.resource.view.subscribe(), self.stop.clone());
        tokio::spawn(async move {
            loop {
                let report = me.report(&view.borrow_and_update());
                if tx.send(Ok(into(report))).await.is_err() {
                    return; // the kubelet went away
                }
                tokio::select! {
                    changed = view.changed() => if changed.is_err() { return },
                    _ = tokio::time::sleep(REPORT_EVERY) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }
}

/// `text` cut to the kubelet's limit on a character boundary, with `...` as it would add.
fn shortened(text: &str) -> String {
    if text.chars().count() <= MAX_MESSAGE {
        return text.to_owned();
    }
    text.chars().take(MAX_MESSAGE - 3).chain("...".chars()).collect()
}

type Reports<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl v1::dra_resource_health_server::DraResourceHealth for Health {
    type NodeWatchResourcesStream = Reports<v1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        Ok(Response::new(self.stream(|r| r)))
    }
}

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for Health {
    type NodeWatchResourcesStream = Reports<v1alpha1::NodeWatchResourcesResponse>;

    async fn node_watch_resources(
        &self,
        _: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
        Ok(Response::new(self.stream(alpha)))
    }
}

/// A v1 report as v1alpha1 (the same fields and numbers).
fn alpha(r: v1::NodeWatchResourcesResponse) -> v1alpha1::NodeWatchResourcesResponse {
    let devices = r.devices.into_iter().map(|d| v1alpha1::DeviceHealth {
        device: d.device.map(|i| v1alpha1::DeviceIdentifier { pool_name: i.pool_name, device_name: i.device_name }),
        health: d.health,
        last_updated_time: d.last_updated_time,
        health_check_timeout_seconds: d.health_check_timeout_seconds,
        message: d.message,
    });
    v1alpha1::NodeWatchResourcesResponse { devices: devices.collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_message_is_cut_to_1024_characters_as_the_kubelet_would() {
        assert_eq!(shortened("Xid 79"), "Xid 79");
        let long = "é".repeat(2000);
        let cut = shortened(&long);
        assert_eq!(cut.chars().count(), 1024);
        assert!(cut.ends_with("...") && cut.starts_with("éé"));
    }

    #[test]
    fn a_v1alpha1_report_carries_every_field() {
        let r = v1::NodeWatchResourcesResponse {
            devices: vec![v1::DeviceHealth {
                device: Some(v1::DeviceIdentifier { pool_name: "node-1".into(), device_name: "gpu-0".into() }),
                health: v1::HealthStatus::Unhealthy as i32,
                last_updated_time: 7,
                health_check_timeout_seconds: 30,
                message: "Xid 79".into(),
            }],
        };
        let a = alpha(r);
        let d = &a.devices[0];
        let id = d.device.as_ref().unwrap();
        assert_eq!((id.pool_name.as_str(), id.device_name.as_str()), ("node-1", "gpu-0"));
        assert_eq!(d.health, v1alpha1::HealthStatus::Unhealthy as i32);
        assert_eq!((d.last_updated_time, d.health_check_timeout_seconds, d.message.as_str()), (7, 30, "Xid 79"));
    }
}
