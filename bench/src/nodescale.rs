//! A node of many driver instances and resources (item 6 of issue 17):
//! `instances` driver instances, alternately the C example and the bench
//! driver, feed `resources` resources of one device each. Measured: process
//! start → every resource registered (against the null plugin registering
//! as many), kubelet restarts → every resource registered again, RSS of the
//! host and its worker processes, and one resource reloaded (its manifest
//! entry changed, SIGHUP) until the kubelet holds its new device.

use crate::node::{self, Artifacts, Node, Proc, proc_stat};
use crate::stats::{Samples, fmt_dur, ratio};
use anyhow::{Context, Result, bail};
use kubelet_emu::Kubelet;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// The section of `docs/benchmarks.md`.
pub const HEADING: &str = "Many driver instances";

/// The section: what was run, then the table.
pub fn section(rows: &[Sized], starts: usize, restarts: usize) -> String {
    format!(
        "Nodes of many driver instances (`devhost-bench node-scale`): instances alternate between the C example \
         and the bench driver, each in its own worker process (the default isolation), and feed resources of \
         one device each. Start-up: p50 of {starts} starts, against the null plugin registering as many \
         resources. Then {restarts} emulated kubelet restarts (clock: restart → every resource registered \
         again), RSS of the host and its workers, and one reload: the last resource's manifest entry moves to \
         another device, SIGHUP, until the kubelet holds the new device. Wall-clock figures taken on a loaded \
         2-CPU machine (other builds running): compare within a row.\n\n{}",
        table(rows)
    )
}

/// What one node size gave.
pub struct Sized {
    pub instances: usize,
    pub resources: usize,
    pub start_p50: Duration,
    pub null_p50: Duration,
    pub rereg_p50: Duration,
    pub rereg_max: Duration,
    pub restarts: usize,
    pub rss_kib: u64,
    pub workers: usize,
    pub reload: Duration,
}

fn manifest(art: &Artifacts, instances: usize, resources: usize, moved: bool) -> (String, Vec<String>) {
    let per = resources.div_ceil(instances);
    let isolation = if in_process() { "isolation = \"in-process\"\n" } else { "" };
    let mut m = String::new();
    for k in 0..instances {
        // One spare device per instance: the reload moves a resource onto it.
        if k.is_multiple_of(2) {
            let _ = write!(
                m,
                "[driver.c{k}]\nmodule = \"{}\"\n{isolation}options = {{ count = {} }}\n\n",
                art.module("example_c").display(),
                per + 1
            );
        } else {
            let _ = write!(
                m,
                "[driver.b{k}]\nmodule = \"{}\"\n{isolation}options = {{ count = {}, prefix = \"b{k}\" }}\n\n",
                art.module("benchdrv").display(),
                per + 1
            );
        }
    }
    let mut names = Vec::new();
    for r in 0..resources {
        let (k, j) = (r % instances, r / instances);
        // The last resource moves to its instance's spare device on reload.
        let j = if moved && r == resources - 1 { per } else { j };
        let (driver, id) = if k.is_multiple_of(2) {
            (format!("c{k}"), format!("example-{j}"))
        } else {
            (format!("b{k}"), format!("b{k}-{j}"))
        };
        let name = format!("scale.example.com/r{r}");
        let _ = write!(m, "[[resource]]\nname = \"{name}\"\ndriver = \"{driver}\"\nmatch = {{ id = \"{id}\" }}\n\n");
        names.push(name);
    }
    (m, names)
}

/// `DEVHOST_BENCH_IN_PROCESS=1`: every driver in process instead of the default worker processes.
fn in_process() -> bool {
    std::env::var_os("DEVHOST_BENCH_IN_PROCESS").is_some_and(|v| v == "1")
}

/// The device ID the last resource has after the reload.
fn moved_id(instances: usize, resources: usize) -> String {
    let per = resources.div_ceil(instances);
    let k = (resources - 1) % instances;
    if k.is_multiple_of(2) { format!("example-{per}") } else { format!("b{k}-{per}") }
}

