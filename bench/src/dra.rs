//! `devhost-bench dra`: Dynamic Resource Allocation against a real etcd and kube-apiserver
//! (built by `tests/cluster/build`, started here on loopback ports) and the real `devhost run`
//! serving the C example driver as a DRA resource.
//!
//! 1. NodePrepareResources of one fresh claim (created, and its allocation written, by the
//!    bench's admin client before the clock starts) on devhost's plugin socket, against a null
//!    DRA plugin in a process of its own answering at once; beside it a bare GET of the same
//!    claim with the same client stack devhost uses (kube-rs, rustls, the same kubeconfig), so
//!    the reader sees how much of a Prepare is the API server, and the same disk writes (three
//!    fsyncs) made by the bench. Then NodeUnprepareResources of the claim (the release hook).
//!    Rounds take the calls in turn, so load drift hits all alike.
//! 2. The example driver's health file flipped: the clock runs from the write to the bench's own
//!    watch of the node's ResourceSlices showing the device tainted (or not); the floor is a slice
//!    of the bench's own changed by one PATCH and seen by the same kind of watch.

use crate::cluster::{Cluster, NAMESPACE, NODE, SliceWatch, allocated_claim};
use crate::node::{Artifacts, Node, Proc};
use crate::report::Report;
use crate::stats::{Samples, Summary, fmt_dur, p50_p99, ratio};
use anyhow::{Context, Result, bail};
use devhost_proto::dra::v1 as dra;
use dra::dra_plugin_client::DraPluginClient;
use dra::dra_plugin_server::{DraPlugin, DraPluginServer};
use k8s_openapi::api::resource::v1::{Device as DraDevice, ResourceClaim, ResourceSlice};
use kube::api::{Api, Patch, PatchParams, PostParams};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The section of `docs/benchmarks.md`.
pub const HEADING: &str = "DRA";
/// devhost's DRA driver name.
pub const DRIVER: &str = "gpu.example.com";
pub const DEVICES: usize = 8;
/// The device whose health the flips change.
pub const FLIPPED: &str = "example-1";
/// Claims prepared before the measured ones.
pub const WARMUP: usize = 10;
/// The driver of the bench's own slice (the baseline of the slice figure).
const FLOOR_DRIVER: &str = "floor.example.com";

fn floor_devices(count: usize) -> serde_json::Value {
    (0..count).map(|i| serde_json::json!({"name": format!("d{i}")})).collect()
}

/// What one run measured.
pub struct Figures {
    pub claims: usize,
    pub null_prepare: Summary,
    pub prepare: Summary,
    pub get: Summary,
    /// Prepare's disk writes (three fsyncs) made by the bench.
    pub disk: Summary,
    pub null_unprepare: Summary,
    pub unprepare: Summary,
    pub tainted: Summary,
    pub untainted: Summary,
    /// The bench's own slice: PATCH → its watch event.
    pub floor: Summary,
    /// Load average (1 min) before and after.
    pub load: (String, String),
    pub profile: String,
    pub k8s: String,
}

impl Figures {
    /// What a Prepare cannot take less than, by the p50s: the null round trip, the claim GET and
    /// the disk writes.
    pub fn floor_of_prepare(&self) -> Duration {
        self.null_prepare.p50 + self.get.p50 + self.disk.p50
    }
}

// ---- the null DRA plugin -----------------------------------------------------------------

struct NullDra;

#[tonic::async_trait]
impl DraPlugin for NullDra {
    async fn node_prepare_resources(
        &self,
        req: Request<dra::NodePrepareResourcesRequest>,
    ) -> Result<Response<dra::NodePrepareResourcesResponse>, Status> {
        // An answer the size of devhost's: one device with one CDI ID per claim.
        let claims = req
            .into_inner()
            .claims
            .into_iter()
            .map(|c| {
                let device = dra::Device {
                    request_names: vec!["gpu".into()],
                    pool_name: NODE.into(),
                    device_name: "example-0".into(),
                    cdi_device_ids: vec![format!("{DRIVER}/claim={}-example-0", c.uid)],
                    ..Default::default()
                };
                (c.uid, dra::NodePrepareResourceResponse { devices: vec![device], error: String::new() })
            })
            .collect();
        Ok(Response::new(dra::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        req: Request<dra::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<dra::NodeUnprepareResourcesResponse>, Status> {
        let claims = req
            .into_inner()
            .claims
            .into_iter()
            .map(|c| (c.uid, dra::NodeUnprepareResourceResponse::default()))
            .collect();
        Ok(Response::new(dra::NodeUnprepareResourcesResponse { claims }))
    }
}

/// The `null-dra-server` subcommand: serve the null DRA plugin on `socket` until killed, with
/// the same two-worker runtime as devhost.
pub fn serve_null(socket: &Path) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let _ = std::fs::remove_file(socket);
        let listener =
            tokio::net::UnixListener::bind(socket).with_context(|| format!("cannot listen on {}", socket.display()))?;
        tonic::transport::Server::builder()
            .add_service(DraPluginServer::new(NullDra))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
            .await
            .context("null DRA server failed")
    })
}

