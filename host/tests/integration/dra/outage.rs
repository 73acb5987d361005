//! DRA through API-server faults, on the real `devhost` binary and a real kube-apiserver and
//! etcd of their own (built by `tests/cluster/build`), reached through a [`FaultProxy`] that
//! plays the network: the server stopped (connections refused), a silent server (a partition:
//! connections stay open and nothing comes back, ever), a slow one (seconds added to each
//! request); and the server itself shedding devhost's requests with `429 Too Many Requests`
//! (its priority and fairness, configured by the test, see [`SHED`]). What must hold: NodePrepareResources fails fast with UNAVAILABLE for a claim it
//! cannot read and never blocks a claim it prepared before, an Unprepare, or a device-plugin
//! resource of the same daemon; slice publishing retries with a capped backoff (no hot loop)
//! and converges to the devices' newest state once the server is back; connections, open
//! files and threads stay bounded through the outage. `DEVHOST_DRA_OUTAGE_SECS` makes the
//! outage of the slice test longer (docs/testing.md records a 10-minute run).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::common::apiserver::ApiServerHarness;
use crate::common::faultproxy::{FaultProxy, Mode};
use crate::common::*;
use devhost::fronts::dra::api::ApiServer;
use devhost_proto::dra::v1::NodeUnprepareResourcesRequest;
use devhost_proto::dra::v1::dra_plugin_client::DraPluginClient;
use devhost_proto::dra::v1::{Claim, NodePrepareResourceResponse, NodePrepareResourcesRequest};
use k8s_openapi::api::core::v1::Node as NodeObject;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{Api, ListParams, PostParams};

const RES: &str = "example.com/accel";
const DRIVER: &str = "accel.example.com";
const PLUGIN_RES: &str = "example.com/plugin";
const NODE: &str = "outage-node";
/// How long a change may take to reach a healthy API server on a loaded machine.
const PUBLISHED_WITHIN: Duration = Duration::from_secs(20);

/// An API server of the test's own (it is stopped and started), the proxy in front of it, a
/// Node object, and a devhost serving `count` example devices as DRA resource [`RES`] through
/// the proxy, plus two as device-plugin resource [`PLUGIN_RES`] to the kubelet emulator.
struct Setup {
    harness: ApiServerHarness,
    upstream: SocketAddr,
    proxy: FaultProxy,
    admin: kube::Client,
    node: Node,
    kubelet: Kubelet,
    metrics: SocketAddr,
    daemon: Daemon,
    /// How many devices the example driver has.
    count: usize,
}

/// Whose credentials devhost uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Identity {
    /// The admin: `system:masters`, which the API server's priority and fairness exempts.
    Admin,
    /// The node `system:node:devhost-node` (group `system:nodes`), which it limits.
    Node,
}

impl Setup {
    async fn start(count: usize) -> Setup {
        Setup::start_as(count, Identity::Admin).await
    }

    async fn start_as(count: usize, identity: Identity) -> Setup {
        let harness = tokio::task::spawn_blocking(ApiServerHarness::start).await.expect("harness thread");
        let upstream: SocketAddr = harness.url().trim_start_matches("https://").parse().expect("server address");
        let proxy = FaultProxy::start(upstream).await;
        let node = Node::new();
        let credentials = match identity {
            Identity::Admin => harness.kubeconfig(),
            Identity::Node => harness.node_kubeconfig(),
        };
        let kubeconfig = proxy.kubeconfig(credentials, upstream, node.path());
        let admin = ApiServer::connect(Some(harness.kubeconfig()), Some(NODE)).await.expect("admin client").client;
        let nodes: Api<NodeObject> = Api::all(admin.clone());
        let object = NodeObject {
            metadata: kube::api::ObjectMeta { name: Some(NODE.into()), ..Default::default() },
            ..Default::default()
        };
        nodes.create(&PostParams::default(), &object).await.expect("create the Node");
        let metrics = free_port();
        let kubelet = Kubelet::start(&node.kubelet_dir()).expect("kubelet emulator");
        let manifest = node.write_manifest(&format!(
            r#"
kubelet_root_dir = "{root}"
kubeconfig = "{kubeconfig}"
node_name = "{NODE}"
metrics_addr = "{metrics}"
state_dir = "{dir}/state"
cdi_dir = "{dir}/cdi"

[driver.dra]
module = "{c}"
options = {{ count = {count}, health_file = "{dir}/health", release_file = "{dir}/released" }}

[driver.plugin]
module = "{c}"
options = {{ count = 2 }}

[[resource]]
name = "{RES}"
driver = "dra"
api = "dra"

[[resource]]
name = "{PLUGIN_RES}"
driver = "plugin"
"#,
            root = node.path().join("kubelet-root").display(),
            kubeconfig = kubeconfig.display(),
            dir = node.path().display(),
            c = module("example_c").display(),
        ));
        let daemon = Daemon::start(&manifest, &node.kubelet_dir());
        kubelet.wait_registered(PLUGIN_RES, WAIT).await.unwrap_or_else(|e| panic!("{e:?}\n{}", daemon.logs()));
        Setup { harness, upstream, proxy, admin, node, kubelet, metrics, daemon, count }
    }

