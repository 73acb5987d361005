//! `devhost-bench`: runs every figure against the real `devhost` binary and
//! writes the report (see `docs/benchmarks.md`). `null-server` is the
//! baseline plugin the bench starts as a child process of its own.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use devhost_bench::node::{Artifacts, Node};
use devhost_bench::report::{self, Report};
use devhost_bench::{
    demo, dra, drapeer, events, footprint, handoff, icount, latency, micro, nodescale, null, peers, scale, startup,
};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(name = "devhost-bench", about = "Measures devhost against in-run baselines and writes docs/benchmarks.md")]
struct Cli {
    /// Where to write the report.
    #[arg(long, default_value = "docs/benchmarks.md")]
    out: PathBuf,
    /// Length of the idle-footprint window in seconds.
    #[arg(long, default_value_t = 30)]
    idle_secs: u64,
    /// Do not build the workspace first (it must already be built).
    #[arg(long)]
    no_build: bool,
    /// Skip the criterion micro-benchmarks (their last saved results are reported).
    #[arg(long)]
    no_micro: bool,
    #[command(subcommand)]
    command: Option<Sub>,
}

#[derive(Subcommand)]
enum Sub {
    /// Serve the null baseline plugin on a socket until killed.
    NullServer {
        #[arg(long)]
        socket: PathBuf,
        /// A kubelet socket to register with.
        #[arg(long)]
        register: Option<PathBuf>,
        /// How many resources to register.
        #[arg(long, default_value_t = 1)]
        resources: usize,
        /// Answer Allocate on the gRPC task (`inline`: the null RPC of
        /// Allocate) or across a thread or a process of its own (the floor of
        /// devhost's driver contract); otherwise Allocate is refused.
        #[arg(long, value_enum)]
        hop: Option<devhost_bench::hop::Kind>,
    },
    /// The null plugin's hop process (`null-server --hop process`): answers
    /// frames on its standard input.
    #[command(hide = true)]
    NullHopWorker,
    /// DRA against a real etcd and kube-apiserver: NodePrepareResources and
    /// NodeUnprepareResources against a null DRA plugin, and a device change
    /// to the updated ResourceSlice; prints the "DRA" section.
    Dra {
        #[arg(long, default_value_t = 200)]
        claims: usize,
        /// Health changes each way.
        #[arg(long, default_value_t = 25)]
        flips: usize,
        /// Replace (or add) the "DRA" section and the summary's DRA rows of this file.
        #[arg(long)]
        record: Option<PathBuf>,
    },
    /// devhost's DRA front beside a DRA driver of the bench's own on the upstream kubeletplugin
    /// helper (built from bench/drapeer) on one API server; prints the "DRA peer" table.
    DraPeers {
        #[arg(long, default_value_t = 200)]
        claims: usize,
        /// Health changes each way, per driver.
        #[arg(long, default_value_t = 25)]
        flips: usize,
        /// Replace (or add) the "DRA peer" part of the "Peers" section of this file.
        #[arg(long)]
        record: Option<PathBuf>,
    },
    /// Serve the null DRA plugin on a socket until killed.
    NullDraServer {
        #[arg(long)]
        socket: PathBuf,
    },
    /// Allocate through the driver hook against the null RPC and devhost's
    /// own GetDevicePluginOptions, in process and isolated, with context
    /// switches per call; prints a markdown table.
    Handoff {
        #[arg(long, default_value_t = 1000)]
        calls: usize,
        /// Replace (or add) the section "Driver hand-off" of this file.
        #[arg(long)]
        record: Option<PathBuf>,
    },
    /// Nodes of many driver instances and resources: start-up, re-registration
    /// after kubelet restarts, RSS, one reload; prints a markdown table.
    NodeScale {
        /// instances:resources pairs.
        #[arg(long, value_delimiter = ',', default_value = "1:1,8:8,16:64")]
        sizes: Vec<String>,
        #[arg(long, default_value_t = 5)]
        starts: usize,
        #[arg(long, default_value_t = 50)]
        restarts: usize,
        /// Replace (or add) the section "Many driver instances" of this file.
        #[arg(long)]
        record: Option<PathBuf>,
    },
    /// Start-up → every resource registered, drivers in process and
    /// isolated, against the null plugin; prints a markdown table.
    Startup {
        #[arg(long, default_value_t = 15)]
        starts: usize,
        /// Replace (or add) the section "Start-up by isolation" of this file.
        #[arg(long)]
        record: Option<PathBuf>,
    },
    /// NVIDIA's k8s-device-plugin (built from bench/peer) beside devhost's
    /// NVIDIA driver on the fake NVML machine; prints the "Peers" table.
    Peers {
        /// Replace (or add) the "Peers" section of this file.
        #[arg(long)]
        record: Option<PathBuf>,
    },
    /// Count the instructions of the hot paths under callgrind (release
    /// build, already built) and record them in, or check them against, the
    /// "Instruction counts" section of a report.
    Icount {
        /// Fail when a count grew more than 10 % over the one recorded in this file.
        #[arg(long, conflicts_with = "record")]
        check: Option<PathBuf>,
        /// Write the counts into this file's section (created if missing).
        #[arg(long)]
        record: Option<PathBuf>,
        /// Keep each figure's callgrind dump files in DIR/<key> (for `callgrind_annotate`).
        #[arg(long, value_name = "DIR")]
        keep: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Sub::NullServer { socket, register, resources, hop }) => {
            null::serve_main(null::ServerArgs { socket, register, resources, hop })
        }
        Some(Sub::NullHopWorker) => devhost_bench::hop::worker_main(),
        Some(Sub::Handoff { calls, record }) => handoff_main(calls, record),
        Some(Sub::Peers { record }) => peers_main(record),
        Some(Sub::Startup { starts, record }) => startup_main(starts, record),
        Some(Sub::NodeScale { sizes, starts, restarts, record }) => node_scale_main(&sizes, starts, restarts, record),
        Some(Sub::Icount { check, record, keep }) => icount_main(check, record, keep),
        Some(Sub::Dra { claims, flips, record }) => dra_main(claims, flips, record),
        Some(Sub::DraPeers { claims, flips, record }) => dra_peers_main(claims, flips, record),
        Some(Sub::NullDraServer { socket }) => dra::serve_null(&socket),
        None => bench(&cli.out, Duration::from_secs(cli.idle_secs), cli.no_build, cli.no_micro),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devhost-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Builds what the bench runs, with the profile this binary was built with.
/// Without `$CARGO` (not started by `cargo run`) nothing is built.
fn build(art: &Artifacts) -> Result<()> {
    let Some(cargo) = std::env::var_os("CARGO").map(PathBuf::from) else { return Ok(()) };
    let profile: Vec<String> = match art.profile().as_str() {
        "release" => vec!["--release".into()],
        "debug" => vec![],
        other => vec!["--profile".into(), other.into()],
    };
    let run = |extra: &[&str]| -> Result<bool> {
        let st = Command::new(&cargo).arg("build").args(&profile).args(extra).current_dir(&art.repo).status()?;
        Ok(st.success())
    };
    if !run(&["--workspace"]).context("cannot run cargo")? {
        eprintln!("devhost-bench: the workspace does not build; building only what the bench needs");
        if !run(&["-p", "devhost", "-p", "devhost-example-c", "-p", "devhost-benchdrv"])? {
            anyhow::bail!("cannot build devhost, the C example and the bench driver");
        }
    }
    Ok(())
}

/// Writes `md` as the section `heading` of the file `path`.
fn record_section(path: &Path, heading: &str, md: &str) -> Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    std::fs::write(path, icount::replace_named(&old, heading, md))
        .with_context(|| format!("cannot write {}", path.display()))
}

