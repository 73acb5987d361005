//! The device registry: loads every driver instance the manifest names,
//! keeps each instance's latest scan, and splits its devices into the
//! resources that select them. Each resource publishes its device list
//! through a latest-value channel that feeds every ListAndWatch stream.

use crate::device::Device;
use crate::instance::Instance;
use crate::loader::{self, Module};
use crate::manifest::{DriverConfig, Manifest, ResourceConfig};
use devhost_proto::v1beta1 as pb;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// A resource's current devices, with health already decided by the host.
#[derive(Debug, Default)]
pub struct View {
    pub devices: Vec<Device>,
    pub index: HashMap<String, usize>,
    /// The ListAndWatch message for these devices, built once per change.
    pub list: pb::ListAndWatchResponse,
}

impl View {
    fn new(devices: Vec<Device>) -> View {
        let index = devices.iter().enumerate().map(|(i, d)| (d.id.clone(), i)).collect();
        let list = pb::ListAndWatchResponse {
            devices: devices
                .iter()
                .map(|d| pb::Device {
                    id: d.id.clone(),
                    health: if d.healthy { devhost_proto::HEALTHY } else { devhost_proto::UNHEALTHY }.to_string(),
                    topology: d.numa_node.map(|n| pb::TopologyInfo { nodes: vec![pb::NumaNode { id: n }] }),
                })
                .collect(),
        };
        View { devices, index, list }
    }

    pub fn get(&self, id: &str) -> Option<&Device> {
        self.index.get(id).map(|&i| &self.devices[i])
    }
}

pub struct Resource {
    pub config: ResourceConfig,
    pub driver: Option<Arc<Instance>>,
    /// Why the resource is not served (its module failed), if so.
    pub error: Option<String>,
    pub view: watch::Sender<Arc<View>>,
    pub registered: AtomicBool,
}

impl Resource {
    pub fn snapshot(&self) -> Arc<View> {
        self.view.borrow().clone()
    }
}

/// A driver instance, or why it could not be brought up.
pub enum Slot {
    Ready(Arc<Instance>),
    Failed(String),
}

pub struct Registry {
    pub drivers: BTreeMap<String, Slot>,
    pub resources: Vec<Arc<Resource>>,
    configs: BTreeMap<String, DriverConfig>,
    /// Conflicts already logged, so a rescan does not repeat them.
    logged: Mutex<HashSet<(String, String)>>,
}

/// Finds and loads a driver's module; the same file is loaded once.
fn resolve(cfg: &DriverConfig, cache: &mut HashMap<PathBuf, Result<Module, String>>) -> Result<Module, String> {
    let Some(path) = cfg.module_candidates.iter().find(|p| p.exists()) else {
        let tried: Vec<String> = cfg.module_candidates.iter().map(|p| p.display().to_string()).collect();
        return Err(format!("driver {}: no module file found (tried {})", cfg.name, tried.join(", ")));
    };
    cache
        .entry(path.clone())
        .or_insert_with(|| loader::load(path).map_err(|e| format!("driver {}: {e}", cfg.name)))
        .clone()
}

impl Registry {
    /// Loads every module and creates every driver instance, then starts the
    /// drivers' watches and takes a first scan. Failures are kept per driver;
    /// they never stop the others.
    pub async fn open(manifest: &Manifest, watch: bool) -> Registry {
        let mut cache = HashMap::new();
        let mut drivers = BTreeMap::new();
        for (name, cfg) in &manifest.drivers {
            let slot = match resolve(cfg, &mut cache) {
                Err(e) => Slot::Failed(e),
                Ok(module) => match Instance::create(name, module, &cfg.options, cfg.call_timeout).await {
                    Ok(inst) => Slot::Ready(inst),
                    Err(e) => Slot::Failed(format!("{e}")),
                },
            };
            if let Slot::Failed(e) = &slot {
                tracing::error!(driver = %name, "driver not loaded, its resources are not served: {e}");
            }
            drivers.insert(name.clone(), slot);
        }
        let resources = manifest
            .resources
            .iter()
            .map(|cfg| {
                let (driver, error) = match drivers.get(&cfg.driver) {
                    Some(Slot::Ready(i)) => (Some(i.clone()), None),
                    Some(Slot::Failed(e)) => (None, Some(e.clone())),
                    None => (None, Some(format!("driver {} is not configured", cfg.driver))),
                };
                Arc::new(Resource {
                    config: cfg.clone(),
                    driver,
                    error,
                    view: watch::channel(Arc::new(View::default())).0,
                    registered: AtomicBool::new(false),
                })
            })
            .collect();
        let reg = Registry { drivers, resources, configs: manifest.drivers.clone(), logged: Mutex::new(HashSet::new()) };
        for (name, slot) in &reg.drivers {
            if let Slot::Ready(inst) = slot {
                if watch && let Err(e) = inst.watch_start().await {
                    tracing::error!(driver = %name, "watch_start failed; relying on rescans: {e}");
                }
                reg.rescan(inst).await;
            }
        }
        reg
    }

