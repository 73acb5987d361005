//! `devhost-bench dra-peers`: devhost's DRA front beside a DRA peer on one real etcd and
//! kube-apiserver, for the same node with the same number of devices, measured in the same run,
//! the two taking turns in every round.
//!
//! The peer is a minimal driver of the bench's own on the upstream `kubeletplugin` helper
//! (`bench/drapeer`, Go, pinned in its `go.mod`; sigs.k8s.io/dra-example-driver cannot be
//! fetched here), built into `target/drapeer/`. Both are reached as the kubelet reaches them
//! (GetInfo on the registration socket, then the plugin socket) and measured alike:
//! NodePrepareResources and NodeUnprepareResources of one fresh claim allocated on the API
//! server, a device's health flipped → its taint visible to a watch of the node's slices, the
//! stored ResourceSlice JSON per device, and idle RSS and CPU over the same window.

use crate::cluster::{Cluster, NAMESPACE, NODE, SliceWatch, allocated_claim};
use crate::dra::{DEVICES, DRIVER, FLIPPED, WARMUP, claim_ref, plugin_client, prepare, register, unprepare};
use crate::node::{self, Artifacts, Proc, proc_stat};
use crate::stats::{Samples, Summary, fmt_dur, ratio};
use anyhow::{Context, Result, bail};
use devhost_proto::dra::v1 as dra;
use dra::dra_plugin_client::DraPluginClient;
use k8s_openapi::api::resource::v1::{Device as DraDevice, ResourceClaim};
use kube::api::{Api, ListParams};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// The section of `docs/benchmarks.md` and the sub-heading in it.
pub const SECTION: &str = "Peers";
pub const SUBHEADING: &str = "DRA peer";
/// The peer's DRA driver name.
const PEER_DRIVER: &str = "peer.example.com";
/// The idle window.
const IDLE: Duration = Duration::from_secs(10);
/// Between a health write and the next.
const SETTLE: Duration = Duration::from_millis(50);

/// Builds the peer from `bench/drapeer` into `target/drapeer/dra-peer`.
pub fn build(art: &Artifacts) -> Result<PathBuf> {
    crate::peers::go_build(art, "bench/drapeer", ".", "drapeer/dra-peer", "the DRA peer")
}

/// One of the two drivers in the run, and what was measured of it.
struct Side {
    name: &'static str,
    driver: &'static str,
    proc: Proc,
    client: DraPluginClient<Channel>,
    health: PathBuf,
    slices: SliceWatch,
    claims: Vec<dra::Claim>,
    prepare: Samples,
    unprepare: Samples,
    tainted: Samples,
    untainted: Samples,
}

/// What one side measured, summed up.
pub struct SideFigures {
    pub prepare: Summary,
    pub unprepare: Summary,
    pub tainted: Summary,
    pub untainted: Summary,
    pub slices: SliceBytes,
    pub rss_kib: u64,
    pub cpu_pct: f64,
    pub threads: u64,
}

/// The stored ResourceSlices of one driver on the node, as the API server returns them.
#[derive(Debug, Default, PartialEq)]
pub struct SliceBytes {
    pub slices: usize,
    pub devices: usize,
    /// Compact JSON of every slice, as stored.
    pub bytes: usize,
    /// The same without `metadata.managedFields`.
    pub bytes_no_managed: usize,
    /// The first device's attribute names, sorted.
    pub attributes: Vec<String>,
    /// The devices' own JSON (`spec.devices[*]`), the rest being the slices' metadata and spec.
    pub device_bytes: usize,
    /// The first device's JSON.
    pub first_device: String,
}

impl SliceBytes {
    fn per_device(&self, bytes: usize) -> f64 {
        bytes as f64 / self.devices.max(1) as f64
    }
}

/// What one run measured: devhost, then the peer.
pub struct Figures {
    pub claims: usize,
    pub devhost: SideFigures,
    pub peer: SideFigures,
    pub load: (String, String),
    pub profile: String,
    pub k8s: String,
}

