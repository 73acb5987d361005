//! Link scores between GPUs, measured once at discovery and cached, so the
//! host's preferred allocation picks well-connected sets without any NVML
//! call per request.
//!
//! Score of a pair = 100 per NVLink between them + a PCIe score from NVML's
//! common-ancestor level (same board 60, one switch 50, several switches 40,
//! host bridge 30, same NUMA node 20, across the system 10). Any NVLink thus
//! outranks the best PCIe path. NVLinks that end on an NVSwitch (a remote PCI
//! address that is no GPU) count per switch as the smaller of the two GPUs'
//! link counts to it: GPUs on one NVSwitch fabric score as fully connected.

use crate::discover::{Gpu, normalize_bus_id};
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::error::NvmlError;
use std::collections::HashMap;

/// NVLinks NVML numbers per GPU (`NVML_NVLINK_MAX_LINKS` of the bindings).
pub const MAX_NVLINKS: u32 = 18;
/// Score per NVLink between two GPUs.
pub const NVLINK_SCORE: u32 = 100;

/// The PCIe part of a pair's score. Without a level (NVML could not say),
/// the NUMA nodes decide between "same node" and "across the system".
pub fn pcie_score(level: Option<TopologyLevel>, same_numa: bool) -> u32 {
    match level {
        Some(TopologyLevel::Internal) => 60,
        Some(TopologyLevel::Single) => 50,
        Some(TopologyLevel::Multiple) => 40,
        Some(TopologyLevel::HostBridge) => 30,
        Some(TopologyLevel::Node) => 20,
        Some(TopologyLevel::System) => 10,
        None if same_numa => 20,
        None => 10,
    }
}

/// NVLink counts per pair from each GPU's remote ends (`remote[i]`: remote
/// PCI address → active links of GPU `i`). `addresses[i]` is GPU `i`'s own
/// address. The result is symmetric.
pub fn nvlink_counts(addresses: &[Option<String>], remote: &[HashMap<String, u32>]) -> Vec<Vec<u32>> {
    let n = addresses.len();
    let gpu_at: HashMap<&str, usize> =
        addresses.iter().enumerate().filter_map(|(i, a)| Some((a.as_deref()?, i))).collect();
    let direct =
        |from: usize, to: usize| addresses[to].as_ref().and_then(|a| remote.get(from)?.get(a)).copied().unwrap_or(0);
    let pair = |i: usize, j: usize| -> u32 {
        // Each side reports the links it sees; trust the larger count.
        let mut links = direct(i, j).max(direct(j, i));
        if let (Some(ri), Some(rj)) = (remote.get(i), remote.get(j)) {
            for (switch, &a) in ri.iter().filter(|(addr, _)| !gpu_at.contains_key(addr.as_str())) {
                links += a.min(rj.get(switch).copied().unwrap_or(0));
            }
        }
        links
    };
    (0..n).map(|i| (0..n).map(|j| if i == j { 0 } else { pair(i, j) }).collect()).collect()
}

/// Measures every pair of `gpus` (by position) through NVML: NVLink state and
/// remote ends, and the PCIe common ancestor. Errors only lower scores.
pub fn measure(nvml: &Nvml, gpus: &[Gpu]) -> Vec<Vec<u32>> {
    let n = gpus.len();
    let devices: Vec<_> =
        gpus.iter().map(|g| nvml.device_by_index(g.index).ok().filter(|_| g.problem.is_none())).collect();
    let mut remote = vec![HashMap::new(); n];
    for (i, device) in devices.iter().enumerate() {
        let Some(device) = device else { continue };
        for link in 0..MAX_NVLINKS {
            let nvlink = device.link_wrapper_for(link);
            match nvlink.is_active() {
                Ok(true) => {}
                Ok(false) => continue,
                // No NVLink on this GPU, or no link with this number.
                Err(NvmlError::NotSupported | NvmlError::InvalidArg) => break,
                Err(e) => {
                    log::debug!("NVML: GPU {} link {link}: {e}", gpus[i].uuid);
                    continue;
                }
            }
            match nvlink.remote_pci_info().map(|p| normalize_bus_id(&p.bus_id)) {
                Ok(Some(address)) => *remote[i].entry(address).or_insert(0) += 1,
                Ok(None) => {}
                Err(e) => log::debug!("NVML: GPU {} link {link}: remote end: {e}", gpus[i].uuid),
            }
        }
    }
    let addresses: Vec<Option<String>> = gpus.iter().map(|g| g.pci_address.clone()).collect();
    let links = nvlink_counts(&addresses, &remote);
    let pair = |i: usize, j: usize| -> u32 {
        let level = match (&devices[i], &devices[j]) {
            (Some(a), Some(b)) => nvml.topology_common_ancestor(a, b).ok(),
            _ => None,
        };
        let same_numa = gpus[i].numa_node.is_some() && gpus[i].numa_node == gpus[j].numa_node;
        NVLINK_SCORE * links[i][j] + pcie_score(level, same_numa)
    };
    (0..n).map(|i| (0..n).map(|j| if i == j { 0 } else { pair(i, j) }).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    #[test]
    fn direct_links_count_from_either_side() {
        let addresses = vec![addr("0000:01:00.0"), addr("0000:02:00.0"), addr("0000:03:00.0")];
        let remote = vec![
            HashMap::from([("0000:02:00.0".to_string(), 4)]),
            HashMap::new(), // GPU 1 could not read its remote ends
            HashMap::new(),
        ];
        let c = nvlink_counts(&addresses, &remote);
        assert_eq!((c[0][1], c[1][0]), (4, 4));
        assert_eq!(c[0][2], 0);
    }

    #[test]
    fn links_through_one_nvswitch_count_as_the_smaller_side() {
        let addresses = vec![addr("0000:01:00.0"), addr("0000:02:00.0"), addr("0000:03:00.0")];
        let sw = "0000:c0:00.0".to_string();
        let other = "0000:c1:00.0".to_string();
        let remote = vec![
            HashMap::from([(sw.clone(), 5), (other.clone(), 4)]),
            HashMap::from([(sw.clone(), 3), (other.clone(), 4)]),
            HashMap::new(),
        ];
        let c = nvlink_counts(&addresses, &remote);
        assert_eq!(c[0][1], 3 + 4);
        assert_eq!(c[0][2], 0);
    }

    #[test]
    fn any_nvlink_beats_the_best_pcie_path() {
        let one_link = NVLINK_SCORE + pcie_score(Some(TopologyLevel::System), false);
        assert!(one_link > pcie_score(Some(TopologyLevel::Internal), true));
        assert!(pcie_score(Some(TopologyLevel::Single), false) > pcie_score(Some(TopologyLevel::Multiple), false));
        assert!(pcie_score(None, true) > pcie_score(None, false));
    }
}
