//! Figures 2 to 4, the event paths: a driver's health change reaching a
//! ListAndWatch client, re-registration after a kubelet restart, and start-up
//! from process start to every resource registered.

use crate::demo::Demo;
use crate::latency::Floor;
use crate::node::{self, Artifacts, Node, Proc};
use crate::report::Report;
use crate::stats::{Samples, fmt_dur, p50_p99, ratio};
use anyhow::{Context, Result, bail};
use devhost_proto::v1beta1 as pb;
use kubelet_emu::Kubelet;
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

const HEALTH_DEVICES: usize = 8;
const HEALTH_FLIPS: usize = 300;
const HEALTH_WARMUP: usize = 20;

/// True when exactly device `bad` (if any) is unhealthy.
fn list_is(msg: &pb::ListAndWatchResponse, prefix: &str, bad: Option<usize>) -> bool {
    msg.devices.len() == HEALTH_DEVICES
        && msg.devices.iter().all(|d| {
            let want_bad = bad.is_some_and(|b| d.id == format!("{prefix}-{b}"));
            (d.health == devhost_proto::UNHEALTHY) == want_bad
        })
}

/// Figure 2: trigger datagram sent → our ListAndWatch stream holds the list.
pub async fn health(art: &Artifacts, floor: &Floor, report: &mut Report) -> Result<()> {
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let trigger = node.path().join("trigger.sock");
    let resource = "bench.example.com/health".to_string();
    let manifest = node.write_manifest(
        "devhost.toml",
        &format!(
            "[driver.b]\nmodule = \"{}\"\noptions = {{ count = {HEALTH_DEVICES}, trigger = \"{}\" }}\n\n\
             [[resource]]\nname = \"{resource}\"\ndriver = \"b\"\n",
            art.module("benchdrv").display(),
            trigger.display()
        ),
    )?;
    let daemon = Proc::devhost(art, &manifest, &node.kubelet_dir())?;
    node::wait_all_registered(&kubelet, std::slice::from_ref(&resource), 1, Some(&daemon)).await?;
    kubelet.wait_devices(&resource, node::WAIT, |d| d.len() == HEALTH_DEVICES).await?;
    let mut client = node::plugin_client(&kubelet, &resource).await?;
    let mut stream = client.list_and_watch(pb::Empty {}).await.context("ListAndWatch refused")?.into_inner();
    let first = stream.message().await.context("ListAndWatch failed")?.context("ListAndWatch ended at once")?;
    if !list_is(&first, "b", None) {
        bail!("unexpected first device list: {first:?}");
    }
    let sender = UnixDatagram::unbound().context("cannot create a datagram socket")?;
    let mut samples = Samples::default();
    for i in 0..HEALTH_WARMUP + HEALTH_FLIPS {
        // Each flip marks one device bad, then all good again: two changes.
        for bad in [Some(i % HEALTH_DEVICES), None] {
            let payload = bad.map(|b| b.to_string()).unwrap_or_default();
            let t = Instant::now();
            sender
                .send_to(payload.as_bytes(), &trigger)
                .with_context(|| format!("cannot send to {}", trigger.display()))?;
            loop {
                let msg = tokio::time::timeout(Duration::from_secs(5), stream.message())
                    .await
                    .context("no ListAndWatch message within 5 s of a health change")?
                    .context("ListAndWatch failed")?
                    .context("ListAndWatch ended")?;
                if list_is(&msg, "b", bad) {
                    break;
                }
            }
            if i >= HEALTH_WARMUP {
                samples.push(t.elapsed());
            }
        }
    }
    drop(daemon);
    let s = samples.summary().context("no samples")?;
    report.row(
        "2. Health change → ListAndWatch (p50 / p99)",
        p50_p99(&s),
        format!("null RPC p50 {}", fmt_dur(floor.seq.p50)),
        format!("{} (p50)", ratio(s.p50, floor.seq.p50)),
        "p99 ≤ 10 ms",
        Some(s.p99 <= Duration::from_millis(10)),
    );
    report.section(
        "2. Health propagation",
        format!(
            "The bench driver (`bench/driver`, {HEALTH_DEVICES} devices) blocks on a unix datagram socket; the bench \
             sends it the list of unhealthy devices and the driver calls `devices_changed()` at once. Measured: \
             datagram sent → the bench's own ListAndWatch stream (on the resource socket, beside the emulated \
             kubelet's) yields a list with exactly that health. {} changes (one device down, then up again, \
             {HEALTH_FLIPS} times) after {HEALTH_WARMUP} warm-up flips.\n\n\
             | n | p50 | p99 | min | max |\n| --- | --- | --- | --- | --- |\n| {} | {} | {} | {} | {} |\n\n\
             The driver runs in a worker process (the default isolation). The path is: driver thread → \
             `devices_changed` → the worker's driver thread scans at once and sends the devices with the notice \
             → the host's channel reader → the registry's watcher task takes that scan (no scan request) → the \
             resource's watch channel → the endpoint's stream task → HTTP/2. The baseline is one null unary round trip: a change cannot arrive faster than about that.\n",
            s.n,
            s.n,
            fmt_dur(s.p50),
            fmt_dur(s.p99),
            fmt_dur(s.min),
            fmt_dur(s.max)
        ),
    );
    Ok(())
}