/// Starts the peer for the node in `n` (its kubelet root `n/kr`, as devhost's).
fn spawn_peer(peer: &Path, n: &Path, kubeconfig: &Path, health: &Path) -> Result<Proc> {
    std::fs::write(health, "")?;
    std::fs::create_dir_all(n.join("kr/plugins_registry"))?;
    std::fs::create_dir_all(n.join("kr/plugins").join(PEER_DRIVER))?;
    let mut cmd = Command::new(peer);
    cmd.args(["--driver", PEER_DRIVER, "--node", NODE, "--devices", &DEVICES.to_string()])
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--kubelet-root")
        .arg(n.join("kr"))
        .arg("--cdi-dir")
        .arg(n.join("peer-cdi"))
        .arg("--state-dir")
        .arg(n.join("peer-state"))
        .arg("--health-file")
        .arg(health)
        // No client-side rate limit: devhost's client has none, and client-go's default
        // (5 requests a second) would make the bench measure the limiter.
        .args(["--kube-api-qps", "-1"]);
    Proc::spawn(cmd, &n.join("logs/dra-peer.log"))
}

/// Registers the side's driver, connects to its plugin socket and waits for its first slice.
async fn side(
    name: &'static str,
    driver: &'static str,
    proc: Proc,
    health: PathBuf,
    admin: &kube::Client,
    n: &Path,
) -> Result<Side> {
    let mut slices = SliceWatch::start(admin, driver).await?;
    let endpoint =
        register(&n.join("kr"), driver).await.with_context(|| format!("{name} log:\n{}", proc.log_tail()))?;
    let client = plugin_client(&endpoint).await?;
    slices
        .until("the first slice", |d| d.len() == DEVICES)
        .await
        .with_context(|| format!("{name} log:\n{}", proc.log_tail()))?;
    let (prepare, unprepare, tainted, untainted) = Default::default();
    Ok(Side { name, driver, proc, client, health, slices, claims: Vec::new(), prepare, unprepare, tainted, untainted })
}

/// `count` fresh allocated claims for each side (`<side>-<i>`, devices in turn).
async fn make_claims(admin: &kube::Client, sides: &mut [Side; 2], count: usize) -> Result<()> {
    let api: Api<ResourceClaim> = Api::namespaced(admin.clone(), NAMESPACE);
    for i in 0..count {
        for s in sides.iter_mut() {
            let name = format!("{}-{i}", s.name);
            let uid = allocated_claim(&api, s.driver, &name, &format!("example-{}", i % DEVICES)).await?;
            s.claims.push(claim_ref(&name, &uid));
        }
    }
    Ok(())
}

/// Each claim prepared then unprepared, the sides taking turns (who goes first alternates).
async fn calls(sides: &mut [Side; 2]) -> Result<()> {
    let rounds = sides[0].claims.len();
    for i in 0..rounds {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            let s = &mut sides[k];
            let claim = s.claims[i].clone();
            let took = prepare(&mut s.client, &claim)
                .await
                .with_context(|| format!("{} log:\n{}", s.name, s.proc.log_tail()))?;
            if i >= WARMUP {
                s.prepare.push(took);
            }
        }
        for k in order {
            let s = &mut sides[k];
            let claim = s.claims[i].clone();
            let took = unprepare(&mut s.client, &claim)
                .await
                .with_context(|| format!("{} log:\n{}", s.name, s.proc.log_tail()))?;
            if i >= WARMUP {
                s.unprepare.push(took);
            }
        }
    }
    Ok(())
}

fn is_tainted(d: &[DraDevice]) -> bool {
    d.len() == DEVICES && d.iter().any(|x| x.name == FLIPPED && x.taints.is_some())
}

fn is_clean(d: &[DraDevice]) -> bool {
    d.len() == DEVICES && d.iter().all(|x| x.taints.is_none())
}

/// FLIPPED unhealthy then healthy again, `flips` times per side, the sides taking turns.
async fn flips(sides: &mut [Side; 2], flips: usize) -> Result<()> {
    for i in 0..flips {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            let s = &mut sides[k];
            tokio::time::sleep(SETTLE).await;
            let t = Instant::now();
            std::fs::write(&s.health, format!("{FLIPPED}\n"))?;
            s.slices.until("the device tainted", is_tainted).await.with_context(|| s.proc.log_tail())?;
            s.tainted.push(t.elapsed());
            tokio::time::sleep(SETTLE).await;
            let t = Instant::now();
            std::fs::write(&s.health, "")?;
            s.slices.until("the device untainted", is_clean).await.with_context(|| s.proc.log_tail())?;
            s.untainted.push(t.elapsed());
        }
    }
    Ok(())
}

