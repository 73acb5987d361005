//! Node Feature Discovery's local feature file: with `nfd_features_dir` set, the host keeps one
//! file, `devhost`, in NFD's `features.d` folder, saying per resource how many devices the node
//! has and of which model. nfd-worker turns each line into a node label, so nodes carry their
//! accelerators' counts and models without devhost ever talking to the API server.
//!
//! The file is rewritten (atomically, only when its content changes) as device lists change and
//! refreshed well before its `# +expiry-time`, so the labels of a node whose devhost is gone
//! disappear by themselves. A restart of devhost keeps the file, and so the labels.

use crate::driver::device::Device;
use crate::engine::registry::Registry;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The file's name in the folder. NFD reads every file there except hidden ones, which is why
/// the temporary file it is written through starts with a dot.
pub const FILE_NAME: &str = "devhost";

/// The namespace of the labels: a subdomain of `feature.node.kubernetes.io`, which NFD allows
/// without any `-extra-label-ns` setting.
pub const LABEL_PREFIX: &str = "devhost.feature.node.kubernetes.io/";

/// The value of the `model` label when a resource's devices are of more than one model.
pub const MIXED: &str = "mixed";

/// How long NFD keeps the labels after the last refresh.
const EXPIRY: Duration = Duration::from_secs(60 * 60);
/// How often the file is rewritten when nothing changed, to push its expiry on.
const REFRESH: Duration = Duration::from_secs(20 * 60);
/// How often the device lists are looked at.
const POLL: Duration = Duration::from_secs(5);

/// Label names and values are at most 63 characters (Kubernetes' rule for both).
const MAX_LABEL: usize = 63;

/// One resource as the file describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub resource: String,
    pub count: usize,
    /// The `model` attribute shared by every device, [`MIXED`], or `None` when no device has one.
    pub model: Option<String>,
}

impl Entry {
    /// Describes `devices` (the physical devices, replicas not counted) of `resource`.
    pub fn new(resource: &str, devices: &[Device]) -> Entry {
        let models: BTreeSet<&str> =
            devices.iter().filter_map(|d| d.attributes.get("model")).map(String::as_str).collect();
        let model = match models.len() {
            0 => None,
            1 => models.first().map(|m| m.to_string()),
            _ => Some(MIXED.to_string()),
        };
        Entry { resource: resource.to_string(), count: devices.len(), model }
    }
}

/// The label name (after [`LABEL_PREFIX`]) for `key` of `resource`: `nvidia.com/gpu` and
/// `count` give `nvidia.com-gpu.count`. `None` when it would exceed 63 characters.
pub fn label_name(resource: &str, key: &str) -> Option<String> {
    let name = format!("{}.{key}", resource.replace('/', "-"));
    (name.len() <= MAX_LABEL).then_some(name)
}

/// A label value for free text (a model name): characters other than letters, digits, `-`,
/// `_` and `.` become `-` (runs of them one `-`), it starts and ends with a letter or digit, and
/// it is cut to 63 characters. `None` when nothing is left.
pub fn label_value(text: &str) -> Option<String> {
    let mut value = String::new();
    for c in text.chars() {
        let c = if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '-' };
        if !(c == '-' && value.ends_with('-')) {
            value.push(c);
        }
    }
    let trim = |s: &str| s.trim_matches(|c: char| !c.is_ascii_alphanumeric()).to_string();
    let mut value = trim(&value);
    if value.len() > MAX_LABEL {
        value.truncate(MAX_LABEL);
        value = trim(&value);
    }
    (!value.is_empty()).then_some(value)
}

/// The file's text: a comment, the expiry directive, then `<resource>.count` and
/// `<resource>.model` per resource. Resources whose label names would be too long are left
/// out and returned, so the caller can say so.
pub fn render(entries: &[Entry], expires: SystemTime) -> (String, Vec<String>) {
    let mut text = String::from(
        "# Written by devhost for Node Feature Discovery: devices per resource on this node.\n\
         # It is rewritten as devices change; do not edit.\n",
    );
    let _ = writeln!(text, "# +expiry-time={}", crate::engine::status::rfc3339(expires));
    let mut skipped = Vec::new();
    for e in entries {
        let (Some(count), Some(model)) = (label_name(&e.resource, "count"), label_name(&e.resource, "model")) else {
            skipped.push(e.resource.clone());
            continue;
        };
        let _ = writeln!(text, "{LABEL_PREFIX}{count}={}", e.count);
        if let Some(value) = e.model.as_deref().and_then(label_value) {
            let _ = writeln!(text, "{LABEL_PREFIX}{model}={value}");
        }
    }
    (text, skipped)
}

/// Writes `text` to `dir/devhost` through a hidden temporary file and a rename, so NFD never
/// reads half a file.
pub fn write(dir: &Path, text: &str) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{FILE_NAME}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join(FILE_NAME))
}

/// What the served resources of `registry` look like now, in manifest order.
fn entries(registry: &Registry) -> Vec<Entry> {
    registry
        .resources()
        .iter()
        .filter(|r| r.driver.is_some())
        .map(|r| Entry::new(&r.config.name, &r.snapshot().devices))
        .collect()
}

