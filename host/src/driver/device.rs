//! What a driver reports about a device, and the container edits the host
//! composes from several devices for one Allocate.

use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    pub host_path: String,
    pub container_path: String,
    pub permissions: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    pub read_only: bool,
}

/// Container edits: what a container receives for a device (from scan) or
/// for an allocation (composed, then amended by the driver's hook).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Edits {
    pub device_nodes: Vec<DeviceNode>,
    pub mounts: Vec<Mount>,
    pub envs: Vec<(String, String)>,
    pub annotations: Vec<(String, String)>,
    pub cdi_devices: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub id: String,
    pub healthy: bool,
    /// Why the driver gave the device its health (ABI 1.2 `device_health_reason`), if it said.
    pub health_reason: Option<String>,
    pub numa_node: Option<i64>,
    pub attributes: BTreeMap<String, String>,
    pub edits: Edits,
    /// Link scores to other devices of the same driver instance.
    pub links: Vec<(String, u32)>,
}

/// Device IDs longer than this (any real one is at most 63 bytes, a replica ID a few more) are
/// shortened where the host repeats an ID it was sent: in error messages and in `/status`.
pub const MAX_SHOWN_ID: usize = 80;
/// How much of a longer ID is shown.
const SHOWN_PREFIX: usize = 48;

/// `id` as stored in a record: itself when of a plausible length, else its first bytes followed
/// by `…(N bytes)`.
pub fn shortened(id: &str) -> String {
    if id.len() <= MAX_SHOWN_ID {
        return id.to_string();
    }
    let mut end = SHOWN_PREFIX;
    while !id.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…({} bytes)", &id[..end], id.len())
}

/// `id` quoted for an error message: `"id"`, or for a long one `"prefix"…(N bytes)`.
pub fn quoted(id: &str) -> String {
    if id.len() <= MAX_SHOWN_ID {
        return format!("{id:?}");
    }
    let short = shortened(id);
    let (prefix, rest) = short.split_once('…').unwrap_or((&short, ""));
    format!("{prefix:?}…{rest}")
}

/// Appends `value` to the comma-joined value of `key` unless already there; a new key goes last
/// (keys keep the order they were first set in). A list looked through, not a map: the devices of
/// one request set the same few keys.
fn join_value(list: &mut Vec<(String, String)>, key: &str, value: &str) {
    match list.iter_mut().find(|(k, _)| k == key) {
        Some((_, existing)) => {
            if !existing.split(',').any(|v| v == value) {
                existing.push(',');
                existing.push_str(value);
            }
        }
        None => list.push((key.to_string(), value.to_string())),
    }
}

/// What composing edits noticed: conflicts an operator should hear about.
pub type Conflicts = Vec<String>;

/// Composes the edits of several devices (in request order):
/// device nodes and mounts de-duplicated by container path (first wins, a
/// different host path is a conflict); env vars and annotations set by
/// several devices joined with ',' (each distinct value once); CDI names
/// de-duplicated.
pub fn compose<'a>(devices: impl IntoIterator<Item = &'a Device>) -> (Edits, Conflicts) {
    let mut out = Edits::default();
    let mut conflicts = Vec::new();
    for d in devices {
        for n in &d.edits.device_nodes {
            match out.device_nodes.iter().find(|e| e.container_path == n.container_path) {
                Some(e) if e.host_path != n.host_path => conflicts.push(format!(
                    "device {}: device node {} -> {} conflicts with {} (kept)",
                    d.id, n.host_path, n.container_path, e.host_path
                )),
                Some(_) => {}
                None => out.device_nodes.push(n.clone()),
            }
        }
        for m in &d.edits.mounts {
            match out.mounts.iter().find(|e| e.container_path == m.container_path) {
                Some(e) if e.host_path != m.host_path || e.read_only != m.read_only => conflicts.push(format!(
                    "device {}: mount {} -> {} conflicts with {} (kept)",
                    d.id, m.host_path, m.container_path, e.host_path
                )),
                Some(_) => {}
                None => out.mounts.push(m.clone()),
            }
        }
        for (k, v) in &d.edits.envs {
            join_value(&mut out.envs, k, v);
        }
        for (k, v) in &d.edits.annotations {
            join_value(&mut out.annotations, k, v);
        }
        for c in &d.edits.cdi_devices {
            if !out.cdi_devices.contains(c) {
                out.cdi_devices.push(c.clone());
            }
        }
    }
    (out, conflicts)
}

