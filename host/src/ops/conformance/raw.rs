//! The module's functions called straight from its descriptor, with the
//! host's real callbacks, in a probe process ([`super::probe`]): overlapping
//! calls into one instance for a driver that claims `DEVHOST_CAP_CONCURRENT`
//! (the host serialises every call whatever the bit says, so `Instance`
//! cannot make them overlap), and 100 create/destroy cycles in one process
//! (through the daemon's in-process instance) that must not leak. Each call is announced first, so that a crash or a
//! hang is reported against it.

use super::channel::calling;
use super::report::{DEADLINE, Report, Verdict};
use crate::driver::callbacks::{self, HostCtx};
use crate::driver::instance::Instance;
use crate::driver::invoke::{Hook, invoke};
use crate::driver::loader::{self, Module};
use devhost_abi as abi;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const THREADS: usize = 8;
const ROUNDS: usize = 50;
/// Create/destroy cycles of the leak check, after a few warm-up ones.
const CYCLES: usize = 100;
const WARM_UP: usize = 5;
/// What 100 cycles may add before it counts as a leak.
const MAX_FD_GROWTH: i64 = 4;
const MAX_THREAD_GROWTH: i64 = 2;
const MAX_RSS_GROWTH_KIB: i64 = 16 * 1024;
/// Growth above this is reported (allocator noise stays well below it).
const WARN_RSS_GROWTH_KIB: i64 = 1024;

/// The host side one raw instance points into; boxed so its address is stable.
struct HostSide {
    ctx: HostCtx,
    api: abi::devhost_host_api,
}

/// One instance made straight from the descriptor; destroyed on drop.
struct Raw {
    m: Module,
    inst: Shared,
    /// Outlives the instance: the driver keeps pointers into it.
    _host: Box<HostSide>,
}

/// The instance pointer, shared by the threads of a concurrent driver.
#[derive(Clone, Copy)]
struct Shared(*mut c_void);
// SAFETY: only shared across threads for a driver that declared
// DEVHOST_CAP_CONCURRENT: it is thread-safe.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Raw {
    fn create(m: Module, options: &[(String, String)]) -> Result<Raw, String> {
        let mut host = Box::new(HostSide {
            ctx: HostCtx { driver: "conformance".into(), changed: Arc::new(tokio::sync::Notify::new()), notice: None },
            api: callbacks::host_api(std::ptr::null_mut()),
        });
        let ctx_ptr: *mut HostCtx = &mut host.ctx;
        host.api.host_ctx = ctx_ptr.cast();
        calling("create");
        // SAFETY: the API table lives in `host`, which the Raw keeps past destroy.
        let (status, state, inst) = unsafe { m.create_instance(&host.api, options) };
        if status != abi::DEVHOST_OK {
            return Err(format!("create returned {status}: {}", state.error.unwrap_or_default()));
        }
        Ok(Raw { m, inst: Shared(inst), _host: host })
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        // Announced one by one (`Module::teardown` does both): a crash names its call.
        if let Some(stop) = self.m.watch_stop() {
            calling("watch_stop");
            // SAFETY: a live instance no other call runs on; not used afterwards.
            unsafe { stop(self.inst.0) };
        }
        if let Some(destroy) = self.m.desc.destroy {
            calling("destroy");
            // SAFETY: as above; destroy is called exactly once.
            unsafe { destroy(self.inst.0) };
        }
    }
}

/// One scan: the device IDs, or what went wrong.
fn scan(m: &Module, inst: Shared) -> Result<Vec<String>, String> {
    calling("scan");
    // SAFETY: a live instance, shared only by a concurrent driver (DEVHOST_CAP_CONCURRENT).
    let (status, state) = unsafe { invoke(m, inst.0, Hook::Scan) };
    if status != abi::DEVHOST_OK {
        return Err(format!("scan returned {status}: {}", state.error.unwrap_or_default()));
    }
    Ok(state.devices.into_iter().map(|d| d.id).collect())
}

/// One round of every concurrent call; the first problem, if any.
fn round(m: &Module, inst: Shared, expected: &[String], first: &[String]) -> Result<(), String> {
    let ids = scan(m, inst)?;
    if ids != expected {
        return Err(format!("an overlapping scan reported {ids:?}, not {expected:?}"));
    }
    let calls = [
        (m.allocate().is_some(), Hook::Allocate(first, None)),
        (m.pre_start().is_some(), Hook::PreStart(first)),
        (m.release().is_some(), Hook::Release(first)),
        (
            m.preferred_allocation().is_some(),
            Hook::Preferred { available: expected, must: first, size: first.len() as u32 },
        ),
    ];
    for (_, hook) in calls.into_iter().filter(|(has, _)| *has) {
        calling(hook.name());
        // SAFETY: as in `scan`.
        let (status, state) = unsafe { invoke(m, inst.0, hook) };
        let not_found_ok = !matches!(hook, Hook::Preferred { .. });
        if status != abi::DEVHOST_OK && !(not_found_ok && status == abi::DEVHOST_ERR_NOT_FOUND) {
            return Err(format!("{} returned {status}: {}", hook.name(), state.error.unwrap_or_default()));
        }
    }
    Ok(())
}

fn load(r: &mut Report, check: &'static str, path: &Path) -> Option<Module> {
    calling("load");
    match loader::load(path) {
        Ok(m) => Some(m),
        Err(e) => {
            r.add(check, Verdict::Fail, format!("the module does not load: {e}"));
            None
        }
    }
}

