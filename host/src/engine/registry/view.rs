//! What a resource publishes (its [`View`]: physical devices, how they are
//! advertised, the ListAndWatch message) and what every resource shares.

use crate::driver::device::Device;
use crate::engine::cdi::{self, CdiWriter};
use crate::engine::podresources::Follower;
use crate::engine::sharing;
use crate::engine::telemetry::Metrics;
use devhost_proto::v1beta1 as pb;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// A resource's current devices, with health already decided by the host.
#[derive(Debug, Default)]
pub struct View {
    /// The physical devices (what drivers reported, with host-decided health).
    pub devices: Vec<Device>,
    pub index: HashMap<String, usize>,
    /// Each physical device is advertised as this many IDs (`<id>::<k>`
    /// when more than one).
    pub replicas: u32,
    /// The ListAndWatch message for these devices, built once per change.
    pub list: pb::ListAndWatchResponse,
    /// The devices whose edits reach containers through the CDI names they declare, as devhost
    /// defines those in its spec files ([`cdi::own_names`]; empty without `cdi_dir`), each as
    /// the Allocate answer takes it ([`cdi::through_names`]).
    pub through_cdi: HashMap<String, Device>,
}

impl View {
    /// `cdi`: devhost writes spec files (`cdi_dir`), so devices' own CDI names are defined.
    pub(super) fn new(devices: Vec<Device>, replicas: u32, cdi: bool) -> View {
        let through_cdi = if cdi {
            let vars = cdi::list_vars(&devices);
            cdi::own_names(&devices)
                .into_values()
                .map(|i| (devices[i].id.clone(), cdi::through_names(&devices[i], &vars)))
                .collect()
        } else {
            HashMap::new()
        };
        let index = devices.iter().enumerate().map(|(i, d)| (d.id.clone(), i)).collect();
        let advertised = if replicas > 1 { sharing::expand(&devices, replicas) } else { devices.clone() };
        let list = pb::ListAndWatchResponse {
            devices: advertised
                .iter()
                .map(|d| pb::Device {
                    id: d.id.clone(),
                    health: if d.healthy { devhost_proto::HEALTHY } else { devhost_proto::UNHEALTHY }.to_string(),
                    topology: d.numa_node.map(|n| pb::TopologyInfo { nodes: vec![pb::NumaNode { id: n }] }),
                })
                .collect(),
        };
        View { devices, index, replicas: replicas.max(1), list, through_cdi }
    }

    /// The physical device behind an advertised ID (a replica ID when the
    /// resource is shared).
    pub fn get(&self, id: &str) -> Option<&Device> {
        let physical = if self.replicas > 1 {
            match sharing::parse_replica(id) {
                Some((p, k)) if k < self.replicas => p,
                _ => return None,
            }
        } else {
            id
        };
        self.physical(physical)
    }

    /// A physical device by its own ID.
    pub fn physical(&self, id: &str) -> Option<&Device> {
        self.index.get(id).map(|&i| &self.devices[i])
    }
}

/// What every resource and endpoint shares: metrics, the CDI writer and folders and the
/// pod-resources follower (who holds which device).
pub struct Services {
    pub metrics: Arc<Metrics>,
    /// Writes the resources' spec files into `cdi_dir`; `None` without it, and for `list` and
    /// `check`, which write nothing.
    pub cdi: Option<CdiWriter>,
    /// The manifest's `cdi_dir`.
    pub cdi_dir: Option<PathBuf>,
    /// The runtime's CDI folders, where the names handed out must resolve (`cdi_spec_dirs`).
    pub cdi_spec_dirs: Vec<PathBuf>,
    pub follower: Option<Arc<Follower>>,
    /// The container runtime, asked before a release whether the holder has exited (`run`,
    /// `sim`).
    pub runtime: Option<Arc<crate::engine::containers::Runtime>>,
}

/// How much of the machinery a registry runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One scan per driver, nothing running (`list`, `check`).
    Inspect,
    /// The daemon: watches, rescans, follows pod resources and releases devices.
    Serve,
    /// `sim`: watches and rescans, without a real kubelet's pod resources.
    Simulate,
}
