//! Instruction counts of devhost's hot paths under callgrind: figures that do
//! not move with the load of a shared machine, so CI can hold them to the
//! values recorded in `docs/benchmarks.md` (at most 10 % growth).
//!
//! The real release `devhost` runs under `valgrind --tool=callgrind` with
//! instrumentation off until it has registered (start-up is never counted).
//! The bench's own client, outside valgrind, makes warm-up calls, then
//! `callgrind_control --dump` marks the edges of windows of `CALLS` calls:
//! a window holds every instruction of every devhost thread (gRPC, host
//! logic, the driver's thread) between two dumps, divided by the calls in
//! it. The smallest of `WINDOWS` windows is the figure: unrelated work (a
//! timer, a driver's own thread) only ever adds to a window.

use crate::node::{Artifacts, Node, Proc};
use anyhow::{Context, Result, bail};
use devhost_proto::v1beta1 as pb;
use kubelet_emu::Kubelet;
use pb::device_plugin_client::DevicePluginClient;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use tonic::transport::Channel;

/// Calls per window, and windows per figure.
const CALLS: u64 = 50;
const WINDOWS: usize = 3;
const WARMUP: usize = 30;
/// Registration under valgrind is slow on a loaded machine.
const START_WAIT: Duration = Duration::from_secs(180);
/// How much a count may grow over the recorded value before the check fails.
pub const TOLERANCE: f64 = 0.10;
/// The heading of the section in `docs/benchmarks.md` the check reads.
pub const HEADING: &str = "Instruction counts (CI check)";

/// One hot path and its count per call.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    /// Stable key, the first column of the recorded table.
    pub key: &'static str,
    pub what: &'static str,
    pub per_call: u64,
}

/// Whether callgrind can run here.
pub fn available() -> bool {
    let ok = |p: &str| Command::new(p).arg("--version").output().is_ok_and(|o| o.status.success());
    ok("valgrind") && ok("callgrind_control")
}

/// devhost under callgrind, with its dump files in the node folder.
struct Counted {
    proc: Proc,
    out: PathBuf,
}

impl Counted {
    /// devhost serving `manifest` under callgrind.
    fn start(art: &Artifacts, node: &Node, manifest: &Path) -> Result<Counted> {
        let mut args: Vec<std::ffi::OsString> = vec!["run".into(), "--config".into(), manifest.into()];
        args.extend(["--kubelet-dir".into(), node.kubelet_dir().into()]);
        Self::spawn(art, node, &art.devhost(), &args, "devhost.log")
    }

    /// The null plugin (this bench's own `null-server`) under callgrind,
    /// registering one resource, `null.bench/r0`, with Allocate answered on
    /// its gRPC task.
    fn start_null(art: &Artifacts, node: &Node, kubelet_sock: &Path) -> Result<Counted> {
        let exe = std::env::current_exe().context("cannot find the bench's own executable")?;
        let socket = node.kubelet_dir().join("null.sock");
        let mut args: Vec<std::ffi::OsString> = vec!["null-server".into(), "--socket".into(), socket.into()];
        args.extend(["--register".into(), kubelet_sock.into(), "--hop".into(), crate::hop::Kind::Inline.arg().into()]);
        Self::spawn(art, node, &exe, &args, "null.log")
    }

    fn spawn(art: &Artifacts, node: &Node, program: &Path, args: &[std::ffi::OsString], log: &str) -> Result<Counted> {
        let out = node.path().join("cg");
        let mut cmd = Command::new("valgrind");
        cmd.arg("--tool=callgrind")
            .arg("--instr-atstart=no")
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(program)
            .args(args)
            .current_dir(&art.repo);
        let proc = Proc::spawn(cmd, &node.log(log))?;
        Ok(Counted { proc, out })
    }