/// The stored slices of `driver` on the node, from the API server's own JSON.
async fn slice_bytes(admin: &kube::Client, driver: &str) -> Result<SliceBytes> {
    let lp = ListParams::default().fields(&format!("spec.driver={driver},spec.nodeName={NODE}"));
    let req = kube::core::Request::new("/apis/resource.k8s.io/v1/resourceslices").list(&lp)?;
    let text = admin.request_text(req).await.context("listing ResourceSlices")?;
    let list: serde_json::Value = serde_json::from_str(&text).context("the slice list is no JSON")?;
    Ok(measure_slices(list["items"].as_array().map(Vec::as_slice).unwrap_or_default()))
}

/// Sizes of `items` (slices as the API server returns them).
pub fn measure_slices(items: &[serde_json::Value]) -> SliceBytes {
    let mut out = SliceBytes { slices: items.len(), ..Default::default() };
    for item in items {
        out.bytes += item.to_string().len();
        let mut bare = item.clone();
        if let Some(meta) = bare.get_mut("metadata").and_then(|m| m.as_object_mut()) {
            meta.remove("managedFields");
        }
        out.bytes_no_managed += bare.to_string().len();
        let devices = item["spec"]["devices"].as_array().map(Vec::as_slice).unwrap_or_default();
        out.devices += devices.len();
        out.device_bytes += devices.iter().map(|d| d.to_string().len()).sum::<usize>();
        if out.first_device.is_empty()
            && let Some(first) = devices.first()
        {
            out.first_device = first.to_string();
            out.attributes = first["attributes"].as_object().map(|a| a.keys().cloned().collect()).unwrap_or_default();
            out.attributes.sort();
        }
    }
    out
}

/// The processes of a side: devhost with its driver worker processes.
fn pids(s: &Side) -> Vec<u32> {
    let mut pids = vec![s.proc.pid()];
    pids.extend(node::workers_of(s.proc.pid()));
    pids
}

/// RSS (at the end), CPU share and threads of both sides over the same idle window.
async fn idle(sides: &[Side; 2]) -> [(u64, f64, u64); 2] {
    let stats = |s: &Side| -> Vec<node::ProcStat> { pids(s).iter().filter_map(|p| proc_stat(*p).ok()).collect() };
    let before = [stats(&sides[0]), stats(&sides[1])];
    tokio::time::sleep(IDLE).await;
    let ns = |v: &[node::ProcStat]| v.iter().map(|x| x.run_ns).sum::<u64>();
    let mut out = [(0, 0.0, 0); 2];
    for (k, s) in sides.iter().enumerate() {
        let after = stats(s);
        let cpu = ns(&after).saturating_sub(ns(&before[k])) as f64 / IDLE.as_nanos() as f64 * 100.0;
        out[k] = (after.iter().map(|x| x.rss_kib).sum(), cpu, after.iter().map(|x| x.threads).sum());
    }
    out
}

async fn figures(s: &Side, admin: &kube::Client, (rss_kib, cpu_pct, threads): (u64, f64, u64)) -> Result<SideFigures> {
    let sum = |x: &Samples, what: &str| x.summary().with_context(|| format!("{}: no {what} samples", s.name));
    Ok(SideFigures {
        prepare: sum(&s.prepare, "prepare")?,
        unprepare: sum(&s.unprepare, "unprepare")?,
        tainted: sum(&s.tainted, "tainted")?,
        untainted: sum(&s.untainted, "untainted")?,
        slices: slice_bytes(admin, s.driver).await?,
        rss_kib,
        cpu_pct,
        threads,
    })
}

