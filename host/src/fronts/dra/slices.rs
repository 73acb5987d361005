//! Publishing a DRA resource's devices as ResourceSlices: one task per DRA front
//! ([`spawn`]) keeps the API server's slices of (driver, node) equal to the resource's healthy
//! devices, from the resource's device view (every change), a watch on the slices (someone
//! else deleted or edited one: the kubelet deletes every slice of its node when it starts) and
//! a full resync every [`RESYNC`] as a backstop.
//!
//! What is published, per DRA resource and node:
//! - one pool, named after the node, with `spec.nodeName` = the node and `spec.driver` = the
//!   resource's DRA driver; every slice is owned by the Node object (garbage-collected with it);
//! - the resource's **healthy physical devices** only (a device turning unhealthy leaves the
//!   slice, coming back re-adds it; `replicas` does not apply to DRA, the manifest warns),
//!   named by [`device_name`], in the order the driver reported them;
//! - at most [`MAX_DEVICES_PER_SLICE`] devices per slice; a bigger pool is split into several
//!   slices, all with the same generation and `resourceSliceCount`. A pool without a healthy
//!   device keeps one empty slice, so that consumers know it is empty rather than missing.
//!
//! Slice names are deterministic: `<node>-<driver>-<index, 4 digits>` (for a name over 253
//! characters, the `<node>-<driver>` part is cut and 8 hex digits of its hash appended). A
//! create that races another (ours, after a restart, or a slice just seen deleted) fails with
//! AlreadyExists instead of making a duplicate, so no cache of our own writes is needed, and
//! name order is index order (the scheduler tries slices first-fit in name order).
//!
//! Generations, simplified from the upstream helper: the pool's generation is the highest among
//! the existing slices. If nothing is created or deleted and at most one slice changes, that
//! slice is updated in place at the same generation (an object is replaced atomically, so no
//! consumer sees a mixed pool). Otherwise slices that are not wanted any more are deleted
//! first, then **every** slice is written at generation + 1: consumers use only the highest
//! generation and wait for `resourceSliceCount` slices of it, so they see the old pool or the
//! new one, never a mix.
//!
//! Attributes (see [`attribute_name`] and [`typed`]): `numaNode` (int) from the device's NUMA
//! node; `resource.kubernetes.io/pciBusID` from a `pci_address` attribute holding one PCI
//! address, and `resource.kubernetes.io/pcieRoot` where sysfs shows its root; the capacity
//! `memory` from `memory` (MiB) or `hbm_gib` (GiB); then every other driver attribute under
//! the driver's own domain (unprefixed), typed int, bool, version (semver 2.0) or string. At
//! most [`MAX_ENTRIES`] attributes and capacities per device, in that order.
//!
//! Stopping the task does **not** delete the slices: the kubelet deletes a driver's slices 30 s
//! after the driver's registration socket is gone, and a devhost restart (or reload) within
//! that time must not make the devices vanish and come back for the scheduler.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    Device as DraDevice, DeviceAttribute, DeviceCapacity, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions, WatchEvent, WatchParams};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;

use super::api::ApiServer;
use super::outage::{Outage, Scope, log_failure, log_recovery};
use super::prepare::device_name;
use crate::driver::device::Device;
use crate::engine::registry::Resource;
use crate::engine::telemetry::Metrics;

