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

/// Builds the peer from `bench/peer` into `target/peer/nvidia-device-plugin`.
pub fn build(art: &Artifacts) -> Result<PathBuf> {
    let out = art.dir.parent().context("target folder has no parent")?.join("peer/nvidia-device-plugin");
    let st = Command::new("go")
        .args(["build", "-o"])
        .arg(&out)
        .arg("github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin")
        .current_dir(art.repo.join("bench/peer"))
        .status()
        .context("cannot run `go` (is the Go toolchain installed?)")?;
    if !st.success() {
        bail!("`go build` of NVIDIA's k8s-device-plugin (bench/peer) failed: {st}");
    }
    Ok(out)
}

/// Which daemon a round runs.
#[derive(Clone, Copy, PartialEq)]
enum Who {
    Devhost,
    Nvidia,
}

struct Setup {
    node: Node,
    kubelet: Kubelet,
    manifest: PathBuf,
    libdir: PathBuf,
    peer: PathBuf,
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
        let manifest = node.write_manifest(
            "devhost.toml",
            &format!(
                "[driver.nvidia]\nmodule = \"{}\"\n\n[driver.nvidia.options]\nnvml_lib = \"{}\"\n\
                 sysfs_root = \"config/sim/nvidia/sys\"\ndevfs_root = \"config/sim/nvidia/dev\"\n\
                 driver_root = \"config/sim/nvidia/driver\"\ndevice_list_strategy = [\"envvar\"]\n\n\
                 [[resource]]\nname = \"{RESOURCE}\"\ndriver = \"nvidia\"\nmatch = {{ kind = \"gpu\" }}\n",
                art.module("nvidia").display(),
                fake.display()
            ),
        )?;
        Ok(Setup { node, kubelet, manifest, libdir, peer: peer.to_path_buf() })
    }

    fn spawn(&self, art: &Artifacts, who: Who) -> Result<Proc> {
        match who {
            Who::Devhost => Proc::devhost(art, &self.manifest, &self.node.kubelet_dir()),
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
                    .current_dir(&art.repo);
                Proc::spawn(cmd, &self.node.path().join("nvidia.log"))
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
    let regs = s.kubelet.registration_count(RESOURCE);
    let lists = s.kubelet.list_count(RESOURCE);
    let p = s.spawn(art, who)?;
    node::wait_all_registered(&s.kubelet, &[RESOURCE.to_string()], regs + 1, Some(&p)).await?;
    let took = p.started.elapsed();
    if let Err(e) = s.kubelet.wait_list_count(RESOURCE, lists + 1, node::WAIT).await {
        bail!("{e}\n{}", p.log_tail());
    }
    let (c, ids) = client_and_ids(s, &p).await?;
    Ok((p, took, c, ids))
}

/// Runs the rounds; returns (devhost, nvidia).
async fn measure(art: &Artifacts, s: &Setup) -> Result<(Side, Side)> {
    let mut sides = [Side::default(), Side::default()];
    let order = [Who::Devhost, Who::Nvidia];
    for _ in 0..STARTS {
        for (k, who) in order.iter().enumerate() {
            let (mut p, took, _, _) = start(art, s, *who).await?;
            sides[k].start.push(took);
            tokio::task::block_in_place(|| p.stop());
        }
    }
    // Calls: each daemon in turn runs a block of calls, blocks alternating.
    const BLOCKS: usize = 4;
    for block in 0..BLOCKS {
        for (k, who) in order.iter().enumerate() {
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
    let [d, n] = sides;
    Ok((d, n))
}

/// The "Peers" section: one table, devhost and NVIDIA's plugin side by side.
pub async fn run(art: &Artifacts, peer: &Path) -> Result<String> {
    let s = Setup::new(art, peer)?;
    let (d, n) = measure(art, &s).await?;
    let sum = |x: &Samples| -> Result<Summary> { x.summary().context("no samples") };
    let mut md = format!(
        "devhost's NVIDIA driver (`isolation` left at its default, a worker process) and NVIDIA's \
         k8s-device-plugin {} (`--device-discovery-strategy nvml`, everything else default) on the same fake \
         NVML machine, `config/sim/nvidia/machine.toml` (four H100s, GPU 3 in MIG mode: devhost's \
         `nvidia.com/gpu` matches the {} whole GPUs, NVIDIA's plugin with `--mig-strategy none` advertises {}), \
         under one kubelet emulator. Rounds alternate: {STARTS} starts each, then blocks of calls each in turn \
         (Allocate of one device; GetPreferredAllocation of 2, and of min(4, all) of the advertised devices). \
         Command: `cargo run --release -p devhost-bench -- peers`. Measured on a loaded 2-CPU machine: the \
         ratios are the figures to quote, and p99s of a few hundred calls are mostly the machine's other load. \
         Not measured yet: kubelet restart, Xid → Unhealthy, recovery, lost GPU, concurrent Allocate, and a \
         machine whose NVLink links differ (the shipped one links GPUs 0 and 1 by 6 NVLinks, 1 and 2 by 2).\n\n\
         | Figure | devhost | NVIDIA k8s-device-plugin | NVIDIA ÷ devhost |\n| --- | --- | --- | --- |\n",
        peer_version(art),
        d.devices,
        n.devices
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