const RESTART_RESOURCES: usize = 8;
const RESTARTS: usize = 25;

/// Figure 3: `Kubelet::restart()` → every resource registered again, and
/// every resource's devices back to Healthy in the kubelet.
pub async fn restart(art: &Artifacts, report: &mut Report) -> Result<()> {
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let names: Vec<String> = (0..RESTART_RESOURCES).map(|i| format!("bench.example.com/r{i}")).collect();
    let mut manifest = format!(
        "[driver.c]\nmodule = \"{}\"\noptions = {{ count = {RESTART_RESOURCES} }}\n",
        art.module("example_c").display()
    );
    for (i, n) in names.iter().enumerate() {
        manifest
            .push_str(&format!("\n[[resource]]\nname = \"{n}\"\ndriver = \"c\"\nmatch = {{ id = \"example-{i}\" }}\n"));
    }
    let manifest = node.write_manifest("devhost.toml", &manifest)?;
    let daemon = Proc::devhost(art, &manifest, &node.kubelet_dir())?;
    node::wait_all_registered(&kubelet, &names, 1, Some(&daemon)).await?;
    let (mut reg, mut cap) = (Samples::default(), Samples::default());
    for _ in 0..RESTARTS {
        // Settle: nothing of the previous round may still be in flight.
        tokio::time::sleep(Duration::from_millis(150)).await;
        for n in &names {
            kubelet.wait_devices(n, node::WAIT, |d| d.len() == 1 && d[0].health == devhost_proto::HEALTHY).await?;
        }
        let regs: Vec<u64> = names.iter().map(|n| kubelet.registration_count(n)).collect();
        let lists: Vec<u64> = names.iter().map(|n| kubelet.list_count(n)).collect();
        let t = Instant::now();
        kubelet.restart().context("emulated kubelet restart failed")?;
        for (n, c) in names.iter().zip(&regs) {
            kubelet.wait_registration_count(n, c + 1, node::WAIT).await?;
        }
        reg.push(t.elapsed());
        for (n, c) in names.iter().zip(&lists) {
            kubelet.wait_list_count(n, c + 1, node::WAIT).await?;
            kubelet.wait_devices(n, node::WAIT, |d| d.iter().all(|x| x.health == devhost_proto::HEALTHY)).await?;
        }
        cap.push(t.elapsed());
    }
    drop(daemon);

    // Baseline: the same 8 registrations made directly by the bench for a
    // null plugin, on a kubelet emulator of its own.
    let bnode = Node::new()?;
    let bkubelet = Kubelet::start(&bnode.kubelet_dir()).context("cannot start the baseline kubelet emulator")?;
    let sock = bnode.kubelet_dir().join("null.sock");
    let _null = crate::null::spawn(art, &sock, None, &bnode.log("null.log"))?;
    crate::null::client(&sock).await?;
    let bnames: Vec<String> = (0..RESTART_RESOURCES).map(|i| format!("null.bench/r{i}")).collect();
    let mut base = Samples::default();
    for _ in 0..RESTARTS {
        let t = Instant::now();
        crate::null::register_all(&bkubelet.socket_path(), "null.sock", &bnames).await?;
        base.push(t.elapsed());
    }
    let (reg, cap, base) = (
        reg.summary().context("no samples")?,
        cap.summary().context("no samples")?,
        base.summary().context("no samples")?,
    );
    report.row(
        "3. Kubelet restart → 8 resources registered (p50 / max)",
        format!("{} / {}", fmt_dur(reg.p50), fmt_dur(reg.max)),
        format!("8 null registrations {}", fmt_dur(base.p50)),
        format!("{} (p50)", ratio(reg.p50, base.p50)),
        "≤ 50 ms",
        Some(reg.max <= Duration::from_millis(50)),
    );
    report.section(
        "3. Kubelet restart",
        format!(
            "One C example driver instance feeds {RESTART_RESOURCES} resources (one device each). The emulated \
             kubelet's `restart()` drops its connections, deletes every socket in the device-plugins folder and \
             listens on a fresh `kubelet.sock`; the clock starts just before that call. {RESTARTS} restarts.\n\n\
             | Until | p50 | p99 | max |\n| --- | --- | --- | --- |\n\
             | every resource registered again | {} | {} | {} |\n\
             | every resource's devices Healthy again in the kubelet | {} | {} | {} |\n\
             | baseline: the bench registers 8 null resources itself | {} | {} | {} |\n\n\
             The baseline is the kubelet side of registration alone (dial, Register, the kubelet dialling back, \
             GetDevicePluginOptions), with no restart to notice.\n",
            fmt_dur(reg.p50),
            fmt_dur(reg.p99),
            fmt_dur(reg.max),
            fmt_dur(cap.p50),
            fmt_dur(cap.p99),
            fmt_dur(cap.max),
            fmt_dur(base.p50),
            fmt_dur(base.p99),
            fmt_dur(base.max)
        ),
    );
    Ok(())
}

