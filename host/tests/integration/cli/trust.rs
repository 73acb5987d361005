//! Module trust: modules others could have written are refused (unless the
//! operator relaxes it, loudly), and a sha256 pin is enforced.

use crate::common::*;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

fn setup(mode: u32, dir_mode: u32, extra: &str) -> (Node, PathBuf) {
    let node = Node::new();
    let drivers = node.path().join("drivers");
    std::fs::create_dir_all(&drivers).unwrap();
    let so = drivers.join("libdevhost_example_c.so");
    std::fs::copy(module("example_c"), &so).unwrap();
    std::fs::set_permissions(&so, std::fs::Permissions::from_mode(mode)).unwrap();
    std::fs::set_permissions(&drivers, std::fs::Permissions::from_mode(dir_mode)).unwrap();
    let m = node.write_manifest_exact(&format!(
        "{extra}\ndriver_dir = \"drivers\"\n[driver.example_c]\n\n[[resource]]\nname = \"example.com/x\"\ndriver = \"example_c\"\n"
    ));
    (node, m)
}

fn check(m: &Path, extra_args: &[&str]) -> (i32, String, String) {
    let mut args = vec!["check", "--config", m.to_str().unwrap()];
    args.extend_from_slice(extra_args);
    devhost(&args)
}

#[test]
fn a_group_writable_module_is_refused() {
    let (_n, m) = setup(0o664, 0o755, "");
    let (code, _, err) = check(&m, &[]);
    assert_eq!(code, 1);
    assert!(
        err.contains("untrusted module") && err.contains("module file is writable by its group (mode 0664)"),
        "{err}"
    );
}

#[test]
fn a_world_writable_folder_is_refused() {
    let (_n, m) = setup(0o644, 0o777, "");
    let (code, _, err) = check(&m, &[]);
    assert_eq!(code, 1);
    assert!(err.contains("its folder is writable by group and others (mode 0777)"), "{err}");
}

#[test]
fn a_module_owned_by_another_user_is_refused() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: changing a file's owner needs root (CI runs as root)");
        return;
    }
    let (n, m) = setup(0o644, 0o755, "");
    let so = n.path().join("drivers/libdevhost_example_c.so");
    std::os::unix::fs::chown(&so, Some(4242), Some(4242)).unwrap();
    let (code, _, err) = check(&m, &[]);
    assert_eq!(code, 1);
    assert!(err.contains("module file is owned by uid 4242, not by root"), "{err}");
}

#[test]
fn the_manifest_or_the_cli_can_relax_trust_loudly() {
    let (_n, m) = setup(0o666, 0o755, "allow_untrusted_modules = true");
    let (code, out, err) = check(&m, &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("OK"));
    assert!(err.contains("LOADING AN UNTRUSTED MODULE") && err.contains("mode 0666"), "{err}");
    let (_n2, m2) = setup(0o666, 0o755, "");
    let (code, _, err) = check(&m2, &["--allow-untrusted-modules"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("module trust checks are relaxed"), "{err}");
}

#[test]
fn a_sha256_pin_is_enforced_and_never_relaxed() {
    let real = devhost::driver::loader::sha256_file(&module("example_c")).unwrap();
    let (_n, good) = setup(0o644, 0o755, "");
    let body = std::fs::read_to_string(&good)
        .unwrap()
        .replace("[driver.example_c]\n", &format!("[driver.example_c]\nsha256 = \"{real}\"\n"));
    std::fs::write(&good, body).unwrap();
    let (code, _, err) = check(&good, &[]);
    assert_eq!(code, 0, "{err}");

    let wrong = "0".repeat(64);
    let (_n2, bad) = setup(0o644, 0o755, "allow_untrusted_modules = true");
    let body = std::fs::read_to_string(&bad)
        .unwrap()
        .replace("[driver.example_c]\n", &format!("[driver.example_c]\nsha256 = \"{wrong}\"\n"));
    std::fs::write(&bad, body).unwrap();
    let (code, _, err) = check(&bad, &[]);
    assert_eq!(code, 1);
    assert!(err.contains(&format!("the manifest pins {wrong}, the file is {real}")), "{err}");
}

#[test]
fn a_malformed_pin_is_a_manifest_error_with_its_line() {
    let (_n, m) = setup(0o644, 0o755, "");
    let body =
        std::fs::read_to_string(&m).unwrap().replace("[driver.example_c]\n", "[driver.example_c]\nsha256 = \"abc\"\n");
    std::fs::write(&m, body).unwrap();
    let (code, _, err) = check(&m, &[]);
    assert_eq!(code, 2);
    assert!(err.contains("driver.example_c.sha256: expected 64 hexadecimal digits"), "{err}");
    assert!(err.contains("devhost.toml:4:10:"), "{err}");
}

#[test]
fn drivers_command_shows_trust_problems() {
    let (n, _m) = setup(0o664, 0o755, "");
    let dir = n.path().join("drivers");
    let (code, out, _) = devhost(&["drivers", "--dir", dir.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.contains("libdevhost_example_c.so: UNTRUSTED") && out.contains("mode 0664"), "{out}");
    assert!(out.contains("not loaded") && !out.contains(": example-c 0."), "an untrusted module is not loaded: {out}");
    let (code, out, _) = devhost(&["drivers", "--dir", dir.to_str().unwrap(), "--allow-untrusted-modules"]);
    assert_eq!(code, 0);
    assert!(out.contains("UNTRUSTED") && out.contains("libdevhost_example_c.so: example-c"), "{out}");
}
