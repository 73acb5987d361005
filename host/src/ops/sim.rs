//! `devhost sim` and `devhost demo`: the daemon and an embedded kubelet
//! emulator in one process, so an operator or a driver author can see what a
//! manifest advertises and what a container would receive, without a cluster.

use crate::engine::registry::{Mode, Resource};
use crate::engine::release::ReleaseRunner;
use crate::manifest::{DEFAULT_CALL_TIMEOUT, Manifest};
use crate::ops::daemon::Daemon;
use kubelet_emu::{Kubelet, PodResourcesServer};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

const REGISTER_WAIT: Duration = Duration::from_secs(10);
/// How often the host asks the emulator who holds what (a node's default is 2 s).
const POD_RESOURCES_INTERVAL: Duration = Duration::from_millis(200);

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

/// `devhost sim` (and `demo`): the report, then with `keep_running` the changes until SIGTERM
/// or SIGINT; the exit status says whether it ran.
pub async fn command(config: &Path, keep_running: bool) -> std::process::ExitCode {
    match run(config, keep_running, crate::ops::serve::wait_for_stop()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devhost sim: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// config/demo.toml in the working folder, or in the checkout the binary
/// was built in (target/<profile>/devhost → ../../config/demo.toml).
pub fn demo_config() -> Option<PathBuf> {
    let here = PathBuf::from("config/demo.toml");
    if here.exists() {
        return Some(here);
    }
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.parent()?.join("config/demo.toml");
    p.exists().then_some(p)
}

/// Runs the simulation and prints its report. `keep_running` then keeps
/// serving and prints every device-list change until `stop` resolves.
pub async fn run(config: &Path, keep_running: bool, stop: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
    let scratch = ScratchDir::new()?;
    let mut manifest = Manifest::load(config, Some(&scratch.0))
        .map_err(|e| anyhow::anyhow!("{} is invalid:\n{e}", config.display()))?;
    let kubelet = Arc::new(Kubelet::start(&scratch.0)?);
    // The emulator's pod-resources socket tells the host who holds what, so
    // a simulated pod can end and the release hooks run as on a node.
    let pods = PodResourcesServer::start(&scratch.0.join("pod-resources/kubelet.sock"))?;
    manifest.pod_resources_socket = pods.socket_path().to_path_buf();
    manifest.pod_resources_interval = POD_RESOURCES_INTERVAL;
    // And an emulated runtime, asked before each release as on a node: a simulated pod's
    // containers have exited once the pod is gone (its runtime knows none of them).
    let runtime = kubelet_emu::RuntimeServer::start(&scratch.0.join("cri.sock"))?;
    manifest.runtime_socket = runtime.socket_path().to_path_buf();
    // A simulation keeps no node state: its release state and allocation
    // journal live and die with the scratch folder, never in the node's
    // `state_dir` (/var/lib/devhost by default).
    manifest.state_dir = scratch.0.join("state");
    manifest.lock_dir = scratch.0.join("lock");
    // The node's daemon may hold the manifest's port: the simulation's server takes a free one.
    if let Some(addr) = &mut manifest.metrics_addr {
        addr.set_port(0);
    }
    // The daemon `run` starts, on the scratch folder: both fronts, the probes, the CDI watch.
    let daemon = Daemon::start(manifest.clone(), Mode::Serve).await.map_err(|e| anyhow::anyhow!("{e}"))?;
    if let Some(addr) = daemon.metrics_addr() {
        tracing::info!("metrics, probes and /status of the simulation on http://{addr}");
    }
    let registry = daemon.registry.clone();
    let resources = registry.resources();

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
    for (n, r) in resources.iter().filter(|r| r.driver.is_some()).enumerate() {
        let name = r.config.name.as_str();
        let allocated = allocation_report(&kubelet, name, &mut out).await;
        // The kubelet lists a container's devices as soon as their Allocate is answered; a device
        // handed out and never listed would be released as one whose pod is gone.
        if let Some(id) = &allocated {
            pods.set_pod("sim", &format!("sim-pod-{n}"), vec![("main".into(), name.into(), vec![id.clone()])]);
        }
        out.push_str(&preferred_report(&kubelet, r).await);
        if let Some(id) = allocated {
            let timeout = manifest.drivers.get(&r.config.driver).map_or(DEFAULT_CALL_TIMEOUT, |d| d.call_timeout);
            let follower = registry.services.follower.as_ref();
            out.push_str(&pod_end_report(&pods, follower, r, &format!("sim-pod-{n}"), &id, timeout).await);
        }
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
    daemon.shutdown().await;
    kubelet.stop();
    pods.stop();
    Ok(())
}

fn device_table(resources: &[Arc<Resource>], kubelet: &Kubelet) -> String {
    let mut rows: Vec<[String; 6]> =
        vec![["RESOURCE", "DEVICE", "HEALTH", "NUMA", "LINKS", "ATTRIBUTES"].map(String::from)];
    for r in resources {
        let name = r.config.name.clone();
        if let Some(e) = &r.error {
            rows.push([name, "-".into(), "NOT SERVED".into(), "-".into(), "-".into(), e.clone()]);
            continue;
        }
        let view = r.snapshot();
        let listed = kubelet.devices(&name).unwrap_or_default();
        if listed.is_empty() {
            rows.push([name.clone(), "(none)".into(), String::new(), String::new(), String::new(), String::new()]);
        }
        for d in listed {
            let attrs = view.get(&d.id).map(|dev| short_attrs(&dev.attributes)).unwrap_or_default();
            let links = view.get(&d.id).map(links_list).filter(|l| !l.is_empty()).map(|l| trim(l, 48));
            let numa = d
                .topology
                .as_ref()
                .map(|t| t.nodes.iter().map(|n| n.id.to_string()).collect::<Vec<_>>().join(","))
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "-".into());
            rows.push([name.clone(), d.id, d.health, numa, links.unwrap_or_else(|| "-".into()), attrs]);
        }
    }
    let mut widths = [0usize; 5];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row.iter()) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut s = String::new();
    for row in rows {
        let _ = writeln!(
            s,
            "{:<w0$}  {:<w1$}  {:<w2$}  {:<w3$}  {:<w4$}  {}",
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2],
            w3 = widths[3],
            w4 = widths[4]
        );
    }
    s
}

