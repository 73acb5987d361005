//! The real `devhost` binary with the TPU driver against the kubelet emulator, on the simulated
//! v6e host checked in under `config/sim/tpu` (8 chips over 2 NUMA nodes, VFIO). Needs
//! `libdevhost_tpu.so` next to the binary (`cargo build -p devhost-tpu`).

use crate::common::*;
use std::path::{Path, PathBuf};

const RESOURCE: &str = "google.com/tpu";

const CHIPS: [&str; 8] = [
    "0000:00:04.0",
    "0000:00:05.0",
    "0000:00:06.0",
    "0000:00:07.0",
    "0000:80:04.0",
    "0000:80:05.0",
    "0000:80:06.0",
    "0000:80:07.0",
];

fn sim() -> PathBuf {
    repo_root().join("config/sim/tpu")
}

fn manifest(node: &Node, root: &Path, options: &str) -> PathBuf {
    node.write_manifest(&format!(
        r#"
[driver.tpu]
module = "{module}"
[driver.tpu.options]
sysfs_root = "{root}/sys"
devfs_root = "{root}/dev"
{options}

[[resource]]
name = "{RESOURCE}"
driver = "tpu"
"#,
        module = module("tpu").display(),
        root = root.display(),
    ))
}

/// Copies a tree, keeping symlinks as symlinks (the sysfs layout is made of them).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        let kind = entry.file_type().unwrap();
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(entry.path()).unwrap(), &target).unwrap();
        } else if kind.is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

fn ids(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_host_lists_eight_chips_and_allocates_them_together() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&manifest(&node, &sim(), ""), &node.kubelet_dir());
    let devs = kubelet.wait_devices(RESOURCE, WAIT, |d| d.len() == 8).await.unwrap();
    let listed: Vec<&str> = devs.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(listed, CHIPS);
    assert!(devs.iter().all(|d| d.health == "Healthy"));
    let numa: Vec<i64> = devs.iter().map(|d| d.topology.as_ref().unwrap().nodes[0].id).collect();
    assert_eq!(numa, [0, 0, 0, 0, 1, 1, 1, 1]);

    let resp = kubelet.allocate(RESOURCE, vec![ids(&CHIPS)]).await.unwrap();
    let container = &resp.container_responses[0];
    let mut nodes: Vec<&str> = container.devices.iter().map(|d| d.container_path.as_str()).collect();
    nodes.sort_unstable();
    assert_eq!(
        nodes,
        [
            "/dev/vfio/2",
            "/dev/vfio/3",
            "/dev/vfio/4",
            "/dev/vfio/5",
            "/dev/vfio/6",
            "/dev/vfio/7",
            "/dev/vfio/8",
            "/dev/vfio/9",
            "/dev/vfio/vfio"
        ]
    );
    let vfio = container.devices.iter().find(|d| d.container_path == "/dev/vfio/vfio").unwrap();
    assert_eq!(Path::new(&vfio.host_path), sim().join("dev/vfio/vfio"));
    assert_eq!(vfio.permissions, "rw");
    for (key, value) in [
        ("TPU_SKIP_MDS_QUERY", "true"),
        ("TPU_ACCELERATOR_TYPE", "v6e-8"),
        ("TPU_TOPOLOGY", "2x4"),
        ("TPU_CHIPS_PER_HOST_BOUNDS", "2,4,1"),
        ("TPU_HOST_BOUNDS", "1,1,1"),
        ("TPU_VISIBLE_CHIPS", "0,1,2,3,4,5,6,7"),
        ("TPU_WORKER_ID", "0"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
        ("TPU_RUNTIME_METRICS_PORTS", "8431,8432,8433,8434,8435,8436,8437,8438"),
    ] {
        assert_eq!(env_of(&resp, 0, key).as_deref(), Some(value), "{key}");
    }

    let err = kubelet.allocate(RESOURCE, vec![ids(&CHIPS[..4])]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("all 8 TPU chips"), "{}", err.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boxes_share_the_host_and_health_follows_the_device_nodes() {
    let node = Node::new();
    let root = node.path().join("sim");
    copy_tree(&sim(), &root);
    let options = "allocation = \"boxes\"\npoll_interval = \"100ms\"";
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&manifest(&node, &root, options), &node.kubelet_dir());
    kubelet.wait_devices(RESOURCE, WAIT, |d| d.len() == 8).await.unwrap();

    // With chip 0 in use, a pair comes from the same half, keeping chips 4-7 whole.
    let pair = kubelet.preferred_allocation(RESOURCE, ids(&CHIPS[1..]), vec![], 2).await.unwrap();
    assert_eq!(pair, ids(&CHIPS[2..4]));

    let resp = kubelet.allocate(RESOURCE, vec![ids(&CHIPS[2..4]), ids(&CHIPS[4..])]).await.unwrap();
    assert_eq!(env_of(&resp, 0, "TPU_VISIBLE_CHIPS").as_deref(), Some("2,3"));
    assert_eq!(env_of(&resp, 0, "TPU_CHIPS_PER_PROCESS_BOUNDS").as_deref(), Some("1,2,1"));
    assert_eq!(env_of(&resp, 0, "TPU_RUNTIME_METRICS_PORTS").as_deref(), Some("8433,8434"));
    assert_eq!(env_of(&resp, 1, "TPU_VISIBLE_CHIPS").as_deref(), Some("4,5,6,7"));
    assert_eq!(env_of(&resp, 1, "TPU_ACCELERATOR_TYPE").as_deref(), Some("v6e-4"));
    assert_eq!(env_of(&resp, 1, "TPU_RUNTIME_METRICS_PORTS").as_deref(), Some("8435,8436,8437,8438"));
    assert_ne!(env_of(&resp, 0, "TPU_PROCESS_PORT"), env_of(&resp, 1, "TPU_PROCESS_PORT"));

    let err = kubelet.allocate(RESOURCE, vec![ids(&CHIPS[1..3])]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("valid 2-chip boxes are chips 0-1, 2-3, 4-5, 6-7"), "{}", err.message());

    // Chip 3 (0000:00:07.0) is VFIO group 5.
    std::fs::remove_file(root.join("dev/vfio/5")).unwrap();
    let devs = kubelet
        .wait_devices(RESOURCE, WAIT, |d| d.iter().any(|x| x.id == CHIPS[3] && x.health == "Unhealthy"))
        .await
        .unwrap();
    assert_eq!(devs.iter().filter(|d| d.health == "Healthy").count(), 7);
    std::fs::write(root.join("dev/vfio/5"), b"").unwrap();
    kubelet.wait_devices(RESOURCE, WAIT, |d| d.iter().all(|x| x.health == "Healthy")).await.unwrap();
}
