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

/// At most this many devices are accepted from one scan; the kubelet's 4 MiB
/// message limit is reached long before a resource could use more.
pub const MAX_DEVICES: usize = 100_000;

/// Finds the entries of a list being built by their key: the list itself is looked through while
/// it is short (one request usually composes a handful of devices, which set the same few keys),
/// and a map of its keys is kept once it holds more than [`SHORT`], so that composing the most
/// devices a scan may hold ([`MAX_DEVICES`]) stays linear instead of
/// quadratic.
struct Finder<T> {
    key_of: fn(&T) -> &str,
    map: Option<std::collections::HashMap<String, usize>>,
}

/// How many entries a list may hold before [`Finder`] keeps a map of its keys (and how many IDs
/// a request may name before `engine::cdi` finds its devices through a map).
pub(crate) const SHORT: usize = 16;

impl<T> Finder<T> {
    fn new(key_of: fn(&T) -> &str) -> Finder<T> {
        Finder { key_of, map: None }
    }

    /// The position in `list` of the entry whose key is `key`.
    fn find(&mut self, list: &[T], key: &str) -> Option<usize> {
        if self.map.is_none() && list.len() > SHORT {
            let mut map = std::collections::HashMap::with_capacity(list.len() * 2);
            for (i, e) in list.iter().enumerate() {
                // The first of equal keys, as the look through the list finds.
                map.entry((self.key_of)(e).to_string()).or_insert(i);
            }
            self.map = Some(map);
        }
        match &self.map {
            Some(map) => map.get(key).copied(),
            None => list.iter().position(|e| (self.key_of)(e) == key),
        }
    }

    /// Appends `entry` to `list` (a key [`Finder::find`] did not find there).
    fn push(&mut self, list: &mut Vec<T>, entry: T) {
        if let Some(map) = &mut self.map {
            map.insert((self.key_of)(&entry).to_string(), list.len());
        }
        list.push(entry);
    }

    /// Replaces the entry of `entry`'s key in `list`, or appends it.
    fn set(&mut self, list: &mut Vec<T>, entry: T) {
        match self.find(list, (self.key_of)(&entry)) {
            Some(i) => list[i] = entry,
            None => self.push(list, entry),
        }
    }
}

fn node_path(n: &DeviceNode) -> &str {
    &n.container_path
}

fn mount_path(m: &Mount) -> &str {
    &m.container_path
}

fn pair_key(kv: &(String, String)) -> &str {
    &kv.0
}

fn itself(s: &String) -> &str {
    s
}

/// Comma-joined values of keys (env vars, annotations) being composed, each distinct value once: a
/// value is looked for in the joined text while it has few values, in a set of them past
/// [`SHORT`] (a key every device of a large request sets, such as a visible-devices list).
struct Joiner {
    keys: Finder<(String, String)>,
    /// The values of each entry (by position) that has more than [`SHORT`] of them; grown only
    /// when one does, so it costs nothing in the usual case.
    sets: Vec<Option<std::collections::HashSet<String>>>,
}

impl Joiner {
    fn new() -> Joiner {
        Joiner { keys: Finder::new(pair_key), sets: Vec::new() }
    }

    /// Appends `value` to the comma-joined value of `key` unless already there; a new key goes
    /// last (keys keep the order they were first set in).
    fn join(&mut self, list: &mut Vec<(String, String)>, key: &str, value: &str) {
        let Some(i) = self.keys.find(list, key) else {
            self.keys.push(list, (key.to_string(), value.to_string()));
            return;
        };
        let existing = &mut list[i].1;
        match self.sets.get_mut(i).and_then(Option::as_mut) {
            Some(set) => {
                if set.contains(value) {
                    return;
                }
                set.extend(value.split(',').map(str::to_string));
            }
            None => {
                if existing.split(',').any(|v| v == value) {
                    return;
                }
                if existing.split(',').nth(SHORT).is_some() {
                    let set = existing.split(',').chain(value.split(',')).map(str::to_string).collect();
                    if self.sets.len() <= i {
                        self.sets.resize_with(i + 1, || None);
                    }
                    self.sets[i] = Some(set);
                }
            }
        }
        existing.push(',');
        existing.push_str(value);
    }
}

/// What composing edits noticed: conflicts an operator should hear about. One request can hold
/// as many devices as a resource has, each conflicting with the first: the first
/// [`Conflicts::SHOWN`] are described, the rest only counted, so that neither the answer's
/// memory nor the log grows with the request.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Conflicts {
    shown: Vec<String>,
    total: usize,
}

impl Conflicts {
    /// How many conflicts of one composition are described.
    pub const SHOWN: usize = 8;

