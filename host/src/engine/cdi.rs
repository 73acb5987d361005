//! CDI (Container Device Interface) spec files: with `cdi_dir` set, the host keeps one spec per
//! resource in that folder, in step with the resource's devices, so a CDI-aware runtime can
//! inject a device by its fully-qualified name `<vendor>/<class>=<device>`. A resource with
//! `device_list_strategy = "cdi"` then answers Allocate with those names instead of raw edits.
//!
//! Mapping, fixed here and documented in docs/features.md:
//! - kind = the resource name (`nvidia.com/gpu`), which must also pass CDI's kind rules;
//! - device name = the device ID when it is a valid CDI name, else a sanitised form plus a hash;
//! - file = `devhost-<vendor>_<class>.json`, the socket's naming scheme;
//! - each entry holds the device's nodes, mounts and env, except *list variables*: env keys that
//!   several devices of the resource set to different values (`X_VISIBLE_DEVICES=3`). The runtime
//!   applies CDI env per device, last one winning, so those stay in the Allocate answer, joined.
//! - a CDI name a device declares itself (`nvidia.com/gpu=GPU-…`, its driver's CDI strategy) is
//!   defined here too when that device alone declares it and has edits: the same entry, under the
//!   declared kind, in `devhost-<vendor>_<class>+<kind's vendor>_<class>.json` unless the kind is
//!   the resource's own. Allocate then hands out the name instead of the edits it stands for.
//!
//! [`resolve`] checks that every name handed out resolves in the runtime's CDI folders;
//! [`watch`] sees the folders change and [`repair`] writes devhost's own files again when
//! someone else removed or changed them.

pub mod repair;
pub mod resolve;
pub mod watch;

use crate::driver::device::{Device, Edits};
use crate::names::{fnv1a, has_hash_suffix};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Prefix of the container annotation that carries CDI names to runtimes without CRI CDI support.
pub const ANNOTATION_PREFIX: &str = "cdi.k8s.io/";
/// The annotation key's name part may have at most this many characters (Kubernetes' rule).
const MAX_ANNOTATION_NAME: usize = 63;
fn is_alnum(c: char) -> bool {
    c.is_ascii_alphanumeric()
}

/// The lowest CDI version that covers what devhost writes: `hostPath` in device nodes came with
/// 0.5.0, dots in the class with 0.6.0.
pub fn cdi_version(resource: &str) -> &'static str {
    match resource.split_once('/') {
        Some((_, class)) if class.contains('.') => "0.6.0",
        _ => "0.5.0",
    }
}

fn is_device_name_char(c: char) -> bool {
    is_alnum(c) || matches!(c, '_' | '-' | '.' | ':')
}

/// Whether `name` is a valid CDI device name: letters, digits, `_`, `-`, `.` and `:`, starting
/// and ending with a letter or digit.
pub fn is_device_name(name: &str) -> bool {
    name.chars().next().is_some_and(is_alnum)
        && name.chars().last().is_some_and(is_alnum)
        && name.chars().all(is_device_name_char)
}

/// The CDI device name for a device ID: the ID itself when it is a valid name (the usual case:
/// `0`, `GPU-8c1e…`, `0000:3b:00.0`, `MIG-…`) that does not end like a hashed name (`-` and 8
/// hex digits); otherwise every character CDI does not allow becomes `_`, an `x` is put in front
/// when the result does not start with a letter or digit, and `-` plus 8 hex digits of the ID's
/// hash is appended, so two different IDs share a name only on a 32-bit hash collision (without
/// the exception, found by fuzzing, ID `x-811c9dc5` took the name of a hashed ID and the spec
/// file named one device twice, which CDI refuses whole).
pub fn device_name(id: &str) -> String {
    if is_device_name(id) && !has_hash_suffix(id) {
        return id.to_string();
    }
    let mut body: String = id.chars().map(|c| if is_device_name_char(c) { c } else { '_' }).collect();
    if !body.chars().next().is_some_and(is_alnum) {
        body.insert(0, 'x');
    }
    format!("{body}-{:08x}", fnv1a(id))
}

