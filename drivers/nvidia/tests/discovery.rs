//! Discovery, topology and container edits through the real nvml-wrapper
//! path, against the fake libnvidia-ml.

mod common;

use common::*;
use devhost_sdk::Health;
use std::os::unix::fs::symlink;

const BUSES: [&str; 8] = [
    "0000:18:00.0",
    "0000:2a:00.0",
    "0000:3a:00.0",
    "0000:5d:00.0",
    "0000:9a:00.0",
    "0000:ab:00.0",
    "0000:ba:00.0",
    "0000:db:00.0",
];
/// NVLink partners, 4 links each. Deliberately not the PCIe switch pairs
/// (0-1, 2-3, ...), so NVLink must win over a shared switch.
const NVLINK_PAIRS: [(usize, usize); 4] = [(0, 3), (1, 2), (4, 7), (5, 6)];

fn eight_gpus() -> (Vec<GpuSpec>, String) {
    let mut gpus: Vec<GpuSpec> = (0..8).map(|i| gpu(i, BUSES[i], if i < 4 { 0 } else { 1 })).collect();
    for (a, b) in NVLINK_PAIRS {
        for (me, peer) in [(a, b), (b, a)] {
            let remote = format!("\"0000{}\"", BUSES[peer].to_uppercase());
            gpus[me].extra = format!("nvlinks = [{}]", vec![remote; 4].join(", "));
        }
    }
    let mut topology = Vec::new();
    for a in 0..8 {
        for b in (a + 1)..8 {
            if a / 2 == b / 2 {
                topology.push((a, b, "single"));
            } else if a / 4 == b / 4 {
                topology.push((a, b, "node"));
            }
        }
    }
    let machine = machine_toml("", &gpus, &topology);
    (gpus, machine)
}

fn score(node: &devhost_nvidia::node::Node, a: usize, b: usize) -> u32 {
    let (dev, _) = node.devices().find(|(d, _)| d.id == gpu_uuid(a)).expect("device a");
    dev.links.iter().find(|(o, _)| *o == gpu_uuid(b)).map(|(_, s)| *s).expect("link a→b")
}

#[test]
fn eight_gpu_machine_reports_every_gpu_with_its_attributes() {
    let (gpus, machine) = eight_gpus();
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[]);
    let devices = snapshot(&node);
    assert_eq!(devices.len(), 8);
    for (i, (d, health)) in devices.iter().enumerate() {
        assert_eq!(d.id, gpu_uuid(i));
        assert_eq!(*health, Health::Healthy);
        assert_eq!(attr(d, "kind"), Some("gpu"));
        assert_eq!(attr(d, "vendor"), Some("nvidia"));
        assert_eq!(attr(d, "model"), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(attr(d, "memory"), Some("81559"));
        assert_eq!(attr(d, "compute_capability"), Some("9.0"));
        // NVML says 00000000:18:00.0; attributes and sysfs use 0000:18:00.0.
        assert_eq!(attr(d, "pci_address"), Some(BUSES[i]));
        assert_eq!(attr(d, "minor"), Some(i.to_string().as_str()));
        assert_eq!(attr(d, "index"), Some(i.to_string().as_str()));
        assert_eq!(attr(d, "uuid"), Some(gpu_uuid(i).as_str()));
        assert_eq!(attr(d, "driver_version"), Some("550.54.15"));
        assert_eq!(attr(d, "cuda_version"), Some("12.4"));
        let numa = if i < 4 { 0 } else { 1 };
        assert_eq!(attr(d, "numa_node"), Some(numa.to_string().as_str()));
        assert_eq!(d.numa_node, Some(numa));
        assert_eq!(d.edits.env, vec![("NVIDIA_VISIBLE_DEVICES".to_string(), gpu_uuid(i))]);
        assert!(d.edits.device_nodes.is_empty() && d.edits.mounts.is_empty() && d.edits.cdi.is_empty());
    }
}

