//! The `devhost` command line: run the daemon, or inspect a manifest, its
//! drivers and what they would advertise without a kubelet.

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use devhost::ops::{commands, serve};
use std::path::PathBuf;
use std::process::ExitCode;

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
    let flags = commands::Flags {
        allow_untrusted_modules: cli.allow_untrusted_modules,
        json_logs: matches!(cli.log_format, LogFormat::Json),
    };
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
            Command::Run { config, kubelet_dir } => serve::run(&config, kubelet_dir.as_deref(), flags).await,
            Command::List { config, json } => commands::list(&config, json, flags).await,
            Command::Check { config } => commands::check(&config, flags).await,
            Command::Drivers { dir } => commands::drivers(&dir, flags),
            #[cfg(feature = "sim")]
            Command::Conformance { module, options } => devhost::ops::conformance::main(&module, &options).await,
            #[cfg(feature = "sim")]
            Command::Sim { config, keep_running } => devhost::ops::sim::command(&config, keep_running).await,
            Command::Completions { .. } | Command::Manpage => ExitCode::SUCCESS,
            #[cfg(feature = "sim")]
            Command::Demo { config, keep_running } => match config.or_else(devhost::ops::sim::demo_config) {
                Some(c) => devhost::ops::sim::command(&c, keep_running).await,
                None => {
                    eprintln!("devhost: config/demo.toml not found; run from the repository root or pass --config");
                    ExitCode::FAILURE
                }
            },
        }
    })
}