// ---- the run -----------------------------------------------------------------------------

pub fn claim_ref(name: &str, uid: &str) -> dra::Claim {
    dra::Claim { namespace: NAMESPACE.into(), uid: uid.into(), name: name.into() }
}

pub async fn prepare(c: &mut DraPluginClient<Channel>, claim: &dra::Claim) -> Result<Duration> {
    let t = Instant::now();
    let answer = c.node_prepare_resources(dra::NodePrepareResourcesRequest { claims: vec![claim.clone()] }).await;
    let took = t.elapsed();
    let answer = answer.with_context(|| format!("NodePrepareResources of {}", claim.name))?.into_inner();
    match answer.claims.get(&claim.uid) {
        Some(r) if r.error.is_empty() && r.devices.len() == 1 => Ok(took),
        other => bail!("NodePrepareResources of {}: {other:?}", claim.name),
    }
}

pub async fn unprepare(c: &mut DraPluginClient<Channel>, claim: &dra::Claim) -> Result<Duration> {
    let t = Instant::now();
    let answer = c.node_unprepare_resources(dra::NodeUnprepareResourcesRequest { claims: vec![claim.clone()] }).await;
    let took = t.elapsed();
    let answer = answer.with_context(|| format!("NodeUnprepareResources of {}", claim.name))?.into_inner();
    match answer.claims.get(&claim.uid) {
        Some(r) if r.error.is_empty() => Ok(took),
        other => bail!("NodeUnprepareResources of {}: {other:?}", claim.name),
    }
}