#[test]
fn nvlink_pairs_score_above_every_pcie_path() {
    let (gpus, machine) = eight_gpus();
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[]);
    assert_eq!(score(&node, 0, 3), 4 * 100 + 20, "4 NVLinks + same NUMA node");
    assert_eq!(score(&node, 0, 1), 50, "one PCIe switch");
    assert_eq!(score(&node, 0, 2), 20, "same NUMA node");
    assert_eq!(score(&node, 0, 4), 10, "across the system");
    for a in 0..8 {
        let best = (0..8).filter(|&b| b != a).max_by_key(|&b| score(&node, a, b)).unwrap();
        let partner = NVLINK_PAIRS.iter().find_map(|&(x, y)| (x == a).then_some(y).or((y == a).then_some(x)));
        assert_eq!(Some(best), partner, "GPU {a}'s best partner");
        for b in 0..8 {
            if a != b {
                assert_eq!(score(&node, a, b), score(&node, b, a), "scores are symmetric");
            }
        }
    }
    let (d, _) = node.devices().next().unwrap();
    assert_eq!(d.links.len(), 7, "a link to every other GPU");
}

fn mig_machine() -> (Vec<GpuSpec>, String) {
    let mut gpus = vec![gpu(0, "0000:18:00.0", 0), gpu(1, "0000:2a:00.0", 1)];
    gpus[1].extra = "mig_mode = true".into();
    // Slot 1 is empty: NVML answers NotFound there.
    gpus[1].migs = vec![
        (0, mig_uuid(1, 0), "1g.10gb".into(), 9856),
        (2, mig_uuid(1, 2), "1g.10gb".into(), 9856),
        (5, mig_uuid(1, 5), "3g.40gb".into(), 40448),
    ];
    let machine = machine_toml("", &gpus, &[]);
    (gpus, machine)
}

#[test]
fn mig_devices_are_listed_and_their_parent_is_not() {
    let (gpus, machine) = mig_machine();
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[]);
    let ids: Vec<String> = node.devices().map(|(d, _)| d.id.clone()).collect();
    assert_eq!(ids, vec![gpu_uuid(0), mig_uuid(1, 0), mig_uuid(1, 2), mig_uuid(1, 5)]);
    let (mig, health) = node.devices().find(|(d, _)| d.id == mig_uuid(1, 5)).unwrap();
    assert_eq!(health, Health::Healthy);
    assert_eq!(attr(mig, "kind"), Some("mig"));
    assert_eq!(attr(mig, "mig_profile"), Some("3g.40gb"));
    assert_eq!(attr(mig, "parent_uuid"), Some(gpu_uuid(1).as_str()));
    assert_eq!(attr(mig, "parent_index"), Some("1"));
    assert_eq!(attr(mig, "index"), Some("1:5"));
    assert_eq!(attr(mig, "memory"), Some("40448"));
    assert_eq!(attr(mig, "model"), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(attr(mig, "pci_address"), Some("0000:2a:00.0"));
    assert_eq!(mig.numa_node, Some(1));
    assert!(mig.links.is_empty(), "MIG devices carry no links");
    assert_eq!(mig.edits.env, vec![("NVIDIA_VISIBLE_DEVICES".to_string(), mig_uuid(1, 5))]);
    let (whole, _) = node.devices().next().unwrap();
    assert!(whole.links.is_empty(), "the only other whole GPU is in MIG mode");
}

#[test]
fn index_strategy_names_gpus_and_mig_devices_by_index() {
    let (gpus, machine) = mig_machine();
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("device_id_strategy", "index"), ("device_list_strategy", "envvar,cdi")]);
    let devices = snapshot(&node);
    let (mig, _) = &devices[2];
    assert_eq!(mig.id, mig_uuid(1, 2), "the kubelet still sees UUIDs");
    assert_eq!(mig.edits.env, vec![("NVIDIA_VISIBLE_DEVICES".to_string(), "1:2".to_string())]);
    assert_eq!(mig.edits.cdi, vec!["nvidia.com/gpu=1:2".to_string()]);
    assert_eq!(devices[0].0.edits.cdi, vec!["nvidia.com/gpu=0".to_string()]);
}

#[test]
fn cdi_strategy_names_the_uuid_and_describes_the_gpu_for_devhosts_spec() {
    let (gpus, machine) = mig_machine();
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[("device_list_strategy", "cdi")]);
    let (d, _) = node.devices().next().unwrap();
    assert_eq!(d.edits.cdi, vec![format!("nvidia.com/gpu={}", gpu_uuid(0))]);
    assert!(d.edits.env.is_empty());
    // The nodes the name stands for, which devhost writes into its spec under that name (a
    // name without them would resolve only where nvidia-ctk wrote a spec).
    let dev = fx.path("dev");
    let nodes: Vec<&str> = d.edits.device_nodes.iter().map(|(_, c, _)| c.as_str()).collect();
    assert!(nodes.contains(&"/dev/nvidia0") && nodes.contains(&"/dev/nvidiactl"), "{nodes:?}");
    assert!(d.edits.device_nodes.iter().all(|(h, _, _)| h.starts_with(&*dev.to_string_lossy())));
}