    fn add(&mut self, describe: impl FnOnce() -> String) {
        if self.shown.len() < Self::SHOWN {
            self.shown.push(describe());
        }
        self.total += 1;
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Every conflict found, described or not.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The first [`Conflicts::SHOWN`] conflicts, described.
    pub fn shown(&self) -> &[String] {
        &self.shown
    }

    /// The conflicts found past the described ones.
    pub fn unshown(&self) -> usize {
        self.total - self.shown.len()
    }
}

/// Composes the edits of several devices (in request order):
/// device nodes and mounts de-duplicated by container path (first wins, a
/// different host path is a conflict); env vars and annotations set by
/// several devices joined with ',' (each distinct value once); CDI names
/// de-duplicated. Linear in the number of devices (see [`Finder`]).
pub fn compose<'a>(devices: impl IntoIterator<Item = &'a Device>) -> (Edits, Conflicts) {
    let mut out = Edits::default();
    let mut conflicts = Conflicts::default();
    let (mut nodes, mut mounts, mut cdi) = (Finder::new(node_path), Finder::new(mount_path), Finder::new(itself));
    let (mut envs, mut annotations) = (Joiner::new(), Joiner::new());
    for d in devices {
        for n in &d.edits.device_nodes {
            match nodes.find(&out.device_nodes, &n.container_path) {
                Some(i) if out.device_nodes[i].host_path != n.host_path => conflicts.add(|| {
                    format!(
                        "device {}: device node {} -> {} conflicts with {} (kept)",
                        d.id, n.host_path, n.container_path, out.device_nodes[i].host_path
                    )
                }),
                Some(_) => {}
                None => nodes.push(&mut out.device_nodes, n.clone()),
            }
        }
        for m in &d.edits.mounts {
            match mounts.find(&out.mounts, &m.container_path) {
                Some(i) if out.mounts[i].host_path != m.host_path || out.mounts[i].read_only != m.read_only => {
                    conflicts.add(|| {
                        format!(
                            "device {}: mount {} -> {} conflicts with {} (kept)",
                            d.id, m.host_path, m.container_path, out.mounts[i].host_path
                        )
                    })
                }
                Some(_) => {}
                None => mounts.push(&mut out.mounts, m.clone()),
            }
        }
        for (k, v) in &d.edits.envs {
            envs.join(&mut out.envs, k, v);
        }
        for (k, v) in &d.edits.annotations {
            annotations.join(&mut out.annotations, k, v);
        }
        for c in &d.edits.cdi_devices {
            if cdi.find(&out.cdi_devices, c).is_none() {
                cdi.push(&mut out.cdi_devices, c.clone());
            }
        }
    }
    (out, conflicts)
}

impl Edits {
    /// Applies a driver hook's edits on top: its env and annotation keys
    /// replace composed values, its nodes and mounts replace entries with the
    /// same container path, its CDI names are added. Linear in the sizes of
    /// both (see [`Finder`]).
    pub fn amend(&mut self, hook: Edits) {
        let mut nodes = Finder::new(node_path);
        for n in hook.device_nodes {
            nodes.set(&mut self.device_nodes, n);
        }
        let mut mounts = Finder::new(mount_path);
        for m in hook.mounts {
            mounts.set(&mut self.mounts, m);
        }
        for (list, set) in [(&mut self.envs, hook.envs), (&mut self.annotations, hook.annotations)] {
            let mut keys = Finder::new(pair_key);
            for kv in set {
                keys.set(list, kv);
            }
        }
        let mut cdi = Finder::new(itself);
        for c in hook.cdi_devices {
            if cdi.find(&self.cdi_devices, &c).is_none() {
                cdi.push(&mut self.cdi_devices, c);
            }
        }
    }
}

/// Devices for unit tests, built in one place: [`Device::test`] is a healthy device with nothing
/// else, and each method sets one thing on it.
#[cfg(test)]
impl Device {
    pub(crate) fn test(id: &str) -> Device {
        Device {
            id: id.into(),
            healthy: true,
            health_reason: None,
            numa_node: None,
            attributes: BTreeMap::new(),
            edits: Edits::default(),
            links: Vec::new(),
        }
    }

    pub(crate) fn health(mut self, healthy: bool) -> Device {
        self.healthy = healthy;
        self
    }

    pub(crate) fn numa(mut self, node: Option<i64>) -> Device {
        self.numa_node = node;
        self
    }

    pub(crate) fn attr(mut self, key: &str, value: &str) -> Device {
        self.attributes.insert(key.into(), value.into());
        self
    }

