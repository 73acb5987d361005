//! Whether the CDI names devhost hands out resolve where the container runtime looks: its CDI
//! folders (`cdi_spec_dirs`) read the way the reference CDI library (containerd's, CRI-O's) reads
//! them. A name no spec defines, or one two specs of the same folder define (the library drops
//! it from both), fails every container that gets it with `CDI device injection failed:
//! unresolvable CDI devices`; this check says so in devhost's log, metrics and `devhost check`.
//!
//! The library's rules, as followed here: folders in order, a spec in a later folder replacing an
//! earlier folder's definition of the same name; in each folder the `.json` and `.yaml` files in
//! name order; a file that cannot be read or parsed, whose kind is not valid or that names a
//! device twice is skipped whole.

use super::{is_device_name, split_name};
use crate::driver::device::Device;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};

/// Where a qualified CDI name is defined, as the runtime would resolve it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Definition {
    /// By this file, in the folder of this position.
    At(PathBuf, usize),
    /// By two files of one folder: the runtime drops it.
    Conflict(Vec<PathBuf>),
}

/// Every name the runtime's folders define, and the files it would skip.
#[derive(Debug, Default)]
pub struct Defined {
    dirs: Vec<PathBuf>,
    names: HashMap<String, Definition>,
    /// A file (or folder) the runtime cannot use, and why.
    pub skipped: Vec<String>,
}

#[derive(Deserialize)]
struct RawSpec {
    kind: String,
    #[serde(default)]
    devices: Vec<RawDevice>,
}

#[derive(Deserialize)]
struct RawDevice {
    name: String,
}

/// The device names a spec file defines under its kind, or why the runtime would skip it.
fn parse(file: &str, bytes: &[u8]) -> Result<(String, Vec<String>), String> {
    let raw: RawSpec = if file.ends_with(".json") {
        serde_json::from_slice(bytes).map_err(|e| e.to_string())?
    } else {
        let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
        serde_saphyr::from_str(text).map_err(|e| e.to_string())?
    };
    crate::manifest::check_kind(&raw.kind)?;
    let mut names = BTreeSet::new();
    for d in &raw.devices {
        if !is_device_name(&d.name) {
            return Err(format!("device name {:?} is not a valid CDI name", d.name));
        }
        if !names.insert(d.name.as_str()) {
            return Err(format!("device {:?} is named twice", d.name));
        }
    }
    Ok((raw.kind.clone(), raw.devices.into_iter().map(|d| d.name).collect()))
}

/// Whether two folder paths name the same folder.
fn same_dir(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a.components().eq(b.components()),
    }
}

/// devhost's own spec files in a folder, as the daemon would leave them: `files` (name, content)
/// in place of every `devhost-*.json` there. `devhost check` writes nothing, so it checks what
/// the daemon would write.
pub struct Planned<'a> {
    pub dir: &'a Path,
    pub files: Vec<(String, Vec<u8>)>,
}

