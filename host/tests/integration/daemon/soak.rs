//! Kubelet churn: hundreds of kubelet restarts with allocations between
//! them, the kubelet vanishing mid-stream, and the device-plugins folder
//! deleted and re-created. Every resource comes back every time; open
//! files, threads and memory do not grow; nobody else's socket is touched.

use crate::common::*;
use std::time::Duration;

const RESOURCES: [&str; 2] = ["example.com/c", "example.com/r"];

fn manifest(node: &Node) -> std::path::PathBuf {
    node.write_manifest(&format!(
        "[driver.c]\nmodule = \"{}\"\n[driver.r]\nmodule = \"{}\"\n\
         [[resource]]\nname = \"example.com/c\"\ndriver = \"c\"\n[[resource]]\nname = \"example.com/r\"\ndriver = \"r\"\n",
        module("example_c").display(),
        module("example_rust").display()
    ))
}

/// (open files, threads, resident KiB) of a process.
fn footprint(pid: u32) -> (usize, usize, u64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (fds, field("Threads:") as usize, field("VmRSS:"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_kubelet_restarts_leak_nothing() {
    let rounds: u64 = std::env::var("DEVHOST_SOAK_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&manifest(&node), &node.kubelet_dir());
    for r in RESOURCES {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    let pid = d.child.id();
    let mut baseline = None;
    for round in 1..=rounds {
        kubelet.restart().unwrap();
        // Another plugin's socket, created after the kubelet's wipe: ours to leave alone.
        let foreign = node.kubelet_dir().join("other-vendor.sock");
        let _l = std::os::unix::net::UnixListener::bind(&foreign).unwrap();
        for r in RESOURCES {
            kubelet.wait_registration_count(r, round + 1, WAIT).await.unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        kubelet.wait_devices("example.com/c", WAIT, |x| x.len() == 2).await.unwrap();
        let resp = match kubelet.allocate("example.com/c", vec![vec!["example-1".into()]]).await {
            Ok(r) => r,
            Err(e) => {
                let logs = d.logs();
                let tail: Vec<&str> = logs.lines().filter(|l| l.contains("INFO") || l.contains("WARN")).collect();
                panic!("round {round}: {e}\n{}", tail[tail.len().saturating_sub(30)..].join("\n"));
            }
        };
        assert_eq!(env_of(&resp, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-1"));
        assert!(foreign.exists(), "round {round}: another plugin's socket was removed");
        if round == rounds.min(50) {
            // Warmed up: allocator pools and lazily started threads exist by now.
            baseline = Some(footprint(pid));
        }
    }
    // One registration per resource and kubelet: a notice of a restart
    // already registered with, read as a new one, re-registers for nothing
    // (and lets a count-based wait like the one above run ahead).
    for r in RESOURCES {
        assert_eq!(kubelet.registration_count(r), rounds + 1, "{r}: registrations over {rounds} kubelet restarts");
    }
    let (fds0, threads0, rss0) = baseline.expect("baseline taken");
    let (fds, threads, rss) = footprint(pid);
    assert!(fds <= fds0 + 2, "open files grew from {fds0} to {fds}");
    assert!(threads <= threads0 + 1, "threads grew from {threads0} to {threads}");
    assert!(rss <= rss0 + 4096, "RSS grew from {rss0} KiB to {rss} KiB");
    eprintln!(
        "after {rounds} restarts: {fds} fds, {threads} threads, {rss} KiB RSS (baseline {fds0}/{threads0}/{rss0})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_vanishing_mid_stream_and_coming_back() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&manifest(&node), &node.kubelet_dir());
    for r in RESOURCES {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    kubelet.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut d = d;
    assert!(d.child.try_wait().unwrap().is_none(), "the daemon keeps running without a kubelet");
    kubelet.restart().unwrap();
    for r in RESOURCES {
        if let Err(e) = kubelet.wait_registration_count(r, 2, WAIT).await {
            panic!("{e}\n{}", d.logs());
        }
    }
    kubelet.allocate("example.com/r", vec![vec!["rex-0".into()]]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_device_plugins_folder_deleted_and_recreated() {
    let node = Node::new();
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&manifest(&node), &node.kubelet_dir());
    for r in RESOURCES {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    kubelet.stop();
    remove_folder_while_served(&node.kubelet_dir());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    for r in RESOURCES {
        kubelet.wait_registered(r, Duration::from_secs(20)).await.unwrap();
    }
    kubelet.wait_devices("example.com/c", WAIT, |x| x.len() == 2).await.unwrap();
    kubelet.allocate("example.com/c", vec![vec!["example-0".into()]]).await.unwrap();
}

/// One sample of the daemon: seconds since the start, resident KiB, open files, threads, tasks.
type Sample = (f64, u64, usize, usize, f64);
/// One quantity of a [`Sample`].
type Quantity = fn(&Sample) -> f64;

/// The least-squares slope of `value` over the samples' time, per hour.
fn slope_per_hour(samples: &[Sample], value: impl Fn(&Sample) -> f64) -> f64 {
    let n = samples.len() as f64;
    let (mt, mv) = (samples.iter().map(|s| s.0).sum::<f64>() / n, samples.iter().map(&value).sum::<f64>() / n);
    let cov: f64 = samples.iter().map(|s| (s.0 - mt) * (value(s) - mv)).sum();
    let var: f64 = samples.iter().map(|s| (s.0 - mt).powi(2)).sum();
    if var == 0.0 { 0.0 } else { cov / var * 3600.0 }
}

/// The compressed soak (issue #38 item 8): kubelet restarts, manifest reloads that add and
/// remove a resource, SIGKILLed driver workers, health flaps, DRA Prepare/Unprepare on a real
/// API server and Allocate load, all at once, for `DEVHOST_SOAK_SECS` (45 s in CI; docs/testing.md
/// records a 30-minute run). The daemon's resident memory, open files, threads and runtime tasks
/// are sampled every 2 s: after warm-up the last quarter may not sit above the first samples'
/// highest (plus a small margin), and the slopes are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_at_once_grows_nothing() {
    use crate::common::apiserver::ApiServerHarness;
    use devhost_proto::dra::v1::dra_plugin_client::DraPluginClient;
    use devhost_proto::dra::v1::{Claim, NodePrepareResourcesRequest, NodeUnprepareResourcesRequest};
    use std::time::Instant;

    let secs: u64 = std::env::var("DEVHOST_SOAK_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(45);
    let harness = tokio::task::spawn_blocking(ApiServerHarness::shared).await.expect("harness thread");
    let node_name = "soak-node";
    harness.kubectl_stdin(
        &["create", "-f", "-"],
        &format!("apiVersion: v1\nkind: Node\nmetadata: {{name: {node_name}}}\n"),
    );
    let (driver, ns) = ("accel.example.com", "default");
    let uid = harness.allocated_claim(ns, "soak", driver, node_name, "example-0");
    let claim = Claim { namespace: ns.into(), uid: uid.clone(), name: "soak".into() };

    let node = Node::new();
    let metrics = free_port();
    let manifest = |with_rust: bool| {
        let extra = if with_rust { "[[resource]]\nname = \"example.com/r\"\ndriver = \"r\"\n" } else { "" };
        node.write_manifest(&format!(
            r#"
kubelet_root_dir = "{root}"
kubeconfig = "{kubeconfig}"
node_name = "{node_name}"
metrics_addr = "{metrics}"
state_dir = "{dir}/state"
cdi_dir = "{dir}/cdi"
[driver.c]
module = "{c}"
options = {{ count = 4, health_file = "{dir}/health" }}
[driver.dra]
module = "{c}"
options = {{ count = 2 }}
[driver.r]
module = "{r}"
[[resource]]
name = "example.com/c"
driver = "c"
[[resource]]
name = "example.com/accel"
driver = "dra"
api = "dra"
{extra}"#,
            root = node.path().join("kubelet-root").display(),
            kubeconfig = harness.kubeconfig().display(),
            dir = node.path().display(),
            c = module("example_c").display(),
            r = module("example_rust").display(),
        ))
    };
    let path = manifest(true);
    let kubelet = std::sync::Arc::new(Kubelet::start(&node.kubelet_dir()).unwrap());
    let d = Daemon::start(&path, &node.kubelet_dir());
    kubelet.wait_registered("example.com/c", WAIT).await.unwrap_or_else(|e| panic!("{e:?}\n{}", d.logs()));
    let pid = d.child.id();
    let socket = node.path().join("kubelet-root/plugins").join(driver).join("dra.sock");

    // Allocate load, beside everything else.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (kubelet, stop) = (kubelet.clone(), stop.clone());
        tokio::spawn(async move {
            let mut ok = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if kubelet.allocate("example.com/c", vec![vec!["example-1".into()]]).await.is_ok() {
                    ok += 1;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            ok
        })
    };
    let tasks = |body: &str| -> f64 {
        body.lines()
            .find(|l| l.starts_with("devhost_runtime_tasks "))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(-1.0)
    };
    let start = Instant::now();
    let (mut samples, mut round, mut prepared, mut kills) = (Vec::<Sample>::new(), 0u64, 0u64, 0u64);
    while start.elapsed() < Duration::from_secs(secs) {
        round += 1;
        std::fs::write(node.path().join("health"), if round % 2 == 0 { "example-2\n" } else { "" }).unwrap();
        if round % 5 == 0 {
            kubelet.restart().unwrap();
        }
        if round % 7 == 0 {
            manifest(round % 14 != 0);
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(pid as i32, libc::SIGHUP) };
        }
        if round % 9 == 0
            && let Some(worker) = worker_of(pid, "c")
        {
            // SAFETY: kill(2) on a worker of our own child.
            unsafe { libc::kill(worker as i32, libc::SIGKILL) };
            kills += 1;
        }
        if let Ok(channel) = devhost_proto::connect_uds(&socket).await {
            let mut plugin = DraPluginClient::new(channel);
            let ask = NodePrepareResourcesRequest { claims: vec![claim.clone()] };
            if let Ok(answer) = plugin.node_prepare_resources(ask).await
                && answer.get_ref().claims.get(&uid).is_some_and(|c| c.error.is_empty())
            {
                prepared += 1;
            }
            let _ =
                plugin.node_unprepare_resources(NodeUnprepareResourcesRequest { claims: vec![claim.clone()] }).await;
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
        if round % 5 == 0 {
            let (fds, threads, rss) = footprint(pid);
            let body = devhost::ops::metrics::get(metrics, "/metrics", &[]).await.map(|r| r.body).unwrap_or_default();
            samples.push((start.elapsed().as_secs_f64(), rss, fds, threads, tasks(&body)));
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let allocations = load.await.unwrap();
    assert!(samples.len() >= 8, "{} samples", samples.len());
    assert!(
        allocations > 100 && prepared > round / 2 && kills > 0,
        "{allocations} Allocates, {prepared} of {round} Prepares, {kills} kills\n{}",
        d.logs()
    );
    // The first quarter is warm-up; its highest values are the baseline.
    let quarter = samples.len() / 4;
    let (early, late) = (&samples[quarter..2 * quarter], &samples[3 * quarter..]);
    let high = |s: &[Sample], f: Quantity| s.iter().map(f).fold(f64::MIN, f64::max);
    let checks: [(&str, Quantity, f64); 4] = [
        ("resident KiB", |s| s.1 as f64, 8192.0),
        ("open files", |s| s.2 as f64, 4.0),
        ("threads", |s| s.3 as f64, 2.0),
        ("runtime tasks", |s| s.4, 8.0),
    ];
    let mut report = Vec::new();
    for (what, f, margin) in checks {
        let (before, after) = (high(early, f), high(late, f));
        report.push(format!("{what}: {before} -> {after}, slope {:+.1}/h", slope_per_hour(&samples[quarter..], f)));
        assert!(
            after <= before + margin,
            "{what} grew from {before} to {after} over {secs} s: {report:?}\n{samples:?}"
        );
    }
    eprintln!(
        "soak {secs} s: {round} rounds, {allocations} Allocates, {prepared} Prepares, {kills} worker kills, {} kubelet \
         restarts, {} reloads; {}",
        round / 5,
        round / 7,
        report.join("; ")
    );
}