    /// Adds a device node `host` → `container`, read-write.
    pub(crate) fn node(mut self, host: &str, container: &str) -> Device {
        let node = DeviceNode { host_path: host.into(), container_path: container.into(), permissions: "rw".into() };
        self.edits.device_nodes.push(node);
        self
    }

    pub(crate) fn links(mut self, links: &[(&str, u32)]) -> Device {
        self.links = links.iter().map(|(peer, score)| (peer.to_string(), *score)).collect();
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(id: &str, node: (&str, &str), env: (&str, &str)) -> Device {
        let mut d = Device::test(id).node(node.0, node.1);
        d.edits.envs = vec![(env.0.into(), env.1.into())];
        d.edits.cdi_devices = vec!["v.com/c=all".into()];
        d
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
        assert_eq!((conflicts.total(), conflicts.unshown()), (1, 0));
        assert!(conflicts.shown()[0].contains("device b") && conflicts.shown()[0].contains("/dev/x1"), "{conflicts:?}");
    }

    #[test]
    fn many_conflicts_describe_the_first_few_and_count_the_rest() {
        // Every device after the first wants /dev/x from another host node, and every one after
        // the second mounts /m from another host path too.
        let devices: Vec<Device> = (0..1000)
            .map(|i| {
                let mut d = dev(&format!("d{i}"), (&format!("/dev/x{i}"), "/dev/x"), ("K", "1"));
                if i > 0 {
                    d.edits.mounts =
                        vec![Mount { host_path: format!("/h{i}"), container_path: "/m".into(), read_only: true }];
                }
                d
            })
            .collect();
        let (e, conflicts) = compose(&devices);
        assert_eq!((e.device_nodes.len(), e.mounts.len()), (1, 1));
        assert_eq!(conflicts.total(), 999 + 998);
        assert_eq!(conflicts.shown().len(), Conflicts::SHOWN);
        assert_eq!(conflicts.unshown(), 999 + 998 - Conflicts::SHOWN);
        // In request order: d1's node, d2's node and mount, d3's ...
        assert!(conflicts.shown()[0].starts_with("device d1: device node /dev/x1 -> /dev/x"), "{conflicts:?}");
        assert!(conflicts.shown()[2].starts_with("device d2: mount /h2 -> /m conflicts with /h1"), "{conflicts:?}");
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

    /// The composition as first written (a look through the list for every key), kept to check
    /// the indexed one against.
    fn reference(devices: &[Device]) -> (Edits, usize) {
        let join = |list: &mut Vec<(String, String)>, k: &str, v: &str| match list.iter_mut().find(|(x, _)| x == k) {
            Some((_, e)) => {
                if !e.split(',').any(|x| x == v) {
                    e.push(',');
                    e.push_str(v);
                }
            }
            None => list.push((k.into(), v.into())),
        };
        let (mut out, mut conflicts) = (Edits::default(), 0);
        for d in devices {
            for n in &d.edits.device_nodes {
                match out.device_nodes.iter().find(|e| e.container_path == n.container_path) {
                    Some(e) if e.host_path != n.host_path => conflicts += 1,
                    Some(_) => {}
                    None => out.device_nodes.push(n.clone()),
                }
            }
            for m in &d.edits.mounts {
                match out.mounts.iter().find(|e| e.container_path == m.container_path) {
                    Some(e) if e.host_path != m.host_path || e.read_only != m.read_only => conflicts += 1,
                    Some(_) => {}
                    None => out.mounts.push(m.clone()),
                }
            }
            for (k, v) in &d.edits.envs {
                join(&mut out.envs, k, v);
            }
            for (k, v) in &d.edits.annotations {
                join(&mut out.annotations, k, v);
            }
            for c in &d.edits.cdi_devices {
                if !out.cdi_devices.contains(c) {
                    out.cdi_devices.push(c.clone());
                }
            }
        }
        (out, conflicts)
    }

    /// `n` devices whose keys and values come from pools of `pool` entries (a small pool: many
    /// repeats and conflicts; a large one: most keys new), some values holding a comma.
    fn generated(n: usize, pool: u64, seed: u64) -> Vec<Device> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % pool
        };
        (0..n)
            .map(|i| {
                let mut d =
                    dev(&format!("d{i}"), (&format!("/dev/h{}", next()), &format!("/dev/c{}", next())), ("K", "v"));
                d.edits.envs =
                    (0..1 + next() % 3).map(|_| (format!("E{}", next() % 4), format!("v{}", next()))).collect();
                if next() % 5 == 0 {
                    d.edits.envs.push(("E0".into(), format!("v{},v{}", next(), next())));
                }
                d.edits.annotations = vec![(format!("a{}", next()), format!("x{}", next() % 3))];
                d.edits.mounts = vec![Mount {
                    host_path: format!("/h{}", next() % 2),
                    container_path: format!("/m{}", next()),
                    read_only: next() % 2 == 0,
                }];
                d.edits.cdi_devices = vec![format!("v.com/c=d{}", next())];
                d
            })
            .collect()
    }

