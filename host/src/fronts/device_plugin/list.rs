//! The ListAndWatch message: a resource's advertised IDs ([`View::advertised`]) as the Device
//! Plugin API's devices, with their health and NUMA node.

use crate::engine::registry::View;
use devhost_proto::v1beta1 as pb;

/// The ListAndWatch message for `view`, built for each message a stream sends.
pub fn message(view: &View) -> pb::ListAndWatchResponse {
    pb::ListAndWatchResponse {
        devices: view
            .advertised
            .iter()
            .map(|d| pb::Device {
                id: d.id.clone(),
                health: if d.healthy { devhost_proto::HEALTHY } else { devhost_proto::UNHEALTHY }.to_string(),
                topology: d.numa_node.map(|n| pb::TopologyInfo { nodes: vec![pb::NumaNode { id: n }] }),
            })
            .collect(),
    }
}