    fn control(&self, args: &[&str]) -> Result<()> {
        let pid = self.proc.pid().to_string();
        let o =
            Command::new("callgrind_control").args(args).arg(&pid).output().context("cannot run callgrind_control")?;
        if !o.status.success() {
            bail!(
                "callgrind_control {} {pid} failed: {}{}",
                args.join(" "),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        Ok(())
    }

    /// Turns instrumentation on and drops what was counted so far.
    fn begin(&self) -> Result<()> {
        self.control(&["--instr=on"])?;
        self.control(&["--zero"])
    }

    /// Dumps the counters (which zeroes them) and returns the instructions
    /// since the last dump or zeroing.
    fn dump(&self) -> Result<u64> {
        let before = self.dumps()?;
        self.control(&["--dump"])?;
        let after = self.dumps()?;
        let new: Vec<&PathBuf> = after.iter().filter(|p| !before.contains(p)).collect();
        let [file] = new.as_slice() else { bail!("callgrind wrote {} dump files, expected one", new.len()) };
        let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
        let total = text
            .lines()
            .find_map(|l| l.strip_prefix("summary:").or_else(|| l.strip_prefix("totals:")))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .with_context(|| format!("no instruction total in {}", file.display()))?;
        Ok(total)
    }

    /// Copies the dump files into `dir` (for `callgrind_annotate`), when asked to.
    fn keep(&self, dir: Option<&Path>) -> Result<()> {
        let Some(dir) = dir else { return Ok(()) };
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for f in self.dumps()? {
            let name = f.file_name().context("dump file has no name")?;
            std::fs::copy(&f, dir.join(name)).with_context(|| format!("cannot copy {}", f.display()))?;
        }
        Ok(())
    }

    fn dumps(&self) -> Result<Vec<PathBuf>> {
        let dir = self.out.parent().context("dump path has no folder")?;
        let stem = self.out.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(&format!("{stem}."))))
            .collect();
        v.sort();
        Ok(v)
    }

    /// The fewest instructions per call over `WINDOWS` windows of `CALLS`
    /// calls of `call` (after `WARMUP` uncounted ones).
    async fn per_call<F, Fut>(&self, mut call: F) -> Result<u64>
    where
        F: FnMut(usize) -> Fut,
        Fut: std::future::Future<Output = Result<()>>,
    {
        for i in 0..WARMUP {
            call(i).await.context("warm-up call failed")?;
        }
        self.begin()?;
        let mut best = u64::MAX;
        for w in 0..WINDOWS {
            self.dump()?;
            for i in 0..CALLS as usize {
                call(WARMUP + w * CALLS as usize + i).await.context("counted call failed")?;
            }
            best = best.min(self.dump()? / CALLS);
        }
        Ok(best)
    }
}

async fn registered(kubelet: &Kubelet, resource: &str, counted: &Counted) -> Result<()> {
    if let Err(e) = kubelet.wait_registration_count(resource, 1, START_WAIT).await {
        bail!("{e}\nlast log lines:\n{}", counted.proc.log_tail());
    }
    Ok(())
}

/// One Allocate of one device through the C example driver's hook (in process).
async fn allocate(art: &Artifacts, keep: Option<&Path>) -> Result<u64> {
    const RESOURCE: &str = "bench.example.com/c";
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let manifest = node.write_manifest(
        "devhost.toml",
        &format!(
            "state_dir = \"{}\"\n[driver.c]\nmodule = \"{}\"\nisolation = \"in-process\"\n\
             options = {{ count = 8, numa_nodes = 2 }}\n\n[[resource]]\nname = \"{RESOURCE}\"\ndriver = \"c\"\n",
            // The C example has a release hook: each Allocate appends to the allocation journal
            // here (and fdatasyncs it) before it answers, as on a node.
            node.path().join("state").display(),
            art.module("example_c").display()
        ),
    )?;
    let counted = Counted::start(art, &node, &manifest)?;
    registered(&kubelet, RESOURCE, &counted).await?;
    kubelet.wait_devices(RESOURCE, START_WAIT, |d| d.len() == 8).await?;
    let client = crate::node::plugin_client(&kubelet, RESOURCE).await?;
    let n = allocates(&counted, &client).await?;
    counted.keep(keep)?;
    Ok(n)
}