/// Overlapping calls from several threads into one instance; a deadlock is
/// the probe's hang, which the battery reports.
pub(super) fn concurrent(r: &mut Report, path: &Path, options: &[(String, String)]) {
    const CHECK: &str = "concurrent calls";
    let Some(m) = load(r, CHECK, path) else { return };
    if !m.concurrent() {
        return r.add(CHECK, Verdict::Skip, "the driver does not claim DEVHOST_CAP_CONCURRENT: calls never overlap");
    }
    let raw = match Raw::create(m, options) {
        Ok(raw) => raw,
        Err(e) => return r.add(CHECK, Verdict::Fail, e),
    };
    let expected = match scan(&m, raw.inst) {
        Ok(ids) => Arc::new(ids),
        Err(e) => return r.add(CHECK, Verdict::Fail, e),
    };
    let first: Arc<Vec<String>> = Arc::new(expected.iter().take(1).cloned().collect());
    let start = Arc::new(Barrier::new(THREADS));
    let inst = raw.inst;
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let (start, expected, first) = (start.clone(), expected.clone(), first.clone());
            std::thread::spawn(move || {
                start.wait();
                (0..ROUNDS).try_for_each(|_| round(&m, inst, &expected, &first))
            })
        })
        .collect();
    let failures: Vec<String> = threads
        .into_iter()
        .filter_map(|t| t.join().unwrap_or_else(|_| Err("a calling thread panicked".into())).err())
        .collect();
    // Every thread has returned: destroy runs alone.
    drop(raw);
    match failures.into_iter().next() {
        None => r.add(
            CHECK,
            Verdict::Pass,
            format!("{THREADS} threads x {ROUNDS} rounds of every concurrent call, all consistent"),
        ),
        Some(e) => r.add(CHECK, Verdict::Fail, e),
    }
}

/// Open descriptors, threads and resident memory of this process.
fn footprint() -> (i64, i64, i64) {
    let count = |dir: &str| std::fs::read_dir(dir).map(|d| d.count() as i64).unwrap_or(-1);
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse::<i64>().ok()))
        })
        .unwrap_or(-1);
    (count("/proc/self/fd"), count("/proc/self/task"), rss)
}

/// create, watch_start, scan, watch_stop and destroy, once, through the
/// daemon's in-process instance (a thread of its own that ends after
/// destroy). Waits for that thread to end, so that a crash in destroy is
/// reported against destroy.
fn cycle(rt: &tokio::runtime::Runtime, m: Module, options: &[(String, String)]) -> Result<(), String> {
    let threads = footprint().1;
    rt.block_on(async {
        calling("create");
        let inst = Instance::create("conformance-cycle", m, options, DEADLINE).await.map_err(|e| e.to_string())?;
        let result = async {
            if m.watch_start().is_some() {
                calling("watch_start");
                inst.watch_start().await?;
            }
            calling("scan");
            inst.scan().await.map(drop)
        }
        .await;
        calling("destroy");
        inst.shutdown();
        let until = Instant::now() + DEADLINE;
        while footprint().1 > threads && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        result.map_err(|e| e.to_string())
    })
}

/// `destroy` then `create`, 100 times in this process: descriptors, threads
/// and memory stay put.
pub(super) fn cycles(r: &mut Report, path: &Path, options: &[(String, String)]) {
    const CHECK: &str = "create/destroy x100";
    let Some(m) = load(r, CHECK, path) else { return };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return r.add(CHECK, Verdict::Fail, format!("cannot start an async runtime: {e}")),
    };
    for _ in 0..WARM_UP {
        if let Err(e) = cycle(&rt, m, options) {
            return r.add(CHECK, Verdict::Fail, e);
        }
    }
    // A driver's watch threads may end a moment after watch_stop returns.
    let settle = || std::thread::sleep(Duration::from_millis(300));
    settle();
    let before = footprint();
    let started = Instant::now();
    for n in 0..CYCLES {
        if let Err(e) = cycle(&rt, m, options) {
            return r.add(CHECK, Verdict::Fail, format!("cycle {}: {e}", n + 1));
        }
    }
    let took = started.elapsed();
    // Wait until the driver's threads are gone (or 10 s), so that what is
    // left over is what the driver left.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = footprint();
    while after.1 > before.1 && Instant::now() < deadline {
        settle();
        after = footprint();
    }
    let growth =
        BTreeMap::from([("fds", after.0 - before.0), ("threads", after.1 - before.1), ("rss_kib", after.2 - before.2)]);
    let watch = m.watch_start().is_some();
    let detail = format!(
        "{CYCLES} cycles{} in {} ms: fds {:+}, threads {:+}, memory {:+} KiB",
        if watch { " with watch_start" } else { "" },
        took.as_millis(),
        growth["fds"],
        growth["threads"],
        growth["rss_kib"]
    );
    if growth["fds"] > MAX_FD_GROWTH || growth["threads"] > MAX_THREAD_GROWTH || growth["rss_kib"] > MAX_RSS_GROWTH_KIB
    {
        let allowed = format!("fds +{MAX_FD_GROWTH}, threads +{MAX_THREAD_GROWTH}, memory +{MAX_RSS_GROWTH_KIB} KiB");
        r.add(CHECK, Verdict::Fail, format!("{detail} (allowed: {allowed})"));
    } else if growth["rss_kib"] > WARN_RSS_GROWTH_KIB {
        let per_cycle = growth["rss_kib"] as f64 / CYCLES as f64;
        r.add(CHECK, Verdict::Warn, format!("{detail}: about {per_cycle:.0} KiB per cycle stays behind"));
    } else {
        r.add(CHECK, Verdict::Pass, detail);
    }
}