/// The fully-qualified CDI name of a device: `<kind>=<device name>`.
pub fn qualified_name(resource: &str, device_id: &str) -> String {
    format!("{resource}={}", device_name(device_id))
}

/// The spec file's name: `devhost-<vendor>_<class>.json` (a valid domain never holds `_`, so two
/// resources never share a file).
pub fn file_name(resource: &str) -> String {
    format!("devhost-{}.json", file_body(resource))
}

fn file_body(kind: &str) -> String {
    kind.chars().map(|c| if is_alnum(c) || matches!(c, '.' | '-' | '_') { c } else { '_' }).collect()
}

/// The file of a resource's spec of kind `kind`: [`file_name`] for its own kind, else
/// `devhost-<resource>+<kind>.json` (no body holds `+`, so a file names one resource and kind).
pub fn kind_file_name(resource: &str, kind: &str) -> String {
    if kind == resource {
        return file_name(resource);
    }
    format!("devhost-{}+{}.json", file_body(resource), file_body(kind))
}

/// Whether `file` is one of `resource`'s spec files.
fn is_file_of(file: &str, resource: &str) -> bool {
    file == file_name(resource)
        || file.strip_prefix(&format!("devhost-{}+", file_body(resource))).is_some_and(|rest| rest.ends_with(".json"))
}

/// The annotation key for a resource's CDI names, `cdi.k8s.io/devhost_<vendor>_<class>`: unique
/// per resource, so the annotations of several resources on one container do not collide. A name
/// part over 63 characters is cut and ends in a hash instead.
pub fn annotation_key(resource: &str) -> String {
    let body: String = format!("devhost_{resource}")
        .chars()
        .map(|c| if is_alnum(c) || matches!(c, '.' | '-' | '_') { c } else { '_' })
        .collect();
    if body.len() <= MAX_ANNOTATION_NAME {
        return format!("{ANNOTATION_PREFIX}{body}");
    }
    let keep = MAX_ANNOTATION_NAME - 9;
    format!("{ANNOTATION_PREFIX}{}_{:08x}", &body[..keep], fnv1a(resource))
}

/// Env keys that two or more devices set to different values: joined by the host, so they are
/// left out of the spec and returned with the Allocate answer.
pub fn list_vars(devices: &[Device]) -> BTreeSet<String> {
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (k, v) in devices.iter().flat_map(|d| &d.edits.envs) {
        match seen.get(k.as_str()) {
            Some(first) if first != v => {
                out.insert(k.clone());
            }
            Some(_) => {}
            None => {
                seen.insert(k, v);
            }
        }
    }
    out
}

#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
struct SpecFile {
    cdi_version: &'static str,
    kind: String,
    devices: Vec<SpecDevice>,
}

#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
struct SpecDevice {
    name: String,
    container_edits: ContainerEdits,
}

#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
struct ContainerEdits {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    env: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    device_nodes: Vec<SpecNode>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    mounts: Vec<SpecMount>,
}

#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
struct SpecNode {
    path: String,
    host_path: String,
    permissions: String,
}

#[derive(Serialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
struct SpecMount {
    host_path: String,
    container_path: String,
    options: Vec<&'static str>,
}

/// A device's CDI edits; `None` when nothing is left (CDI forbids an entry without edits).
fn device_edits(edits: &Edits, list_vars: &BTreeSet<String>) -> Option<ContainerEdits> {
    let out = ContainerEdits {
        env: edits.envs.iter().filter(|(k, _)| !list_vars.contains(k)).map(|(k, v)| format!("{k}={v}")).collect(),
        device_nodes: edits
            .device_nodes
            .iter()
            .map(|n| SpecNode {
                path: n.container_path.clone(),
                host_path: n.host_path.clone(),
                permissions: n.permissions.clone(),
            })
            .collect(),
        mounts: edits
            .mounts
            .iter()
            .map(|m| SpecMount {
                host_path: m.host_path.clone(),
                container_path: m.container_path.clone(),
                options: vec![if m.read_only { "ro" } else { "rw" }, "nosuid", "nodev", "bind"],
            })
            .collect(),
    };
    let empty = out.env.is_empty() && out.device_nodes.is_empty() && out.mounts.is_empty();
    (!empty).then_some(out)
}

