//! The `devhost` command line: run the daemon, or inspect a manifest, its
//! drivers and what they would advertise without a kubelet.

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use devhost::engine::registry::{Mode, Registry, Slot};
use devhost::manifest::Manifest;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Parser)]
#[command(name = "devhost", version = env!("DEVHOST_VERSION"), about = "One kubelet device-plugin host for every accelerator driver module")]
struct Cli {
    /// Log output format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    /// Load driver modules even when others could have written them (development only).
    #[arg(long, global = true)]
    allow_untrusted_modules: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve every resource of the manifest to the kubelet.
    Run {
        #[arg(long)]
        config: PathBuf,
        /// Overrides the manifest's kubelet_dir.
        #[arg(long)]
        kubelet_dir: Option<PathBuf>,
    },
    /// Show what would be advertised, without a kubelet.
    List {
        #[arg(long)]
        config: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Validate the manifest and load its modules; non-zero exit on any problem.
    Check {
        #[arg(long)]
        config: PathBuf,
    },
    /// Run a manifest against an embedded kubelet emulator and print what it advertises.
    #[cfg(feature = "sim")]
    Sim {
        #[arg(long)]
        config: PathBuf,
        /// Keep serving after the report and print device-list changes.
        #[arg(long)]
        keep_running: bool,
    },
    /// `sim` on the bundled demo node (config/demo.toml).
    #[cfg(feature = "sim")]
    Demo {
        /// The demo manifest (default: config/demo.toml here or beside the binary's checkout).
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        keep_running: bool,
    },
    /// Run the conformance battery on one driver module; non-zero exit when a check fails.
    #[cfg(feature = "sim")]
    Conformance {
        #[arg(long)]
        module: PathBuf,
        /// The driver's options, as KEY=VALUE.
        #[arg(long, num_args = 1.., value_name = "KEY=VALUE")]
        options: Vec<String>,
    },
    /// List the driver modules in a folder without enabling anything.
    Drivers {
        #[arg(long, default_value = devhost::manifest::DEFAULT_DRIVER_DIR)]
        dir: PathBuf,
    },
    /// Print a shell completion script (e.g. `devhost completions bash > /etc/bash_completion.d/devhost`).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page, generated from this command line (`devhost manpage | man -l -`).
    Manpage,
}

impl Command {
    /// The simulations and the conformance battery print a report: their logs are quieter.
    fn prints_a_report(&self) -> bool {
        #[cfg(feature = "sim")]
        if matches!(self, Command::Sim { .. } | Command::Demo { .. } | Command::Conformance { .. }) {
            return true;
        }
        false
    }
}

fn init_logs(format: LogFormat, quiet: bool) {
    // The simulations print a report; their logs only matter when something is wrong.
    let default = if quiet { "warn,kubelet_emu=error" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("DEVHOST_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use std::io::IsTerminal;
    // Colours only for a person at a terminal, never in log files.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// How long an edited manifest must stay unchanged before it is applied.
const MANIFEST_SETTLE: std::time::Duration = std::time::Duration::from_secs(1);

static ALLOW_UNTRUSTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Whether logs are JSON: manifest problems then go through the logger too.
static LOG_JSON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes freed request buffers go back to the system: glibc serves a large allocation with its
/// own mapping, returned when freed, but by default raises that threshold after each such free,
/// so that later 4 MiB request buffers come from per-thread heaps that keep the memory. A fixed
/// threshold (which also turns off the raising) keeps the daemon's footprint at what it uses.
fn return_large_frees() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    }
}

fn main() -> ExitCode {
    return_large_frees();
    // A driver worker process (isolation = "process") is this binary too.
    if let Some(code) = devhost::driver::isolation::worker_entry() {
        return code;
    }
    // So is the probe process `devhost conformance` runs a module's raw calls in.
    #[cfg(feature = "sim")]
    if let Some(code) = devhost::ops::conformance::probe_entry() {
        return code;
    }
    let cli = Cli::parse();
    // Generated from the command line definition, without logs or a runtime.
    match cli.command {
        Command::Completions { shell } => return devhost::ops::cli_docs::completions(Cli::command(), shell),
        Command::Manpage => return devhost::ops::cli_docs::manpage(Cli::command()),
        _ => {}
    }
    ALLOW_UNTRUSTED.store(cli.allow_untrusted_modules, std::sync::atomic::Ordering::Relaxed);
    LOG_JSON.store(matches!(cli.log_format, LogFormat::Json), std::sync::atomic::Ordering::Relaxed);
    init_logs(cli.log_format, cli.command.prints_a_report());
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("devhost: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        match cli.command {
            Command::Run { config, kubelet_dir } => run(&config, kubelet_dir.as_deref()).await,
            Command::List { config, json } => list(&config, json).await,
            Command::Check { config } => check(&config).await,
            Command::Drivers { dir } => drivers(&dir),
            #[cfg(feature = "sim")]
            Command::Conformance { module, options } => devhost::ops::conformance::main(&module, &options).await,
            #[cfg(feature = "sim")]
            Command::Sim { config, keep_running } => sim(&config, keep_running).await,
            Command::Completions { .. } | Command::Manpage => ExitCode::SUCCESS,
            #[cfg(feature = "sim")]
            Command::Demo { config, keep_running } => match config.or_else(demo_config) {
                Some(c) => sim(&c, keep_running).await,
                None => {
                    eprintln!("devhost: config/demo.toml not found; run from the repository root or pass --config");
                    ExitCode::FAILURE
                }
            },
        }
    })
}

