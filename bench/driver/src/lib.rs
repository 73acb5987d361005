//! The benchmarks' driver module (`libdevhost_benchdrv.so`). It invents
//! `count` devices with container edits and optional link scores, and its
//! watch thread blocks on a unix datagram socket (option `trigger`) so that
//! the bench can change device health at an exact instant: no polling period
//! hides the host's own propagation delay.
//!
//! Options:
//! - `count`: devices, 0..=100000 (default 8); IDs are `<prefix>-<i>`
//! - `prefix`: ID prefix (default `b`)
//! - `numa_nodes`: device i is on node i % numa_nodes (with `link_group`, its
//!   whole group is on one node); 0 = no NUMA (default 2)
//! - `link_group`: devices in the same run of this many consecutive indices are
//!   linked (40 within a pair, 20 within a quad, 10 otherwise); 0 = no links
//! - `trigger`: path of the datagram socket to bind; each datagram is the full
//!   comma-separated list of unhealthy device indices (empty: all healthy)

use devhost_sdk::{Driver, Edits, Error, Health, Hooks, Host, Options, Result, Scan};
use std::collections::HashSet;
use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

const MAX_COUNT: u32 = 100_000;

struct BenchDriver {
    host: Host,
    count: u32,
    prefix: String,
    numa_nodes: u32,
    link_group: u32,
    trigger: Option<PathBuf>,
    /// Indices the latest trigger datagram marked unhealthy.
    unhealthy: Arc<Mutex<HashSet<u32>>>,
    stop: Arc<AtomicBool>,
    watcher: Mutex<Option<JoinHandle<()>>>,
}

/// Parses a datagram: comma-separated indices below `count`; others are ignored.
fn parse_unhealthy(text: &str, count: u32) -> HashSet<u32> {
    text.split(',').filter_map(|s| s.trim().parse::<u32>().ok()).filter(|&i| i < count).collect()
}

/// The link score between devices `a` and `b` (0: not linked).
fn link_score(a: u32, b: u32, group: u32) -> u32 {
    if group == 0 || a == b || a / group != b / group {
        0
    } else if a / 2 == b / 2 {
        40
    } else if a / 4 == b / 4 {
        20
    } else {
        10
    }
}

impl BenchDriver {
    fn id(&self, i: u32) -> String {
        format!("{}-{i}", self.prefix)
    }

    /// Blocks on the trigger socket; every datagram replaces the unhealthy set
    /// and tells the host at once.
    fn watch_loop(
        sock: UnixDatagram,
        host: Host,
        count: u32,
        unhealthy: Arc<Mutex<HashSet<u32>>>,
        stop: Arc<AtomicBool>,
    ) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sock.recv(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    host.log(log::Level::Error, &format!("benchdrv: trigger socket failed, watch ends: {e}"));
                    return;
                }
            };
            if stop.load(Ordering::Acquire) {
                return;
            }
            let text = String::from_utf8_lossy(&buf[..n]);
            *unhealthy.lock().unwrap_or_else(PoisonError::into_inner) = parse_unhealthy(&text, count);
            host.devices_changed();
        }
    }
}

impl Driver for BenchDriver {
    const HOOKS: Hooks = Hooks { allocate: true, watch: true, ..Hooks::NONE };

    fn create(host: Host, options: &Options) -> Result<Self> {
        options.deny_unknown(&["count", "prefix", "numa_nodes", "link_group", "trigger"])?;
        let count: u32 = options.parse_or("count", 8)?;
        if count > MAX_COUNT {
            return Err(Error::invalid_argument(format!("option \"count\": {count} is above {MAX_COUNT}")));
        }
        Ok(BenchDriver {
            host,
            count,
            prefix: options.get_or("prefix", "b").to_string(),
            numa_nodes: options.parse_or("numa_nodes", 2)?,
            link_group: options.parse_or("link_group", 0)?,
            trigger: options.get("trigger").map(PathBuf::from),
            unhealthy: Arc::new(Mutex::new(HashSet::new())),
            stop: Arc::new(AtomicBool::new(false)),
            watcher: Mutex::new(None),
        })
    }