/// Most devices in one ResourceSlice (the API server's limit without taints or counters).
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Most attributes and capacities of one device, together.
pub const MAX_ENTRIES: usize = 32;
/// Longest attribute name (a C identifier).
pub const MAX_ATTRIBUTE_NAME: usize = 32;
/// Longest string or version value.
pub const MAX_VALUE: usize = 64;
/// Longest object name (a DNS subdomain).
const MAX_OBJECT_NAME: usize = 253;
/// How often the slices are compared with the API server's even when nothing was seen.
pub const RESYNC: Duration = Duration::from_secs(60);
/// The longest one publishing pass may take: the API client has no read timeout of its own, so
/// a server that accepted the connection and went silent (a network partition, a stopped
/// process) would hold the publisher, and every later change, until the connection broke.
pub const PASS_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a watch may stay silent before it is started again (the server ends a watch with no
/// events after about 290 s, so only a dead connection stays silent longer).
const WATCH_SILENT: Duration = Duration::from_secs(300);
/// A watch that ends sooner than this counts as a failure, so a server that ends every watch at
/// once is not asked again in a loop.
const WATCH_SHORTEST: Duration = Duration::from_secs(5);
/// What the publisher's and the watch's log lines call their calls.
const PUBLISH: &str = "publish the ResourceSlices";
const WATCH: &str = "watch the ResourceSlices";
/// The standard PCI bus address attribute (`dddd:bb:dd.f`).
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// The standard PCIe root complex attribute (`pci<domain>:<bus>`).
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// The attribute name of the device's NUMA node.
pub const NUMA_NODE: &str = "numaNode";

/// The DRA attribute name of a devhost attribute key: lowerCamelCase, every character other
/// than an ASCII letter or digit separating words (`pci_address` → `pciAddress`,
/// `mig_profile` → `migProfile`), `_` in front if it would start with a digit. `None` when
/// nothing is left or the result is longer than [`MAX_ATTRIBUTE_NAME`].
pub fn attribute_name(key: &str) -> Option<String> {
    let mut name = String::new();
    let mut word_start = false;
    for c in key.chars() {
        if c.is_ascii_alphanumeric() {
            name.push(if word_start && !name.is_empty() { c.to_ascii_uppercase() } else { c });
            word_start = false;
        } else {
            word_start = true;
        }
    }
    if name.starts_with(|c: char| c.is_ascii_digit()) {
        name.insert(0, '_');
    }
    (!name.is_empty() && name.len() <= MAX_ATTRIBUTE_NAME).then_some(name)
}

/// A driver's string value, typed: int if it parses as an i64, bool for `true`/`false`,
/// version if it is a semantic version 2.0 (`1.2.3-rc.1`), else string; `None` for a string
/// or version longer than [`MAX_VALUE`].
pub fn typed(value: &str) -> Option<DeviceAttribute> {
    if let Ok(n) = value.parse::<i64>() {
        return Some(DeviceAttribute { int: Some(n), ..Default::default() });
    }
    if let Ok(b) = value.parse::<bool>() {
        return Some(DeviceAttribute { bool: Some(b), ..Default::default() });
    }
    if value.len() > MAX_VALUE {
        return None;
    }
    if is_semver(value) {
        return Some(DeviceAttribute { version: Some(value.to_owned()), ..Default::default() });
    }
    Some(DeviceAttribute { string: Some(value.to_owned()), ..Default::default() })
}

/// Semantic Versioning 2.0: `MAJOR.MINOR.PATCH[-pre][+build]`, numbers without leading zeros.
pub fn is_semver(text: &str) -> bool {
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    let ident = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let (rest, build) = match text.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (text, None),
    };
    if build.is_some_and(|b| !b.split('.').all(ident)) {
        return false;
    }
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let pre_ok = |p: &str| p.split('.').all(|i| ident(i) && (!i.bytes().all(|b| b.is_ascii_digit()) || number(i)));
    if pre.is_some_and(|p| !pre_ok(p)) {
        return false;
    }
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3 && parts.iter().all(|p| number(p))
}

/// `text` as a PCI bus address `dddd:bb:dd.f` (lower-case hex), if it is exactly one.
pub fn pci_bus_id(text: &str) -> Option<String> {
    let text = text.trim().to_ascii_lowercase();
    let b = text.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    let ok = b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11]);
    ok.then_some(text)
}

/// The PCIe root (`pci0000:00`) in the sysfs link target of a PCI device
/// (`../../../devices/pci0000:00/0000:00:01.0/0000:3b:00.0`).
pub fn pcie_root_of_link(target: &Path) -> Option<String> {
    target.components().find_map(|c| {
        let part = c.as_os_str().to_str()?;
        let rest = part.strip_prefix("pci")?;
        let b = rest.as_bytes();
        let ok = b.len() == 7 && b[4] == b':' && b.iter().enumerate().all(|(i, c)| i == 4 || c.is_ascii_hexdigit());
        ok.then(|| part.to_ascii_lowercase())
    })
}

