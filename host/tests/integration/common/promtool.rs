//! Prometheus's own `promtool` for the tests that check the alerts in docs/prometheus-rules.yaml
//! against what a real daemon exports: finding the tool, running it, and turning scrapes into the
//! input series of a `promtool test rules` file.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// promtool from `PROMTOOL`, `PATH` or ~/.cache/devhost/bin (where `scripts/install-deps` puts
/// it). `None` (the caller skips) when there is none, except in CI (`CI=true`), where that fails.
pub fn promtool() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PROMTOOL") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("promtool"))
        .find(|p| p.is_file());
    let cached = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/devhost/bin/promtool"));
    let found = on_path.or(cached.filter(|p| p.is_file()));
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "promtool not found (PROMTOOL, PATH, ~/.cache/devhost/bin): scripts/install-deps installs it"
        );
        eprintln!("SKIPPED: promtool not found; scripts/install-deps installs it");
    }
    found
}

/// Runs promtool with `args`, `stdin` on its standard input; returns (success, stdout+stderr).
pub fn run_promtool(tool: &PathBuf, args: &[&str], stdin: &str) -> (bool, String) {
    use std::io::Write;
    let mut child = Command::new(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// `series selector → value` of one exposition in the Prometheus text format.
pub fn samples(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter(|l| l.starts_with("devhost_"))
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(series, value)| (series.to_string(), value.to_string()))
        .collect()
}

/// promtool input series: `before` for minutes 0–4, `after` from minute 5 to 20 (`_` where a
/// scrape had no such series).
pub fn input_series(before: &str, after: &str) -> String {
    let (a, b) = (samples(before), samples(after));
    let mut names: Vec<&String> = a.keys().chain(b.keys()).collect();
    names.sort();
    names.dedup();
    let mut out = String::new();
    for name in names {
        let va = a.get(name).map_or("_", String::as_str);
        let vb = b.get(name).map_or("_", String::as_str);
        let values: Vec<&str> = std::iter::repeat_n(va, 5).chain(std::iter::repeat_n(vb, 16)).collect();
        out.push_str(&format!("      - series: '{name}'\n        values: '{}'\n", values.join(" ")));
    }
    out
}

/// The names of the alerts in docs/prometheus-rules.yaml.
pub fn alert_names(rules: &str) -> Vec<&str> {
    rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).collect()
}
