//! Behaviour of `Manifest::parse` / `Manifest::load` as the operator sees it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;

mod dra;
mod errors;
mod features;

pub(super) const PATH: &str = "/etc/devhost/devhost.toml";

pub(super) const EXAMPLE: &str = r#"kubelet_dir = "/var/lib/kubelet/device-plugins"
driver_dir  = "/usr/lib/devhost/drivers"
call_timeout = "10s"

[driver.nvidia]
module = "libdevhost_nvidia.so"
poll_interval = "30s"
call_timeout = "5s"
[driver.nvidia.options]
nvml_lib = "libnvidia-ml.so.1"

[[resource]]
name = "nvidia.com/h100"
driver = "nvidia"
match = { model = "*H100*" }
"#;

pub(super) fn parse(text: &str) -> Result<Manifest, ManifestErrors> {
    Manifest::parse(text, Path::new(PATH), None)
}

/// The diagnostics of a manifest that must fail, rendered as the operator reads them.
pub(super) fn errors(text: &str) -> Vec<String> {
    match parse(text) {
        Ok(manifest) => panic!("expected errors, got {manifest:?}"),
        Err(ManifestErrors(diagnostics)) => diagnostics.iter().map(|d| d.to_string()).collect(),
    }
}

pub(super) fn only_error(text: &str) -> String {
    let errors = errors(text);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    errors.into_iter().next().unwrap()
}

pub(super) fn assert_has(errors: &[String], prefix: &str, needle: &str) {
    assert!(
        errors.iter().any(|e| e.starts_with(prefix) && e.contains(needle)),
        "no error starting with {prefix:?} and containing {needle:?} in {errors:#?}"
    );
}

#[test]
fn example_manifest_parses() {
    let manifest = parse(EXAMPLE).unwrap();
    let nvidia = &manifest.drivers["nvidia"];
    assert_eq!(nvidia.module_candidates, vec![PathBuf::from("/usr/lib/devhost/drivers/libdevhost_nvidia.so")]);
    assert_eq!(nvidia.poll_interval, Some(Duration::from_secs(30)));
    assert_eq!(nvidia.call_timeout, Duration::from_secs(5));
    assert_eq!(nvidia.options, vec![("nvml_lib".into(), "libnvidia-ml.so.1".into())]);
    assert!(!nvidia.implicit);
    let resource = &manifest.resources[0];
    assert_eq!(resource.name, "nvidia.com/h100");
    assert_eq!(resource.matches, vec![("model".into(), "*H100*".into())]);
    assert_eq!(resource.socket_name, "devhost-nvidia.com_h100.sock");
    assert_eq!(resource.location, format!("{PATH}:12:1"));
    assert!(manifest.warnings.is_empty());
}

#[test]
fn defaults_apply_when_keys_are_absent() {
    let manifest = parse("[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\n").unwrap();
    assert_eq!(manifest.path, PathBuf::from(PATH));
    assert_eq!(manifest.kubelet_dir, PathBuf::from(DEFAULT_KUBELET_DIR));
    assert_eq!(manifest.driver_dir, PathBuf::from(DEFAULT_DRIVER_DIR));
    let x = &manifest.drivers["x"];
    assert_eq!(x.call_timeout, DEFAULT_CALL_TIMEOUT);
    assert_eq!(x.poll_interval, None);
    assert!(x.options.is_empty());
    assert!(manifest.resources[0].matches.is_empty());
}

#[test]
fn empty_manifest_is_valid_and_empty() {
    let manifest = parse("").unwrap();
    assert!(manifest.drivers.is_empty() && manifest.resources.is_empty());
}

#[test]
fn relative_paths_resolve_against_the_manifest_folder() {
    let text = "kubelet_dir = \"sockets\"\ndriver_dir = \"../drivers\"\n\
                [driver.a]\nmodule = \"sub/a.so\"\n[driver.b]\nmodule = \"/opt/b.so\"\n\
                [[resource]]\nname = \"a.com/a\"\ndriver = \"a\"\n\
                [[resource]]\nname = \"a.com/b\"\ndriver = \"b\"\n";
    let manifest = parse(text).unwrap();
    assert_eq!(manifest.kubelet_dir, PathBuf::from("/etc/devhost/sockets"));
    assert_eq!(manifest.driver_dir, PathBuf::from("/etc/devhost/../drivers"));
    assert_eq!(manifest.drivers["a"].module_candidates, vec![PathBuf::from("/etc/devhost/../drivers/sub/a.so")]);
    assert_eq!(manifest.drivers["b"].module_candidates, vec![PathBuf::from("/opt/b.so")]);
}