/// The same Allocate answered by the null plugin on its gRPC task (the
/// answer the C example's hook gives, no driver, no hop): the gRPC floor
/// that devhost's figure is read against.
async fn null_allocate(art: &Artifacts, keep: Option<&Path>) -> Result<u64> {
    const RESOURCE: &str = "null.bench/r0";
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let counted = Counted::start_null(art, &node, &kubelet.socket_path())?;
    registered(&kubelet, RESOURCE, &counted).await?;
    let client = crate::node::plugin_client(&kubelet, RESOURCE).await?;
    let n = allocates(&counted, &client).await?;
    counted.keep(keep)?;
    Ok(n)
}

/// Allocates of one device each (`example-0` to `example-7` in turn), counted.
async fn allocates(counted: &Counted, client: &DevicePluginClient<Channel>) -> Result<u64> {
    counted
        .per_call(|i| {
            let c = client.clone();
            async move {
                crate::latency::allocate(c, vec![format!("example-{}", i % 8)]).await?;
                Ok(())
            }
        })
        .await
}

/// One GetPreferredAllocation of 8 out of 64 linked devices.
async fn preferred(art: &Artifacts, keep: Option<&Path>) -> Result<u64> {
    const RESOURCE: &str = "bench.example.com/links";
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let manifest = node.write_manifest(
        "devhost.toml",
        &format!(
            "[driver.b]\nmodule = \"{}\"\nisolation = \"in-process\"\n\
             options = {{ count = 64, numa_nodes = 2, link_group = 8 }}\n\n\
             [[resource]]\nname = \"{RESOURCE}\"\ndriver = \"b\"\n",
            art.module("benchdrv").display()
        ),
    )?;
    let counted = Counted::start(art, &node, &manifest)?;
    registered(&kubelet, RESOURCE, &counted).await?;
    kubelet.wait_devices(RESOURCE, START_WAIT, |d| d.len() == 64).await?;
    let client = crate::node::plugin_client(&kubelet, RESOURCE).await?;
    let available: Vec<String> = (0..64).map(|i| format!("b-{i}")).collect();
    let n = counted
        .per_call(|_| {
            let mut c = client.clone();
            let req = pb::PreferredAllocationRequest {
                container_requests: vec![pb::ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.clone(),
                    must_include_device_i_ds: vec![],
                    allocation_size: 8,
                }],
            };
            async move {
                let resp = c.get_preferred_allocation(req).await?.into_inner();
                let n = resp.container_responses.first().map_or(0, |r| r.device_i_ds.len());
                if n != 8 {
                    bail!("GetPreferredAllocation answered {n} devices, not 8");
                }
                Ok(())
            }
        })
        .await?;
    counted.keep(keep)?;
    Ok(n)
}

/// One ListAndWatch update: a driver's health change until the stream has it.
async fn list_update(art: &Artifacts, keep: Option<&Path>) -> Result<u64> {
    const RESOURCE: &str = "bench.example.com/health";
    const DEVICES: usize = 8;
    let node = Node::new()?;
    let kubelet = Kubelet::start(&node.kubelet_dir()).context("cannot start the kubelet emulator")?;
    let trigger = node.path().join("trigger.sock");
    let manifest = node.write_manifest(
        "devhost.toml",
        &format!(
            "[driver.b]\nmodule = \"{}\"\nisolation = \"in-process\"\noptions = {{ count = {DEVICES}, trigger = \"{}\" }}\n\n\
             [[resource]]\nname = \"{RESOURCE}\"\ndriver = \"b\"\n",
            art.module("benchdrv").display(),
            trigger.display()
        ),
    )?;
    let counted = Counted::start(art, &node, &manifest)?;
    registered(&kubelet, RESOURCE, &counted).await?;
    kubelet.wait_devices(RESOURCE, START_WAIT, |d| d.len() == DEVICES).await?;
    let mut client = crate::node::plugin_client(&kubelet, RESOURCE).await?;
    let mut stream = client.list_and_watch(pb::Empty {}).await.context("ListAndWatch refused")?.into_inner();
    stream.message().await.context("ListAndWatch failed")?.context("ListAndWatch ended at once")?;
    let sender = UnixDatagram::unbound().context("cannot create a datagram socket")?;
    let stream = std::sync::Arc::new(tokio::sync::Mutex::new(stream));
    let n = counted
        .per_call(|i| {
            // Even calls mark one device bad, odd ones all good again.
            let bad = (i % 2 == 0).then_some(i / 2 % DEVICES);
            let payload = bad.map(|b| b.to_string()).unwrap_or_default();
            let sent = sender.send_to(payload.as_bytes(), &trigger);
            let stream = stream.clone();
            async move {
                sent.context("cannot send a health change to the bench driver")?;
                let mut stream = stream.lock().await;
                loop {
                    let msg = tokio::time::timeout(Duration::from_secs(60), stream.message())
                        .await
                        .context("no ListAndWatch message within 60 s of a health change")??
                        .context("ListAndWatch ended")?;
                    let unhealthy: Vec<&str> = msg
                        .devices
                        .iter()
                        .filter(|d| d.health == devhost_proto::UNHEALTHY)
                        .map(|d| d.id.as_str())
                        .collect();
                    let want: Vec<String> = bad.map(|b| format!("b-{b}")).into_iter().collect();
                    if unhealthy == want.iter().map(String::as_str).collect::<Vec<_>>() {
                        return Ok(());
                    }
                }
            }
        })
        .await?;
    counted.keep(keep)?;
    Ok(n)
}

