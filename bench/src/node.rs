//! The pieces of a simulated node: where the built artifacts are, a short
//! temporary folder with a manifest and a device-plugins folder, the real
//! `devhost` process, and what `/proc` says about a process.

use anyhow::{Context, Result, bail};
use devhost_proto::v1beta1::device_plugin_client::DevicePluginClient;
use kubelet_emu::Kubelet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// How long any single wait of the bench may take before it is a failure.
pub const WAIT: Duration = Duration::from_secs(20);
/// The largest message the bench's own clients accept (the scale figure
/// checks the kubelet's 4 MiB limit separately).
pub const MAX_MESSAGE: usize = 64 << 20;

/// Built artifacts: the `devhost` binary and the driver modules beside it.
#[derive(Clone, Debug)]
pub struct Artifacts {
    /// `target/<profile>`.
    pub dir: PathBuf,
    /// The repository root (the folder holding `config/`).
    pub repo: PathBuf,
}

impl Artifacts {
    /// The folder this bench binary was built into, and the repository.
    pub fn locate() -> Result<Artifacts> {
        let exe = std::env::current_exe().context("cannot find the bench's own executable")?;
        let dir = exe.parent().context("the bench executable has no folder")?.to_path_buf();
        let repo =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().context("bench/ has no parent folder")?.to_path_buf();
        Ok(Artifacts { dir, repo })
    }

    pub fn devhost(&self) -> PathBuf {
        self.dir.join("devhost")
    }

    /// `libdevhost_<name>.so` in the profile folder.
    pub fn module(&self, name: &str) -> PathBuf {
        self.dir.join(format!("libdevhost_{name}.so"))
    }

    /// Fails with the build command when something the bench runs is missing.
    pub fn require(&self) -> Result<()> {
        for p in [self.devhost(), self.module("example_c"), self.module("benchdrv")] {
            if !p.exists() {
                bail!("{} is missing: run `cargo build --release --workspace` first", p.display());
            }
        }
        Ok(())
    }

    pub fn profile(&self) -> String {
        self.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    }
}

/// The log folder of a node (see [`Node::log`]).
const LOGS: &str = "logs";

/// A temporary node folder: `<tmp>/dp` is the kubelet's device-plugins folder.
/// Kept short because socket paths are limited to 107 bytes.
pub struct Node {
    pub tmp: tempfile::TempDir,
}

impl Node {
    pub fn new() -> Result<Node> {
        let tmp =
            tempfile::Builder::new().prefix("dhb").tempdir_in("/tmp").context("cannot create a node folder in /tmp")?;
        std::fs::create_dir(tmp.path().join(LOGS)).context("cannot create the node's log folder")?;
        Ok(Node { tmp })
    }

    /// Where a process of this node logs: `<node>/logs/<name>`. Never the node folder itself,
    /// which holds the manifests: devhost watches its manifest's folder for edits, and a log
    /// written there would wake it on every line, as no deployment does (its manifest is a
    /// ConfigMap volume, its log a pipe).
    pub fn log(&self, name: &str) -> PathBuf {
        self.path().join(LOGS).join(name)
    }

    pub fn path(&self) -> &Path {
        self.tmp.path()
    }

    pub fn kubelet_dir(&self) -> PathBuf {
        self.path().join("dp")
    }

    pub fn write_manifest(&self, name: &str, body: &str) -> Result<PathBuf> {
        let p = self.path().join(name);
        std::fs::write(&p, body).with_context(|| format!("cannot write manifest {}", p.display()))?;
        Ok(p)
    }
}

/// A child process of the bench (devhost or the null server): terminated
/// with SIGTERM and reaped on drop.
pub struct Proc {
    pub child: Child,
    pub started: Instant,
    pub log: PathBuf,
}

