//! `api` and `dra_driver`: which kubelet API serves a resource, the DRA driver name, and the
//! one-API-per-device rule.

use std::collections::BTreeMap;

use super::{PATH, errors, only_error, parse};
use crate::manifest::{ResourceApi, TaintEffect, api_conflicts, check_dra_driver_name, derive_dra_driver_name};

const RESOURCE: &str = "[[resource]]\nname = \"example.com/gpu\"\ndriver = \"x\"\n";

#[test]
fn api_defaults_to_the_device_plugin() {
    let manifest = parse(RESOURCE).unwrap();
    assert_eq!(manifest.resources[0].api, ResourceApi::DevicePlugin);
    let explicit = parse(&format!("{RESOURCE}api = \"device-plugin\"\n")).unwrap();
    assert_eq!(explicit.resources[0].api, ResourceApi::DevicePlugin);
}

#[test]
fn dra_resource_gets_a_driver_name_from_its_resource_name() {
    let manifest = parse(&format!("{RESOURCE}api = \"dra\"\n")).unwrap();
    assert_eq!(manifest.resources[0].api, ResourceApi::Dra { driver_name: "gpu.example.com".into() });
}

#[test]
fn dra_driver_overrides_the_derived_name() {
    let manifest = parse(&format!("{RESOURCE}api = \"dra\"\ndra_driver = \"accel.example.com\"\n")).unwrap();
    assert_eq!(manifest.resources[0].api.dra_driver(), Some("accel.example.com"));
}

#[test]
fn derived_names_are_lower_case_dns_subdomains() {
    assert_eq!(derive_dra_driver_name("nvidia.com/h100"), "h100.nvidia.com");
    assert_eq!(derive_dra_driver_name("example.com/Big_GPU"), "big-gpu.example.com");
    assert_eq!(check_dra_driver_name("h100.nvidia.com"), Ok(()));
    assert!(check_dra_driver_name("-x.example.com").is_err());
    assert!(check_dra_driver_name("Gpu.example.com").is_err());
    let digit = check_dra_driver_name("3d.example.com").unwrap_err();
    assert!(digit.contains("`3d.example.com/claim`") && digit.contains("CDI vendor"), "{digit}");
    assert!(check_dra_driver_name(&format!("{}.example.com", "a".repeat(60))).unwrap_err().contains("at most 63"));
}

#[test]
fn unknown_api_is_an_error_at_its_value() {
    let error = only_error(&format!("{RESOURCE}api = \"csi\"\n"));
    assert!(error.starts_with(&format!("{PATH}:4:7: resource[0].api: unknown api \"csi\"")), "{error}");
}

#[test]
fn dra_driver_without_dra_is_an_error() {
    let error = only_error(&format!("{RESOURCE}dra_driver = \"gpu.example.com\"\n"));
    assert!(error.starts_with(&format!("{PATH}:4:14: resource[0].dra_driver: only applies with api")), "{error}");
}

#[test]
fn an_unhealthy_devices_taint_is_no_schedule_unless_set_to_no_execute() {
    let manifest = parse(&format!("{RESOURCE}api = \"dra\"\n")).unwrap();
    assert_eq!(manifest.resources[0].dra_taint_effect, TaintEffect::NoSchedule);
    let manifest = parse(&format!("{RESOURCE}api = \"dra\"\ndra_taint_effect = \"NoExecute\"\n")).unwrap();
    assert_eq!(manifest.resources[0].dra_taint_effect, TaintEffect::NoExecute);
    assert_eq!(TaintEffect::NoExecute.as_str(), "NoExecute");
}

#[test]
fn a_taint_effect_needs_dra_and_a_known_effect() {
    let error = only_error(&format!("{RESOURCE}dra_taint_effect = \"NoExecute\"\n"));
    assert!(error.starts_with(&format!("{PATH}:4:20: resource[0].dra_taint_effect: only applies with api")), "{error}");
    let error = only_error(&format!("{RESOURCE}api = \"dra\"\ndra_taint_effect = \"PreferNoSchedule\"\n"));
    assert!(
        error.starts_with(&format!(
            "{PATH}:5:20: resource[0].dra_taint_effect: unknown taint effect \"PreferNoSchedule\"; expected \"NoSchedule\" or \"NoExecute\""
        )),
        "{error}"
    );
}

#[test]
fn stale_claims_are_checked_every_five_minutes_unless_dra_claim_check_interval_says_otherwise() {
    assert_eq!(parse(RESOURCE).unwrap().dra_claim_check_interval, std::time::Duration::from_secs(300));
    let manifest = parse(&format!("dra_claim_check_interval = \"30s\"\n{RESOURCE}")).unwrap();
    assert_eq!(manifest.dra_claim_check_interval, std::time::Duration::from_secs(30));
    let error = only_error(&format!("dra_claim_check_interval = \"0s\"\n{RESOURCE}"));
    assert!(error.starts_with(&format!("{PATH}:1:28: dra_claim_check_interval: duration `0s` is zero")), "{error}");
}

#[test]
fn invalid_dra_driver_is_an_error() {
    let error = only_error(&format!("{RESOURCE}api = \"dra\"\ndra_driver = \"GPU_driver\"\n"));
    assert!(error.starts_with(&format!("{PATH}:5:14: resource[0].dra_driver: `GPU_driver` is not a valid")), "{error}");
}

#[test]
fn unusable_derived_name_asks_for_dra_driver() {
    let long = format!("example.com/{}", "g".repeat(60));
    // A short kubelet_dir keeps the device-plugin socket path within its limit.
    let text = format!("kubelet_dir = \"/k\"\n[[resource]]\nname = \"{long}\"\ndriver = \"x\"\napi = \"dra\"\n");
    let error = only_error(&text);
    assert!(error.starts_with(&format!("{PATH}:5:7: resource[0].api: the DRA driver name derived")), "{error}");
    assert!(error.contains("set `dra_driver`"), "{error}");
}