pub async fn one(art: &Artifacts, instances: usize, resources: usize, starts: usize, restarts: usize) -> Result<Sized> {
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let (body, names) = manifest(art, instances, resources, false);
    let path = node.write_manifest("devhost.toml", &body)?;
    let mut start = Samples::default();
    let mut daemon = None;
    for round in 1..=starts as u64 {
        let wall = std::time::SystemTime::now();
        let d = Proc::devhost(art, &path, &node.kubelet_dir())?;
        node::wait_all_registered(&kubelet, &names, round, Some(&d)).await?;
        start.push(d.started.elapsed());
        // DEVHOST_BENCH_KEEP_LOG=<file>: keep the first start's log (run with DEVHOST_LOG=debug to see each step).
        if let (1, Some(keep)) = (round, std::env::var_os("DEVHOST_BENCH_KEEP_LOG")) {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let text = std::fs::read_to_string(&d.log).unwrap_or_default();
            let at = wall.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let _ =
                std::fs::write(keep, format!("spawned at {}.{:06} (unix)\n{text}", at.as_secs(), at.subsec_micros()));
        }
        if round < starts as u64 {
            let mut d = d;
            tokio::task::block_in_place(|| d.stop());
        } else {
            daemon = Some(d);
        }
    }
    let daemon = daemon.context("no start")?;
    for n in &names {
        kubelet.wait_devices(n, node::WAIT, |d| d.len() == 1).await?;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let workers = node::workers_of(daemon.pid());
    let rss_kib = proc_stat(daemon.pid())?.rss_kib
        + workers.iter().map(|w| proc_stat(*w).map(|s| s.rss_kib).unwrap_or(0)).sum::<u64>();

    let mut rereg = Samples::default();
    for _ in 0..restarts {
        let regs: Vec<u64> = names.iter().map(|n| kubelet.registration_count(n)).collect();
        let t = Instant::now();
        kubelet.restart().context("emulated kubelet restart failed")?;
        for (n, c) in names.iter().zip(&regs) {
            if let Err(e) = kubelet.wait_registration_count(n, c + 1, node::WAIT).await {
                bail!("{e}\nlast log lines:\n{}", daemon.log_tail());
            }
        }
        rereg.push(t.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if daemon.child.id() == 0 || proc_stat(daemon.pid()).is_err() {
        bail!("devhost died during the restarts:\n{}", daemon.log_tail());
    }

    // Reload: the last resource moves to its instance's spare device.
    let last = names.last().context("no resources")?.clone();
    let want = moved_id(instances, resources);
    let (moved, _) = manifest(art, instances, resources, true);
    std::fs::write(&path, moved).context("cannot rewrite the manifest")?;
    let t = Instant::now();
    // SAFETY: kill(2) on our own live child.
    unsafe { libc::kill(daemon.pid() as i32, libc::SIGHUP) };
    if let Err(e) = kubelet.wait_devices(&last, node::WAIT, |d| d.len() == 1 && d[0].id == want).await {
        bail!("reload: {e}\nlast log lines:\n{}", daemon.log_tail());
    }
    let reload = t.elapsed();
    for n in &names[..names.len() - 1] {
        kubelet.wait_devices(n, node::WAIT, |d| d.len() == 1).await?;
    }
    drop(daemon);

    let null = null_starts(art, resources, starts).await?;
    let s = |x: &Samples| x.summary().context("no samples");
    let (start, rereg_s, null) = (s(&start)?, s(&rereg)?, s(&null)?);
    Ok(Sized {
        instances,
        resources,
        start_p50: start.p50,
        null_p50: null.p50,
        rereg_p50: rereg_s.p50,
        rereg_max: rereg_s.max,
        restarts,
        rss_kib,
        workers: workers.len(),
        reload,
    })
}

async fn null_starts(art: &Artifacts, n: usize, starts: usize) -> Result<Samples> {
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let names: Vec<String> = (0..n).map(|i| format!("null.bench/r{i}")).collect();
    let sock = node.kubelet_dir().join("null.sock");
    let mut s = Samples::default();
    for round in 1..=starts as u64 {
        let mut p = crate::null::spawn(art, &sock, Some((&kubelet.socket_path(), n)), &node.log("null.log"))?;
        node::wait_all_registered(&kubelet, &names, round, Some(&p)).await?;
        s.push(p.started.elapsed());
        tokio::task::block_in_place(|| p.stop());
    }
    Ok(s)
}

/// The markdown table for several node sizes.
pub fn table(rows: &[Sized]) -> String {
    let mut md = String::from(
        "| instances | resources | start → all registered p50 | null plugin, same resources | ratio | kubelet restart → all re-registered p50 / max (n) | RSS host + workers (workers) | reload of one resource |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} / {} ({}) | {:.1} MiB ({}) | {} |",
            r.instances,
            r.resources,
            fmt_dur(r.start_p50),
            fmt_dur(r.null_p50),
            ratio(r.start_p50, r.null_p50),
            fmt_dur(r.rereg_p50),
            fmt_dur(r.rereg_max),
            r.restarts,
            r.rss_kib as f64 / 1024.0,
            r.workers,
            fmt_dur(r.reload)
        );
    }
    md
}
