//! Figure 7: the criterion micro-benchmarks of `benches/hot_paths.rs`, run
//! through cargo at the end of the bench and read back from criterion's
//! `estimates.json` files for the report.

use crate::node::Artifacts;
use crate::stats::fmt_dur;
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The benchmarks of `benches/hot_paths.rs`: (criterion ID, what it measures, items per iteration).
pub const BENCHES: &[(&str, &str, u64)] = &[
    ("compose_64_devices", "`device::compose` of 64 devices' edits (node, env) for one Allocate", 64),
    ("choose_4_of_16_exhaustive", "`preferred::choose` 4 of 16 with links (exhaustive, 1,820 sets)", 1),
    ("choose_8_of_64_greedy", "`preferred::choose` 8 of 64 with links (greedy)", 1),
    ("encode_list_1000_devices", "prost encode of a 1,000-device ListAndWatchResponse", 1000),
    ("encoded_len_list_1000_devices", "prost `encoded_len` of the same message", 1000),
];

/// Criterion settings the full run uses to stay within its time budget.
pub const QUICK_ARGS: &[&str] = &["--warm-up-time", "1", "--measurement-time", "3"];

/// Runs the benchmarks with cargo (`cargo` is the path cargo gave us in `$CARGO`).
pub fn run_criterion(cargo: &Path, art: &Artifacts) -> Result<()> {
    let status = Command::new(cargo)
        .args(["bench", "-p", "devhost-bench", "--bench", "hot_paths", "--"])
        .args(QUICK_ARGS)
        .current_dir(&art.repo)
        .status()
        .with_context(|| format!("cannot run {}", cargo.display()))?;
    if !status.success() {
        bail!("`cargo bench -p devhost-bench` failed ({status})");
    }
    Ok(())
}

/// The median and mean criterion estimated, in nanoseconds.
fn estimate(dir: &Path, id: &str) -> Result<(f64, f64)> {
    let path = dir.join(id).join("new/estimates.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("no criterion result {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let point =
        |k: &str| v[k]["point_estimate"].as_f64().with_context(|| format!("{}: no {k}.point_estimate", path.display()));
    Ok((point("median")?, point("mean")?))
}

/// The report section from criterion's files under `target/criterion`.
pub fn section(art: &Artifacts, ran_here: bool) -> String {
    let dir = art.dir.parent().map(|t| t.join("criterion")).unwrap_or_default();
    let mut body = format!(
        "Command: `cargo bench -p devhost-bench` (criterion, `benches/hot_paths.rs`). {}\n\n\
         | Benchmark | median | mean | per item (median) |\n| --- | --- | --- | --- |\n",
        if ran_here {
            format!(
                "This run used `cargo bench -p devhost-bench --bench hot_paths -- {}` to stay short.",
                QUICK_ARGS.join(" ")
            )
        } else {
            "Not run by this invocation; the figures below are the last ones criterion saved.".to_string()
        }
    );
    let mut found = 0;
    for (id, what, items) in BENCHES {
        match estimate(&dir, id) {
            Ok((median, mean)) => {
                found += 1;
                let d = |ns: f64| fmt_dur(Duration::from_nanos(ns.round() as u64));
                let per = if *items > 1 { d(median / *items as f64) } else { "–".into() };
                body.push_str(&format!("| {what} | {} | {} | {per} |\n", d(median), d(mean)));
            }
            Err(e) => body.push_str(&format!("| {what} | not measured: {e} | | |\n")),
        }
    }
    if found == 0 {
        body.push_str("\nNo criterion results found: run `cargo bench -p devhost-bench`, then the bench again.\n");
    }
    body
}