/// A device's link scores as `other:score,…` (empty without links).
fn links_list(d: &crate::driver::device::Device) -> String {
    d.links.iter().map(|(other, score)| format!("{other}:{score}")).collect::<Vec<_>>().join(",")
}

/// The attributes worth a glance, trimmed so the table stays readable.
fn short_attrs(attrs: &BTreeMap<String, String>) -> String {
    trim(attrs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "), 90)
}

/// `s` cut to `max` characters, with `...` when it was longer (`devhost list` shows it all).
fn trim(s: String, max: usize) -> String {
    if s.chars().count() > max { s.chars().take(max - 3).collect::<String>() + "..." } else { s }
}

/// Allocates one healthy device and prints what the container gets; the
/// device ID when the allocation succeeded.
async fn allocation_report(kubelet: &Kubelet, resource: &str, s: &mut String) -> Option<String> {
    let devices = kubelet.devices(resource).unwrap_or_default();
    let Some(dev) = devices.iter().find(|d| d.health == devhost_proto::HEALTHY) else {
        let _ = writeln!(s, "\n{resource}: no healthy device to allocate");
        return None;
    };
    let _ = writeln!(s, "\nAllocate([{}]) on {resource} gives the container:", dev.id);
    match kubelet.allocate(resource, vec![vec![dev.id.clone()]]).await {
        Err(e) => {
            let _ = writeln!(s, "  ERROR {:?}: {}", e.code(), e.message());
            None
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
            Some(dev.id.clone())
        }
    }
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

/// NUMA nodes and total link score of a set, as the host's default ranks it.
fn set_score(view: &crate::engine::registry::View, ids: &[String]) -> (Vec<String>, u64) {
    let mut nodes: Vec<String> =
        ids.iter().map(|id| view.get(id).and_then(|d| d.numa_node).map_or("none".into(), |n| n.to_string())).collect();
    nodes.sort();
    nodes.dedup();
    let score_of = |a: &str, b: &str| -> u64 {
        view.get(a).map_or(0, |d| d.links.iter().filter(|(o, _)| o == b).map(|(_, s)| u64::from(*s)).sum())
    };
    let mut total = 0;
    for (i, a) in ids.iter().enumerate() {
        for b in &ids[i + 1..] {
            total += score_of(a, b) + score_of(b, a);
        }
    }
    (nodes, total)
}

/// Asks the host which two devices it would give a two-device container,
/// and shows the NUMA nodes and link scores behind the choice.
async fn preferred_report(kubelet: &Kubelet, r: &Resource) -> String {
    let mut s = String::new();
    let name = r.config.name.as_str();
    let available: Vec<String> = kubelet
        .devices(name)
        .unwrap_or_default()
        .into_iter()
        .filter(|d| d.health == devhost_proto::HEALTHY)
        .map(|d| d.id)
        .collect();
    if available.len() < 2 {
        return s;
    }
    let _ = writeln!(s, "\nGetPreferredAllocation(2 of {}) on {name}:", available.len());
    let chosen = match kubelet.preferred_allocation(name, available.clone(), Vec::new(), 2).await {
        Ok(ids) => ids,
        Err(e) => {
            let _ = writeln!(s, "  ERROR {:?}: {}", e.code(), e.message());
            return s;
        }
    };
    let view = r.snapshot();
    let (nodes, score) = set_score(&view, &chosen);
    let hook = r.driver.as_ref().is_some_and(|d| d.module.preferred_allocation);
    let _ = writeln!(
        s,
        "  chosen      {}  NUMA {}  link score {score}{}",
        chosen.join(","),
        nodes.join(","),
        if hook { "  (the driver's preferred_allocation hook, repaired by the host)" } else { "" }
    );
    // The best-linked pairs, for comparison: fewer NUMA nodes come first, then links.
    // (NUMA node count, link score best first, the pair, its NUMA nodes)
    type Pair = (usize, std::cmp::Reverse<u64>, Vec<String>, Vec<String>);
    let mut pairs: Vec<Pair> = Vec::new();
    for (i, a) in available.iter().enumerate() {
        for b in &available[i + 1..] {
            let ids = vec![a.clone(), b.clone()];
            let (nodes, score) = set_score(&view, &ids);
            if score > 0 {
                pairs.push((nodes.len(), std::cmp::Reverse(score), ids, nodes));
            }
        }
    }
    pairs.sort();
    for (_, std::cmp::Reverse(score), ids, nodes) in pairs.iter().take(3) {
        let _ = writeln!(s, "  linked      {}  NUMA {}  link score {score}", ids.join(","), nodes.join(","));
    }
    if pairs.is_empty() {
        let _ = writeln!(s, "  (no link scores: the choice is NUMA nodes, then scan order)");
    }
    s
}

/// Whether the host saw, within [`REGISTER_WAIT`], the pod hold `id` of resource `name`
/// through the pod-resources follower, and its release runner caught up with that.
async fn seen_holding(
    follower: &Arc<crate::engine::podresources::Follower>,
    runner: &ReleaseRunner,
    name: &str,
    id: &str,
) -> bool {
    let mut holders = follower.subscribe();
    let wait = tokio::time::sleep(REGISTER_WAIT);
    tokio::pin!(wait);
    let mut held_since = None;
    loop {
        {
            let snap = holders.borrow_and_update();
            if held_since.is_none() && snap.holder(name, id).is_some() {
                held_since = Some(snap.generation);
            }
        }
        if held_since.is_some_and(|g| runner.seen_generation() >= g) {
            return true;
        }
        tokio::select! {
            _ = holders.changed() => {}
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = &mut wait => return false,
        }
    }
}

/// Once release was called for `id`: Ok when it is out of the runner's overlay (released), the
/// reason when it is still listed after a failed call (the host retries).
async fn released(
    overlay: &mut tokio::sync::watch::Receiver<Arc<crate::engine::release::Overlay>>,
    runner: &ReleaseRunner,
    id: &str,
) -> Result<(), String> {
    loop {
        if !overlay.borrow_and_update().contains_key(id) {
            return Ok(());
        }
        // Still listed after the call returned: it failed, and the host retries.
        let failed = runner.pending().iter().any(|b| matches!(b.phase, crate::engine::release::Phase::Failed { .. }));
        if let Some(reason) = runner.unhealthy(id).filter(|_| failed) {
            return Err(reason);
        }
        if overlay.changed().await.is_err() {
            return Ok(());
        }
    }
}

/// Ends a simulated pod that held `id` and shows the release hook running.
async fn pod_end_report(
    pods: &PodResourcesServer,
    follower: Option<&Arc<crate::engine::podresources::Follower>>,
    r: &Resource,
    pod: &str,
    id: &str,
    timeout: Duration,
) -> String {
    let mut s = String::new();
    let (Some(runner), Some(driver), Some(follower)) = (r.release.as_ref(), r.driver.as_ref(), follower) else {
        return s;
    };
    if !driver.module.release {
        return s;
    }
    let name = r.config.name.as_str();
    let _ = writeln!(s, "\nPod sim/{pod} (holding {id} on {name}) ends:");
    pods.set_pod("sim", pod, vec![("main".into(), name.into(), vec![id.to_string()])]);
    // The host must have seen the pod hold the device before it can see it let go.
    if !seen_holding(follower, runner, name, id).await {
        let _ = writeln!(s, "  the host did not see the pod through the pod-resources socket");
        return s;
    }
    let mut overlay = runner.subscribe();
    overlay.borrow_and_update();
    let ended = std::time::Instant::now();
    pods.remove_pod("sim", pod);
    let deadline = timeout + Duration::from_secs(5);
    if tokio::time::timeout(deadline, overlay.changed()).await.is_err() {
        let _ = writeln!(s, "  release was not called within {deadline:?}");
        return s;
    }
    let started = ended.elapsed();
    let outcome = tokio::time::timeout(deadline, released(&mut overlay, runner, id)).await;
    let took = ended.elapsed().saturating_sub(started);
    match outcome {
        Ok(Ok(())) => {
            let _ = writeln!(
                s,
                "  release([{id}]) called {} ms after the pod ended; returned OK after {} ms; {id} Healthy again",
                started.as_millis(),
                took.as_millis()
            );
        }
        Ok(Err(reason)) => {
            let _ = writeln!(
                s,
                "  release([{id}]) failed after {} ms; Unhealthy, the host retries: {reason}",
                took.as_millis()
            );
        }
        Err(_) => {
            let _ = writeln!(s, "  release([{id}]) still running after {deadline:?}");
        }
    }
    s
}
