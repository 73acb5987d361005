//! Process isolation at the instance level: an isolated driver answers as
//! the in-process one does, and a worker that segfaults, aborts, exits or
//! hangs fails only its own calls (UNAVAILABLE / DEADLINE_EXCEEDED), is
//! restarted, and serves again. Crashing drivers are compiled here from
//! tests/fixtures/crash_driver.c; the worker is the real `devhost` binary.

use crate::common::*;
use devhost::driver::instance::{CallError, Instance};
use devhost::manifest::{DriverConfig, Manifest};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A driver table as an operator writes it, parsed by the real manifest code.
fn config(module: &Path, extra: &str, options: &str) -> DriverConfig {
    let text = format!(
        "[driver.d]\nmodule = \"{}\"\n{extra}\n[driver.d.options]\n{options}\n[[resource]]\nname = \"t.com/d\"\ndriver = \"d\"\n",
        module.display()
    );
    let mut m = Manifest::parse(&text, Path::new("/tmp/devhost.toml"), None).expect("test manifest parses");
    m.drivers.remove("d").expect("driver d")
}

async fn isolated(module: &Path, extra: &str, options: &str) -> Result<Arc<Instance>, CallError> {
    devhost::driver::isolation::set_worker_program(devhost_bin());
    let cfg = config(module, &format!("isolation = \"process\"\n{extra}"), options);
    Instance::create_isolated(&cfg, module, false).await
}