/// Driver attributes published as capacities instead: key → (capacity name, power of 1024 of
/// the unit: 2 = MiB, 3 = GiB).
fn capacity_of(key: &str) -> Option<(&'static str, usize)> {
    match key {
        "memory" => Some(("memory", 2)),
        "hbm_gib" => Some(("memory", 3)),
        _ => None,
    }
}

/// `n` units of 1024^`power` bytes as a Quantity in the API server's canonical form (the
/// largest binary suffix that keeps it an integer: 40960 MiB is `40Gi`), so the stored slice
/// equals the one sent.
pub fn binary_quantity(mut n: u64, mut power: usize) -> Quantity {
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    if n == 0 {
        return Quantity("0".into());
    }
    let power_max = SUFFIXES.len() - 1;
    while n.is_multiple_of(1024) && power < power_max {
        n /= 1024;
        power += 1;
    }
    Quantity(format!("{n}{}", SUFFIXES[power.min(power_max)]))
}

/// Messages that are logged once per publisher (per DRA front), keyed by their text.
#[derive(Default)]
struct Once(HashSet<String>);

impl Once {
    fn first(&mut self, text: &str) -> bool {
        self.0.insert(text.to_owned())
    }
}

/// One device as the API's Device, and what was left out (each a message naming it).
pub fn dra_device(device: &Device, sysfs: &Path) -> (DraDevice, Vec<String>) {
    let mut skipped = Vec::new();
    let mut attrs: Vec<(String, DeviceAttribute)> = Vec::new();
    let mut caps: Vec<(String, Quantity)> = Vec::new();
    if let Some(n) = device.numa_node {
        attrs.push((NUMA_NODE.to_owned(), DeviceAttribute { int: Some(n), ..Default::default() }));
    }
    if let Some(pci) = device.attributes.get("pci_address").and_then(|a| pci_bus_id(a)) {
        let root = std::fs::read_link(sysfs.join("bus/pci/devices").join(&pci)).ok();
        attrs.push((PCI_BUS_ID.to_owned(), DeviceAttribute { string: Some(pci), ..Default::default() }));
        if let Some(root) = root.as_deref().and_then(pcie_root_of_link) {
            attrs.push((PCIE_ROOT.to_owned(), DeviceAttribute { string: Some(root), ..Default::default() }));
        }
    }
    for (key, value) in &device.attributes {
        if let Some((cap, power)) = capacity_of(key)
            && let Ok(n) = value.trim().parse::<u64>()
        {
            if !caps.iter().any(|(c, _)| c == cap) {
                caps.push((cap.to_owned(), binary_quantity(n, power)));
            }
            continue;
        }
        let Some(name) = attribute_name(key) else {
            skipped.push(format!(
                "attribute `{key}` has no valid DRA name (letters and digits, at most {MAX_ATTRIBUTE_NAME} once \
                 camel-cased)"
            ));
            continue;
        };
        if attrs.iter().any(|(n, _)| *n == name) || caps.iter().any(|(c, _)| *c == name) {
            if name != NUMA_NODE {
                skipped.push(format!("attribute `{key}` would be published as `{name}`, which is taken"));
            }
            continue;
        }
        let Some(value) = typed(value) else {
            skipped.push(format!("attribute `{key}`: the value is longer than {MAX_VALUE} characters"));
            continue;
        };
        attrs.push((name, value));
    }
    let room = MAX_ENTRIES.saturating_sub(caps.len());
    if attrs.len() > room {
        let dropped: Vec<&str> = attrs[room..].iter().map(|(n, _)| n.as_str()).collect();
        skipped.push(format!(
            "attributes {} are left out: a device may have at most {MAX_ENTRIES} attributes and capacities",
            dropped.join(", ")
        ));
        attrs.truncate(room);
    }
    let device = DraDevice {
        name: device_name(&device.id),
        attributes: (!attrs.is_empty()).then(|| attrs.into_iter().collect()),
        capacity: (!caps.is_empty())
            .then(|| caps.into_iter().map(|(n, value)| (n, DeviceCapacity { value, request_policy: None })).collect()),
        ..Default::default()
    };
    (device, skipped)
}