impl Defined {
    /// Reads `dirs` in the runtime's order, with `planned` standing in for devhost's own files.
    pub fn scan(dirs: &[PathBuf], planned: Option<&Planned<'_>>) -> Defined {
        let mut out = Defined { dirs: dirs.to_vec(), ..Defined::default() };
        for (priority, dir) in dirs.iter().enumerate() {
            let mut files: BTreeMap<String, Result<Vec<u8>, String>> = BTreeMap::new();
            match std::fs::read_dir(dir) {
                Ok(entries) => {
                    for entry in entries.filter_map(Result::ok) {
                        let name = entry.file_name().to_string_lossy().into_owned();
                        let spec = name.ends_with(".json") || name.ends_with(".yaml");
                        if !spec || entry.file_type().is_ok_and(|t| t.is_dir()) {
                            continue;
                        }
                        files.insert(name, std::fs::read(entry.path()).map_err(|e| e.to_string()));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => out.skipped.push(format!("CDI folder {}: {e}", dir.display())),
            }
            if let Some(p) = planned.filter(|p| same_dir(p.dir, dir)) {
                files.retain(|name, _| !(name.starts_with("devhost-") && name.ends_with(".json")));
                files.extend(p.files.iter().map(|(n, b)| (n.clone(), Ok(b.clone()))));
            }
            for (name, bytes) in files {
                let path = dir.join(&name);
                match bytes.and_then(|b| parse(&name, &b)) {
                    Ok((kind, devices)) => {
                        for d in devices {
                            out.define(format!("{kind}={d}"), &path, priority);
                        }
                    }
                    Err(why) => out.skipped.push(format!("CDI spec {}: {why}; the runtime skips it", path.display())),
                }
            }
        }
        out
    }

    fn define(&mut self, name: String, path: &Path, priority: usize) {
        let next = match self.names.remove(&name) {
            // The library keeps a conflict even when a later folder defines the name again.
            Some(Definition::Conflict(mut files)) => {
                if priority == files_priority(&files, &self.dirs) {
                    files.push(path.to_path_buf());
                }
                Definition::Conflict(files)
            }
            Some(Definition::At(old, p)) if p == priority => Definition::Conflict(vec![old, path.to_path_buf()]),
            _ => Definition::At(path.to_path_buf(), priority),
        };
        self.names.insert(name, next);
    }

    /// Why `name` does not resolve, if it does not.
    pub fn unresolved(&self, name: &str) -> Option<Unresolved> {
        match self.names.get(name) {
            Some(Definition::At(..)) => None,
            Some(Definition::Conflict(files)) => Some(Unresolved::Conflict(files.clone())),
            None => Some(Unresolved::Missing(self.dirs.clone())),
        }
    }
}

/// The folder position of a conflict's files (all in one folder).
fn files_priority(files: &[PathBuf], dirs: &[PathBuf]) -> usize {
    let dir = files.first().and_then(|f| f.parent());
    dirs.iter().position(|d| dir.is_some_and(|p| p == d)).unwrap_or(usize::MAX)
}

/// Why a CDI name does not resolve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unresolved {
    /// No spec in these folders defines it.
    Missing(Vec<PathBuf>),
    /// These spec files of one folder all define it, so the runtime drops it.
    Conflict(Vec<PathBuf>),
}

/// One CDI name devhost would hand out that the runtime cannot resolve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub resource: String,
    pub device: String,
    pub name: String,
    pub why: Unresolved,
    /// devhost's `cdi_dir`, when the runtime does not read it.
    pub unread_cdi_dir: Option<PathBuf>,
}

fn paths(list: &[PathBuf]) -> String {
    list.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Problem { resource, device, name, .. } = self;
        write!(f, "resource {resource}: device {device}: CDI name {name} ")?;
        match &self.why {
            Unresolved::Missing(dirs) => write!(f, "is defined by no CDI spec in {} (cdi_spec_dirs)", paths(dirs))?,
            Unresolved::Conflict(files) => write!(f, "is defined twice, by {}, so the runtime drops it", paths(files))?,
        }
        if let Some(dir) = &self.unread_cdi_dir {
            write!(f, "; devhost writes its specs into cdi_dir {}, which is not among them", dir.display())?;
        }
        write!(f, "; containers given this device fail with \"CDI device injection failed: unresolvable CDI devices\"")
    }
}

/// The CDI names devhost hands out for a resource's devices, each with its device's ID: with
/// `cdi_strategy`, `<resource>=<device name>` of each device that has a spec entry; and every
/// name a device declares itself.
pub fn handed_out(resource: &str, cdi_strategy: bool, devices: &[Device]) -> Vec<(String, String)> {
    let vars = super::list_vars(devices);
    let mut out = Vec::new();
    for d in devices {
        if cdi_strategy && super::device_edits(&d.edits, &vars).is_some() {
            out.push((d.id.clone(), super::qualified_name(resource, &d.id)));
        }
        for name in &d.edits.cdi_devices {
            if split_name(name).is_some() && !out.iter().any(|(id, n)| *id == d.id && n == name) {
                out.push((d.id.clone(), name.clone()));
            }
        }
    }
    out
}

/// The problems of one resource's names against `defined`.
pub fn problems(resource: &str, names: &[(String, String)], defined: &Defined, cdi_dir: Option<&Path>) -> Vec<Problem> {
    let unread = cdi_dir.filter(|dir| !defined.dirs.iter().any(|d| same_dir(d, dir)));
    names
        .iter()
        .filter_map(|(device, name)| {
            Some(Problem {
                resource: resource.to_string(),
                device: device.clone(),
                name: name.clone(),
                why: defined.unresolved(name)?,
                unread_cdi_dir: unread.map(Path::to_path_buf),
            })
        })
        .collect()
}

/// How many devices a list of problems names.
pub fn devices_affected(problems: &[Problem]) -> usize {
    problems.iter().map(|p| p.device.as_str()).collect::<BTreeSet<_>>().len()
}

#[cfg(test)]
mod tests;
