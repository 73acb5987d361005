//! Every annotated manifest in config/ passes `devhost check` with the
//! modules this workspace builds. Hardware the machine lacks is simply
//! absent (NVML missing, no FPGA or TPU in /sys), which a driver must
//! survive with zero devices; the simulated nodes use checked-in trees.

use crate::common::*;

#[test]
fn the_deploy_configmap_manifest_passes_check() {
    let built = module("example_c").parent().unwrap().to_path_buf();
    let text = configmap_manifest();
    assert!(text.contains("[driver.nvidia]"), "extracted:\n{text}");
    let node = Node::new();
    let m = node.write_manifest(&format!("driver_dir = \"{}\"\n{text}", built.display()));
    let (code, out, err) = devhost(&["check", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn every_example_manifest_passes_check() {
    let dir = repo_root().join("config");
    let built = module("example_c").parent().unwrap().to_path_buf();
    let mut checked = 0;
    let mut entries: Vec<_> = std::fs::read_dir(&dir).unwrap().filter_map(Result::ok).map(|e| e.path()).collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if path.extension().is_none_or(|x| x != "toml") || name.starts_with('.') {
            continue;
        }
        // Point the example at this build's modules; everything else stays as written.
        let text = std::fs::read_to_string(&path).unwrap();
        let body: String =
            text.lines().filter(|l| !l.trim_start().starts_with("driver_dir")).map(|l| format!("{l}\n")).collect();
        let body = body.replace("target/release/libfake_nvml.so", &built.join("libfake_nvml.so").display().to_string());
        let copy = dir.join(format!(".check-{name}"));
        std::fs::write(&copy, format!("driver_dir = \"{}\"\n{body}", built.display())).unwrap();
        let out = std::process::Command::new(devhost_bin())
            .args(["check", "--config"])
            .arg(&copy)
            .current_dir(repo_root())
            .output()
            .unwrap();
        let _ = std::fs::remove_file(&copy);
        assert!(
            out.status.success(),
            "devhost check {name} failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        checked += 1;
    }
    assert!(checked >= 4, "expected the demo and the per-hardware examples, checked {checked}");
}