fn node_scale_main(sizes: &[String], starts: usize, restarts: usize, record: Option<PathBuf>) -> Result<()> {
    let art = Artifacts::locate()?;
    art.require()?;
    let mut pairs = Vec::new();
    for s in sizes {
        let (i, r) = s.split_once(':').with_context(|| format!("size {s:?} is not instances:resources"))?;
        let (i, r): (usize, usize) = (i.parse()?, r.parse()?);
        if i == 0 || r < i {
            anyhow::bail!("size {s:?}: need at least one instance and one resource per instance");
        }
        pairs.push((i, r));
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut rows = Vec::new();
    for (i, r) in pairs {
        eprintln!("devhost-bench: {i} instances, {r} resources");
        rows.push(rt.block_on(nodescale::one(&art, i, r, starts, restarts)).with_context(|| format!("{i}:{r}"))?);
    }
    let md = nodescale::section(&rows, starts, restarts);
    print!("{md}");
    if let Some(path) = record {
        record_section(&path, nodescale::HEADING, &md)?;
    }
    Ok(())
}

fn peers_main(record: Option<PathBuf>) -> Result<()> {
    let art = Artifacts::locate()?;
    art.require()?;
    let peer = devhost_bench::peers::build(&art)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let md = rt.block_on(peers::run(&art, &peer))?;
    print!("{md}");
    if let Some(path) = record {
        // The section's sub-sections (the DRA peer's) are written by their own commands: keep them.
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        let kept = drapeer::subsections(&old, drapeer::SECTION);
        record_section(&path, drapeer::SECTION, &format!("{}\n\n{kept}", md.trim_end()))?;
    }
    Ok(())
}

fn dra_peers_main(claims: usize, flips: usize, record: Option<PathBuf>) -> Result<()> {
    let art = Artifacts::locate()?;
    art.require()?;
    let peer = drapeer::build(&art)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let figures = rt.block_on(drapeer::run(&art, &peer, claims, flips))?;
    let md = drapeer::section(&art, &figures, flips);
    print!("{md}");
    if let Some(path) = record {
        let old = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let new = drapeer::replace_subsection(&old, drapeer::SECTION, drapeer::SUBHEADING, &md);
        std::fs::write(&path, new).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn startup_main(starts: usize, record: Option<PathBuf>) -> Result<()> {
    let art = Artifacts::locate()?;
    art.require()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let md = rt.block_on(startup::run(&art, starts))?;
    print!("{md}");
    if let Some(path) = record {
        record_section(&path, startup::HEADING, &md)?;
    }
    Ok(())
}

fn dra_main(claims: usize, flips: usize, record: Option<PathBuf>) -> Result<()> {
    let art = Artifacts::locate()?;
    art.require()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let figures = rt.block_on(dra::run(&art, claims, flips))?;
    let (md, mut rows) = (dra::section(&figures), Report::default());
    dra::rows(&figures, &mut rows);
    print!("{md}");
    if let Some(path) = record {
        record_section(&path, dra::HEADING, &md)?;
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        std::fs::write(&path, dra::replace_summary_rows(&text, &rows))
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn handoff_main(calls: usize, record: Option<PathBuf>) -> Result<()> {
    let art = Artifacts::locate()?;
    art.require()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let md = rt.block_on(handoff::run(&art, calls))?;
    print!("{md}");
    if let Some(path) = record {
        record_section(&path, handoff::HEADING, &md)?;
    }
    Ok(())
}

/// The `icount` subcommand: measure, print, then check or record.
fn icount_main(check: Option<PathBuf>, record: Option<PathBuf>, keep: Option<PathBuf>) -> Result<()> {
    let art = Artifacts::locate()?;
    art.require()?;
    if art.profile() != "release" {
        anyhow::bail!("instruction counts are recorded for the release build: run target/release/devhost-bench");
    }
    if !icount::available() {
        anyhow::bail!("valgrind (with callgrind_control) is not installed");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let figures = rt.block_on(icount::measure(&art, keep.as_deref()))?;
    for f in &figures {
        println!("{:<20} {:>10} instructions per call  ({})", f.key, f.per_call, f.what);
    }
    if let Some(path) = record {
        let md = std::fs::read_to_string(&path).unwrap_or_default();
        let md = icount::replace_section(&md, &icount::section(&figures));
        std::fs::write(&path, md).with_context(|| format!("cannot write {}", path.display()))?;
        println!("recorded in {}", path.display());
    }
    if let Some(path) = check {
        let md = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let recorded = icount::recorded(&md).with_context(|| format!("in {}", path.display()))?;
        let bad = icount::compare(&recorded, &figures);
        if !bad.is_empty() {
            anyhow::bail!(
                "instruction counts grew more than {:.0} % over {}:\n  {}",
                icount::TOLERANCE * 100.0,
                path.display(),
                bad.join("\n  ")
            );
        }
        println!("every count is within {:.0} % of {}", icount::TOLERANCE * 100.0, path.display());
    }
    Ok(())
}

fn command_line() -> String {
    let args: Vec<String> =
        std::env::args().skip(1).map(|a| if a.contains(' ') { format!("'{a}'") } else { a }).collect();
    let mut cmd = String::from("cargo run --release -p devhost-bench");
    if !args.is_empty() {
        cmd.push_str(" -- ");
        cmd.push_str(&args.join(" "));
    }
    cmd
}

/// Set on the re-executed bench once the build is done.
const BUILT_ENV: &str = "DEVHOST_BENCH_BUILT";

/// When the build replaced this very binary, runs the new one instead (same
/// arguments, build skipped): a stale bench would measure with stale code.
fn reexec_if_rebuilt(art: &Artifacts) -> Result<()> {
    let me = std::fs::read_link("/proc/self/exe").unwrap_or_default();
    if !me.to_string_lossy().ends_with(" (deleted)") {
        return Ok(());
    }
    use std::os::unix::process::CommandExt;
    let err = Command::new(art.dir.join("devhost-bench")).args(std::env::args_os().skip(1)).env(BUILT_ENV, "1").exec();
    Err(err).context("cannot run the rebuilt bench")
}

fn bench(out: &Path, idle: Duration, no_build: bool, no_micro: bool) -> Result<()> {
    let art = Artifacts::locate()?;
    if !no_build && std::env::var_os(BUILT_ENV).is_none() {
        build(&art)?;
        reexec_if_rebuilt(&art)?;
    }
    let cargo = std::env::var_os("CARGO").map(PathBuf::from);
    art.require()?;
    let started = Instant::now();
    if art.profile() != "release" {
        eprintln!("devhost-bench: WARNING: profile {:?}, not release; figures are not representative", art.profile());
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut report = Report::default();
    rt.block_on(async {
        let step = |n: &str| eprintln!("devhost-bench: {n} ({:.0} s)", started.elapsed().as_secs_f64());
        step("1. Allocate round trip");
        let floor = latency::run(&art, &mut report).await.context("figure 1 (it is also every baseline)")?;
        step("2. health propagation");
        if let Err(e) = events::health(&art, &floor, &mut report).await {
            report.failures.push(format!("2. health propagation: {e:#}"));
        }
        step("3. kubelet restart");
        if let Err(e) = events::restart(&art, &mut report).await {
            report.failures.push(format!("3. kubelet restart: {e:#}"));
        }
        let demo_node = Node::new()?;
        match demo::choose(&art, &demo_node) {
            Ok(demo) => {
                step("4. start-up");
                if let Err(e) = events::startup(&art, &demo, &mut report).await {
                    report.failures.push(format!("4. start-up: {e:#}"));
                }
                step("start-up by isolation");
                match startup::run(&art, 15).await {
                    Ok(md) => report.section(startup::HEADING, md),
                    Err(e) => report.failures.push(format!("start-up by isolation: {e:#}")),
                }
                step("5. idle footprint");
                if let Err(e) = footprint::run(&art, &demo, idle, &mut report).await {
                    report.failures.push(format!("5. idle footprint: {e:#}"));
                }
            }
            Err(e) => report.failures.push(format!("4. and 5. (no demo node): {e:#}")),
        }
        if icount::available() && art.profile() == "release" {
            step("instruction counts (callgrind)");
            match icount::measure(&art, None).await {
                Ok(f) => report.section(icount::HEADING, icount::section(&f)),
                Err(e) => report.failures.push(format!("instruction counts: {e:#}")),
            }
        } else {
            report.failures.push("instruction counts: valgrind is not installed or the build is not release".into());
        }
        step("peers (NVIDIA's k8s-device-plugin)");
        match peers::build(&art) {
            Ok(peer) => match peers::run(&art, &peer).await {
                Ok(md) => report.section("Peers", md),
                Err(e) => report.failures.push(format!("peers: {e:#}")),
            },
            Err(e) => report.failures.push(format!("peers (NVIDIA's plugin not built): {e:#}")),
        }
        step("driver hand-off");
        match handoff::run(&art, 1000).await {
            Ok(md) => report.section(handoff::HEADING, md),
            Err(e) => report.failures.push(format!("driver hand-off: {e:#}")),
        }
        step("many driver instances");
        let mut rows = Vec::new();
        for (i, r) in [(1, 1), (8, 8), (16, 64)] {
            match nodescale::one(&art, i, r, 5, 50).await {
                Ok(row) => rows.push(row),
                Err(e) => report.failures.push(format!("{i} instances, {r} resources: {e:#}")),
            }
        }
        report.section(nodescale::HEADING, nodescale::section(&rows, 5, 50));
        step("DRA (etcd and kube-apiserver)");
        match dra::run(&art, 200, 25).await {
            Ok(f) => {
                dra::rows(&f, &mut report);
                report.section(dra::HEADING, dra::section(&f));
            }
            Err(e) => report.failures.push(format!("DRA: {e:#}")),
        }
        step("6. scale");
        if let Err(e) = scale::run(&art, &floor, &mut report).await {
            report.failures.push(format!("6. scale: {e:#}"));
        }
        anyhow::Ok(())
    })?;
    drop(rt);
    let mut ran_micro = false;
    if let (false, Some(cargo)) = (no_micro, &cargo) {
        eprintln!("devhost-bench: 7. micro-benchmarks ({:.0} s)", started.elapsed().as_secs_f64());
        match micro::run_criterion(cargo, &art) {
            Ok(()) => ran_micro = true,
            Err(e) => report.failures.push(format!("7. micro-benchmarks: {e:#}")),
        }
    }
    report.micro = Some(micro::section(&art, ran_micro));
    let md = report.render(&command_line(), &report::machine(), &report::now_utc(), started.elapsed());
    // Sections this run does not make (kept by hand, or recorded by a subcommand it skipped) stay.
    let md = report::keep_sections(&std::fs::read_to_string(out).unwrap_or_default(), &md);
    std::fs::write(out, &md).with_context(|| format!("cannot write {}", out.display()))?;
    for r in report.rows.iter().filter(|r| r.met == Some(false)) {
        eprintln!("devhost-bench: target missed: {}: {} (target {})", r.figure, r.result, r.target);
    }
    for f in &report.failures {
        eprintln!("devhost-bench: not measured: {f}");
    }
    eprintln!("devhost-bench: wrote {} in {:.0} s", out.display(), started.elapsed().as_secs_f64());
    Ok(())
}
