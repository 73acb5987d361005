//! One manifest for the whole fleet: the manifest of deploy/configmap.yaml (NVIDIA, FPGA and TPU
//! drivers) runs the real daemon on nodes that have none of that hardware, the way the same
//! ConfigMap reaches every node of a cluster. Each bundled hardware driver says so in one INFO
//! line and nothing at WARN or ERROR (log-based alerting pages on those), every resource is
//! registered with the kubelet with no devices, `/readyz` answers 200, and no alert of
//! docs/prometheus-rules.yaml fires on the series the daemon exports (promtool, when installed).
//! The example drivers are left out: they always have devices.

use crate::common::promtool::{alert_names, input_series, promtool, run_promtool};
use crate::common::*;
use devhost::ops::metrics;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

/// The drivers of the ConfigMap and the words of their "no hardware here" INFO line.
const QUIET: [(&str, &str); 3] = [
    ("nvidia", "no NVIDIA GPU on this node"),
    ("fpga", "no FPGA card on this node"),
    ("tpu", "no TPU chip on this node"),
];

/// The ConfigMap's manifest pointed at this node: this build's modules, the test's sysfs and devfs,
/// an NVML library that is not there (no NVIDIA container runtime injected one), and a metrics port.
fn fleet_manifest(node: &Node, addr: SocketAddr) -> std::path::PathBuf {
    let mut m: toml::Table = configmap_manifest().parse().expect("the ConfigMap's manifest is TOML");
    let built = module("nvidia").parent().unwrap().display().to_string();
    let root = node.path();
    m.insert("driver_dir".into(), built.into());
    m.insert("metrics_addr".into(), addr.to_string().into());
    m.insert("cdi_dir".into(), root.join("cdi").display().to_string().into());
    m.insert("pod_resources_socket".into(), pod_resources_socket(node).display().to_string().into());
    m.insert("state_dir".into(), root.join("state").display().to_string().into());
    m.insert("lock_dir".into(), root.join("lock").display().to_string().into());
    let drivers = m.get_mut("driver").and_then(toml::Value::as_table_mut).expect("[driver.*] tables");
    assert_eq!(drivers.keys().collect::<Vec<_>>(), ["fpga", "nvidia", "tpu"], "the ConfigMap's drivers changed");
    for (name, driver) in drivers.iter_mut() {
        let table = driver.as_table_mut().unwrap();
        let options = table.entry("options").or_insert(toml::Table::new().into()).as_table_mut().unwrap();
        options.insert("sysfs_root".into(), root.join("sys").display().to_string().into());
        options.insert("devfs_root".into(), root.join("dev").display().to_string().into());
        if name == "nvidia" {
            let nowhere = root.join("no-nvidia-runtime/libnvidia-ml.so.1");
            options.insert("nvml_lib".into(), nowhere.display().to_string().into());
        }
    }
    std::fs::create_dir_all(root.join("dev")).unwrap();
    std::fs::create_dir_all(root.join("cdi")).unwrap();
    node.write_manifest(&m.to_string())
}

/// Where the kubelet's PodResources service listens on this node (a real node has one).
fn pod_resources_socket(node: &Node) -> std::path::PathBuf {
    node.path().join("pod-resources/kubelet.sock")
}

/// The resources of the manifest.
fn resources(manifest: &Path) -> Vec<String> {
    let m: toml::Table = std::fs::read_to_string(manifest).unwrap().parse().unwrap();
    let list = m["resource"].as_array().unwrap();
    list.iter().map(|r| r["name"].as_str().unwrap().to_string()).collect()
}

/// A plain PCI function under `sys/devices/pci0000:00`, linked from `sys/bus/pci/devices`.
fn pci_function(sys: &Path, address: &str, vendor: &str, class: &str) {
    let real = sys.join("devices/pci0000:00").join(address);
    std::fs::create_dir_all(&real).unwrap();
    for (file, value) in [("vendor", vendor), ("device", "0x1234"), ("class", class), ("numa_node", "-1")] {
        std::fs::write(real.join(file), format!("{value}\n")).unwrap();
    }
    std::fs::create_dir_all(sys.join("bus/pci/devices")).unwrap();
    std::os::unix::fs::symlink(
        format!("../../../devices/pci0000:00/{address}"),
        sys.join("bus/pci/devices").join(address),
    )
    .unwrap();
}

/// The level of a text log line (`<time> LEVEL target: message …`).
fn level(line: &str) -> &str {
    line.split_whitespace().nth(1).unwrap_or("")
}

