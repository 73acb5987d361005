//! How a worker process ends, as the supervisor waits for it, collects it and says it in logs
//! and reports ("exit status 7", "signal 11 (SIGSEGV), core dumped"). A leaf: it knows processes,
//! not the supervisor.

use std::os::unix::process::ExitStatusExt;
use std::process::Child;
use std::time::{Duration, Instant};

pub(super) fn wait_exit(child: &mut Child, within: Duration) {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Kills the worker if it still runs, collects it, and says how it ended
/// (and its exit code, when it exited).
pub(super) fn reap(child: &mut Child) -> (String, Option<i32>) {
    let _ = child.kill();
    match child.wait() {
        Err(e) => (format!("its status is unknown: {e}"), None),
        Ok(st) => (describe_exit(st), st.code()),
    }
}

/// How a process ended, as logs and reports say it: "exit status 7",
/// "signal 11 (SIGSEGV), core dumped".
pub(crate) fn describe_exit(st: std::process::ExitStatus) -> String {
    match (st.code(), st.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(sig)) => {
            format!("signal {sig} ({}){}", signal_name(sig), if st.core_dumped() { ", core dumped" } else { "" })
        }
        _ => st.to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGTERM => "SIGTERM",
        libc::SIGTRAP => "SIGTRAP",
        _ => "signal",
    }
}

/// Whether the worker ended by itself, waiting briefly: its end of the
/// channel closes a moment before the kernel reports the exit.
pub(super) fn own_exit(child: &mut Child) -> Option<std::process::ExitStatus> {
    let until = Instant::now() + Duration::from_millis(500);
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(5)),
            _ => return None,
        }
    }
}