impl Proc {
    /// Starts `devhost run` on a manifest, logging to `logs/<manifest stem>.log`
    /// beside the (temporary) kubelet folder (never into the manifest's folder,
    /// see [`Node::log`], nor into the repository).
    /// The working directory is the repository, as for `config/*.toml`.
    pub fn devhost(art: &Artifacts, manifest: &Path, kubelet_dir: &Path) -> Result<Proc> {
        let mut cmd = Command::new(art.devhost());
        cmd.args(["run", "--config"]).arg(manifest).arg("--kubelet-dir").arg(kubelet_dir).current_dir(&art.repo);
        let stem = manifest.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "devhost".into());
        let logs = kubelet_dir.parent().unwrap_or(kubelet_dir).join(LOGS);
        std::fs::create_dir_all(&logs).with_context(|| format!("cannot create {}", logs.display()))?;
        Proc::spawn(cmd, &logs.join(format!("{stem}.log")))
    }

    pub fn spawn(mut cmd: Command, log: &Path) -> Result<Proc> {
        let file = std::fs::File::create(log).with_context(|| format!("cannot create log {}", log.display()))?;
        let started = Instant::now();
        // As deployed: a developer's RUST_BACKTRACE=1 would make every error
        // the daemon meets (a missing pod-resources socket, say) capture a
        // backtrace, which no node pays.
        let child = cmd
            .env_remove("RUST_BACKTRACE")
            .env_remove("RUST_LIB_BACKTRACE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .with_context(|| format!("cannot start {:?}", cmd.get_program()))?;
        Ok(Proc { child, started, log: log.to_path_buf() })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The end of the process's log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// SIGTERM, then SIGKILL after 3 s; always reaps.
    pub fn stop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // SAFETY: kill(2) on our own child, which has not been reaped yet.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(3) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Waits until every resource has registered `n` times in all.
pub async fn wait_all_registered(kubelet: &Kubelet, resources: &[String], n: u64, proc: Option<&Proc>) -> Result<()> {
    for r in resources {
        if let Err(e) = kubelet.wait_registration_count(r, n, WAIT).await {
            let log = proc.map(|p| format!("\nlast log lines:\n{}", p.log_tail())).unwrap_or_default();
            bail!("{e}{log}");
        }
    }
    Ok(())
}

/// A device-plugin client of our own on a resource's socket (not the
/// emulator's connection), with a generous message limit.
pub async fn plugin_client(kubelet: &Kubelet, resource: &str) -> Result<DevicePluginClient<Channel>> {
    let path = kubelet.endpoint_path(resource).with_context(|| format!("{resource} never registered"))?;
    let channel =
        devhost_proto::connect_uds(&path).await.with_context(|| format!("cannot connect to {}", path.display()))?;
    Ok(DevicePluginClient::new(channel).max_decoding_message_size(MAX_MESSAGE))
}

/// A node serving one resource from the C example driver: `driver_keys` is the
/// rest of its `[driver.c]` table (e.g. `isolation = "process"` and its
/// `options`). Returns once the resource lists `devices` devices, with a
/// client of our own on its socket; the node outlives the daemon when the
/// tuple is bound in this order.
pub async fn c_example_node(
    art: &Artifacts,
    resource: &str,
    devices: usize,
    driver_keys: &str,
) -> Result<(Node, Kubelet, Proc, DevicePluginClient<Channel>)> {
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let manifest = node.write_manifest(
        "devhost.toml",
        &format!(
            "[driver.c]\nmodule = \"{}\"\n{driver_keys}\n\n[[resource]]\nname = \"{resource}\"\ndriver = \"c\"\n",
            art.module("example_c").display()
        ),
    )?;
    let daemon = Proc::devhost(art, &manifest, &node.kubelet_dir())?;
    wait_all_registered(&kubelet, &[resource.to_string()], 1, Some(&daemon)).await?;
    kubelet.wait_devices(resource, WAIT, |d| d.len() == devices).await?;
    let client = plugin_client(&kubelet, resource).await?;
    Ok((node, kubelet, daemon, client))
}

/// CPU time and memory of a process, from `/proc/<pid>/{stat,status}` and
/// the per-thread schedstat (nanosecond run time).
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcStat {
    /// utime + stime in clock ticks.
    pub ticks: u64,
    /// Sum of the threads' on-CPU nanoseconds.
    pub run_ns: u64,
    pub rss_kib: u64,
    pub threads: u64,
}

pub fn proc_stat(pid: u32) -> Result<ProcStat> {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("process {pid} is gone"))?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).context("unexpected /proc/<pid>/stat format")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5); `rest` starts at field 3.
    let tick =
        |i: usize| fields.get(i - 3).and_then(|v| v.parse::<u64>().ok()).context("bad utime/stime in /proc stat");
    let ticks = tick(14)? + tick(15)?;
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).with_context(|| format!("process {pid} is gone"))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let mut run_ns = 0;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                run_ns += s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        }
    }
    Ok(ProcStat { ticks, run_ns, rss_kib: field("VmRSS:"), threads: field("Threads:") })
}

/// Each thread of a process: (tid, name, on-CPU nanoseconds from schedstat).
/// The driver worker processes (`isolation = "process"`, the default) of
/// the devhost process `parent`.
pub fn workers_of(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(parent) && String::from_utf8_lossy(&cmdline).contains("__driver-worker") {
            out.push(pid);
        }
    }
    out.sort_unstable();
    out
}

pub fn threads(pid: u32) -> Vec<(u32, String, u64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    let mut out = Vec::new();
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let name = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default().trim().to_string();
        let ns = std::fs::read_to_string(t.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()))
            .unwrap_or(0);
        out.push((tid, name, ns));
    }
    out
}

/// Clock ticks per second for utime/stime.
pub fn clock_ticks() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if v > 0 { v as u64 } else { 100 }
}
