//! `devhost conformance`, the real binary on real modules: every bundled
//! driver (NVIDIA against the fake NVML, FPGA and TPU against the simulated
//! sysfs trees under config/sim) and both examples must conform, and a C
//! driver that breaks one rule must fail exactly the check for that rule.
//! Needs `cargo build --workspace` first (the modules are cdylibs).

use crate::common::*;
use std::path::Path;
use std::process::Command;

/// Runs the battery; returns (exit code, report).
fn conformance(module: &Path, options: &[String]) -> (i32, String) {
    let mut args = vec!["conformance".to_string(), "--module".into(), module.display().to_string()];
    if !options.is_empty() {
        args.push("--options".into());
        args.extend(options.iter().cloned());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, out, err) = devhost(&args);
    (code, format!("{out}\n--- stderr ---\n{err}"))
}

fn line<'a>(report: &'a str, check: &str) -> &'a str {
    report
        .lines()
        .find(|l| l.get(6..).is_some_and(|rest| rest.starts_with(check)))
        .unwrap_or_else(|| panic!("no line for {check:?} in:\n{report}"))
}

fn assert_conforms(module: &Path, options: &[String]) -> String {
    let (code, report) = conformance(module, options);
    assert_eq!(code, 0, "{} does not conform:\n{report}", module.display());
    assert!(report.contains("CONFORMS:") && !report.contains("\nFAIL"), "{report}");
    for check in ["handshake and descriptor", "create", "scan", "kubelet sees every device"] {
        assert!(line(&report, check).starts_with("PASS"), "{check}:\n{report}");
    }
    report
}

fn sim(path: &str) -> String {
    repo_root().join("config/sim").join(path).display().to_string()
}

#[test]
fn the_c_example_conforms() {
    let report = assert_conforms(&module("example_c"), &["count=4".into(), "numa_nodes=2".into()]);
    // It has a release hook, so the pod-end check ran rather than being skipped.
    assert!(line(&report, "release after the pod ends").starts_with("PASS"), "{report}");
    assert!(line(&report, "unknown and duplicate IDs refused").starts_with("PASS"), "{report}");
    // It reads claim parameters (ABI 1.3) and refuses a key it does not know.
    let params = line(&report, "claim parameters");
    assert!(params.starts_with("PASS") && params.contains("refused with INVALID_ARGUMENT"), "{report}");
}

#[test]
fn the_rust_example_conforms() {
    let report = assert_conforms(&module("example_rust"), &[]);
    assert!(line(&report, "claim parameters").starts_with("PASS"), "{report}");
}

#[test]
fn the_fpga_driver_conforms_on_the_simulated_node() {
    assert_conforms(
        &module("fpga"),
        &[format!("sysfs_root={}", sim("fpga/sys")), format!("devfs_root={}", sim("fpga/dev"))],
    );
}

#[test]
fn the_tpu_driver_conforms_and_survives_overlapping_calls() {
    let report = assert_conforms(
        &module("tpu"),
        &[
            format!("sysfs_root={}", sim("tpu/sys")),
            format!("devfs_root={}", sim("tpu/dev")),
            "allocation=boxes".into(),
        ],
    );
    // The TPU driver claims DEVHOST_CAP_CONCURRENT: the overlapping calls ran.
    assert!(line(&report, "concurrent calls").starts_with("PASS"), "{report}");
    assert!(line(&report, "claim parameters").starts_with("SKIP"), "it takes no claim parameters: {report}");
}