fn load_manifest(path: &Path, kubelet_dir: Option<&Path>) -> Option<Manifest> {
    match Manifest::load(path, kubelet_dir) {
        Ok(mut m) => {
            if ALLOW_UNTRUSTED.load(std::sync::atomic::Ordering::Relaxed) {
                m.allow_untrusted_modules = true;
            }
            if m.allow_untrusted_modules {
                tracing::warn!("module trust checks are relaxed: modules others can write will be loaded");
            }
            for w in &m.warnings {
                tracing::warn!("{w}");
            }
            Some(m)
        }
        Err(errors) => {
            if LOG_JSON.load(std::sync::atomic::Ordering::Relaxed) {
                for d in &errors.0 {
                    tracing::error!(location = %d.location, field = %d.field, "manifest problem: {}", d.message);
                }
            } else {
                eprintln!("devhost: {} has {} problem(s):", path.display(), errors.0.len());
                for d in &errors.0 {
                    eprintln!("  {d}");
                }
            }
            None
        }
    }
}

async fn run(config: &Path, kubelet_dir: Option<&Path>) -> ExitCode {
    // Handlers first: a SIGTERM during start-up still removes our sockets.
    let Some(mut signals) = Signals::install() else { return ExitCode::FAILURE };
    // A ConfigMap update replaces the file (through a symlink swap): watch
    // its folder and reload when the text really changed and then stayed
    // the same for MANIFEST_SETTLE (a file written in pieces is never
    // applied half-written). SIGHUP applies at once: the operator asked.
    // Watched before it is read: resources are served while the start goes
    // on, and an edit made meanwhile must not be missed.
    let mut edits = watch_manifest(config);
    let mut last_text = std::fs::read_to_string(config).unwrap_or_default();
    let Some(manifest) = load_manifest(config, kubelet_dir) else { return ExitCode::from(2) };
    // Before anything is loaded or served: a second daemon on one kubelet
    // folder would replace the first one's sockets over and over.
    let _lock = match devhost::lock::acquire(&manifest.lock_dir, &manifest.kubelet_dir) {
        Ok(lock) => Some(lock),
        Err(e @ devhost::lock::LockError::Held { .. }) => {
            tracing::error!("{e}");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            tracing::warn!(
                "{e}; running without protection against a second devhost on this kubelet folder (lock_dir must be writable)"
            );
            None
        }
    };
    // A taken metrics port fails the start before anything is served.
    let probes_listener = match manifest.metrics_addr {
        Some(addr) => match devhost::ops::metrics::bind(addr).await {
            Ok(l) => Some(l),
            Err(e) => {
                eprintln!("devhost: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    let registry = Registry::new(&manifest, Mode::Serve);
    let (stop_probes, stop_probes_rx) = tokio::sync::watch::channel(false);
    if let Some(listener) = probes_listener {
        let (ready_reg, status_reg) = (registry.clone(), registry.clone());
        let probes = devhost::ops::metrics::Probes::new(
            move || {
                let missing = ready_reg.unregistered();
                if missing.is_empty() { Ok(()) } else { Err(missing) }
            },
            move || devhost::engine::status::status_json(std::time::SystemTime::now(), status_reg.status(true)),
        );
        tokio::spawn(devhost::ops::metrics::serve(listener, registry.services.metrics.clone(), probes, stop_probes_rx));
    }
    let endpoints = Arc::new(devhost::fronts::device_plugin::kubelet::Endpoints::start(
        manifest.kubelet_dir.clone(),
        registry.services.clone(),
    ));
    let dra = devhost::fronts::dra::Fronts::new(&manifest, registry.services.metrics.clone());
    // The fronts follow the registry: each resource is served as soon as its
    // own driver is up, at start and on every reload.
    let (stop_fronts, plugins, fronts) = follow_registry(registry.clone(), endpoints.clone(), dra);
    // CDI folders changed by others (a vendor's spec, devhost's own removed by hand): seen at once.
    let cdi_watch = registry.watch_cdi();
    registry.apply(&manifest).await;
    let nfd = manifest.nfd_features_dir.clone().map(|dir| devhost::ops::nfd::spawn(dir, registry.clone()));
    // While an edit settles: when it may be applied, and the text then seen.
    let mut settling: Option<(tokio::time::Instant, String)> = None;
    loop {
        let settled = async {
            match &settling {
                Some((at, _)) => tokio::time::sleep_until(*at).await,
                None => std::future::pending().await,
            }
        };
        let why = tokio::select! {
            signal = signals.next() => match signal {
                Signal::Reload => "SIGHUP",
                Signal::Stop(name) => {
                    tracing::info!("{name}: removing our sockets and exiting");
                    break;
                }
            },
            Some(()) = edits.recv() => {
                while edits.try_recv().is_ok() {}
                let text = std::fs::read_to_string(config).unwrap_or_default();
                tracing::debug!("the manifest file changed; applying it once unchanged for {MANIFEST_SETTLE:?}");
                settling = Some((tokio::time::Instant::now() + MANIFEST_SETTLE, text));
                continue;
            }
            () = settled => {
                let seen = settling.take().map(|(_, t)| t).unwrap_or_default();
                let text = std::fs::read_to_string(config).unwrap_or_default();
                if text != seen {
                    // Changed without an event we saw: settle again.
                    settling = Some((tokio::time::Instant::now() + MANIFEST_SETTLE, text));
                    continue;
                }
                if text == last_text {
                    continue;
                }
                "the manifest file changed"
            }
        };
        settling = None;
        last_text = std::fs::read_to_string(config).unwrap_or_default();
        tracing::info!("{why}: reloading {}", config.display());
        let Some(next) = load_manifest(config, kubelet_dir) else {
            tracing::error!("new manifest rejected; still serving the previous one");
            continue;
        };
        for (key, changed) in [
            ("kubelet_dir", next.kubelet_dir != manifest.kubelet_dir),
            ("metrics_addr", next.metrics_addr != manifest.metrics_addr),
            ("cdi_dir", next.cdi_dir != manifest.cdi_dir),
            ("cdi_spec_dirs", next.cdi_spec_dirs != manifest.cdi_spec_dirs),
            ("nfd_features_dir", next.nfd_features_dir != manifest.nfd_features_dir),
            ("pod_resources_socket", next.pod_resources_socket != manifest.pod_resources_socket),
            ("pod_resources_interval", next.pod_resources_interval != manifest.pod_resources_interval),
            ("runtime_socket", next.runtime_socket != manifest.runtime_socket),
            ("lock_dir", next.lock_dir != manifest.lock_dir),
            ("state_dir", next.state_dir != manifest.state_dir),
        ] {
            if changed {
                tracing::warn!("{key} changed; it takes effect when devhost restarts (the running value stays)");
            }
        }
        let changes = registry.apply(&next).await;
        // Every CDI name handed out must resolve: said again at each reload, for every resource.
        registry.recheck_cdi();
        let names = |v: &[Arc<devhost::engine::registry::Resource>]| {
            v.iter().map(|r| r.config.name.clone()).collect::<Vec<_>>().join(", ")
        };
        for gone in changes.stopped.iter().filter(|s| !changes.started.iter().any(|r| r.config.name == s.config.name)) {
            tracing::warn!(resource = %gone.config.name, "removed by this reload: no longer in the manifest, no longer served");
        }
        tracing::info!(
            started = %names(&changes.started),
            stopped = %names(&changes.stopped),
            unchanged = %names(&changes.kept),
            "reload applied"
        );
    }
    let _ = stop_fronts.send(true);
    let _ = plugins.await;
    let mut dra = fronts.await.ok();
    endpoints.shutdown().await;
    if let Some(dra) = &mut dra {
        dra.shutdown().await;
    }
    for task in nfd.into_iter().chain(cdi_watch) {
        task.abort();
    }
    let _ = stop_probes.send(true);
    registry.shutdown();
    ExitCode::SUCCESS
}

/// Keeps the device-plugin endpoints and the DRA fronts in step with the
/// registry's resources until told to stop. Both follow every install, so
/// that each resource is served as soon as its own driver is up; a DRA front
/// that cannot start is tried once per apply (at start, and again at each
/// reload). Each front has a task of its own, so a slow DRA start (an API
/// server that does not answer) never holds back a device plugin. The DRA
/// task returns the fronts for their shutdown.
fn follow_registry(
    registry: Arc<Registry>,
    endpoints: Arc<devhost::fronts::device_plugin::kubelet::Endpoints>,
    mut dra: devhost::fronts::dra::Fronts,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<()>,
    tokio::task::JoinHandle<devhost::fronts::dra::Fronts>,
) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (mut installs, mut stop_rx) = (registry.installs(), stopped.clone());
    let reg = registry.clone();
    let plugins = tokio::spawn(async move {
        loop {
            installs.borrow_and_update();
            endpoints.sync(&reg.resources()).await;
            if !next_install(&mut installs, &mut stop_rx).await {
                break;
            }
        }
    });
    let (mut installs, mut stop_rx) = (registry.installs(), stopped);
    let fronts = tokio::spawn(async move {
        let mut round = 0;
        loop {
            let apply = *installs.borrow_and_update();
            if apply != round {
                round = apply;
                dra.new_round();
            }
            dra.sync(&registry.resources()).await;
            if !next_install(&mut installs, &mut stop_rx).await {
                break;
            }
        }
        dra
    });
    (stop, plugins, fronts)
}

/// Waits for the registry's next install; false once told to stop (or the registry is gone).
async fn next_install(
    installs: &mut tokio::sync::watch::Receiver<u64>,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> bool {
    tokio::select! {
        changed = installs.changed() => changed.is_ok(),
        _ = stop.changed() => false,
    }
}

/// Notifies on any change in the manifest's folder that may concern it
/// (the file itself, or the `..data` link a ConfigMap volume swaps). The
/// events are read on the runtime, by a task that ends with the receiver.
fn watch_manifest(config: &Path) -> tokio::sync::mpsc::Receiver<()> {
    use inotify::WatchMask;
    use tokio_stream::StreamExt;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let name = config.file_name().map(|n| n.to_os_string());
    let dir = config.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
    // Written, replaced, renamed, removed or touched: not reads.
    let mask = WatchMask::CREATE
        | WatchMask::DELETE
        | WatchMask::MOVE
        | WatchMask::MODIFY
        | WatchMask::CLOSE_WRITE
        | WatchMask::ATTRIB
        | WatchMask::ONLYDIR;
    let mut events =
        match devhost::fs_events::stream().and_then(|events| events.watches().add(&dir, mask).map(|_| events)) {
            Ok(events) => events,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "cannot watch the manifest's folder ({e}); reload with SIGHUP");
                return rx;
            }
        };
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(event) => event,
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), "cannot read the manifest folder's events ({e}); reload with SIGHUP");
                    return;
                }
            };
            let relevant = event
                .name
                .as_deref()
                .is_some_and(|f| Some(f) == name.as_deref() || f.to_string_lossy().starts_with("..data"))
                || event.mask.contains(inotify::EventMask::Q_OVERFLOW);
            if relevant && matches!(tx.try_send(()), Err(tokio::sync::mpsc::error::TrySendError::Closed(_))) {
                return;
            }
        }
    });
    rx
}

