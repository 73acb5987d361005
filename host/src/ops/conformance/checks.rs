//! The checks, in the order a driver's life runs them: load, create, scan,
//! each hook, the kubelet's view, overlapping calls, a doorbell storm, and
//! create/destroy cycles that must not leak.

use super::{DEADLINE, Report, Verdict};
use crate::driver::callbacks::check_device_id;
use crate::driver::device::{Device, compose};
use crate::driver::instance::{CallError, Instance};
use crate::driver::loader::{self, Module};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Create/destroy cycles of the leak check, after a few warm-up ones.
const CYCLES: usize = 100;
const WARM_UP: usize = 5;
/// What 100 cycles may add before it counts as a leak.
const MAX_FD_GROWTH: i64 = 4;
const MAX_THREAD_GROWTH: i64 = 2;
const MAX_RSS_GROWTH_KIB: i64 = 16 * 1024;
/// Growth above this is reported (allocator noise stays well below it).
const WARN_RSS_GROWTH_KIB: i64 = 1024;

pub(super) async fn run(path: &Path, options: &[(String, String)]) -> Report {
    let mut r = Report { module: path.display().to_string(), outcomes: Vec::new() };
    let Some(module) = descriptor(&mut r, path) else { return r };
    let Some(inst) = create(&mut r, &module, options).await else { return r };
    let devices = scans(&mut r, &inst).await;
    ids_and_attributes(&mut r, &devices);
    links(&mut r, &devices);
    conflicts(&mut r, &devices);
    hooks(&mut r, &inst, &devices).await;
    inst.shutdown();
    super::node::kubelet_checks(&mut r, path, options, &devices).await;
    match loader::load(path) {
        Ok(m) => super::raw::concurrent(&mut r, m, options, &devices),
        Err(e) => r.add("concurrent calls", Verdict::Fail, format!("the module no longer loads: {e}")),
    }
    storm(&mut r, &module, options).await;
    cycles(&mut r, path, options).await;
    r
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

fn descriptor(r: &mut Report, path: &Path) -> Option<Module> {
    if let Err(problems) = loader::check_trust(path, None) {
        let text: Vec<String> = problems.iter().map(|e| e.to_string()).collect();
        r.add(
            "trust",
            Verdict::Warn,
            format!("an operator's devhost refuses this file as installed here: {}", text.join("; ")),
        );
    } else {
        r.add("trust", Verdict::Pass, "owner and permissions pass the host's checks");
    }
    let m = match loader::load(path) {
        Ok(m) => m,
        Err(e) => {
            r.add("handshake and descriptor", Verdict::Fail, e.to_string());
            return None;
        }
    };
    let hooks = match m.capabilities() {
        c if c.is_empty() => "no optional hooks".to_string(),
        c => c.join(", "),
    };
    let detail = format!("{} {} (ABI {}) [{hooks}]", m.name, m.version, m.abi_version());
    if !is_semver(m.version) {
        r.add("handshake and descriptor", Verdict::Warn, format!("{detail}: version is not MAJOR.MINOR.PATCH"));
    } else {
        r.add("handshake and descriptor", Verdict::Pass, detail);
    }
    Some(m)
}

fn is_semver(v: &str) -> bool {
    let core = v.split(['-', '+']).next().unwrap_or_default();
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

async fn create(r: &mut Report, module: &Module, options: &[(String, String)]) -> Option<Arc<Instance>> {
    let started = Instant::now();
    match Instance::create("conformance", *module, options, DEADLINE).await {
        Ok(inst) => {
            r.add("create", Verdict::Pass, format!("{} option(s), {}", options.len(), ms(started.elapsed())));
            Some(inst)
        }
        Err(e) => {
            r.add("create", Verdict::Fail, e.to_string());
            None
        }
    }
}

async fn scans(r: &mut Report, inst: &Instance) -> Vec<Device> {
    let started = Instant::now();
    let first = inst.scan().await;
    let took = started.elapsed();
    let second = inst.scan().await;
    match (first, second) {
        (Ok(a), Ok(b)) => {
            let ids = |d: &[Device]| d.iter().map(|d| d.id.clone()).collect::<Vec<_>>();
            let problems: Vec<String> = a.problems.iter().chain(b.problems.iter()).cloned().collect();
            if !problems.is_empty() {
                r.add("scan", Verdict::Fail, format!("the host refused part of the scan: {}", problems.join("; ")));
            } else if ids(&a.devices) != ids(&b.devices) {
                r.add(
                    "scan",
                    Verdict::Fail,
                    format!("two scans in a row differ: {:?} then {:?}", ids(&a.devices), ids(&b.devices)),
                );
            } else if a.devices.is_empty() {
                r.add("scan", Verdict::Warn, "no devices: the checks that need one are skipped");
            } else {
                r.add(
                    "scan",
                    Verdict::Pass,
                    format!("{} device(s), twice the same IDs, {}", a.devices.len(), ms(took)),
                );
            }
            a.devices
        }
        (Err(e), _) | (_, Err(e)) => {
            r.add("scan", Verdict::Fail, e.to_string());
            Vec::new()
        }
    }
}

/// Attribute keys an operator can write in a manifest's `match` without quoting surprises.
fn attribute_key_ok(k: &str) -> bool {
    !k.is_empty() && k.len() <= 63 && k.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-/".contains(&b))
}

fn ids_and_attributes(r: &mut Report, devices: &[Device]) {
    let mut bad = Vec::new();
    for d in devices {
        if let Err(why) = check_device_id(&d.id) {
            bad.push(format!("device ID {:?}: {why}", d.id));
        }
        for (k, v) in &d.attributes {
            if !attribute_key_ok(k) {
                bad.push(format!("device {}: attribute key {k:?} is not 1 to 63 of [A-Za-z0-9._-/]", d.id));
            }
            if v.chars().any(char::is_control) || v.len() > 1024 {
                bad.push(format!("device {}: attribute {k} has control characters or is over 1024 bytes", d.id));
            }
        }
    }
    match bad.is_empty() {
        true => r.add("IDs and attributes", Verdict::Pass, "valid for the kubelet and for manifest globs"),
        false => r.add("IDs and attributes", Verdict::Fail, bad.join("; ")),
    }
}

fn links(r: &mut Report, devices: &[Device]) {
    let known: BTreeSet<&str> = devices.iter().map(|d| d.id.as_str()).collect();
    let score = |from: &str, to: &str| -> Option<u32> {
        devices.iter().find(|d| d.id == from)?.links.iter().find(|(o, _)| o == to).map(|(_, s)| *s)
    };
    let (mut unknown, mut one_sided) = (Vec::new(), Vec::new());
    let mut count = 0;
    for d in devices {
        for (other, s) in &d.links {
            count += 1;
            if !known.contains(other.as_str()) {
                unknown.push(format!("{} -> {other:?}", d.id));
            } else if score(other, &d.id) != Some(*s) {
                one_sided.push(format!(
                    "{} -> {other} ({s}) but {other} -> {} ({:?})",
                    d.id,
                    d.id,
                    score(other, &d.id)
                ));
            }
        }
    }
    if count == 0 {
        r.add("links", Verdict::Skip, "the driver reports no link scores");
    } else if !unknown.is_empty() {
        r.add("links", Verdict::Fail, format!("links to IDs the scan does not report: {}", unknown.join(", ")));
    } else if !one_sided.is_empty() {
        r.add("links", Verdict::Warn, format!("one-sided or unequal scores: {}", one_sided.join("; ")));
    } else {
        r.add("links", Verdict::Pass, format!("{count} link(s), each reported from both ends with one score"));
    }
}

fn conflicts(r: &mut Report, devices: &[Device]) {
    let (_, found) = compose(devices.iter());
    match found.is_empty() {
        true => r.add("edits between devices", Verdict::Pass, "all devices in one container compose without conflicts"),
        false if found.unshown() == 0 => r.add("edits between devices", Verdict::Fail, found.shown().join("; ")),
        false => r.add(
            "edits between devices",
            Verdict::Fail,
            format!("{}; and {} more", found.shown().join("; "), found.unshown()),
        ),
    }
}

fn answered<T>(r: &mut Report, check: &'static str, started: Instant, result: Result<T, CallError>) -> Option<T> {
    match result {
        Ok(v) => {
            r.add(check, Verdict::Pass, format!("answered in {}", ms(started.elapsed())));
            Some(v)
        }
        Err(e) => {
            r.add(check, Verdict::Fail, e.to_string());
            None
        }
    }
}

/// Each optional hook once, the way a pod's life calls them, within the deadline.
async fn hooks(r: &mut Report, inst: &Instance, devices: &[Device]) {
    let m = inst.module.clone();
    let first: Vec<String> = devices.iter().take(1).map(|d| d.id.clone()).collect();
    let none = |r: &mut Report, check, what: &str| r.add(check, Verdict::Skip, format!("no {what} hook"));
    if !m.watch {
        none(r, "watch_start", "watch");
    } else {
        let t = Instant::now();
        answered(r, "watch_start", t, inst.watch_start().await);
    }
    if first.is_empty() {
        for check in ["allocate", "preferred_allocation", "pre_start", "release after the pod ends"] {
            r.add(check, Verdict::Skip, "no device to call it with");
        }
        return;
    }
    if !m.allocate {
        none(r, "allocate", "allocate");
    } else {
        let t = Instant::now();
        answered(r, "allocate", t, inst.allocate(first.clone()).await);
    }
    if !m.preferred_allocation {
        none(r, "preferred_allocation", "preferred_allocation");
    } else {
        let all: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
        let size = all.len().min(2) as u32;
        let t = Instant::now();
        let result = inst.preferred(all.clone(), first.clone(), size).await;
        let took = t.elapsed();
        match result {
            Ok(Some(ids)) if !ids.starts_with(&first) || ids.iter().any(|i| !all.contains(i)) => r.add(
                "preferred_allocation",
                Verdict::Warn,
                format!(
                    "proposed {ids:?} for must_include {first:?} of {all:?}: the host repairs it and logs a warning"
                ),
            ),
            Ok(_) => r.add("preferred_allocation", Verdict::Pass, format!("answered in {}", ms(took))),
            Err(e) => r.add("preferred_allocation", Verdict::Fail, e.to_string()),
        }
    }
    if !m.pre_start {
        none(r, "pre_start", "pre_start");
    } else {
        let t = Instant::now();
        answered(r, "pre_start", t, inst.pre_start(first.clone()).await);
    }
    if !m.release {
        none(r, "release after the pod ends", "release");
    } else {
        // The pod that got `first` ended: release once, then again as the
        // host's retry after a missed deadline would (it must be repeatable).
        let t = Instant::now();
        let once = inst.release(first.clone()).await;
        let took = t.elapsed();
        let again = inst.release(first.clone()).await;
        let refused =
            |e: &CallError| matches!(e, CallError::Status { code, .. } if *code != devhost_abi::DEVHOST_ERR_NOT_FOUND);
        match (once, again) {
            (Err(e), _) if refused(&e) => r.add("release after the pod ends", Verdict::Fail, e.to_string()),
            (_, Err(e)) if refused(&e) => {
                r.add("release after the pod ends", Verdict::Fail, format!("a repeated release failed: {e}"))
            }
            (Err(e), _) | (_, Err(e)) if !matches!(e, CallError::Status { .. }) => {
                r.add("release after the pod ends", Verdict::Fail, e.to_string())
            }
            _ => r.add(
                "release after the pod ends",
                Verdict::Pass,
                format!("{} for {first:?}, and repeatable", ms(took)),
            ),
        }
    }
}

/// A storm of `devices_changed` from several threads while the host rescans
/// on each doorbell, as the registry does: every rescan answers in time with
/// the same devices.
async fn storm(r: &mut Report, module: &Module, options: &[(String, String)]) {
    const THREADS: usize = 8;
    const RINGS: usize = 2_000;
    let inst = match Instance::create("conformance-storm", *module, options, DEADLINE).await {
        Ok(i) => i,
        Err(e) => return r.add("devices_changed storm", Verdict::Fail, e.to_string()),
    };
    let before = inst.scan().await.map(|o| o.devices.into_iter().map(|d| d.id).collect::<Vec<_>>());
    let ringers: Vec<_> = (0..THREADS)
        .map(|_| {
            let changed = inst.changed.clone();
            std::thread::spawn(move || {
                for _ in 0..RINGS {
                    changed.notify_one();
                    std::thread::yield_now();
                }
            })
        })
        .collect();
    let started = Instant::now();
    let mut rescans = 0;
    let mut verdict = Ok(());
    while !ringers.iter().all(|t| t.is_finished()) || rescans == 0 {
        if tokio::time::timeout(Duration::from_millis(50), inst.changed.notified()).await.is_err() {
            continue;
        }
        rescans += 1;
        match inst.scan().await {
            Ok(o)
                if before.as_ref().is_ok_and(|b| *b == o.devices.iter().map(|d| d.id.clone()).collect::<Vec<_>>()) => {}
            Ok(o) => {
                verdict = Err(format!("a rescan reported {} device(s), not the {:?} before", o.devices.len(), before));
                break;
            }
            Err(e) => {
                verdict = Err(e.to_string());
                break;
            }
        }
    }
    for t in ringers {
        let _ = t.join();
    }
    inst.shutdown();
    match verdict {
        Ok(()) => r.add(
            "devices_changed storm",
            Verdict::Pass,
            format!(
                "{} rings from {THREADS} threads coalesced into {rescans} rescan(s), all consistent, {}",
                THREADS * RINGS,
                ms(started.elapsed())
            ),
        ),
        Err(e) => r.add("devices_changed storm", Verdict::Fail, e),
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

async fn cycle(module: &Module, options: &[(String, String)], watch: bool) -> Result<(), CallError> {
    let inst = Instance::create("conformance-cycle", *module, options, DEADLINE).await?;
    let result = async {
        if watch {
            inst.watch_start().await?;
        }
        inst.scan().await.map(drop)
    }
    .await;
    inst.shutdown();
    result
}

/// `destroy` then `create`, 100 times: descriptors, threads and memory stay put.
async fn cycles(r: &mut Report, path: &Path, options: &[(String, String)]) {
    const CHECK: &str = "create/destroy x100";
    let module = match loader::load(path) {
        Ok(m) => m,
        Err(e) => return r.add(CHECK, Verdict::Fail, e.to_string()),
    };
    let watch = module.watch_start().is_some();
    for _ in 0..WARM_UP {
        if let Err(e) = cycle(&module, options, watch).await {
            return r.add(CHECK, Verdict::Fail, e.to_string());
        }
    }
    let settle = || async {
        // A destroyed instance's worker thread ends after destroy returns.
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    settle().await;
    let before = footprint();
    let started = Instant::now();
    for n in 0..CYCLES {
        if let Err(e) = cycle(&module, options, watch).await {
            return r.add(CHECK, Verdict::Fail, format!("cycle {}: {e}", n + 1));
        }
    }
    let took = started.elapsed();
    // Destroy runs on each worker thread as it ends: wait until they are
    // gone (or 10 s), so what is left over is what the driver left.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = footprint();
    while after.1 > before.1 && Instant::now() < deadline {
        settle().await;
        after = footprint();
    }
    let growth =
        BTreeMap::from([("fds", after.0 - before.0), ("threads", after.1 - before.1), ("rss_kib", after.2 - before.2)]);
    let detail = format!(
        "{CYCLES} cycles{} in {}: fds {:+}, threads {:+}, memory {:+} KiB",
        if watch { " with watch_start" } else { "" },
        ms(took),
        growth["fds"],
        growth["threads"],
        growth["rss_kib"]
    );
    if growth["fds"] > MAX_FD_GROWTH || growth["threads"] > MAX_THREAD_GROWTH || growth["rss_kib"] > MAX_RSS_GROWTH_KIB
    {
        r.add(CHECK, Verdict::Fail, format!("{detail} (allowed: fds +{MAX_FD_GROWTH}, threads +{MAX_THREAD_GROWTH}, memory +{MAX_RSS_GROWTH_KIB} KiB)"));
    } else if growth["rss_kib"] > WARN_RSS_GROWTH_KIB {
        let per_cycle = growth["rss_kib"] as f64 / CYCLES as f64;
        r.add(CHECK, Verdict::Warn, format!("{detail}: about {per_cycle:.0} KiB per cycle stays behind"));
    } else {
        r.add(CHECK, Verdict::Pass, detail);
    }
}