/// FNV-1a, 32 bits (stable across builds).
fn fnv1a(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// The name of slice `index` of (node, driver): `<node>-<driver>-<index:04>`, shortened with a
/// hash when over 253 characters.
pub fn slice_name(node: &str, driver: &str, index: usize) -> String {
    let stem = format!("{node}-{driver}");
    let name = format!("{stem}-{index:04}");
    if name.len() <= MAX_OBJECT_NAME {
        return name;
    }
    let keep = MAX_OBJECT_NAME - format!("-{:08x}-{index:04}", 0).len();
    let mut cut = keep.min(stem.len());
    while !stem.is_char_boundary(cut) {
        cut -= 1;
    }
    let short = stem[..cut].trim_end_matches(['-', '.']);
    format!("{short}-{:08x}-{index:04}", fnv1a(&stem))
}

/// The desired device lists, one per slice (at least one, maybe empty): the healthy devices of
/// `devices` in order, split every [`MAX_DEVICES_PER_SLICE`]. Messages name what was left out.
pub fn desired(devices: &[Device], sysfs: &Path) -> (Vec<Vec<DraDevice>>, Vec<String>) {
    let mut notes = Vec::new();
    let mut seen: HashMap<String, &str> = HashMap::new();
    let mut all = Vec::new();
    for d in devices.iter().filter(|d| d.healthy) {
        let (dra, skipped) = dra_device(d, sysfs);
        notes.extend(skipped.into_iter().map(|s| format!("device {}: {s}", d.id)));
        if let Some(first) = seen.get(&dra.name) {
            notes.push(format!(
                "device {} is not published: its DRA device name {} is already that of device {first}",
                d.id, dra.name
            ));
            continue;
        }
        seen.insert(dra.name.clone(), &d.id);
        all.push(dra);
    }
    let mut slices: Vec<Vec<DraDevice>> = all.chunks(MAX_DEVICES_PER_SLICE).map(<[_]>::to_vec).collect();
    if slices.is_empty() {
        slices.push(Vec::new());
    }
    (slices, notes)
}

/// Up to a few JSON paths where `sent` and `stored` differ (`spec.devices[0].capacity`).
fn differences(sent: &serde_json::Value, stored: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    use serde_json::Value;
    if out.len() >= 5 || sent == stored {
        return;
    }
    match (sent, stored) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                differences(v, b.get(k).unwrap_or(&Value::Null), &format!("{path}.{k}"), out);
            }
            for k in b.keys().filter(|k| !a.contains_key(*k)) {
                if out.len() < 5 {
                    out.push(format!("{path}.{k} (added)"));
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                differences(x, y, &format!("{path}[{i}]"), out);
            }
        }
        _ => out.push(path.to_owned()),
    }
}

/// What one reconcile pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub devices: usize,
    pub slices: usize,
    pub generation: i64,
}

/// Reconciles one (driver, node)'s slices with the API server.
struct Publisher {
    driver: String,
    resource: String,
    node: String,
    slices: Api<ResourceSlice>,
    nodes: Api<Node>,
    selector: String,
    sysfs: PathBuf,
    once: Once,
    /// Per slice name: the spec last sent and the spec the server stored for it, so a field
    /// the server drops (a feature gate off) does not make every pass write again.
    stored: HashMap<String, (serde_json::Value, serde_json::Value)>,
}

fn json<T: serde::Serialize>(value: &T) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

impl Publisher {
    fn new(driver: &str, resource: &str, api: &ApiServer) -> Publisher {
        Publisher {
            driver: driver.to_owned(),
            resource: resource.to_owned(),
            node: api.node.clone(),
            slices: Api::all(api.client.clone()),
            nodes: Api::all(api.client.clone()),
            selector: selector(driver, &api.node),
            sysfs: PathBuf::from("/sys"),
            once: Once::default(),
            stored: HashMap::new(),
        }
    }

    /// The existing slice `name` holds `spec` (or holds what the server made of it last time).
    fn same(&self, name: &str, spec: &ResourceSliceSpec, existing: &ResourceSliceSpec) -> bool {
        let (sent, have) = (json(spec), json(existing));
        sent == have || self.stored.get(name).is_some_and(|(s, h)| *s == sent && *h == have)
    }

