//! `devhost conformance` on modules that crash, abort or hang: the battery
//! runs the module under process isolation, so a module that dies in any
//! entry point fails the check for that call (naming it and the signal or
//! the deadline), the checks after it still run, and the exit code is 1.
//! The module is tests/fixtures/crash_driver.c with every hook, the real
//! `devhost` binary runs the battery. Needs `cargo build --workspace` first.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// crash_driver.c built with every optional hook (watch, preferred, release).
fn every_hook_driver(dir: &Path) -> PathBuf {
    let out = dir.join("libdevhost_crashy.so");
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread", "-DEVERY_HOOK", "-I"])
        .arg(abi_include())
        .arg("-o")
        .arg(&out)
        .arg(repo_root().join("tests/fixtures/crash_driver.c"))
        .status()
        .unwrap();
    assert!(st.success(), "compiling crash_driver.c failed");
    out
}

/// Runs the battery; returns (exit code, -1 for a signal, and the report).
fn conformance(module: &Path, options: &[String]) -> (i32, String) {
    let mut args = vec!["conformance".to_string(), "--module".into(), module.display().to_string(), "--options".into()];
    args.extend(options.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = devhost(&args);
    (code, format!("{out}\n--- stderr ---\n{err}"))
}

fn line<'a>(report: &'a str, check: &str) -> &'a str {
    report
        .lines()
        .find(|l| l.get(6..).is_some_and(|rest| rest.starts_with(&format!("{check} "))))
        .unwrap_or_else(|| panic!("no line for {check:?} in:\n{report}"))
}

/// Every check of the battery, in report order: all appear, whatever crashed.
const CHECKS: [&str; 20] = [
    "trust",
    "handshake and descriptor",
    "create",
    "scan",
    "IDs and attributes",
    "links",
    "edits between devices",
    "watch_start",
    "allocate",
    "claim parameters",
    "preferred_allocation",
    "pre_start",
    "release after the pod ends",
    "destroy",
    "kubelet sees every device",
    "unknown and duplicate IDs refused",
    "concurrent calls",
    "devices_changed storm",
    "create/destroy x100",
    "DOES NOT CONFORM",
];

fn assert_complete(report: &str) {
    let mut from = 0;
    for check in CHECKS {
        let at = report[from..].find(check).unwrap_or_else(|| panic!("{check:?} missing or out of order:\n{report}"));
        from += at + check.len();
    }
}

/// One crash per entry point, each on the first call of that hook only (the
/// fixture deletes its trigger file first): the check that made the call
/// fails naming it and the signal, and the restarted worker passes the rest.
#[test]
fn a_crash_in_any_entry_point_fails_that_check_and_the_battery_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let so = every_hook_driver(dir.path());
    let cases = [
        ("create", "abort", "create", "SIGABRT"),
        ("scan", "segv", "scan", "SIGSEGV"),
        ("watch_start", "segv", "watch_start", "SIGSEGV"),
        ("allocate", "segv", "allocate", "SIGSEGV"),
        ("preferred_allocation", "segv", "preferred_allocation", "SIGSEGV"),
        ("pre_start", "abort", "pre_start", "SIGABRT"),
        ("release", "segv", "release after the pod ends", "SIGSEGV"),
        ("destroy", "segv", "destroy", "SIGSEGV"),
    ];
    let runs: Vec<_> = cases
        .into_iter()
        .map(|(hook, how, check, signal)| {
            let arm = dir.path().join(format!("arm-{hook}"));
            std::fs::write(&arm, "").unwrap();
            let options = vec![format!("crash_in={hook}"), format!("how={how}"), format!("arm_file={}", arm.display())];
            let so = so.clone();
            std::thread::spawn(move || (hook, check, signal, conformance(&so, &options)))
        })
        .collect();
    for run in runs {
        let (hook, check, signal, (code, report)) = run.join().unwrap();
        assert_eq!(code, 1, "{hook}: exit code\n{report}");
        assert_complete(&report);
        let l = line(&report, check);
        assert!(l.starts_with("FAIL") && l.contains(hook) && l.contains(signal), "{hook}: {l}\n{report}");
        // Exactly that check failed: the worker restarted for the others.
        let failed: Vec<&str> = report.lines().filter(|l| l.starts_with("FAIL")).collect();
        assert_eq!(failed, [l], "{hook}: only {check} fails\n{report}");
    }
}

/// A hang is a failed check that names the call and the deadline; the
/// battery kills that worker and goes on with a new one.
#[test]
fn a_hang_in_scan_names_the_deadline_and_the_battery_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let so = every_hook_driver(dir.path());
    let arm = dir.path().join("arm");
    std::fs::write(&arm, "").unwrap();
    let (code, report) =
        conformance(&so, &["crash_in=scan".into(), "how=hang".into(), format!("arm_file={}", arm.display())]);
    assert_eq!(code, 1, "{report}");
    assert_complete(&report);
    let l = line(&report, "scan");
    assert!(l.starts_with("FAIL") && l.contains("scan did not return within 10 s"), "{l}\n{report}");
    assert!(line(&report, "allocate").starts_with("PASS"), "{report}");
}

/// A module broken for good in destroy: the main instance's destroy fails,
/// and so does the leak check, which runs the module in a probe process of
/// its own: the kit outlives both.
#[test]
fn a_module_that_always_crashes_in_destroy_fails_the_destroy_and_leak_checks() {
    let dir = tempfile::tempdir().unwrap();
    let so = every_hook_driver(dir.path());
    let (code, report) = conformance(&so, &["crash_in=destroy".into(), "how=segv".into(), "repeat=1".into()]);
    assert_eq!(code, 1, "{report}");
    assert_complete(&report);
    for check in ["destroy", "create/destroy x100"] {
        let l = line(&report, check);
        assert!(l.starts_with("FAIL") && l.contains("destroy") && l.contains("SIGSEGV"), "{check}: {l}\n{report}");
    }
}

/// A module whose create always aborts: every check that needs an instance
/// says why it could not run, and the report still ends with the verdict.
#[test]
fn a_module_that_always_aborts_in_create_still_gets_a_whole_report() {
    let dir = tempfile::tempdir().unwrap();
    let so = every_hook_driver(dir.path());
    let (code, report) = conformance(&so, &["crash_in=create".into(), "how=abort".into(), "repeat=1".into()]);
    assert_eq!(code, 1, "{report}");
    assert_complete(&report);
    let l = line(&report, "create");
    assert!(l.starts_with("FAIL") && l.contains("create") && l.contains("SIGABRT"), "{l}\n{report}");
    let l = line(&report, "create/destroy x100");
    assert!(l.starts_with("FAIL") && l.contains("create") && l.contains("SIGABRT"), "{l}\n{report}");
}