    fn scan(&self, scan: &mut Scan<'_>) -> Result<()> {
        let unhealthy = self.unhealthy.lock().unwrap_or_else(PoisonError::into_inner).clone();
        for i in 0..self.count {
            let id = self.id(i);
            let health = if unhealthy.contains(&i) { Health::Unhealthy } else { Health::Healthy };
            // A link group shares a NUMA node, as GPUs on one board share a socket.
            let slot = i.checked_div(self.link_group).unwrap_or(i);
            let numa = (self.numa_nodes > 0).then(|| slot % self.numa_nodes);
            let mut dev = scan.device(&id, health, numa);
            dev.attr("index", &i.to_string())
                .device_node("/dev/null", &format!("/dev/bench{i}"), "rw")
                .env("BENCH_VISIBLE_DEVICES", &id);
            if let Some(group) = i.checked_div(self.link_group) {
                let first = group * self.link_group;
                for j in first..(first + self.link_group).min(self.count) {
                    let score = link_score(i, j, self.link_group);
                    if score > 0 {
                        dev.link(&self.id(j), score);
                    }
                }
            }
        }
        Ok(())
    }

    fn allocate(&self, device_ids: &[&str], edits: &mut Edits<'_>) -> Result<()> {
        edits.env("BENCH_ALLOCATED", &device_ids.join(","));
        Ok(())
    }

    fn watch_start(&self) -> Result<()> {
        let Some(path) = &self.trigger else { return Ok(()) };
        // A stale socket file from an earlier run would make bind fail.
        let _ = std::fs::remove_file(path);
        let sock = UnixDatagram::bind(path)
            .map_err(|e| Error::unavailable(format!("cannot bind the trigger socket {}: {e}", path.display())))?;
        let (host, count, unhealthy, stop) = (self.host, self.count, self.unhealthy.clone(), self.stop.clone());
        stop.store(false, Ordering::Release);
        let handle = std::thread::Builder::new()
            .name("benchdrv-watch".into())
            .spawn(move || Self::watch_loop(sock, host, count, unhealthy, stop))
            .map_err(|e| Error::internal(format!("cannot start the watch thread: {e}")))?;
        *self.watcher.lock().unwrap_or_else(PoisonError::into_inner) = Some(handle);
        Ok(())
    }

    fn watch_stop(&self) {
        let Some(handle) = self.watcher.lock().unwrap_or_else(PoisonError::into_inner).take() else { return };
        self.stop.store(true, Ordering::Release);
        if let Some(path) = &self.trigger {
            // Wake the blocked recv; if the socket is already gone the thread
            // has ended on its error.
            if let Ok(waker) = UnixDatagram::unbound() {
                let _ = waker.send_to(b"", path);
            }
            let _ = std::fs::remove_file(path);
        }
        let _ = handle.join();
    }
}

devhost_sdk::export_driver!(
    BenchDriver,
    name = "benchdrv",
    version = "0.0.1",
    description = "Benchmark devices with instant, socket-triggered health changes"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trigger_text_lists_unhealthy_indices_within_count() {
        let got = parse_unhealthy("3, 7,x,,12", 10);
        assert_eq!(got, HashSet::from([3, 7]));
        assert!(parse_unhealthy("", 10).is_empty());
    }

    #[test]
    fn link_scores_follow_pairs_quads_and_groups() {
        assert_eq!(link_score(0, 1, 8), 40);
        assert_eq!(link_score(0, 3, 8), 20);
        assert_eq!(link_score(0, 7, 8), 10);
        assert_eq!(link_score(0, 8, 8), 0);
        assert_eq!(link_score(0, 1, 0), 0);
    }
}
