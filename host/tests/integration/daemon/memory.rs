//! Kubelet input cannot push the daemon past its DaemonSet memory limit (64 MiB in
//! deploy/daemonset.yaml): large Allocate, GetPreferredAllocation and PreStartContainer requests
//! just under the kubelet's 4 MiB message size, sent one after another and many at once over
//! several connections, are refused while the daemon's peak RSS stays far below the limit and a
//! control Allocate keeps being served.

use crate::common::*;
use devhost_proto::v1beta1 as pb;
use pb::device_plugin_client::DevicePluginClient;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tonic::transport::Channel;

const RESOURCE: &str = "example.com/good";
/// The DaemonSet's memory limit is 64 MiB; the daemon must stay at half of it. What an attack
/// can grow is the daemon's own (anonymous) memory; the rest of its RSS is the pages of its binary
/// and libraries, which depend on the build (about 28 MiB of a 77 MB debug binary, about 8 MiB of
/// the release build the image ships). So the budget is on the anonymous part: 32 MiB minus
/// 16 MiB left for a release build's file pages.
const PEAK_ANON_BUDGET_KIB: u64 = 16 << 10;
/// Beyond this the attack has already shown the daemon unbounded: stop before it hurts the machine.
const ABORT_KIB: u64 = 512 << 10;

/// RssFile of `pid` in KiB: the pages of its binary and libraries.
fn file_backed(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssFile:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// (VmHWM, VmRSS) of `pid` in KiB.
fn memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("VmRSS:"))
}

/// About 3.6 MiB on the wire each, in the shapes that cost a decoder the most per byte.
fn allocate_shapes() -> Vec<(&'static str, pb::AllocateRequest)> {
    let one = |ids: Vec<String>| pb::AllocateRequest {
        container_requests: vec![pb::ContainerAllocateRequest { devices_ids: ids }],
    };
    vec![
        ("1.2 million one-byte IDs", one(vec!["x".to_string(); 1_200_000])),
        ("one ID of 3.6 MiB", one(vec!["y".repeat(3_600_000)])),
        ("3,600 unknown IDs of 1 KiB", one((0..3_600).map(|i| format!("{i:01024}")).collect())),
        ("270,000 unknown IDs of 12 bytes", one((0..270_000).map(|i| format!("ghost-{i:06}")).collect())),
        (
            "1.8 million empty container requests",
            pb::AllocateRequest { container_requests: vec![pb::ContainerAllocateRequest::default(); 1_800_000] },
        ),
        (
            "300,000 container requests naming one real device",
            pb::AllocateRequest {
                container_requests: vec![
                    pb::ContainerAllocateRequest { devices_ids: vec!["example-0".into()] };
                    300_000
                ],
            },
        ),
    ]
}

fn preferred_shape() -> pb::PreferredAllocationRequest {
    pb::PreferredAllocationRequest {
        container_requests: vec![pb::ContainerPreferredAllocationRequest {
            available_device_i_ds: vec!["x".to_string(); 600_000],
            must_include_device_i_ds: vec!["z".to_string(); 600_000],
            allocation_size: 1,
        }],
    }
}

fn pre_start_shape() -> pb::PreStartContainerRequest {
    pb::PreStartContainerRequest { devices_ids: (0..3_600).map(|i| format!("{i:01024}")).collect() }
}

async fn clients(kubelet: &Kubelet, n: usize) -> Vec<DevicePluginClient<Channel>> {
    let path = kubelet.endpoint_path(RESOURCE).expect("registered");
    let mut out = Vec::new();
    for _ in 0..n {
        let ch = devhost_proto::connect_uds(&path).await.expect("connect to the endpoint");
        out.push(DevicePluginClient::new(ch));
    }
    out
}

async fn control_allocate(kubelet: &Kubelet) -> Result<(), String> {
    let r = kubelet.allocate(RESOURCE, vec![vec!["example-1".into()]]).await.map_err(|e| format!("{e:?}"))?;
    match env_of(&r, 0, "EXAMPLE_ALLOCATED").as_deref() {
        Some("example-1") => Ok(()),
        other => Err(format!("wrong answer: EXAMPLE_ALLOCATED = {other:?}")),
    }
}

