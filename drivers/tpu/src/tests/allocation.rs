//! The allocation policies and the environment each allocation gets.

use super::*;
use crate::allocation::{prefer, resolve};
use crate::env::environment;
use devhost_sdk::{Result, Status};

type Env = Vec<(&'static str, String)>;

fn allocate(config: &Config, chips: &[ChipView], ids: &[&str]) -> Result<Env> {
    environment(config, &resolve(config, chips, ids)?)
}

fn ids_at(chips: &[ChipView], indices: &[usize]) -> Vec<String> {
    indices.iter().map(|&i| chips.iter().find(|v| v.index == i).unwrap().chip.id.clone()).collect()
}

fn strs(ids: &[String]) -> Vec<&str> {
    ids.iter().map(String::as_str).collect()
}

fn assert_env(env: &Env, expected: &[(&str, &str)]) {
    let got: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    assert_eq!(got, expected);
}

#[test]
fn whole_v4_host_gets_the_full_single_host_environment() {
    let tree = v4_host();
    let (_, chips) = tree.inventory();
    let config = tree.config(&[]);
    let env = allocate(&config, &chips, &strs(&ids_at(&chips, &[3, 1, 0, 2]))).unwrap();
    assert_env(
        &env,
        &[
            ("TPU_SKIP_MDS_QUERY", "true"),
            ("TPU_ACCELERATOR_TYPE", "v4-8"),
            ("TPU_TOPOLOGY", "2x2x1"),
            ("TPU_TOPOLOGY_WRAP", "false,false,false"),
            ("TPU_TOPOLOGY_ALT", "false"),
            ("TPU_CHIPS_PER_HOST_BOUNDS", "2,2,1"),
            ("TPU_CHIPS_PER_PROCESS_BOUNDS", "2,2,1"),
            ("TPU_HOST_BOUNDS", "1,1,1"),
            ("TPU_PROCESS_BOUNDS", "1,1,1"),
            ("TPU_VISIBLE_CHIPS", "0,1,2,3"),
            ("TPU_VISIBLE_DEVICES", "0,1,2,3"),
            ("TPU_WORKER_ID", "0"),
            ("TPU_WORKER_HOSTNAMES", "localhost"),
            ("TPU_RUNTIME_METRICS_PORTS", "8431,8432,8433,8434"),
            ("TPU_PROCESS_PORT", "8476"),
        ],
    );
}

#[test]
fn whole_host_refuses_any_other_size() {
    let tree = v6e_host();
    let (_, chips) = tree.inventory();
    let config = tree.config(&[]);
    let e = allocate(&config, &chips, &V6E_CHIPS[..4]).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("all 8 TPU chips") && e.message.contains("not 4"), "{e}");
    let e = prefer(&config, &chips, &V6E_CHIPS, &[], 4).unwrap_err();
    assert!(e.message.contains("all 8 TPU chips"), "{e}");
    assert_eq!(prefer(&config, &chips, &V6E_CHIPS, &[], 8).unwrap(), V6E_CHIPS);
}

#[test]
fn whole_v6e_host_is_a_2x4_v6e_8() {
    let tree = v6e_host();
    let (_, chips) = tree.inventory();
    let env = allocate(&tree.config(&[]), &chips, &V6E_CHIPS).unwrap();
    assert_eq!(var(&env, "TPU_ACCELERATOR_TYPE"), "v6e-8");
    assert_eq!(var(&env, "TPU_TOPOLOGY"), "2x4");
    assert_eq!(var(&env, "TPU_CHIPS_PER_HOST_BOUNDS"), "2,4,1");
    assert_eq!(var(&env, "TPU_VISIBLE_CHIPS"), "0,1,2,3,4,5,6,7");
    assert_eq!(var(&env, "TPU_RUNTIME_METRICS_PORTS"), "8431,8432,8433,8434,8435,8436,8437,8438");
}

