//! The alerts operators are given (docs/prometheus-rules.yaml) fire where they must, on what a
//! real daemon exports: the real binary runs a node where one driver's module is missing (its
//! resource never registers), one driver's create keeps failing, one device is unhealthy,
//! Allocate calls time out or are refused, and a reload's new driver settings are refused. Two scrapes of its `/metrics` (before and after the
//! incidents) pass Prometheus's own `promtool check metrics`, and become the input series of a
//! `promtool test rules` file that evaluates every documented alert.
//!
//! promtool comes from `scripts/install-deps` (Debian's `prometheus` package, unpacked under
//! ~/.cache/devhost/bin); `PROMTOOL=path` names another. Without it the test is skipped, except
//! in CI (`CI=true`), where a missing promtool fails it.

use crate::common::promtool::{input_series, promtool, run_promtool};
use crate::common::*;
use devhost::ops::metrics;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Scrapes until the exposition contains every line of `want`.
async fn scrape_until(addr: SocketAddr, want: &[&str]) -> String {
    let start = Instant::now();
    loop {
        let body = metrics::get(addr, "/metrics", &[]).await.map(|r| r.body).unwrap_or_default();
        if want.iter().all(|w| body.lines().any(|l| l == *w)) {
            return body;
        }
        assert!(start.elapsed() < WAIT * 2, "the scrape never showed {want:?}:\n{body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The `description:` of alert `name` in the rule file, as written there (a quoted YAML string).
fn description_of(rules: &str, name: &str) -> String {
    let from = rules.find(&format!("- alert: {name}\n")).unwrap_or_else(|| panic!("no alert {name}"));
    let line = rules[from..].lines().find_map(|l| l.trim().strip_prefix("description: "));
    line.unwrap_or_else(|| panic!("alert {name} has no description")).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_alert_fires_on_a_real_scrape() {
    let Some(tool) = promtool() else { return };
    let rules = repo_root().join("docs/prometheus-rules.yaml");
    let rules_text = std::fs::read_to_string(&rules).unwrap();
    let (ok, out) = run_promtool(&tool, &["check", "rules", rules.to_str().unwrap()], "");
    assert!(ok, "promtool check rules {}:\n{out}", rules.display());

    let node = Node::new();
    let addr = free_port();
    std::fs::write(node.path().join("health"), "example-1\n").unwrap();
    let manifest_text = |ex_extra: &str| {
        format!(
            r#"metrics_addr = "{addr}"
cdi_dir = "{cdi}"
cdi_spec_dirs = ["{runtime_cdi}"]
[driver.ex]
module = "{ex}"
options = {{ count = 2, health_file = "{health}"{ex_extra} }}
[driver.slow]
module = "{t}"
call_timeout = "300ms"
options = {{ count = 2, hang_in = "allocate", hang_ms = 3000 }}
[driver.missing]
module = "{missing}"
[driver.booting]
module = "{t}"
options = {{ fail_create_until = "{never}" }}
[[resource]]
name = "example.com/accel"
driver = "ex"
device_list_strategy = "cdi"
[[resource]]
name = "example.com/slow"
driver = "slow"
[[resource]]
name = "example.com/missing"
driver = "missing"
[[resource]]
name = "example.com/booting"
driver = "booting"
"#,
            ex = module("example_c").display(),
            t = module("testdrv").display(),
            health = node.path().join("health").display(),
            missing = node.path().join("libdevhost_missing.so").display(),
            never = node.path().join("never").display(),
            // devhost writes its specs where the runtime does not look: its CDI names do not resolve.
            cdi = node.path().join("cdi").display(),
            runtime_cdi = node.path().join("runtime-cdi").display(),
        )
    };
    let m = node.write_manifest(&manifest_text(""));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/accel", WAIT, |x| x.len() == 2).await.unwrap();
    kubelet.wait_devices("example.com/slow", WAIT, |x| x.len() == 2).await.unwrap();
    let before = scrape_until(
        addr,
        &[
            r#"devhost_resource_registered{resource="example.com/accel"} 1"#,
            r#"devhost_resource_registered{resource="example.com/slow"} 1"#,
            r#"devhost_driver_create_retrying{driver="booting"} 1"#,
            r#"devhost_cdi_unresolvable_devices{resource="example.com/accel"} 2"#,
        ],
    )
    .await;
    // The series an alert reads exist before anything happened: at 0.
    for line in [
        r#"devhost_resource_registered{resource="example.com/missing"} 0"#,
        r#"devhost_module_load_failures_total{driver="ex"} 0"#,
        r#"devhost_allocations_total{resource="example.com/accel",outcome="error"} 0"#,
        r#"devhost_driver_calls_total{driver="slow",call="allocate",outcome="timeout"} 0"#,
        r#"devhost_cdi_unresolvable_devices{resource="example.com/slow"} 0"#,
    ] {
        assert!(before.lines().any(|l| l == line), "no {line:?} at start-up:\n{before}");
    }

    // The incidents: an Allocate of an unknown device, an Allocate whose hook misses its deadline,
    // and a reload whose new settings for `ex` its module refuses (the old instance serves on).
    kubelet.allocate("example.com/accel", vec![vec!["nonexistent".into()]]).await.unwrap_err();
    kubelet.allocate("example.com/slow", vec![vec!["t-0".into()]]).await.unwrap_err();
    let next = node.path().join("next.toml");
    std::fs::write(&next, manifest_text(", colour = \"blue\"")).unwrap();
    std::fs::rename(&next, &m).unwrap();
    let after = scrape_until(
        addr,
        &[
            r#"devhost_allocations_total{resource="example.com/accel",outcome="error"} 1"#,
            r#"devhost_driver_calls_total{driver="slow",call="allocate",outcome="timeout"} 1"#,
            r#"devhost_module_load_failures_total{driver="ex"} 1"#,
        ],
    )
    .await;

    for (when, text) in [("before", &before), ("after", &after)] {
        let (ok, out) = run_promtool(&tool, &["check", "metrics"], text);
        assert!(ok, "promtool check metrics on the scrape {when} the incidents:\n{out}\n{text}");
    }

    // Each firing alert: its labels and its summary (the description is the rule file's, as is).
    let alert_at = |eval: &str, name: &str, fired: &[(&str, &str)]| {
        let description = description_of(&rules_text, name);
        let mut s = format!("          - eval_time: {eval}\n            alertname: {name}\n            exp_alerts:\n");
        for (labels, summary) in fired {
            s.push_str(&format!(
                "              - exp_labels: {{ {labels} }}\n                exp_annotations:\n                  summary: {summary:?}\n                  description: {description}\n"
            ));
        }
        s
    };
    // 7 minutes in: the incidents are 2 minutes old, the start-up 7 (past every `for: 5m`).
    let alert = |name: &str, fired: &[(&str, &str)]| alert_at("7m", name, fired);
    let tests = format!(
        "rule_files:\n  - {rules}\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n{series}    alert_rule_test:\n{a}",
        rules = rules.display(),
        series = input_series(&before, &after),
        a = [
            alert(
                "DevhostResourceNotRegistered",
                &[(
                    r#"severity: critical, resource: "example.com/missing""#,
                    "example.com/missing is not registered with the kubelet",
                )],
            ),
            alert(
                "DevhostUnhealthyDevices",
                &[(
                    r#"severity: warning, resource: "example.com/accel", health: unhealthy"#,
                    "1 unhealthy device(s) of example.com/accel",
                )],
            ),
            alert(
                "DevhostDriverCallsFailing",
                &[(
                    "severity: warning, driver: slow, call: allocate, outcome: timeout",
                    "driver slow: allocate calls end in timeout",
                )],
            ),
            alert(
                "DevhostAllocateErrors",
                &[
                    (
                        r#"severity: warning, resource: "example.com/accel", outcome: error"#,
                        "Allocate requests for example.com/accel are refused",
                    ),
                    (
                        r#"severity: warning, resource: "example.com/slow", outcome: error"#,
                        "Allocate requests for example.com/slow are refused",
                    ),
                ],
            ),
            alert(
                "DevhostModuleLoadFailed",
                &[
                    // At start-up: the series appeared at 1.
                    ("severity: critical, driver: missing", "driver missing could not be loaded"),
                    // By the reload: an increase from 0.
                    ("severity: critical, driver: ex", "driver ex could not be loaded"),
                ],
            ),
            alert(
                "DevhostCDINamesUnresolvable",
                &[(
                    r#"severity: critical, resource: "example.com/accel""#,
                    "2 device(s) of example.com/accel have a CDI name the container runtime cannot resolve",
                )],
            ),
            alert_at(
                "12m",
                "DevhostDriverCreateRetrying",
                &[("severity: warning, driver: booting", "driver booting has been failing to start for 10 minutes")],
            ),
        ]
        .concat(),
    );
    let file = node.path().join("alerts-test.yaml");
    std::fs::write(&file, &tests).unwrap();
    let (ok, out) = run_promtool(&tool, &["test", "rules", file.to_str().unwrap()], "");
    assert!(ok, "promtool test rules:\n{out}\n--- test file ---\n{tests}");
}

/// The documentation lists the alerts of the rule file, expression for expression.
#[test]
fn the_documented_alerts_are_the_rule_file() {
    let rules = std::fs::read_to_string(repo_root().join("docs/prometheus-rules.yaml")).unwrap();
    let features = std::fs::read_to_string(repo_root().join("docs/features.md")).unwrap();
    let names = crate::common::promtool::alert_names(&rules);
    assert_eq!(names.len(), 7, "{names:?}");
    for name in names {
        assert!(features.contains(&format!("`{name}`")), "docs/features.md does not describe alert {name}");
    }
}