/// Keeps `dir/devhost` in step with `registry` until the task is dropped or aborted. Problems
/// are logged once each (a read-only or missing folder does not flood the log) and never stop
/// the daemon.
pub fn spawn(dir: PathBuf, registry: Arc<Registry>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // The file kept from the last run stays until every first scan is in:
        // a half-scanned node must not relabel itself.
        for r in registry.resources() {
            r.first_scan().await;
        }
        let path = dir.join(FILE_NAME);
        let mut written: Option<(Vec<Entry>, SystemTime)> = None;
        let mut last_problem: Option<String> = None;
        let mut warned_skipped = BTreeSet::new();
        loop {
            let now = SystemTime::now();
            let current = entries(&registry);
            let due = match &written {
                Some((entries, at)) => *entries != current || now.duration_since(*at).unwrap_or_default() >= REFRESH,
                None => true,
            };
            if due {
                let (text, skipped) = render(&current, now + EXPIRY);
                for resource in skipped {
                    if warned_skipped.insert(resource.clone()) {
                        tracing::warn!(
                            resource = %resource,
                            "resource name too long for an NFD label (63 characters with .count): left out of {}",
                            path.display()
                        );
                    }
                }
                match write(&dir, &text) {
                    Ok(()) => {
                        if written.is_none() || last_problem.is_some() {
                            tracing::info!(file = %path.display(), resources = current.len(), "NFD feature file written");
                        }
                        last_problem = None;
                        written = Some((current, now));
                    }
                    Err(e) => {
                        let problem = e.to_string();
                        if last_problem.as_deref() != Some(problem.as_str()) {
                            tracing::warn!(
                                "cannot write the NFD feature file {}: {problem}; node labels from devhost stay as they \
                                 were (check that nfd_features_dir is mounted read-write); retrying",
                                path.display()
                            );
                        }
                        last_problem = Some(problem);
                    }
                }
            }
            tokio::time::sleep(POLL).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    fn device(id: &str, model: Option<&str>) -> Device {
        match model {
            Some(m) => Device::test(id).attr("model", m),
            None => Device::test(id),
        }
    }

    #[test]
    fn one_model_is_named_several_are_mixed_none_is_left_out() {
        let h100 = [device("a", Some("NVIDIA H100 80GB HBM3")), device("b", Some("NVIDIA H100 80GB HBM3"))];
        assert_eq!(Entry::new("nvidia.com/gpu", &h100).model.as_deref(), Some("NVIDIA H100 80GB HBM3"));
        let two = [device("a", Some("u250")), device("b", Some("u280"))];
        assert_eq!(Entry::new("example.com/fpga", &two).model.as_deref(), Some(MIXED));
        let none = [device("a", None)];
        assert_eq!(
            Entry::new("google.com/tpu", &none),
            Entry { resource: "google.com/tpu".into(), count: 1, model: None }
        );
    }

    #[test]
    fn file_has_expiry_then_count_and_model_per_resource() {
        let entries = [
            Entry { resource: "nvidia.com/gpu".into(), count: 4, model: Some("NVIDIA H100 80GB HBM3".into()) },
            Entry { resource: "nvidia.com/mig-1g.10gb".into(), count: 0, model: None },
        ];
        let (text, skipped) = render(&entries, UNIX_EPOCH + Duration::from_secs(3600));
        assert!(skipped.is_empty());
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with("# ") || l.starts_with("# +")).collect();
        assert_eq!(
            lines,
            [
                "# +expiry-time=1970-01-01T01:00:00.000Z",
                "devhost.feature.node.kubernetes.io/nvidia.com-gpu.count=4",
                "devhost.feature.node.kubernetes.io/nvidia.com-gpu.model=NVIDIA-H100-80GB-HBM3",
                "devhost.feature.node.kubernetes.io/nvidia.com-mig-1g.10gb.count=0",
            ]
        );
    }

    #[test]
    fn label_values_keep_only_what_kubernetes_allows() {
        assert_eq!(label_value("Tesla V100-SXM2-16GB").as_deref(), Some("Tesla-V100-SXM2-16GB"));
        assert_eq!(label_value("  (engineering sample) ").as_deref(), Some("engineering-sample"));
        assert_eq!(label_value("???"), None);
        let long = "x".repeat(70) + "-y";
        assert_eq!(label_value(&long).map(|v| v.len()), Some(63));
    }

    #[test]
    fn too_long_resource_names_are_left_out_and_reported() {
        let long = format!("example.com/{}", "a".repeat(50));
        let (text, skipped) = render(&[Entry { resource: long.clone(), count: 1, model: None }], UNIX_EPOCH);
        assert_eq!(skipped, [long]);
        assert!(!text.contains("example.com-"), "{text}");
    }

    #[test]
    fn write_replaces_the_file_and_leaves_no_visible_temporary() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "a=1\n").unwrap();
        write(dir.path(), "a=2\n").unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap(), "a=2\n");
        let visible: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.starts_with('.'))
            .collect();
        assert_eq!(visible, [FILE_NAME]);
    }
}
