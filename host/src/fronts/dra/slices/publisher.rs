//! One reconcile pass of (driver, node)'s ResourceSlices against the API server: the wanted
//! slices (healthy devices, split and named), compared with what the server has, then the
//! creates, updates and deletes that make them equal (the generation rules in the area's docs).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{Device as DraDevice, ResourcePool, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};

use super::super::api::ApiServer;
use super::super::taint::health_taint;
use super::attributes::{LoggedWarnings, dra_device};
use crate::driver::device::Device;
use crate::manifest::TaintEffect;
use crate::names::fnv1a;

/// The field selector of (driver, node)'s slices.
pub fn selector(driver: &str, node: &str) -> String {
    format!("spec.driver={driver},spec.nodeName={node}")
}

/// Most devices in one ResourceSlice (the API server's limit without taints or counters).
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Longest object name (a DNS subdomain).
const MAX_OBJECT_NAME: usize = 253;

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

/// Most devices in one ResourceSlice when one of them has a taint
/// (`ResourceSliceMaxDevicesWithAdvancedFeatures`).
pub const MAX_DEVICES_PER_TAINTED_SLICE: usize = 64;
/// How a DRA resource's unhealthy devices appear in its slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unhealthy {
    /// Published with the health taint, of this effect.
    Tainted(TaintEffect),
    /// Left out: the API server drops device taints (its DRADeviceTaints gate is off).
    LeftOut,
}

/// The desired device lists of DRA driver `driver`, one per slice (at least one, maybe empty):
/// the devices of `devices` in order, the unhealthy ones tainted or left out as `unhealthy`
/// says, split every [`MAX_DEVICES_PER_SLICE`] ([`MAX_DEVICES_PER_TAINTED_SLICE`] once a device
/// is tainted). Messages name what was left out.
pub fn desired(
    devices: &[Device],
    sysfs: &Path,
    driver: &str,
    unhealthy: Unhealthy,
) -> (Vec<Vec<DraDevice>>, Vec<String>) {
    let mut notes = Vec::new();
    let mut seen: HashMap<String, &str> = HashMap::new();
    let mut all = Vec::new();
    for d in devices {
        let taint = match (d.healthy, unhealthy) {
            (true, _) => None,
            (false, Unhealthy::Tainted(effect)) => Some(health_taint(driver, d, effect)),
            (false, Unhealthy::LeftOut) => continue,
        };
        let (mut dra, skipped) = dra_device(d, sysfs);
        notes.extend(skipped.into_iter().map(|s| format!("device {}: {s}", d.id)));
        if let Some(first) = seen.get(&dra.name) {
            notes.push(format!(
                "device {} is not published: its DRA device name {} is already that of device {first}",
                d.id, dra.name
            ));
            continue;
        }
        seen.insert(dra.name.clone(), &d.id);
        dra.taints = taint.map(|t| vec![t]);
        all.push(dra);
    }
    let tainted = all.iter().any(|d| d.taints.is_some());
    let size = if tainted { MAX_DEVICES_PER_TAINTED_SLICE } else { MAX_DEVICES_PER_SLICE };
    let mut slices: Vec<Vec<DraDevice>> = all.chunks(size).map(<[_]>::to_vec).collect();
    if slices.is_empty() {
        slices.push(Vec::new());
    }
    (slices, notes)
}

/// Gives each taint of `wanted` the `timeAdded` the server stored for the same taint (key and
/// effect) of the same device in `existing`, so a device unhealthy since then keeps its time
/// (a NoExecute toleration's seconds count from it) and an unchanged slice compares equal.
fn keep_taint_times(wanted: &mut [Vec<DraDevice>], existing: &HashMap<String, ResourceSlice>) {
    let mut stored: HashMap<(&str, &str, &str), _> = HashMap::new();
    for device in existing.values().flat_map(|s| s.spec.devices.iter().flatten()) {
        for taint in device.taints.iter().flatten() {
            if let Some(time) = &taint.time_added {
                stored.insert((device.name.as_str(), taint.key.as_str(), taint.effect.as_str()), time.clone());
            }
        }
    }
    for device in wanted.iter_mut().flatten() {
        for taint in device.taints.iter_mut().flatten() {
            taint.time_added = stored.get(&(device.name.as_str(), taint.key.as_str(), taint.effect.as_str())).cloned();
        }
    }
}