enum Signal {
    Reload,
    Stop(&'static str),
}

struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Option<Signals> {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt()), signal(SignalKind::hangup())) {
            (Ok(term), Ok(int), Ok(hup)) => Some(Signals { term, int, hup }),
            _ => {
                tracing::error!("cannot install signal handlers");
                None
            }
        }
    }

    async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => Signal::Stop("SIGTERM"),
            _ = self.int.recv() => Signal::Stop("SIGINT"),
            _ = self.hup.recv() => Signal::Reload,
        }
    }
}

#[cfg(feature = "sim")]
async fn wait_for_signal() {
    match Signals::install() {
        Some(mut s) => while !matches!(s.next().await, Signal::Stop(_)) {},
        None => std::future::pending().await,
    }
}

async fn list(config: &Path, json: bool) -> ExitCode {
    let Some(manifest) = load_manifest(config, None) else { return ExitCode::from(2) };
    let registry = Registry::open(&manifest, Mode::Inspect).await;
    if json {
        let mut out = registry.status(false);
        add_holders(&mut out, &manifest).await;
        match serde_json::to_string_pretty(&out) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("devhost: cannot encode JSON: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        for r in &registry.resources() {
            println!("{} (driver {})", r.config.name, r.config.driver);
            if let Some(e) = &r.error {
                println!("  NOT SERVED: {e}");
                continue;
            }
            let view = r.snapshot();
            if view.devices.is_empty() {
                println!("  (no devices)");
            }
            for d in &view.devices {
                let numa = d.numa_node.map(|n| n.to_string()).unwrap_or_else(|| "-".into());
                let mut attrs: Vec<String> = d.attributes.iter().map(|(k, v)| format!("{k}={v}")).collect();
                attrs.extend(links_text(d));
                let health = if d.healthy { "Healthy" } else { "Unhealthy" };
                println!("  {:<40} {:<9} numa={:<2} {}", d.id, health, numa, attrs.join(" "));
                if let Some(why) = d.health_reason.as_ref().filter(|_| !d.healthy) {
                    println!("  {:<40} reason: {why}", "");
                }
            }
        }
    }
    registry.shutdown();
    ExitCode::SUCCESS
}