/// The CDI names devices declare themselves that devhost defines, each with the index of its
/// device: a valid `kind=name` that one device of the resource alone declares (a name several
/// devices share, like `vendor.com/x=all`, stands for no single device's edits), when that device
/// has edits to describe.
pub fn own_names(devices: &[Device]) -> BTreeMap<&str, usize> {
    let vars = list_vars(devices);
    let mut count: HashMap<&str, usize> = HashMap::new();
    for name in devices.iter().flat_map(|d| &d.edits.cdi_devices) {
        *count.entry(name).or_default() += 1;
    }
    let mut out = BTreeMap::new();
    for (i, d) in devices.iter().enumerate() {
        for name in &d.edits.cdi_devices {
            let valid = split_name(name)
                .is_some_and(|(kind, dev)| crate::manifest::check_kind(kind).is_ok() && is_device_name(dev));
            if valid && count.get(name.as_str()) == Some(&1) && device_edits(&d.edits, &vars).is_some() {
                out.insert(name.as_str(), i);
            }
        }
    }
    out
}

/// `kind=name` split at the `=`.
pub fn split_name(qualified: &str) -> Option<(&str, &str)> {
    qualified.split_once('=')
}

/// The spec files for a resource's devices, one per kind: the resource's own kind (each device
/// under its ID's name) and each kind of the devices' [own names](own_names). Deterministic: the
/// same devices give the same bytes. Empty when no device has edits to describe (CDI requires at
/// least one device per spec).
pub fn render_all(resource: &str, devices: &[Device]) -> Vec<(String, Vec<u8>)> {
    let vars = list_vars(devices);
    let mut kinds: BTreeMap<&str, Vec<SpecDevice>> = BTreeMap::new();
    for d in devices {
        if let Some(e) = device_edits(&d.edits, &vars) {
            kinds.entry(resource).or_default().push(SpecDevice { name: device_name(&d.id), container_edits: e });
        }
    }
    for (qualified, i) in own_names(devices) {
        let Some((kind, name)) = split_name(qualified) else { continue };
        let entries = kinds.entry(kind).or_default();
        // The resource's own entry of that name (a uuid named under the resource's kind) is the
        // same device's: CDI refuses a name twice in one spec.
        if entries.iter().any(|e| e.name == name) {
            continue;
        }
        if let Some(e) = device_edits(&devices[i].edits, &vars) {
            entries.push(SpecDevice { name: name.to_string(), container_edits: e });
        }
    }
    let mut out = Vec::new();
    for (kind, devices) in kinds {
        let spec = SpecFile { cdi_version: cdi_version(kind), kind: kind.to_string(), devices };
        // Serialising plain structs of strings cannot fail; an empty answer would only skip a write.
        if let Ok(mut bytes) = serde_json::to_vec_pretty(&spec) {
            bytes.push(b'\n');
            out.push((kind.to_string(), bytes));
        }
    }
    out
}

/// The spec file of the resource's own kind only (see [`render_all`]), or `None`.
pub fn render(resource: &str, devices: &[Device]) -> Option<Vec<u8>> {
    render_all(resource, devices).into_iter().find(|(k, _)| k == resource).map(|(_, b)| b)
}