    async fn plugin(&self) -> DraPluginClient<tonic::transport::Channel> {
        let socket = self.node.path().join("kubelet-root/plugins").join(DRIVER).join("dra.sock");
        DraPluginClient::new(devhost_proto::connect_uds(&socket).await.expect("DRA plugin socket"))
    }

    /// Creates ResourceClaim `name` and writes its allocation of `device`, as the scheduler
    /// would; returns its UID.
    fn claim(&self, name: &str, device: &str) -> Claim {
        let ns = "default";
        let uid = self.harness.allocated_claim(ns, name, DRIVER, NODE, device);
        Claim { namespace: ns.into(), uid, name: name.into() }
    }

    async fn metric(&self, series: &str) -> f64 {
        let body = devhost::ops::metrics::get(self.metrics, "/metrics", &[]).await.expect("metrics").body;
        body.lines().find(|l| l.starts_with(series)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(-1.0)
    }

    fn publish_errors(&self) -> impl std::future::Future<Output = f64> + '_ {
        self.metric("devhost_dra_slice_publishes_total{resource=\"example.com/accel\",outcome=\"error\"}")
    }

    /// The published devices, sorted, an unhealthy one (tainted) as `NAME (tainted)`.
    async fn published(&self) -> Vec<String> {
        let api: Api<ResourceSlice> = Api::all(self.admin.clone());
        let params = ListParams::default().fields(&format!("spec.driver={DRIVER},spec.nodeName={NODE}"));
        let slices = api.list(&params).await.expect("list ResourceSlices").items;
        let devices = slices.iter().flat_map(|s| s.spec.devices.iter().flatten());
        let mut names: Vec<String> = devices
            .map(|d| if d.taints.is_some() { format!("{} (tainted)", d.name) } else { d.name.clone() })
            .collect();
        names.sort();
        names
    }

