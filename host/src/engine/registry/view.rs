//! What a resource publishes (its [`View`]: physical devices and the IDs it advertises for them,
//! with their health and NUMA node) and what every resource shares. The Device Plugin front turns
//! the advertised IDs into its ListAndWatch message (`fronts::device_plugin::list`).

use crate::driver::device::Device;
use crate::engine::cdi::{self, CdiWriter};
use crate::engine::podresources::Follower;
use crate::engine::sharing;
use crate::engine::telemetry::Metrics;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// One ID a resource advertises: a physical device's own, or one of its replicas' (`<id>::<k>`)
/// when the resource is shared, with the health and NUMA node of the physical device behind it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertised {
    pub id: String,
    pub healthy: bool,
    pub numa_node: Option<i64>,
}

/// A resource's current devices, with health already decided by the host.
#[derive(Debug, Default)]
pub struct View {
    /// The physical devices (what drivers reported, with host-decided health).
    pub devices: Vec<Device>,
    pub index: HashMap<String, usize>,
    /// Each physical device is advertised as this many IDs (`<id>::<k>`
    /// when more than one).
    pub replicas: u32,
    /// The IDs advertised for these devices, built once per change, in [`sharing::expand`]'s
    /// order (replica-major): what ListAndWatch lists.
    pub advertised: Vec<Advertised>,
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
        let advertised = advertise(&devices, replicas);
        View { devices, index, replicas: replicas.max(1), advertised, through_cdi }
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

/// The IDs advertised for `devices` shared `replicas` times: [`sharing::expand`]'s IDs, in its
/// order, without copying the rest of each device.
fn advertise(devices: &[Device], replicas: u32) -> Vec<Advertised> {
    let one = |d: &Device, id: String| Advertised { id, healthy: d.healthy, numa_node: d.numa_node };
    if replicas <= 1 {
        return devices.iter().map(|d| one(d, d.id.clone())).collect();
    }
    let mut out = Vec::with_capacity(devices.len() * replicas as usize);
    for k in 0..replicas {
        out.extend(devices.iter().map(|d| one(d, sharing::replica_id(&d.id, k))));
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(id: &str, healthy: bool, numa_node: Option<i64>) -> Device {
        Device::test(id).health(healthy).numa(numa_node)
    }

    #[test]
    fn advertised_ids_are_the_expanded_devices() {
        let devices = [dev("a", true, Some(1)), dev("b", false, None)];
        for replicas in [0, 1, 3] {
            let want: Vec<Advertised> = sharing::expand(&devices, replicas)
                .into_iter()
                .map(|d| Advertised { id: d.id, healthy: d.healthy, numa_node: d.numa_node })
                .collect();
            assert_eq!(advertise(&devices, replicas), want, "replicas = {replicas}");
        }
    }
}