/// Starts the fleet manifest on a node whose sysfs `make_sys` lays out and checks that it is quiet.
async fn quiet_on(make_sys: impl FnOnce(&Path)) {
    let node = Node::new();
    let sys = node.path().join("sys");
    std::fs::create_dir_all(&sys).unwrap();
    make_sys(&sys);
    let addr = free_port();
    let manifest = fleet_manifest(&node, addr);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _pods = kubelet_emu::PodResourcesServer::start(&pod_resources_socket(&node)).unwrap();
    let d = Daemon::start(&manifest, &node.kubelet_dir());

    // Registered, with no devices: the scheduler sees a capacity of 0, not an unknown resource.
    let names = resources(&manifest);
    assert!(names.len() >= 4, "{names:?}");
    for name in &names {
        kubelet.wait_devices(name, WAIT, <[_]>::is_empty).await.unwrap();
    }
    let ready = wait_ready(addr).await;
    assert_eq!(ready.status, 200, "/readyz: {}", ready.body);
    let first = metrics::get(addr, "/metrics", &[]).await.unwrap().body;
    // A few of the watch threads' rounds later: nothing more to say.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = metrics::get(addr, "/metrics", &[]).await.unwrap().body;

    let log = d.logs();
    let loud: Vec<&str> = log.lines().filter(|l| matches!(level(l), "WARN" | "ERROR")).collect();
    assert!(loud.is_empty(), "WARN or ERROR on a node without the hardware:\n{}\n--- log ---\n{log}", loud.join("\n"));
    for (driver, words) in QUIET {
        let said: Vec<&str> = log.lines().filter(|l| l.contains(words)).collect();
        assert_eq!(said.len(), 1, "driver {driver}: one line {words:?}; log:\n{log}");
        assert_eq!(level(said[0]), "INFO", "{}", said[0]);
        assert!(said[0].contains(&format!("driver=\"{driver}\"")), "{}", said[0]);
    }
    for name in &names {
        let registered = format!("devhost_resource_registered{{resource=\"{name}\"}} 1");
        assert!(later.lines().any(|l| l == registered), "no {registered:?} in\n{later}");
    }
    no_alert_fires(node.path(), &first, &later);
}

/// Polls `/readyz` until it answers 200 or the wait is over; returns the last answer.
async fn wait_ready(addr: SocketAddr) -> metrics::Reply {
    let start = Instant::now();
    loop {
        let reply = metrics::get(addr, "/readyz", &[]).await;
        match reply {
            Ok(r) if r.status == 200 || start.elapsed() > WAIT => return r,
            Err(e) if start.elapsed() > WAIT => panic!("/readyz: {e}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// `promtool test rules`: on these series, held for 20 minutes, no documented alert fires.
fn no_alert_fires(dir: &Path, first: &str, later: &str) {
    let Some(tool) = promtool() else { return };
    let rules = repo_root().join("docs/prometheus-rules.yaml");
    let rules_text = std::fs::read_to_string(&rules).unwrap();
    let names = alert_names(&rules_text);
    assert!(!names.is_empty());
    let mut checks = String::new();
    for eval in ["7m", "12m", "20m"] {
        for name in &names {
            checks.push_str(&format!("      - eval_time: {eval}\n        alertname: {name}\n        exp_alerts: []\n"));
        }
    }
    let tests = format!(
        "rule_files:\n  - {rules}\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n{series}    alert_rule_test:\n{checks}",
        rules = rules.display(),
        series = input_series(first, later),
    );
    let file = dir.join("quiet-alerts-test.yaml");
    std::fs::write(&file, &tests).unwrap();
    let (ok, out) = run_promtool(&tool, &["test", "rules", file.to_str().unwrap()], "");
    assert!(ok, "an alert fires on a node without the hardware:\n{out}\n--- test file ---\n{tests}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_sysfs_is_a_node_without_the_hardware() {
    quiet_on(|_| {}).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pci_bus_of_other_devices_is_a_node_without_the_hardware() {
    quiet_on(|sys| {
        // A NIC, an NVMe disk, and an NVIDIA function that is no GPU (class 0x0403, HD audio):
        // NVIDIA's vendor ID alone does not make a GPU.
        pci_function(sys, "0000:00:03.0", "0x8086", "0x020000");
        pci_function(sys, "0000:00:04.0", "0x144d", "0x010802");
        pci_function(sys, "0000:00:05.0", "0x10de", "0x040300");
    })
    .await;
}
