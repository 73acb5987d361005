//! The loader refuses every kind of bad module with a message naming the
//! file and the reason, and `devhost drivers` shows it without enabling
//! anything. Bad modules are compiled here from tests/fixtures/bad_driver.c.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn build_bad(dir: &Path, define: &str) -> PathBuf {
    let out = dir.join(format!("lib{}.so", define.to_lowercase()));
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC"])
        .arg(format!("-D{define}"))
        .arg("-I")
        .arg(abi_include())
        .arg("-o")
        .arg(&out)
        .arg(repo_root().join("tests/fixtures/bad_driver.c"))
        .status()
        .expect("cc");
    assert!(st.success());
    out
}

fn load_err(path: &Path) -> String {
    match devhost::driver::loader::load(path) {
        Ok(m) => panic!("{} loaded as {}", path.display(), m.name),
        Err(e) => e.to_string(),
    }
}

fn assert_names(msg: &str, path: &Path, reason: &str) {
    assert!(msg.contains(&path.display().to_string()), "message does not name the file: {msg}");
    assert!(msg.contains(reason), "message does not say {reason:?}: {msg}");
}

#[test]
fn missing_file() {
    let p = Path::new("/nonexistent/libdevhost_x.so");
    assert_names(&load_err(p), p, "module file not found");
}

#[test]
fn not_an_elf_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("libdevhost_text.so");
    std::fs::write(&p, "#!/bin/sh\necho hi\n").unwrap();
    let msg = load_err(&p);
    assert_names(&msg, &p, "cannot be loaded");
    assert!(msg.contains("invalid ELF header") || msg.contains("file too short"), "dlerror text missing: {msg}");
}

#[test]
fn wrong_architecture() {
    // A valid ELF header for another machine (EM_AARCH64 on x86-64, or EM_X86_64 elsewhere).
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("libdevhost_arch.so");
    let mut elf = std::fs::read(module("example_c")).unwrap();
    let machine: u16 = if cfg!(target_arch = "x86_64") { 183 } else { 62 };
    elf[18..20].copy_from_slice(&machine.to_le_bytes());
    std::fs::write(&p, elf).unwrap();
    let msg = load_err(&p);
    assert_names(&msg, &p, "cannot be loaded");
    assert!(msg.contains("wrong ELF class") || msg.contains("ELF") || msg.contains("machine"), "{msg}");
}

#[test]
fn missing_entry_symbol() {
    let dir = tempfile::tempdir().unwrap();
    let p = build_bad(dir.path(), "NO_ENTRY");
    assert_names(&load_err(&p), &p, "no entry symbol `devhost_driver_entry_v1`");
}

#[test]
fn null_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let p = build_bad(dir.path(), "NULL_DESC");
    assert_names(&load_err(&p), &p, "entry symbol returned NULL");
}

#[test]
fn wrong_magic() {
    let dir = tempfile::tempdir().unwrap();
    let p = build_bad(dir.path(), "BAD_MAGIC");
    assert_names(&load_err(&p), &p, "wrong magic 0x12345678");
}

#[test]
fn unsupported_major_version() {
    let dir = tempfile::tempdir().unwrap();
    let p = build_bad(dir.path(), "BAD_MAJOR");
    assert_names(&load_err(&p), &p, "unsupported ABI major version 2 (this host supports 1)");
}

#[test]
fn descriptor_too_small() {
    let dir = tempfile::tempdir().unwrap();
    let p = build_bad(dir.path(), "TOO_SMALL");
    assert_names(&load_err(&p), &p, "driver descriptor too small: 16 bytes declared");
}

#[test]
fn required_function_missing() {
    let dir = tempfile::tempdir().unwrap();
    let p = build_bad(dir.path(), "NULL_SCAN");
    assert_names(&load_err(&p), &p, "required function `scan` is NULL");
}

