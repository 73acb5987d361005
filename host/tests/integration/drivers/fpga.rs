//! The FPGA driver module in the real `devhost` binary against the kubelet
//! emulator, over a copy of the simulated node in `config/sim/fpga` (an Intel
//! DFL card with two accelerator ports and an AMD Alveo U250).

use crate::common::*;
use std::fs;
use std::path::Path;

const NLB0: &str = "example.com/fpga-nlb0";
const NLB3: &str = "example.com/fpga-nlb3";
const U250: &str = "example.com/alveo-u250";
const PORT1: &str = "sys/devices/pci0000:00/0000:5d:00.0/0000:5e:00.0/fpga_region/region0/dfl-port.1";

/// Copies a tree, keeping symlinks as symlinks (the class and bus entries).
fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (src, dst) = (e.path(), to.join(e.file_name()));
        let ty = e.file_type().unwrap();
        if ty.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(&src).unwrap(), &dst).unwrap();
        } else if ty.is_dir() {
            copy_tree(&src, &dst);
        } else {
            fs::copy(&src, &dst).unwrap();
        }
    }
}

/// A node holding a private copy of the simulated FPGA tree and a manifest
/// with the three resources of `config/fpga.toml` plus `extra`.
fn fpga_node(mode: &str, extra: &str) -> Node {
    fpga_node_with(mode, "poll_interval = \"100ms\"\nudev = false", extra)
}

/// Like [`fpga_node`] with other driver options than the fast test poll.
fn fpga_node_with(mode: &str, options: &str, extra: &str) -> Node {
    let node = Node::new();
    copy_tree(&repo_root().join("config/sim/fpga"), &node.path().join("fpga"));
    let sim = node.path().join("fpga");
    node.write_manifest(&format!(
        r#"
[driver.fpga]
module = "{module}"
[driver.fpga.options]
mode = "{mode}"
sysfs_root = "{sys}"
devfs_root = "{dev}"
{options}

[[resource]]
name = "{NLB0}"
driver = "fpga"
match = {{ afu_id = "d8424dc4a4a3c413f89e433683f9040b" }}

[[resource]]
name = "{NLB3}"
driver = "fpga"
match = {{ afu_id = "f7df405cbd7acf7222f144b0b93acd18" }}

[[resource]]
name = "{U250}"
driver = "fpga"
match = {{ driver = "xrt", model = "u250" }}
{extra}
"#,
        module = module("fpga").display(),
        sys = sim.join("sys").display(),
        dev = sim.join("dev").display(),
    ));
    node
}

