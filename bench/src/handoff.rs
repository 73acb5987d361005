//! The cost of handing an Allocate to the driver's own thread (in process)
//! or worker process (isolated) and back, in one run: p50 of Allocate
//! against the null plugin's GetDevicePluginOptions and its Allocate
//! answered on the gRPC task (the null RPCs), devhost's own
//! GetDevicePluginOptions (no driver call), and the null plugin's Allocate
//! across a hop of the same kind (the contract's floor, [`crate::hop`]),
//! taken call by call in turn with nothing else between the calls; then, in
//! runs of their own, the context switches per call of the devhost process
//! (and its worker), which do not depend on load.

use crate::hop;
use crate::latency::{Client, allocate, options_call, sequential};
use crate::node::{self, Artifacts, Node};
use crate::stats::{Samples, fmt_dur, ratio};
use anyhow::{Context, Result, bail};
use devhost_proto::v1beta1 as pb;
use std::fmt::Write as _;

/// The section of `docs/benchmarks.md`.
pub const HEADING: &str = "Driver hand-off";
const RESOURCE: &str = "bench.example.com/c";
const DEVICES: usize = 8;
const WARMUP: usize = 200;

/// Voluntary + involuntary context switches of every thread of `pid`.
fn switches(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    let mut n = 0;
    for t in tasks.flatten() {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        for l in status.lines() {
            if let Some(v) =
                l.strip_prefix("voluntary_ctxt_switches:").or(l.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                n += v.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    n
}

/// Switches of devhost and its driver workers.
fn all_switches(pid: u32) -> u64 {
    switches(pid) + node::workers_of(pid).into_iter().map(switches).sum::<u64>()
}

/// One line of the result: p50 of null, the hop floor, options, allocate; switches per call.
pub struct Line {
    pub isolation: &'static str,
    pub null_p50: std::time::Duration,
    /// The null plugin's Allocate, answered on its gRPC task.
    pub null_alloc_p50: std::time::Duration,
    /// The null plugin's Allocate across a hop of the same kind ([`crate::hop`]).
    pub floor_p50: std::time::Duration,
    pub opts_p50: std::time::Duration,
    pub alloc_p50: std::time::Duration,
    pub opts_switches: f64,
    pub alloc_switches: f64,
}

async fn one(art: &Artifacts, isolation: &'static str, hop: hop::Kind, null: &Client, n: usize) -> Result<Line> {
    let keys = format!("isolation = \"{isolation}\"\noptions = {{ count = {DEVICES} }}");
    let (node, _kubelet, daemon, dh) = node::c_example_node(art, RESOURCE, DEVICES, &keys).await?;
    let hop_sock = node.path().join("hop.sock");
    let _hop = crate::null::spawn_hop(art, &hop_sock, hop, &node.log("hop.log"))?;
    let floor = crate::null::client(&hop_sock).await?;
    let alloc = |c: Client, i: usize| allocate(c, vec![format!("example-{}", i % DEVICES)]);
    same_answers(&dh, &[("the floor", &floor), ("the null plugin", null)]).await?;
    sequential(&dh, WARMUP, alloc).await?;
    sequential(&dh, WARMUP, options_call).await?;
    sequential(&floor, WARMUP, alloc).await?;
    sequential(null, WARMUP, alloc).await?;
    let (mut base, mut base_a, mut f, mut a, mut o) =
        (Samples::default(), Samples::default(), Samples::default(), Samples::default(), Samples::default());
    // Nothing between the calls: every call but devhost's options follows a call to another
    // process, so that each finds the machine in the same state. (Reading /proc between calls,
    // as this bench once did, took milliseconds of the bench's CPU right before the calls it
    // preceded and slowed those alone.)
    for i in 0..n {
        base.extend(sequential(null, 1, options_call).await?);
        f.extend(sequential(&floor, 1, |c, _| alloc(c, i)).await?);
        base_a.extend(sequential(null, 1, |c, _| alloc(c, i)).await?);
        a.extend(sequential(&dh, 1, |c, _| alloc(c, i)).await?);
        o.extend(sequential(&dh, 1, options_call).await?);
    }
    // Context switches, in runs of their own: /proc is read before and after each run.
    let pid = daemon.pid();
    let s0 = all_switches(pid);
    sequential(&dh, n, alloc).await?;
    let s1 = all_switches(pid);
    sequential(&dh, n, options_call).await?;
    let s2 = all_switches(pid);
    let s = |x: &Samples| x.summary().context("no samples");
    Ok(Line {
        isolation,
        null_p50: s(&base)?.p50,
        null_alloc_p50: s(&base_a)?.p50,
        floor_p50: s(&f)?.p50,
        opts_p50: s(&o)?.p50,
        alloc_p50: s(&a)?.p50,
        opts_switches: s2.saturating_sub(s1) as f64 / n as f64,
        alloc_switches: s1.saturating_sub(s0) as f64 / n as f64,
    })
}

/// Fails unless each of `others` (the null plugin on its gRPC task and across the hop) answers an
/// Allocate exactly as devhost does with the C example: otherwise the ratios would compare
/// different work.
pub async fn same_answers(devhost: &Client, others: &[(&str, &Client)]) -> Result<()> {
    let ids = vec!["example-2".to_string(), "example-5".to_string()];
    let ask = |c: &Client| {
        let mut c = c.clone();
        let req =
            pb::AllocateRequest { container_requests: vec![pb::ContainerAllocateRequest { devices_ids: ids.clone() }] };
        async move { anyhow::Ok(c.allocate(req).await?.into_inner()) }
    };
    let ours = ask(devhost).await.context("devhost's Allocate")?;
    for &(who, c) in others {
        let theirs = ask(c).await.with_context(|| format!("{who}'s Allocate"))?;
        if theirs != ours {
            bail!("{who} does not answer Allocate as devhost does:\n  devhost: {ours:?}\n  {who}: {theirs:?}");
        }
    }
    Ok(())
}

/// Measures both isolation modes against one null plugin; returns a markdown table.
pub async fn run(art: &Artifacts, n: usize) -> Result<String> {
    let node = Node::new()?;
    let null_sock = node.path().join("null.sock");
    let _null = crate::null::spawn_hop(art, &null_sock, hop::Kind::Inline, &node.log("null.log"))?;
    let null = crate::null::client(&null_sock).await?;
    sequential(&null, WARMUP, options_call).await?;
    let mut md = format!(
        "What handing an Allocate to the driver and back costs (`devhost-bench handoff`): the C example driver \
         in process and in a worker process, {n} calls of each kind, in turn with nothing between them (the null \
         plugin's GetDevicePluginOptions, the floor below, the null plugin's Allocate, devhost's Allocate, \
         devhost's GetDevicePluginOptions, which calls no driver). The null plugin answers Allocate on its gRPC \
         task with what devhost answers for the C example (each device's node and visible-devices variable, and \
         what the hook adds: one env var, one annotation): the null RPC of Allocate, the same request and \
         answer as devhost's, checked equal before the calls are timed. Context switches: every thread of devhost and its worker \
         process, from /proc before and after a run of {n} calls of one kind, apart from the timed calls; \
         unlike latencies they do not move with the machine's load. A caller waits up to 50 µs for the answer, \
         yielding its CPU between looks, before it parks its task: in process for the driver thread's \
         (`host/src/driver/instance.rs`), isolated reading the worker's reply from the channel itself \
         (`host/src/driver/isolation/conn.rs`). The floor: the null plugin answering Allocate across one hop \
         of the same kind and nothing else (`bench/src/hop.rs`: a thread of its own, or a child process over a \
         socket pair; the same wait for the answer; the same answer), in the same rounds: what any plugin pays \
         that keeps the ABI's promise to run driver code off the async runtime. Latencies taken on a loaded \
         2-CPU machine: the ratios and switch counts are the figures to quote.\n\n\
         | isolation | null p50 | null Allocate p50 | floor: null Allocate across a hop, p50 | devhost options p50 | \
         Allocate p50 | Allocate ÷ null | Allocate ÷ null Allocate | floor ÷ null Allocate | Allocate ÷ floor | \
         switches per options call | per Allocate |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    );
    for (iso, hop) in [("in-process", hop::Kind::Thread), ("process", hop::Kind::Process)] {
        let l = one(art, iso, hop, &null, n).await.with_context(|| format!("isolation = {iso}"))?;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} |",
            l.isolation,
            fmt_dur(l.null_p50),
            fmt_dur(l.null_alloc_p50),
            fmt_dur(l.floor_p50),
            hop.arg(),
            fmt_dur(l.opts_p50),
            fmt_dur(l.alloc_p50),
            ratio(l.alloc_p50, l.null_p50),
            ratio(l.alloc_p50, l.null_alloc_p50),
            ratio(l.floor_p50, l.null_alloc_p50),
            ratio(l.alloc_p50, l.floor_p50),
            l.opts_switches,
            l.alloc_switches
        );
    }
    Ok(md)
}
