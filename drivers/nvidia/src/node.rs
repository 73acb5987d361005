//! The GPUs of this node as the driver reports them: opens NVML, discovers,
//! measures topology and computes every device's attributes, links and
//! container edits once; afterwards only health changes. Plain Rust, driven
//! directly by the tests; `lib.rs` turns it into SDK calls.

use crate::config::Config;
use crate::discover::{Gpu, Inventory, discover};
use crate::edits::{self, DriverFiles, Edits, Target};
use crate::health::{Board, Notify, Watcher};
use crate::presence::{self, Presence};
use crate::topology;
use devhost_sdk::Health;
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use std::ffi::OsStr;
use std::sync::{Arc, Mutex, PoisonError};

/// One device as reported to the host (a whole GPU or a MIG device).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// The UUID (GPU-… or MIG-…).
    pub id: String,
    /// UUID of the physical GPU whose health this device shares.
    pub gpu_uuid: String,
    pub numa_node: Option<u32>,
    pub attrs: Vec<(String, String)>,
    /// (other device ID, score), only between whole GPUs.
    pub links: Vec<(String, u32)>,
    pub edits: Edits,
}

/// The driver instance's view of the node.
pub struct Node {
    devices: Vec<Device>,
    board: Arc<Board>,
    nvml: Option<Arc<Nvml>>,
    config: Config,
    notify: Notify,
    watcher: Mutex<Option<Watcher>>,
}

impl Node {
    /// Opens NVML and discovers. A missing or failing NVML yields a node without devices, never
    /// an error: logged at INFO on a node without NVIDIA GPUs, at ERROR on one with them.
    pub fn open(config: &Config, notify: Notify) -> Node {
        let nvml = match Nvml::builder().lib_path(OsStr::new(&config.nvml_lib)).init() {
            Ok(nvml) => Some(Arc::new(nvml)),
            Err(e) => {
                report_unusable_nvml(config, &e);
                None
            }
        };
        let inventory = nvml.as_deref().map(|n| discover(n, &config.sysfs_root)).unwrap_or_default();
        let scores = match &nvml {
            Some(n) => topology::measure(n, &inventory.gpus),
            None => Vec::new(),
        };
        let files = if config.list.describes_nodes() { driver_files(config) } else { DriverFiles::default() };
        let control_nodes =
            if config.list.describes_nodes() { edits::present_control_nodes(&config.devfs_root) } else { Vec::new() };
        let devices = build_devices(config, &inventory, &scores, &files, &control_nodes);
        let board = Arc::new(Board::new(inventory.gpus.iter().map(|g| (g.uuid.as_str(), g.problem.as_deref()))));
        if nvml.is_some() && inventory.gpus.is_empty() {
            log::info!(
                "no NVIDIA GPU on this node (NVML {} reports none); its resources stay empty",
                inventory.driver_version
            );
        } else if nvml.is_some() {
            log::info!(
                "NVML {} (CUDA {}): {} GPU(s), {} device(s) offered",
                inventory.driver_version,
                inventory.cuda_version,
                inventory.gpus.len(),
                devices.len()
            );
        }
        Node { devices, board, nvml, config: config.clone(), notify, watcher: Mutex::new(None) }
    }

    /// Every device with its current health.
    pub fn devices(&self) -> impl Iterator<Item = (&Device, Health)> {
        self.devices.iter().map(|d| {
            let health = if self.board.is_healthy(&d.gpu_uuid) { Health::Healthy } else { Health::Unhealthy };
            (d, health)
        })
    }

    /// Why a device is Unhealthy (empty when Healthy).
    /// The memory of device `id` in MiB, if NVML told it.
    pub fn memory_mib(&self, id: &str) -> Option<u64> {
        let device = self.devices.iter().find(|d| d.id == id)?;
        device.attrs.iter().find(|(k, _)| k == "memory").and_then(|(_, v)| v.parse().ok())
    }

    pub fn unhealthy_reason(&self, id: &str) -> String {
        self.devices.iter().find(|d| d.id == id).map(|d| self.board.reason(&d.gpu_uuid)).unwrap_or_default()
    }

    /// Starts the health thread; returns once events are registered.
    pub fn watch_start(&self) {
        let Some(nvml) = &self.nvml else { return };
        if self.devices.is_empty() {
            return;
        }
        let mut slot = self.watcher.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot =
                Some(Watcher::start(nvml.clone(), self.board.clone(), self.config.health.clone(), self.notify.clone()));
        }
    }

    /// Stops and joins the health thread.
    pub fn watch_stop(&self) {
        let watcher = self.watcher.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(w) = watcher {
            w.stop();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // The thread borrows NVML: it must end before NVML shuts down.
        self.watch_stop();
    }
}

/// Says why there are no devices when NVML cannot be used. Only the PCI bus can tell a node
/// without NVIDIA hardware (the normal case for most nodes of a fleet running one manifest) from
/// a GPU node whose driver is missing or broken, which must stay loud.
fn report_unusable_nvml(config: &Config, e: &NvmlError) {
    let lib = &config.nvml_lib;
    let fix = "Is the NVIDIA driver installed and loaded? The option nvml_lib names the libnvidia-ml library to load.";
    match presence::nvidia_gpus(&config.sysfs_root) {
        Presence::None { passthrough } => {
            let vfio = if passthrough > 0 {
                format!(" for containers ({passthrough} bound to vfio-pci for virtual machines)")
            } else {
                String::new()
            };
            log::info!(
                "no NVIDIA GPU on this node{vfio} (none for containers on the PCI bus under {}, and NVML from {lib:?} \
                 cannot be used: {e}); its resources stay empty",
                config.sysfs_root.display()
            );
        }
        Presence::Gpus(gpus) => log::error!(
            "cannot use NVML from {lib:?}: {e}; reporting no NVIDIA GPUs although the PCI bus shows {} ({}). {fix}",
            gpus.len(),
            gpus.join(", ")
        ),
        Presence::Unknown(why) => {
            log::error!(
                "cannot use NVML from {lib:?}: {e}; reporting no NVIDIA GPUs ({why}, so there may be some). {fix}"
            )
        }
    }
}