fn start(node: &Node) -> (Kubelet, Daemon) {
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let daemon = Daemon::start(&node.path().join("devhost.toml"), &node.kubelet_dir());
    (kubelet, daemon)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ports_and_alveo_cards_are_advertised_per_accelerator_function() {
    let node = fpga_node("port", "");
    let (kubelet, _d) = start(&node);
    for (res, id) in [(NLB0, "dfl-port.0"), (NLB3, "dfl-port.1"), (U250, "0000:3b:00.1")] {
        let devs = kubelet.wait_devices(res, WAIT, |d| d.len() == 1).await.unwrap();
        assert_eq!(devs[0].id, id);
        assert_eq!(devs[0].health, "Healthy");
        assert_eq!(devs[0].topology.as_ref().unwrap().nodes[0].id, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_hands_out_the_port_node_or_the_alveo_nodes() {
    let node = fpga_node("port", "");
    let (kubelet, _d) = start(&node);
    kubelet.wait_devices(U250, WAIT, |d| d.len() == 1).await.unwrap();
    // Each resource registers on its own: wait for the one allocated from, too.
    kubelet.wait_devices(NLB0, WAIT, |d| d.len() == 1).await.unwrap();
    let resp = kubelet.allocate(NLB0, vec![vec!["dfl-port.0".into()]]).await.unwrap();
    let specs = &resp.container_responses[0].devices;
    assert_eq!(specs.len(), 1);
    assert_eq!(specs[0].container_path, "/dev/dfl-port.0");
    assert_eq!(Path::new(&specs[0].host_path), node.path().join("fpga/dev/dfl-port.0"));
    assert_eq!(specs[0].permissions, "rw");
    let resp = kubelet.allocate(U250, vec![vec!["0000:3b:00.1".into()]]).await.unwrap();
    let paths: Vec<&str> = resp.container_responses[0].devices.iter().map(|d| d.container_path.as_str()).collect();
    assert_eq!(paths, ["/dev/dri/renderD128", "/dev/xclmgmt15104"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_devel_mode_gives_the_whole_fpga_with_its_fme() {
    let region = "example.com/fpga-region";
    let extra = format!(
        "[[resource]]\nname = \"{region}\"\ndriver = \"fpga\"\nmatch = {{ interface_id = \"ce48969398f05f33946d560708be108a\" }}\n"
    );
    let node = fpga_node("region-devel", &extra);
    let (kubelet, _d) = start(&node);
    let devs = kubelet.wait_devices(region, WAIT, |d| d.len() == 1).await.unwrap();
    assert_eq!(devs[0].id, "dfl-fme.0");
    // A region lists both ports' AFU IDs, so single-function globs skip it.
    assert!(kubelet.wait_devices(NLB0, WAIT, |_| true).await.unwrap().is_empty());
    let resp = kubelet.allocate(region, vec![vec!["dfl-fme.0".into()]]).await.unwrap();
    let paths: Vec<&str> = resp.container_responses[0].devices.iter().map(|d| d.container_path.as_str()).collect();
    assert_eq!(paths, ["/dev/dfl-port.0", "/dev/dfl-port.1", "/dev/dfl-fme.0"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_register_turns_the_port_unhealthy_and_back() {
    let node = fpga_node("port", "");
    let (kubelet, _d) = start(&node);
    kubelet.wait_devices(NLB3, WAIT, |d| d.len() == 1 && d[0].health == "Healthy").await.unwrap();
    let errors = node.path().join("fpga").join(PORT1).join("errors/errors");
    fs::write(&errors, "0x4\n").unwrap();
    kubelet.wait_devices(NLB3, WAIT, |d| d.len() == 1 && d[0].health == "Unhealthy").await.unwrap();
    let nlb0 = kubelet.devices(NLB0).unwrap();
    assert_eq!(nlb0[0].health, "Healthy", "the sibling port is unaffected");
    fs::write(&errors, "0x0\n").unwrap();
    kubelet.wait_devices(NLB3, WAIT, |d| d.len() == 1 && d[0].health == "Healthy").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_port_disappears_from_its_resource() {
    let node = fpga_node("port", "");
    let (kubelet, d) = start(&node);
    kubelet.wait_devices(NLB3, WAIT, |d| d.len() == 1).await.unwrap();
    fs::remove_dir_all(node.path().join("fpga").join(PORT1)).unwrap();
    kubelet.wait_devices(NLB3, WAIT, |d| d.is_empty()).await.unwrap();
    d.wait_log("2 FPGA card(s), 2 device(s) in port mode", WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_default_poll_a_port_error_shows_within_about_a_second() {
    // No poll_interval: the driver's default. udev off: errors raise no uevent anyway.
    let node = fpga_node_with("port", "udev = false", "");
    let (kubelet, _d) = start(&node);
    kubelet.wait_devices(NLB3, WAIT, |d| d.len() == 1 && d[0].health == "Healthy").await.unwrap();
    let errors = node.path().join("fpga").join(PORT1).join("errors/errors");
    // Four changes, so a lucky moment right before a slower poll cannot pass the test.
    for (value, health) in [("0x4", "Unhealthy"), ("0x0", "Healthy"), ("0x1", "Unhealthy"), ("0x0", "Healthy")] {
        let written = std::time::Instant::now();
        fs::write(&errors, format!("{value}\n")).unwrap();
        kubelet.wait_devices(NLB3, WAIT, |d| d.len() == 1 && d[0].health == health).await.unwrap();
        let took = written.elapsed();
        // One poll (1 s) plus a scan and the host's hand-off, with room for a loaded machine.
        assert!(took < std::time::Duration::from_millis(2200), "errors = {value}: {health} after {took:?}");
    }
}