/// Measures both sides; `claims` claims each (after WARMUP), `flips` health changes each way.
/// Must be called on the thread that lives as long as the bench (see [`Cluster::start`]).
pub async fn run(art: &Artifacts, peer: &Path, claims: usize, flip_count: usize) -> Result<Figures> {
    let load_before = crate::report::loadavg();
    let cluster = Cluster::start(art).await?;
    let (n, admin, kubeconfig) = (cluster.node.path(), cluster.admin.clone(), cluster.cp.kubeconfig.clone());
    let (dh_health, peer_health) = (n.join("health"), n.join("peer-health"));
    let manifest = crate::dra::devhost_manifest(art, &cluster.node, &kubeconfig, &dh_health)?;
    let daemon = Proc::devhost(art, &manifest, &cluster.node.kubelet_dir())?;
    let devhost = side("devhost", DRIVER, daemon, dh_health, &admin, n).await?;
    let peer_proc = spawn_peer(peer, n, &kubeconfig, &peer_health)?;
    let peer = side("peer", PEER_DRIVER, peer_proc, peer_health, &admin, n).await?;
    let mut sides = [devhost, peer];
    make_claims(&admin, &mut sides, WARMUP + claims).await?;
    eprintln!("devhost-bench dra-peers: {} claims each", WARMUP + claims);
    calls(&mut sides).await?;
    let released = std::fs::read_to_string(n.join("released")).unwrap_or_default().lines().count();
    if released != sides[0].claims.len() {
        bail!("devhost's release hook ran {released} times for {} unprepared claims", sides[0].claims.len());
    }
    eprintln!("devhost-bench dra-peers: {flip_count} health flips each");
    flips(&mut sides, flip_count).await?;
    eprintln!("devhost-bench dra-peers: idle for {} s", IDLE.as_secs());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let [dh_idle, peer_idle] = idle(&sides).await;
    Ok(Figures {
        claims,
        devhost: figures(&sides[0], &admin, dh_idle).await?,
        peer: figures(&sides[1], &admin, peer_idle).await?,
        load: (load_before, crate::report::loadavg()),
        profile: art.profile(),
        k8s: cluster.k8s.clone(),
    })
}

/// The pinned helper release, from `bench/drapeer/go.mod`.
fn helper_version(art: &Artifacts) -> String {
    let gomod = std::fs::read_to_string(art.repo.join("bench/drapeer/go.mod")).unwrap_or_default();
    gomod
        .lines()
        .find_map(|l| l.trim().strip_prefix("k8s.io/dynamic-resource-allocation "))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| "(unknown release)".into())
}

/// The sub-section's markdown (without its heading).
pub fn section(art: &Artifacts, f: &Figures, flips: usize) -> String {
    let (d, p) = (&f.devhost, &f.peer);
    let mut md = intro(art, f, flips);
    md.push_str("| Figure | devhost | peer (kubeletplugin helper) | peer ÷ devhost |\n| --- | --- | --- | --- |\n");
    let mut dur = |what: &str, a: Duration, b: Duration| {
        let _ = writeln!(md, "| {what} | {} | {} | {} |", fmt_dur(a), fmt_dur(b), ratio(b, a));
    };
    dur("NodePrepareResources, 1 claim, p50", d.prepare.p50, p.prepare.p50);
    dur("NodePrepareResources, 1 claim, p99", d.prepare.p99, p.prepare.p99);
    dur("NodeUnprepareResources, 1 claim, p50", d.unprepare.p50, p.unprepare.p50);
    dur("NodeUnprepareResources, 1 claim, p99", d.unprepare.p99, p.unprepare.p99);
    dur("device unhealthy → tainted in the slice, p50", d.tainted.p50, p.tainted.p50);
    dur("device unhealthy → tainted in the slice, max", d.tainted.max, p.tainted.max);
    dur("device healthy → untainted in the slice, p50", d.untainted.p50, p.untainted.p50);
    let per = |s: &SliceBytes, b: usize| s.per_device(b);
    let bytes = |what: &str, a: f64, b: f64| format!("| {what} | {a:.0} B | {b:.0} B | {:.2}× |", b / a.max(1.0));
    let _ = writeln!(
        md,
        "{}",
        bytes("stored ResourceSlice JSON per device", per(&d.slices, d.slices.bytes), per(&p.slices, p.slices.bytes))
    );
    let _ = writeln!(
        md,
        "{}",
        bytes(
            "the same without `managedFields`",
            per(&d.slices, d.slices.bytes_no_managed),
            per(&p.slices, p.slices.bytes_no_managed)
        )
    );
    let _ = writeln!(
        md,
        "| idle RSS (devhost: host + worker) | {:.1} MiB | {:.1} MiB | {:.2}× |",
        d.rss_kib as f64 / 1024.0,
        p.rss_kib as f64 / 1024.0,
        p.rss_kib as f64 / d.rss_kib.max(1) as f64
    );
    let _ = writeln!(
        md,
        "| idle CPU over {} s (schedstat; devhost: host + worker) | {:.3} % | {:.3} % | – |",
        IDLE.as_secs(),
        d.cpu_pct,
        p.cpu_pct
    );
    let _ = writeln!(md, "| threads (devhost: host + worker) | {} | {} | – |", d.threads, p.threads);
    md.push('\n');
    md.push_str(&reading(f));
    md
}

