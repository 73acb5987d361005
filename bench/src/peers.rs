//! NVIDIA's k8s-device-plugin beside devhost's NVIDIA driver on the same
//! fake NVML machine (`drivers/fake-nvml`, `config/sim/nvidia/machine.toml`)
//! under the same kubelet emulator, in alternating rounds, so that every
//! figure has the peer's and the ratio from one run.
//!
//! The peer is built from its Go module at the release pinned in
//! `bench/peer/go.mod` (checksums in `go.sum`) into `target/peer/`; Go's own
//! caches keep later builds short. It finds the fake through
//! `LD_LIBRARY_PATH` (a `libnvidia-ml.so.1` link to it). Its plugin sockets
//! go to the fixed `/var/lib/kubelet/device-plugins`, so it runs in a
//! private mount namespace (`unshare -m`) where that folder is the node's
//! emulated kubelet folder: nothing on the machine's own `/var/lib` changes.
//! It is given the kubelet socket as `kubelet.sock`, relative to that
//! folder: grpc-go sends the dial target as the HTTP/2 `:authority`, and an
//! absolute path there is no valid authority, which the emulator's HTTP/2
//! stack (unlike the real kubelet's) refuses with PROTOCOL_ERROR.

use crate::latency::Client;
use crate::node::{self, Artifacts, Node, Proc, proc_stat};
use crate::stats::{Samples, Summary, fmt_dur, ratio};
use anyhow::{Context, Result, bail};
use devhost_proto::v1beta1 as pb;
use kubelet_emu::Kubelet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const RESOURCE: &str = "nvidia.com/gpu";
const STARTS: usize = 9;
const CALLS: usize = 400;
const PREFS: usize = 100;
const WARMUP: usize = 30;
const IDLE: Duration = Duration::from_secs(10);
/// Kubelet restarts per daemon, in blocks that alternate.
const RESTARTS: usize = 15;
/// Concurrent Allocate: clients (devhost accepts 16 connections per endpoint,
/// the kubelet's and the sequential client included), and calls per client per block.
const CLIENTS: usize = 8;
const CONC_CALLS: usize = 20;
/// Rounds of Xid and lost GPU per daemon (a fresh start each).
const FAULT_ROUNDS: usize = 8;
const FAULT_SETTLE: Duration = Duration::from_secs(1);
/// devhost's `recovery_period` in this bench (the driver's default is longer).
const RECOVERY: Duration = Duration::from_millis(1000);
/// How long a recovery is waited for before it counts as "never".
const NEVER: Duration = Duration::from_secs(5);

/// Builds the peer from `bench/peer` into `target/peer/nvidia-device-plugin`.
pub fn build(art: &Artifacts) -> Result<PathBuf> {
    let package = "github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin";
    go_build(art, "bench/peer", package, "peer/nvidia-device-plugin", "NVIDIA's k8s-device-plugin")
}

/// `go build` of `package` in the Go module `module` (a folder of the repository) into
/// `<target>/<out>`; `what` names it in the error.
pub fn go_build(art: &Artifacts, module: &str, package: &str, out: &str, what: &str) -> Result<PathBuf> {
    let out = art.dir.parent().context("target folder has no parent")?.join(out);
    let st = Command::new("go")
        .args(["build", "-o"])
        .arg(&out)
        .arg(package)
        .current_dir(art.repo.join(module))
        .status()
        .context("cannot run `go` (is the Go toolchain installed?)")?;
    if !st.success() {
        bail!("`go build` of {what} ({module}) failed: {st}");
    }
    Ok(out)
}

/// Which daemon a round runs.
#[derive(Clone, Copy, PartialEq)]
enum Who {
    Devhost,
    Nvidia,
    /// devhost with its NVIDIA driver in process (`isolation = "in-process"`),
    /// for the fault rounds only: what the process boundary costs there.
    DevhostInProcess,
}