    /// Waits until every device is published, those of `healthy` without a taint and the others
    /// tainted; returns how long it took.
    async fn wait_published(&self, healthy: &[&str], within: Duration) -> Duration {
        let mut want: Vec<String> = (0..self.count)
            .map(|i| format!("example-{i}"))
            .map(|n| if healthy.contains(&n.as_str()) { n } else { format!("{n} (tainted)") })
            .collect();
        want.sort();
        let start = Instant::now();
        loop {
            let got = self.published().await;
            if got == want {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < within,
                "published {got:?}, not {want:?}, within {within:?}\n{}",
                self.daemon.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// (open files, threads) of the daemon.
    fn footprint(&self) -> (usize, usize) {
        let pid = self.daemon.child.id();
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
        (fds, threads(pid).len())
    }
}

async fn prepare(
    plugin: &mut DraPluginClient<tonic::transport::Channel>,
    claims: &[&Claim],
) -> Result<HashMap<String, NodePrepareResourceResponse>, tonic::Status> {
    let claims = claims.iter().map(|c| (*c).clone()).collect();
    plugin.node_prepare_resources(NodePrepareResourcesRequest { claims }).await.map(|r| r.into_inner().claims)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_fails_fast_and_never_blocks_what_needs_no_api_server() {
    let s = Setup::start(2).await;
    s.wait_published(&["example-0", "example-1"], PUBLISHED_WITHIN).await;
    let known = s.claim("known", "example-0");
    let fresh = s.claim("fresh", "example-1");
    let mut plugin = s.plugin().await;
    let first = prepare(&mut plugin, &[&known]).await.expect("prepare with the server up");
    assert_eq!(first[&known.uid].error, "", "{first:?}");

    // A silent server: the connection is open, nothing comes back.
    s.proxy.set(Mode::Silent);
    let start = Instant::now();
    let again = prepare(&mut plugin, &[&known]).await.expect("a prepared claim needs no API server");
    assert_eq!(again[&known.uid], first[&known.uid], "the same answer as before");
    assert!(start.elapsed() < Duration::from_secs(2), "answered from the checkpoint: {:?}", start.elapsed());

    // A new claim's read hangs until the GET deadline, while a device-plugin Allocate and an
    // Unprepare of the known claim are answered at once.
    let mut blocked = s.plugin().await;
    let pending = {
        let fresh = fresh.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            (prepare(&mut blocked, &[&fresh]).await, start.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let start = Instant::now();
    s.kubelet.allocate(PLUGIN_RES, vec![vec!["example-1".into()]]).await.expect("device-plugin Allocate");
    let request = NodeUnprepareResourcesRequest { claims: vec![known.clone()] };
    let unprepared = plugin.node_unprepare_resources(request).await.expect("unprepare").into_inner().claims;
    assert_eq!(unprepared[&known.uid].error, "");
    assert!(start.elapsed() < Duration::from_secs(2), "Allocate and Unprepare took {:?}", start.elapsed());
    assert!(!pending.is_finished(), "the new claim's read waits on the silent server");
    let (answer, took) = pending.await.expect("prepare task");
    let status = answer.expect_err("an unreadable claim fails the call");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("fresh") && status.message().contains("within"), "{status:?}");
    assert!(took < Duration::from_secs(15), "failed at the GET deadline, not the kubelet's: {took:?}");

    // The server stopped: refused at once.
    s.proxy.set(Mode::Pass);
    let mut s = s;
    s.harness.stop_api_server();
    let start = Instant::now();
    let status = prepare(&mut plugin, &[&fresh]).await.expect_err("the server is down");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(start.elapsed() < Duration::from_secs(3), "a refused connection fails fast: {:?}", start.elapsed());

    // Back: the kubelet's retry prepares it.
    s.harness.start_api_server();
    let done = prepare(&mut plugin, &[&fresh]).await.expect("prepare with the server back");
    assert_eq!(done[&fresh.uid].error, "", "{done:?}");
    assert_eq!(done[&fresh.uid].devices[0].device_name, "example-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_converge_after_an_outage_with_capped_retries_and_bounded_resources() {
    let outage: u64 = std::env::var("DEVHOST_DRA_OUTAGE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(70);
    let mut s = Setup::start(4).await;
    s.wait_published(&["example-0", "example-1", "example-2", "example-3"], PUBLISHED_WITHIN).await;
    let (fds0, threads0) = s.footprint();
    let errors0 = s.publish_errors().await.max(0.0);

    // A partition first: the publisher's pass hangs on a connection that never answers.
    s.proxy.set(Mode::Silent);
    std::fs::write(s.node.path().join("health"), "example-1\n").unwrap();
    s.daemon.wait_log("DRA: cannot publish the ResourceSlices", Duration::from_secs(60)).await;
    // Then the server itself stops for the rest of the outage, and the devices change again.
    s.proxy.set(Mode::Pass);
    s.harness.stop_api_server();
    std::fs::write(s.node.path().join("health"), "example-2\n").unwrap();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(outage) {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let most_open = s.proxy.most_open();
    let errors = s.publish_errors().await - errors0;
    let (fds, threads) = s.footprint();
    s.harness.start_api_server();
    let back = Instant::now();
    let took = s.wait_published(&["example-0", "example-1", "example-3"], Duration::from_secs(75)).await;

    let total = outage + 60;
    // Backoff 1, 2, 4, 8, 16, then every 30 s (each silent pass also ran for its 30 s).
    let most = 6 + total / 30;
    assert!(errors >= 3.0 && errors <= most as f64, "{errors} failed passes in about {total} s (at most {most})");
    assert!(most_open <= 6, "{most_open} connections open at once (through the proxy, since devhost started)");
    assert!(fds <= fds0 + 4, "open files grew from {fds0} to {fds} through the outage");
    assert!(threads <= threads0 + 2, "threads grew from {threads0} to {threads} through the outage");
    let logs = s.daemon.logs();
    let warns = logs.lines().filter(|l| l.contains("WARN") && l.contains("publish the ResourceSlices")).count();
    assert!(warns <= 1 + total as usize / 300, "{warns} WARN lines for one outage:\n{logs}");
    assert!(logs.contains("DRA: can publish the ResourceSlices of DRA driver accel.example.com"), "recovery logged");
    eprintln!(
        "outage {total} s: {errors} failed passes, {most_open} connections at most, fds {fds0}->{fds}, threads \
         {threads0}->{threads}; published {took:?} after the server was ready ({:?} since start)",
        back.elapsed()
    );
    let _ = s.upstream;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_server_and_a_second_writer_churning_the_slices_do_not_lose_an_update() {
    let s = Setup::start(4).await;
    s.wait_published(&["example-0", "example-1", "example-2", "example-3"], PUBLISHED_WITHIN).await;
    // Each of devhost's requests takes 300 ms longer, and someone else changes the slices'
    // labels every 20 ms: devhost's writes carry a stale resourceVersion and get 409 Conflict.
    s.proxy.set(Mode::Delay(Duration::from_millis(300)));
    let churn = {
        let api: Api<ResourceSlice> = Api::all(s.admin.clone());
        tokio::spawn(async move {
            let params = ListParams::default().fields(&format!("spec.driver={DRIVER},spec.nodeName={NODE}"));
            let start = Instant::now();
            let mut writes = 0u32;
            while start.elapsed() < Duration::from_secs(12) {
                for slice in api.list(&params).await.map(|l| l.items).unwrap_or_default() {
                    let patch = serde_json::json!({"metadata": {"labels": {"churn": writes.to_string()}}});
                    let name = slice.metadata.name.unwrap_or_default();
                    let merge = kube::api::Patch::Merge(&patch);
                    if api.patch(&name, &kube::api::PatchParams::default(), &merge).await.is_ok() {
                        writes += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            writes
        })
    };
    for unhealthy in ["example-1\n", "example-1\nexample-2\n", "", "example-3\n"] {
        std::fs::write(s.node.path().join("health"), unhealthy).unwrap();
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let writes = churn.await.expect("churn task");
    let took = s.wait_published(&["example-0", "example-1", "example-2"], Duration::from_secs(60)).await;
    let logs = s.daemon.logs();
    let conflicts = logs.lines().filter(|l| l.contains("publish the ResourceSlices") && l.contains("409")).count();
    assert!(conflicts >= 1, "the churn made no write of devhost conflict ({writes} label writes):\n{logs}");
    s.proxy.set(Mode::Pass);
    eprintln!("{writes} label writes by the churn, {conflicts} conflicting passes of devhost, right {took:?} after");
}

/// The API server's priority and fairness shedding devhost's requests, as it does for a client
/// that is over its share: a priority level that executes nothing and rejects instead of queueing
/// (`Reject`), and a flow schema that sends every request of devhost's user there, ahead of the
/// built-in `system-node-high` (400) and `system-nodes` (500). `nominalConcurrencyShares: 0`
/// makes the level's limit 0 seats, but kube-apiserver (v1.36 and v1.37) still dispatches a request to a
/// level with nothing executing (its queue set lets a request wider than the limit run alone),
/// so a limit of 0 alone rejects nothing. The second flow schema (matched first) sends a LIST of
/// the namespaces by the same user to the same level: the test's [`hold_the_seat`] keeps one
/// such LIST executing at all times, and then every other request of devhost's is answered
/// `429 Too Many Requests` at once. The admin (`system:masters`) stays exempt.
const SHED: &str = r#"
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: devhost-shed}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 0
    lendablePercent: 0
    borrowingLimitPercent: 0
    limitResponse: {type: Reject}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: devhost-shed}
spec:
  priorityLevelConfiguration: {name: devhost-shed}
  matchingPrecedence: 90
  distinguisherMethod: {type: ByUser}
  rules:
  - subjects:
    - kind: User
      user: {name: "system:node:devhost-node"}
    resourceRules:
    - verbs: ["*"]
      apiGroups: ["*"]
      resources: ["*"]
      clusterScope: true
      namespaces: ["*"]
    nonResourceRules:
    - verbs: ["*"]
      nonResourceURLs: ["*"]
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: devhost-shed-holder}
spec:
  priorityLevelConfiguration: {name: devhost-shed}
  matchingPrecedence: 80
  distinguisherMethod: {type: ByUser}
  rules:
  - subjects:
    - kind: User
      user: {name: "system:node:devhost-node"}
    resourceRules:
    - verbs: ["list"]
      apiGroups: [""]
      resources: ["namespaces"]
      clusterScope: true
"#;

/// Keeps one request of the node's user executing in the `devhost-shed` level: a LIST of the
/// namespaces at a resource version far ahead of the server's, which the watch cache holds for
/// 3 s before it answers 504 (too large resource version), and at once again (a client without
/// retries: kube's default one would wait after the 504, leaving the seat free). Runs until
/// aborted.
async fn hold_the_seat(kubeconfig: std::path::PathBuf) {
    let file = kube::config::Kubeconfig::read_from(&kubeconfig).expect("the node kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(file, &Default::default()).await.expect("holder config");
    config.default_retry = false;
    let client = kube::Client::try_from(config).expect("holder client");
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client);
    let params = ListParams::default().at("999999999").matching(kube::api::VersionMatch::NotOlderThan);
    loop {
        let start = Instant::now();
        let _ = namespaces.list(&params).await;
        // Answered at once: a request of devhost's had the seat (429). Again, soon.
        if start.elapsed() < Duration::from_millis(500) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Whether kubectl, as `kubeconfig`'s user, is answered `429 Too Many Requests` for a LIST of
/// the ResourceSlices (its first response; kubectl itself would retry a 429 ten times).
fn kubectl_gets_429(bin: &std::path::Path, kubeconfig: &std::path::Path) -> Option<String> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(bin.join("kubectl"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["-v=6", "get", "--raw", "/apis/resource.k8s.io/v1/resourceslices"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl");
    let stderr = std::io::BufReader::new(child.stderr.take().expect("piped stderr"));
    let response = stderr.lines().map_while(Result::ok).find(|l| l.contains("\"Response\""));
    let _ = child.kill();
    let _ = child.wait();
    response.filter(|l| l.contains("status=\"429 Too Many Requests\""))
}

/// The `apiserver_flowcontrol_rejected_requests_total` of flow schema `schema`, from the API
/// server's own /metrics (read as the admin).
fn rejected_by(harness: &ApiServerHarness, schema: &str) -> f64 {
    let body = harness.kubectl(&["get", "--raw", "/metrics"]);
    let label = format!("flow_schema=\"{schema}\"");
    body.lines()
        .filter(|l| l.starts_with("apiserver_flowcontrol_rejected_requests_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// How many attempts devhost's backoff (1, 2, 4, 8, 16 s, then every 30 s; `fronts/dra/outage.rs`)
/// makes within `window` of its first failure, that one included.
fn attempts_within(window: Duration) -> u32 {
    let (mut at, mut wait, mut attempts) = (Duration::ZERO, Duration::from_secs(1), 1);
    while at + wait <= window {
        at += wait;
        attempts += 1;
        wait = (wait * 2).min(Duration::from_secs(30));
    }
    attempts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_servers_own_429_fails_prepare_fast_and_the_slices_converge_once_it_stops() {
    // devhost as the node, whom priority and fairness limits (the admin would be exempt).
    let s = Setup::start_as(4, Identity::Node).await;
    s.wait_published(&["example-0", "example-1", "example-2", "example-3"], PUBLISHED_WITHIN).await;
    let known = s.claim("known", "example-0");
    let fresh = s.claim("fresh", "example-1");
    let mut plugin = s.plugin().await;
    let first = prepare(&mut plugin, &[&known]).await.expect("prepare before the shedding");
    assert_eq!(first[&known.uid].error, "", "{first:?}");

    // Shed: the level, the flow schemas, and a request of the node's that keeps its one seat.
    s.harness.kubectl_stdin(&["create", "-f", "-"], SHED);
    let holder = tokio::spawn(hold_the_seat(s.harness.node_kubeconfig().to_path_buf()));
    // The server applies a new flow schema a moment later: ask until kubectl meets the 429.
    let (bin, node_kubeconfig) = (s.harness.bin_dir().to_path_buf(), s.harness.node_kubeconfig().to_path_buf());
    let start = Instant::now();
    let seen = loop {
        let (bin, kubeconfig) = (bin.clone(), node_kubeconfig.clone());
        if let Some(line) = tokio::task::spawn_blocking(move || kubectl_gets_429(&bin, &kubeconfig)).await.unwrap() {
            break line;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "the API server answers the node no 429");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("kubectl as the node, {:?} after the flow schema: {seen}", start.elapsed());

    // Measured from here: the server's rejections of devhost and devhost's failed passes.
    let window = Instant::now();
    let rejected0 = rejected_by(&s.harness, "devhost-shed");
    let errors0 = s.publish_errors().await.max(0.0);
    // Churn: the devices' health changes four times, the last state is example-2 unhealthy.
    for unhealthy in ["example-1\n", "example-1\nexample-2\n", "", "example-2\n"] {
        std::fs::write(s.node.path().join("health"), unhealthy).unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }

    // (a) A new claim fails fast; a device-plugin Allocate, the kubelet's repeated Prepare of the
    // known claim and its Unprepare are answered meanwhile.
    let mut other = s.plugin().await;
    let pending = {
        let fresh = fresh.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            (prepare(&mut other, &[&fresh]).await, start.elapsed())
        })
    };
    let start = Instant::now();
    s.kubelet.allocate(PLUGIN_RES, vec![vec!["example-1".into()]]).await.expect("device-plugin Allocate");
    let again = prepare(&mut plugin, &[&known]).await.expect("a prepared claim needs no API server");
    assert_eq!(again[&known.uid], first[&known.uid], "the same answer as before");
    let request = NodeUnprepareResourcesRequest { claims: vec![known.clone()] };
    let unprepared = plugin.node_unprepare_resources(request).await.expect("unprepare").into_inner().claims;
    assert_eq!(unprepared[&known.uid].error, "");
    let others = start.elapsed();
    assert!(others < Duration::from_secs(2), "Allocate, Prepare and Unprepare took {others:?}");
    let (answer, took) = pending.await.expect("prepare task");
    let status = answer.expect_err("a claim the server will not give fails the call");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("fresh"), "{status:?}");
    assert!(status.message().contains("Too many requests"), "the server's own answer is passed on: {status:?}");
    assert!(took < Duration::from_secs(3), "a 429 fails the call at once, not at the GET deadline: {took:?}");

    // (b) No hot loop: what the server rejected stays within devhost's backoff.
    while window.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let rejected = rejected_by(&s.harness, "devhost-shed") - rejected0;
    let errors = s.publish_errors().await - errors0;
    let measured = window.elapsed();
    // One rejected request per pass (its first, the LIST), plus the one Prepare's GET; the
    // watch started before the shedding holds no seat, and one more in case it restarted.
    let passes = attempts_within(measured);
    let most = passes + 2;
    assert!(errors >= 2.0 && errors <= passes as f64, "{errors} failed passes in {measured:?} (at most {passes})");
    assert!(
        rejected >= errors && rejected <= most as f64,
        "{rejected} requests rejected in {measured:?} (at most {most})"
    );
    // (c) One WARN for the outage, no matter how many passes failed.
    let logs = s.daemon.logs();
    let warns = logs.lines().filter(|l| l.contains("WARN") && l.contains("publish the ResourceSlices")).count();
    assert_eq!(warns, 1, "WARN lines for one outage:\n{logs}");

    // The shedding ends: the slices hold the newest state within the backoff's cap.
    s.harness.kubectl(&["delete", "flowschema", "devhost-shed", "devhost-shed-holder"]);
    holder.abort();
    let back = Instant::now();
    let converged =
        s.wait_published(&["example-0", "example-1", "example-3"], PUBLISHED_WITHIN + Duration::from_secs(30)).await;
    let logs = s.daemon.logs();
    assert!(logs.contains("DRA: can publish the ResourceSlices of DRA driver accel.example.com"), "recovery logged");
    let done = prepare(&mut plugin, &[&fresh]).await.expect("prepare once the shedding ended");
    assert_eq!(done[&fresh.uid].error, "", "{done:?}");
    assert_eq!(done[&fresh.uid].devices[0].device_name, "example-1");
    s.harness.kubectl(&["delete", "prioritylevelconfiguration", "devhost-shed"]);
    eprintln!(
        "429s for {measured:?}: {rejected} requests rejected (at most {most}), {errors} failed passes (at most \
         {passes}), new claim failed in {took:?}, the rest answered in {others:?}; slices right {converged:?} after \
         the shedding ended ({:?} with the prepare); the kubelet read: {}",
        back.elapsed(),
        status.message()
    );
}
