//! DRA claim mapping (`prepare::plan`, `prepare::dra_device_name`) on arbitrary device IDs and
//! allocation results. Every device name is a DNS label, an ID that is one is its own name, and
//! two devices of one driver never share a name (else a claim could prepare the wrong device).
//! `plan` is deterministic; what it plans is exactly the healthy devices the driver's results
//! name, once each, with every request (subrequest dropped) and admin access only when every
//! result asks for it; it refuses only when a result of the driver has another pool, names no
//! device, or names an unhealthy one.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use devhost::driver::callbacks::check_device_id;
use devhost::driver::device::Device;
use devhost::fronts::dra::prepare::{AllocationResult, dra_device_name, plan};
use devhost::manifest::TaintEffect;
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

const DRIVER: &str = "gpu.example.com";
const POOL: &str = "node-a";

#[derive(Debug, Arbitrary)]
struct Input {
    devices: Vec<(String, bool)>,
    results: Vec<RawResult>,
}

#[derive(Debug, Arbitrary)]
struct RawResult {
    request: String,
    other_driver: bool,
    other_pool: bool,
    /// Names device `n % devices` when some, else `name`.
    device: Option<u8>,
    name: String,
    admin_access: bool,
}

fn is_label(name: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    !name.is_empty()
        && name.len() <= 63
        && name.chars().all(|c| alnum(c) || c == '-')
        && name.chars().next().is_some_and(alnum)
        && name.chars().last().is_some_and(alnum)
}

fn device(id: String, healthy: bool) -> Device {
    Device {
        id,
        healthy,
        health_reason: None,
        numa_node: None,
        attributes: Default::default(),
        edits: Default::default(),
        links: Vec::new(),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let mut devices: Vec<Device> = Vec::new();
    for (id, healthy) in input.devices {
        // What a scan can report: IDs that pass the host's check, each once.
        if check_device_id(&id).is_ok() && devices.iter().all(|d| d.id != id) {
            devices.push(device(id, healthy));
        }
    }
    let mut names: BTreeMap<String, &str> = BTreeMap::new();
    for d in &devices {
        let name = dra_device_name(&d.id);
        assert!(is_label(&name), "device name {name:?} of ID {:?} is not a DNS label", d.id);
        // ...unless it ends as hashed names do (`-` and 8 hex digits), which could be another ID's.
        let (body, tail) = d.id.split_at(d.id.len().saturating_sub(8));
        let hashed_shape = body.ends_with('-') && tail.len() == 8 && tail.bytes().all(|b| b.is_ascii_hexdigit());
        if is_label(&d.id) && !hashed_shape {
            assert_eq!(name, d.id, "an ID that is a DNS label is its own name");
        }
        if let Some(other) = names.insert(name.clone(), &d.id) {
            panic!("IDs {other:?} and {:?} share the DRA device name {name:?}", d.id);
        }
    }
    let results: Vec<AllocationResult> = input
        .results
        .into_iter()
        .map(|r| AllocationResult {
            request: r.request,
            driver: if r.other_driver { "other.example.com".into() } else { DRIVER.into() },
            pool: if r.other_pool { "node-b".into() } else { POOL.into() },
            device: match (r.device, devices.len()) {
                (Some(n), len) if len > 0 => dra_device_name(&devices[usize::from(n) % len].id),
                _ => r.name,
            },
            admin_access: r.admin_access,
            tolerations: Vec::new(),
        })
        .collect();
    let answer = plan(DRIVER, POOL, TaintEffect::NoSchedule, &devices, &results);
    assert_eq!(answer, plan(DRIVER, POOL, TaintEffect::NoSchedule, &devices, &results), "plan is not deterministic");
    let ours: Vec<&AllocationResult> = results.iter().filter(|r| r.driver == DRIVER).collect();
    let by_name = |name: &str| devices.iter().find(|d| dra_device_name(&d.id) == name);
    let refusable = ours.iter().any(|r| r.pool != POOL || by_name(&r.device).is_none_or(|d| !d.healthy));
    let planned = match answer {
        Err(message) => {
            assert!(refusable, "refused a claim that can be prepared: {message}");
            return;
        }
        Ok(planned) => planned,
    };
    assert!(!refusable, "planned a claim that names a foreign pool, an unknown or an unhealthy device");
    for (i, p) in planned.iter().enumerate() {
        assert!(planned[..i].iter().all(|q| q.id != p.id), "device {} planned twice", p.id);
        let device = by_name(&p.device).expect("a planned device exists");
        assert_eq!(device.id, p.id);
        let for_it: Vec<&&AllocationResult> = ours.iter().filter(|r| r.device == p.device).collect();
        assert!(!for_it.is_empty(), "device {} planned without a result naming it", p.id);
        assert_eq!(p.admin_access, for_it.iter().all(|r| r.admin_access), "admin access of {}", p.id);
        for r in for_it {
            let request = r.request.split_once('/').map_or(r.request.as_str(), |(q, _)| q);
            assert!(p.requests.iter().any(|q| q == request), "request {request} of {} lost", p.id);
        }
    }
    for r in &ours {
        assert!(planned.iter().any(|p| p.device == r.device), "result for {} not planned", r.device);
    }
});