struct Setup {
    node: Node,
    kubelet: Kubelet,
    manifest: PathBuf,
    /// The same manifest with the driver in process.
    manifest_in_process: PathBuf,
    libdir: PathBuf,
    peer: PathBuf,
    /// The shipped machine with its control file in the node's folder.
    machine: PathBuf,
    /// A machine whose NVLink links differ (see `LINKS_MACHINE`).
    links_machine: PathBuf,
    control: PathBuf,
}

/// Why the peer's kubelet restart is not measured.
const NO_PEER_RESTART: &str = "not measurable in this harness: the plugin restarts on an fsnotify Create \
     event whose name equals `--kubelet-socket` verbatim (`/var/lib/kubelet/device-plugins/kubelet.sock` by \
     default, which a real kubelet restart matches); the bench must pass the relative `kubelet.sock` (see the \
     peer's dial note in `bench/src/peers.rs`), so the plugin never notices the new socket and never registers \
     again";

/// Four whole H100s; GPUs 0 and 1 (NUMA 0) share 1 NVLink, 1 and 2 have 2,
/// and 2 and 3 (NUMA 1, one host bridge) 8: the best-connected pair is 2 and
/// 3, not the lowest indices.
const LINKS_MACHINE: &str = r#"driver_version = "550.54.15"
cuda_version = 12040
control = "CONTROL"
topology_default = "system"

[[gpu]]
uuid = "GPU-5c4d7e3a-9b1f-4c2e-8d6a-0f1e2d3c4b01"
name = "NVIDIA H100 80GB HBM3"
memory_mib = 81559
pci_bus_id = "00000000:18:00.0"
minor = 0
compute_capability = [9, 0]
nvlinks = ["00000000:2A:00.0"]

[[gpu]]
uuid = "GPU-5c4d7e3a-9b1f-4c2e-8d6a-0f1e2d3c4b02"
name = "NVIDIA H100 80GB HBM3"
memory_mib = 81559
pci_bus_id = "00000000:2A:00.0"
minor = 1
compute_capability = [9, 0]
nvlinks = ["00000000:18:00.0", "00000000:9A:00.0", "00000000:9A:00.0"]

[[gpu]]
uuid = "GPU-5c4d7e3a-9b1f-4c2e-8d6a-0f1e2d3c4b03"
name = "NVIDIA H100 80GB HBM3"
memory_mib = 81559
pci_bus_id = "00000000:9A:00.0"
minor = 2
compute_capability = [9, 0]
nvlinks = [
    "00000000:2A:00.0", "00000000:2A:00.0",
    "00000000:AB:00.0", "00000000:AB:00.0", "00000000:AB:00.0", "00000000:AB:00.0",
    "00000000:AB:00.0", "00000000:AB:00.0", "00000000:AB:00.0", "00000000:AB:00.0",
]

[[gpu]]
uuid = "GPU-5c4d7e3a-9b1f-4c2e-8d6a-0f1e2d3c4b04"
name = "NVIDIA H100 80GB HBM3"
memory_mib = 81559
pci_bus_id = "00000000:AB:00.0"
minor = 3
compute_capability = [9, 0]
nvlinks = [
    "00000000:9A:00.0", "00000000:9A:00.0", "00000000:9A:00.0", "00000000:9A:00.0",
    "00000000:9A:00.0", "00000000:9A:00.0", "00000000:9A:00.0", "00000000:9A:00.0",
]

[[topology]]
gpus = [0, 1]
level = "single"

[[topology]]
gpus = [2, 3]
level = "hostbridge"
"#;

/// The UUID of GPU `index` in both machine files.
fn gpu_uuid(index: usize) -> String {
    format!("GPU-5c4d7e3a-9b1f-4c2e-8d6a-0f1e2d3c4b0{}", index + 1)
}

