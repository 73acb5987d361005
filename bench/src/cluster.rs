//! etcd and kube-apiserver for the DRA benches (`dra`, `dra-peers`), built by `tests/cluster/build`
//! and started here on loopback ports with a Node object, and the bench's own view of them:
//! claims allocated as the scheduler would allocate them, and watches of a node's ResourceSlices.

use crate::node::{Artifacts, Node, Proc};
use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, Node as NodeObject};
use k8s_openapi::api::resource::v1::{Device as DraDevice, ResourceClaim, ResourceSlice};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Command;
use std::time::{Duration, Instant};
use tokio_stream::{Stream, StreamExt};

/// The node the drivers serve.
pub const NODE: &str = "dh-bench-node";
pub const NAMESPACE: &str = "default";
/// How long etcd and kube-apiserver may take to serve (a loaded 2-core machine).
const READY_WITHIN: Duration = Duration::from_secs(180);
/// How long one slice change may take before the run fails.
const SLICE_WITHIN: Duration = Duration::from_secs(20);
const ADMIN_TOKEN: &str = "bench-admin-token";

/// A running control plane with the node's Node object, in a node folder (`cp/` in it). The
/// control plane is stopped before the folder is removed.
pub struct Cluster {
    pub cp: ControlPlane,
    pub node: Node,
    /// The bench's admin client.
    pub admin: kube::Client,
    /// The Kubernetes build (the cache folder's name).
    pub k8s: String,
}

impl Cluster {
    /// Builds (or finds) the binaries, starts etcd and kube-apiserver, waits for them, and
    /// creates the Node object the slices are owned by. Must be called on the thread that lives
    /// as long as the bench (the control plane's processes die with the thread that started them).
    pub async fn start(art: &Artifacts) -> Result<Cluster> {
        let bin = cluster_bin(art)?;
        let k8s = bin.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let node = Node::new()?;
        let cp_dir = node.path().join("cp");
        std::fs::create_dir_all(&cp_dir)?;
        let mut cp = start_control_plane(&bin, &cp_dir)?;
        let admin = client(&cp.kubeconfig).await?;
        wait_ready(&mut cp, &admin).await?;
        let node_obj = NodeObject {
            metadata: kube::api::ObjectMeta { name: Some(NODE.into()), ..Default::default() },
            ..Default::default()
        };
        Api::<NodeObject>::all(admin.clone())
            .create(&PostParams::default(), &node_obj)
            .await
            .context("creating the Node")?;
        Ok(Cluster { cp, node, admin, k8s })
    }
}

/// etcd and kube-apiserver in a folder of the node, stopped (API server first) on drop.
pub struct ControlPlane {
    procs: Vec<Proc>,
    pub kubeconfig: PathBuf,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        while let Some(mut p) = self.procs.pop() {
            p.stop();
        }
    }
}

