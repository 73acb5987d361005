//! The environment libtpu reads instead of the GCE metadata server. Off GKE nothing else tells
//! libtpu its slice shape, so every allocation carries the full set, derived from the chips the
//! container got and the operator's slice options. Ports are derived from chip indices: two
//! containers on one host hold disjoint chips, so their ports never collide.

use crate::config::Config;
use crate::generation::Generation;
use crate::inventory::ChipView;
use crate::topology;
use devhost_sdk::{Error, Result};
use std::collections::BTreeSet;

/// The variables for one container holding `chosen` (non-empty, one generation, index order).
pub fn environment(config: &Config, chosen: &[&ChipView]) -> Result<Vec<(&'static str, String)>> {
    let Some(first) = chosen.first() else {
        return Err(Error::invalid_argument("the request names no TPU chips"));
    };
    let generation = first.chip.generation;
    let count = chosen.len();
    let chip_bounds = topology::chip_bounds(count).ok_or_else(|| {
        Error::failed_precondition(format!(
            "{count} {generation} chips are not a TPU host shape libtpu accepts (1, 2, 4 or 8 chips)"
        ))
    })?;
    let topology = match &config.topology {
        // `Config` guarantees two or three dimensions.
        Some(dims) => [dims[0], dims[1], dims.get(2).copied().unwrap_or(1)],
        None => chip_bounds,
    };
    let host_bounds = host_bounds(&topology, &chip_bounds, generation)?;
    let hosts = host_bounds.iter().product::<u32>() as usize;
    let hostnames = config.worker_hostnames.clone().unwrap_or_else(|| vec!["localhost".to_string()]);
    if hostnames.len() != hosts {
        return Err(Error::failed_precondition(format!(
            "topology {} spans {hosts} host(s) of {count} chips, but worker_hostnames lists {}; \
             list every host of the slice in worker-ID order",
            topology::topology_text(&topology, generation),
            hostnames.len()
        )));
    }
    let slice_chips: u32 = topology.iter().product();
    let accelerator_type = config
        .accelerator_type
        .clone()
        .unwrap_or_else(|| format!("{}-{}", generation.accelerator_name(), slice_chips * generation.cores_per_chip()));

    let indices: Vec<usize> = chosen.iter().map(|v| v.index).collect();
    let visible = join(indices.iter());
    let metrics_ports: Vec<u16> = indices
        .iter()
        .map(|&i| offset_port(config.metrics_port_base, i, "metrics_port_base"))
        .collect::<Result<_>>()?;
    // One libtpu process per container; its port follows the box's first chip.
    let process_port = offset_port(config.process_port_base, first.index, "process_port_base")?;

    let mut env = vec![
        ("TPU_SKIP_MDS_QUERY", "true".to_string()),
        ("TPU_ACCELERATOR_TYPE", accelerator_type),
        ("TPU_TOPOLOGY", topology::topology_text(&topology, generation)),
        ("TPU_TOPOLOGY_WRAP", topology::wrap(&topology, generation)),
        ("TPU_TOPOLOGY_ALT", "false".to_string()),
        ("TPU_CHIPS_PER_HOST_BOUNDS", topology::bounds_text(&chip_bounds)),
        ("TPU_CHIPS_PER_PROCESS_BOUNDS", topology::bounds_text(&chip_bounds)),
        ("TPU_HOST_BOUNDS", topology::bounds_text(&host_bounds)),
        ("TPU_PROCESS_BOUNDS", topology::bounds_text(&host_bounds)),
        ("TPU_VISIBLE_CHIPS", visible.clone()),
        ("TPU_VISIBLE_DEVICES", visible),
        ("TPU_WORKER_ID", config.worker_id.to_string()),
        ("TPU_WORKER_HOSTNAMES", hostnames.join(",")),
        ("TPU_RUNTIME_METRICS_PORTS", join(metrics_ports.iter())),
        ("TPU_PROCESS_PORT", process_port.to_string()),
    ];
    if generation == Generation::Tpu7x {
        let numa: BTreeSet<u32> = chosen.iter().filter_map(|v| v.chip.numa_node).collect();
        if !numa.is_empty() {
            env.push(("WORKLOAD_NIC_PREFERRED_NUMA", join(numa.iter())));
        }
    }
    Ok(env)
}

/// Slice dimensions divided by one host's: how many hosts along each axis.
fn host_bounds(topology: &[u32; 3], chips: &[u32; 3], generation: Generation) -> Result<[u32; 3]> {
    let mut out = [1; 3];
    for axis in 0..3 {
        if !topology[axis].is_multiple_of(chips[axis]) {
            return Err(Error::failed_precondition(format!(
                "topology {} is not a whole number of {} hosts (chips per host {})",
                topology::topology_text(topology, generation),
                topology::topology_text(chips, generation),
                topology::bounds_text(chips)
            )));
        }
        out[axis] = topology[axis] / chips[axis];
    }
    Ok(out)
}

fn offset_port(base: u16, index: usize, option: &str) -> Result<u16> {
    u16::try_from(usize::from(base) + index).map_err(|_| {
        Error::failed_precondition(format!("option \"{option}\" {base} + chip {index} is past port 65535"))
    })
}

fn join<T: ToString>(items: impl Iterator<Item = T>) -> String {
    items.map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}