/// `links=other:score,…` when the device has links.
fn links_text(d: &devhost::driver::device::Device) -> Option<String> {
    let links: Vec<String> = d.links.iter().map(|(other, score)| format!("{other}:{score}")).collect();
    (!links.is_empty()).then(|| format!("links={}", links.join(",")))
}

/// Who holds each device, from the kubelet's pod-resources socket when
/// there is one (a running node); `list` works without it.
async fn add_holders(out: &mut [serde_json::Value], manifest: &Manifest) {
    let holders = devhost::engine::podresources::list_once(&manifest.pod_resources_socket).await;
    for r in out.iter_mut() {
        let name = r["resource"].as_str().unwrap_or_default().to_string();
        match &holders {
            Ok(map) => {
                let snap = devhost::engine::podresources::Snapshot {
                    generation: 1,
                    resources: Some(std::sync::Arc::new(map.clone())),
                    ..Default::default()
                };
                if let Some(devices) = r["devices"].as_array_mut() {
                    for d in devices {
                        let id = d["id"].as_str().unwrap_or_default().to_string();
                        d["held_by"] = serde_json::json!(snap.holders_of_device(&name, &id));
                    }
                }
            }
            Err(e) => r["holders_error"] = serde_json::Value::String(e.to_string()),
        }
    }
}