/// A spec file of kind `kind` with one entry per `(device name, edits)`; entries without edits
/// are left out (CDI forbids them), and `None` when none is left. Used for DRA claims, whose
/// devices each carry their own part of the claim's edits.
pub fn render_entries(kind: &str, entries: &[(String, Edits)]) -> Option<Vec<u8>> {
    let none = BTreeSet::new();
    let devices: Vec<SpecDevice> = entries
        .iter()
        .filter_map(|(name, edits)| {
            device_edits(edits, &none).map(|e| SpecDevice { name: name.clone(), container_edits: e })
        })
        .collect();
    if devices.is_empty() {
        return None;
    }
    let spec = SpecFile { cdi_version: cdi_version(kind), kind: kind.to_string(), devices };
    let mut bytes = serde_json::to_vec_pretty(&spec).ok()?;
    bytes.push(b'\n');
    Some(bytes)
}

/// What a device whose [own names](own_names) devhost defines contributes to an Allocate answer
/// in `edits` mode: its list variables, annotations and CDI names; its nodes, mounts and other
/// env reach the container through those names.
pub fn through_names(device: &Device, vars: &BTreeSet<String>) -> Device {
    let e = &device.edits;
    let edits = Edits {
        envs: e.envs.iter().filter(|(k, _)| vars.contains(k)).cloned().collect(),
        annotations: e.annotations.clone(),
        cdi_devices: e.cdi_devices.clone(),
        ..Edits::default()
    };
    Device { edits, ..device.clone() }
}

/// Turns the composed edits of one container request into the `cdi` strategy's answer: the CDI
/// names of the requested devices that have a spec entry, the same names in the CDI annotation,
/// and what CDI cannot carry (list variables, annotations, CDI names the driver declared).
/// `devices` is the resource's current device list (replicas included); `physical` the requested
/// physical device IDs (after [`crate::engine::sharing::physical_ids`]).
pub fn allocate_edits(resource: &str, devices: &[Device], physical: &[String], composed: Edits) -> Edits {
    let vars = list_vars(devices);
    // A device by its ID, else the first replica of it: looked for in the list for a few IDs, in
    // a map of the list for more (a request for thousands of devices stays linear).
    let index: Option<HashMap<&str, &Device>> = (physical.len() > crate::driver::device::SHORT).then(|| {
        let mut index = HashMap::with_capacity(devices.len());
        for d in devices {
            index.entry(d.id.as_str()).or_insert(d);
        }
        for d in devices {
            if let Some((p, _)) = crate::engine::sharing::parse_replica(&d.id) {
                index.entry(p).or_insert(d);
            }
        }
        index
    });
    let find = |id: &str| match &index {
        Some(index) => index.get(id).copied(),
        None => devices.iter().find(|d| d.id == id).or_else(|| {
            devices.iter().find(|d| crate::engine::sharing::parse_replica(&d.id).is_some_and(|(p, _)| p == id))
        }),
    };
    let names: Vec<String> = physical
        .iter()
        .filter(|id| find(id).is_some_and(|d| device_edits(&d.edits, &vars).is_some()))
        .map(|id| qualified_name(resource, id))
        .collect();
    let mut out = Edits {
        envs: composed.envs.into_iter().filter(|(k, _)| vars.contains(k)).collect(),
        annotations: composed.annotations,
        cdi_devices: names.clone(),
        ..Edits::default()
    };
    // The driver's own CDI names after ours, each once.
    out.amend(Edits { cdi_devices: composed.cdi_devices, ..Edits::default() });
    if !names.is_empty() {
        out.annotations.push((annotation_key(resource), names.join(",")));
    }
    out
}

/// Writes and removes spec files in one folder.
#[derive(Clone, Debug)]
pub struct CdiWriter {
    dir: PathBuf,
    /// Each of devhost's spec files by name, as it last meant to write it (written or not): what
    /// [`repair`] restores. Held while a file is written, so a repair never puts back content a
    /// newer write has just replaced.
    wanted: Arc<Mutex<BTreeMap<String, Vec<u8>>>>,
}

/// Makes temporary file names unique when two tasks write the same resource at once.
static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

fn with_path(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("CDI spec {}: {e}", path.display()))
}