#[test]
fn relative_manifest_path_keeps_paths_relative_to_the_working_folder() {
    let text = "driver_dir = \"drivers\"\n";
    let manifest = Manifest::parse(text, Path::new("devhost.toml"), None).unwrap();
    assert_eq!(manifest.driver_dir, PathBuf::from("drivers"));
}

#[test]
fn undeclared_driver_is_implicit_with_conventional_candidates_in_order() {
    let text = "driver_dir = \"/d\"\ncall_timeout = 3\n\
                [[resource]]\nname = \"a.com/b\"\ndriver = \"acme\"\n";
    let manifest = parse(text).unwrap();
    let acme = &manifest.drivers["acme"];
    assert!(acme.implicit);
    assert_eq!(acme.name, "acme");
    assert_eq!(acme.module_candidates, vec![PathBuf::from("/d/libdevhost_acme.so"), PathBuf::from("/d/acme.so")]);
    assert_eq!(acme.call_timeout, Duration::from_secs(3));
}

#[test]
fn a_hyphenated_driver_name_also_finds_the_cargo_spelling() {
    let text = "driver_dir = \"/d\"\n[[resource]]\nname = \"a.com/b\"\ndriver = \"example-c\"\n";
    let manifest = parse(text).unwrap();
    let candidates = &manifest.drivers["example-c"].module_candidates;
    assert_eq!(
        candidates,
        &vec![
            PathBuf::from("/d/libdevhost_example-c.so"),
            PathBuf::from("/d/libdevhost_example_c.so"),
            PathBuf::from("/d/example-c.so")
        ]
    );
}

#[test]
fn trust_settings_are_read() {
    let pin = "AB".repeat(32);
    let text = format!(
        "allow_untrusted_modules = true\n[driver.x]\nsha256 = \"{pin}\"\n[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\n"
    );
    let manifest = parse(&text).unwrap();
    assert!(manifest.allow_untrusted_modules);
    assert_eq!(manifest.drivers["x"].sha256.as_deref(), Some("ab".repeat(32).as_str()));
    let plain = parse("[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\n").unwrap();
    assert!(!plain.allow_untrusted_modules);
}

#[test]
fn declared_driver_without_module_uses_the_convention() {
    let text = "driver_dir = \"/d\"\n[driver.gpu]\npoll_interval = 60\n\
                [[resource]]\nname = \"a.com/b\"\ndriver = \"gpu\"\n";
    let gpu = &parse(text).unwrap().drivers["gpu"];
    assert!(!gpu.implicit);
    assert_eq!(gpu.module_candidates[0], PathBuf::from("/d/libdevhost_gpu.so"));
    assert_eq!(gpu.poll_interval, Some(Duration::from_secs(60)));
}

#[test]
fn one_module_backs_several_instances_and_one_instance_several_resources() {
    let text = "[driver.a]\nmodule = \"m.so\"\n[driver.a.options]\nx = 1\n\
                [driver.b]\nmodule = \"m.so\"\n[driver.b.options]\nx = 2\n\
                [[resource]]\nname = \"a.com/one\"\ndriver = \"a\"\n\
                [[resource]]\nname = \"a.com/two\"\ndriver = \"a\"\n\
                [[resource]]\nname = \"a.com/three\"\ndriver = \"b\"\n";
    let manifest = parse(text).unwrap();
    assert_eq!(manifest.drivers["a"].module_candidates, manifest.drivers["b"].module_candidates);
    assert_eq!(manifest.drivers["b"].options, vec![("x".into(), "2".into())]);
    let names: Vec<&str> = manifest.resources.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["a.com/one", "a.com/two", "a.com/three"]);
}

