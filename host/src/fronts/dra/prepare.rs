//! What NodePrepareResources answers for one claim, decided without sockets: the claim's
//! allocation results (read from the API server by the caller) are mapped back from DRA device
//! names to the driver's device IDs. The whole claim is checked before anything is prepared, as
//! Allocate does: one bad result fails the claim, naming it.
//!
//! Device names, fixed here: a DRA device name is a DNS label (lower-case letters, digits and
//! `-`, at most 63, starting and ending with a letter or digit). A device ID that already is one
//! is its own name, unless it ends like a hashed name does (`-` and 8 hex digits); any other is
//! lower-cased, every other character becomes `-`, the ends are trimmed, the body is cut to 54
//! characters and `-` plus 8 hex digits of the ID's hash is appended, so a name never changes
//! across restarts and two IDs share a name only on a 32-bit hash collision (without the
//! exception, ID `x-264d58fb` would take the name of ID `}}}}}}`).

use super::taint::{Toleration, health_taint, tolerates};
use crate::driver::device::Device;
use crate::manifest::TaintEffect;
use crate::names::{fnv1a, has_hash_suffix};

/// Longest DRA device name (a DNS label).
const MAX_DEVICE_NAME: usize = 63;
/// Room for the body of a hashed name: 63 minus `-` and 8 hex digits.
const MAX_HASHED_BODY: usize = MAX_DEVICE_NAME - 9;

/// One entry of a claim's `status.allocation.devices.results`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationResult {
    /// The request name, possibly `request/subrequest`.
    pub request: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
    /// Admin access (monitoring, diagnostics): the device may be in use by other claims too.
    pub admin_access: bool,
    /// The tolerations of the request: an unhealthy device is prepared only if they tolerate
    /// its taint.
    pub tolerations: Vec<Toleration>,
}

fn is_label_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'
}

fn is_device_name(name: &str) -> bool {
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    name.len() <= MAX_DEVICE_NAME
        && name.chars().all(is_label_char)
        && alnum(name.chars().next())
        && alnum(name.chars().last())
}

/// The DRA device name of a driver's device ID (rule in the module docs).
pub fn dra_device_name(id: &str) -> String {
    if is_device_name(id) && !has_hash_suffix(id) {
        return id.to_owned();
    }
    let body: String =
        id.chars().map(|c| c.to_ascii_lowercase()).map(|c| if is_label_char(c) { c } else { '-' }).collect();
    let body = body.trim_matches('-');
    let body: String = body.chars().take(MAX_HASHED_BODY).collect();
    let body = body.trim_end_matches('-');
    let hash = fnv1a(id);
    if body.is_empty() { format!("x-{hash:08x}") } else { format!("{body}-{hash:08x}") }
}

/// One device of a claim, mapped back to the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// The driver's device ID.
    pub id: String,
    /// The DRA device name the allocation gave.
    pub device: String,
    /// The requests it was allocated for, subrequest suffixes dropped (`req/sub` → `req`).
    pub requests: Vec<String>,
    /// Every result naming the device asks for admin access: the device may be in use by other
    /// claims, so it is neither held exclusively nor released when this claim is unprepared.
    pub admin_access: bool,
}