#[test]
fn v6e_boxes_get_their_own_shape_and_ports() {
    let tree = v6e_host();
    let (_, chips) = tree.inventory();
    let config = tree.config(&[("allocation", "boxes")]);
    let quad = allocate(&config, &chips, &V6E_CHIPS[4..]).unwrap();
    assert_env(
        &quad,
        &[
            ("TPU_SKIP_MDS_QUERY", "true"),
            ("TPU_ACCELERATOR_TYPE", "v6e-4"),
            ("TPU_TOPOLOGY", "2x2"),
            ("TPU_TOPOLOGY_WRAP", "false,false,false"),
            ("TPU_TOPOLOGY_ALT", "false"),
            ("TPU_CHIPS_PER_HOST_BOUNDS", "2,2,1"),
            ("TPU_CHIPS_PER_PROCESS_BOUNDS", "2,2,1"),
            ("TPU_HOST_BOUNDS", "1,1,1"),
            ("TPU_PROCESS_BOUNDS", "1,1,1"),
            ("TPU_VISIBLE_CHIPS", "4,5,6,7"),
            ("TPU_VISIBLE_DEVICES", "4,5,6,7"),
            ("TPU_WORKER_ID", "0"),
            ("TPU_WORKER_HOSTNAMES", "localhost"),
            ("TPU_RUNTIME_METRICS_PORTS", "8435,8436,8437,8438"),
            ("TPU_PROCESS_PORT", "8480"),
        ],
    );
    let pair = allocate(&config, &chips, &[V6E_CHIPS[3], V6E_CHIPS[2]]).unwrap();
    assert_eq!(var(&pair, "TPU_ACCELERATOR_TYPE"), "v6e-2");
    assert_eq!(var(&pair, "TPU_TOPOLOGY"), "1x2");
    assert_eq!(var(&pair, "TPU_CHIPS_PER_PROCESS_BOUNDS"), "1,2,1");
    assert_eq!(var(&pair, "TPU_VISIBLE_CHIPS"), "2,3");
    assert_eq!(var(&pair, "TPU_RUNTIME_METRICS_PORTS"), "8433,8434");
    assert_eq!(var(&pair, "TPU_PROCESS_PORT"), "8478");
    let single = allocate(&config, &chips, &[V6E_CHIPS[1]]).unwrap();
    assert_eq!(var(&single, "TPU_TOPOLOGY"), "1x1");
    assert_eq!(var(&single, "TPU_CHIPS_PER_HOST_BOUNDS"), "1,1,1");
    assert_eq!(var(&single, "TPU_VISIBLE_CHIPS"), "1");
    assert_eq!(var(&single, "TPU_RUNTIME_METRICS_PORTS"), "8432");
    assert_eq!(var(&single, "TPU_PROCESS_PORT"), "8477");
}

#[test]
fn boxes_refuse_shapes_that_are_not_boxes() {
    let tree = v6e_host();
    let (_, chips) = tree.inventory();
    let config = tree.config(&[("allocation", "boxes")]);
    let e = allocate(&config, &chips, &[V6E_CHIPS[1], V6E_CHIPS[2]]).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("0000:00:05.0 (chip 1), 0000:00:06.0 (chip 2)"), "{e}");
    assert!(e.message.contains("2-chip box (1x2)") && e.message.contains("chips 0-1, 2-3, 4-5, 6-7"), "{e}");
    let e = allocate(&config, &chips, &V6E_CHIPS[2..6]).unwrap_err();
    assert!(e.message.contains("chips 0-3, 4-7"), "{e}");
    let e = allocate(&config, &chips, &V6E_CHIPS[..3]).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("3-chip"), "{e}");
}

#[test]
fn unknown_and_repeated_chips_are_refused() {
    let tree = v4_host();
    let (_, chips) = tree.inventory();
    let config = tree.config(&[("allocation", "boxes")]);
    let e = allocate(&config, &chips, &["0000:99:00.0"]).unwrap_err();
    assert_eq!(e.status, Status::NotFound);
    assert!(e.message.contains("0000:99:00.0"), "{e}");
    let e = allocate(&config, &chips, &["0000:00:04.0", "0000:00:04.0"]).unwrap_err();
    assert_eq!(e.status, Status::InvalidArgument);
}

#[test]
fn tpu7x_box_gets_numa_and_slot_order() {
    let tree = tpu7x_host();
    let (_, chips) = tree.inventory();
    let config = tree.config(&[("allocation", "boxes")]);
    let env = allocate(&config, &chips, &["0000:40:02", "0000:40:03"]).unwrap();
    assert_eq!(var(&env, "TPU_ACCELERATOR_TYPE"), "tpu7x-4");
    assert_eq!(var(&env, "TPU_TOPOLOGY"), "1x2x1");
    assert_eq!(var(&env, "TPU_VISIBLE_CHIPS"), "2,3");
    assert_eq!(var(&env, "TPU_RUNTIME_METRICS_PORTS"), "8433,8434");
    assert_eq!(var(&env, "WORKLOAD_NIC_PREFERRED_NUMA"), "1");
    let whole = allocate(&tree.config(&[]), &chips, &["0000:40:02", "0000:40:03", "0000:c0:02", "0000:c0:03"]).unwrap();
    assert_eq!(var(&whole, "TPU_ACCELERATOR_TYPE"), "tpu7x-8");
    assert_eq!(var(&whole, "TPU_TOPOLOGY"), "2x2x1");
    assert_eq!(var(&whole, "WORKLOAD_NIC_PREFERRED_NUMA"), "0,1");
}

