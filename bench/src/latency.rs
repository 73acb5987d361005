//! Figure 1: the Allocate round trip (client → unix socket → devhost → C ABI
//! → C example driver → back), alone and with 64 concurrent clients, against
//! the null plugin's GetDevicePluginOptions measured in the same rounds.

use crate::node::{self, Artifacts, Node, Proc};
use crate::report::Report;
use crate::stats::{Samples, Summary, fmt_dur, p50_p99, ratio};
use anyhow::{Context, Result, bail};
use devhost_proto::v1beta1 as pb;
use kubelet_emu::Kubelet;
use pb::device_plugin_client::DevicePluginClient;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

pub type Client = DevicePluginClient<Channel>;

/// The gRPC floor every figure is compared with.
#[derive(Clone, Copy, Debug)]
pub struct Floor {
    pub seq: Summary,
    pub conc: Summary,
}

/// Sequential and concurrent iteration counts (per round).
const ROUNDS: usize = 4;
const SEQ_PER_ROUND: usize = 500;
const CONC_ROUNDS: usize = 2;
pub const CLIENTS: usize = 64;
/// The concurrent clients share this many HTTP/2 connections (8 streams on
/// each): an endpoint serves at most 16 connections at once
/// (`intake::MAX_CONNECTIONS`), and the kubelet itself uses one.
const CONNECTIONS: usize = 8;
const CALLS_PER_CLIENT: usize = 25;
const WARMUP: usize = 200;

/// Runs `call(client, i)` `n` times one after the other; returns each latency.
pub async fn sequential<F, Fut>(client: &Client, n: usize, call: F) -> Result<Samples>
where
    F: Fn(Client, usize) -> Fut,
    Fut: Future<Output = Result<(), tonic::Status>>,
{
    let mut s = Samples(Vec::with_capacity(n));
    for i in 0..n {
        let t = Instant::now();
        call(client.clone(), i).await.with_context(|| format!("call {i} failed"))?;
        s.push(t.elapsed());
    }
    Ok(s)
}

/// `clients.len()` tasks, one per client, start together and
/// make `per_client` calls each; returns every call's latency.
pub async fn concurrent<F, Fut>(clients: &[Client], per_client: usize, call: F) -> Result<Samples>
where
    F: Fn(Client, usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<(), tonic::Status>> + Send,
{
    let barrier = Arc::new(tokio::sync::Barrier::new(clients.len()));
    let mut tasks = Vec::new();
    for (k, c) in clients.iter().enumerate() {
        let (c, call, barrier) = (c.clone(), call.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut s = Samples(Vec::with_capacity(per_client));
            for i in 0..per_client {
                let t = Instant::now();
                call(c.clone(), k * per_client + i).await?;
                s.push(t.elapsed());
            }
            Ok::<_, tonic::Status>(s)
        }));
    }
    let mut all = Samples::default();
    for t in tasks {
        all.extend(t.await.context("client task failed")?.context("concurrent call failed")?);
    }
    Ok(all)
}

/// `clients` clients on `connections` connections to `socket`, taken in turn.
pub async fn connect_shared(socket: &std::path::Path, clients: usize, connections: usize) -> Result<Vec<Client>> {
    let conns = connect_many(socket, connections.min(clients)).await?;
    Ok((0..clients).map(|i| conns[i % conns.len()].clone()).collect())
}

/// `n` clients, each with its own connection to `socket`.
pub async fn connect_many(socket: &std::path::Path, n: usize) -> Result<Vec<Client>> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let ch = devhost_proto::connect_uds(socket)
            .await
            .with_context(|| format!("cannot connect to {}", socket.display()))?;
        v.push(DevicePluginClient::new(ch).max_decoding_message_size(node::MAX_MESSAGE));
    }
    Ok(v)
}

pub async fn options_call(mut c: Client, _: usize) -> Result<(), tonic::Status> {
    c.get_device_plugin_options(pb::Empty {}).await.map(drop)
}

/// One Allocate of `ids`, checked to carry a container response.
pub async fn allocate(mut c: Client, ids: Vec<String>) -> Result<(), tonic::Status> {
    let req = pb::AllocateRequest { container_requests: vec![pb::ContainerAllocateRequest { devices_ids: ids }] };
    let resp = c.allocate(req).await?.into_inner();
    if resp.container_responses.len() != 1 {
        return Err(tonic::Status::internal("allocate answered without exactly one container response"));
    }
    Ok(())
}

const RESOURCE: &str = "bench.example.com/c";
const DEVICES: usize = 8;