fn driver_files(config: &Config) -> DriverFiles {
    let files = edits::find_driver_files(&config.driver_root);
    if files.libraries.is_empty() {
        log::warn!(
            "no NVIDIA libraries found under driver_root {:?}; containers get device nodes only",
            config.driver_root
        );
    }
    files
}

/// Device IDs must be 1–63 printable ASCII characters without spaces or "::".
fn valid_id(id: &str) -> bool {
    (1..=63).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic()) && !id.contains("::")
}

/// The devices of an inventory: whole GPUs not in MIG mode, and MIG devices.
pub fn build_devices(
    config: &Config,
    inventory: &Inventory,
    scores: &[Vec<u32>],
    files: &DriverFiles,
    control_nodes: &[String],
) -> Vec<Device> {
    let mut devices = Vec::new();
    if config.list.describes_nodes() {
        if !config.list.envvar && inventory.gpus.iter().any(|g| g.mig.as_ref().is_some_and(|m| !m.is_empty())) {
            log::warn!(
                "device_list_strategy {}: MIG devices get their parent's /dev/nvidiaN but not the \
                 /dev/nvidia-caps access nodes CUDA needs for MIG; add envvar for MIG resources",
                if config.list.cdi { "cdi" } else { "device-nodes" }
            );
        }
        for gpu in &inventory.gpus {
            if let Some(minor) = gpu.minor
                && !config.devfs_root.join(format!("nvidia{minor}")).exists()
            {
                log::warn!("GPU {}: {:?} has no nvidia{minor} node", gpu.uuid, config.devfs_root);
            }
        }
    }
    let whole: Vec<usize> = (0..inventory.gpus.len()).filter(|&i| inventory.gpus[i].mig.is_none()).collect();
    for (i, gpu) in inventory.gpus.iter().enumerate() {
        let common = common_attrs(gpu, inventory);
        match &gpu.mig {
            None => {
                let index = gpu.index.to_string();
                let target = Target { uuid: &gpu.uuid, index_name: &index, minor: gpu.minor };
                let mut attrs = vec![kv("kind", "gpu")];
                attrs.extend(common);
                attrs.push(kv("uuid", &gpu.uuid));
                attrs.push(kv("index", &index));
                if let Some(m) = gpu.memory_mib {
                    attrs.push(kv("memory", &m.to_string()));
                }
                let links = whole
                    .iter()
                    .filter(|&&j| j != i)
                    .filter_map(|&j| Some((inventory.gpus[j].uuid.clone(), *scores.get(i)?.get(j)?)))
                    .collect();
                devices.push(Device {
                    id: gpu.uuid.clone(),
                    gpu_uuid: gpu.uuid.clone(),
                    numa_node: gpu.numa_node,
                    attrs,
                    links,
                    edits: edits::device_edits(config, files, control_nodes, &target),
                });
            }
            Some(migs) => {
                for mig in migs {
                    let index = format!("{}:{}", gpu.index, mig.slot);
                    let target = Target { uuid: &mig.uuid, index_name: &index, minor: gpu.minor };
                    let mut attrs = vec![kv("kind", "mig")];
                    attrs.extend(common.iter().cloned());
                    attrs.push(kv("uuid", &mig.uuid));
                    attrs.push(kv("index", &index));
                    if let Some(m) = mig.memory_mib {
                        attrs.push(kv("memory", &m.to_string()));
                    }
                    attrs.push(kv("mig_profile", &mig.profile));
                    attrs.push(kv("parent_uuid", &gpu.uuid));
                    attrs.push(kv("parent_index", &gpu.index.to_string()));
                    devices.push(Device {
                        id: mig.uuid.clone(),
                        gpu_uuid: gpu.uuid.clone(),
                        numa_node: gpu.numa_node,
                        attrs,
                        links: Vec::new(),
                        edits: edits::device_edits(config, files, control_nodes, &target),
                    });
                }
            }
        }
    }
    devices.retain(|d| {
        let ok = valid_id(&d.id);
        if !ok {
            log::error!("NVML reported UUID {:?}, which is no valid device ID; it is not offered", d.id);
        }
        ok
    });
    devices
}

fn kv(k: &str, v: &str) -> (String, String) {
    (k.to_string(), v.to_string())
}

/// Attributes a GPU and its MIG devices share.
fn common_attrs(gpu: &Gpu, inventory: &Inventory) -> Vec<(String, String)> {
    let mut attrs = vec![kv("vendor", "nvidia"), kv("model", &gpu.name)];
    if let Some(cc) = &gpu.compute_capability {
        attrs.push(kv("compute_capability", cc));
    }
    if let Some(pci) = &gpu.pci_address {
        attrs.push(kv("pci_address", pci));
    }
    if let Some(minor) = gpu.minor {
        attrs.push(kv("minor", &minor.to_string()));
    }
    // Like every bundled driver: no numa_node attribute when there is no affinity.
    if let Some(n) = gpu.numa_node {
        attrs.push(kv("numa_node", &n.to_string()));
    }
    attrs.push(kv("driver_version", &inventory.driver_version));
    attrs.push(kv("cuda_version", &inventory.cuda_version));
    attrs
}