    fn spec(&self, devices: &[DraDevice], generation: i64, count: usize) -> ResourceSliceSpec {
        ResourceSliceSpec {
            driver: self.driver.clone(),
            node_name: Some(self.node.clone()),
            pool: ResourcePool { name: self.node.clone(), generation, resource_slice_count: count as i64 },
            // The server stores an empty list as none: send it the way it is kept, so an empty
            // pool's slice compares equal to what the server returns.
            devices: (!devices.is_empty()).then(|| devices.to_vec()),
            ..Default::default()
        }
    }

    /// Remembers what the server stored for `sent`, warning once per slice if it differs.
    fn check_stored(&mut self, name: &str, sent: &ResourceSliceSpec, stored: &ResourceSliceSpec) {
        let (sent, stored) = (json(sent), json(stored));
        if sent != stored {
            let mut paths = Vec::new();
            differences(&sent, &stored, "spec", &mut paths);
            let text = format!(
                "the API server stored ResourceSlice {name} of DRA driver {} on node {} with fields dropped or \
                 changed ({}); a feature gate of the API server may be off",
                self.driver,
                self.node,
                paths.join(", ")
            );
            if self.once.first(&text) {
                tracing::warn!(resource = %self.resource, dra_driver = %self.driver, node = %self.node, "{text}");
            }
        }
        self.stored.insert(name.to_owned(), (sent, stored));
    }

    /// The owner reference to this node (its UID read now: a node deleted and registered again
    /// has a new one).
    async fn owner(&self) -> Result<OwnerReference, String> {
        let node = self.nodes.get(&self.node).await.map_err(|e| {
            format!(
                "cannot read Node {} (its UID owns the ResourceSlices of DRA driver {}): {e}",
                self.node, self.driver
            )
        })?;
        let uid = node.metadata.uid.ok_or_else(|| format!("Node {} has no UID", self.node))?;
        Ok(OwnerReference {
            api_version: "v1".into(),
            kind: "Node".into(),
            name: self.node.clone(),
            uid,
            controller: Some(true),
            block_owner_deletion: None,
        })
    }

    /// One pass: makes the server's slices those of `devices`. `Ok(Some(_))` when it wrote.
    async fn reconcile(&mut self, devices: &[Device]) -> Result<Option<Published>, String> {
        let (wanted, notes) = desired(devices, &self.sysfs);
        for note in notes {
            if self.once.first(&note) {
                tracing::warn!(resource = %self.resource, dra_driver = %self.driver, "not published in full: {note}");
            }
        }
        let (d, n) = (&self.driver, &self.node);
        let list = self
            .slices
            .list(&ListParams::default().fields(&self.selector))
            .await
            .map_err(|e| format!("cannot list the ResourceSlices of DRA driver {d} on node {n}: {e}"))?;
        let existing: HashMap<String, ResourceSlice> =
            list.items.into_iter().filter_map(|s| Some((s.metadata.name.clone()?, s))).collect();
        let generation = existing.values().map(|s| s.spec.pool.generation).max().unwrap_or(0);
        let count = wanted.len();
        let names: Vec<String> = (0..count).map(|i| slice_name(n, d, i)).collect();
        let obsolete: Vec<&ResourceSlice> = existing
            .iter()
            .filter(|(name, s)| !names.contains(name) || s.spec.pool.name != *n)
            .map(|(_, s)| s)
            .collect();
        let changed: Vec<usize> = (0..count)
            .filter(|&i| match existing.get(&names[i]) {
                None => true,
                Some(s) => !self.same(&names[i], &self.spec(&wanted[i], generation, count), &s.spec),
            })
            .collect();
        if obsolete.is_empty() && changed.is_empty() {
            return Ok(None);
        }
        let creates = changed.iter().filter(|&&i| !existing.contains_key(&names[i])).count();
        let in_place = obsolete.is_empty() && creates == 0 && changed.len() == 1 && generation > 0;
        let (generation, write): (i64, Vec<usize>) =
            if in_place { (generation, changed) } else { (generation + 1, (0..count).collect()) };
        let owner = self.owner().await?;
        for slice in obsolete {
            let name = slice.metadata.name.clone().unwrap_or_default();
            let params = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: slice.metadata.uid.clone(),
                    resource_version: slice.metadata.resource_version.clone(),
                }),
                ..Default::default()
            };
            match self.slices.delete(&name, &params).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_not_found() => {}
                Err(e) => return Err(format!("cannot delete ResourceSlice {name} of DRA driver {d} on node {n}: {e}")),
            }
            self.stored.remove(&name);
        }
        for i in write {
            let name = &names[i];
            let spec = self.spec(&wanted[i], generation, count);
            let old = existing.get(name);
            let slice = ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    owner_references: Some(vec![owner.clone()]),
                    resource_version: old.and_then(|s| s.metadata.resource_version.clone()),
                    ..Default::default()
                },
                spec: spec.clone(),
            };
            let (verb, written) = match old {
                Some(_) => ("update", self.slices.replace(name, &PostParams::default(), &slice).await),
                None => ("create", self.slices.create(&PostParams::default(), &slice).await),
            };
            let stored = written.map_err(|e| {
                format!(
                    "cannot {verb} ResourceSlice {name} of DRA driver {} on node {} ({} devices, generation \
                     {generation}): {e}",
                    self.driver,
                    self.node,
                    wanted[i].len()
                )
            })?;
            self.check_stored(name, &spec, &stored.spec);
        }
        Ok(Some(Published { devices: wanted.iter().map(Vec::len).sum(), slices: count, generation }))
    }
}