#[test]
fn device_nodes_strategy_mounts_the_driver_from_driver_root() {
    let (gpus, machine) = mig_machine();
    let fx = Fixture::new(&gpus, &machine);
    // A driver root as a driver container lays it out, with absolute links.
    let root = fx.path("driver");
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    let bin = root.join("usr/bin");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(lib.join("libcuda.so.550.54.15"), "").unwrap();
    symlink("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", lib.join("libcuda.so.1")).unwrap();
    std::fs::write(lib.join("libnvidia-ml.so.550.54.15"), "").unwrap();
    symlink("libnvidia-ml.so.550.54.15", lib.join("libnvidia-ml.so.1")).unwrap();
    std::fs::write(lib.join("libnvidia-ptxjitcompiler.so.550.54.15"), "").unwrap();
    std::fs::write(lib.join("libc.so.6"), "").unwrap();
    std::fs::write(bin.join("nvidia-smi"), "").unwrap();
    std::fs::write(bin.join("bash"), "").unwrap();
    let root_text = root.to_string_lossy().into_owned();
    let node = fx.open(&[("device_list_strategy", "device-nodes"), ("driver_root", &root_text)]);

    let (mig, _) = node.devices().find(|(d, _)| d.id == mig_uuid(1, 0)).unwrap();
    let dev = fx.path("dev");
    let node_pairs: Vec<(String, String)> = mig
        .edits
        .device_nodes
        .iter()
        .map(|(h, c, p)| {
            assert_eq!(p, "rw");
            (h.clone(), c.clone())
        })
        .collect();
    let expect_node = |n: &str| (dev.join(n).to_string_lossy().into_owned(), format!("/dev/{n}"));
    // nvidia-modeset is absent from the generated devfs, so it is left out.
    assert_eq!(
        node_pairs,
        vec![
            expect_node("nvidiactl"),
            expect_node("nvidia-uvm"),
            expect_node("nvidia-uvm-tools"),
            expect_node("nvidia1")
        ],
        "control nodes plus the parent GPU's node"
    );
    let real_cuda = lib.join("libcuda.so.550.54.15").to_string_lossy().into_owned();
    let real_ml = lib.join("libnvidia-ml.so.550.54.15").to_string_lossy().into_owned();
    let real_jit = lib.join("libnvidia-ptxjitcompiler.so.550.54.15").to_string_lossy().into_owned();
    let real_smi = bin.join("nvidia-smi").to_string_lossy().into_owned();
    let mut mounts = mig.edits.mounts.clone();
    mounts.sort();
    // Each library in every folder the loader searches without a variable, plus the one CUDA
    // images name themselves; each tool in /usr/bin and /usr/local/nvidia/bin.
    let multiarch = format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH);
    let lib_dirs = ["/usr/local/nvidia/lib64", multiarch.as_str(), "/usr/lib64"];
    let mut expected = Vec::new();
    for (real, name) in [
        (&real_cuda, "libcuda.so.1"),
        (&real_cuda, "libcuda.so.550.54.15"),
        (&real_ml, "libnvidia-ml.so.1"),
        (&real_ml, "libnvidia-ml.so.550.54.15"),
        (&real_jit, "libnvidia-ptxjitcompiler.so.550.54.15"),
    ] {
        expected.extend(lib_dirs.iter().map(|d| (real.clone(), format!("{d}/{name}"), true)));
    }
    for d in ["/usr/local/nvidia/bin", "/usr/bin"] {
        expected.push((real_smi.clone(), format!("{d}/nvidia-smi"), true));
    }
    expected.sort();
    assert_eq!(mounts, expected, "driver libraries and tools, read-only, links resolved inside driver_root");
    // The image's own PATH and LD_LIBRARY_PATH are left alone.
    assert_eq!(mig.edits.env, Vec::<(String, String)>::new());
}