async fn check(config: &Path) -> ExitCode {
    let Some(manifest) = load_manifest(config, None) else { return ExitCode::from(2) };
    let registry = Registry::open(&manifest, Mode::Inspect).await;
    let mut problems = Vec::new();
    for (name, slot) in registry.drivers() {
        match slot {
            Slot::Failed(e) => problems.push(e),
            // A device is served by exactly one kubelet API: only the devices decide whether
            // a DRA resource's `match` overlaps another resource's.
            Slot::Ready(inst)
                if manifest.resources.iter().any(|r| r.driver == name && r.api.dra_driver().is_some()) =>
            {
                match inst.scan().await {
                    Ok(out) => {
                        let devices = out.devices.iter().map(|d| (d.id.as_str(), &d.attributes));
                        problems.extend(devhost::manifest::api_conflicts(&manifest.resources, &name, devices));
                    }
                    Err(e) => problems.push(format!("driver {name}: scan failed: {e}")),
                }
            }
            Slot::Ready(_) => {}
        }
    }
    let cdi = registry.planned_cdi_report();
    problems.extend(cdi.problems.iter().map(ToString::to_string));
    registry.shutdown();
    for line in &cdi.skipped {
        eprintln!("devhost: note: {line}");
    }
    if problems.is_empty() {
        println!(
            "{}: OK ({} driver(s), {} resource(s))",
            config.display(),
            manifest.drivers.len(),
            manifest.resources.len()
        );
        ExitCode::SUCCESS
    } else {
        eprintln!("devhost: {} has {} problem(s):", config.display(), problems.len());
        for p in &problems {
            eprintln!("  {p}");
        }
        ExitCode::from(1)
    }
}