fn alloc_one(c: Client, i: usize) -> impl Future<Output = Result<(), tonic::Status>> + Send {
    allocate(c, vec![format!("example-{}", i % DEVICES)])
}

/// Sequential Allocate with the C driver in a worker process of its own,
/// interleaved with null-plugin rounds: (devhost, baseline).
async fn isolated_allocate(art: &Artifacts, null: &Client) -> Result<(Summary, Summary)> {
    let keys = format!("isolation = \"process\"\noptions = {{ count = {DEVICES}, numa_nodes = 2 }}");
    let (_node, _kubelet, _daemon, dh) = node::c_example_node(art, RESOURCE, DEVICES, &keys).await?;
    sequential(&dh, WARMUP, alloc_one).await?;
    let (mut base, mut alloc) = (Samples::default(), Samples::default());
    for i in 0..ROUNDS / 2 * SEQ_PER_ROUND {
        base.extend(sequential(null, 1, options_call).await?);
        alloc.extend(sequential(&dh, 1, |c, _| alloc_one(c, i)).await?);
    }
    Ok((alloc.summary().context("no samples")?, base.summary().context("no samples")?))
}

/// Measures figure 1 and returns the null plugin's floor for later figures.
pub async fn run(art: &Artifacts, report: &mut Report) -> Result<Floor> {
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let manifest = node.write_manifest(
        "devhost.toml",
        &format!(
            "[driver.c]\nmodule = \"{}\"\nisolation = \"in-process\"\noptions = {{ count = {DEVICES}, numa_nodes = 2 }}\n\n\
             [[resource]]\nname = \"{RESOURCE}\"\ndriver = \"c\"\n",
            art.module("example_c").display()
        ),
    )?;
    let daemon = Proc::devhost(art, &manifest, &node.kubelet_dir())?;
    node::wait_all_registered(&kubelet, &[RESOURCE.to_string()], 1, Some(&daemon)).await?;
    kubelet.wait_devices(RESOURCE, node::WAIT, |d| d.len() == DEVICES).await?;
    let null_sock = node.path().join("null.sock");
    let _null = crate::null::spawn(art, &null_sock, None, &node.log("null.log"))?;
    let null = crate::null::client(&null_sock).await?;
    let dh = node::plugin_client(&kubelet, RESOURCE).await?;

    // The driver's edits must be in the answer: this is the real path.
    let mut probe = dh.clone();
    let req = pb::AllocateRequest {
        container_requests: vec![pb::ContainerAllocateRequest { devices_ids: vec!["example-1".into()] }],
    };
    let resp = probe.allocate(req).await.context("first Allocate failed")?.into_inner();
    if !resp.container_responses.first().is_some_and(|c| c.envs.contains_key("EXAMPLE_ALLOCATED")) {
        bail!("Allocate did not go through the C driver's hook: {resp:?}");
    }

    sequential(&null, WARMUP, options_call).await?;
    sequential(&dh, WARMUP, alloc_one).await?;
    let (mut base, mut alloc, mut opts) = (Samples::default(), Samples::default(), Samples::default());
    // Call by call in turn: drift in machine load hits every side alike.
    for i in 0..ROUNDS * SEQ_PER_ROUND {
        base.extend(sequential(&null, 1, options_call).await?);
        alloc.extend(sequential(&dh, 1, |c, _| alloc_one(c, i)).await?);
        opts.extend(sequential(&dh, 1, options_call).await?);
    }
    let null_clients = connect_shared(&null_sock, CLIENTS, CONNECTIONS).await?;
    let dh_path = kubelet.endpoint_path(RESOURCE).context("resource lost its endpoint")?;
    let dh_clients = connect_shared(&dh_path, CLIENTS, CONNECTIONS).await?;
    let (mut base_c, mut alloc_c) = (Samples::default(), Samples::default());
    let (mut base_wall, mut alloc_wall) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..CONC_ROUNDS {
        let t = Instant::now();
        base_c.extend(concurrent(&null_clients, CALLS_PER_CLIENT, options_call).await?);
        base_wall += t.elapsed();
        let t = Instant::now();
        alloc_c.extend(concurrent(&dh_clients, CALLS_PER_CLIENT, alloc_one).await?);
        alloc_wall += t.elapsed();
    }
    let per_sec = |n: usize, wall: Duration| n as f64 / wall.as_secs_f64().max(1e-9);
    drop(daemon);
    let isolated = isolated_allocate(art, &null).await;

    let s = |x: &Samples| x.summary().context("no samples");
    let (base, alloc, opts, base_c, alloc_c) = (s(&base)?, s(&alloc)?, s(&opts)?, s(&base_c)?, s(&alloc_c)?);
    report.row(
        "1. Allocate, sequential (p50 / p99)",
        p50_p99(&alloc),
        format!("null RPC {}", p50_p99(&base)),
        format!("{} (p50)", ratio(alloc.p50, base.p50)),
        "p50 ≤ 1.2× baseline",
        Some(alloc.p50.as_secs_f64() <= 1.2 * base.p50.as_secs_f64()),
    );
    report.row(
        "1. Allocate, 64 concurrent clients (p50 / p99)",
        p50_p99(&alloc_c),
        format!("null RPC {}", p50_p99(&base_c)),
        format!("{} (p99)", ratio(alloc_c.p99, base_c.p99)),
        "p99 ≤ 1 ms",
        Some(alloc_c.p99 <= Duration::from_millis(1)),
    );
    let table = [
        ("null plugin GetDevicePluginOptions (baseline)", &base),
        ("devhost GetDevicePluginOptions (no driver call)", &opts),
        ("devhost Allocate, 1 device (C driver hook)", &alloc),
        ("null plugin, 64 concurrent clients (baseline)", &base_c),
        ("devhost Allocate, 64 concurrent clients", &alloc_c),
    ];
    let mut body = format!(
        "The real `devhost` release binary serves the C example driver (`count = {DEVICES}`, `numa_nodes = 2`); \
         the clients are the bench's own, on the resource's unix socket (sequential calls: one HTTP/2 connection each). The \
         baseline is a tonic server that answers GetDevicePluginOptions with an empty message, in a process of \
         its own with the same two-worker runtime as devhost. Sequential: {} calls of each kind after {WARMUP} \
         warm-up calls, taken in turn (baseline, Allocate, GetDevicePluginOptions, again) so that load drift hits \
         all of them alike. Concurrent: {CLIENTS} clients, {} to each of {CONNECTIONS} HTTP/2 \
         connections (an endpoint serves at most 16 connections at once), start together and make \
         {CALLS_PER_CLIENT} calls each, {CONC_ROUNDS} rounds.\n\n\
         | Call | n | p50 | p99 | min | max | p50 vs baseline |\n| --- | --- | --- | --- | --- | --- | --- |\n",
        ROUNDS * SEQ_PER_ROUND,
        CLIENTS / CONNECTIONS
    );
    for (name, x) in table {
        let against = if name.contains("concurrent") { base_c.p50 } else { base.p50 };
        body.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} | {} |\n",
            x.n,
            fmt_dur(x.p50),
            fmt_dur(x.p99),
            fmt_dur(x.min),
            fmt_dur(x.max),
            ratio(x.p50, against)
        ));
    }
    match &isolated {
        Ok((iso, iso_base)) => body.push_str(&format!(
            "| devhost Allocate, 1 device, driver in `isolation = \"process\"` | {} | {} | {} | {} | {} | {} (its own \
             baseline rounds: {}) |\n",
            iso.n,
            fmt_dur(iso.p50),
            fmt_dur(iso.p99),
            fmt_dur(iso.min),
            fmt_dur(iso.max),
            ratio(iso.p50, iso_base.p50),
            fmt_dur(iso_base.p50)
        )),
        Err(e) => body.push_str(&format!("\nAllocate with `isolation = \"process\"` not measured: {e:#}\n")),
    }
    body.push_str(&format!(
        "\nCost of the driver path on top of devhost's own gRPC handling (Allocate p50 − GetDevicePluginOptions \
         p50): {}.\n",
        fmt_dur(alloc.p50.saturating_sub(opts.p50))
    ));
    body.push_str(&format!(
        "\nThroughput with {CLIENTS} concurrent clients: devhost Allocate {:.0} calls/s, null plugin {:.0} calls/s. \
         With {CLIENTS} calls always in flight, a call waits for about {CLIENTS} ÷ throughput; the null plugin's \
         own p99 under the same load is {}, so a 1 ms p99 is {} on this machine for any gRPC server.\n",
        per_sec(alloc_c.n, alloc_wall),
        per_sec(base_c.n, base_wall),
        fmt_dur(base_c.p99),
        if base_c.p99 > Duration::from_millis(1) { "out of reach" } else { "within reach" }
    ));
    report.section("1. Allocate round trip", body);
    Ok(Floor { seq: base, conc: base_c })
}