/// What is wrong with the answer to a hostile request, if anything.
fn refused(what: &str, r: Result<(), tonic::Status>) -> Option<String> {
    let Err(err) = r else { return Some(format!("{what}: a hostile request succeeded")) };
    if !matches!(err.code(), tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted) {
        return Some(format!("{what}: {:?} {:.200}", err.code(), err.message()));
    }
    (err.message().len() > 512).then(|| format!("{what}: the error quotes too much ({} bytes)", err.message().len()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn large_and_concurrent_requests_keep_memory_far_below_the_daemonset_limit() {
    let node = Node::new();
    let m = node.write_manifest(&format!(
        "[driver.good]\nmodule = \"{}\"\noptions = {{ count = 2 }}\n[[resource]]\nname = \"{RESOURCE}\"\ndriver = \"good\"\n",
        module("example_c").display()
    ));
    let kubelet = Arc::new(Kubelet::start(&node.kubelet_dir()).unwrap());
    let d = Daemon::start(&m, &node.kubelet_dir());
    let pid = d.child.id();
    kubelet.wait_devices(RESOURCE, WAIT, |x| x.len() == 2).await.unwrap();
    control_allocate(&kubelet).await.unwrap();
    let (idle, _) = memory(pid);
    let binary = file_backed(pid);

    // A watchdog: the first look at an unbounded daemon ends the attack.
    let blown = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let blown = blown.clone();
        tokio::spawn(async move {
            loop {
                if memory(pid).1 > ABORT_KIB {
                    blown.store(true, Ordering::SeqCst);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    // The control: a kubelet-style Allocate every 100 ms during the whole attack.
    let stop = Arc::new(AtomicBool::new(false));
    let (served, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let control = {
        let (kubelet, stop, served, failed) = (kubelet.clone(), stop.clone(), served.clone(), failed.clone());
        tokio::spawn(async move {
            let mut last_error = None;
            while !stop.load(Ordering::SeqCst) {
                match control_allocate(&kubelet).await {
                    Ok(()) => served.fetch_add(1, Ordering::SeqCst),
                    Err(e) => {
                        last_error = Some(e);
                        failed.fetch_add(1, Ordering::SeqCst)
                    }
                };
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            last_error
        })
    };

    // One at a time, every shape, twice.
    let mut problems = Vec::new();
    let mut c = clients(&kubelet, 1).await.remove(0);
    for _ in 0..2 {
        for (what, req) in allocate_shapes() {
            problems.extend(refused(what, c.allocate(req).await.map(drop)));
            assert!(!blown.load(Ordering::SeqCst), "RSS passed {ABORT_KIB} KiB after {what}");
        }
        let r = c.get_preferred_allocation(preferred_shape()).await.map(drop);
        problems.extend(refused("GetPreferredAllocation of 1.2 million IDs", r));
        let r = c.pre_start_container(pre_start_shape()).await.map(drop);
        problems.extend(refused("PreStartContainer of 3,600 IDs of 1 KiB", r));
    }

    eprintln!("after the sequential requests: {:?} KiB", memory(pid));
    // Many at once: rounds of 16 concurrent requests over 4 connections.
    let conns = clients(&kubelet, 4).await;
    for round in 0..3 {
        let mut calls = Vec::new();
        for i in 0..16usize {
            let mut c = conns[i % conns.len()].clone();
            calls.push(tokio::spawn(async move {
                let what = format!("round {round}, call {i}");
                let r = match i % 4 {
                    0 => c
                        .allocate(pb::AllocateRequest {
                            container_requests: vec![pb::ContainerAllocateRequest {
                                devices_ids: (0..3_600).map(|k| format!("{k:01024}")).collect(),
                            }],
                        })
                        .await
                        .map(drop),
                    1 => c.pre_start_container(pre_start_shape()).await.map(drop),
                    2 => c
                        .allocate(pb::AllocateRequest {
                            container_requests: vec![pb::ContainerAllocateRequest {
                                devices_ids: vec!["w".repeat(3_600_000)],
                            }],
                        })
                        .await
                        .map(drop),
                    _ => c
                        .allocate(pb::AllocateRequest {
                            container_requests: vec![pb::ContainerAllocateRequest {
                                devices_ids: (0..270_000).map(|k| format!("ghost-{k:06}")).collect(),
                            }],
                        })
                        .await
                        .map(drop),
                };
                (what, r)
            }));
        }
        for call in calls {
            let (what, r) = call.await.unwrap();
            problems.extend(refused(&what, r));
        }
        assert!(!blown.load(Ordering::SeqCst), "RSS passed {ABORT_KIB} KiB in round {round}");
    }

    stop.store(true, Ordering::SeqCst);
    let last_error = control.await.unwrap();
    watchdog.abort();
    control_allocate(&kubelet).await.expect("a control Allocate after the attack");
    let (peak, now) = memory(pid);
    eprintln!(
        "daemon memory: idle {idle} KiB ({binary} KiB binary and libraries), peak {peak} KiB, now {now} KiB; \
         control allocations: {} served, {} failed",
        served.load(Ordering::SeqCst),
        failed.load(Ordering::SeqCst)
    );
    assert_eq!(failed.load(Ordering::SeqCst), 0, "the control Allocate failed during the attack: {last_error:?}");
    assert!(served.load(Ordering::SeqCst) >= 1, "the control Allocate was never answered during the attack");
    // The high-water mark less the binary's pages at idle: the daemon's own memory at its peak
    // (conservatively: code pages first touched during the attack count as the daemon's).
    let own = peak.saturating_sub(binary);
    assert!(
        own < PEAK_ANON_BUDGET_KIB,
        "peak RSS {peak} KiB, {own} KiB of it the daemon's own beyond {binary} KiB of binary and library pages \
         (idle {idle} KiB): not far enough below the DaemonSet's 64 MiB limit"
    );
    assert!(problems.is_empty(), "wrong answers to hostile requests:\n{}", problems.join("\n"));
    // The daemon is still whole: the status it serves is small again.
    assert!(d.logs().len() < 4 << 20, "the log grew by megabytes: requests are quoted at length");
}
