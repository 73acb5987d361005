//! Which "demo node" the start-up and footprint figures run: the project's
//! `config/demo.toml` when it passes `devhost check` (the report says when it
//! falls short of three hardware drivers and six resources), otherwise the
//! best node the built modules allow, put together from the simulated FPGA
//! and TPU trees under `config/sim` and the C example.

use crate::node::{Artifacts, Node};
use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::process::Command;

pub struct Demo {
    pub manifest: PathBuf,
    pub resources: Vec<String>,
    /// Short name for tables, e.g. "config/demo.toml (3 drivers, 7 resources)".
    pub title: String,
    /// Why this node, and what each resource holds.
    pub notes: String,
}

/// `devhost check` on a manifest: Ok, or its complaint.
fn check(art: &Artifacts, manifest: &std::path::Path) -> Result<(), String> {
    let out = Command::new(art.devhost())
        .args(["check", "--config"])
        .arg(manifest)
        .current_dir(&art.repo)
        .env("DEVHOST_LOG", "off")
        .env("NO_COLOR", "1")
        .output()
        .map_err(|e| format!("cannot run devhost check: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    // Keep the problem lines, not the log lines around them.
    let text = String::from_utf8_lossy(&out.stderr);
    let problems: Vec<&str> =
        text.lines().filter(|l| l.starts_with("  ")).map(str::trim).filter(|l| !l.is_empty()).collect();
    if problems.is_empty() { Err(format!("devhost check failed ({})", out.status)) } else { Err(problems.join("; ")) }
}

/// Device counts per resource, from `devhost list --json`.
fn inventory(art: &Artifacts, manifest: &std::path::Path) -> String {
    let Ok(out) = Command::new(art.devhost())
        .args(["list", "--json", "--config"])
        .arg(manifest)
        .current_dir(&art.repo)
        .env("DEVHOST_LOG", "off")
        .output()
    else {
        return String::new();
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else { return String::new() };
    let items: Vec<String> = v
        .as_array()
        .map(|a| {
            a.iter()
                .map(|r| {
                    let n = r["devices"].as_array().map(Vec::len).unwrap_or(0);
                    format!(
                        "`{}` ({} device{}, driver {})",
                        r["resource"].as_str().unwrap_or("?"),
                        n,
                        if n == 1 { "" } else { "s" },
                        r["driver"].as_str().unwrap_or("?")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    items.join(", ")
}

fn resources_of(manifest: &std::path::Path) -> Result<(Vec<String>, usize)> {
    let m = devhost::manifest::Manifest::load(manifest, None).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((m.resources.iter().map(|r| r.name.clone()).collect(), m.drivers.len()))
}

/// Driver blocks for the composite node, with the resources each serves.
fn blocks(art: &Artifacts) -> Vec<(&'static str, String)> {
    let sim = art.repo.join("config/sim");
    vec![
        (
            "fpga",
            format!(
                "[driver.fpga]\nmodule = \"{}\"\n[driver.fpga.options]\nmode = \"port\"\nsysfs_root = \"{}\"\n\
                 devfs_root = \"{}\"\npoll_interval = \"5s\"\n\n\
                 [[resource]]\nname = \"example.com/fpga-nlb0\"\ndriver = \"fpga\"\n\
                 match = {{ driver = \"dfl\", afu_id = \"d8424dc4a4a3c413f89e433683f9040b\" }}\n\n\
                 [[resource]]\nname = \"example.com/fpga-nlb3\"\ndriver = \"fpga\"\n\
                 match = {{ driver = \"dfl\", afu_id = \"f7df405cbd7acf7222f144b0b93acd18\" }}\n\n\
                 [[resource]]\nname = \"example.com/alveo-u250\"\ndriver = \"fpga\"\n\
                 match = {{ driver = \"xrt\", model = \"u250\" }}\n",
                art.module("fpga").display(),
                sim.join("fpga/sys").display(),
                sim.join("fpga/dev").display()
            ),
        ),
        (
            "tpu",
            format!(
                "[driver.tpu]\nmodule = \"{}\"\n[driver.tpu.options]\nsysfs_root = \"{}\"\ndevfs_root = \"{}\"\n\
                 poll_interval = \"5s\"\n\n[[resource]]\nname = \"google.com/tpu\"\ndriver = \"tpu\"\n",
                art.module("tpu").display(),
                sim.join("tpu/sys").display(),
                sim.join("tpu/dev").display()
            ),
        ),
        (
            "example-c",
            format!(
                "[driver.example]\nmodule = \"{}\"\noptions = {{ count = 2, numa_nodes = 2 }}\n\n\
                 [[resource]]\nname = \"example.com/ex0\"\ndriver = \"example\"\nmatch = {{ id = \"example-0\" }}\n\n\
                 [[resource]]\nname = \"example.com/ex1\"\ndriver = \"example\"\nmatch = {{ id = \"example-1\" }}\n",
                art.module("example_c").display()
            ),
        ),
    ]
}

/// Picks the demo node; manifests it writes live in `node`.
pub fn choose(art: &Artifacts, node: &Node) -> Result<Demo> {
    let demo = art.repo.join("config/demo.toml");
    let mut why = String::new();
    if demo.exists() {
        match (check(art, &demo), resources_of(&demo)) {
            (Ok(()), Ok((resources, drivers))) => {
                let shape = if drivers >= 3 && resources.len() >= 6 {
                    String::new()
                } else {
                    format!(
                        " It has {drivers} drivers and {} resources, short of the 3 hardware drivers and 6 resources \
                         a full demo node should have; it is still the best node the repository ships.",
                        resources.len()
                    )
                };
                return Ok(Demo {
                    title: format!("config/demo.toml ({drivers} drivers, {} resources)", resources.len()),
                    notes: format!("`config/demo.toml` as shipped: {}.{shape}", inventory(art, &demo)),
                    manifest: demo,
                    resources,
                });
            }
            (Err(e), _) => why = format!("config/demo.toml does not pass `devhost check` ({e})"),
            (_, Err(e)) => why = format!("config/demo.toml does not parse ({e})"),
        }
    } else {
        why.push_str("there is no config/demo.toml");
    }
    let mut body = String::new();
    let mut used = Vec::new();
    for (name, block) in blocks(art) {
        let probe = node.write_manifest(&format!("probe-{name}.toml"), block.as_str())?;
        match check(art, &probe) {
            Ok(()) => {
                body.push_str(&block);
                body.push('\n');
                used.push(name);
            }
            Err(e) => why.push_str(&format!("; driver {name} left out: {e}")),
        }
    }
    if used.is_empty() {
        bail!("no driver passes `devhost check` for the demo node ({why})");
    }
    let manifest = node.write_manifest("demo.toml", &body)?;
    let (resources, drivers) = resources_of(&manifest).context("the composite demo manifest does not parse")?;
    Ok(Demo {
        title: format!("{} ({drivers} drivers, {} resources)", used.join(" + "), resources.len()),
        notes: format!(
            "Composite node written by the bench because {why}: the simulated FPGA and TPU trees of `config/sim` \
             with the options of `config/fpga.toml` and `config/tpu.toml`, plus the C example: {}.",
            inventory(art, &manifest)
        ),
        manifest,
        resources,
    })
}