/// Measures every figure.
/// With `keep`, each figure's callgrind dumps are copied into `keep/<key>`.
pub async fn measure(art: &Artifacts, keep: Option<&Path>) -> Result<Vec<Figure>> {
    let keep = |key: &str| keep.map(|k| k.join(key));
    Ok(vec![
        Figure {
            key: "allocate",
            what: "Allocate of 1 device through the C example driver's hook (in process)",
            per_call: allocate(art, keep("allocate").as_deref()).await.context("Allocate")?,
        },
        Figure {
            key: "null-allocate",
            what: "the same Allocate answered by the null plugin on its gRPC task (the bench's `null-server --hop inline`, not devhost): the gRPC floor",
            per_call: null_allocate(art, keep("null-allocate").as_deref())
                .await
                .context("the null plugin's Allocate")?,
        },
        Figure {
            key: "preferred-8-of-64",
            what: "GetPreferredAllocation, 8 of 64 devices with link scores (bench driver)",
            per_call: preferred(art, keep("preferred-8-of-64").as_deref()).await.context("GetPreferredAllocation")?,
        },
        Figure {
            key: "list-update",
            what: "ListAndWatch update: one health change from the bench driver to the stream",
            per_call: list_update(art, keep("list-update").as_deref()).await.context("ListAndWatch update")?,
        },
    ])
}

/// The section of `docs/benchmarks.md`, whose table the check reads back.
pub fn section(figures: &[Figure]) -> String {
    let mut s = format!(
        "Instructions executed by the devhost process (every thread: gRPC, host logic, the driver's thread) per \
         call, counted by `valgrind --tool=callgrind` on the release build: the smallest of {WINDOWS} windows of \
         {CALLS} calls, after {WARMUP} uncounted warm-up calls; start-up is never counted. Unlike wall-clock \
         figures these do not depend on the machine's load. CI runs `devhost-bench icount --check \
         docs/benchmarks.md` and fails when one grows more than {:.0} % over the value below; after a deliberate \
         change, record new values with `cargo run --release -p devhost-bench -- icount --record \
         docs/benchmarks.md`.\n\n| Key | Hot path | Instructions per call |\n| --- | --- | --- |\n",
        TOLERANCE * 100.0
    );
    for f in figures {
        s.push_str(&format!("| `{}` | {} | {} |\n", f.key, f.what, f.per_call));
    }
    let count = |key: &str| figures.iter().find(|f| f.key == key).map(|f| f.per_call as f64);
    if let (Some(ours), Some(null)) = (count("allocate"), count("null-allocate"))
        && null > 0.0
    {
        s.push_str(&format!(
            "\n`null-allocate` counts the null plugin's process, not devhost's: an Allocate costs devhost {:.2}× the \
             instructions of the null plugin's (everything devhost adds, the hand-off to the driver's thread and the \
             hook included).\n",
            ours / null
        ));
    }
    s
}

