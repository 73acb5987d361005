//! The real `devhost` binary with the NVIDIA driver against the kubelet emulator. NVML is the
//! fake libnvidia-ml the workspace builds (`drivers/fake-nvml`), copied into the test folder
//! with a generated machine file beside it: four whole H100s sharing NVLinks unevenly and a
//! fifth GPU in MIG mode. Needs `libdevhost_nvidia.so` and `libfake_nvml.so` next to the binary
//! (`cargo build --workspace`).

mod common;
use common::*;
use std::io::Write;
use std::path::PathBuf;

const GPUS: &str = "nvidia.com/gpu";
const MIG: &str = "nvidia.com/mig-1g.10gb";
const BUSES: [&str; 5] = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0"];

fn uuid(i: usize) -> String {
    format!("GPU-0e5b9c2a-1d3f-4a6b-8c7d-{i:012x}")
}

fn mig(slot: usize) -> String {
    format!("MIG-7a1c3e5f-2b4d-5e6f-9a0b-{slot:012x}")
}

fn nvml_bus(bus: &str) -> String {
    format!("0000{}", bus.to_uppercase())
}

/// GPUs 0 and 2 share 6 NVLinks, 1 and 3 share 2; PCIe pairs 0-1 and 2-3 sit on one switch.
/// GPU 4 is in MIG mode with two 1g.10gb devices.
fn machine() -> String {
    let links = |peer: usize, n: usize| vec![format!("\"{}\"", nvml_bus(BUSES[peer])); n].join(", ");
    let nvlinks = [links(2, 6), links(3, 2), links(0, 6), links(1, 2), String::new()];
    let mut t = String::from("control = \"control\"\ntopology_default = \"node\"\n");
    for (i, bus) in BUSES.iter().enumerate() {
        t += &format!(
            "[[gpu]]\nuuid = \"{}\"\nname = \"NVIDIA H100 80GB HBM3\"\nmemory_mib = 81559\npci_bus_id = \"{}\"\nminor = {i}\nnvlinks = [{}]\n",
            uuid(i),
            nvml_bus(bus),
            nvlinks[i]
        );
    }
    t += "mig_mode = true\n";
    for slot in 0..2 {
        t += &format!(
            "[[gpu.mig_device]]\nslot = {slot}\nuuid = \"{}\"\nprofile = \"1g.10gb\"\nmemory_mib = 9856\n",
            mig(slot)
        );
    }
    t += "[[topology]]\ngpus = [0, 1]\nlevel = \"single\"\n[[topology]]\ngpus = [2, 3]\nlevel = \"single\"\n";
    t
}

/// Lays out the fake NVML, sysfs (all GPUs on NUMA node 0) and devfs under the test folder;
/// returns the manifest.
fn setup(node: &Node, options: &str) -> PathBuf {
    setup_machine(node, options, &machine(), &BUSES.map(|b| (b, 0)))
}

/// Like [`setup`] for any machine file and (PCI bus, NUMA node) list.
fn setup_machine(node: &Node, options: &str, machine: &str, buses: &[(&str, u32)]) -> PathBuf {
    let root = node.path();
    let lib = fake_nvml_node(root, machine, "pci0000:00", buses);
    node.write_manifest(&format!(
        r#"
[driver.nvidia]
module = "{module}"
[driver.nvidia.options]
nvml_lib = "{lib}/libnvidia-ml.so.1"
sysfs_root = "{root}/sys"
devfs_root = "{root}/dev"
{options}

[[resource]]
name = "{GPUS}"
driver = "nvidia"
match = {{ kind = "gpu" }}

[[resource]]
name = "{MIG}"
driver = "nvidia"
match = {{ mig_profile = "1g.10gb" }}
"#,
        module = module("nvidia").display(),
        lib = lib.display(),
        root = root.display(),
    ))
}

