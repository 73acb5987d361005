//! Test fixtures: a private copy of the fake libnvidia-ml with a machine file
//! beside it, a sysfs tree with the GPUs' PCI functions and NUMA nodes, a devfs tree, and a log
//! capture. Each test gets its own copy of the library, so tests run in
//! parallel without sharing the fake's state.

#![allow(dead_code)]

use devhost_nvidia::config::Config;
use devhost_nvidia::health::Notify;
use devhost_nvidia::node::{Device, Node};
use devhost_sdk::{Health, Options};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const FAKE: &str = "libfake_nvml.so";

/// The fake library in the target dir: the test's own profile first, then
/// the other. Built with `cargo build -p fake-nvml` when missing, because
/// `cargo test` does not build cdylibs.
pub fn fake_library() -> PathBuf {
    static FOUND: OnceLock<PathBuf> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("test executable path");
            // target/<profile>/deps/<test> → target/<profile>
            let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile> folder");
            let target = profile_dir.parent().expect("target folder");
            let candidates =
                [profile_dir.join(FAKE), target.join("debug").join(FAKE), target.join("release").join(FAKE)];
            if let Some(found) = candidates.iter().find(|p| p.is_file()) {
                return found.clone();
            }
            let status = std::process::Command::new(env!("CARGO"))
                .args(["build", "-p", "fake-nvml"])
                .status()
                .expect("run cargo build -p fake-nvml");
            assert!(status.success(), "cargo build -p fake-nvml failed");
            candidates.into_iter().find(|p| p.is_file()).unwrap_or_else(|| {
                panic!("{FAKE} not found under {}: run `cargo build --workspace` first", target.display())
            })
        })
        .clone()
}

/// A GPU of a generated machine.
pub struct GpuSpec {
    pub uuid: String,
    pub bus: String,
    pub numa: i32,
    /// Extra TOML lines for this `[[gpu]]` table (nvlinks, mig_mode, ...).
    pub extra: String,
    /// `[[gpu.mig_device]]` tables.
    pub migs: Vec<(u32, String, String, u64)>,
}

pub fn gpu_uuid(i: usize) -> String {
    format!("GPU-{:08x}-1111-4222-8333-{:012x}", 0xabc0_0000u32 + i as u32, i)
}

pub fn mig_uuid(gpu: usize, slot: u32) -> String {
    format!("MIG-{:08x}-2222-4333-8444-{:012x}", 0xdef0_0000u32 + gpu as u32, slot)
}

pub fn gpu(i: usize, bus: &str, numa: i32) -> GpuSpec {
    GpuSpec { uuid: gpu_uuid(i), bus: bus.to_string(), numa, extra: String::new(), migs: Vec::new() }
}

/// Renders a machine file.
pub fn machine_toml(header: &str, gpus: &[GpuSpec], topology: &[(usize, usize, &str)]) -> String {
    let mut t = format!("control = \"control\"\ntopology_default = \"system\"\n{header}\n");
    for (i, g) in gpus.iter().enumerate() {
        // NVML spells bus IDs with an 8-digit domain in upper case.
        let nvml_bus = format!("0000{}", g.bus.to_uppercase());
        t += &format!(
            "[[gpu]]\nuuid = \"{}\"\nname = \"NVIDIA H100 80GB HBM3\"\nmemory_mib = 81559\npci_bus_id = \"{nvml_bus}\"\nminor = {i}\n{}\n",
            g.uuid, g.extra
        );
        for (slot, uuid, profile, mib) in &g.migs {
            t += &format!(
                "[[gpu.mig_device]]\nslot = {slot}\nuuid = \"{uuid}\"\nprofile = \"{profile}\"\nmemory_mib = {mib}\n"
            );
        }
    }
    for (a, b, level) in topology {
        t += &format!("[[topology]]\ngpus = [{a}, {b}]\nlevel = \"{level}\"\n");
    }
    t
}

/// A node's trees and its private fake NVML.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub lib: PathBuf,
    pub changes: Arc<AtomicUsize>,
}

impl Fixture {
    pub fn new(gpus: &[GpuSpec], machine: &str) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let libdir = dir.path().join("lib");
        std::fs::create_dir_all(&libdir).unwrap();
        let lib = libdir.join("libnvidia-ml.so.1");
        std::fs::copy(fake_library(), &lib).unwrap();
        std::fs::write(libdir.join("fake-nvml.toml"), machine).unwrap();
        std::fs::write(libdir.join("control"), "").unwrap();
        // sysfs as the kernel lays it out: bus/pci/devices/<addr> links into devices/.
        let sys = dir.path().join("sys");
        std::fs::create_dir_all(sys.join("bus/pci/devices")).unwrap();
        for g in gpus {
            let real = sys.join("devices/pci0000:00").join(&g.bus);
            std::fs::create_dir_all(&real).unwrap();
            std::fs::write(real.join("numa_node"), format!("{}\n", g.numa)).unwrap();
            // An NVIDIA 3D controller: what tells a GPU node without a usable NVML.
            std::fs::write(real.join("vendor"), "0x10de\n").unwrap();
            std::fs::write(real.join("class"), "0x030200\n").unwrap();
            let link = sys.join("bus/pci/devices").join(&g.bus);
            std::os::unix::fs::symlink(format!("../../../devices/pci0000:00/{}", g.bus), link).unwrap();
        }
        let dev = dir.path().join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        for node in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"] {
            std::fs::write(dev.join(node), "").unwrap();
        }
        for i in 0..gpus.len() {
            std::fs::write(dev.join(format!("nvidia{i}")), "").unwrap();
        }
        Fixture { dir, lib, changes: Arc::new(AtomicUsize::new(0)) }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn config(&self, extra: &[(&str, &str)]) -> Config {
        let mut pairs = vec![
            ("nvml_lib".to_string(), self.lib.to_string_lossy().into_owned()),
            ("sysfs_root".to_string(), self.path("sys").to_string_lossy().into_owned()),
            ("devfs_root".to_string(), self.path("dev").to_string_lossy().into_owned()),
        ];
        pairs.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Config::from_options(&Options::new(pairs)).expect("valid options")
    }

    pub fn notify(&self) -> Notify {
        let changes = self.changes.clone();
        Arc::new(move || {
            changes.fetch_add(1, Ordering::SeqCst);
        })
    }

    pub fn open(&self, extra: &[(&str, &str)]) -> Node {
        Node::open(&self.config(extra), self.notify())
    }

    /// Appends a command to the fake's control file.
    pub fn control(&self, line: &str) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(self.path("lib/control")).unwrap();
        writeln!(f, "{line}").unwrap();
    }
}

/// Devices with their health, by ID order of the report.
pub fn snapshot(node: &Node) -> Vec<(Device, Health)> {
    node.devices().map(|(d, h)| (d.clone(), h)).collect()
}

pub fn health_of(node: &Node, id: &str) -> Option<Health> {
    node.devices().find(|(d, _)| d.id == id).map(|(_, h)| h)
}

pub fn attr<'a>(device: &'a Device, key: &str) -> Option<&'a str> {
    device.attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// Polls `cond` every 5 ms until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Installs the log capture (before the code under test logs).
pub fn capture_logs() {
    static LOGGER: Capture = Capture;
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Debug);
    }
}

/// Every log line of this test process so far.
pub fn logs() -> Vec<String> {
    LINES.lock().unwrap().clone()
}

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        LINES.lock().unwrap().push(format!("{} {}", record.level(), record.args()));
    }
    fn flush(&self) {}
}