    #[test]
    fn composing_with_an_index_gives_what_looking_through_the_lists_gave() {
        // Sizes on both sides of the point where a map of the keys takes over, in pools that make
        // keys repeat often, sometimes, or almost never.
        for n in [0, 1, 2, 15, 16, 17, 18, 40, 200] {
            for pool in [3, 20, 60, 1_000_000] {
                let devices = generated(n, pool, n as u64 * 31 + pool);
                let (want, want_conflicts) = reference(&devices);
                let (got, conflicts) = compose(&devices);
                assert_eq!(got, want, "{n} devices, pool {pool}");
                assert_eq!(conflicts.total(), want_conflicts, "{n} devices, pool {pool}");
                assert_eq!(conflicts.shown().len(), want_conflicts.min(Conflicts::SHOWN), "{n} devices, pool {pool}");
            }
        }
    }

    #[test]
    fn amending_with_an_index_gives_what_looking_through_the_lists_gave() {
        for (n, pool) in [(3, 5), (17, 20), (60, 40), (300, 1_000_000)] {
            let (mut got, _) = compose(&generated(n, pool, 7));
            let mut want = got.clone();
            let hook = compose(&generated(n, pool, 11)).0;
            for d in &hook.device_nodes {
                match want.device_nodes.iter_mut().find(|e| e.container_path == d.container_path) {
                    Some(e) => *e = d.clone(),
                    None => want.device_nodes.push(d.clone()),
                }
            }
            for m in &hook.mounts {
                match want.mounts.iter_mut().find(|e| e.container_path == m.container_path) {
                    Some(e) => *e = m.clone(),
                    None => want.mounts.push(m.clone()),
                }
            }
            for (list, set) in [(&mut want.envs, &hook.envs), (&mut want.annotations, &hook.annotations)] {
                for (k, v) in set {
                    match list.iter_mut().find(|(x, _)| x == k) {
                        Some(e) => e.1 = v.clone(),
                        None => list.push((k.clone(), v.clone())),
                    }
                }
            }
            for c in &hook.cdi_devices {
                if !want.cdi_devices.contains(c) {
                    want.cdi_devices.push(c.clone());
                }
            }
            got.amend(hook);
            assert_eq!(got, want, "{n} edits, pool {pool}");
        }
    }

    #[test]
    fn the_largest_request_composes_every_device_once() {
        // As many devices as one scan may hold, each with its own node, mount, env value and CDI
        // name: looking through the lists took about 10^10 comparisons (minutes, on a runtime
        // thread); with the index this is linear. The test runs it on a thread of its own and
        // gives up after a bound far above the linear time, so a quadratic regression fails here
        // instead of hanging the suite.
        let n = MAX_DEVICES;
        let devices: Vec<Device> = (0..n)
            .map(|i| {
                let mut d =
                    dev(&format!("d{i}"), (&format!("/dev/h{i}"), &format!("/dev/c{i}")), ("VISIBLE", &i.to_string()));
                d.edits.mounts =
                    vec![Mount { host_path: format!("/h{i}"), container_path: format!("/m{i}"), read_only: true }];
                d.edits.annotations = vec![(format!("a{i}"), "x".into())];
                d.edits.cdi_devices = vec![format!("v.com/c=d{i}")];
                d
            })
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut e, conflicts) = compose(&devices);
            let visible = e.envs.first().map(|(_, v)| v.split(',').count());
            // The hook replaces every node: one look-up each.
            let hook = (0..n)
                .map(|i| DeviceNode {
                    host_path: format!("/dev/other{i}"),
                    container_path: format!("/dev/c{i}"),
                    permissions: "r".into(),
                })
                .collect();
            e.amend(Edits { device_nodes: hook, ..Edits::default() });
            let _ = tx.send((e, conflicts, visible));
        });
        let (e, conflicts, visible) =
            rx.recv_timeout(std::time::Duration::from_secs(60)).expect("compose did not finish in 60 s");
        assert!(conflicts.is_empty());
        assert_eq!((e.device_nodes.len(), e.mounts.len(), e.annotations.len(), e.cdi_devices.len()), (n, n, n, n));
        assert_eq!(e.envs.len(), 1);
        assert_eq!(visible, Some(n));
        assert_eq!(e.device_nodes[n - 1].host_path, format!("/dev/other{}", n - 1));
        assert_eq!(e.device_nodes[n - 1].container_path, format!("/dev/c{}", n - 1));
    }
}