/// The recorded values: `key → instructions` from the section's table.
pub fn recorded(md: &str) -> Result<Vec<(String, u64)>> {
    let start = md.find(&format!("## {HEADING}")).with_context(|| format!("no \"## {HEADING}\" section"))?;
    let body = &md[start..];
    let end = body[3..].find("\n## ").map_or(body.len(), |e| e + 3);
    let mut out = Vec::new();
    for line in body[..end].lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if let [_, key, _, count, _] = cells.as_slice()
            && let Some(key) = key.strip_prefix('`').and_then(|k| k.strip_suffix('`'))
        {
            let n = count.parse::<u64>().with_context(|| format!("bad count {count:?} for {key}"))?;
            out.push((key.to_string(), n));
        }
    }
    if out.is_empty() {
        bail!("the \"{HEADING}\" section has no recorded counts");
    }
    Ok(out)
}

/// Replaces (or appends) the section in the markdown text.
pub fn replace_section(md: &str, body: &str) -> String {
    replace_named(md, HEADING, body)
}

/// Replaces (or appends) the section `## heading` of the markdown text.
pub fn replace_named(md: &str, heading: &str, body: &str) -> String {
    let new = format!("## {heading}\n\n{}\n", body.trim_end());
    match md.find(&format!("\n## {heading}\n")).map(|i| i + 1) {
        Some(start) => {
            let rest = &md[start + 3..];
            let end = rest.find("\n## ").map_or(md.len(), |e| start + 3 + e + 1);
            format!("{}{new}{}", &md[..start], if end < md.len() { format!("\n{}", &md[end..]) } else { String::new() })
        }
        None => format!("{}\n{new}", md.trim_end_matches('\n').to_string() + "\n"),
    }
}

/// Compares measured figures with recorded ones: the lines that failed.
pub fn compare(recorded: &[(String, u64)], measured: &[Figure]) -> Vec<String> {
    let mut bad = Vec::new();
    for f in measured {
        match recorded.iter().find(|(k, _)| k == f.key) {
            None => bad.push(format!("{}: no recorded value (record with `icount --record`)", f.key)),
            Some((_, was)) => {
                let limit = (*was as f64 * (1.0 + TOLERANCE)).floor() as u64;
                if f.per_call > limit {
                    bad.push(format!(
                        "{}: {} instructions per call, {:+.1} % over the recorded {was} (limit {limit})",
                        f.key,
                        f.per_call,
                        (f.per_call as f64 / *was as f64 - 1.0) * 100.0
                    ));
                }
            }
        }
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figs(a: u64) -> Vec<Figure> {
        vec![Figure { key: "allocate", what: "x", per_call: a }]
    }

    #[test]
    fn section_round_trips_through_the_document() {
        let md = "# t\n\n## A\n\ntext\n\n## B\n\nmore\n";
        let with = replace_section(md, &section(&figs(1234)));
        assert!(with.starts_with("# t\n\n## A\n\ntext\n"), "{with}");
        assert_eq!(recorded(&with).unwrap(), vec![("allocate".to_string(), 1234)]);
        let again = replace_section(&with, &section(&figs(99)));
        assert_eq!(recorded(&again).unwrap(), vec![("allocate".to_string(), 99)]);
        assert_eq!(again.matches(HEADING).count(), 1, "{again}");
        // Something after the section survives a replacement.
        let mid = replace_section(md, &section(&figs(5))) + "\n## C\n\nlast\n";
        let re = replace_section(&mid, &section(&figs(6)));
        assert!(re.contains("## C\n\nlast"), "{re}");
        assert_eq!(recorded(&re).unwrap(), vec![("allocate".to_string(), 6)]);
    }

    #[test]
    fn growth_over_ten_percent_fails_and_up_to_ten_passes() {
        let rec = vec![("allocate".to_string(), 1000)];
        assert!(compare(&rec, &figs(1100)).is_empty());
        assert!(compare(&rec, &figs(500)).is_empty());
        let bad = compare(&rec, &figs(1101));
        assert_eq!(bad.len(), 1);
        assert!(bad[0].contains("+10.1 %"), "{bad:?}");
        assert!(!compare(&[], &figs(1)).is_empty(), "an unrecorded figure fails");
    }
}