/// What the table shows where the peer is ahead, and what the slices hold.
fn reading(f: &Figures) -> String {
    let (d, p) = (&f.devhost, &f.peer);
    let mut md = String::new();
    let slice = |s: &SliceBytes| {
        format!(
            "{} slice(s), {} devices; {} B of devices, {} B of metadata and spec besides (without managedFields); first device `{}`",
            s.slices,
            s.devices,
            s.device_bytes,
            s.bytes_no_managed.saturating_sub(s.device_bytes),
            s.first_device
        )
    };
    let _ = writeln!(md, "Slices, devhost: {}.\n\nSlices, the peer: {}.\n", slice(&d.slices), slice(&p.slices));
    if p.tainted.p50 < d.tainted.p50 {
        md.push_str(
            "**Why the peer is ahead on a device change.** devhost's slice publisher lists the node's slices \
             from the API server on each pass and then replaces the changed slice: two round trips \
             (`host/src/fronts/dra/slices/publisher.rs`, `pass`), where the helper's slice controller works from its \
             informer's cache and sends the one update. The change also starts in devhost's driver worker process \
             (the example's inotify thread, a rescan, the devices sent over the worker's socket) where the peer \
             reads its file in its own process.\n\n",
        );
    }
    if p.prepare.p99 < d.prepare.p99 || p.unprepare.p99 < d.unprepare.p99 {
        let _ = writeln!(
            md,
            "**The p99s** (a few of the slowest of {} calls per side, on a shared machine) follow the machine's \
             other load (the load averages above) more than either driver, and change sides between runs.\n",
            d.prepare.n
        );
    }
    if p.prepare.p50 < d.prepare.p50 || p.unprepare.p50 < d.unprepare.p50 {
        md.push_str(
            "**Where the peer is ahead on a call.** devhost's Prepare and Unprepare also call the C example's \
             allocate and release hooks in its driver worker process (a hop to another process and back, which \
             `devhost-bench handoff` puts at tens of microseconds); the peer has no driver to call. The rest of both \
             calls is the same work: the claim GET (Prepare only) and the fsyncs, which is most of their time and \
             moves with the disk and the machine's load.\n\n",
        );
    }
    if p.slices.bytes < d.slices.bytes {
        md.push_str(
            "**Why the peer's slices are smaller.** The devices are the same JSON when their attributes are (see \
             above); the difference is the slice's own metadata and spec (name, labels, owner, managedFields) \
             spread over the devices.\n\n",
        );
    }
    md
}

fn intro(art: &Artifacts, f: &Figures, flips: usize) -> String {
    format!(
        "Command: `cargo run --release -p devhost-bench -- dra-peers --claims {claims} --flips {flips} --record \
         docs/benchmarks.md` (this run: the {profile} build). One real etcd and kube-apiserver ({k8s}, from \
         `tests/cluster/build`) on loopback, one node (`{NODE}`, one kubelet root for both): devhost serving the C \
         example driver (`count = {DEVICES}`, a worker process) as DRA driver `{DRIVER}`, and beside it the peer, \
         `bench/drapeer`: a minimal DRA driver of the bench's own on the upstream `kubeletplugin` helper \
         (k8s.io/dynamic-resource-allocation {helper}; sigs.k8s.io/dra-example-driver cannot be fetched here) as \
         driver `{PEER_DRIVER}` with {DEVICES} devices and the C example's attributes, its API client without \
         client-side rate limit (as devhost's). The peer does the same work per call as devhost: the helper GETs the \
         claim, the peer maps its result to a device (refusing one another claim holds), writes the claim's CDI \
         spec and then its checkpoint, each a temporary file flushed and renamed, the folder flushed too (three \
         fsyncs, like devhost); Unprepare removes the spec and writes the checkpoint. devhost also runs the \
         example's allocate and release hooks in its worker process, which the peer has no counterpart of. Both are \
         reached as the kubelet does (GetInfo, then the plugin socket). {WARMUP} warm-up claims, then {claims} \
         per side, each fresh and allocated on the API server by the bench before the clock starts; in each round \
         both prepare and then both unprepare, who goes first alternating. Health: each driver's health file names \
         {FLIPPED} (then nothing), {flips} times each way per side, taking turns, clock from the write to the \
         bench's watch of the node's slices showing the taint (`<driver>/unhealthy`) set or gone; the peer turns \
         its fsnotify event into PublishResources, the helper's slice controller updates the slice. Slice bytes: \
         the node's stored slices of each driver as the API server lists them, compact JSON, ÷ devices. Idle: both \
         at once over the same {idle} s after the rounds. Load average (1 min) {lb} at the start, {la} at the end, on \
         a shared 2-CPU machine: the ratios are the figures to quote.\n\n",
        claims = f.claims,
        profile = f.profile,
        k8s = f.k8s,
        helper = helper_version(art),
        idle = IDLE.as_secs(),
        lb = f.load.0,
        la = f.load.1,
    )
}

