//! Process isolation for driver modules (`isolation = "process"`): the
//! driver's code runs in a worker process of its own (`devhost-worker`, the
//! worker mode of this crate alone, or this same binary in that hidden mode:
//! [`worker_program`]), so a segfault, an abort or a hang in vendor
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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// A lock that a panic elsewhere does not make unusable: what it guards stays consistent under
/// every holder here.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The hidden first argument that turns `devhost` into a driver worker.
pub const WORKER_ARG: &str = "__driver-worker";

static PROGRAM: OnceLock<PathBuf> = OnceLock::new();

/// Makes `program` the executable started for worker processes. By default
/// the host starts [`WORKER_BINARY`] from beside its own executable (see
/// [`worker_program`]), else `/proc/self/exe`. Test and benchmark binaries
/// that embed the library point it at a `devhost` binary instead. Only the
/// first call counts.
pub fn set_worker_program(program: impl Into<PathBuf>) {
    let _ = PROGRAM.set(program.into());
}

/// The running binary, even after the file is replaced or deleted.
const SELF_EXE: &str = "/proc/self/exe";

/// The worker program's file name, looked for beside the running `devhost`:
/// the worker mode alone (about 0.45 MB against devhost's 15.5 MB), so a worker
/// starts in less time and keeps fewer of the binary's pages resident.
pub const WORKER_BINARY: &str = "devhost-worker";

/// `devhost-worker`, opened once: workers are started from this descriptor
/// (`/proc/self/fd/N`), so replacing the file on disk changes nothing for a
/// running host, as `/proc/self/exe` does for devhost itself.
struct Companion {
    /// Never read, only kept open for good: `launch` names it.
    _file: std::fs::File,
    /// `/proc/self/fd/N` of `file`: what workers are started from.
    launch: PathBuf,
    /// Where it was found, shown as the workers' `argv[0]`.
    path: PathBuf,
    /// A worker started from it greeted the host: it works.
    proven: AtomicBool,
    /// It failed before any worker of it greeted: `/proc/self/exe` from then on.
    given_up: AtomicBool,
}

static COMPANION: OnceLock<Option<Companion>> = OnceLock::new();

fn companion() -> Option<&'static Companion> {
    COMPANION
        .get_or_init(|| {
            use std::os::fd::AsRawFd;
            let dir = std::env::current_exe().ok()?.parent()?.to_path_buf();
            let path = dir.join(WORKER_BINARY);
            let file = std::fs::File::open(&path).ok()?;
            match companion_problems(&path, &file) {
                None => Some(Companion {
                    launch: PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd())),
                    _file: file,
                    path,
                    proven: AtomicBool::new(false),
                    given_up: AtomicBool::new(false),
                }),
                Some(why) => {
                    tracing::warn!(
                        program = %path.display(),
                        "not starting driver workers from {WORKER_BINARY} ({why}); devhost itself runs them"
                    );
                    None
                }
            }
        })
        .as_ref()
}

/// The companion, when `program` is what its workers are started from.
fn companion_at(program: &Path) -> Option<&'static Companion> {
    companion().filter(|c| program == c.launch)
}

/// What is wrong with the worker program `path` (open as `file`), if anything:
/// it must be an executable file that only root (or the daemon's user) could
/// have written, as for modules.
fn companion_problems(path: &Path, file: &std::fs::File) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = match file.metadata() {
        Ok(m) => m,
        Err(e) => return Some(format!("cannot inspect it: {e}")),
    };
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Some("not an executable file".into());
    }
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let problems = crate::driver::loader::file_problems(&real, &meta, "worker program");
    if problems.is_empty() {
        return None;
    }
    Some(problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))
}

/// The program a new worker is started from: the one set by
/// [`set_worker_program`], else `devhost-worker` beside this binary (once it
/// is found trustworthy and until it fails to start a worker), else
/// `/proc/self/exe`.
pub(crate) fn worker_program() -> PathBuf {
    match PROGRAM.get() {
        Some(p) => p.clone(),
        None => current_program(&companion().map_or_else(|| PathBuf::from(SELF_EXE), |c| c.launch.clone())),
    }
}

/// What `ps` should show as the worker's `argv[0]` when it is started from
/// `program`: the binary's own path rather than a /proc link.
pub(crate) fn shown_name(program: &Path) -> Option<PathBuf> {
    if program == Path::new(SELF_EXE) {
        return std::env::current_exe().ok();
    }
    companion_at(program).map(|c| c.path.clone())
}

/// `program` is the companion and none of its workers has greeted yet: the
/// caller may still give up on it.
pub(crate) fn unproven_companion(program: &Path) -> bool {
    companion_at(program).is_some_and(|c| !c.proven.load(Ordering::Acquire))
}

/// A worker started from `program` greeted the host.
pub(crate) fn greeted_from(program: &Path) {
    if let Some(c) = companion_at(program) {
        c.proven.store(true, Ordering::Release);
    }
}

/// The companion could not start a worker (`why`): devhost itself runs
/// workers from now on. Returns the program to use instead.
pub(crate) fn give_up_companion(why: &str) -> PathBuf {
    if let Some(c) = companion()
        && !c.given_up.swap(true, Ordering::AcqRel)
    {
        tracing::warn!(
            program = %c.path.display(),
            "{WORKER_BINARY} could not start a driver worker ({why}); devhost itself runs them from now on"
        );
    }
    PathBuf::from(SELF_EXE)
}

/// The program to start a worker of `spec_program` from now: the same one,
/// unless that is the companion, given up since.
pub(crate) fn current_program(spec_program: &Path) -> PathBuf {
    match companion_at(spec_program) {
        Some(c) if c.given_up.load(Ordering::Acquire) => PathBuf::from(SELF_EXE),
        _ => spec_program.to_path_buf(),
    }
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