#[tokio::test]
async fn create_refused_shows_the_drivers_message() {
    let dir = tempfile::tempdir().unwrap();
    let p = build_bad(dir.path(), "REFUSE_CREATE");
    let m = devhost::driver::loader::load(&p).unwrap();
    let err = devhost::driver::instance::Instance::create("bad", m, &[], std::time::Duration::from_secs(5))
        .await
        .err()
        .unwrap();
    let msg = err.to_string();
    assert!(msg.contains("bad-driver refuses: no hardware here") && msg.contains("UNAVAILABLE"), "{msg}");
    // And through the CLI: `check` lists it and fails.
    let manifest = dir.path().join("m.toml");
    std::fs::write(
        &manifest,
        format!(
            "[driver.bad]\nmodule = \"{}\"\n[[resource]]\nname = \"example.com/bad\"\ndriver = \"bad\"\n",
            p.display()
        ),
    )
    .unwrap();
    let (code, _, err) = devhost(&["check", "--config", manifest.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("bad-driver refuses: no hardware here"), "{err}");
}

#[test]
fn c_example_options_are_refused_with_the_drivers_message() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("m.toml");
    std::fs::write(
        &manifest,
        format!(
            "[driver.ex]\nmodule = \"{}\"\noptions = {{ count = \"abc\" }}\n[[resource]]\nname = \"example.com/ex\"\ndriver = \"ex\"\n",
            module("example_c").display()
        ),
    )
    .unwrap();
    let (code, _, err) = devhost(&["check", "--config", manifest.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("count") && err.contains("abc"), "{err}");
}

#[test]
fn drivers_command_lists_good_and_bad_modules() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(module("example_c"), dir.path().join("libdevhost_example_c.so")).unwrap();
    std::fs::copy(module("testdrv"), dir.path().join("libdevhost_testdrv.so")).unwrap();
    build_bad(dir.path(), "BAD_MAJOR");
    let (code, out, _) = devhost(&["drivers", "--dir", dir.path().to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(out.contains("libdevhost_example_c.so: example-c") && out.contains("(ABI 1.3)"), "{out}");
    assert!(out.contains("allocate, pre_start, watch, release"), "{out}");
    let sha = devhost::driver::loader::sha256_file(&module("example_c")).unwrap();
    assert!(out.contains(&format!("    sha256 {sha} (the bytes loaded")), "{out}");
    assert!(
        out.contains(
            "libdevhost_testdrv.so: testdrv 0.0.1 (ABI 1.3) [allocate, preferred_allocation, pre_start, watch]"
        ),
        "{out}"
    );
    assert!(
        out.contains("libbad_major.so: cannot be loaded") && out.contains("unsupported ABI major version 2"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_v1_0_driver_loads_and_works_in_this_host() {
    let node = Node::new();
    let so = node.path().join("libcompat_v1_0.so");
    compile_c(&repo_root().join("tests/compat/v1_0/driver.c"), &so, &repo_root().join("tests/compat/v1_0"));
    let m = node.write_manifest(&format!(
        "[driver.compat]\nmodule = \"{}\"\n[[resource]]\nname = \"example.com/compat\"\ndriver = \"compat\"\n",
        so.display()
    ));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&m, &node.kubelet_dir());
    let devs = kubelet.wait_devices("example.com/compat", WAIT, |d| d.len() == 3).await.unwrap();
    assert_eq!(devs[0].id, "compat-0");
    let resp = kubelet.allocate("example.com/compat", vec![vec!["compat-1".into(), "compat-2".into()]]).await.unwrap();
    assert_eq!(env_of(&resp, 0, "COMPAT_ALLOCATED").as_deref(), Some("2"));
    assert_eq!(env_of(&resp, 0, "COMPAT_DEVICE").as_deref(), Some("compat-1,compat-2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_v1_1_driver_loads_and_releases_beside_the_v1_0_one() {
    let node = Node::new();
    let mut manifest = String::new();
    for minor in ["0", "1"] {
        let dir = repo_root().join(format!("tests/compat/v1_{minor}"));
        let so = node.path().join(format!("libcompat_v1_{minor}.so"));
        compile_c(&dir.join("driver.c"), &so, &dir);
        manifest += &format!(
            "[driver.compat{minor}]\nmodule = \"{}\"\n[[resource]]\nname = \"example.com/compat{minor}\"\ndriver = \"compat{minor}\"\n",
            so.display()
        );
    }
    let m = node.write_manifest(&manifest);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&m, &node.kubelet_dir());
    for resource in ["example.com/compat0", "example.com/compat1"] {
        let devs = kubelet.wait_devices(resource, WAIT, |d| d.len() == 3).await.unwrap();
        assert_eq!(devs[0].id, "compat-0", "{resource}");
        kubelet.allocate(resource, vec![vec!["compat-1".into()]]).await.unwrap();
    }
    let resp = kubelet.allocate("example.com/compat0", vec![vec!["compat-2".into()]]).await.unwrap();
    assert_eq!(env_of(&resp, 0, "COMPAT_ALLOCATED").as_deref(), Some("1"));

    // The hook 1.1 added, called the way the host's release runner calls it.
    let module = devhost::driver::loader::load(&node.path().join("libcompat_v1_1.so")).unwrap();
    assert_eq!((module.name, module.abi_version().as_str()), ("compat-v1.1", "1.1"));
    assert_eq!(module.capabilities(), ["release"]);
    let timeout = std::time::Duration::from_secs(5);
    let inst = devhost::driver::instance::Instance::create("compat11", module, &[], timeout).await.unwrap();
    assert!(inst.release(vec!["compat-2".into()]).await.unwrap(), "the v1.1 driver has a release hook");
    let scan = inst.scan().await.unwrap().devices;
    let released: Vec<&str> = scan.iter().map(|d| d.attributes["released"].as_str()).collect();
    assert_eq!(released, ["0", "0", "1"]);
    let err = inst.release(vec!["gpu-7".into()]).await.unwrap_err().to_string();
    assert!(err.contains("release failed (NOT_FOUND)"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_v1_0_driver_has_no_release_hook() {
    // A 1.0 descriptor ends before `release`: the host must not read past it.
    let node = Node::new();
    let so = node.path().join("libcompat_v1_0.so");
    compile_c(&repo_root().join("tests/compat/v1_0/driver.c"), &so, &repo_root().join("tests/compat/v1_0"));
    let module = devhost::driver::loader::load(&so).unwrap();
    assert_eq!(module.declared, devhost_abi::DESC_SIZE_V1_0);
    assert!(module.release().is_none());
    assert_eq!(module.capabilities(), ["allocate"]);
    let timeout = std::time::Duration::from_secs(5);
    let inst = devhost::driver::instance::Instance::create("compat10", module, &[], timeout).await.unwrap();
    assert!(!inst.release(vec!["compat-0".into()]).await.unwrap(), "a 1.0 driver was called for release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_v1_3_driver_reads_claim_parameters_and_the_v1_2_one_declares_none() {
    let node = Node::new();
    let load = |minor: &str| {
        let dir = repo_root().join(format!("tests/compat/v1_{minor}"));
        let so = node.path().join(format!("libcompat_v1_{minor}.so"));
        compile_c(&dir.join("driver.c"), &so, &dir);
        devhost::driver::loader::load(&so).unwrap()
    };
    let old = load("2");
    assert!(!old.info().claim_parameters && !old.info().reads_claim_parameters(), "1.2 knows no claim parameters");
    let module = load("3");
    assert_eq!((module.name, module.abi_version().as_str()), ("compat-v1.3", "1.3"));
    assert_eq!(module.capabilities(), ["allocate", "claim_parameters"]);
    assert!(module.info().reads_claim_parameters());
    let timeout = std::time::Duration::from_secs(5);
    let inst = devhost::driver::instance::Instance::create("compat13", module, &[], timeout).await.unwrap();
    let env = |edits: devhost::driver::device::Edits| edits.envs.into_iter().find(|(k, _)| k == "COMPAT_PARAMETERS");
    let ids = vec!["compat-0".to_string()];
    let claim = inst.allocate(ids.clone(), Some(r#"[{"a":1}]"#.into())).await.unwrap().unwrap();
    assert_eq!(env(claim), Some(("COMPAT_PARAMETERS".into(), r#"[{"a":1}]"#.into())));
    let container = inst.allocate(ids.clone(), None).await.unwrap().unwrap();
    assert_eq!(env(container).map(|(_, v)| v).as_deref(), Some("none"), "a device-plugin container has no claim");
    let refused = inst.allocate(ids, Some(r#"[{"x":"refuse"}]"#.into())).await.unwrap_err().to_string();
    assert!(
        refused.contains("INVALID_ARGUMENT") && refused.contains("compat-v1.3 refuses these parameters"),
        "{refused}"
    );
}

#[test]
fn panicking_rust_driver_returns_panic_and_the_host_survives() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let m = devhost::driver::loader::load(&module("testdrv")).unwrap();
        let opts = vec![("panic_in".to_string(), "create".to_string())];
        let err = devhost::driver::instance::Instance::create("p", m, &opts, std::time::Duration::from_secs(5))
            .await
            .err()
            .unwrap();
        let msg = err.to_string();
        assert!(msg.contains("PANIC") && msg.contains("told to panic in create"), "{msg}");
        // The same module still creates a healthy instance afterwards.
        let ok =
            devhost::driver::instance::Instance::create("q", m, &[], std::time::Duration::from_secs(5)).await.unwrap();
        assert_eq!(ok.scan().await.unwrap().devices.len(), 4);
    });
}