/// The field selector of (driver, node)'s slices.
pub fn selector(driver: &str, node: &str) -> String {
    format!("spec.driver={driver},spec.nodeName={node}")
}

/// Aborts a task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts the publisher of `resource` as DRA driver `driver`; it ends when `stop` turns true
/// (leaving the slices in place, see the module docs).
pub fn spawn(
    driver: &str,
    resource: Arc<Resource>,
    api: ApiServer,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let mut publisher = Publisher::new(driver, &resource.config.name, &api);
    tokio::spawn(async move {
        let poke = Arc::new(Notify::new());
        let _watcher = AbortOnDrop(tokio::spawn(watch_slices(
            publisher.slices.clone(),
            publisher.selector.clone(),
            publisher.driver.clone(),
            publisher.node.clone(),
            poke.clone(),
        )));
        // Not before the resource's first device list is in (its driver's first scan, or the
        // start grace): publishing the empty list seen until then would tell the scheduler
        // this node has no devices of the driver for a moment at every start.
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = resource.first_scan() => {}
        }
        let mut view = resource.view.subscribe();
        let mut view_open = true;
        let mut outage = Outage::default();
        loop {
            let devices = view.borrow_and_update().devices.clone();
            let started = Instant::now();
            let result = tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                r = tokio::time::timeout(PASS_TIMEOUT, publisher.reconcile(&devices)) => r.unwrap_or_else(|_| {
                    Err(format!("no answer from the API server within {} s", PASS_TIMEOUT.as_secs()))
                }),
            };
            let scope = Scope { driver: &publisher.driver, node: &publisher.node };
            match result {
                Ok(done) => {
                    if let Some((attempts, lasted)) = outage.succeeded(Instant::now()) {
                        log_recovery(scope, PUBLISH, attempts, lasted);
                    }
                    if let Some(p) = done {
                        metrics.dra_slices_published(&publisher.resource, Some(p.devices));
                        tracing::info!(
                            resource = %publisher.resource,
                            dra_driver = %publisher.driver,
                            node = %publisher.node,
                            devices = p.devices,
                            slices = p.slices,
                            generation = p.generation,
                            ms = started.elapsed().as_millis() as u64,
                            "DRA: ResourceSlices published"
                        );
                    }
                }
                Err(e) => {
                    metrics.dra_slices_published(&publisher.resource, None);
                    let verdict = outage.failed(Instant::now());
                    log_failure(scope, &verdict, PUBLISH, &e);
                    // Device changes meanwhile wait for the next attempt: the pass reads the
                    // newest view, so no update is lost, and a flapping device cannot make the
                    // attempts against a server that is away more frequent.
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => break,
                        _ = tokio::time::sleep(verdict.wait()) => continue,
                    }
                }
            }
            tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                changed = view.changed(), if view_open => view_open = changed.is_ok(),
                _ = poke.notified() => {}
                _ = tokio::time::sleep(RESYNC) => {}
            }
        }
    })
}

