//! Figure 5: what devhost costs on every node while nothing happens: resident
//! memory and CPU time over an idle window, next to the null plugin measured
//! over the same window. Memory is the host process plus each driver worker
//! process (every driver runs in one unless it opts into `in-process`).

use crate::demo::Demo;
use crate::node::{self, Artifacts, Node, Proc, ProcStat, proc_stat};
use crate::report::Report;
use anyhow::{Context, Result};
use kubelet_emu::Kubelet;
use std::time::{Duration, Instant};

/// Idle figures of one process.
struct Idle {
    rss_max_kib: u64,
    rss_end_kib: u64,
    /// Percent of one core, from utime+stime.
    cpu_ticks_pct: f64,
    /// Percent of one core, from the threads' schedstat (ns resolution).
    cpu_ns_pct: f64,
    threads: u64,
}

fn idle_of(start: ProcStat, end: ProcStat, rss_max_kib: u64, secs: f64) -> Idle {
    let ticks = end.ticks.saturating_sub(start.ticks) as f64 / node::clock_ticks() as f64;
    Idle {
        rss_max_kib,
        rss_end_kib: end.rss_kib,
        cpu_ticks_pct: ticks / secs * 100.0,
        cpu_ns_pct: end.run_ns.saturating_sub(start.run_ns) as f64 / 1e9 / secs * 100.0,
        threads: end.threads,
    }
}

/// Threads that ran during the window, busiest first: `name (tid N): 0.012 %`.
fn busy_threads(before: &[(u32, String, u64)], after: &[(u32, String, u64)], secs: f64) -> Vec<String> {
    let mut v: Vec<(u64, String)> = after
        .iter()
        .map(|(tid, name, ns)| {
            let was = before.iter().find(|(t, _, _)| t == tid).map(|(_, _, n)| *n).unwrap_or(0);
            (ns.saturating_sub(was), format!("`{name}` (tid {tid})"))
        })
        .filter(|(d, _)| *d > 0)
        .collect();
    v.sort_by_key(|b| std::cmp::Reverse(b.0));
    v.into_iter().map(|(d, name)| format!("{name}: {:.4} %", d as f64 / 1e9 / secs * 100.0)).collect()
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

pub async fn run(art: &Artifacts, demo: &Demo, idle: Duration, report: &mut Report) -> Result<()> {
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let daemon = Proc::devhost(art, &demo.manifest, &node.kubelet_dir())?;
    node::wait_all_registered(&kubelet, &demo.resources, 1, Some(&daemon)).await?;
    let null_sock = node.kubelet_dir().join("null.sock");
    let null = crate::null::spawn(art, &null_sock, Some((&kubelet.socket_path(), 1)), &node.log("null.log"))?;
    node::wait_all_registered(&kubelet, &["null.bench/r0".to_string()], 1, Some(&null)).await?;
    // Let start-up work (first scans, registrations, allocator warm-up) finish.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let (d0, n0) = (proc_stat(daemon.pid())?, proc_stat(null.pid())?);
    let threads0 = node::threads(daemon.pid());
    let workers = node::workers_of(daemon.pid());
    let worker_rss = |pid: u32| proc_stat(pid).map(|s| s.rss_kib).unwrap_or(0);
    let mut w_max: Vec<u64> = workers.iter().map(|&w| worker_rss(w)).collect();
    let (mut d_max, mut n_max) = (d0.rss_kib, n0.rss_kib);
    let t = Instant::now();
    while t.elapsed() < idle {
        let left = idle.saturating_sub(t.elapsed());
        tokio::time::sleep(left.min(Duration::from_secs(1))).await;
        d_max = d_max.max(proc_stat(daemon.pid())?.rss_kib);
        n_max = n_max.max(proc_stat(null.pid())?.rss_kib);
        for (m, &w) in w_max.iter_mut().zip(&workers) {
            *m = (*m).max(worker_rss(w));
        }
    }
    let worker_top = w_max.iter().copied().max().unwrap_or(0);
    let secs = t.elapsed().as_secs_f64();
    let (d1, n1) = (proc_stat(daemon.pid())?, proc_stat(null.pid())?);
    let busy = busy_threads(&threads0, &node::threads(daemon.pid()), secs);
    let (d, n) = (idle_of(d0, d1, d_max, secs), idle_of(n0, n1, n_max, secs));
    drop((daemon, null));

    let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.2}×", a / b) } else { "–".into() };
    report.row(
        &format!("5. Idle RSS, {} (max over {secs:.0} s)", demo.title),
        mib(d.rss_max_kib),
        format!("null plugin {}", mib(n.rss_max_kib)),
        ratio(d.rss_max_kib as f64, n.rss_max_kib as f64),
        "≤ 15 MiB",
        Some(d.rss_max_kib <= 15 * 1024),
    );
    report.row(
        &format!("5. Idle RSS per driver worker, {} ({} workers, largest)", demo.title, workers.len()),
        mib(worker_top),
        format!("all workers {}", mib(w_max.iter().sum())),
        "–".to_string(),
        "≤ 6 MiB each",
        Some(worker_top <= 6 * 1024),
    );
    report.row(
        &format!("5. Idle CPU, {} (utime+stime over {secs:.0} s)", demo.title),
        format!("{:.3} % of one core", d.cpu_ticks_pct),
        format!("null plugin {:.3} %", n.cpu_ticks_pct),
        ratio(d.cpu_ns_pct, n.cpu_ns_pct),
        "≤ 0.1 % of one core",
        Some(d.cpu_ticks_pct <= 0.1),
    );
    let row = |name: &str, x: &Idle| {
        format!(
            "| {name} | {} | {} | {:.3} % | {:.4} % | {} |\n",
            mib(x.rss_max_kib),
            mib(x.rss_end_kib),
            x.cpu_ticks_pct,
            x.cpu_ns_pct,
            x.threads
        )
    };
    report.section(
        "5. Idle footprint",
        format!(
            "{}\n\nBoth processes are registered with the emulated kubelet, which keeps their ListAndWatch streams \
             open, and are then left alone for {secs:.1} s after a 2 s settle. RSS is `VmRSS` of \
             `/proc/<pid>/status`, sampled every second; CPU is `utime + stime` of `/proc/<pid>/stat` (clock ticks \
             of 1/{} s) and, for resolution, the sum of the threads' `schedstat` run time.\n\n\
             | Process | RSS max | RSS at end | CPU (utime+stime) | CPU (schedstat) | threads |\n\
             | --- | --- | --- | --- | --- | --- |\n{}{}\n\
             Where devhost's idle CPU went (threads that ran at all, by schedstat): {}. A `drv-<driver>` thread \
             runs that driver's calls, and threads a driver starts from inside a call inherit its name; \
             `tokio-rt-worker` threads are the host's own.\n",
            demo.notes,
            node::clock_ticks(),
            row("devhost", &d),
            row("null plugin (baseline)", &n),
            if busy.is_empty() { "none".to_string() } else { busy.join(", ") }
        ),
    );
    Ok(())
}
