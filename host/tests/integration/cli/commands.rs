//! The inspection commands an operator runs on a node: list, check, sim,
//! and the log formats.

use crate::common::*;

fn manifest(node: &Node) -> std::path::PathBuf {
    node.write_manifest(&format!(
        r#"
driver_dir = "{dir}"
[driver.example_c]
options = {{ count = 2, numa_nodes = 0 }}
[driver.example_rust]
options = {{ count = 3 }}
[[resource]]
name = "example.com/c"
driver = "example_c"
[[resource]]
name = "example.com/rex-even"
driver = "example_rust"
match = {{ index = "[02]" }}
[[resource]]
name = "example.com/rex"
driver = "example_rust"
"#,
        dir = module("example_c").parent().unwrap().display()
    ))
}

#[test]
fn list_json_shows_what_would_be_advertised() {
    let node = Node::new();
    let m = manifest(&node);
    let (code, out, err) = devhost(&["list", "--config", m.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let arr = v.as_array().unwrap();
    assert_eq!(arr.len(), 3);
    assert_eq!(arr[0]["resource"], "example.com/c");
    let devs = arr[0]["devices"].as_array().unwrap();
    assert_eq!(devs.len(), 2);
    assert_eq!(devs[0]["id"], "example-0");
    assert_eq!(devs[0]["health"], "Healthy");
    assert!(devs[0]["numa_node"].is_null(), "numa_nodes = 0 means no NUMA affinity");
    assert_eq!(devs[0]["attributes"]["model"], "example-v1");
}

#[test]
fn match_globs_split_devices_and_the_first_resource_wins() {
    let node = Node::new();
    let m = manifest(&node);
    let (code, out, err) = devhost(&["list", "--config", m.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let ids = |i: usize| -> Vec<String> {
        v[i]["devices"].as_array().unwrap().iter().map(|d| d["id"].as_str().unwrap().to_string()).collect()
    };
    // `[02]` is not a glob class here: only `*` and `?` are special, so
    // nothing matches the literal "[02]"...
    assert!(ids(1).is_empty());
    // ...and every rex device goes to the catch-all resource.
    assert_eq!(ids(2), ["rex-0", "rex-1", "rex-2"]);
}

#[test]
fn first_matching_resource_takes_a_shared_device() {
    let node = Node::new();
    let m = node.write_manifest(&format!(
        r#"
driver_dir = "{dir}"
[driver.example_rust]
options = {{ count = 3 }}
[[resource]]
name = "example.com/first"
driver = "example_rust"
match = {{ index = "1" }}
[[resource]]
name = "example.com/rest"
driver = "example_rust"
"#,
        dir = module("example_c").parent().unwrap().display()
    ));
    let (code, out, err) = devhost(&["list", "--config", m.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["devices"].as_array().unwrap().len(), 1);
    assert_eq!(v[0]["devices"][0]["id"], "rex-1");
    let rest: Vec<&str> = v[1]["devices"].as_array().unwrap().iter().map(|d| d["id"].as_str().unwrap()).collect();
    assert_eq!(rest, ["rex-0", "rex-2"]);
}

#[test]
fn check_passes_a_good_manifest_and_lists_every_manifest_error() {
    let node = Node::new();
    let m = manifest(&node);
    let (code, out, err) = devhost(&["check", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("OK"), "{out}");
    let bad = node.write_manifest_exact("bogus = 1\n[[resource]]\nname = \"gpu\"\ndriver = \"x\"\n");
    let (code, _, err) = devhost(&["check", "--config", bad.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("devhost.toml:1:1") && err.contains("bogus"), "{err}");
    assert!(err.contains("devhost.toml:3:") && err.contains("gpu"), "{err}");
}

#[test]
fn rust_driver_logs_reach_the_host_log_as_json() {
    let node = Node::new();
    let m = manifest(&node);
    let out = std::process::Command::new(devhost_bin())
        .args(["--log-format", "json", "list", "--config", m.to_str().unwrap()])
        .env("DEVHOST_LOG", "info")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.contains("example-rust: 3 device(s)"))
        .unwrap_or_else(|| panic!("the SDK's log::info! did not reach the host log:\n{err}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["level"], "INFO");
    assert_eq!(v["fields"]["driver"], "example_rust");
}

#[test]
fn sim_registers_lists_and_allocates_one_device_per_resource() {
    let node = Node::new();
    let m = manifest(&node);
    let (code, out, err) = devhost(&["sim", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("3 of 3 resource(s) registered"), "{out}");
    assert!(out.contains("Allocate([example-0]) on example.com/c"), "{out}");
    assert!(out.contains("env         EXAMPLE_VISIBLE_DEVICES=example-0"), "{out}");
    assert!(out.contains("device      /dev/null -> /dev/rex0 (rw)"), "{out}");
    assert!(out.contains("REX_ALLOCATED_COUNT=1"), "{out}");
}

#[test]
fn check_refuses_a_device_served_by_dra_and_the_device_plugin() {
    let node = Node::new();
    let body = |second_match: &str| {
        format!(
            r#"
driver_dir = "{dir}"
[driver.example_rust]
options = {{ count = 3 }}
[[resource]]
name = "example.com/rex-dra"
driver = "example_rust"
api = "dra"
match = {{ id = "rex-1" }}
[[resource]]
name = "example.com/rex"
driver = "example_rust"
{second_match}
"#,
            dir = module("example_c").parent().unwrap().display()
        )
    };
    let m = node.write_manifest_exact(&body(""));
    let (code, _, err) = devhost(&["check", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("devhost.toml:10:1: device `rex-1` of driver `example_rust`"), "{err}");
    assert!(err.contains("`example.com/rex-dra` (api = \"dra\", at ") && err.contains("exactly one API"), "{err}");
    assert!(!err.contains("rex-0") && !err.contains("rex-2"), "only the shared device is named: {err}");
    // Split apart, the same two resources pass.
    let m = node.write_manifest(&body("match = { index = \"0\" }\n"));
    let (code, out, err) = devhost(&["check", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("OK"), "{out}");
}