#[test]
fn tpu7x_pairs_may_not_span_numa_nodes() {
    let tree = Tree::new();
    let mut group = 0;
    // Three slots on node 0 and one on node 1: the aligned pair {2,3} crosses nodes.
    for (slot, numa) in [("0000:40:02", 0), ("0000:40:03", 0), ("0000:40:04", 0), ("0000:c0:02", 1)] {
        for function in ["0", "1"] {
            let address = format!("{slot}.{function}");
            tree.pci(&address, "0x1ae0", "0x0076").numa(&address, numa).vfio(&address, group);
            group += 1;
        }
    }
    let (_, chips) = tree.inventory();
    let config = tree.config(&[("allocation", "boxes")]);
    let e = allocate(&config, &chips, &["0000:40:04", "0000:c0:02"]).unwrap_err();
    assert!(e.message.contains("span NUMA nodes"), "{e}");
    let all: Vec<&str> = chips.iter().map(|v| v.chip.id.as_str()).collect();
    assert_eq!(prefer(&config, &chips, &all[2..], &[], 2).unwrap_err().status, Status::ResourceExhausted);
}

#[test]
fn multi_host_slices_take_the_operators_topology() {
    let tree = v4_host();
    let (_, chips) = tree.inventory();
    let all: Vec<&str> = chips.iter().map(|v| v.chip.id.as_str()).collect();
    let config = tree.config(&[("topology", "2x2x2"), ("worker_id", "1"), ("worker_hostnames", "tpu-a,tpu-b")]);
    let env = allocate(&config, &chips, &all).unwrap();
    assert_eq!(var(&env, "TPU_ACCELERATOR_TYPE"), "v4-16");
    assert_eq!(var(&env, "TPU_TOPOLOGY"), "2x2x2");
    assert_eq!(var(&env, "TPU_CHIPS_PER_HOST_BOUNDS"), "2,2,1");
    assert_eq!(var(&env, "TPU_HOST_BOUNDS"), "1,1,2");
    assert_eq!(var(&env, "TPU_PROCESS_BOUNDS"), "1,1,2");
    assert_eq!(var(&env, "TPU_WORKER_ID"), "1");
    assert_eq!(var(&env, "TPU_WORKER_HOSTNAMES"), "tpu-a,tpu-b");

    let big = tree.config(&[("topology", "4x4x8"), ("accelerator_type", "v4-256"), ("worker_hostnames", "only-me")]);
    let e = allocate(&big, &chips, &all).unwrap_err();
    assert_eq!(e.status, Status::FailedPrecondition);
    assert!(e.message.contains("spans 32 host(s)") && e.message.contains("lists 1"), "{e}");

    let wrapped = tree.config(&[("topology", "4x4x4"), ("worker_hostnames", &vec!["h"; 16].join(","))]);
    let env = allocate(&wrapped, &chips, &all).unwrap();
    assert_eq!(var(&env, "TPU_TOPOLOGY_WRAP"), "true,true,true");
    assert_eq!(var(&env, "TPU_HOST_BOUNDS"), "2,2,4");

    let odd = tree.config(&[("topology", "3x2x1")]);
    let e = allocate(&odd, &chips, &all).unwrap_err();
    assert!(e.message.contains("not a whole number of 2x2x1 hosts"), "{e}");
}

#[test]
fn preferred_boxes_keep_larger_boxes_free() {
    let tree = v6e_host();
    let (_, chips) = tree.inventory();
    let config = tree.config(&[("allocation", "boxes")]);
    let all = V6E_CHIPS;
    assert_eq!(prefer(&config, &chips, &all, &[], 2).unwrap(), ids_at(&chips, &[0, 1]));
    // Chip 0 is taken: the next pair comes from the same half, keeping 4-7 whole.
    assert_eq!(prefer(&config, &chips, &all[1..], &[], 2).unwrap(), ids_at(&chips, &[2, 3]));
    assert_eq!(prefer(&config, &chips, &all[1..], &[], 4).unwrap(), ids_at(&chips, &[4, 5, 6, 7]));
    assert_eq!(prefer(&config, &chips, &all[1..], &[], 1).unwrap(), ids_at(&chips, &[1]));
    // must_include decides which box.
    assert_eq!(prefer(&config, &chips, &all, &[all[5]], 2).unwrap(), ids_at(&chips, &[4, 5]));
    let e = prefer(&config, &chips, &all[1..], &[], 8).unwrap_err();
    assert_eq!(e.status, Status::ResourceExhausted);
    assert!(e.message.contains("no free 8-chip TPU box"), "{e}");
    let e = prefer(&config, &chips, &[all[0], all[2]], &[], 2).unwrap_err();
    assert!(e.message.contains("free chips: 0, 2"), "{e}");
}