impl Edits {
    /// Applies a driver hook's edits on top: its env and annotation keys
    /// replace composed values, its nodes and mounts replace entries with the
    /// same container path, its CDI names are added.
    pub fn amend(&mut self, hook: Edits) {
        for n in hook.device_nodes {
            match self.device_nodes.iter_mut().find(|e| e.container_path == n.container_path) {
                Some(e) => *e = n,
                None => self.device_nodes.push(n),
            }
        }
        for m in hook.mounts {
            match self.mounts.iter_mut().find(|e| e.container_path == m.container_path) {
                Some(e) => *e = m,
                None => self.mounts.push(m),
            }
        }
        for (k, v) in hook.envs {
            set_kv(&mut self.envs, k, v);
        }
        for (k, v) in hook.annotations {
            set_kv(&mut self.annotations, k, v);
        }
        for c in hook.cdi_devices {
            if !self.cdi_devices.contains(&c) {
                self.cdi_devices.push(c);
            }
        }
    }
}

fn set_kv(list: &mut Vec<(String, String)>, k: String, v: String) {
    match list.iter_mut().find(|(key, _)| *key == k) {
        Some(e) => e.1 = v,
        None => list.push((k, v)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(id: &str, node: (&str, &str), env: (&str, &str)) -> Device {
        Device {
            id: id.into(),
            healthy: true,
            health_reason: None,
            numa_node: None,
            attributes: BTreeMap::new(),
            edits: Edits {
                device_nodes: vec![DeviceNode {
                    host_path: node.0.into(),
                    container_path: node.1.into(),
                    permissions: "rw".into(),
                }],
                envs: vec![(env.0.into(), env.1.into())],
                cdi_devices: vec!["v.com/c=all".into()],
                ..Edits::default()
            },
            links: vec![],
        }
    }

    #[test]
    fn long_ids_are_shortened_with_their_length_and_short_ones_kept() {
        assert_eq!(shortened("gpu-0"), "gpu-0");
        assert_eq!(quoted("gpu-0"), "\"gpu-0\"");
        let long = "é".repeat(1_000_000);
        let s = shortened(&long);
        assert!(s.starts_with("éé") && s.ends_with("…(2000000 bytes)") && s.len() < 80, "{s}");
        let q = quoted(&format!("a\n{}", "b".repeat(100)));
        assert!(q.starts_with("\"a\\nbbb") && q.ends_with("\"…(102 bytes)"), "{q}");
    }

    #[test]
    fn compose_joins_env_in_request_order_and_dedups_nodes() {
        let a = dev("a", ("/dev/ctl", "/dev/ctl"), ("VIS", "a"));
        let b = dev("b", ("/dev/ctl", "/dev/ctl"), ("VIS", "b"));
        let c = dev("c", ("/dev/ctl", "/dev/ctl"), ("VIS", "a"));
        let (e, conflicts) = compose([&b, &a, &c]);
        assert_eq!(e.envs, vec![("VIS".to_string(), "b,a".to_string())]);
        assert_eq!(e.device_nodes.len(), 1);
        assert_eq!(e.cdi_devices, vec!["v.com/c=all".to_string()]);
        assert!(conflicts.is_empty());
    }

    #[test]
    fn composed_keys_keep_the_order_they_were_first_set_in() {
        let mut a = dev("a", ("/dev/a", "/dev/a"), ("B", "1"));
        a.edits.envs.push(("A".into(), "1".into()));
        a.edits.annotations = vec![("z".into(), "a".into()), ("y".into(), "a".into())];
        let mut b = dev("b", ("/dev/b", "/dev/b"), ("A", "2"));
        b.edits.envs.push(("C".into(), "x".into()));
        b.edits.annotations = vec![("y".into(), "b".into())];
        let (e, _) = compose([&a, &b]);
        let pairs = |v: &[(String, String)]| v.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>();
        assert_eq!(pairs(&e.envs), ["B=1", "A=1,2", "C=x"]);
        assert_eq!(pairs(&e.annotations), ["z=a", "y=a,b"]);
    }

    #[test]
    fn conflicting_device_node_keeps_first_and_reports() {
        let a = dev("a", ("/dev/x0", "/dev/x"), ("K", "1"));
        let b = dev("b", ("/dev/x1", "/dev/x"), ("K", "1"));
        let (e, conflicts) = compose([&a, &b]);
        assert_eq!(e.device_nodes[0].host_path, "/dev/x0");
        assert_eq!(conflicts.len(), 1);
        assert!(conflicts[0].contains("device b") && conflicts[0].contains("/dev/x1"), "{conflicts:?}");
    }

    #[test]
    fn hook_edits_override_composed_ones() {
        let a = dev("a", ("/dev/x0", "/dev/x"), ("K", "1"));
        let (mut e, _) = compose([&a]);
        e.amend(Edits {
            envs: vec![("K".into(), "2".into()), ("NEW".into(), "y".into())],
            device_nodes: vec![DeviceNode {
                host_path: "/dev/y".into(),
                container_path: "/dev/x".into(),
                permissions: "r".into(),
            }],
            ..Edits::default()
        });
        assert_eq!(e.envs, vec![("K".to_string(), "2".to_string()), ("NEW".to_string(), "y".to_string())]);
        assert_eq!(e.device_nodes.len(), 1);
        assert_eq!(e.device_nodes[0].host_path, "/dev/y");
    }
}
