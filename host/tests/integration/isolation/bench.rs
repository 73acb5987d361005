//! What process isolation costs an Allocate: the same C example driver, in
//! process and in a worker process, measured in interleaved rounds so that
//! machine noise hits both alike. Ignored by default (timing, and only
//! meaningful in release); the figures and the command are in
//! docs/isolation.md:
//!
//! `cargo test --release -p devhost --test integration isolation::bench:: -- --ignored --nocapture --test-threads 1`

use crate::common::*;
use devhost::driver::instance::Instance;
use devhost::manifest::Manifest;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

const ROUNDS: usize = 20;
const PER_ROUND: usize = 500;
const WARMUP: usize = 1000;
/// The target for the added p50 latency.
const TARGET: Duration = Duration::from_micros(50);

/// The C example built with -O2, so both sides run the same driver code.
fn example_c(dir: &Path) -> PathBuf {
    let out = dir.join("libdevhost_example_c.so");
    let st = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-std=c11", "-O2", "-shared", "-fPIC", "-pthread", "-I"])
        .arg(abi_include())
        .arg("-o")
        .arg(&out)
        .arg(repo_root().join("drivers/example-c/example.c"))
        .status()
        .expect("run the C compiler");
    assert!(st.success());
    out
}

fn manifest(so: &Path) -> String {
    format!(
        "[driver.local]\nmodule = \"{so}\"\nisolation = \"in-process\"\noptions = {{ count = 8 }}\n\
         [driver.isolated]\nmodule = \"{so}\"\nisolation = \"process\"\noptions = {{ count = 8 }}\n\
         [[resource]]\nname = \"example.com/local\"\ndriver = \"local\"\n\
         [[resource]]\nname = \"example.com/isolated\"\ndriver = \"isolated\"\n",
        so = so.display()
    )
}

struct Stats {
    p50: Duration,
    p99: Duration,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    Stats { p50: v[v.len() / 2], p99: v[(v.len() * 99 / 100).min(v.len() - 1)] }
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

/// Prints the comparison; `enforce` applies the target, which is
/// about Allocate as the kubelet sees it (the driver call alone is context:
/// there the IPC is all there is, with no gRPC to hide it).
fn report(what: &str, local: Vec<Duration>, isolated: Vec<Duration>, enforce: bool) {
    let n = local.len();
    let (l, i) = (stats(local), stats(isolated));
    let added = i.p50.saturating_sub(l.p50);
    println!("\n{what} ({n} calls each, {ROUNDS} interleaved rounds):");
    println!("| Backend | p50 | p99 |\n| --- | --- | --- |");
    println!("| in process | {} | {} |", us(l.p50), us(l.p99));
    println!("| isolation = \"process\" | {} | {} |", us(i.p50), us(i.p99));
    println!("added by isolation at p50: {} (target ≤ {})", us(added), us(TARGET));
    if enforce {
        assert!(added <= TARGET, "{what}: isolation adds {} at p50, more than {}", us(added), us(TARGET));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
async fn allocate_cost_at_the_instance() {
    devhost::driver::isolation::set_worker_program(devhost_bin());
    let dir = tempfile::tempdir().unwrap();
    let so = example_c(dir.path());
    let m = Manifest::parse(&manifest(&so), Path::new("/tmp/devhost.toml"), None).unwrap();
    let cfg = &m.drivers["local"];
    let local = Instance::create("local", devhost::driver::loader::load(&so).unwrap(), &cfg.options, cfg.call_timeout)
        .await
        .unwrap();
    let isolated = Instance::create_isolated(&m.drivers["isolated"], &so, false).await.unwrap();
    async fn round(inst: &Arc<Instance>, n: usize, out: &mut Vec<Duration>) {
        for i in 0..n {
            let t = Instant::now();
            let edits = inst.allocate(vec![format!("example-{}", i % 8)], None).await.unwrap();
            out.push(t.elapsed());
            assert!(edits.is_some());
        }
    }
    let (mut l, mut i) = (Vec::new(), Vec::new());
    round(&local, WARMUP, &mut Vec::new()).await;
    round(&isolated, WARMUP, &mut Vec::new()).await;
    for _ in 0..ROUNDS {
        round(&local, PER_ROUND, &mut l).await;
        round(&isolated, PER_ROUND, &mut i).await;
    }
    report("Instance::allocate (the driver call alone)", l, i, false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run in release with --ignored --nocapture"]
async fn allocate_cost_through_the_kubelet_api() {
    let node = Node::new();
    let so = example_c(node.path());
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _daemon = Daemon::start(&node.write_manifest(&manifest(&so)), &node.kubelet_dir());
    for r in ["example.com/local", "example.com/isolated"] {
        kubelet.wait_devices(r, WAIT, |d| d.len() == 8).await.unwrap();
    }
    async fn round(kubelet: &Kubelet, resource: &str, n: usize, out: &mut Vec<Duration>) {
        for i in 0..n {
            let t = Instant::now();
            let resp = kubelet.allocate(resource, vec![vec![format!("example-{}", i % 8)]]).await.unwrap();
            out.push(t.elapsed());
            assert!(env_of(&resp, 0, "EXAMPLE_ALLOCATED").is_some(), "the driver's hook ran");
        }
    }
    let (mut l, mut i) = (Vec::new(), Vec::new());
    round(&kubelet, "example.com/local", WARMUP, &mut Vec::new()).await;
    round(&kubelet, "example.com/isolated", WARMUP, &mut Vec::new()).await;
    for _ in 0..ROUNDS {
        round(&kubelet, "example.com/local", PER_ROUND, &mut l).await;
        round(&kubelet, "example.com/isolated", PER_ROUND, &mut i).await;
    }
    report("Allocate over gRPC from the kubelet emulator (what the kubelet sees)", l, i, true);
}
