//! The keys of the cross-vendor features: `cdi_dir`, `cdi_spec_dirs`, `metrics_addr`, `replicas`,
//! `one_replica_per_container` and `device_list_strategy`.

use std::path::PathBuf;

use super::{PATH, assert_has, errors, only_error, parse};
use crate::manifest::DeviceListStrategy;

const RESOURCE: &str = "[[resource]]\nname = \"example.com/gpu\"\ndriver = \"x\"\n";

#[test]
fn features_are_off_by_default() {
    let manifest = parse(RESOURCE).unwrap();
    assert_eq!((manifest.cdi_dir, manifest.metrics_addr), (None, None));
    let r = &manifest.resources[0];
    assert_eq!((r.replicas, r.one_replica_per_container), (1, false));
    assert_eq!(r.device_list_strategy, DeviceListStrategy::Edits);
}

#[test]
fn every_feature_key_is_read() {
    let text = format!(
        "cdi_dir = \"cdi\"\nmetrics_addr = \"[::]:9400\"\n{RESOURCE}replicas = 4\none_replica_per_container = true\n\
         device_list_strategy = \"cdi\"\n"
    );
    let manifest = parse(&text).unwrap();
    assert_eq!(manifest.cdi_dir, Some(PathBuf::from("/etc/devhost/cdi")), "relative to the manifest folder");
    assert_eq!(manifest.metrics_addr, Some("[::]:9400".parse().unwrap()));
    let r = &manifest.resources[0];
    assert_eq!((r.replicas, r.one_replica_per_container), (4, true));
    assert_eq!(r.device_list_strategy, DeviceListStrategy::Cdi);
    assert!(manifest.warnings.is_empty(), "{:?}", manifest.warnings);
}

#[test]
fn metrics_addr_must_be_ip_and_port() {
    let error = only_error("metrics_addr = \"localhost:9400\"\n");
    assert!(error.starts_with(&format!("{PATH}:1:16: metrics_addr: `localhost:9400` is not a socket")), "{error}");
    assert!(only_error("metrics_addr = \"0.0.0.0\"\n").contains("IP:PORT"));
}

#[test]
fn empty_cdi_dir_is_an_error() {
    let error = only_error("cdi_dir = \"\"\n");
    assert!(error.starts_with(&format!("{PATH}:1:11: cdi_dir: the path is empty")), "{error}");
}

#[test]
fn cdi_spec_dirs_default_to_the_runtimes_folders_and_resolve_like_other_paths() {
    let defaults = parse(RESOURCE).unwrap().cdi_spec_dirs;
    assert_eq!(defaults, vec![PathBuf::from("/etc/cdi"), PathBuf::from("/var/run/cdi")]);
    let manifest = parse(&format!("cdi_spec_dirs = [\"/run/cdi\", \"cdi\"]\n{RESOURCE}")).unwrap();
    assert_eq!(manifest.cdi_spec_dirs, vec![PathBuf::from("/run/cdi"), PathBuf::from("/etc/devhost/cdi")]);
    let error = only_error("cdi_spec_dirs = []\n");
    assert!(error.starts_with(&format!("{PATH}:1:17: cdi_spec_dirs: the list is empty")), "{error}");
    let error = only_error("cdi_spec_dirs = [\"/etc/cdi\", \"\"]\n");
    assert!(error.contains("cdi_spec_dirs: a path is empty"), "{error}");
}

#[test]
fn replicas_must_be_between_1_and_1024() {
    for (value, column) in [("0", 12), ("-2", 12), ("1025", 12)] {
        let error = only_error(&format!("{RESOURCE}replicas = {value}\n"));
        let prefix = format!("{PATH}:4:{column}: resource[0].replicas: replicas is {value}; it must be");
        assert!(error.starts_with(&prefix), "{error}");
    }
    let error = only_error(&format!("{RESOURCE}replicas = \"4\"\n"));
    assert!(error.starts_with(&format!("{PATH}:4:12: resource[0].replicas: invalid type")), "{error}");
}

#[test]
fn unknown_strategy_names_the_choices() {
    let error = only_error(&format!("{RESOURCE}device_list_strategy = \"envvar\"\n"));
    assert!(error.starts_with(&format!("{PATH}:4:24: resource[0].device_list_strategy: ")), "{error}");
    assert!(error.contains("`edits`") && error.contains("`cdi`"), "{error}");
}

#[test]
fn cdi_strategy_needs_cdi_dir() {
    let error = only_error(&format!("{RESOURCE}device_list_strategy = \"cdi\"\n"));
    assert!(error.starts_with(&format!("{PATH}:4:24: resource[0].device_list_strategy: ")), "{error}");
    assert!(error.contains("needs the top-level cdi_dir"), "{error}");
}

#[test]
fn with_cdi_dir_resource_names_must_be_cdi_kinds() {
    let text = "cdi_dir = \"/var/run/cdi\"\n[[resource]]\nname = \"1x.example.com/gpu\"\ndriver = \"x\"\n\
                [[resource]]\nname = \"example.com/2g\"\ndriver = \"x\"\n";
    let errors = errors(text);
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_has(&errors, &format!("{PATH}:3:8: resource[0].name: "), "vendor `1x.example.com` must start with a letter");
    assert_has(&errors, &format!("{PATH}:6:8: resource[1].name: "), "class `2g`");
    // Without cdi_dir the same names are fine: the kubelet accepts them.
    assert!(parse(&text.replace("cdi_dir = \"/var/run/cdi\"\n", "")).is_ok());
}

#[test]
fn one_replica_per_container_without_replicas_is_a_warning() {
    let manifest = parse(&format!("{RESOURCE}one_replica_per_container = true\n")).unwrap();
    assert_eq!(
        manifest.warnings,
        [format!("{PATH}:1:1: resource[0].one_replica_per_container: has no effect without replicas > 1")]
    );
}

#[test]
fn lock_dir_defaults_to_run_devhost_and_resolves_like_other_paths() {
    assert_eq!(parse(RESOURCE).unwrap().lock_dir, PathBuf::from(crate::manifest::DEFAULT_LOCK_DIR));
    let manifest = parse(&format!("lock_dir = \"run\"\n{RESOURCE}")).unwrap();
    assert_eq!(manifest.lock_dir, PathBuf::from("/etc/devhost/run"));
    assert!(only_error("lock_dir = \"\"\n").starts_with(&format!("{PATH}:1:12: lock_dir: the path is empty")));
}

#[test]
fn state_dir_defaults_to_var_lib_devhost_and_resolves_like_other_paths() {
    assert_eq!(parse(RESOURCE).unwrap().state_dir, PathBuf::from("/var/lib/devhost"));
    let manifest = parse(&format!("state_dir = \"state\"\n{RESOURCE}")).unwrap();
    assert_eq!(manifest.state_dir, PathBuf::from("/etc/devhost/state"));
    assert!(only_error("state_dir = \"\"\n").starts_with(&format!("{PATH}:1:13: state_dir: the path is empty")));
}