/// Watches (driver, node)'s slices and pokes the publisher on every change someone made (our
/// own writes too; that pass then finds nothing to do), and when a watch ends (events may be
/// missed until the next one starts). A watch that cannot start, ends within
/// [`WATCH_SHORTEST`] or stays silent for [`WATCH_SILENT`] is started again after a backoff.
async fn watch_slices(slices: Api<ResourceSlice>, selector: String, driver: String, node: String, poke: Arc<Notify>) {
    let mut outage = Outage::default();
    let scope = Scope { driver: &driver, node: &node };
    loop {
        let began = Instant::now();
        let started = async {
            let list = slices.list(&ListParams::default().fields(&selector).limit(1)).await?;
            let version = list.metadata.resource_version.unwrap_or_default();
            slices.watch(&WatchParams::default().fields(&selector), &version).await
        };
        let ended = match tokio::time::timeout(PASS_TIMEOUT, started).await {
            Ok(Ok(stream)) => {
                let mut stream = std::pin::pin!(stream);
                let why = loop {
                    match tokio::time::timeout(WATCH_SILENT, stream.next()).await {
                        Ok(Some(Ok(WatchEvent::Added(_) | WatchEvent::Modified(_) | WatchEvent::Deleted(_)))) => {
                            poke.notify_one()
                        }
                        Ok(Some(Ok(WatchEvent::Bookmark(_)))) => {}
                        // 410 Gone (the version is too old) and the like: start over.
                        Ok(Some(Ok(WatchEvent::Error(e)))) => break format!("the watch ended: {}", e.message),
                        Ok(Some(Err(e))) => break format!("the watch broke: {e}"),
                        Ok(None) => break "the server ended the watch".to_owned(),
                        Err(_) => break format!("the watch was silent for {} s", WATCH_SILENT.as_secs()),
                    }
                };
                poke.notify_one();
                if began.elapsed() >= WATCH_SHORTEST {
                    if let Some((attempts, lasted)) = outage.succeeded(Instant::now()) {
                        log_recovery(scope, WATCH, attempts, lasted);
                    }
                    continue;
                }
                format!("{why} within {} ms of starting", began.elapsed().as_millis())
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer from the API server within {} s", PASS_TIMEOUT.as_secs()),
        };
        let verdict = outage.failed(Instant::now());
        log_failure(scope, &verdict, WATCH, &ended);
        tokio::time::sleep(verdict.wait()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn device(id: &str, healthy: bool, attrs: &[(&str, &str)]) -> Device {
        Device {
            id: id.into(),
            healthy,
            health_reason: None,
            numa_node: Some(1),
            attributes: attrs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
            edits: Default::default(),
            links: Vec::new(),
        }
    }

    #[test]
    fn attribute_names_are_camel_cased_c_identifiers() {
        assert_eq!(attribute_name("model").as_deref(), Some("model"));
        assert_eq!(attribute_name("pci_address").as_deref(), Some("pciAddress"));
        assert_eq!(attribute_name("compute_capability").as_deref(), Some("computeCapability"));
        assert_eq!(attribute_name("numa-node").as_deref(), Some("numaNode"));
        assert_eq!(attribute_name("3d").as_deref(), Some("_3d"));
        assert_eq!(attribute_name("__"), None);
        assert_eq!(attribute_name(&"a".repeat(33)), None);
    }

    #[test]
    fn values_are_typed() {
        assert_eq!(typed("42").unwrap().int, Some(42));
        assert_eq!(typed("-1").unwrap().int, Some(-1));
        assert_eq!(typed("true").unwrap().bool, Some(true));
        assert_eq!(typed("1.2.3-rc.1+b5").unwrap().version.as_deref(), Some("1.2.3-rc.1+b5"));
        assert_eq!(typed("535.104.05").unwrap().string.as_deref(), Some("535.104.05"), "leading zero: no semver");
        assert_eq!(typed("8.0").unwrap().string.as_deref(), Some("8.0"));
        assert_eq!(typed("NVIDIA H100 80GB HBM3").unwrap().string.as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert!(typed(&"x".repeat(65)).is_none());
        assert!(!is_semver("1.2") && !is_semver("01.2.3") && !is_semver("1.2.3-01") && is_semver("0.0.0-0a"));
    }

    #[test]
    fn pci_addresses_and_roots() {
        assert_eq!(pci_bus_id("0000:3B:00.0").as_deref(), Some("0000:3b:00.0"));
        assert_eq!(pci_bus_id("0000:3b:00.0,0000:3c:00.0"), None);
        assert_eq!(
            pcie_root_of_link(Path::new("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0")).as_deref(),
            Some("pci0000:3a")
        );
        assert_eq!(pcie_root_of_link(Path::new("../../devices/platform/x")), None);
    }

    #[test]
    fn a_device_gets_standard_attributes_capacity_and_typed_driver_attributes() {
        let d = device(
            "GPU-1",
            true,
            &[
                ("model", "H100"),
                ("memory", "81559"),
                ("pci_address", "0000:3b:00.0"),
                ("index", "0"),
                ("numa_node", "1"),
            ],
        );
        let (dra, skipped) = dra_device(&d, Path::new("/nonexistent"));
        assert!(skipped.is_empty(), "{skipped:?}");
        assert_eq!(dra.name, device_name("GPU-1"));
        let attrs = dra.attributes.unwrap();
        assert_eq!(attrs["numaNode"].int, Some(1));
        assert_eq!(attrs["model"].string.as_deref(), Some("H100"));
        assert_eq!(attrs["index"].int, Some(0));
        assert_eq!(attrs[PCI_BUS_ID].string.as_deref(), Some("0000:3b:00.0"));
        assert_eq!(attrs["pciAddress"].string.as_deref(), Some("0000:3b:00.0"));
        assert!(!attrs.contains_key("memory"));
        assert_eq!(dra.capacity.unwrap()["memory"].value, Quantity("81559Mi".into()));
    }

    #[test]
    fn quantities_take_the_canonical_binary_suffix() {
        assert_eq!(binary_quantity(81559, 2), Quantity("81559Mi".into()));
        assert_eq!(binary_quantity(40960, 2), Quantity("40Gi".into()));
        assert_eq!(binary_quantity(1024 * 1024, 3), Quantity("1Pi".into()));
        assert_eq!(binary_quantity(16, 3), Quantity("16Gi".into()));
        assert_eq!(binary_quantity(0, 2), Quantity("0".into()));
    }

    #[test]
    fn too_many_attributes_are_cut_at_32_entries_and_said() {
        let attrs: Vec<(String, String)> = (0..40).map(|i| (format!("a{i:02}"), "v".to_string())).collect();
        let refs: Vec<(&str, &str)> = attrs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let (dra, skipped) = dra_device(&device("d", true, &refs), Path::new("/nonexistent"));
        assert_eq!(dra.attributes.unwrap().len(), MAX_ENTRIES);
        assert!(skipped[0].contains("a31"), "{skipped:?}");
    }

    #[test]
    fn only_healthy_devices_are_split_into_slices_of_128() {
        let mut devices: Vec<Device> = (0..300).map(|i| device(&format!("dev-{i}"), true, &[])).collect();
        devices[5].healthy = false;
        let (slices, notes) = desired(&devices, Path::new("/nonexistent"));
        assert!(notes.is_empty());
        assert_eq!(slices.iter().map(Vec::len).collect::<Vec<_>>(), [128, 128, 43]);
        assert!(slices.iter().flatten().all(|d| d.name != "dev-5"));
        let (empty, _) = desired(&[], Path::new("/nonexistent"));
        assert_eq!(empty.len(), 1, "an empty pool keeps one empty slice");
    }

    #[test]
    fn slice_names_are_deterministic_ordered_and_short_enough() {
        assert_eq!(slice_name("node-1", "accel.example.com", 2), "node-1-accel.example.com-0002");
        let long = slice_name(&"n".repeat(250), "accel.example.com", 3);
        assert!(long.len() <= 253 && long.ends_with("-0003"), "{long}");
        assert_eq!(long, slice_name(&"n".repeat(250), "accel.example.com", 3));
    }
}