impl CdiWriter {
    pub fn new(dir: impl Into<PathBuf>) -> CdiWriter {
        CdiWriter { dir: dir.into(), wanted: Arc::default() }
    }

    fn wanted(&self) -> MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        self.wanted.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where a resource's spec lives.
    pub fn path(&self, resource: &str) -> PathBuf {
        self.dir.join(file_name(resource))
    }

    /// Brings a resource's spec files in step with its devices ([`render_all`]): each written
    /// atomically (a temporary file in the same folder, flushed to disk, then renamed over the old
    /// one, so a runtime never reads half a spec), left alone when the content is unchanged; the
    /// resource's files of kinds it no longer has are removed. Returns whether a file changed.
    pub fn write(&self, resource: &str, devices: &[Device]) -> io::Result<bool> {
        let specs = render_all(resource, devices);
        let keep: BTreeSet<String> = specs.iter().map(|(kind, _)| kind_file_name(resource, kind)).collect();
        let mut wanted = self.wanted();
        wanted.retain(|file, _| !is_file_of(file, resource));
        wanted.extend(specs.iter().map(|(kind, bytes)| (kind_file_name(resource, kind), bytes.clone())));
        let mut changed = self.remove_files(resource, &keep)?;
        for (kind, bytes) in &specs {
            changed |= self.write_file(&kind_file_name(resource, kind), bytes)?;
        }
        Ok(changed)
    }

    fn write_file(&self, file: &str, bytes: &[u8]) -> io::Result<bool> {
        let path = self.dir.join(file);
        match std::fs::read(&path) {
            Ok(old) if old == bytes => return Ok(false),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(with_path(&path, e)),
        }
        std::fs::create_dir_all(&self.dir).map_err(|e| with_path(&self.dir, e))?;
        // No `.json` suffix: runtimes watching the folder only load `.json`/`.yaml` files.
        let seq = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
        let temp = self.dir.join(format!(".{file}.{}-{seq}.tmp", std::process::id()));
        let written = write_synced(&temp, bytes).and_then(|()| std::fs::rename(&temp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temp);
            return Err(with_path(&path, e));
        }
        // The rename is durable once the folder itself is flushed.
        if let Ok(dir) = std::fs::File::open(&self.dir) {
            let _ = dir.sync_all();
        }
        Ok(true)
    }

    /// Removes a resource's spec files (the resource left the manifest). Returns whether a file
    /// was there.
    pub fn remove(&self, resource: &str) -> io::Result<bool> {
        let mut wanted = self.wanted();
        wanted.retain(|file, _| !is_file_of(file, resource));
        self.remove_files(resource, &BTreeSet::new())
    }

    /// Removes the resource's spec files not named in `keep`.
    fn remove_files(&self, resource: &str, keep: &BTreeSet<String>) -> io::Result<bool> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(with_path(&self.dir, e)),
        };
        let mut removed = false;
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !is_file_of(&name, resource) || keep.contains(&name) {
                continue;
            }
            match std::fs::remove_file(entry.path()) {
                Ok(()) => removed = true,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(with_path(&entry.path(), e)),
            }
        }
        Ok(removed)
    }

    /// Removes devhost's spec files (and leftover temporary files) that belong to none of
    /// `resources`: what a previous run or an older manifest left behind. Other tools' files in
    /// the folder are never touched. Returns the removed paths.
    pub fn remove_stale(&self, resources: &[&str]) -> io::Result<Vec<PathBuf>> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(with_path(&self.dir, e)),
        };
        let mut removed = Vec::new();
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            let kept = resources.iter().any(|r| is_file_of(&name, r));
            let ours = name.starts_with("devhost-") && name.ends_with(".json") && !kept;
            let temp = name.starts_with(".devhost-") && name.ends_with(".tmp");
            if (ours || temp) && std::fs::remove_file(entry.path()).is_ok() {
                removed.push(entry.path());
            }
        }
        Ok(removed)
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

#[cfg(test)]
mod tests;
