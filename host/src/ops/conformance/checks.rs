//! The checks, in the order a driver's life runs them: load, create, scan,
//! each hook, the kubelet's view, overlapping calls, a doorbell storm, and
//! create/destroy cycles that must not leak.

use super::probe::{self, Probe};
use super::report::{Report, Verdict};
use super::subject::Subject;
use crate::driver::callbacks::check_device_id;
use crate::driver::device::{Device, compose};
use crate::driver::loader;
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

pub(super) async fn run(path: &Path, options: &[(String, String)]) -> Report {
    let mut r = Report { module: path.display().to_string(), outcomes: Vec::new() };
    trust(&mut r, path);
    if probe::run(&mut r, Probe::Handshake, path, options).await == Verdict::Fail {
        return r;
    }
    let mut subject = create(&mut r, path, options).await;
    let devices = scans(&mut r, &mut subject).await;
    ids_and_attributes(&mut r, &devices);
    links(&mut r, &devices);
    conflicts(&mut r, &devices);
    super::hooks::run(&mut r, &mut subject, &devices).await;
    super::hooks::destroy(&mut r, &mut subject).await;
    super::node::kubelet_checks(&mut r, path, options, &devices).await;
    probe::run(&mut r, Probe::Concurrent, path, options).await;
    storm(&mut r, path, options).await;
    probe::run(&mut r, Probe::Cycles, path, options).await;
    r
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

fn trust(r: &mut Report, path: &Path) {
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
}

/// `dlopen`, the entry point and the descriptor: in a probe process, where
/// a module that crashes while loading takes only the probe down.
pub(super) fn handshake(r: &mut Report, path: &Path) {
    super::channel::calling("load");
    let m = match loader::load(path) {
        Ok(m) => m,
        Err(e) => return r.add("handshake and descriptor", Verdict::Fail, e.to_string()),
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
}

fn is_semver(v: &str) -> bool {
    let core = v.split(['-', '+']).next().unwrap_or_default();
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// The first worker and its `create`; when that fails, one more worker
/// for the checks that follow (a module that fails once may work again).
async fn create(r: &mut Report, path: &Path, options: &[(String, String)]) -> Subject {
    let started = Instant::now();
    let (mut subject, created) = Subject::start("conformance", path, options).await;
    match created {
        Ok(()) => r.add(
            "create",
            Verdict::Pass,
            format!("{} option(s), {} in a worker process", options.len(), ms(started.elapsed())),
        ),
        Err(e) => {
            r.add("create", Verdict::Fail, e);
            subject.restart().await;
        }
    }
    subject
}

async fn scans(r: &mut Report, s: &mut Subject) -> Vec<Device> {
    let inst = match s.live() {
        Ok(inst) => inst.clone(),
        Err(why) => {
            r.add("scan", Verdict::Skip, why);
            return Vec::new();
        }
    };
    let (started, pid) = (Instant::now(), s.pid());
    let first = inst.scan().await;
    let took = started.elapsed();
    let second = match &first {
        Ok(_) => inst.scan().await,
        Err(e) => Err(e.clone()),
    };
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
            let why = s.failed("scan", pid, e).await;
            let devices = rescan(s).await;
            match devices.len() {
                0 => r.add("scan", Verdict::Fail, why),
                n => r.add(
                    "scan",
                    Verdict::Fail,
                    format!("{why}; a new worker's scan found {n} device(s) for the checks below"),
                ),
            }
            devices
        }
    }
}

/// After a failed scan: the devices of one more, for the checks that need some.
async fn rescan(s: &mut Subject) -> Vec<Device> {
    let Ok(inst) = s.live().cloned() else { return Vec::new() };
    let pid = s.pid();
    match inst.scan().await {
        Ok(o) => o.devices,
        Err(e) => {
            s.failed("scan", pid, e).await;
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

/// A storm of `devices_changed` from several threads while the host rescans
/// on each doorbell, as the registry does: every rescan answers in time with
/// the same devices.
async fn storm(r: &mut Report, path: &Path, options: &[(String, String)]) {
    const CHECK: &str = "devices_changed storm";
    const THREADS: usize = 8;
    const RINGS: usize = 2_000;
    let (mut s, created) = Subject::start("conformance-storm", path, options).await;
    let inst = match (created, s.live()) {
        (Ok(()), Ok(inst)) => inst.clone(),
        (Err(why), _) | (_, Err(why)) => return r.add(CHECK, Verdict::Fail, why),
    };
    let ids = |devices: &[Device]| devices.iter().map(|d| d.id.clone()).collect::<Vec<_>>();
    let pid = s.pid();
    let before = match inst.scan().await {
        Ok(o) => ids(&o.devices),
        Err(e) => {
            let why = s.failed("scan", pid, e).await;
            return r.add(CHECK, Verdict::Fail, why);
        }
    };
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
            Ok(o) if ids(&o.devices) == before => {}
            Ok(o) => {
                verdict = Err(format!("a rescan reported {:?}, not the {before:?} before", ids(&o.devices)));
                break;
            }
            Err(e) => {
                verdict = Err(s.failed("scan", pid, e).await);
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
