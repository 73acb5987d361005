//! Shared harness for the host's integration tests: the real `devhost`
//! binary, the real driver modules the workspace builds, C drivers compiled
//! here with the system compiler, and the kubelet emulator.

pub mod apiserver;
pub mod faultproxy;
pub mod promtool;
pub mod wait;

pub use wait::{eventually, eventually_with, eventually_within};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub use kubelet_emu::Kubelet;

pub const WAIT: Duration = Duration::from_secs(15);

/// A loopback address with a port free right now (for `metrics_addr`).
pub fn free_port() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

pub fn devhost_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_devhost"))
}

/// The workspace root (the folder holding `drivers/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("host/ has a parent").to_path_buf()
}

/// A driver module built by the workspace, e.g. `module("example_c")`.
pub fn module(name: &str) -> PathBuf {
    let dir = devhost_bin().parent().expect("binary has a folder").to_path_buf();
    let path = dir.join(format!("libdevhost_{name}.so"));
    assert!(path.exists(), "{} is missing: run `cargo build --workspace` before the tests", path.display());
    path
}

/// The threads of process `pid`: each one's `/proc` task folder and its
/// name (`comm`); none once the process is gone.
pub fn threads(pid: u32) -> Vec<(PathBuf, String)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
    tasks
        .filter_map(|t| {
            let dir = t.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            Some((dir, comm.trim().to_string()))
        })
        .collect()
}

/// Compiles a C driver with the strict flags vendors use.
pub fn compile_c(src: &Path, out: &Path, include: &Path) {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread"])
        .arg("-I")
        .arg(include)
        .arg("-o")
        .arg(out)
        .arg(src)
        .status()
        .expect("run the C compiler");
    assert!(st.success(), "compiling {} failed", src.display());
}

pub fn abi_include() -> PathBuf {
    repo_root().join("drivers/abi/include")
}

/// A test folder with a manifest and a kubelet device-plugins folder.
pub struct Node {
    pub tmp: tempfile::TempDir,
}

impl Node {
    pub fn new() -> Node {
        Node { tmp: tempfile::Builder::new().prefix("dh").tempdir().expect("tempdir") }
    }
    pub fn path(&self) -> &Path {
        self.tmp.path()
    }
    pub fn kubelet_dir(&self) -> PathBuf {
        self.path().join("dp")
    }
    /// Writes `body` as the node's manifest. A body that sets no `state_dir`
    /// gets the node's own, so a test never writes into the machine's
    /// /var/lib/devhost.
    pub fn write_manifest(&self, body: &str) -> PathBuf {
        let p = self.path().join("devhost.toml");
        let mut body = body.to_string();
        // The node's own state folder and runtime socket (none serves there unless a test starts
        // one), never the machine's /var/lib/devhost or containerd.
        for (key, path) in [("state_dir", "state"), ("runtime_socket", "cri.sock")] {
            if !body.lines().any(|l| l.trim_start().starts_with(key)) {
                body = format!("{key} = \"{}\"\n{body}", self.path().join(path).display());
            }
        }
        std::fs::write(&p, body).expect("write manifest");
        p
    }

    /// Writes `body` as the manifest, byte for byte, for tests that assert
    /// line numbers: a body that runs the daemon names its own `state_dir`
    /// (`check` writes nothing).
    pub fn write_manifest_exact(&self, body: &str) -> PathBuf {
        let p = self.path().join("devhost.toml");
        std::fs::write(&p, body).expect("write manifest");
        p
    }
}

/// The running daemon; killed on drop if still alive.
pub struct Daemon {
    pub child: Child,
    pub log: PathBuf,
}

impl Daemon {
    pub fn start(manifest: &Path, kubelet_dir: &Path) -> Daemon {
        Self::start_from(&devhost_bin(), manifest, kubelet_dir)
    }