/// Replaces (or adds, at the section's end) the sub-section `### sub` of `## section` in `md`.
pub fn replace_subsection(md: &str, section: &str, sub: &str, body: &str) -> String {
    let new = format!("### {sub}\n\n{}\n", body.trim_end());
    let Some(start) = md.find(&format!("\n## {section}\n")).map(|i| i + 1) else {
        return format!("{}\n## {section}\n\n{new}", md.trim_end_matches('\n').to_owned() + "\n");
    };
    let end = md[start + 3..].find("\n## ").map_or(md.len(), |e| start + 3 + e + 1);
    let sec = &md[start..end];
    let (a, b) = match sec.find(&format!("\n### {sub}\n")) {
        Some(s) => {
            let s = start + s + 1;
            let e = md[s + 4..end].find("\n### ").map_or(end, |e| s + 4 + e + 1);
            (s, e)
        }
        None => (end, end),
    };
    let before = md[..a].trim_end_matches('\n');
    let after = &md[b..];
    if after.is_empty() { format!("{before}\n\n{new}") } else { format!("{before}\n\n{new}\n{after}") }
}

/// The `### ` sub-sections of `## section` in `md` (from the first one to the section's end), to
/// keep when the section's own table is written again.
pub fn subsections(md: &str, section: &str) -> String {
    let Some(start) = md.find(&format!("\n## {section}\n")).map(|i| i + 1) else { return String::new() };
    let end = md[start + 3..].find("\n## ").map_or(md.len(), |e| start + 3 + e + 1);
    md[start..end].find("\n### ").map_or(String::new(), |s| md[start + s + 1..end].trim_end().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MD: &str = "# x\n\n## Peers\n\ntable\n\n### DRA peer\n\nold\n\n## Next\n\nz\n";

    #[test]
    fn a_subsection_is_replaced_in_place() {
        let out = replace_subsection(MD, "Peers", "DRA peer", "new");
        assert_eq!(out, "# x\n\n## Peers\n\ntable\n\n### DRA peer\n\nnew\n\n## Next\n\nz\n");
    }

    #[test]
    fn a_missing_subsection_goes_at_the_sections_end() {
        let md = "# x\n\n## Peers\n\ntable\n\n## Next\n\nz\n";
        let out = replace_subsection(md, "Peers", "DRA peer", "new");
        assert_eq!(out, "# x\n\n## Peers\n\ntable\n\n### DRA peer\n\nnew\n\n## Next\n\nz\n");
        let last = replace_subsection("# x\n\n## Peers\n\ntable\n", "Peers", "DRA peer", "new");
        assert_eq!(last, "# x\n\n## Peers\n\ntable\n\n### DRA peer\n\nnew\n");
    }

    #[test]
    fn subsections_are_what_follows_the_sections_own_text() {
        assert_eq!(subsections(MD, "Peers"), "### DRA peer\n\nold");
        assert_eq!(subsections("# x\n\n## Peers\n\ntable\n", "Peers"), "");
    }

    #[test]
    fn slice_bytes_count_devices_and_leave_managed_fields_out_on_request() {
        let item = serde_json::json!({"metadata": {"name": "s", "managedFields": [{"manager": "m"}]},
            "spec": {"devices": [{"name": "a", "attributes": {"model": {}, "index": {}}}, {"name": "b"}]}});
        let m = measure_slices(std::slice::from_ref(&item));
        assert_eq!((m.slices, m.devices), (1, 2));
        assert_eq!(m.bytes, item.to_string().len());
        assert_eq!(m.bytes - m.bytes_no_managed, r#","managedFields":[{"manager":"m"}]"#.len());
        assert_eq!(m.attributes, ["index", "model"]);
    }
}
