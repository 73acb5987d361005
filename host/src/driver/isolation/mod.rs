//! Process isolation for driver modules (`isolation = "process"`): the
//! driver's code runs in a worker process of its own (this same binary,
//! started in a hidden mode), so a segfault, an abort or a hang in vendor
//! code costs that driver a restart instead of taking every other driver on
//! the node down with the host. The host talks to the worker over a private
//! socket pair ([`protocol`], read by `conn`); [`supervisor`] restarts dead or stuck
//! workers; [`worker`] is the other end; [`privileges`] is what the worker
//! gives up before it loads the module. docs/isolation.md explains it to
//! operators.

mod conn;
pub mod privileges;
pub mod protocol;
pub mod supervisor;
pub mod worker;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::OnceLock;

/// The hidden first argument that turns `devhost` into a driver worker.
pub const WORKER_ARG: &str = "__driver-worker";

static PROGRAM: OnceLock<PathBuf> = OnceLock::new();

/// Makes `program` the executable started for worker processes. The default,
/// `/proc/self/exe`, is right for the `devhost` binary (and stays right when
/// the file is replaced by an upgrade: the worker speaks the running host's
/// protocol). Test and benchmark binaries that embed the library point it at
/// a `devhost` binary instead. Only the first call counts.
pub fn set_worker_program(program: impl Into<PathBuf>) {
    let _ = PROGRAM.set(program.into());
}

/// The running binary, even after the file is replaced or deleted.
const SELF_EXE: &str = "/proc/self/exe";

pub(crate) fn worker_program() -> PathBuf {
    PROGRAM.get().cloned().unwrap_or_else(|| PathBuf::from(SELF_EXE))
}

/// Runs the worker mode when this process was started as a driver worker;
/// `None` for every other command line. Call it first thing in `main`.
pub fn worker_entry() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    if args.next()? != WORKER_ARG {
        return None;
    }
    let (Some(name), Some(module)) = (args.next(), args.next()) else {
        eprintln!(
            "devhost {WORKER_ARG}: expected a driver name and a module path; this mode is started by devhost itself"
        );
        return Some(ExitCode::from(2));
    };
    Some(worker::main(&name.to_string_lossy(), Path::new(&module)))
}