/// How many taints the devices of `spec` carry.
fn taints_in(spec: &ResourceSliceSpec) -> usize {
    spec.devices.iter().flatten().map(|d| d.taints.as_ref().map_or(0, Vec::len)).sum()
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
pub(super) struct Publisher {
    pub(super) driver: String,
    pub(super) resource: String,
    pub(super) node: String,
    pub(super) slices: Api<ResourceSlice>,
    pub(super) nodes: Api<Node>,
    pub(super) selector: String,
    pub(super) sysfs: PathBuf,
    /// The warnings logged already, each once.
    pub(super) logged: LoggedWarnings,
    /// Per slice name: the spec last sent and the spec the server stored for it, so a field
    /// the server drops (a feature gate off) does not make every pass write again.
    pub(super) stored: HashMap<String, (serde_json::Value, serde_json::Value)>,
    /// How unhealthy devices are published: tainted until the server shows it drops taints.
    pub(super) unhealthy: Unhealthy,
}

fn json<T: serde::Serialize>(value: &T) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

impl Publisher {
    pub(super) fn new(driver: &str, resource: &str, effect: TaintEffect, api: &ApiServer) -> Publisher {
        Publisher {
            driver: driver.to_owned(),
            resource: resource.to_owned(),
            node: api.node.clone(),
            slices: Api::all(api.client.clone()),
            nodes: Api::all(api.client.clone()),
            selector: selector(driver, &api.node),
            sysfs: PathBuf::from("/sys"),
            logged: LoggedWarnings::default(),
            stored: HashMap::new(),
            unhealthy: Unhealthy::Tainted(effect),
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

    /// Remembers what the server stored for `sent`, warning once per slice if it differs. A
    /// server that drops the devices' taints turns publishing to leaving unhealthy devices out.
    fn check_stored(&mut self, name: &str, sent: &ResourceSliceSpec, stored: &ResourceSliceSpec) {
        let dropped_taints = taints_in(sent) > 0 && taints_in(stored) == 0;
        if dropped_taints && self.unhealthy != Unhealthy::LeftOut {
            self.unhealthy = Unhealthy::LeftOut;
            tracing::warn!(resource = %self.resource, dra_driver = %self.driver, node = %self.node,
                "the API server dropped the device taints of ResourceSlice {name} (its DRADeviceTaints feature gate \
                 is off): unhealthy devices of DRA driver {} are left out of its slices instead of tainted, until \
                 devhost starts again", self.driver);
        }
        let (sent, stored) = (json(sent), json(stored));
        let mut paths = Vec::new();
        differences(&sent, &stored, "spec", &mut paths);
        // The server stamps a new taint's time; dropped taints were handled above. Any other
        // change to a taint is reported like any other field.
        paths.retain(|p| !p.ends_with(".timeAdded (added)") && (!dropped_taints || !p.contains(".taints")));
        if !paths.is_empty() {
            let text = format!(
                "the API server stored ResourceSlice {name} of DRA driver {} on node {} with fields dropped or \
                 changed ({}); a feature gate of the API server may be off",
                self.driver,
                self.node,
                paths.join(", ")
            );
            if self.logged.is_new(&text) {
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

    /// Makes the server's slices those of `devices`. `Ok(Some(_))` when it wrote. A pass that
    /// finds the server dropping taints is followed at once by one that leaves unhealthy
    /// devices out.
    pub(super) async fn reconcile(&mut self, devices: &[Device]) -> Result<Option<Published>, String> {
        let before = self.unhealthy;
        let wrote = self.pass(devices).await?;
        if self.unhealthy == before {
            return Ok(wrote);
        }
        self.pass(devices).await
    }

    /// One pass of [`Publisher::reconcile`].
    async fn pass(&mut self, devices: &[Device]) -> Result<Option<Published>, String> {
        let (mut wanted, notes) = desired(devices, &self.sysfs, &self.driver, self.unhealthy);
        for note in notes {
            if self.logged.is_new(&note) {
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
        keep_taint_times(&mut wanted, &existing);
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
        self.delete(&obsolete).await?;
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

    /// Deletes the `obsolete` slices, each only as it was read (its uid and resourceVersion as
    /// preconditions); one already gone is fine.
    async fn delete(&mut self, obsolete: &[&ResourceSlice]) -> Result<(), String> {
        let (d, n) = (&self.driver, &self.node);
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
        Ok(())
    }
}