impl Setup {
    fn new(art: &Artifacts, peer: &Path) -> Result<Setup> {
        let node = Node::new()?;
        let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
        let fake = art.dir.join("libfake_nvml.so");
        if !fake.exists() || !art.module("nvidia").exists() {
            bail!("{} or the NVIDIA driver is missing: build the workspace in release", fake.display());
        }
        let libdir = node.path().join("lib");
        std::fs::create_dir_all(&libdir)?;
        std::os::unix::fs::symlink(&fake, libdir.join("libnvidia-ml.so.1"))?;
        let text = |isolation: &str| {
            format!(
                "[driver.nvidia]\nmodule = \"{}\"\nisolation = \"{isolation}\"\n\n[driver.nvidia.options]\nnvml_lib = \"{}\"\n\
                 sysfs_root = \"config/sim/nvidia/sys\"\ndevfs_root = \"config/sim/nvidia/dev\"\n\
                 driver_root = \"config/sim/nvidia/driver\"\ndevice_list_strategy = [\"envvar\"]\n\
                 recovery_period = \"{}ms\"\n\n\
                 [[resource]]\nname = \"{RESOURCE}\"\ndriver = \"nvidia\"\nmatch = {{ kind = \"gpu\" }}\n",
                art.module("nvidia").display(),
                fake.display(),
                RECOVERY.as_millis()
            )
        };
        let manifest = node.write_manifest("devhost.toml", &text("process"))?;
        let manifest_in_process = node.write_manifest("devhost-in.toml", &text("in-process"))?;
        let control = node.path().join("nvml-control");
        std::fs::write(&control, "")?;
        let shipped = std::fs::read_to_string(art.repo.join("config/sim/nvidia/machine.toml"))
            .context("cannot read config/sim/nvidia/machine.toml")?;
        let with_control = |text: &str| -> String {
            text.lines()
                .map(|l| {
                    if l.trim_start().starts_with("control") {
                        format!("control = \"{}\"", control.display())
                    } else {
                        l.to_string()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")
                + "\n"
        };
        let machine = node.path().join("machine.toml");
        std::fs::write(&machine, with_control(&shipped))?;
        let links_machine = node.path().join("machine-links.toml");
        std::fs::write(&links_machine, with_control(LINKS_MACHINE))?;
        Ok(Setup {
            node,
            kubelet,
            manifest,
            manifest_in_process,
            libdir,
            peer: peer.to_path_buf(),
            machine,
            links_machine,
            control,
        })
    }

    /// Appends one command to the fake NVML's control file.
    fn inject(&self, line: &str) -> Result<()> {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new().append(true).open(&self.control)?;
        writeln!(f, "{line}")?;
        Ok(())
    }

    fn spawn(&self, art: &Artifacts, who: Who, machine: &Path) -> Result<Proc> {
        match who {
            Who::Devhost | Who::DevhostInProcess => {
                let manifest = if who == Who::Devhost { &self.manifest } else { &self.manifest_in_process };
                let mut cmd = Command::new(art.devhost());
                cmd.args(["run", "--config"])
                    .arg(manifest)
                    .arg("--kubelet-dir")
                    .arg(self.node.kubelet_dir())
                    .env("FAKE_NVML_MACHINE", machine)
                    .current_dir(&art.repo);
                Proc::spawn(cmd, &self.node.log("devhost.log"))
            }
            Who::Nvidia => {
                let mut cmd = Command::new("unshare");
                cmd.args(["-m", "--propagation", "private", "sh", "-c"])
                    .arg(
                        "mount -t tmpfs none /var/lib && mkdir -p /var/lib/kubelet/device-plugins && \
                         mount --bind \"$0\" /var/lib/kubelet/device-plugins && \
                         cd /var/lib/kubelet/device-plugins && \
                         exec \"$1\" --device-discovery-strategy nvml --kubelet-socket kubelet.sock",
                    )
                    .arg(self.node.kubelet_dir())
                    .arg(&self.peer)
                    .env("LD_LIBRARY_PATH", &self.libdir)
                    .env("FAKE_NVML_MACHINE", machine)
                    .current_dir(&art.repo);
                Proc::spawn(cmd, &self.node.log("nvidia.log"))
            }
        }
    }
}

/// Everything measured of one daemon.
#[derive(Default)]
struct Side {
    start: Samples,
    alloc: Samples,
    pref2: Samples,
    pref_all: Samples,
    devices: usize,
    rss_kib: u64,
    threads: u64,
    cpu_pct: f64,
    conc: Samples,
    restart: Samples,
    xid: Samples,
    /// Xid → Healthy again; empty when it never came back.
    xid_back: Samples,
    lost: Samples,
    /// `back` → Healthy again; empty when it never came back.
    lost_back: Samples,
    /// The 2 devices it prefers of the links machine's 4.
    links_pick: Vec<String>,
}

/// Waits until the kubelet holds `uuid` with that health; the time since `t`.
async fn wait_health(s: &Setup, uuid: &str, healthy: bool, within: Duration, t: Instant) -> Result<Duration> {
    let want = if healthy { devhost_proto::HEALTHY } else { devhost_proto::UNHEALTHY };
    s.kubelet
        .wait_devices(RESOURCE, within, |d| d.iter().any(|x| x.id == uuid && x.health == want))
        .await
        .map_err(|e| anyhow::anyhow!("{uuid} never {want}: {e}"))?;
    Ok(t.elapsed())
}

/// Kubelet restarts: `restart()` → registered again (then every device
/// Healthy again before the next one). devhost only: see `NO_PEER_RESTART`.
async fn restarts(art: &Artifacts, s: &Setup, sides: &mut [Side; 3]) -> Result<()> {
    const BLOCKS: usize = 3;
    for _ in 0..BLOCKS {
        for (k, who) in [Who::Devhost].iter().enumerate() {
            let (mut p, _, _, _) = start(art, s, *who).await?;
            for _ in 0..RESTARTS / BLOCKS {
                let regs = s.kubelet.registration_count(RESOURCE);
                let t = Instant::now();
                s.kubelet.restart().context("emulated kubelet restart failed")?;
                if let Err(e) = s.kubelet.wait_registration_count(RESOURCE, regs + 1, node::WAIT).await {
                    bail!("{e}\n{}", p.log_tail());
                }
                sides[k].restart.push(t.elapsed());
                s.kubelet
                    .wait_devices(RESOURCE, node::WAIT, |d| {
                        !d.is_empty() && d.iter().all(|x| x.health == devhost_proto::HEALTHY)
                    })
                    .await?;
            }
            tokio::task::block_in_place(|| p.stop());
        }
    }
    Ok(())
}

/// Xid 79 on GPU 1 → Unhealthy → Healthy again; then GPU 2 lost → Unhealthy
/// → `back` → Healthy again. A fresh start of each daemon per round.
async fn faults(art: &Artifacts, s: &Setup, sides: &mut [Side; 3]) -> Result<()> {
    for round in 0..FAULT_ROUNDS {
        for (k, who) in [Who::Devhost, Who::Nvidia, Who::DevhostInProcess].iter().enumerate() {
            let (mut p, _, _, _) = start(art, s, *who).await?;
            // NVIDIA's plugin registers its NVML events in a goroutine of its
            // own after it registered, and says nothing when done: an Xid
            // before that is lost. Both get the same settle.
            tokio::time::sleep(FAULT_SETTLE).await;
            let (xid_gpu, lost_gpu) = (gpu_uuid(1), gpu_uuid(2));
            let t = Instant::now();
            s.inject("xid 1 79")?;
            sides[k].xid.push(wait_health(s, &xid_gpu, false, node::WAIT, t).await.context(p.log_tail())?);
            // Only the first round waits out a recovery that never comes.
            let wait = if sides[k].xid_back.0.is_empty() && round > 0 { Duration::ZERO } else { RECOVERY + NEVER };
            if let Ok(d) = wait_health(s, &xid_gpu, true, wait, t).await {
                sides[k].xid_back.push(d);
            }
            let t = Instant::now();
            s.inject("lost 2")?;
            sides[k].lost.push(wait_health(s, &lost_gpu, false, node::WAIT, t).await.context(p.log_tail())?);
            let t = Instant::now();
            s.inject("back 2")?;
            let wait = if sides[k].lost_back.0.is_empty() && round > 0 { Duration::ZERO } else { RECOVERY + NEVER };
            if let Ok(d) = wait_health(s, &lost_gpu, true, wait, t).await {
                sides[k].lost_back.push(d);
            }
            tokio::task::block_in_place(|| p.stop());
        }
    }
    Ok(())
}

/// Each daemon on the links machine: which 2 of its 4 GPUs it prefers.
async fn links(art: &Artifacts, s: &Setup, sides: &mut [Side; 3]) -> Result<()> {
    for (k, who) in [Who::Devhost, Who::Nvidia].iter().enumerate() {
        let (mut p, _, c, ids) = start_on(art, s, *who, &s.links_machine).await?;
        let mut c = c.clone();
        let req = pb::PreferredAllocationRequest {
            container_requests: vec![pb::ContainerPreferredAllocationRequest {
                available_device_i_ds: ids.clone(),
                must_include_device_i_ds: vec![],
                allocation_size: 2,
            }],
        };
        let resp = c.get_preferred_allocation(req).await.context("GetPreferredAllocation failed")?.into_inner();
        let mut pick = resp.container_responses.first().map(|r| r.device_i_ds.clone()).unwrap_or_default();
        pick.sort();
        sides[k].links_pick = pick;
        tokio::task::block_in_place(|| p.stop());
    }
    Ok(())
}

async fn client_and_ids(s: &Setup, proc: &Proc) -> Result<(Client, Vec<String>)> {
    let devs = s
        .kubelet
        .wait_devices(RESOURCE, node::WAIT, |d| !d.is_empty() && d.iter().all(|x| x.health == devhost_proto::HEALTHY))
        .await
        .with_context(|| format!("no healthy devices\n{}", proc.log_tail()))?;
    let ids = devs.iter().map(|d| d.id.clone()).collect();
    Ok((node::plugin_client(&s.kubelet, RESOURCE).await?, ids))
}

async fn preferred(c: &Client, ids: &[String], size: i32) -> Result<Duration> {
    let mut c = c.clone();
    let req = pb::PreferredAllocationRequest {
        container_requests: vec![pb::ContainerPreferredAllocationRequest {
            available_device_i_ds: ids.to_vec(),
            must_include_device_i_ds: vec![],
            allocation_size: size,
        }],
    };
    let t = Instant::now();
    let resp = c.get_preferred_allocation(req).await.context("GetPreferredAllocation failed")?.into_inner();
    let d = t.elapsed();
    let n = resp.container_responses.first().map_or(0, |r| r.device_i_ds.len());
    if n != size as usize {
        bail!("GetPreferredAllocation of {size} answered {n} devices");
    }
    Ok(d)
}

/// Starts `who` and waits for its registration and first device list.
async fn start(art: &Artifacts, s: &Setup, who: Who) -> Result<(Proc, Duration, Client, Vec<String>)> {
    start_on(art, s, who, &s.machine).await
}

async fn start_on(
    art: &Artifacts,
    s: &Setup,
    who: Who,
    machine: &Path,
) -> Result<(Proc, Duration, Client, Vec<String>)> {
    let regs = s.kubelet.registration_count(RESOURCE);
    let lists = s.kubelet.list_count(RESOURCE);
    let p = s.spawn(art, who, machine)?;
    node::wait_all_registered(&s.kubelet, &[RESOURCE.to_string()], regs + 1, Some(&p)).await?;
    let took = p.started.elapsed();
    if let Err(e) = s.kubelet.wait_list_count(RESOURCE, lists + 1, node::WAIT).await {
        bail!("{e}\n{}", p.log_tail());
    }
    let (c, ids) = client_and_ids(s, &p).await?;
    Ok((p, took, c, ids))
}

/// Runs the rounds; returns (devhost, nvidia, devhost with the driver in
/// process: fault rounds only).
async fn measure(art: &Artifacts, s: &Setup) -> Result<(Side, Side, Side)> {
    let mut sides = [Side::default(), Side::default(), Side::default()];
    let order = [Who::Devhost, Who::Nvidia];
    for _ in 0..STARTS {
        for (k, who) in order.iter().enumerate() {
            let (mut p, took, _, _) = start(art, s, *who).await?;
            sides[k].start.push(took);
            tokio::task::block_in_place(|| p.stop());
        }
    }
    eprintln!("devhost-bench peers: calls");
    // Calls: each daemon in turn runs a block of calls, blocks alternating.
    const BLOCKS: usize = 4;
    for block in 0..BLOCKS {
        for (k, who) in order.iter().enumerate() {
            eprintln!(
                "devhost-bench peers: block {block}, {}",
                if *who == Who::Devhost { "devhost" } else { "nvidia" }
            );
            let (mut p, _, c, ids) = start(art, s, *who).await?;
            sides[k].devices = ids.len();
            for i in 0..WARMUP {
                crate::latency::allocate(c.clone(), vec![ids[i % ids.len()].clone()]).await?;
            }
            for i in 0..CALLS / BLOCKS {
                let t = Instant::now();
                crate::latency::allocate(c.clone(), vec![ids[i % ids.len()].clone()])
                    .await
                    .context("Allocate failed")?;
                sides[k].alloc.push(t.elapsed());
            }
            for _ in 0..PREFS / BLOCKS {
                sides[k].pref2.push(preferred(&c, &ids, 2).await?);
                sides[k].pref_all.push(preferred(&c, &ids, ids.len().min(4) as i32).await?);
            }
            let socket = s.kubelet.endpoint_path(RESOURCE).context("not registered")?;
            let clients = crate::latency::connect_many(&socket, CLIENTS).await?;
            let ids2 = ids.clone();
            let conc = crate::latency::concurrent(&clients, CONC_CALLS, move |c, i| {
                crate::latency::allocate(c, vec![ids2[i % ids2.len()].clone()])
            });
            let conc = tokio::time::timeout(node::WAIT, conc).await.with_context(|| {
                format!("{CLIENTS} concurrent Allocates did not end within {:?}\n{}", node::WAIT, p.log_tail())
            })??;
            sides[k].conc.extend(conc);
            if block == BLOCKS - 1 {
                // devhost's driver runs in a worker process: count it with the host.
                let mut pids = vec![p.pid()];
                pids.extend(node::workers_of(p.pid()));
                let stats =
                    |pids: &[u32]| -> Vec<node::ProcStat> { pids.iter().filter_map(|q| proc_stat(*q).ok()).collect() };
                let a = stats(&pids);
                tokio::time::sleep(IDLE).await;
                let b = stats(&pids);
                sides[k].rss_kib = b.iter().map(|x| x.rss_kib).sum();
                sides[k].threads = b.iter().map(|x| x.threads).sum();
                let ns = |v: &[node::ProcStat]| v.iter().map(|x| x.run_ns).sum::<u64>();
                sides[k].cpu_pct = ns(&b).saturating_sub(ns(&a)) as f64 / IDLE.as_nanos() as f64 * 100.0;
            }
            tokio::task::block_in_place(|| p.stop());
        }
    }
    eprintln!("devhost-bench peers: kubelet restarts");
    restarts(art, s, &mut sides).await.context("kubelet restarts")?;
    eprintln!("devhost-bench peers: Xid and lost GPU");
    faults(art, s, &mut sides).await.context("Xid and lost GPU")?;
    eprintln!("devhost-bench peers: the links machine");
    links(art, s, &mut sides).await.context("the links machine")?;
    let [d, n, i] = sides;
    Ok((d, n, i))
}

/// The "Peers" section: one table, devhost and NVIDIA's plugin side by side.
pub async fn run(art: &Artifacts, peer: &Path) -> Result<String> {
    let s = Setup::new(art, peer)?;
    let (d, n, inproc) = measure(art, &s).await?;
    let sum = |x: &Samples| -> Result<Summary> { x.summary().context("no samples") };
    let mut md = format!(
        "devhost's NVIDIA driver (`isolation` left at its default, a worker process) and NVIDIA's \
         k8s-device-plugin {} (`--device-discovery-strategy nvml`, everything else default) on the same fake \
         NVML machine, `config/sim/nvidia/machine.toml` (four H100s, GPU 3 in MIG mode: devhost's \
         `nvidia.com/gpu` matches the {} whole GPUs, NVIDIA's plugin with `--mig-strategy none` advertises {}), \
         under one kubelet emulator. Rounds alternate: {STARTS} starts each, then blocks of calls each in turn \
         (Allocate of one device; GetPreferredAllocation of 2, and of min(4, all) of the advertised devices). \
         Concurrent Allocate: {CLIENTS} clients, each on its own connection, start together and make \
         {CONC_CALLS} calls each, once per block. Kubelet restart: the emulator does what a real kubelet does \
         when it comes back after a crash (its plugin connections are gone, it deletes every socket in the \
         device-plugins folder, the stale `kubelet.sock` included, and listens on a fresh `kubelet.sock`); \
         clock from that call to the next registration, {RESTARTS} restarts each in alternating blocks. Faults \
         ({FAULT_ROUNDS} rounds, a fresh start of each daemon per round, {} s after it registered; devhost also with its \
         driver in process, `isolation = \"in-process\"`, to show what the worker process costs there) are lines appended to the fake's \
         control file: `xid 1 79` (GPU 1 fell off the bus) and `lost 2` (GPU 2 stops answering NVML and its \
         event wait reports it once), then `back 2`; clock from the write to the kubelet's list showing the \
         change. devhost runs with `recovery_period = \"{}ms\"` (its default is longer), so a GPU comes back \
         once that long passes without a new critical Xid; NVIDIA's plugin has no recovery: a device it marks \
         Unhealthy stays so until the plugin restarts (waited for {} s). Links machine: four whole H100s where \
         GPUs 0–1 share 1 NVLink, 1–2 share 2, and 2–3 (one NUMA node, one host bridge) share 8; each daemon \
         is asked for 2 of the 4. Command: `cargo run --release -p devhost-bench -- peers`. Measured on a \
         loaded 2-CPU machine: the ratios are the figures to quote, and p99s of a few hundred calls are mostly \
         the machine's other load.\n\n\
         | Figure | devhost | NVIDIA k8s-device-plugin | NVIDIA ÷ devhost |\n| --- | --- | --- | --- |\n",
        peer_version(art),
        d.devices,
        n.devices,
        FAULT_SETTLE.as_secs(),
        RECOVERY.as_millis(),
        (RECOVERY + NEVER).as_secs()
    );
    let rows: [(&str, &Samples, &Samples); 4] = [
        ("start → registered, p50", &d.start, &n.start),
        ("Allocate, 1 device, sequential p50", &d.alloc, &n.alloc),
        ("GetPreferredAllocation, 2 devices, p50", &d.pref2, &n.pref2),
        ("GetPreferredAllocation, min(4, all) devices, p50", &d.pref_all, &n.pref_all),
    ];
    for (what, a, b) in rows {
        let (a, b) = (sum(a)?, sum(b)?);
        let _ = writeln!(md, "| {what} | {} | {} | {} |", fmt_dur(a.p50), fmt_dur(b.p50), ratio(b.p50, a.p50));
    }
    let (a, b) = (sum(&d.alloc)?, sum(&n.alloc)?);
    let _ = writeln!(
        md,
        "| Allocate, 1 device, sequential p99 | {} | {} | {} |",
        fmt_dur(a.p99),
        fmt_dur(b.p99),
        ratio(b.p99, a.p99)
    );
    let (a, b) = (sum(&d.conc)?, sum(&n.conc)?);
    let _ = writeln!(
        md,
        "| Allocate, {CLIENTS} concurrent clients, p50 / p99 | {} / {} | {} / {} | {} / {} |",
        fmt_dur(a.p50),
        fmt_dur(a.p99),
        fmt_dur(b.p50),
        fmt_dur(b.p99),
        ratio(b.p50, a.p50),
        ratio(b.p99, a.p99)
    );
    let a = sum(&d.restart)?;
    let _ = writeln!(
        md,
        "| kubelet restart → registered again, p50 / max (n = {}) | {} / {} | {NO_PEER_RESTART} | – |",
        a.n,
        fmt_dur(a.p50),
        fmt_dur(a.max),
    );
    for (what, a, b) in [
        ("Xid 79 → Unhealthy, p50", &d.xid, &n.xid),
        ("Xid 79 → Unhealthy, p50, devhost's driver in process", &inproc.xid, &n.xid),
        ("GPU lost → Unhealthy, p50", &d.lost, &n.lost),
        ("GPU lost → Unhealthy, p50, devhost's driver in process", &inproc.lost, &n.lost),
    ] {
        let (a, b) = (sum(a)?, sum(b)?);
        let _ = writeln!(md, "| {what} | {} | {} | {} |", fmt_dur(a.p50), fmt_dur(b.p50), ratio(b.p50, a.p50));
    }
    let back = |x: &Samples| match x.summary() {
        Some(v) => format!("{} (p50)", fmt_dur(v.p50)),
        None => format!("never (not within {} s)", (RECOVERY + NEVER).as_secs()),
    };
    let _ = writeln!(md, "| Xid → Healthy again (recovery) | {} | {} | – |", back(&d.xid_back), back(&n.xid_back));
    let _ = writeln!(md, "| lost GPU answers again → Healthy | {} | {} | – |", back(&d.lost_back), back(&n.lost_back));
    let best = [gpu_uuid(2), gpu_uuid(3)];
    let pick = |v: &[String]| {
        let idx: Vec<String> = v
            .iter()
            .map(|id| (0..4).find(|i| gpu_uuid(*i) == *id).map_or(id.clone(), |i| format!("GPU {i}")))
            .collect();
        let verdict = if v == best { "the best-connected pair" } else { "not the best-connected pair (GPUs 2 and 3)" };
        format!("{}: {verdict}", idx.join(" + "))
    };
    let _ = writeln!(md, "| links machine, 2 of 4 preferred | {} | {} | – |", pick(&d.links_pick), pick(&n.links_pick));
    let _ = writeln!(
        md,
        "| idle RSS (devhost: host + worker) | {:.1} MiB | {:.1} MiB | {:.2}× |",
        d.rss_kib as f64 / 1024.0,
        n.rss_kib as f64 / 1024.0,
        n.rss_kib as f64 / d.rss_kib.max(1) as f64
    );
    let _ = writeln!(
        md,
        "| idle CPU over {} s (devhost: host + worker; schedstat) | {:.3} % | {:.3} % | – |",
        IDLE.as_secs(),
        d.cpu_pct,
        n.cpu_pct
    );
    let _ = writeln!(md, "| threads (devhost: host + worker) | {} | {} | – |", d.threads, n.threads);
    Ok(md)
}

/// The pinned release, from `bench/peer/go.mod`.
fn peer_version(art: &Artifacts) -> String {
    let gomod = std::fs::read_to_string(art.repo.join("bench/peer/go.mod")).unwrap_or_default();
    gomod
        .lines()
        .find_map(|l| l.trim().strip_prefix("require github.com/NVIDIA/k8s-device-plugin "))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| "(unknown release)".into())
}