#[cfg(feature = "sim")]
async fn sim(config: &Path, keep_running: bool) -> ExitCode {
    match devhost::ops::sim::run(config, keep_running, wait_for_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devhost sim: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// config/demo.toml in the working folder, or in the checkout the binary
/// was built in (target/<profile>/devhost → ../../config/demo.toml).
#[cfg(feature = "sim")]
fn demo_config() -> Option<PathBuf> {
    let here = PathBuf::from("config/demo.toml");
    if here.exists() {
        return Some(here);
    }
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.parent()?.join("config/demo.toml");
    p.exists().then_some(p)
}

fn drivers(dir: &Path) -> ExitCode {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("devhost: cannot read driver folder {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    };
    let mut paths: Vec<PathBuf> =
        entries.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "so")).collect();
    paths.sort();
    if paths.is_empty() {
        println!("no .so files in {}", dir.display());
    }
    for p in paths {
        let file = p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        // Loading runs a module's initialisers: an untrusted one is only
        // described, not loaded, unless the operator relaxed trust.
        if let Err(problems) = devhost::driver::loader::check_trust(&p, None) {
            let text: Vec<String> = problems.iter().map(|e| e.to_string()).collect();
            println!("{file}: UNTRUSTED (refused unless allow_untrusted_modules): {}", text.join("; "));
            if !ALLOW_UNTRUSTED.load(std::sync::atomic::Ordering::Relaxed) {
                println!("    not loaded; --allow-untrusted-modules loads it to show what it is");
                continue;
            }
        }
        match devhost::driver::loader::load(&p) {
            Ok(m) => println!(
                "{file}: {} {} (ABI {}) [{}]{}\n    sha256 {} (the bytes loaded; `sha256 = ...` in [driver.X] pins them)",
                m.name,
                m.version,
                m.abi_version(),
                m.capabilities().join(", "),
                if m.description.is_empty() { String::new() } else { format!(" — {}", m.description) },
                m.source.sha256()
            ),
            Err(e) => println!("{file}: cannot be loaded: {e}"),
        }
    }
    ExitCode::SUCCESS
}
