//! The composition of container edits: `compose` (devices in request order, with its indexed
//! `Finder`/`Joiner` past 16 entries), `Edits::amend` (a driver hook's edits on top) and the CDI
//! side (`cdi::render_all`, `cdi::allocate_edits`). Composing is deterministic and gives what
//! the plain look-through-the-lists model below gives, conflicts included (none silently lost);
//! amending leaves every hook key with the hook's value; a rendered spec file is JSON whose
//! device names are valid and distinct within it (CDI refuses a spec that names one twice).
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use devhost::driver::callbacks::check_device_id;
use devhost::driver::device::{Device, DeviceNode, Edits, Mount, compose};
use devhost::engine::cdi;
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeSet;

/// Keys and values come from small pools so that devices share keys (conflicts, joins), and a
/// free string sometimes (new keys, commas, empty values).
#[derive(Debug, Arbitrary)]
enum Text {
    Pool(u8),
    Free(String),
}

impl Text {
    fn get(self) -> String {
        match self {
            Text::Pool(n) => ["a", "b", "c", "a,b", "", "/dev/x", "/dev/y", "x,", "d", "e"][usize::from(n) % 10].into(),
            Text::Free(s) => s,
        }
    }
}

#[derive(Debug, Arbitrary)]
struct RawEdits {
    nodes: Vec<(Text, Text)>,
    mounts: Vec<(Text, Text, bool)>,
    envs: Vec<(Text, Text)>,
    annotations: Vec<(Text, Text)>,
    cdi: Vec<Text>,
}

impl RawEdits {
    fn get(self) -> Edits {
        let pairs = |v: Vec<(Text, Text)>| v.into_iter().map(|(k, v)| (k.get(), v.get())).collect();
        Edits {
            device_nodes: self
                .nodes
                .into_iter()
                .map(|(c, h)| DeviceNode { host_path: h.get(), container_path: c.get(), permissions: "rw".into() })
                .collect(),
            mounts: self
                .mounts
                .into_iter()
                .map(|(c, h, read_only)| Mount { host_path: h.get(), container_path: c.get(), read_only })
                .collect(),
            envs: pairs(self.envs),
            annotations: pairs(self.annotations),
            cdi_devices: self.cdi.into_iter().map(Text::get).collect(),
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    devices: Vec<(String, RawEdits)>,
    hook: RawEdits,
    requested: Vec<u8>,
}

/// Composition as first written: a look through the list for every key.
fn model(devices: &[Device]) -> (Edits, usize) {
    let join = |list: &mut Vec<(String, String)>, k: &str, v: &str| match list.iter_mut().find(|(x, _)| x == k) {
        Some((_, e)) if !e.split(',').any(|x| x == v) => {
            e.push(',');
            e.push_str(v);
        }
        Some(_) => {}
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
        d.edits.envs.iter().for_each(|(k, v)| join(&mut out.envs, k, v));
        d.edits.annotations.iter().for_each(|(k, v)| join(&mut out.annotations, k, v));
        for c in &d.edits.cdi_devices {
            if !out.cdi_devices.contains(c) {
                out.cdi_devices.push(c.clone());
            }
        }
    }
    (out, conflicts)
}

fn device(id: String, edits: Edits) -> Device {
    Device {
        id,
        healthy: true,
        health_reason: None,
        numa_node: None,
        attributes: Default::default(),
        edits,
        links: Vec::new(),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let mut devices: Vec<Device> = Vec::new();
    for (id, edits) in input.devices {
        // What a scan can report: IDs that pass the host's check, each once.
        if check_device_id(&id).is_ok() && devices.iter().all(|d| d.id != id) {
            devices.push(device(id, edits.get()));
        }
    }
    let (composed, conflicts) = compose(&devices);
    assert_eq!(compose(&devices), (composed.clone(), conflicts.clone()), "compose is not deterministic");
    let (expected, expected_conflicts) = model(&devices);
    assert_eq!(composed, expected, "compose differs from the plain model");
    assert_eq!(conflicts.total(), expected_conflicts, "conflicts lost or invented");
    assert_eq!(conflicts.shown().len() + conflicts.unshown(), conflicts.total());
    assert!(conflicts.shown().len() <= 8);

    let hook = input.hook.get();
    let mut amended = composed.clone();
    amended.amend(hook.clone());
    for (k, v) in &hook.envs {
        let last = hook.envs.iter().rev().find(|(x, _)| x == k).map(|(_, v)| v);
        let got = amended.envs.iter().find(|(x, _)| x == k).map(|(_, v)| v);
        assert_eq!(got, last, "hook env {k}={v} not applied");
    }
    for n in &hook.device_nodes {
        let last = hook.device_nodes.iter().rev().find(|x| x.container_path == n.container_path);
        let got = amended.device_nodes.iter().find(|x| x.container_path == n.container_path);
        assert_eq!(got, last, "hook device node {} not applied", n.container_path);
    }
    let kept: BTreeSet<&String> = amended.cdi_devices.iter().collect();
    assert_eq!(kept.len(), amended.cdi_devices.len(), "a CDI name twice after amend");

    let resource = "vendor.example.com/gpu";
    for (kind, bytes) in cdi::render_all(resource, &devices) {
        let spec: serde_json::Value = serde_json::from_slice(&bytes).expect("a spec file is JSON");
        let mut names = BTreeSet::new();
        for d in spec["devices"].as_array().expect("a spec has devices") {
            let name = d["name"].as_str().expect("a device has a name");
            assert!(cdi::is_device_name(name), "spec {kind}: invalid CDI device name {name:?}");
            assert!(names.insert(name.to_string()), "spec {kind} names device {name:?} twice");
        }
    }
    let physical: Vec<String> = match devices.len() {
        0 => Vec::new(),
        n => input.requested.iter().map(|&i| devices[usize::from(i) % n].id.clone()).collect(),
    };
    // Physical IDs arrive distinct (`sharing::physical_ids` keeps the first replica of each).
    let mut seen = BTreeSet::new();
    let physical: Vec<String> = physical.into_iter().filter(|id| seen.insert(id.clone())).collect();
    let answer = cdi::allocate_edits(resource, &devices, &physical, composed);
    let unique: BTreeSet<&String> = answer.cdi_devices.iter().collect();
    assert_eq!(unique.len(), answer.cdi_devices.len(), "a CDI name twice in an Allocate answer");
});