/// The folder of the built Kubernetes binaries, from `tests/cluster/build` (which builds them
/// on first use; `DEVHOST_CLUSTER_CACHE` picks its cache).
fn cluster_bin(art: &Artifacts) -> Result<PathBuf> {
    let script = art.repo.join("tests/cluster/build");
    let out = Command::new(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({}): see its output above", script.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let dir = PathBuf::from(text.lines().last().unwrap_or_default().trim());
    if !dir.join("kube-apiserver").exists() || !dir.join("etcd").exists() {
        bail!("{} printed {text:?}, which holds no kube-apiserver and etcd", script.display());
    }
    Ok(dir)
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn openssl(args: &[&str]) -> Result<String> {
    let out = Command::new("openssl").args(args).output().context("cannot run openssl")?;
    if !out.status.success() {
        bail!("openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Child processes that die with the bench (`PR_SET_PDEATHSIG`; spawned from the main thread,
/// which lives as long as the bench).
fn tied(mut cmd: Command) -> Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd
}

/// Starts etcd and kube-apiserver (as `host/tests/integration/common/apiserver.rs` does: token auth,
/// AlwaysAllow, the server's self-signed certificate) and writes an admin kubeconfig.
fn start_control_plane(bin: &Path, dir: &Path) -> Result<ControlPlane> {
    let p = |name: &str| dir.join(name).to_string_lossy().into_owned();
    openssl(&["genrsa", "-out", &p("sa.key"), "2048"])?;
    openssl(&["rsa", "-in", &p("sa.key"), "-pubout", "-out", &p("sa.pub")])?;
    std::fs::write(dir.join("tokens.csv"), format!("{ADMIN_TOKEN},admin,admin,\"system:masters\"\n"))?;
    let (etcd_port, peer_port, api_port) = (free_port()?, free_port()?, free_port()?);
    let (etcd_url, peer_url) = (format!("http://127.0.0.1:{etcd_port}"), format!("http://127.0.0.1:{peer_port}"));
    let mut cp = ControlPlane { procs: Vec::new(), kubeconfig: dir.join("kubeconfig") };
    let mut etcd = Command::new(bin.join("etcd"));
    etcd.args(["--data-dir", &p("etcd"), "--listen-client-urls", &etcd_url, "--advertise-client-urls", &etcd_url])
        .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("default={peer_url}"), "--unsafe-no-fsync"])
        .current_dir(dir);
    cp.procs.push(Proc::spawn(tied(etcd), &dir.join("etcd.log"))?);
    let mut api = Command::new(bin.join("kube-apiserver"));
    api.args(["--etcd-servers", &etcd_url, "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1"])
        // From 1.37 the default endpoint reconciler refuses a loopback advertise address.
        .args(["--endpoint-reconciler-type", "none"])
        .args(["--secure-port", &api_port.to_string(), "--cert-dir", &p("certs")])
        .args(["--service-account-issuer", "https://kubernetes.default.svc"])
        .args(["--service-account-key-file", &p("sa.pub"), "--service-account-signing-key-file", &p("sa.key")])
        .args(["--service-cluster-ip-range", "10.96.0.0/16", "--token-auth-file", &p("tokens.csv")])
        .args(["--authorization-mode", "AlwaysAllow"])
        .current_dir(dir);
    cp.procs.push(Proc::spawn(tied(api), &dir.join("kube-apiserver.log"))?);
    // The self-signed certificate is written before the server listens.
    let cert = dir.join("certs/apiserver.crt");
    let deadline = Instant::now() + READY_WITHIN;
    while !cert.exists() {
        for proc in &mut cp.procs {
            if let Ok(Some(st)) = proc.child.try_wait() {
                bail!("{} exited ({st}):\n{}", proc.log.display(), proc.log_tail());
            }
        }
        if Instant::now() > deadline {
            bail!("kube-apiserver wrote no {} within {READY_WITHIN:?}", cert.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(200));
    let text = openssl(&["x509", "-noout", "-text", "-in", &cert.to_string_lossy()])?;
    let tls = if text.contains("IP Address:127.0.0.1") {
        format!("certificate-authority: {}", cert.display())
    } else {
        "insecure-skip-tls-verify: true".to_owned()
    };
    std::fs::write(
        &cp.kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: https://127.0.0.1:{api_port}\n    {tls}\n\
             users:\n- name: admin\n  user:\n    token: {ADMIN_TOKEN}\ncontexts:\n- name: local\n  context:\n    cluster: local\n    user: admin\n\
             current-context: local\n"
        ),
    )?;
    Ok(cp)
}

/// A client of the API server, made as devhost makes its own.
pub async fn client(kubeconfig: &Path) -> Result<kube::Client> {
    let api = devhost::fronts::dra::api::ApiServer::connect(Some(kubeconfig), Some(NODE)).await?;
    Ok(api.client)
}

/// Waits until the API server serves the `default` namespace (its bootstrap is done).
async fn wait_ready(cp: &mut ControlPlane, client: &kube::Client) -> Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let deadline = Instant::now() + READY_WITHIN;
    loop {
        let last = match namespaces.get(NAMESPACE).await {
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        for proc in &mut cp.procs {
            if let Ok(Some(st)) = proc.child.try_wait() {
                bail!("{} exited ({st}):\n{}", proc.log.display(), proc.log_tail());
            }
        }
        if Instant::now() > deadline {
            bail!("the API server did not serve namespace {NAMESPACE} within {READY_WITHIN:?}: {last}");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

// ---- claims and slices -------------------------------------------------------------------

/// Creates claim `name` for one device of DRA driver `driver` (its device class named after it)
/// and writes its allocation (`device` of this node's pool) as the scheduler would; returns its UID.
pub async fn allocated_claim(claims: &Api<ResourceClaim>, driver: &str, name: &str, device: &str) -> Result<String> {
    let obj: ResourceClaim = serde_json::from_value(serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu",
            "exactly": {"deviceClassName": driver, "allocationMode": "ExactCount", "count": 1}}]}}
    }))?;
    let created =
        claims.create(&PostParams::default(), &obj).await.with_context(|| format!("creating claim {name}"))?;
    let patch = serde_json::json!({"status": {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": driver, "pool": NODE, "device": device}]}}}});
    claims
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .with_context(|| format!("allocating claim {name}"))?;
    created.metadata.uid.with_context(|| format!("claim {name} has no UID"))
}

type Events = Pin<Box<dyn Stream<Item = kube::Result<WatchEvent<ResourceSlice>>> + Send>>;

/// A watch of (driver, NODE)'s ResourceSlices, started again where it left off when the
/// server ends it.
pub struct SliceWatch {
    api: Api<ResourceSlice>,
    selector: String,
    version: String,
    events: Option<Events>,
}

impl SliceWatch {
    pub async fn start(client: &kube::Client, driver: &str) -> Result<SliceWatch> {
        let api: Api<ResourceSlice> = Api::all(client.clone());
        let selector = format!("spec.driver={driver},spec.nodeName={NODE}");
        let list = api.list(&ListParams::default().fields(&selector)).await.context("listing ResourceSlices")?;
        let version = list.metadata.resource_version.unwrap_or_default();
        Ok(SliceWatch { api, selector, version, events: None })
    }

    /// Waits for a slice event whose devices satisfy `done`.
    pub async fn until(&mut self, what: &str, done: impl Fn(&[DraDevice]) -> bool) -> Result<()> {
        let deadline = tokio::time::Instant::now() + SLICE_WITHIN;
        loop {
            if self.events.is_none() {
                let wp = WatchParams::default().fields(&self.selector);
                self.events = Some(Box::pin(self.api.watch(&wp, &self.version).await.context("watching slices")?));
            }
            let Some(events) = self.events.as_mut() else { continue };
            let next = tokio::time::timeout_at(deadline, events.next())
                .await
                .map_err(|_| anyhow::anyhow!("{what}: no such ResourceSlice within {SLICE_WITHIN:?}"))?;
            let slice = match next {
                Some(Ok(WatchEvent::Added(s) | WatchEvent::Modified(s))) => s,
                Some(Ok(WatchEvent::Bookmark(b))) => {
                    self.version = b.metadata.resource_version;
                    continue;
                }
                Some(Ok(WatchEvent::Deleted(s))) => {
                    self.version = s.metadata.resource_version.clone().unwrap_or_default();
                    continue;
                }
                Some(Ok(WatchEvent::Error(e))) => bail!("{what}: the slice watch failed: {e:?}"),
                Some(Err(e)) => bail!("{what}: the slice watch failed: {e}"),
                None => {
                    self.events = None;
                    continue;
                }
            };
            self.version = slice.metadata.resource_version.clone().unwrap_or_default();
            if done(slice.spec.devices.as_deref().unwrap_or_default()) {
                return Ok(());
            }
        }
    }
}
