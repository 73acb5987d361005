//! `devhost conformance --module FILE.so`: the battery a vendor runs on a
//! driver module before shipping it. Each check drives the module through
//! the host's real loader, instance, callbacks and (for the kubelet-facing
//! checks) endpoint and an embedded kubelet, and ends in one line of a
//! pass/fail report; [`raw`] makes the overlapping calls a driver that claims
//! `DEVHOST_CAP_CONCURRENT` must survive, [`node`] the kubelet's side.

mod channel;
mod checks;
mod child;
mod hooks;
mod node;
mod probe;
mod raw;
mod report;
mod subject;

pub use child::entry as probe_entry;

use std::path::Path;

pub use report::{DEADLINE, Outcome, Report, Verdict, parse_options};

/// Runs every check on the module at `path` with `options`.
pub async fn run(path: &Path, options: &[(String, String)]) -> Report {
    checks::run(path, options).await
}

/// The subcommand: prints the report; exit 1 when a check failed, 2 on bad options.
pub async fn main(module: &Path, words: &[String]) -> std::process::ExitCode {
    let options = match parse_options(words) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("devhost conformance: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let report = run(module, &options).await;
    print!("{}", report.render());
    if report.passed() { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::from(1) }
}