#[test]
fn the_nvidia_driver_conforms_against_the_fake_nvml() {
    let nvml = devhost_bin().parent().unwrap().join("libfake_nvml.so");
    assert!(nvml.exists(), "{} is missing: run `cargo build --workspace`", nvml.display());
    let report = assert_conforms(
        &module("nvidia"),
        &[
            format!("nvml_lib={}", nvml.display()),
            format!("sysfs_root={}", sim("nvidia/sys")),
            format!("devfs_root={}", sim("nvidia/dev")),
            format!("driver_root={}", sim("nvidia/driver")),
        ],
    );
    assert!(line(&report, "concurrent calls").starts_with("PASS"), "{report}");
    assert!(line(&report, "links").starts_with("PASS"), "{report}");
    assert!(line(&report, "claim parameters").starts_with("PASS"), "its MPS settings refuse an unknown key: {report}");
    let allocate = line(&report, "allocate");
    assert!(allocate.starts_with("SKIP") && allocate.contains("ALLOCATE_CLAIMS_ONLY"), "claims only: {report}");
}

#[test]
fn the_guides_complete_c_driver_conforms() {
    // The one-file driver of docs/driver-guide.md §1.1, as a vendor copies it.
    let guide = std::fs::read_to_string(repo_root().join("docs/driver-guide.md")).unwrap();
    let driver = guide
        .split("```c\n")
        .skip(1)
        .filter_map(|block| block.split("```").next())
        .find(|block| block.contains("devhost_driver_entry_v1(void) {"))
        .expect("the guide has a complete C driver");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("acme.c"), driver).unwrap();
    let so = dir.path().join("libdevhost_acme.so");
    compile_c(&dir.path().join("acme.c"), &so, &abi_include());
    let report = assert_conforms(&so, &["count=4".into()]);
    assert!(line(&report, "create/destroy x100").starts_with("PASS"), "{report}");
}

/// Builds tests/fixtures/nonconforming_driver.c with one fault switched on.
fn nonconforming(dir: &Path, fault: Option<&str>) -> std::path::PathBuf {
    let out = dir.join(format!("libnc_{}.so", fault.unwrap_or("none").to_lowercase()));
    let mut cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread", "-I"]).arg(abi_include());
    if let Some(f) = fault {
        cc.arg(format!("-D{f}"));
    }
    let st = cc.arg("-o").arg(&out).arg(repo_root().join("tests/fixtures/nonconforming_driver.c")).status().unwrap();
    assert!(st.success(), "compiling the fixture with {fault:?} failed");
    out
}

#[test]
fn each_broken_rule_fails_its_own_check_and_the_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let report = assert_conforms(&nonconforming(dir.path(), None), &[]);
    assert!(line(&report, "links").starts_with("SKIP"), "{report}");
    assert!(line(&report, "create/destroy x100").starts_with("PASS"), "{report}");
    for (fault, check, says) in [
        ("UNSTABLE_IDS", "scan", "two scans in a row differ"),
        ("BAD_LINK", "links", "\"nc-99\""),
        ("CONFLICT", "edits between devices", "conflicts with"),
        ("LEAK_FD", "create/destroy x100", "fds +"),
        ("BAD_ATTRIBUTE", "IDs and attributes", "\"serial number\""),
        ("RACY", "concurrent calls", "an overlapping scan reported"),
    ] {
        let (code, report) = conformance(&nonconforming(dir.path(), Some(fault)), &[]);
        assert_eq!(code, 1, "{fault}: exit code\n{report}");
        let l = line(&report, check);
        assert!(l.starts_with("FAIL") && l.contains(says), "{fault}: {l}\n{report}");
        assert!(report.contains("DOES NOT CONFORM"), "{report}");
    }
}

#[test]
fn a_file_that_is_not_a_driver_fails_the_handshake_and_bad_options_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_driver = dir.path().join("libnothing.so");
    std::fs::write(&not_a_driver, "not an ELF file").unwrap();
    let (code, report) = conformance(&not_a_driver, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(line(&report, "handshake and descriptor").starts_with("FAIL"), "{report}");
    assert!(line(&report, "handshake and descriptor").contains("libnothing.so"), "{report}");

    let (code, _, err) = devhost(&["conformance", "--module", "x.so", "--options", "novalue"]);
    assert_eq!(code, 2);
    assert!(err.contains("--options \"novalue\": expected KEY=VALUE"), "{err}");
}