fn crash_driver(dir: &Path) -> PathBuf {
    let out = dir.join("libcrashy.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &out, &abi_include());
    out
}

/// A crashy instance that misbehaves `how` in `hook` once `arm` exists.
async fn crashy(dir: &Path, hook: &str, how: &str, timeout: &str) -> (Arc<Instance>, PathBuf) {
    let arm = dir.join("arm");
    let options = format!("crash_in = \"{hook}\"\nhow = \"{how}\"\narm_file = \"{}\"", arm.display());
    let inst = isolated(&crash_driver(dir), &format!("call_timeout = \"{timeout}\""), &options).await.unwrap();
    (inst, arm)
}

/// The error of a call that must fail.
fn fails<T>(r: Result<T, CallError>) -> CallError {
    match r {
        Ok(_) => panic!("the call succeeded"),
        Err(e) => e,
    }
}

fn ids(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[tokio::test]
async fn isolated_driver_answers_like_the_in_process_one() {
    let so = module("example_c");
    let options = "count = 4\nnuma_nodes = 2";
    let cfg = config(&so, "", options);
    let local = Instance::create("d", devhost::driver::loader::load(&so).unwrap(), &cfg.options, cfg.call_timeout)
        .await
        .unwrap();
    let remote = isolated(&so, "", options).await.unwrap();
    let pid = remote.worker_pid().expect("a worker process");
    assert_ne!(pid, std::process::id());
    assert_eq!(remote.module, local.module, "the worker reports the same descriptor facts");
    assert!(remote.module.pre_start && remote.module.allocate);
    assert_eq!(remote.scan().await.unwrap().devices, local.scan().await.unwrap().devices);
    let req = ids(&["example-2", "example-0"]);
    assert_eq!(remote.allocate(req.clone(), None).await.unwrap(), local.allocate(req.clone(), None).await.unwrap());
    remote.pre_start(req.clone()).await.unwrap();
    assert_eq!(remote.release(req.clone()).await.unwrap(), local.release(req.clone()).await.unwrap());
    // A DRA claim's parameters (ABI 1.3) cross to the worker and reach the driver's allocate.
    assert!(remote.module.reads_claim_parameters(), "the C example declares DEVHOST_CAP_CLAIM_PARAMETERS");
    let hello = Some(r#"[{"greeting":"hello"},{"greeting":"bye"}]"#.to_owned());
    let edits = remote.allocate(req.clone(), hello.clone()).await.unwrap().unwrap();
    assert_eq!(edits, local.allocate(req.clone(), hello).await.unwrap().unwrap());
    let greeting = edits.envs.iter().find(|(k, _)| k == "EXAMPLE_GREETING");
    assert_eq!(greeting.map(|(_, v)| v.as_str()), Some("bye"), "the last entry wins: {edits:?}");
    let bad = Some(r#"[{"colour":"red"}]"#.to_owned());
    let error = remote.allocate(req.clone(), bad).await.unwrap_err().to_string();
    assert!(error.contains("INVALID_ARGUMENT") && error.contains(r#"unknown parameter "colour""#), "{error}");
    let none = remote.allocate(req, None).await.unwrap().unwrap();
    assert!(none.envs.iter().all(|(k, _)| k != "EXAMPLE_GREETING"), "a container gets no greeting");
    assert_eq!(remote.worker_pid(), Some(pid), "no restart happened");
}

#[tokio::test]
async fn a_crash_fails_the_call_in_flight_with_unavailable_then_the_worker_restarts() {
    for how in ["segv", "abort", "exit"] {
        let dir = tempfile::tempdir().unwrap();
        let (inst, arm) = crashy(dir.path(), "allocate", how, "5s").await;
        let first = inst.worker_pid().unwrap();
        assert_eq!(inst.allocate(ids(&["crash-0"]), None).await.unwrap().unwrap().envs[0].1, "1");
        std::fs::write(&arm, "").unwrap();
        let err = fails(inst.allocate(ids(&["crash-0"]), None).await);
        assert_eq!(tonic::Status::from(&err).code(), tonic::Code::Unavailable, "{how}: {err}");
        assert!(err.to_string().contains("during allocate"), "{how}: {err}");
        // Broken at once, so the registry reports the devices Unhealthy.
        assert!(inst.poisoned(), "{how}: not reported broken right after the crash");
        eventually_within(&format!("{how}: restart"), Duration::from_secs(10), || !inst.poisoned()).await;
        let second = inst.worker_pid().unwrap();
        assert_ne!(second, first, "{how}: same worker process");
        let devices = inst.scan().await.unwrap().devices;
        assert!(devices.len() == 2 && devices.iter().all(|d| d.healthy), "{how}: {devices:?}");
        assert!(inst.allocate(ids(&["crash-1"]), None).await.unwrap().is_some(), "{how}");
    }
}

#[tokio::test]
async fn a_crash_in_scan_is_a_failed_scan_and_the_next_worker_scans_again() {
    let dir = tempfile::tempdir().unwrap();
    let (inst, arm) = crashy(dir.path(), "scan", "segv", "5s").await;
    assert_eq!(inst.scan().await.unwrap().devices.len(), 2);
    std::fs::write(&arm, "").unwrap();
    let err = fails(inst.scan().await);
    assert!(matches!(err, CallError::Unavailable { .. }), "{err}");
    // Calls while it restarts fail fast with the reason, never hang.
    if let Err(e) = inst.scan().await {
        assert_eq!(tonic::Status::from(&e).code(), tonic::Code::Unavailable, "{e}");
    }
    eventually_within("restart", Duration::from_secs(10), || !inst.poisoned()).await;
    assert_eq!(inst.scan().await.unwrap().devices.len(), 2);
}

#[tokio::test]
async fn a_worker_stuck_for_three_deadlines_is_killed_and_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let (inst, arm) = crashy(dir.path(), "allocate", "hang", "300ms").await;
    let first = inst.worker_pid().unwrap();
    std::fs::write(&arm, "").unwrap();
    let start = Instant::now();
    let err = fails(inst.allocate(ids(&["crash-0"]), None).await);
    assert!(matches!(err, CallError::Timeout { .. }), "{err}");
    let err = fails(inst.scan().await);
    assert!(matches!(err, CallError::Hung { call: "allocate", .. }), "calls are refused while it hangs: {err}");
    assert!(inst.hung().is_some());
    eventually_within("kill and restart", Duration::from_secs(10), || inst.worker_pid().is_some_and(|p| p != first))
        .await;
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(850), "killed after {took:?}, before three deadlines");
    assert!(inst.hung().is_none() && !inst.poisoned());
    assert!(inst.allocate(ids(&["crash-0"]), None).await.unwrap().is_some());
}

#[tokio::test]
async fn a_panic_restarts_the_worker_instead_of_poisoning_the_instance() {
    let inst = isolated(&module("testdrv"), "", "panic_in = \"pre_start\"").await.unwrap();
    let first = inst.worker_pid().unwrap();
    let err = fails(inst.pre_start(ids(&["t-0"])).await);
    assert!(err.to_string().contains("PANIC"), "{err}");
    eventually_within("restart", Duration::from_secs(10), || inst.worker_pid().is_some_and(|p| p != first)).await;
    assert_eq!(inst.scan().await.unwrap().devices.len(), 4, "the fresh worker serves");
}

#[tokio::test]
async fn load_and_create_failures_read_as_they_do_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("libdevhost_text.so");
    std::fs::write(&text, "not an ELF file").unwrap();
    let err = fails(isolated(&text, "", "").await).to_string();
    assert!(err.contains(&text.display().to_string()) && err.contains("cannot be loaded"), "{err}");
    let err = fails(isolated(&crash_driver(dir.path()), "", "bogus = 1").await);
    assert!(matches!(&err, CallError::Status { call: "create", status: "INVALID_ARGUMENT", .. }), "{err}");
    assert!(err.to_string().contains("unknown option"), "{err}");
}

/// One line of /proc/PID/status, e.g. `CapEff`.
fn proc_status(pid: u32, key: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text.lines().find(|l| l.starts_with(&format!("{key}:"))).unwrap_or_else(|| panic!("no {key} in {text}"));
    line.split_once(':').unwrap().1.trim().to_string()
}

fn caps(pid: u32, key: &str) -> u64 {
    u64::from_str_radix(&proc_status(pid, key), 16).unwrap()
}

#[tokio::test]
async fn the_worker_keeps_only_the_listed_capabilities_and_no_stray_descriptors() {
    let so = module("example_c");
    let plain = isolated(&so, "", "").await.unwrap();
    let pid = plain.worker_pid().unwrap();
    assert_eq!(proc_status(pid, "NoNewPrivs"), "1");
    for set in ["CapEff", "CapPrm", "CapInh", "CapAmb"] {
        assert_eq!(caps(pid, set), 0, "{set} of the worker");
    }
    let host_bounding = caps(std::process::id(), "CapBnd");
    let host_can_drop = caps(std::process::id(), "CapEff") & (1 << 8) != 0; // CAP_SETPCAP
    if host_can_drop {
        assert_eq!(caps(pid, "CapBnd"), 0);
    } else {
        assert_eq!(caps(pid, "CapBnd"), host_bounding);
    }
    // Beyond stdin, stdout and stderr: the channel (and its clone for reading), the sealed copy of
    // the module the host checked and the worker's own eventfd (change notices wake its driver
    // thread), nothing else the host had open.
    let targets: std::collections::BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_str().unwrap().parse::<u32>().unwrap() > 2)
        .map(|e| std::fs::read_link(e.path()).unwrap().display().to_string())
        .collect();
    assert_eq!(targets.len(), 3, "{targets:?}");
    assert_eq!(targets.iter().filter(|t| t.starts_with("socket:")).count(), 1, "{targets:?}");
    assert!(targets.contains("anon_inode:[eventfd]"), "{targets:?}");
    assert!(targets.iter().any(|t| t.starts_with("/memfd:devhost:libdevhost_example_c.so")), "{targets:?}");

    let keeping = isolated(&so, "keep_capabilities = [\"CAP_DAC_OVERRIDE\"]", "").await.unwrap();
    let pid = keeping.worker_pid().unwrap();
    let dac_override = 1 << 1;
    let expected = caps(std::process::id(), "CapEff") & dac_override;
    assert_eq!(caps(pid, "CapEff"), expected);
    if host_can_drop {
        assert_eq!(caps(pid, "CapBnd"), host_bounding & dac_override);
    }
}

fn scans_in(log: &Path) -> usize {
    std::fs::read_to_string(log).unwrap_or_default().lines().count()
}

#[tokio::test]
async fn a_change_notice_brings_its_scan_and_the_host_asks_for_none() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("scans");
    let inst = isolated(&module("testdrv"), "", &format!("scan_log = \"{}\"", log.display())).await.unwrap();
    assert_eq!(inst.scan().await.unwrap().devices.len(), 4);
    assert_eq!(scans_in(&log), 1);
    // The test driver calls devices_changed inside watch_start.
    let notice = inst.changed.notified();
    inst.watch_start().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), notice).await.expect("the change notice reaches the host");
    // The worker scans on its own at the notice, before anyone asks.
    eventually_within("the worker's own scan", Duration::from_secs(10), || scans_in(&log) == 2).await;
    // The host's rescan takes that scan's devices: no scan request, no third scan.
    assert_eq!(inst.scan().await.unwrap().devices.len(), 4);
    assert_eq!(scans_in(&log), 2, "the rescan after a notice must not ask the worker again");
    // Without a notice, a rescan asks the worker as before.
    assert_eq!(inst.scan().await.unwrap().devices.len(), 4);
    assert_eq!(scans_in(&log), 3);
}