#[test]
fn options_are_flattened_and_sorted() {
    let text = "[driver.x.options]\nz = 1.5\nflag = true\nlist = [1, 2]\n\
                [driver.x.options.nested]\nkey = \"v\"\n[[driver.x.options.dev]]\npath = \"/dev/a\"\n\
                [[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\n";
    let options = &parse(text).unwrap().drivers["x"].options;
    let expected: Vec<(String, String)> =
        [("dev.0.path", "/dev/a"), ("flag", "true"), ("list", "1,2"), ("nested.key", "v"), ("z", "1.5")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
    assert_eq!(options, &expected);
}

#[test]
fn unused_declared_driver_is_a_warning_not_an_error() {
    let text = "[driver.spare]\n[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\n";
    let manifest = parse(text).unwrap();
    assert_eq!(manifest.warnings, vec![format!("{PATH}:1:1: driver.spare: declared but no [[resource]] uses it")]);
}

#[test]
fn matches_require_every_glob_and_id_is_the_device_id() {
    let text = "[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\n\
                match = { model = \"*H100*\", id = \"GPU-?\" }\n";
    let resource = &parse(text).unwrap().resources[0];
    let attrs = BTreeMap::from([("model".to_string(), "NVIDIA H100 80GB".to_string())]);
    assert!(resource.matches("GPU-1", &attrs));
    assert!(!resource.matches("GPU-10", &attrs));
    assert!(!resource.matches("GPU-1", &BTreeMap::new()));
    let other = BTreeMap::from([("model".to_string(), "A100".to_string())]);
    assert!(!resource.matches("GPU-1", &other));
}

#[test]
fn resource_without_match_takes_every_device() {
    let text = "[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\n";
    let resource = &parse(text).unwrap().resources[0];
    assert!(resource.matches("anything", &BTreeMap::new()));
}

#[test]
fn errors_display_one_diagnostic_per_line() {
    let errors = ManifestErrors(vec![
        Diagnostic { location: "f:1:2".into(), field: "a".into(), message: "bad".into() },
        Diagnostic { location: "f:3:4".into(), field: "b".into(), message: "worse".into() },
    ]);
    assert_eq!(errors.to_string(), "f:1:2: a: bad\nf:3:4: b: worse");
}

#[test]
fn load_reads_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("devhost.toml");
    std::fs::write(&path, "driver_dir = \"mods\"\n").unwrap();
    let manifest = Manifest::load(&path, None).unwrap();
    assert_eq!(manifest.driver_dir, dir.path().join("mods"));
    assert_eq!(manifest.path, path);
}

#[test]
fn unreadable_file_is_one_diagnostic_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("missing.toml");
    let ManifestErrors(diagnostics) = Manifest::load(&path, None).unwrap_err();
    assert_eq!(diagnostics.len(), 1);
    assert_eq!(diagnostics[0].location, path.display().to_string());
    assert!(diagnostics[0].message.contains("No such file"), "{:?}", diagnostics[0]);
}

#[test]
fn isolation_defaults_to_process_and_process_keeps_listed_capabilities() {
    let resource = "[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\n";
    let plain = parse(&format!("[driver.x]\n{resource}")).unwrap();
    assert_eq!(plain.drivers["x"].isolation, Isolation::Process { keep_capabilities: vec![] });
    let implicit = parse("[[resource]]\nname = \"a.com/b\"\ndriver = \"y\"\n").unwrap();
    assert_eq!(implicit.drivers["y"].isolation, Isolation::Process { keep_capabilities: vec![] });
    let kept = parse(&format!("[driver.x]\nkeep_capabilities = [\"CAP_SYS_ADMIN\"]\n{resource}")).unwrap();
    let admin = vec!["CAP_SYS_ADMIN".to_string()];
    assert_eq!(kept.drivers["x"].isolation, Isolation::Process { keep_capabilities: admin });
    let text = format!(
        "[driver.x]\nisolation = \"process\"\nkeep_capabilities = [\"CAP_SYS_ADMIN\", \"CAP_DAC_OVERRIDE\", \"CAP_SYS_ADMIN\"]\n{resource}"
    );
    let keep = vec!["CAP_SYS_ADMIN".to_string(), "CAP_DAC_OVERRIDE".to_string()];
    assert_eq!(parse(&text).unwrap().drivers["x"].isolation, Isolation::Process { keep_capabilities: keep });
    let bare = parse(&format!("[driver.x]\nisolation = \"process\"\n{resource}")).unwrap();
    assert_eq!(bare.drivers["x"].isolation, Isolation::Process { keep_capabilities: vec![] });
    let explicit = parse(&format!("[driver.x]\nisolation = \"in-process\"\n{resource}")).unwrap();
    assert_eq!(explicit.drivers["x"].isolation, Isolation::InProcess);
}