pub async fn plugin_client(socket: &Path) -> Result<DraPluginClient<Channel>> {
    let start = Instant::now();
    loop {
        match devhost_proto::connect_uds(socket).await {
            Ok(ch) => return Ok(DraPluginClient::new(ch)),
            Err(e) if start.elapsed() > crate::node::WAIT => {
                return Err(e).with_context(|| format!("nothing accepted on {}", socket.display()));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// What the kubelet's plugin watcher does before it calls the plugin: GetInfo on the
/// registration socket, then the verdict. Returns the plugin endpoint.
pub async fn register(kubelet_root: &Path, driver: &str) -> Result<PathBuf> {
    use devhost_proto::pluginregistration::registration_client::RegistrationClient;
    use devhost_proto::pluginregistration::{InfoRequest, RegistrationStatus};
    let reg = kubelet_root.join("plugins_registry").join(format!("{driver}-reg.sock"));
    let start = Instant::now();
    let channel = loop {
        match devhost_proto::connect_uds(&reg).await {
            Ok(ch) => break ch,
            Err(e) if start.elapsed() > crate::node::WAIT => {
                return Err(e).with_context(|| format!("{driver} never served {}", reg.display()));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    let mut client = RegistrationClient::new(channel);
    let info = client.get_info(InfoRequest {}).await.context("GetInfo")?.into_inner();
    client
        .notify_registration_status(RegistrationStatus { plugin_registered: true, error: String::new() })
        .await
        .context("NotifyRegistrationStatus")?;
    Ok(PathBuf::from(info.endpoint))
}

/// The disk writes a Prepare makes, done by the bench in a folder on the same file system: a
/// CDI spec (a temporary file written, flushed with fsync, renamed), then the checkpoint (the
/// same, and the folder flushed too).
fn disk_writes(dir: &Path) -> Result<Duration> {
    use std::io::Write as _;
    let t = Instant::now();
    for (name, size, sync_dir) in [("spec.json", 600, false), ("checkpoint.json", 400, true)] {
        let temp = dir.join(format!(".{name}.tmp"));
        let mut f = std::fs::File::create(&temp)?;
        f.write_all(&vec![b' '; size])?;
        f.sync_all()?;
        std::fs::rename(&temp, dir.join(name))?;
        if sync_dir {
            std::fs::File::open(dir)?.sync_all()?;
        }
    }
    Ok(t.elapsed())
}

/// Writes devhost's manifest in `node`: the C example (`count = DEVICES`, health file `health`,
/// written empty here) served as DRA driver DRIVER, with the node's kubelet root `<node>/kr`.
pub fn devhost_manifest(art: &Artifacts, node: &Node, kubeconfig: &Path, health: &Path) -> Result<PathBuf> {
    let n = node.path();
    std::fs::write(health, "")?;
    node.write_manifest(
        "devhost.toml",
        &format!(
            "kubelet_root_dir = \"{n}/kr\"\nkubeconfig = \"{kc}\"\nnode_name = \"{NODE}\"\ncdi_dir = \"{n}/cdi\"\n\
             state_dir = \"{n}/state\"\nlock_dir = \"{n}\"\n\n[driver.c]\nmodule = \"{module}\"\n\
             options = {{ count = {DEVICES}, health_file = \"{health}\", release_file = \"{n}/released\" }}\n\n\
             [[resource]]\nname = \"example.com/gpu\"\ndriver = \"c\"\napi = \"dra\"\ndra_driver = \"{DRIVER}\"\n",
            n = n.display(),
            kc = kubeconfig.display(),
            module = art.module("example_c").display(),
            health = health.display(),
        ),
    )
}

/// Measures both figures; `claims` prepared claims, `flips` health changes each way.
/// Must be called on the thread that lives as long as the bench (the control plane's
/// processes die with the thread that started them).
pub async fn run(art: &Artifacts, claims: usize, flips: usize) -> Result<Figures> {
    let load_before = crate::report::loadavg();
    let cluster = Cluster::start(art).await?;
    let (node, admin, k8s) = (&cluster.node, cluster.admin.clone(), cluster.k8s.clone());
    let n = node.path();
    let health = n.join("health");
    let manifest = devhost_manifest(art, node, &cluster.cp.kubeconfig, &health)?;
    let claims_api: Api<ResourceClaim> = Api::namespaced(admin.clone(), NAMESPACE);
    let mut made = Vec::new();
    for i in 0..WARMUP + claims {
        let name = format!("bench-{i}");
        let uid = allocated_claim(&claims_api, DRIVER, &name, &format!("example-{}", i % DEVICES)).await?;
        made.push(claim_ref(&name, &uid));
    }

    let null_sock = n.join("null-dra.sock");
    let exe = std::env::current_exe().context("cannot find the bench's own executable")?;
    let mut cmd = Command::new(exe);
    cmd.arg("null-dra-server").arg("--socket").arg(&null_sock);
    let _null = Proc::spawn(cmd, &node.log("null-dra.log"))?;
    let mut null = plugin_client(&null_sock).await?;

    let mut slices = SliceWatch::start(&admin, DRIVER).await?;
    // The floor of the slice figure: a slice of the bench's own, changed by one PATCH and seen
    // by the same kind of watch.
    let floor_api: Api<ResourceSlice> = Api::all(admin.clone());
    let floor_slice: ResourceSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": "bench-floor"},
        "spec": {"driver": FLOOR_DRIVER, "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}, "devices": floor_devices(2)}
    }))?;
    floor_api.create(&PostParams::default(), &floor_slice).await.context("creating the floor slice")?;
    let mut floor_watch = SliceWatch::start(&admin, FLOOR_DRIVER).await?;
    let daemon = Proc::devhost(art, &manifest, &node.kubelet_dir())?;
    let endpoint =
        register(&n.join("kr"), DRIVER).await.with_context(|| format!("devhost log:\n{}", daemon.log_tail()))?;
    let mut dh = plugin_client(&endpoint).await?;
    slices
        .until("the first slice", |d| d.len() == DEVICES)
        .await
        .with_context(|| format!("devhost log:\n{}", daemon.log_tail()))?;

    // A bare GET of the claim with the client stack devhost uses.
    let getter: Api<ResourceClaim> = Api::namespaced(crate::cluster::client(&cluster.cp.kubeconfig).await?, NAMESPACE);
    let get = |name: String| {
        let api = getter.clone();
        async move {
            let t = Instant::now();
            api.get(&name).await.with_context(|| format!("GET of claim {name}"))?;
            anyhow::Ok(t.elapsed())
        }
    };
    let (mut s_null, mut s_prep, mut s_get, mut s_null_un, mut s_un) =
        (Samples::default(), Samples::default(), Samples::default(), Samples::default(), Samples::default());
    let mut s_disk = Samples::default();
    let disk_dir = n.join("disk");
    std::fs::create_dir_all(&disk_dir)?;
    for (i, claim) in made.iter().enumerate() {
        let (np, p, g) = match i % 3 {
            0 => {
                let np = prepare(&mut null, claim).await?;
                let p = prepare(&mut dh, claim).await?;
                (np, p, get(claim.name.clone()).await?)
            }
            1 => {
                let p = prepare(&mut dh, claim).await?;
                let g = get(claim.name.clone()).await?;
                (prepare(&mut null, claim).await?, p, g)
            }
            _ => {
                let g = get(claim.name.clone()).await?;
                let np = prepare(&mut null, claim).await?;
                (np, prepare(&mut dh, claim).await?, g)
            }
        };
        let (nu, u) = if i % 2 == 0 {
            let nu = unprepare(&mut null, claim).await?;
            (nu, unprepare(&mut dh, claim).await?)
        } else {
            let u = unprepare(&mut dh, claim).await?;
            (unprepare(&mut null, claim).await?, u)
        };
        let disk = disk_writes(&disk_dir).with_context(|| format!("disk writes in {}", disk_dir.display()))?;
        if i >= WARMUP {
            s_disk.push(disk);
            s_null.push(np);
            s_prep.push(p);
            s_get.push(g);
            s_null_un.push(nu);
            s_un.push(u);
        }
    }

    // Every Unprepare went through the driver's release hook (it appends one line per call).
    let released = std::fs::read_to_string(n.join("released")).unwrap_or_default().lines().count();
    if released != made.len() {
        bail!("the release hook ran {released} times for {} unprepared claims:\n{}", made.len(), daemon.log_tail());
    }
    let (mut tainted, mut untainted, mut floor) = (Samples::default(), Samples::default(), Samples::default());
    for _ in 0..flips {
        for count in [1, 2] {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let t = Instant::now();
            let patch = serde_json::json!({"spec": {"devices": floor_devices(count)}});
            floor_api.patch("bench-floor", &PatchParams::default(), &Patch::Merge(&patch)).await?;
            floor_watch.until("the floor slice", |d| d.len() == count).await?;
            floor.push(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t = Instant::now();
        std::fs::write(&health, format!("{FLIPPED}\n"))?;
        let is_tainted = |d: &[DraDevice]| d.iter().any(|x| x.name == FLIPPED && x.taints.is_some());
        slices.until("the device tainted", |d| d.len() == DEVICES && is_tainted(d)).await?;
        tainted.push(t.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t = Instant::now();
        std::fs::write(&health, "")?;
        slices.until("the device untainted", |d| d.len() == DEVICES && d.iter().all(|x| x.taints.is_none())).await?;
        untainted.push(t.elapsed());
    }
    let s = |x: &Samples, what: &str| x.summary().with_context(|| format!("no {what} samples"));
    Ok(Figures {
        claims,
        null_prepare: s(&s_null, "null prepare")?,
        prepare: s(&s_prep, "prepare")?,
        get: s(&s_get, "GET")?,
        disk: s(&s_disk, "disk")?,
        null_unprepare: s(&s_null_un, "null unprepare")?,
        unprepare: s(&s_un, "unprepare")?,
        tainted: s(&tainted, "device tainted")?,
        untainted: s(&untainted, "device untainted")?,
        floor: s(&floor, "floor slice")?,
        load: (load_before, crate::report::loadavg()),
        profile: art.profile(),
        k8s,
    })
}

/// The summary table's rows.
pub fn rows(f: &Figures, report: &mut Report) {
    report.row(
        "DRA NodePrepareResources, 1 claim (p50 / p99)",
        p50_p99(&f.prepare),
        format!(
            "null DRA plugin {} (beside it: claim GET p50 {}, disk writes p50 {})",
            p50_p99(&f.null_prepare),
            fmt_dur(f.get.p50),
            fmt_dur(f.disk.p50)
        ),
        format!(
            "{} (p50); {} of null + GET + disk writes",
            ratio(f.prepare.p50, f.null_prepare.p50),
            ratio(f.prepare.p50, f.floor_of_prepare())
        ),
        "–",
        None,
    );
    report.row(
        "DRA NodeUnprepareResources, 1 claim (p50 / p99)",
        p50_p99(&f.unprepare),
        format!("null DRA plugin {}", p50_p99(&f.null_unprepare)),
        format!("{} (p50)", ratio(f.unprepare.p50, f.null_unprepare.p50)),
        "–",
        None,
    );
    report.row(
        "DRA device unhealthy → tainted in its ResourceSlice, by watch (p50 / max)",
        format!("{} / {}", fmt_dur(f.tainted.p50), fmt_dur(f.tainted.max)),
        format!("the bench's own slice PATCH → watch p50 {}", fmt_dur(f.floor.p50)),
        format!("{} (p50)", ratio(f.tainted.p50, f.floor.p50)),
        "–",
        None,
    );
}

/// The markdown section.
pub fn section(f: &Figures) -> String {
    let row = |md: &mut String, what: &str, s: &Summary, base: &Summary| {
        let _ = writeln!(
            md,
            "| {what} | {} | {} | {} | {} | {} | {} |",
            s.n,
            fmt_dur(s.p50),
            fmt_dur(s.p99),
            fmt_dur(s.min),
            fmt_dur(s.max),
            ratio(s.p50, base.p50)
        );
    };
    let mut md = format!(
        "`devhost-bench dra` (command: `cargo run --release -p devhost-bench -- dra --claims {claims} --flips {flips} \
         --record docs/benchmarks.md`; this run: the {profile} build): a real etcd and kube-apiserver ({k8s}, \
         from `tests/cluster/build`) on loopback, the real `devhost run` serving the C example driver \
         (`count = {DEVICES}`, its default isolation, a worker process) as DRA driver `{DRIVER}`, reached as the \
         kubelet does: the registration socket's GetInfo, then the plugin socket. Load average (1 min) {lb} at the \
         start, {la} at the end, on a shared 2-CPU machine: the ratios are the figures to quote.\n\n\
         **NodePrepareResources.** Each claim is fresh: created, and its allocation (one device) written, by the \
         bench's admin client before the clock starts. devhost GETs it from the API server, maps the result to the \
         device, calls the driver's allocate hook, writes the claim's CDI spec and the checkpoint. The baseline is \
         a DRA plugin in a process of its own (the same two-worker runtime) answering at once with one device. \
         Beside them a bare GET of the same claim from the bench with the client stack devhost uses (kube-rs, \
         rustls, the same kubeconfig): the part of a Prepare that is the API server. Each claim is then \
         unprepared (devhost: the release hook, the CDI spec removed, the checkpoint written). {WARMUP} warm-up \
         claims, then {claims}; in each round the calls take turns in a rotating order.\n\n\
         | Call | n | p50 | p99 | min | max | p50 vs null |\n| --- | --- | --- | --- | --- | --- | --- |\n",
        claims = f.claims,
        flips = f.tainted.n,
        profile = f.profile,
        k8s = f.k8s,
        lb = f.load.0,
        la = f.load.1,
    );
    row(&mut md, "null DRA plugin NodePrepareResources (baseline)", &f.null_prepare, &f.null_prepare);
    row(&mut md, "devhost NodePrepareResources, 1 claim, 1 device", &f.prepare, &f.null_prepare);
    row(&mut md, "bare GET of the claim (kube-rs, same server)", &f.get, &f.null_prepare);
    row(&mut md, "Prepare's disk writes, made by the bench (3 fsyncs)", &f.disk, &f.null_prepare);
    row(&mut md, "null DRA plugin NodeUnprepareResources (baseline)", &f.null_unprepare, &f.null_unprepare);
    row(&mut md, "devhost NodeUnprepareResources, 1 claim", &f.unprepare, &f.null_unprepare);
    let pct = |d: Duration| 100.0 * d.as_secs_f64() / f.prepare.p50.as_secs_f64().max(1e-12);
    let rest = f.prepare.p50.saturating_sub(f.get.p50 + f.disk.p50 + f.null_prepare.p50);
    let _ = writeln!(
        md,
        "\nWhere devhost's Prepare p50 ({}) goes, by the p50s above: the claim GET {} ({:.0} %), the disk writes \
         {} ({:.0} %: the spec and the checkpoint are flushed with fsync before the answer, so a node that crashes \
         keeps what it told the kubelet), the gRPC round trip {} ({:.0} %), and {} for the rest (the plan, the \
         allocate hook in the driver's worker process, the spec's rendering). The disk writes depend on \
         the node's storage (and here on the other builds sharing the disk) more than on devhost, and move the \
         Prepare with them; the figure to quote is Prepare ÷ (null + GET + disk writes), {}.\n",
        fmt_dur(f.prepare.p50),
        fmt_dur(f.get.p50),
        pct(f.get.p50),
        fmt_dur(f.disk.p50),
        pct(f.disk.p50),
        fmt_dur(f.null_prepare.p50),
        pct(f.null_prepare.p50),
        if rest.is_zero() {
            "nothing measurable".to_owned()
        } else {
            format!("{} ({:.0} %)", fmt_dur(rest), pct(rest))
        },
        ratio(f.prepare.p50, f.floor_of_prepare()),
    );
    let _ = writeln!(
        md,
        "**Device change → updated ResourceSlice.** The example driver's health file is written ({FLIPPED} \
         unhealthy, then healthy again, {} times each, 50 ms apart); the clock runs from the write to the \
         bench's own watch of the node's ResourceSlices (a kube watch, not polling) delivering the slice without \
         the device, or with it again. The path: the driver's inotify thread → rescan → the resource's watch \
         channel → the slice publisher → the API server (one slice updated in place) → etcd → the watch. The \
         baseline, in the same rounds: a slice of the bench's own (driver `{FLOOR_DRIVER}`, same node) changed by \
         one merge PATCH from the bench, timed to its own watch's event: the API server's write-to-watch floor.\n\n\
         | change | n | p50 | p99 | min | max | p50 vs floor |\n| --- | --- | --- | --- | --- | --- | --- |",
        f.tainted.n
    );
    row(&mut md, "the bench's slice PATCH → watch (floor)", &f.floor, &f.floor);
    row(&mut md, "device unhealthy → tainted in the slice", &f.tainted, &f.floor);
    row(&mut md, "device healthy → untainted in the slice", &f.untainted, &f.floor);
    md
}

/// Replaces the summary table's DRA rows of `md` (rows whose figure starts with "DRA") with
/// those of `report`, after the table's last row.
pub fn replace_summary_rows(md: &str, report: &Report) -> String {
    let mut lines: Vec<String> = md.lines().map(str::to_owned).collect();
    let Some(head) = lines.iter().position(|l| l == "## Summary") else { return md.to_owned() };
    lines.retain(|l| !l.starts_with("| DRA "));
    let Some(first) = lines.iter().skip(head).position(|l| l.starts_with("| ")).map(|i| i + head) else {
        return md.to_owned();
    };
    let end = lines.iter().skip(first).position(|l| !l.starts_with("| ")).map_or(lines.len(), |i| i + first);
    let new: Vec<String> = report
        .rows
        .iter()
        .map(|r| format!("| {} | {} | {} | {} | {} | – |", r.figure, r.result, r.baseline, r.ratio, r.target))
        .collect();
    lines.splice(end..end, new);
    let mut out = lines.join("\n");
    if md.ends_with('\n') {
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_rows_are_replaced_after_the_table() {
        let md = "# x\n\n## Summary\n\n| Figure | R |\n| --- | --- |\n| 1. a | b |\n| DRA old | z |\n\n## 1. a\n";
        let mut r = Report::default();
        r.row("DRA new", "1".into(), "2".into(), "3".into(), "–", None);
        let out = replace_summary_rows(md, &r);
        assert_eq!(
            out,
            "# x\n\n## Summary\n\n| Figure | R |\n| --- | --- |\n| 1. a | b |\n| DRA new | 1 | 2 | 3 | – | – |\n\n## 1. a\n"
        );
    }
}