    /// Scans one instance and publishes the result to its resources.
    pub async fn rescan(&self, inst: &Arc<Instance>) {
        let devices = match inst.scan().await {
            Ok(out) => Some(out.devices),
            Err(e) => {
                tracing::error!(driver = %inst.name, "scan failed, its devices are reported Unhealthy: {e}");
                None
            }
        };
        self.publish(inst, devices);
    }

    /// Splits devices among the instance's resources (manifest order: a
    /// device selected by two resources goes to the first). `None` keeps the
    /// previous devices but marks them Unhealthy, as does a broken instance.
    fn publish(&self, inst: &Arc<Instance>, devices: Option<Vec<Device>>) {
        let broken = inst.poisoned() || inst.hung().is_some();
        let mut taken: HashMap<String, String> = HashMap::new();
        for res in self.resources.iter().filter(|r| r.config.driver == inst.name && r.driver.is_some()) {
            let mut mine: Vec<Device> = match &devices {
                Some(all) => all
                    .iter()
                    .filter(|d| res.config.matches(&d.id, &d.attributes))
                    .filter(|d| match taken.get(&d.id) {
                        Some(first) => {
                            self.log_conflict(&d.id, first, &res.config.name);
                            false
                        }
                        None => {
                            taken.insert(d.id.clone(), res.config.name.clone());
                            true
                        }
                    })
                    .cloned()
                    .collect(),
                None => res.snapshot().devices.clone(),
            };
            if devices.is_none() || broken {
                for d in &mut mine {
                    d.healthy = false;
                }
            }
            res.view.send_if_modified(|cur| {
                if cur.devices == mine {
                    return false;
                }
                *cur = Arc::new(View::new(mine));
                true
            });
        }
    }

    fn log_conflict(&self, id: &str, first: &str, second: &str) {
        let mut logged = self.logged.lock().unwrap_or_else(|p| p.into_inner());
        if logged.insert((id.to_string(), second.to_string())) {
            tracing::warn!(device = id, "device is selected by resources {first} and {second}; it goes to {first}");
        }
    }

    /// Runs until `stop` fires: rescans each instance on "devices changed",
    /// on its poll interval, and when a hang or panic changes its state.
    pub fn spawn_watchers(self: &Arc<Self>, stop: watch::Receiver<bool>) {
        for (name, slot) in &self.drivers {
            let Slot::Ready(inst) = slot else { continue };
            let poll = self.configs.get(name).and_then(|c| c.poll_interval);
            let (reg, inst, mut stop) = (self.clone(), inst.clone(), stop.clone());
            tokio::spawn(async move {
                loop {
                    let tick = async {
                        match poll {
                            Some(p) => tokio::time::sleep(p).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        _ = inst.changed.notified() => {}
                        _ = tick => {}
                        _ = stop.changed() => break,
                    }
                    if *stop.borrow() {
                        break;
                    }
                    reg.rescan(&inst).await;
                }
            });
        }
    }

    pub fn resource(&self, name: &str) -> Option<&Arc<Resource>> {
        self.resources.iter().find(|r| r.config.name == name)
    }

    /// Stops every driver (watch_stop, destroy) after queued calls.
    pub fn shutdown(&self) {
        for slot in self.drivers.values() {
            if let Slot::Ready(inst) = slot {
                inst.shutdown();
            }
        }
    }

    pub fn all_registered(&self) -> bool {
        self.resources.iter().filter(|r| r.driver.is_some()).all(|r| r.registered.load(Ordering::Acquire))
    }
}