/// The devices NodePrepareResources prepares for one claim of DRA driver `driver`, whose devices
/// (its one pool `pool`) are `devices`; an unhealthy one only for a request that tolerates its
/// taint (of `effect`). Results for other drivers are not ours and are skipped,
/// as the kubelet sends each driver the whole claim. A device named by several results is
/// planned once, with every request. An error names the claim's device that cannot be prepared
/// and why.
pub fn plan(
    driver: &str,
    pool: &str,
    effect: TaintEffect,
    devices: &[Device],
    results: &[AllocationResult],
) -> Result<Vec<Planned>, String> {
    let mut planned: Vec<Planned> = Vec::new();
    for result in results.iter().filter(|r| r.driver == driver) {
        if result.pool != pool {
            return Err(format!(
                "device {} of request {} is in pool {}, but driver {driver} serves only pool {pool} on this node",
                result.device, result.request, result.pool
            ));
        }
        let Some(device) = devices.iter().find(|d| dra_device_name(&d.id) == result.device) else {
            return Err(format!(
                "device {} of request {} is not a device of driver {driver} on this node (gone since allocation?)",
                result.device, result.request
            ));
        };
        if !device.healthy {
            let taint = health_taint(driver, device, effect);
            if !tolerates(&result.tolerations, &taint) {
                let value = taint.value.map(|v| format!("={v}")).unwrap_or_default();
                return Err(format!(
                    "device {} (ID {}) of request {} is unhealthy, and the request does not tolerate its taint \
                     {}{value}:{}",
                    result.device, device.id, result.request, taint.key, taint.effect
                ));
            }
        }
        let request = result.request.split_once('/').map_or(result.request.as_str(), |(r, _)| r).to_owned();
        match planned.iter_mut().find(|p| p.id == device.id) {
            Some(p) => {
                p.admin_access &= result.admin_access;
                if !p.requests.contains(&request) {
                    p.requests.push(request);
                }
            }
            None => planned.push(Planned {
                id: device.id.clone(),
                device: result.device.clone(),
                requests: vec![request],
                admin_access: result.admin_access,
            }),
        }
    }
    Ok(planned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fronts::dra::taint::Toleration;

    fn device(id: &str, healthy: bool) -> Device {
        Device::test(id).health(healthy)
    }

    fn result(request: &str, driver: &str, pool: &str, device: &str) -> AllocationResult {
        AllocationResult {
            request: request.into(),
            driver: driver.into(),
            pool: pool.into(),
            device: device.into(),
            admin_access: false,
            tolerations: Vec::new(),
        }
    }

    #[test]
    fn device_names_are_stable_dns_labels() {
        assert_eq!(dra_device_name("gpu-0"), "gpu-0");
        let pci = dra_device_name("0000:3B:00.0");
        assert!(pci.starts_with("0000-3b-00-0-") && pci.len() == 13 + 8, "{pci}");
        assert_eq!(dra_device_name("0000:3B:00.0"), pci, "the same ID always gets the same name");
        assert_ne!(dra_device_name("GPU-1"), dra_device_name("gpu-1"), "a lossy mapping keeps IDs apart");
        let long = dra_device_name(&"A".repeat(100));
        assert!(long.len() <= 63 && is_device_name(&long), "{long}");
        assert!(is_device_name(&dra_device_name("::")), "{}", dra_device_name("::"));
    }

    #[test]
    fn an_id_shaped_like_a_hashed_name_never_takes_another_ids_name() {
        // Found by tests/fuzz (dra_plan): `}}}}}}` is named `x-264d58fb`, which is also a DNS label.
        assert_eq!(dra_device_name("}}}}}}"), "x-264d58fb");
        for id in ["}}}}}}", "GPU-A", "0000:3B:00.0", &"A".repeat(63)] {
            let name = dra_device_name(id);
            assert_ne!(dra_device_name(&name), name, "ID {name:?} would share the name of ID {id:?}");
            assert!(is_device_name(&dra_device_name(&name)));
        }
        assert_eq!(dra_device_name("gpu-0"), "gpu-0", "other labels stay their own names");
        assert_eq!(dra_device_name("gpu-1234567"), "gpu-1234567", "7 hex digits are not a hash");
    }

    #[test]
    fn plan_maps_names_back_to_ids() {
        let devices = [device("GPU-A", true), device("gpu-1", true)];
        let results = [
            result("gpus/large", "gpu.example.com", "node-1", &dra_device_name("GPU-A")),
            result("gpus", "other.example.com", "node-1", "x"),
            result("one", "gpu.example.com", "node-1", "gpu-1"),
            result("two", "gpu.example.com", "node-1", "gpu-1"),
        ];
        let planned = plan("gpu.example.com", "node-1", TaintEffect::NoSchedule, &devices, &results).unwrap();
        assert_eq!(planned.len(), 2, "the other driver's result is skipped, a device is planned once");
        assert_eq!((planned[0].id.as_str(), planned[0].device.as_str()), ("GPU-A", dra_device_name("GPU-A").as_str()));
        assert_eq!(planned[0].requests, ["gpus"], "the subrequest suffix is dropped");
        assert_eq!(planned[1].id, "gpu-1");
        assert_eq!(planned[1].requests, ["one", "two"]);
    }

    #[test]
    fn plan_refuses_unknown_foreign_pool_and_unhealthy_devices_by_name() {
        let devices = [device("gpu-0", true), device("gpu-1", false)];
        let plan =
            |r: AllocationResult| plan("d.example.com", "n", TaintEffect::NoSchedule, &devices, &[r]).unwrap_err();
        assert!(plan(result("r", "d.example.com", "n", "gpu-9")).contains("gpu-9 of request r is not a device"));
        assert!(plan(result("r", "d.example.com", "other", "gpu-0")).contains("in pool other"));
        assert!(plan(result("r", "d.example.com", "n", "gpu-1")).contains(
            "gpu-1 (ID gpu-1) of request r is unhealthy, and the request does not tolerate its taint \
             d.example.com/unhealthy:NoSchedule"
        ));
    }

    #[test]
    fn an_unhealthy_device_is_planned_for_a_request_that_tolerates_its_taint() {
        let mut sick = device("gpu-1", false);
        sick.health_reason = Some("Xid 79".into());
        let devices = [sick];
        let with =
            |t: Toleration| AllocationResult { tolerations: vec![t], ..result("r", "d.example.com", "n", "gpu-1") };
        let plan = |r: AllocationResult, effect| plan("d.example.com", "n", effect, &devices, &[r]);
        let key = "d.example.com/unhealthy".to_string();
        let exists = Toleration { key: key.clone(), exists: true, ..Toleration::default() };
        assert_eq!(plan(with(exists.clone()), TaintEffect::NoSchedule).unwrap()[0].id, "gpu-1");
        let any = Toleration { exists: true, ..Toleration::default() };
        assert!(plan(with(any), TaintEffect::NoExecute).is_ok(), "an empty key with Exists tolerates every taint");
        let equal = Toleration { key: key.clone(), value: "Xid-79".into(), ..Toleration::default() };
        assert!(plan(with(equal.clone()), TaintEffect::NoSchedule).is_ok());
        let other_value = Toleration { value: "Xid-48".into(), ..equal };
        let err = plan(with(other_value), TaintEffect::NoSchedule).unwrap_err();
        assert!(err.contains("taint d.example.com/unhealthy=Xid-79:NoSchedule"), "{err}");
        let no_schedule_only = Toleration { effect: "NoSchedule".into(), ..exists };
        assert!(plan(with(no_schedule_only), TaintEffect::NoExecute).is_err(), "the effect must match");
        let other_key = Toleration { key: "x.example.com/unhealthy".into(), exists: true, ..Toleration::default() };
        assert!(plan(with(other_key), TaintEffect::NoSchedule).is_err());
    }

    #[test]
    fn a_device_is_planned_for_admin_access_only_when_every_result_asks_for_it() {
        let devices = [device("gpu-0", true), device("gpu-1", true)];
        let admin =
            |request: &str, name: &str| AllocationResult { admin_access: true, ..result(request, "d", "n", name) };
        let planned = plan(
            "d",
            "n",
            TaintEffect::NoSchedule,
            &devices,
            &[admin("watch", "gpu-0"), admin("watch", "gpu-1"), result("use", "d", "n", "gpu-1")],
        )
        .unwrap();
        assert!(planned[0].admin_access);
        assert!(!planned[1].admin_access, "gpu-1 is also allocated for exclusive use");
    }
}
