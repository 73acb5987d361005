//! `devhost sim` and `devhost demo`: the daemon and an embedded kubelet
//! emulator in one process, so an operator or a driver author can see what a
//! manifest advertises and what a container would receive, without a cluster.

use crate::manifest::Manifest;
use crate::registry::{Registry, Resource};
use kubelet_emu::Kubelet;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const REGISTER_WAIT: Duration = Duration::from_secs(10);

/// A private device-plugins folder for the embedded kubelet, removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> std::io::Result<ScratchDir> {
        let dir = std::env::temp_dir().join(format!("devhost-sim-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(ScratchDir(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the simulation and prints its report. `keep_running` then keeps
/// serving and prints every device-list change until `stop` resolves.
pub async fn run(config: &Path, keep_running: bool, stop: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    let scratch = ScratchDir::new()?;
    let manifest = Manifest::load(config, Some(&scratch.0))
        .map_err(|e| anyhow::anyhow!("{} is invalid:\n{e}", config.display()))?;
    let kubelet = Arc::new(Kubelet::start(&scratch.0)?);
    let registry = Registry::open(&manifest, crate::registry::Mode::Simulate).await;
    let endpoints = crate::kubelet::Endpoints::start(scratch.0.clone(), registry.services.clone());
    let resources = registry.resources();
    endpoints.sync(&resources).await;

    let mut out = String::new();
    let served: Vec<&str> = resources.iter().filter(|r| r.driver.is_some()).map(|r| r.config.name.as_str()).collect();
    for name in &served {
        if let Err(e) = kubelet.wait_list_count(name, 1, REGISTER_WAIT).await {
            let _ = writeln!(out, "! {name}: {e}");
        }
    }
    let _ = writeln!(
        out,
        "devhost sim: {} — {} of {} resource(s) registered with the embedded kubelet\n",
        config.display(),
        kubelet.resources().len(),
        resources.len()
    );
    out.push_str(&device_table(&resources, &kubelet));
    for name in &served {
        out.push_str(&allocation_report(&kubelet, name).await);
    }
    print!("{out}");

    if keep_running {
        println!("\nServing; device-list changes are printed below. Ctrl-C to stop.");
        let watchers: Vec<_> =
            served.iter().map(|n| tokio::spawn(watch_changes(kubelet.clone(), n.to_string()))).collect();
        stop.await;
        for w in watchers {
            w.abort();
        }
    }
    endpoints.shutdown().await;
    registry.shutdown();
    kubelet.stop();
    Ok(())
}

fn device_table(resources: &[Arc<Resource>], kubelet: &Kubelet) -> String {
    let mut rows: Vec<[String; 5]> = vec![["RESOURCE", "DEVICE", "HEALTH", "NUMA", "ATTRIBUTES"].map(String::from)];
    for r in resources {
        let name = r.config.name.clone();
        if let Some(e) = &r.error {
            rows.push([name, "-".into(), "NOT SERVED".into(), "-".into(), e.clone()]);
            continue;
        }
        let view = r.snapshot();
        let listed = kubelet.devices(&name).unwrap_or_default();
        if listed.is_empty() {
            rows.push([name.clone(), "(none)".into(), String::new(), String::new(), String::new()]);
        }
        for d in listed {
            let attrs = view.get(&d.id).map(|dev| short_attrs(&dev.attributes)).unwrap_or_default();
            let numa = d
                .topology
                .as_ref()
                .map(|t| t.nodes.iter().map(|n| n.id.to_string()).collect::<Vec<_>>().join(","))
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "-".into());
            rows.push([name.clone(), d.id, d.health, numa, attrs]);
        }
    }
    let mut widths = [0usize; 4];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row.iter()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut s = String::new();
    for row in rows {
        let _ = writeln!(
            s,
            "{:<w0$}  {:<w1$}  {:<w2$}  {:<w3$}  {}",
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3]
        );
    }
    s
}

/// The attributes worth a glance, trimmed so the table stays readable.
fn short_attrs(attrs: &BTreeMap<String, String>) -> String {
    let mut s: String = attrs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
    if s.chars().count() > 90 {
        s = s.chars().take(87).collect::<String>() + "...";
    }
    s
}

async fn allocation_report(kubelet: &Kubelet, resource: &str) -> String {
    let mut s = String::new();
    let devices = kubelet.devices(resource).unwrap_or_default();
    let Some(dev) = devices.iter().find(|d| d.health == devhost_proto::HEALTHY) else {
        let _ = writeln!(s, "\n{resource}: no healthy device to allocate");
        return s;
    };
    let _ = writeln!(s, "\nAllocate([{}]) on {resource} gives the container:", dev.id);
    match kubelet.allocate(resource, vec![vec![dev.id.clone()]]).await {
        Err(e) => {
            let _ = writeln!(s, "  ERROR {:?}: {}", e.code(), e.message());
        }
        Ok(resp) => {
            for c in resp.container_responses {
                let mut envs: Vec<_> = c.envs.into_iter().collect();
                envs.sort();
                for (k, v) in envs {
                    let _ = writeln!(s, "  env         {k}={v}");
                }
                for d in c.devices {
                    let _ = writeln!(s, "  device      {} -> {} ({})", d.host_path, d.container_path, d.permissions);
                }
                for m in c.mounts {
                    let _ = writeln!(
                        s,
                        "  mount       {} -> {}{}",
                        m.host_path,
                        m.container_path,
                        if m.read_only { " (ro)" } else { "" }
                    );
                }
                let mut ann: Vec<_> = c.annotations.into_iter().collect();
                ann.sort();
                for (k, v) in ann {
                    let _ = writeln!(s, "  annotation  {k}={v}");
                }
                for cdi in c.cdi_devices {
                    let _ = writeln!(s, "  cdi         {}", cdi.name);
                }
            }
        }
    }
    s
}

/// Prints each health change the kubelet sees for one resource.
async fn watch_changes(kubelet: Arc<Kubelet>, resource: String) {
    let mut last: BTreeMap<String, String> = BTreeMap::new();
    let snapshot = |k: &Kubelet| -> BTreeMap<String, String> {
        k.devices(&resource).unwrap_or_default().into_iter().map(|d| (d.id, d.health)).collect()
    };
    last.extend(snapshot(&kubelet));
    loop {
        let n = kubelet.list_count(&resource);
        if kubelet.wait_list_count(&resource, n + 1, Duration::from_secs(3600)).await.is_err() {
            continue;
        }
        let now = snapshot(&kubelet);
        for (id, health) in &now {
            match last.get(id) {
                Some(old) if old != health => println!("{resource}: {id} {old} -> {health}"),
                None => println!("{resource}: {id} appeared ({health})"),
                _ => {}
            }
        }
        for id in last.keys().filter(|id| !now.contains_key(*id)) {
            println!("{resource}: {id} disappeared");
        }
        last = now;
    }
}
