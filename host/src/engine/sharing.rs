//! Sharing a device between containers: a resource with `replicas = N` advertises each physical
//! device as N device IDs, `<id>::<k>` for k in 0..N, so the kubelet can hand one device to N
//! containers. Allocate maps the replica IDs back to physical devices before the driver sees them.
//! Everything here is pure; the registry expands, the endpoint maps back.

use crate::driver::device::Device;
use std::collections::{HashMap, HashSet};

/// Between the physical device ID and the replica index. Physical IDs may contain it too: the
/// index is always after the last one.
pub const SEPARATOR: &str = "::";

/// The ID of replica `k` of device `id`.
pub fn replica_id(id: &str, k: u32) -> String {
    format!("{id}{SEPARATOR}{k}")
}

/// The driver's device ID for an ID the kubelet knows: shared replicas are advertised as
/// `<id>::<k>` (the ABI reserves `::` for it), every other ID is the driver's own.
pub fn driver_id(kubelet_id: &str) -> &str {
    parse_replica(kubelet_id).map_or(kubelet_id, |(id, _)| id)
}

/// Splits a replica ID into the physical ID and the index. The index must be written the way
/// [`replica_id`] writes it (decimal, no sign, no leading zero), so that every replica has exactly
/// one ID.
pub fn parse_replica(id: &str) -> Option<(&str, u32)> {
    let (physical, k) = id.rsplit_once(SEPARATOR)?;
    let canonical = !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) && (k == "0" || !k.starts_with('0'));
    if physical.is_empty() || !canonical {
        return None;
    }
    k.parse().ok().map(|k| (physical, k))
}

/// The devices a resource advertises for its physical `devices` when each is shared `replicas`
/// times. Replicas carry the physical device's health, NUMA node, attributes and edits, so a
/// device's health applies to all its replicas. The order is replica-major (every device's
/// replica 0, then every device's replica 1, ...): the host's preferred allocation favours early
/// devices, so a fresh node spreads containers over distinct devices first. A link from device A
/// to device B becomes a link from each replica of A to each replica of B; replicas of one device
/// are not linked to each other, so the link score never prefers packing one device. With
/// `replicas <= 1` the devices are returned unchanged.
pub fn expand(devices: &[Device], replicas: u32) -> Vec<Device> {
    if replicas <= 1 {
        return devices.to_vec();
    }
    let present: HashSet<&str> = devices.iter().map(|d| d.id.as_str()).collect();
    let mut out = Vec::with_capacity(devices.len() * replicas as usize);
    for k in 0..replicas {
        for d in devices {
            let links = d
                .links
                .iter()
                // A link to a device this resource does not hold has no replica to point at.
                .filter(|(peer, _)| peer != &d.id && present.contains(peer.as_str()))
                .flat_map(|(peer, score)| (0..replicas).map(move |j| (replica_id(peer, j), *score)))
                .collect();
            out.push(Device { id: replica_id(&d.id, k), links, ..d.clone() });
        }
    }
    out
}

/// Maps the device IDs of one container request back to physical device IDs, de-duplicated in
/// request order (two replicas of one device give that device once). With `replicas <= 1` the IDs
/// are physical already and returned as they are. Errors name the offending IDs: an ID that is
/// not a replica ID of this resource, or (with `one_per_container`) two replicas of one device.
pub fn physical_ids(requested: &[String], replicas: u32, one_per_container: bool) -> Result<Vec<String>, String> {
    if replicas <= 1 {
        return Ok(requested.to_vec());
    }
    let mut out: Vec<String> = Vec::with_capacity(requested.len());
    let mut first_replica: HashMap<&str, &str> = HashMap::new();
    for id in requested {
        let Some((physical, _)) = parse_replica(id).filter(|&(_, k)| k < replicas) else {
            return Err(format!(
                "device ID {id:?} is not a replica ID of this resource (expected <device>{SEPARATOR}<k> with k below {replicas})"
            ));
        };
        match first_replica.get(physical) {
            Some(first) if one_per_container => {
                return Err(format!(
                    "device IDs {first:?} and {id:?} are replicas of the same device {physical:?}; this resource \
                     allows one replica of a device per container (one_replica_per_container = true)"
                ));
            }
            Some(_) => {}
            None => {
                first_replica.insert(physical, id);
                out.push(physical.to_string());
            }
        }
    }
    Ok(out)
}