const STARTS: usize = 15;

/// Starts one node's devhost `STARTS` times; returns time to every resource
/// registered and to every resource's first device list.
async fn start_times(art: &Artifacts, manifest: &std::path::Path, names: &[String]) -> Result<(Samples, Samples)> {
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let (mut reg, mut listed) = (Samples::default(), Samples::default());
    for round in 1..=STARTS as u64 {
        let lists: Vec<u64> = names.iter().map(|n| kubelet.list_count(n)).collect();
        let mut daemon = Proc::devhost(art, manifest, &node.kubelet_dir())?;
        node::wait_all_registered(&kubelet, names, round, Some(&daemon)).await?;
        reg.push(daemon.started.elapsed());
        for (n, c) in names.iter().zip(&lists) {
            kubelet.wait_list_count(n, c + 1, node::WAIT).await?;
        }
        listed.push(daemon.started.elapsed());
        tokio::task::block_in_place(|| daemon.stop());
    }
    Ok((reg, listed))
}

/// Figure 4: process start → every resource registered.
pub async fn startup(art: &Artifacts, demo: &Demo, report: &mut Report) -> Result<()> {
    let node = Node::new()?;
    let c_names: Vec<String> = (0..4).map(|i| format!("bench.example.com/s{i}")).collect();
    let mut manifest =
        format!("[driver.c]\nmodule = \"{}\"\noptions = {{ count = 4 }}\n", art.module("example_c").display());
    for (i, n) in c_names.iter().enumerate() {
        manifest
            .push_str(&format!("\n[[resource]]\nname = \"{n}\"\ndriver = \"c\"\nmatch = {{ id = \"example-{i}\" }}\n"));
    }
    let c_manifest = node.write_manifest("c.toml", &manifest)?;
    let variants = [
        ("C example driver, 4 resources".to_string(), c_manifest, c_names),
        (format!("demo node: {}", demo.title), demo.manifest.clone(), demo.resources.clone()),
    ];
    let mut body = format!(
        "The clock starts just before `devhost run` is spawned (the emulated kubelet is already listening) and \
         stops when the emulator has accepted the last resource's registration. {STARTS} starts per node; the \
         process is stopped with SIGTERM between starts.\n\n\
         | Node | resources | registered p50 | p99 | first lists p50 | baseline p50 | ratio |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n"
    );
    for (title, manifest, names) in variants {
        let (reg, listed) = start_times(art, &manifest, &names).await?;
        let base = null_start_times(art, names.len()).await?;
        let (reg, listed, base) = (
            reg.summary().context("no samples")?,
            listed.summary().context("no samples")?,
            base.summary().context("no samples")?,
        );
        body.push_str(&format!(
            "| {title} | {} | {} | {} | {} | {} | {} |\n",
            names.len(),
            fmt_dur(reg.p50),
            fmt_dur(reg.p99),
            fmt_dur(listed.p50),
            fmt_dur(base.p50),
            ratio(reg.p50, base.p50)
        ));
        report.row(
            &format!("4. Start-up → registered, {title} (p50 / p99)"),
            p50_p99(&reg),
            format!("null plugin start + {} registrations {}", names.len(), fmt_dur(base.p50)),
            format!("{} (p50)", ratio(reg.p50, base.p50)),
            "≤ 50 ms",
            Some(reg.p50 <= Duration::from_millis(50)),
        );
    }
    body.push_str(
        "\nBaseline: the null plugin binary started the same way, registering as many resources itself as soon \
         as its socket listens (process start, runtime start, bind, registration).\n",
    );
    report.section("4. Start-up", body);
    Ok(())
}

/// Baseline of figure 4: null plugin process start → `n` resources registered.
async fn null_start_times(art: &Artifacts, n: usize) -> Result<Samples> {
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let names: Vec<String> = (0..n).map(|i| format!("null.bench/r{i}")).collect();
    let sock = node.kubelet_dir().join("null.sock");
    let mut s = Samples::default();
    for round in 1..=STARTS as u64 {
        let mut p = crate::null::spawn(art, &sock, Some((&kubelet.socket_path(), n)), &node.log("null.log"))?;
        node::wait_all_registered(&kubelet, &names, round, Some(&p)).await?;
        s.push(p.started.elapsed());
        tokio::task::block_in_place(|| p.stop());
    }
    Ok(s)
}
