//! Trying every hook without a cluster, through the real binary: link scores
//! in `list`, `list --json` and `sim`, a warning for a link to an ID the scan
//! does not report, `sim`'s preferred-allocation choice with the scores
//! behind it, and a simulated pod that ends so the release hook runs.

use crate::common::*;
use std::process::Command;

fn manifest(node: &Node, body: &str) -> String {
    node.write_manifest(body).display().to_string()
}

fn example_c(options: &str) -> String {
    format!(
        "driver_dir = \"{}\"\n[driver.example_c]\noptions = {{ {options} }}\n[[resource]]\nname = \"example.com/fake\"\ndriver = \"example_c\"\n",
        module("example_c").parent().unwrap().display()
    )
}

#[test]
fn list_shows_link_scores_in_text_and_json() {
    let node = Node::new();
    let m = manifest(&node, &example_c("count = 4, numa_nodes = 2"));
    let (code, out, err) = devhost(&["list", "--config", &m]);
    assert_eq!(code, 0, "{err}");
    let line = out.lines().find(|l| l.trim_start().starts_with("example-0 ")).expect("example-0 listed");
    assert!(line.ends_with("links=example-1:10"), "{line}");

    let (code, out, err) = devhost(&["list", "--config", &m, "--json"]);
    assert_eq!(code, 0, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).unwrap();
    let dev = &json[0]["devices"][0];
    assert_eq!(dev["id"], "example-0");
    assert_eq!(dev["links"], serde_json::json!([{ "id": "example-1", "score": 10 }]));
}

#[test]
fn a_link_to_an_id_the_scan_does_not_report_is_a_warning_naming_both() {
    let node = Node::new();
    let so = node.path().join("libdevhost_nc.so");
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-DBAD_LINK", "-I"])
        .arg(abi_include())
        .arg("-o")
        .arg(&so)
        .arg(repo_root().join("tests/fixtures/nonconforming_driver.c"))
        .status()
        .unwrap();
    assert!(st.success());
    let m = manifest(
        &node,
        &format!(
            "allow_untrusted_modules = true\n[driver.nc]\nmodule = \"{}\"\n[[resource]]\nname = \"example.com/nc\"\ndriver = \"nc\"\n",
            so.display()
        ),
    );
    let (code, out, err) = devhost(&["list", "--config", &m]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains(
            r#"driver emitted bad data: device "nc-0": link to "nc-99", which this scan does not report, is ignored"#
        ),
        "{err}"
    );
    // The link is still shown as reported, so the operator sees the typo.
    assert!(out.contains("links=nc-99:10"), "{out}");
}

fn sim(manifest: &str) -> String {
    let (code, out, err) = devhost(&["sim", "--config", manifest]);
    assert_eq!(code, 0, "{out}\n{err}");
    out
}

#[test]
fn sim_keeps_no_state_in_the_manifests_state_dir() {
    // The example driver has a release hook, so a daemon would keep release
    // state and an allocation journal in state_dir; a simulation must not
    // touch the node's.
    let node = Node::new();
    let state = node.path().join("node-state");
    let body = format!("state_dir = \"{}\"\n{}", state.display(), example_c("count = 2"));
    let out = sim(&manifest(&node, &body));
    assert!(out.contains("Allocate"), "{out}");
    let written: Vec<_> =
        std::fs::read_dir(&state).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(written.is_empty(), "sim wrote into the manifest's state_dir: {written:?}");
}

#[test]
fn sim_prints_links_and_the_preferred_choice_with_its_scores() {
    let node = Node::new();
    let out = sim(&manifest(&node, &example_c("count = 4, numa_nodes = 2")));
    let header = out.lines().find(|l| l.starts_with("RESOURCE")).expect("device table");
    assert!(header.contains("LINKS"), "{header}");
    let row = out.lines().find(|l| l.contains(" example-1 ")).expect("example-1 row");
    assert!(row.contains("example-0:10"), "{row}");
    // Fewest NUMA nodes wins over links: example-0 and example-2 share node 0,
    // the linked pairs span two nodes. Both are shown, with their scores.
    assert!(out.contains("GetPreferredAllocation(2 of 4) on example.com/fake:"), "{out}");
    assert!(out.contains("  chosen      example-0,example-2  NUMA 0  link score 0"), "{out}");
    assert!(out.contains("  linked      example-0,example-1  NUMA 0,1  link score 20"), "{out}");
}

#[test]
fn sim_ends_a_pod_and_shows_the_release_hook_with_its_timing() {
    let node = Node::new();
    let log = node.path().join("released");
    let out = sim(&manifest(
        &node,
        &example_c(&format!("count = 2, release_delay_ms = 300, release_file = \"{}\"", log.display())),
    ));
    assert!(out.contains("Pod sim/sim-pod-0 (holding example-0 on example.com/fake) ends:"), "{out}");
    let line = out.lines().find(|l| l.contains("release([example-0]) called")).unwrap_or_else(|| panic!("{out}"));
    let took: u64 = line
        .split("returned OK after ")
        .nth(1)
        .and_then(|r| r.split(" ms").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(took >= 250, "the hook sleeps 300 ms, yet took {took} ms: {line}");
    // The driver really ran it: its release file names the device.
    let released = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(released.contains("example-0"), "{released:?}");
}

#[test]
fn sim_says_when_the_release_hook_fails() {
    let node = Node::new();
    let fail = node.path().join("fail");
    std::fs::write(&fail, "example-0\n").unwrap();
    let out = sim(&manifest(&node, &example_c(&format!("count = 1, release_fail_file = \"{}\"", fail.display()))));
    let line = out.lines().find(|l| l.contains("release([example-0])")).unwrap_or_else(|| panic!("{out}"));
    assert!(line.contains("failed after") && line.contains("the host retries"), "{line}");
}