#[test]
fn two_resources_may_not_share_a_dra_driver_name() {
    let text = "[[resource]]\nname = \"example.com/gpu\"\ndriver = \"x\"\napi = \"dra\"\n\
                [[resource]]\nname = \"example.com/GPU\"\ndriver = \"x\"\napi = \"dra\"\n";
    let errors = errors(text);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(errors[0].starts_with(&format!("{PATH}:8:7: resource[1].dra_driver: DRA driver name `gpu.example.com`")));
    assert!(errors[0].contains(&format!("resource `example.com/gpu` at {PATH}:1:1")), "{}", errors[0]);
}

fn two_resources(first_api: &str, second_api: &str) -> Vec<crate::manifest::ResourceConfig> {
    let text = format!(
        "[[resource]]\nname = \"example.com/a\"\ndriver = \"x\"\napi = \"{first_api}\"\nmatch = {{ model = \"v1\" }}\n\
         [[resource]]\nname = \"example.com/b\"\ndriver = \"x\"\napi = \"{second_api}\"\n"
    );
    parse(&text).unwrap().resources
}

#[test]
fn a_device_selected_by_a_dra_and_another_resource_is_a_conflict() {
    let v1 = BTreeMap::from([("model".to_string(), "v1".to_string())]);
    let v2 = BTreeMap::from([("model".to_string(), "v2".to_string())]);
    let devices = [("d0", &v1), ("d1", &v2)];
    for (a, b) in [("dra", "device-plugin"), ("device-plugin", "dra"), ("dra", "dra")] {
        let problems = api_conflicts(&two_resources(a, b), "x", devices);
        assert_eq!(problems.len(), 1, "{a}/{b}: {problems:#?}");
        let p = &problems[0];
        assert!(
            p.starts_with(&format!("{PATH}:6:1: device `d0` of driver `x` is selected by resource `example.com/b`"))
        );
        assert!(p.contains(&format!("resource `example.com/a` (api = \"{a}\", at {PATH}:1:1)")), "{p}");
    }
}

#[test]
fn device_plugin_resources_may_still_share_a_device() {
    let v1 = BTreeMap::from([("model".to_string(), "v1".to_string())]);
    let resources = two_resources("device-plugin", "device-plugin");
    assert!(api_conflicts(&resources, "x", [("d0", &v1)]).is_empty());
    // Another driver's resources are not this driver's business.
    assert!(api_conflicts(&two_resources("dra", "dra"), "y", [("d0", &v1)]).is_empty());
}

#[test]
fn kubelet_root_dir_defaults_to_the_kubelets_and_resolves_relative_paths() {
    assert_eq!(parse(RESOURCE).unwrap().kubelet_root_dir, std::path::PathBuf::from("/var/lib/kubelet"));
    let manifest = parse(&format!("kubelet_root_dir = \"root\"\n{RESOURCE}")).unwrap();
    assert_eq!(manifest.kubelet_root_dir, std::path::PathBuf::from("/etc/devhost/root"));
    let error = only_error(&format!("kubelet_root_dir = \"\"\n{RESOURCE}"));
    assert!(error.starts_with(&format!("{PATH}:1:20: kubelet_root_dir: the path is empty")), "{error}");
}

#[test]
fn kubeconfig_resolves_against_the_manifest_folder_and_node_name_is_kept() {
    let manifest = parse(&format!("kubeconfig = \"kube/config\"\nnode_name = \"gpu-node-7\"\n{RESOURCE}")).unwrap();
    let folder = std::path::Path::new(PATH).parent().unwrap();
    assert_eq!(manifest.kubeconfig.as_deref(), Some(folder.join("kube/config").as_path()));
    assert_eq!(manifest.node_name.as_deref(), Some("gpu-node-7"));
    let unset = parse(RESOURCE).unwrap();
    assert_eq!((unset.kubeconfig, unset.node_name), (None, None));
}

#[test]
fn a_node_name_that_is_not_a_dns_subdomain_is_refused_at_its_line() {
    let error = only_error(&format!("node_name = \"GPU_Node\"\n{RESOURCE}"));
    assert!(
        error.contains(":1:") && error.contains("node_name") && error.contains("`GPU_Node` is not a node name"),
        "{error}"
    );
}

#[test]
fn a_dra_resource_is_not_held_to_the_device_plugin_socket_length() {
    // Under the default kubelet_dir this name's device-plugin socket would pass 107 bytes; a DRA
    // resource has no such socket, so only the device-plugin twin is refused.
    let name = format!("{}.example.com/gpu", "a".repeat(60));
    let dra =
        format!("[[resource]]\nname = \"{name}\"\ndriver = \"x\"\napi = \"dra\"\ndra_driver = \"g.example.com\"\n");
    assert!(parse(&dra).is_ok(), "{:?}", errors(&dra));
    let plugin = format!("[[resource]]\nname = \"{name}\"\ndriver = \"x\"\n");
    assert!(only_error(&plugin).contains("bytes long; a unix socket path may have at most 107"));
}

#[test]
fn replicas_on_a_dra_resource_is_a_warning() {
    let manifest = parse(&format!("{RESOURCE}api = \"dra\"\nreplicas = 2\n")).unwrap();
    assert_eq!(manifest.warnings.len(), 1, "{:?}", manifest.warnings);
    assert!(
        manifest.warnings[0]
            .starts_with(&format!("{PATH}:1:1: resource[0].replicas: has no effect with api = \"dra\"")),
        "{:?}",
        manifest.warnings
    );
    assert!(parse(&format!("{RESOURCE}replicas = 2\n")).unwrap().warnings.is_empty());
}
