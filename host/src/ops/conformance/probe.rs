//! The checks that need the module's code in a process of the kit's own
//! making: the handshake (`dlopen` and the entry point), the overlapping
//! calls of [`super::raw`] (the worker protocol serialises calls) and the
//! create/destroy leak check (it counts one process's descriptors, threads
//! and memory across 100 instances). Each runs in a probe process, this
//! binary started again with [`PROBE_ARG`]: a crash or a hang there costs
//! the probe, and the battery reports it against the call that was running.
//!
//! The probe writes lines on its protocol descriptor (its standard output
//! at start; the driver's own standard output goes to standard error):
//! `call\tNAME` before each call into the module, and
//! `check\tVERDICT\tCHECK\tDETAIL` for each outcome. This file is the battery's side, which
//! starts and watches the probe; [`super::child`] is the probe's, [`super::channel`] its lines.

use super::report::{DEADLINE, Report, Verdict};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;

/// The hidden first argument that turns `devhost` into a conformance probe.
pub const PROBE_ARG: &str = "__conformance-probe";

/// One probe: what it runs, and the checks it reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Probe {
    Handshake,
    Concurrent,
    Cycles,
}

impl Probe {
    pub(super) fn arg(self) -> &'static str {
        match self {
            Probe::Handshake => "handshake",
            Probe::Concurrent => "concurrent",
            Probe::Cycles => "cycles",
        }
    }

    /// The report line this probe fills.
    pub(super) fn check(self) -> &'static str {
        match self {
            Probe::Handshake => "handshake and descriptor",
            Probe::Concurrent => "concurrent calls",
            Probe::Cycles => "create/destroy x100",
        }
    }

    pub(super) fn from_arg(arg: &str) -> Option<Probe> {
        [Probe::Handshake, Probe::Concurrent, Probe::Cycles].into_iter().find(|p| p.arg() == arg)
    }
}

/// Runs `probe` on `module` in a probe process and adds its outcome to `r`;
/// the verdict of its check.
pub(super) async fn run(r: &mut Report, probe: Probe, module: &Path, options: &[(String, String)]) -> Verdict {
    let (module, options) = (module.to_path_buf(), options.to_vec());
    let (verdict, detail) = match tokio::task::spawn_blocking(move || supervise(probe, &module, &options)).await {
        Ok(outcome) => outcome,
        Err(e) => (Verdict::Fail, format!("the probe's thread failed: {e}")),
    };
    r.add(probe.check(), verdict, detail);
    verdict
}

/// Starts the probe and reads it until it ends; kills it when no line came
/// for a call deadline (a hang in the module).
fn supervise(probe: Probe, module: &Path, options: &[(String, String)]) -> (Verdict, String) {
    let mut cmd = Command::new("/proc/self/exe");
    cmd.arg(PROBE_ARG).arg(probe.arg()).arg(module);
    cmd.args(options.iter().map(|(k, v)| format!("{k}={v}")));
    let mut child = match cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn() {
        Ok(c) => c,
        Err(e) => return (Verdict::Fail, format!("cannot start a probe process: {e}")),
    };
    let Some(out) = child.stdout.take() else {
        let _ = child.kill();
        let _ = child.wait();
        return (Verdict::Fail, "the probe process has no output channel".into());
    };
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let (mut last, mut outcome) = ("load".to_string(), None);
    let mut stuck = false;
    loop {
        match lines.recv_timeout(DEADLINE) {
            Ok(line) => match line.split('\t').collect::<Vec<_>>()[..] {
                ["call", name] => last = name.to_string(),
                ["check", verdict, check, detail] if check == probe.check() => {
                    outcome = Verdict::of_label(verdict).map(|v| (v, detail.to_string()));
                }
                _ => {}
            },
            Err(mpsc::RecvTimeoutError::Timeout) => {
                stuck = true;
                let _ = child.kill();
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let status = child.wait();
    if stuck {
        let secs = DEADLINE.as_secs();
        return (
            Verdict::Fail,
            format!("{last} did not return within {secs} s (the call deadline); the probe process was killed"),
        );
    }
    match (status, outcome) {
        (Ok(st), Some(outcome)) if st.success() => outcome,
        (Ok(st), _) => {
            let how = crate::driver::isolation::supervisor::describe_exit(st);
            (Verdict::Fail, format!("the probe process died in {last}: {how}"))
        }
        (Err(e), _) => (Verdict::Fail, format!("the probe process's status is unknown: {e}")),
    }
}