fn control(node: &Node, line: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).open(node.path().join("nvml/control")).unwrap();
    writeln!(f, "{line}").unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpus_and_mig_devices_are_listed_and_nvlink_pairs_are_preferred() {
    let node = Node::new();
    let manifest = setup(&node, "device_list_strategy = [\"envvar\", \"cdi\"]");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&manifest, &node.kubelet_dir());

    let gpus = kubelet.wait_devices(GPUS, WAIT, |d| d.len() == 4).await.unwrap();
    let listed: Vec<&str> = gpus.iter().map(|d| d.id.as_str()).collect();
    let whole: Vec<String> = (0..4).map(uuid).collect();
    assert_eq!(listed, whole, "whole GPUs only: GPU 4 is in MIG mode");
    assert!(gpus.iter().all(|d| d.health == "Healthy"));
    assert!(gpus.iter().all(|d| d.topology.as_ref().unwrap().nodes[0].id == 0));
    let migs = kubelet.wait_devices(MIG, WAIT, |d| d.len() == 2).await.unwrap();
    let mig_ids: Vec<&str> = migs.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(mig_ids, [mig(0), mig(1)]);

    // The 6-NVLink pair wins over the PCIe switch pairs and the 2-NVLink pair.
    let mut pair = kubelet.preferred_allocation(GPUS, whole.clone(), vec![], 2).await.unwrap();
    pair.sort();
    assert_eq!(pair, [uuid(0), uuid(2)]);
    let mut with_one = kubelet.preferred_allocation(GPUS, whole.clone(), vec![uuid(1)], 2).await.unwrap();
    with_one.sort();
    assert_eq!(with_one, [uuid(1), uuid(3)]);

    let resp = kubelet.allocate(GPUS, vec![vec![uuid(0), uuid(2)]]).await.unwrap();
    let visible = env_of(&resp, 0, "NVIDIA_VISIBLE_DEVICES").unwrap();
    assert_eq!(visible, format!("{},{}", uuid(0), uuid(2)));
    let cdi: Vec<&str> = resp.container_responses[0].cdi_devices.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(cdi, [format!("nvidia.com/gpu={}", uuid(0)), format!("nvidia.com/gpu={}", uuid(2))]);

    let resp = kubelet.allocate(MIG, vec![vec![mig(1)]]).await.unwrap();
    assert_eq!(env_of(&resp, 0, "NVIDIA_VISIBLE_DEVICES"), Some(mig(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_critical_xid_turns_the_gpu_unhealthy_until_it_recovers() {
    let node = Node::new();
    let manifest = setup(&node, "recovery_period = \"500ms\"");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&manifest, &node.kubelet_dir());
    kubelet.wait_devices(GPUS, WAIT, |d| d.len() == 4).await.unwrap();
    kubelet.wait_devices(MIG, WAIT, |d| d.len() == 2).await.unwrap();

    control(&node, "xid 1 13"); // an application error: ignored
    control(&node, "xid 1 79");
    control(&node, "xid 4 48");
    let unhealthy = |d: &[kubelet_emu::Device], id: &str| d.iter().any(|x| x.id == id && x.health == "Unhealthy");
    let gpus = kubelet.wait_devices(GPUS, WAIT, |d| unhealthy(d, &uuid(1))).await.unwrap();
    assert_eq!(gpus.iter().filter(|d| d.health == "Unhealthy").count(), 1, "only GPU 1");
    // The driver says why (ABI 1.2), and the host logs the transition with it.
    d.wait_log(
        &format!("device {:?}: Healthy -> Unhealthy (driver reported Unhealthy: critical Xid 79)", uuid(1)),
        WAIT,
    )
    .await;
    // An Xid on the MIG-mode GPU affects both of its MIG devices.
    kubelet.wait_devices(MIG, WAIT, |d| d.iter().all(|x| x.health == "Unhealthy")).await.unwrap();

    // Both answer NVML normally, so they come back after the quiet period.
    kubelet.wait_devices(GPUS, WAIT, |d| d.iter().all(|x| x.health == "Healthy")).await.unwrap();
    kubelet.wait_devices(MIG, WAIT, |d| d.iter().all(|x| x.health == "Healthy")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_lost_without_an_event_turns_unhealthy_by_the_default_periodic_check() {
    let node = Node::new();
    // Default health_check_interval (1 s); a short recovery period for the way back.
    let manifest = setup(&node, "recovery_period = \"500ms\"");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&manifest, &node.kubelet_dir());
    kubelet.wait_devices(GPUS, WAIT, |d| d.len() == 4 && d.iter().all(|x| x.health == "Healthy")).await.unwrap();

    // GPU 2 stops answering NVML, and neither an Xid nor the event wait says so.
    let lost = std::time::Instant::now();
    control(&node, "vanish 2");
    let unhealthy = |d: &[kubelet_emu::Device], id: &str| d.iter().any(|x| x.id == id && x.health == "Unhealthy");
    let gpus = kubelet.wait_devices(GPUS, WAIT, |d| unhealthy(d, &uuid(2))).await.unwrap();
    let took = lost.elapsed();
    // One check interval plus one event-wait tick, with room for a loaded machine.
    assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
    assert_eq!(gpus.iter().filter(|d| d.health == "Unhealthy").count(), 1, "only GPU 2");

    control(&node, "back 2");
    kubelet.wait_devices(GPUS, WAIT, |d| d.iter().all(|x| x.health == "Healthy")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_nvml_on_a_gpu_node_is_an_error_and_the_daemon_keeps_running() {
    let node = Node::new();
    let manifest = setup(&node, "");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let missing = node.path().join("nowhere/libnvidia-ml.so.1");
    let manifest =
        node.write_manifest(&text.replace(
            &format!("{}/libnvidia-ml.so.1", node.path().join("nvml").display()),
            &missing.display().to_string(),
        ));
    let mut d = Daemon::start(&manifest, &node.kubelet_dir());
    let log = d.wait_log("cannot use NVML", WAIT).await;
    // The GPUs are on the PCI bus: their driver is missing, which must page someone.
    let line = log.lines().find(|l| l.contains("cannot use NVML")).unwrap();
    assert!(line.contains(" ERROR ") && line.contains(&missing.display().to_string()), "{line}");
    assert!(BUSES.iter().all(|bus| line.contains(bus)), "the line names the GPUs: {line}");
    assert!(d.child.try_wait().unwrap().is_none(), "devhost exited:\n{log}");
}

const EIGHT: [&str; 8] = [
    "0000:18:00.0",
    "0000:2a:00.0",
    "0000:3a:00.0",
    "0000:5d:00.0",
    "0000:9a:00.0",
    "0000:ab:00.0",
    "0000:ba:00.0",
    "0000:db:00.0",
];

/// Eight H100s in two NVLink islands, one per NUMA node: within each island
/// every pair shares 2 NVLinks, and one pair (2-3, 4-5) shares 6.
fn eight_gpu_machine() -> String {
    let links =
        |i: usize, j: usize| if (i.min(j), i.max(j)) == (2, 3) || (i.min(j), i.max(j)) == (4, 5) { 6 } else { 2 };
    let mut t = String::from("control = \"control\"\ntopology_default = \"system\"\n");
    for (i, bus) in EIGHT.iter().enumerate() {
        let island = if i < 4 { 0..4 } else { 4..8 };
        let peers: Vec<String> =
            island.filter(|&j| j != i).flat_map(|j| vec![format!("\"{}\"", nvml_bus(EIGHT[j])); links(i, j)]).collect();
        t += &format!(
            "[[gpu]]\nuuid = \"{}\"\nname = \"NVIDIA H100 80GB HBM3\"\nmemory_mib = 81559\npci_bus_id = \"{}\"\nminor = {i}\nnvlinks = [{}]\n",
            uuid(i),
            nvml_bus(bus),
            peers.join(", ")
        );
    }
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_an_eight_gpu_nvlink_machine_preferred_sets_are_nvlink_connected() {
    let node = Node::new();
    let buses: Vec<(&str, u32)> = EIGHT.iter().enumerate().map(|(i, b)| (*b, (i / 4) as u32)).collect();
    let manifest = setup_machine(&node, "", &eight_gpu_machine(), &buses);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&manifest, &node.kubelet_dir());
    let gpus = kubelet.wait_devices(GPUS, WAIT, |d| d.len() == 8).await.unwrap();
    let numa: Vec<i64> = gpus.iter().map(|d| d.topology.as_ref().unwrap().nodes[0].id).collect();
    assert_eq!(numa, [0, 0, 0, 0, 1, 1, 1, 1]);
    let all: Vec<String> = (0..8).map(uuid).collect();
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    // Two GPUs: the 6-NVLink pair (the first one in stable order).
    let two = kubelet.preferred_allocation(GPUS, all.clone(), vec![], 2).await.unwrap();
    assert_eq!(sorted(two), [uuid(2), uuid(3)]);
    // Two GPUs around GPU 5: its 6-NVLink partner, not a PCIe neighbour.
    let two = kubelet.preferred_allocation(GPUS, all.clone(), vec![uuid(5)], 2).await.unwrap();
    assert_eq!(sorted(two), [uuid(4), uuid(5)]);
    // Four GPUs: one whole NVLink island on one NUMA node.
    let four = kubelet.preferred_allocation(GPUS, all.clone(), vec![], 4).await.unwrap();
    assert_eq!(sorted(four), (0..4).map(uuid).collect::<Vec<_>>());
    let four = kubelet.preferred_allocation(GPUS, all.clone(), vec![uuid(6)], 4).await.unwrap();
    assert_eq!(sorted(four), (4..8).map(uuid).collect::<Vec<_>>());
    // With one island partly taken, the rest of it still beats a cross-island set.
    let avail: Vec<String> = [0, 1, 2, 4, 5, 6, 7].map(uuid).to_vec();
    let three = kubelet.preferred_allocation(GPUS, avail, vec![uuid(0)], 3).await.unwrap();
    assert_eq!(sorted(three), [uuid(0), uuid(1), uuid(2)]);
}
