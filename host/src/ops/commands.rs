//! The one-shot commands (`list`, `check`, `drivers`) and how every command loads the
//! manifest ([`load_manifest`]).

use crate::engine::podresources::Snapshot;
use crate::engine::registry::report::View;
use crate::engine::registry::{DriverState, Mode, Registry};
use crate::manifest::Manifest;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// What the command line says about every command.
#[derive(Debug, Clone, Copy, Default)]
pub struct Flags {
    /// `--allow-untrusted-modules`: load modules others can write (as the manifest's key).
    pub allow_untrusted_modules: bool,
    /// `--log-format json`: manifest problems are log lines, not text on stderr.
    pub json_logs: bool,
}

/// Loads the manifest at `path`, logging its warnings; its problems are printed (as log lines
/// with `--log-format json`), and then there is none.
pub fn load_manifest(path: &Path, kubelet_dir: Option<&Path>, flags: Flags) -> Option<Manifest> {
    match Manifest::load(path, kubelet_dir) {
        Ok(mut m) => {
            if flags.allow_untrusted_modules {
                m.allow_untrusted_modules = true;
            }
            if m.allow_untrusted_modules {
                tracing::warn!("module trust checks are relaxed: modules others can write will be loaded");
            }
            for w in &m.warnings {
                tracing::warn!("{w}");
            }
            Some(m)
        }
        Err(errors) => {
            if flags.json_logs {
                for d in &errors.0 {
                    tracing::error!(location = %d.location, field = %d.field, "manifest problem: {}", d.message);
                }
            } else {
                eprintln!("devhost: {} has {} problem(s):", path.display(), errors.0.len());
                for d in &errors.0 {
                    eprintln!("  {d}");
                }
            }
            None
        }
    }
}

/// `devhost list`: every resource and its devices, as a table or as JSON.
pub async fn list(config: &Path, json: bool, flags: Flags) -> ExitCode {
    let Some(manifest) = load_manifest(config, None, flags) else { return ExitCode::from(2) };
    let registry = Registry::open(&manifest, Mode::Inspect).await;
    if json {
        let holders = list_holders(&manifest).await;
        let out = registry.status(View::List(holders.as_ref().map_err(String::as_str)));
        match serde_json::to_string_pretty(&out) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("devhost: cannot encode JSON: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        for r in &registry.resources() {
            println!("{} (driver {})", r.config.name, r.config.driver);
            if let Some(e) = &r.error {
                println!("  NOT SERVED: {e}");
                continue;
            }
            let view = r.snapshot();
            if view.devices.is_empty() {
                println!("  (no devices)");
            }
            for d in &view.devices {
                let numa = d.numa_node.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
                let mut attrs: Vec<String> = d.attributes.iter().map(|(k, v)| format!("{k}={v}")).collect();
                attrs.extend(links_text(d));
                let health = if d.healthy { "Healthy" } else { "Unhealthy" };
                println!("  {:<40} {:<9} numa={:<2} {}", d.id, health, numa, attrs.join(" "));
                if let Some(why) = d.health_reason.as_ref().filter(|_| !d.healthy) {
                    println!("  {:<40} reason: {why}", "");
                }
            }
        }
    }
    registry.shutdown();
    ExitCode::SUCCESS
}

/// `links=other:score,…` when the device has links.
fn links_text(d: &crate::driver::device::Device) -> Option<String> {
    let links: Vec<String> = d.links.iter().map(|(other, score)| format!("{other}:{score}")).collect();
    (!links.is_empty()).then(|| format!("links={}", links.join(",")))
}

/// Who holds each device, from the kubelet's pod-resources socket when there is one (a running
/// node); `list` works without it, and each resource then says why there are no holders.
async fn list_holders(manifest: &Manifest) -> Result<Snapshot, String> {
    let map =
        crate::engine::podresources::list_once(&manifest.pod_resources_socket).await.map_err(|e| e.to_string())?;
    Ok(Snapshot { generation: 1, resources: Some(std::sync::Arc::new(map)), ..Default::default() })
}

/// `devhost check`: the manifest, every driver's create and the CDI names it would hand out.
pub async fn check(config: &Path, flags: Flags) -> ExitCode {
    let Some(manifest) = load_manifest(config, None, flags) else { return ExitCode::from(2) };
    let registry = Registry::open(&manifest, Mode::Inspect).await;
    let mut problems = Vec::new();
    for (name, state) in registry.drivers() {
        match state {
            DriverState::Failed(e) => problems.push(e),
            // A device is served by exactly one kubelet API: only the devices decide whether
            // a DRA resource's `match` overlaps another resource's.
            DriverState::Ready(inst)
                if manifest.resources.iter().any(|r| r.driver == name && r.api.dra_driver().is_some()) =>
            {
                match inst.scan().await {
                    Ok(out) => {
                        let devices = out.devices.iter().map(|d| (d.id.as_str(), &d.attributes));
                        problems.extend(crate::manifest::api_conflicts(&manifest.resources, &name, devices));
                    }
                    Err(e) => problems.push(format!("driver {name}: scan failed: {e}")),
                }
            }
            DriverState::Ready(_) => {}
        }
    }
    let cdi = registry.planned_cdi_report();
    problems.extend(cdi.problems.iter().map(ToString::to_string));
    registry.shutdown();
    for line in &cdi.skipped {
        eprintln!("devhost: note: {line}");
    }
    if problems.is_empty() {
        println!(
            "{}: OK ({} driver(s), {} resource(s))",
            config.display(),
            manifest.drivers.len(),
            manifest.resources.len()
        );
        ExitCode::SUCCESS
    } else {
        eprintln!("devhost: {} has {} problem(s):", config.display(), problems.len());
        for p in &problems {
            eprintln!("  {p}");
        }
        ExitCode::from(1)
    }
}

/// `devhost drivers`: what each module in `dir` is, loading only trusted ones unless told.
pub fn drivers(dir: &Path, flags: Flags) -> ExitCode {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("devhost: cannot read driver folder {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    };
    let mut paths: Vec<PathBuf> =
        entries.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "so")).collect();
    paths.sort();
    if paths.is_empty() {
        println!("no .so files in {}", dir.display());
    }
    for p in paths {
        let file = p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        // Loading runs a module's initialisers: an untrusted one is only
        // described, not loaded, unless the operator relaxed trust.
        if let Err(problems) = crate::driver::loader::check_trust(&p, None) {
            let text: Vec<String> = problems.iter().map(|e| e.to_string()).collect();
            println!("{file}: UNTRUSTED (refused unless allow_untrusted_modules): {}", text.join("; "));
            if !flags.allow_untrusted_modules {
                println!("    not loaded; --allow-untrusted-modules loads it to show what it is");
                continue;
            }
        }
        match crate::driver::loader::load(&p) {
            Ok(m) => println!(
                "{file}: {} {} (ABI {}) [{}]{}\n    sha256 {} (the bytes loaded; `sha256 = ...` in [driver.X] pins them)",
                m.name,
                m.version,
                m.abi_version(),
                m.capabilities().join(", "),
                if m.description.is_empty() { String::new() } else { format!(" — {}", m.description) },
                m.source.sha256()
            ),
            Err(e) => println!("{file}: cannot be loaded: {e}"),
        }
    }
    ExitCode::SUCCESS
}
