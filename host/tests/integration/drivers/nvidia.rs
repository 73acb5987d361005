//! The real `devhost` binary with the NVIDIA driver against the kubelet emulator. NVML is the
//! fake libnvidia-ml the workspace builds (`drivers/fake-nvml`), copied into the test folder
//! with a generated machine file beside it: four whole H100s sharing NVLinks unevenly and a
//! fifth GPU in MIG mode. Needs `libdevhost_nvidia.so` and `libfake_nvml.so` next to the binary
//! (`cargo build --workspace`).

use crate::common::*;
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

/// [`setup`] with the `cdi` strategy and top-level `top` (keys before the first table).
/// Called again on one node, it only rewrites the manifest's top.
fn setup_cdi(node: &Node, top: &str) -> PathBuf {
    let manifest = node.path().join("devhost.toml");
    let body = match std::fs::read_to_string(node.path().join("body.toml")) {
        Ok(body) => body,
        Err(_) => {
            let written = setup(node, "device_list_strategy = \"cdi\"");
            let body = std::fs::read_to_string(&written).unwrap();
            std::fs::write(node.path().join("body.toml"), &body).unwrap();
            for n in ["nvidiactl", "nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidia4"] {
                std::fs::write(node.path().join("dev").join(n), "").unwrap();
            }
            body
        }
    };
    std::fs::write(&manifest, format!("{top}\n{body}")).unwrap();
    manifest
}

fn spec_names(path: &std::path::Path) -> (String, Vec<String>) {
    let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let names = spec["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string());
    (spec["kind"].as_str().unwrap().to_string(), names.collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cdi_strategy_hands_out_names_that_devhosts_own_spec_defines() {
    let node = Node::new();
    let (etc, run) = (node.path().join("etc-cdi"), node.path().join("run-cdi"));
    let top =
        format!("cdi_dir = \"{}\"\ncdi_spec_dirs = [\"{}\", \"{}\"]", run.display(), etc.display(), run.display());
    let manifest = setup_cdi(&node, &top);
    let (code, out, err) = devhost(&["check", "--config", manifest.to_str().unwrap()]);
    assert_eq!(code, 0, "every name devhost would hand out resolves in the spec it would write: {out}{err}");
    assert!(!run.exists(), "check writes nothing");

    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&manifest, &node.kubelet_dir());
    kubelet.wait_devices(GPUS, WAIT, |d| d.len() == 4).await.unwrap();
    kubelet.wait_devices(MIG, WAIT, |d| d.len() == 2).await.unwrap();
    let resp = kubelet.allocate(GPUS, vec![vec![uuid(1)]]).await.unwrap();
    let c = &resp.container_responses[0];
    let name = format!("nvidia.com/gpu={}", uuid(1));
    assert_eq!(c.cdi_devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(), [name.as_str()]);
    assert!(c.devices.is_empty() && c.mounts.is_empty(), "the name carries the GPU's nodes: {c:?}");

    // The resource's kind is the driver's: one file. The MIG resource's names get a file of their own.
    let (kind, names) = spec_names(&run.join("devhost-nvidia.com_gpu.json"));
    assert_eq!((kind.as_str(), names), (GPUS, (0..4).map(uuid).collect::<Vec<_>>()));
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("devhost-nvidia.com_gpu.json")).unwrap()).unwrap();
    let nodes: Vec<&str> = spec["devices"][1]["containerEdits"]["deviceNodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["path"].as_str().unwrap())
        .collect();
    assert!(nodes.contains(&"/dev/nvidia1") && nodes.contains(&"/dev/nvidiactl"), "{nodes:?}");
    let (kind, names) = spec_names(&run.join("devhost-nvidia.com_mig-1g.10gb+nvidia.com_gpu.json"));
    assert_eq!((kind.as_str(), names), (GPUS, vec![mig(0), mig(1)]));
    let resp = kubelet.allocate(MIG, vec![vec![mig(0)]]).await.unwrap();
    assert_eq!(resp.container_responses[0].cdi_devices[0].name, format!("nvidia.com/gpu={}", mig(0)));
    assert!(!d.logs().contains("CDI name"), "no resolution problem is logged:\n{}", d.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unresolvable_cdi_names_fail_check_and_show_in_the_log_and_metrics() {
    let node = Node::new();
    let (etc, run) = (node.path().join("etc-cdi"), node.path().join("run-cdi"));
    let name0 = format!("nvidia.com/gpu={}", uuid(0));
    // The runtime does not read devhost's cdi_dir: no name resolves.
    let top = format!("cdi_dir = \"{}\"\ncdi_spec_dirs = [\"{}\"]", run.display(), etc.display());
    let manifest = setup_cdi(&node, &top);
    let (code, _, err) = devhost(&["check", "--config", manifest.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    let want = format!(
        "resource {GPUS}: device {}: CDI name {name0} is defined by no CDI spec in {} (cdi_spec_dirs); devhost writes \
         its specs into cdi_dir {}, which is not among them",
        uuid(0),
        etc.display(),
        run.display()
    );
    assert!(err.contains(&want), "{err}");
    assert!(err.contains("unresolvable CDI devices"), "{err}");

    // nvidia-ctk's spec in the same folder as devhost's defines the same name: dropped from both.
    let addr = free_port();
    let top = format!("cdi_dir = \"{0}\"\ncdi_spec_dirs = [\"{0}\"]\nmetrics_addr = \"{addr}\"", run.display());
    let manifest = setup_cdi(&node, &top);
    std::fs::create_dir_all(&run).unwrap();
    let nvidia = run.join("nvidia.yaml");
    let yaml = format!(
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: {}\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n",
        uuid(0)
    );
    std::fs::write(&nvidia, yaml).unwrap();
    let (code, _, err) = devhost(&["check", "--config", manifest.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    let twice = format!(
        "CDI name {name0} is defined twice, by {}, {}",
        run.join("devhost-nvidia.com_gpu.json").display(),
        nvidia.display()
    );
    assert!(err.contains(&twice), "{err}");
    assert!(!err.contains(&format!("device {}:", uuid(1))), "the other GPUs resolve: {err}");

    let _kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&manifest, &node.kubelet_dir());
    d.wait_log(&twice, WAIT).await;
    let metric = format!("devhost_cdi_unresolvable_devices{{resource=\"{GPUS}\"}} 1");
    wait_metric(addr, &metric).await;
    // Each resource's series appears with its first CDI check, the MIG one's maybe a scrape later.
    wait_metric(addr, &format!("devhost_cdi_unresolvable_devices{{resource=\"{MIG}\"}} 0")).await;
    // Fixed on the node, then a reload: said, and counted.
    std::fs::remove_file(&nvidia).unwrap();
    // SAFETY: plain kill(2) on our own child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGHUP) };
    d.wait_log("every CDI name of the resource resolves again", WAIT).await;
    wait_metric(addr, &format!("devhost_cdi_unresolvable_devices{{resource=\"{GPUS}\"}} 0")).await;
}

async fn wait_metric(addr: std::net::SocketAddr, line: &str) -> String {
    let start = std::time::Instant::now();
    loop {
        let body = devhost::ops::metrics::get(addr, "/metrics", &[]).await.map(|r| r.body).unwrap_or_default();
        if body.contains(line) {
            return body;
        }
        assert!(start.elapsed() < WAIT, "{line} never shown:\n{body}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