/// Makes a preferred allocation hold replicas of distinct devices where the available IDs allow
/// it, for resources that refuse two replicas of one device per container. `chosen` is a valid
/// answer (from the host's policy); each replica whose device is already used is swapped for an
/// available replica of an unused device, in `available` order. Must-include IDs are never
/// swapped out. When too few distinct devices are available the answer keeps its duplicates: the
/// kubelet then allocates what it can and Allocate explains the refusal.
pub fn prefer_distinct(chosen: &[String], available: &[String], must: &[String]) -> Vec<String> {
    let physical = |id: &str| driver_id(id).to_string();
    let mut used: HashSet<String> = HashSet::new();
    let mut out: Vec<Option<String>> = Vec::with_capacity(chosen.len());
    // Must-include IDs claim their devices first, so a swap never collides with them.
    for id in chosen {
        if must.contains(id) {
            used.insert(physical(id));
            out.push(Some(id.clone()));
        } else {
            out.push(None);
        }
    }
    let taken: HashSet<&String> = chosen.iter().collect();
    let mut spare = available.iter().filter(|id| !taken.contains(id));
    for (slot, id) in out.iter_mut().zip(chosen) {
        if slot.is_some() {
            continue;
        }
        if used.insert(physical(id)) {
            *slot = Some(id.clone());
            continue;
        }
        let swap = spare.by_ref().find(|s| !used.contains(&physical(s)));
        match swap {
            Some(s) => {
                used.insert(physical(s));
                *slot = Some(s.clone());
            }
            None => *slot = Some(id.clone()),
        }
    }
    out.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(id: &str, healthy: bool, links: &[(&str, u32)]) -> Device {
        let node = format!("/dev/{id}");
        Device::test(id).health(healthy).numa(Some(1)).attr("model", "X").node(&node, &node).links(links)
    }

    fn ids(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn replica_ids_round_trip() {
        assert_eq!(replica_id("gpu0", 3), "gpu0::3");
        assert_eq!(parse_replica("gpu0::3"), Some(("gpu0", 3)));
        // The index follows the last separator, so physical IDs may hold one.
        assert_eq!(parse_replica(&replica_id("a::b", 0)), Some(("a::b", 0)));
    }

    #[test]
    fn non_canonical_replica_ids_are_rejected() {
        for id in ["gpu0", "gpu0::", "::1", "gpu0::01", "gpu0::+1", "gpu0::-1", "gpu0::1x", "gpu0::99999999999"] {
            assert_eq!(parse_replica(id), None, "{id}");
        }
    }

    #[test]
    fn expand_is_replica_major_and_keeps_device_facts() {
        let out = expand(&[dev("a", true, &[]), dev("b", false, &[])], 2);
        let got: Vec<&str> = out.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(got, ["a::0", "b::0", "a::1", "b::1"]);
        for d in &out {
            let physical = parse_replica(&d.id).unwrap().0;
            assert_eq!(d.healthy, physical == "a", "{}: health follows the physical device", d.id);
            assert_eq!(d.numa_node, Some(1));
            assert_eq!(d.attributes["model"], "X");
            assert_eq!(d.edits.device_nodes[0].host_path, format!("/dev/{physical}"));
        }
    }

    #[test]
    fn expand_maps_links_to_every_replica_of_the_peer() {
        let out = expand(&[dev("a", true, &[("b", 40), ("gone", 9), ("a", 5)]), dev("b", true, &[("a", 40)])], 2);
        let a1 = out.iter().find(|d| d.id == "a::1").unwrap();
        assert_eq!(a1.links, vec![("b::0".to_string(), 40), ("b::1".to_string(), 40)]);
    }

    #[test]
    fn one_replica_expands_to_the_same_devices() {
        let devices = vec![dev("a", true, &[("b", 1)]), dev("b", true, &[])];
        assert_eq!(expand(&devices, 1), devices);
    }

    #[test]
    fn physical_ids_dedup_in_request_order() {
        let got = physical_ids(&ids(&["b::1", "a::0", "b::0"]), 4, false).unwrap();
        assert_eq!(got, ["b", "a"]);
    }

    #[test]
    fn two_replicas_of_one_device_are_refused_when_one_per_container() {
        let err = physical_ids(&ids(&["a::0", "b::0", "a::2"]), 4, true).unwrap_err();
        assert!(err.contains("\"a::0\" and \"a::2\"") && err.contains("same device \"a\""), "{err}");
        assert_eq!(physical_ids(&ids(&["a::0", "b::3"]), 4, true).unwrap(), ["a", "b"]);
    }

    #[test]
    fn malformed_or_out_of_range_replica_ids_are_errors() {
        for bad in ["a", "a::4", "a::01"] {
            let err = physical_ids(&ids(&["b::0", bad]), 4, false).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")) && err.contains("below 4"), "{err}");
        }
    }

    #[test]
    fn without_replicas_ids_pass_through_untouched() {
        assert_eq!(physical_ids(&ids(&["a::1", "b"]), 1, true).unwrap(), ["a::1", "b"]);
    }

    #[test]
    fn prefer_distinct_swaps_siblings_for_unused_devices() {
        let available = ids(&["a::1", "a::2", "b::2", "c::0"]);
        let got = prefer_distinct(&ids(&["a::1", "a::2"]), &available, &[]);
        assert_eq!(got, ["a::1", "b::2"]);
    }

    #[test]
    fn prefer_distinct_keeps_must_include_and_duplicates_it_cannot_avoid() {
        let available = ids(&["a::1", "a::2", "a::3"]);
        let got = prefer_distinct(&ids(&["a::1", "a::2"]), &available, &ids(&["a::2"]));
        assert_eq!(got, ["a::1", "a::2"], "no other device available: the answer stays valid");
        let available = ids(&["a::1", "a::2", "b::0"]);
        let got = prefer_distinct(&ids(&["a::1", "a::2"]), &available, &ids(&["a::2"]));
        assert_eq!(got, ["b::0", "a::2"], "the must-include replica keeps its device");
    }
}
