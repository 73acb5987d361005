//! `kubelet-emu`: the emulated kubelet device manager as a process of its own,
//! for checks where devhost runs elsewhere (in a container, as the DaemonSet
//! runs it) and shares only the device-plugins folder with it. CI's image
//! check (`.ci/image`) uses it.
//!
//! ```text
//! kubelet-emu DIR --expect RESOURCE=COUNT... [--timeout SECONDS] [--allocate]
//!             [--pod-resources SOCKET]
//! ```
//!
//! Serves `DIR/kubelet.sock`, waits until every expected resource has
//! registered and lists COUNT healthy devices, prints one line per resource
//! (with the Unix time in milliseconds it got there, so that the caller can
//! measure start-up), optionally makes an Allocate call for the first device
//! of each, and exits: 0 when everything arrived in time, 1 otherwise, 2 on
//! bad arguments. With `--pod-resources` it also serves the PodResources API
//! (no pods) on SOCKET and waits until devhost has asked it once.

use kubelet_emu::{Kubelet, PodResourcesServer};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const USAGE: &str =
    "usage: kubelet-emu DIR --expect RESOURCE=COUNT... [--timeout SECONDS] [--allocate] [--pod-resources SOCKET]";

struct Args {
    dir: PathBuf,
    expect: Vec<(String, usize)>,
    timeout: Duration,
    allocate: bool,
    pod_resources: Option<PathBuf>,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut dir = None;
    let mut expect = Vec::new();
    let mut timeout = Duration::from_secs(60);
    let mut allocate = false;
    let mut pod_resources = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--expect" => {
                let value = args.next().ok_or("--expect needs RESOURCE=COUNT")?;
                let (name, count) =
                    value.rsplit_once('=').ok_or_else(|| format!("--expect {value}: expected RESOURCE=COUNT"))?;
                let count = count.parse().map_err(|_| format!("--expect {value}: {count:?} is not a device count"))?;
                expect.push((name.to_string(), count));
            }
            "--timeout" => {
                let value = args.next().ok_or("--timeout needs SECONDS")?;
                let secs: u64 =
                    value.parse().map_err(|_| format!("--timeout {value}: not a whole number of seconds"))?;
                timeout = Duration::from_secs(secs);
            }
            "--allocate" => allocate = true,
            "--pod-resources" => {
                pod_resources = Some(PathBuf::from(args.next().ok_or("--pod-resources needs SOCKET")?))
            }
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            other if dir.is_none() => dir = Some(PathBuf::from(other)),
            other => return Err(format!("unexpected argument {other}")),
        }
    }
    let dir = dir.ok_or("no device-plugins folder given")?;
    if expect.is_empty() {
        return Err("nothing to wait for: give at least one --expect".into());
    }
    Ok(Args { dir, expect, timeout, allocate, pod_resources })
}

fn unix_ms() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("kubelet-emu: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let kubelet = match Kubelet::start(&args.dir) {
        Ok(k) => k,
        Err(e) => {
            eprintln!("kubelet-emu: cannot serve {}: {e}", args.dir.display());
            return ExitCode::FAILURE;
        }
    };
    let pod_resources = match args.pod_resources.as_deref().map(PodResourcesServer::start).transpose() {
        Ok(server) => server,
        Err(e) => {
            eprintln!("kubelet-emu: cannot serve the PodResources API: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("listening on {} at_unix_ms={}", kubelet.socket_path().display(), unix_ms());
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut ok = true;
    for (name, count) in &args.expect {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let healthy = |d: &kubelet_emu::Device| d.health == "Healthy";
        match kubelet.wait_devices(name, left, |devices| devices.len() == *count && devices.iter().all(healthy)).await {
            Ok(devices) => {
                println!(
                    "registered {name} devices={} endpoint={} at_unix_ms={}",
                    devices.len(),
                    kubelet.endpoint(name).unwrap_or_default(),
                    unix_ms()
                );
                if args.allocate
                    && let Some(first) = devices.first()
                {
                    match kubelet.allocate(name, vec![vec![first.id.clone()]]).await {
                        Ok(answer) => {
                            let c = answer.container_responses.first();
                            println!(
                                "allocated {name} {}: devices={} envs={} mounts={} cdi_devices={}",
                                first.id,
                                c.map_or(0, |c| c.devices.len()),
                                c.map_or(0, |c| c.envs.len()),
                                c.map_or(0, |c| c.mounts.len()),
                                c.map_or(0, |c| c.cdi_devices.len()),
                            );
                        }
                        Err(e) => {
                            println!("FAILED allocate {name} {}: {e}", first.id);
                            ok = false;
                        }
                    }
                }
            }
            Err(e) => {
                println!("FAILED {name}: {e}");
                ok = false;
            }
        }
    }
    if let Some(server) = &pod_resources {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match server.wait_list_count(1, left).await {
            Ok(()) => {
                println!("pod-resources: asked {} time(s) at {}", server.list_count(), server.socket_path().display())
            }
            Err(e) => {
                println!("FAILED pod-resources: {e}");
                ok = false;
            }
        }
    }
    if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