/// The log lines of this process that name `needle` (tests run in parallel and share the log).
fn lines_naming(needle: &str) -> Vec<String> {
    logs().into_iter().filter(|l| l.contains(needle)).collect()
}

#[test]
fn missing_nvml_on_a_gpu_node_is_an_error_naming_the_gpus() {
    capture_logs();
    let (gpus, machine) = mig_machine();
    let fx = Fixture::new(&gpus, &machine);
    let missing = fx.path("nowhere/libnvidia-ml.so.1").to_string_lossy().into_owned();
    let node = fx.open(&[("nvml_lib", &missing)]);
    assert_eq!(node.devices().count(), 0);
    node.watch_start();
    node.watch_stop();
    let lines = lines_naming(&missing);
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = &lines[0];
    assert!(line.starts_with("ERROR") && line.contains("cannot use NVML"), "{line}");
    assert!(line.contains(&gpus[0].bus) && line.contains("Is the NVIDIA driver installed"), "{line}");
}

#[test]
fn missing_nvml_on_a_node_without_nvidia_gpus_is_one_info_line() {
    capture_logs();
    let fx = Fixture::new(&[], &machine_toml("", &[], &[]));
    let missing = fx.path("nowhere/libnvidia-ml.so.1").to_string_lossy().into_owned();
    let node = fx.open(&[("nvml_lib", &missing)]);
    assert_eq!(node.devices().count(), 0);
    node.watch_start();
    node.watch_stop();
    let lines = lines_naming(&missing);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("INFO no NVIDIA GPU on this node"), "{}", lines[0]);
    assert!(lines[0].contains("its resources stay empty"), "{}", lines[0]);
}

#[test]
fn nvml_that_fails_to_init_on_a_gpu_node_is_an_error() {
    capture_logs();
    let (gpus, _) = mig_machine();
    let machine = machine_toml("init_error = 9", &gpus, &[]);
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[]);
    assert_eq!(node.devices().count(), 0);
    let lines = lines_naming(&fx.lib.to_string_lossy());
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("ERROR") && lines[0].contains("cannot use NVML"), "{}", lines[0]);
}

#[test]
fn an_installed_nvml_without_its_kernel_driver_on_a_node_without_gpus_is_info() {
    capture_logs();
    // NVML_ERROR_DRIVER_NOT_LOADED: an image that ships libnvidia-ml, on a node with no GPU.
    let fx = Fixture::new(&[], &machine_toml("init_error = 9", &[], &[]));
    let node = fx.open(&[]);
    assert_eq!(node.devices().count(), 0);
    let lines = lines_naming(&fx.lib.to_string_lossy());
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("INFO no NVIDIA GPU on this node"), "{}", lines[0]);
}

#[test]
fn a_pci_bus_that_cannot_be_read_keeps_a_missing_nvml_an_error() {
    capture_logs();
    let fx = Fixture::new(&[], &machine_toml("", &[], &[]));
    let missing = fx.path("nowhere/libnvidia-ml.so.1").to_string_lossy().into_owned();
    let not_sysfs = fx.path("no-such-sysfs").to_string_lossy().into_owned();
    fx.open(&[("nvml_lib", &missing), ("sysfs_root", &not_sysfs)]);
    let lines = lines_naming(&missing);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("ERROR") && lines[0].contains(&not_sysfs), "{}", lines[0]);
}

#[test]
fn a_gpu_lost_before_discovery_is_left_out_with_an_error() {
    capture_logs();
    let mut gpus = vec![gpu(0, "0000:18:00.0", 0), gpu(1, "0000:2a:00.0", 0)];
    gpus[1].extra = "lost = true".into();
    let machine = machine_toml("", &gpus, &[]);
    let fx = Fixture::new(&gpus, &machine);
    let node = fx.open(&[]);
    // Lost GPUs refuse even a handle by index, so NVML cannot name it: only GPU 0 remains.
    let ids: Vec<String> = node.devices().map(|(d, _)| d.id.clone()).collect();
    assert_eq!(ids, vec![gpu_uuid(0)]);
    let lines = logs();
    assert!(
        lines.iter().any(|l| l.starts_with("ERROR") && l.contains("GPU index 1") && l.contains("fell off the bus")),
        "{lines:?}"
    );
}