    /// As [`Daemon::start`], from the `devhost` binary at `bin`.
    pub fn start_from(bin: &Path, manifest: &Path, kubelet_dir: &Path) -> Daemon {
        let log = manifest.with_extension("log");
        let file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(bin)
            .args(["run", "--config"])
            .arg(manifest)
            .arg("--kubelet-dir")
            .arg(kubelet_dir)
            .env("DEVHOST_LOG", "debug")
            // A driver panic with RUST_BACKTRACE=1 (as a developer's shell
            // may set it) symbolises a debug build's backtrace, which can
            // outlast the hostile tests' 300 ms call deadlines.
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start devhost");
        Daemon { child, log }
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let pid = self.child.id() as i32;
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < within {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Waits until the log contains `needle`.
    pub async fn wait_log(&self, needle: &str, timeout: Duration) -> String {
        let start = Instant::now();
        loop {
            let l = self.logs();
            if l.contains(needle) {
                return l;
            }
            assert!(start.elapsed() < timeout, "log never contained {needle:?}; log:\n{l}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deletes the kubelet's device-plugins folder as an operator's `rm -rf` would, while the daemon
/// serves in it: the daemon binds its sockets again as soon as they are removed (as after a
/// kubelet restart), so one pass may find the folder not empty; the deletion is tried again
/// until the folder is gone, for at most a few seconds.
pub fn remove_folder_while_served(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::DirectoryNotEmpty && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("cannot delete {}: {e}", dir.display()),
        }
    }
}

/// Runs `devhost ARGS` to completion and returns (exit code, stdout, stderr).
pub fn devhost(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(devhost_bin()).args(args).output().expect("run devhost");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn env_of(resp: &kubelet_emu::AllocateResponse, i: usize, key: &str) -> Option<String> {
    resp.container_responses.get(i).and_then(|c| c.envs.get(key).cloned())
}

/// Writes `dir/kubeconfig` for an API server that is not there (port 1), for tests whose DRA
/// resources need a client but never reach the server, and returns its path.
pub fn unreachable_kubeconfig(dir: &Path) -> PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n\
         users:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\n\
         current-context: x\n",
    )
    .expect("write the kubeconfig");
    path
}

/// The workspace's fake libnvidia-ml.
pub fn fake_nvml() -> PathBuf {
    let path = devhost_bin().parent().expect("binary folder").join("libfake_nvml.so");
    assert!(path.exists(), "{} is missing: run `cargo build --workspace` before the tests", path.display());
    path
}

/// Lays out an NVIDIA node under `root` for the NVIDIA driver: the fake NVML in `root/nvml`
/// (`libnvidia-ml.so.1`, `machine` as `fake-nvml.toml`, an empty `control` file), each
/// (PCI bus, NUMA node) of `buses` as an NVIDIA GPU's PCI function under PCI root complex
/// `pci_root` in `root/sys`, and an empty `root/dev`. Returns the folder of the library (the
/// driver's `nvml_lib` is `<it>/libnvidia-ml.so.1`).
pub fn fake_nvml_node(root: &Path, machine: &str, pci_root: &str, buses: &[(&str, u32)]) -> PathBuf {
    let lib = root.join("nvml");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::copy(fake_nvml(), lib.join("libnvidia-ml.so.1")).unwrap();
    std::fs::write(lib.join("fake-nvml.toml"), machine).unwrap();
    std::fs::write(lib.join("control"), "").unwrap();
    std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
    for &(bus, numa) in buses {
        let real = root.join("sys/devices").join(pci_root).join(bus);
        std::fs::create_dir_all(&real).unwrap();
        std::fs::write(real.join("numa_node"), format!("{numa}\n")).unwrap();
        // An NVIDIA 3D controller: what tells a GPU node without a usable NVML.
        std::fs::write(real.join("vendor"), "0x10de\n").unwrap();
        std::fs::write(real.join("class"), "0x030200\n").unwrap();
        std::os::unix::fs::symlink(
            format!("../../../devices/{pci_root}/{bus}"),
            root.join("sys/bus/pci/devices").join(bus),
        )
        .unwrap();
    }
    std::fs::create_dir_all(root.join("dev")).unwrap();
    lib
}

/// The manifest embedded in deploy/configmap.yaml (the `devhost.toml: |` block).
pub fn configmap_manifest() -> String {
    let yaml = std::fs::read_to_string(repo_root().join("deploy/configmap.yaml")).unwrap();
    let lines = yaml.lines().skip_while(|l| l.trim() != "devhost.toml: |").skip(1);
    let first = lines.clone().find(|l| !l.trim().is_empty()).expect("a manifest in the ConfigMap");
    let indent = first.len() - first.trim_start().len();
    lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() >= indent)
        .map(|l| format!("{}\n", l.get(indent..).unwrap_or("")))
        .collect()
}

/// Children of `parent` started as driver workers (of any driver).
pub fn workers_of(parent: u32) -> Vec<u32> {
    workers_matching(parent, "__driver-worker\0")
}

/// The worker process of driver `driver` among the children of `parent`, if one runs.
pub fn worker_of(parent: u32, driver: &str) -> Option<u32> {
    workers_matching(parent, &format!("__driver-worker\0{driver}\0")).first().copied()
}

/// Live children of `parent` whose command line holds `needle`.
fn workers_matching(parent: u32, needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if alive(pid) && ppid(pid) == Some(parent) && String::from_utf8_lossy(&cmdline).contains(needle) {
            out.push(pid);
        }
    }
    out
}

/// The `stat` fields after the command name: state, ppid, ….
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(stat.rsplit_once(')')?.1.split_whitespace().map(str::to_string).collect())
}

pub fn ppid(pid: u32) -> Option<u32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

/// Running, not a zombie nobody reaped (a container's init may not reap).
pub fn alive(pid: u32) -> bool {
    stat_fields(pid).is_some_and(|f| f.first().is_some_and(|s| s != "Z" && s != "X"))
}