#[tokio::test]
async fn a_notice_scan_that_hangs_is_a_stuck_scan_like_a_requested_one() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("scans");
    let options = format!("scan_log = \"{}\"\nhang_in = \"scan\"\nhang_ms = 3000", log.display());
    let inst = isolated(&module("testdrv"), "call_timeout = \"500ms\"", &options).await.unwrap();
    assert_eq!(inst.scan().await.unwrap().devices.len(), 4);
    let notice = inst.changed.notified();
    inst.watch_start().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), notice).await.expect("the change notice reaches the host");
    // The second scan (the notice's) hangs for 3 s: the rescan times out at the call deadline.
    let start = Instant::now();
    let err = fails(inst.scan().await);
    assert!(matches!(err, CallError::Timeout { call: "scan", .. }), "{err}");
    assert!(start.elapsed() < Duration::from_millis(2500), "timed out after {:?}", start.elapsed());
    assert_eq!(inst.hung().map(|(call, _)| call), Some("scan"), "the worker is stuck in the notice's scan");
    // Stuck for three deadlines, it is killed and a fresh worker serves, as for a requested scan.
    let pid = inst.worker_pid();
    eventually_within("a restarted worker", Duration::from_secs(20), || {
        inst.worker_pid().is_some_and(|p| Some(p) != pid) && inst.hung().is_none()
    })
    .await;
    assert_eq!(inst.scan().await.unwrap().devices.len(), 4);
}

#[tokio::test]
async fn shutdown_stops_the_worker_process() {
    let inst = isolated(&module("example_c"), "", "").await.unwrap();
    let pid = inst.worker_pid().unwrap();
    inst.shutdown();
    let err = fails(inst.scan().await);
    assert_eq!(tonic::Status::from(&err).code(), tonic::Code::Unavailable, "{err}");
    eventually_within("worker exit", Duration::from_secs(10), || !Path::new(&format!("/proc/{pid}")).exists()).await;
}
