//! The probe process's side (`devhost __conformance-probe PROBE MODULE [KEY=VALUE…]`): runs one
//! probe's check on the module and sends its outcome to the battery over the [`channel`].

use std::path::Path;
use std::process::ExitCode;

use super::probe::{PROBE_ARG, Probe};
use super::report::{Report, parse_options};
use super::{channel, checks, raw};

/// Runs the probe mode when this process was started as one; `None` for
/// every other command line. Call it first thing in `main`.
pub fn entry() -> Option<ExitCode> {
    let mut args = std::env::args().skip(1);
    if args.next()? != PROBE_ARG {
        return None;
    }
    let (Some(probe), Some(module)) = (args.next().as_deref().and_then(Probe::from_arg), args.next()) else {
        eprintln!("devhost {PROBE_ARG}: expected a probe and a module; this mode is started by `devhost conformance`");
        return Some(ExitCode::from(2));
    };
    let words: Vec<String> = args.collect();
    let options = match parse_options(&words) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("devhost {PROBE_ARG}: {e}");
            return Some(ExitCode::from(2));
        }
    };
    if let Err(e) = channel::take_stdout() {
        eprintln!("devhost {PROBE_ARG}: {e}");
        return Some(ExitCode::from(2));
    }
    let module = Path::new(&module);
    let mut r = Report { module: module.display().to_string(), outcomes: Vec::new() };
    match probe {
        Probe::Handshake => checks::handshake(&mut r, module),
        Probe::Concurrent => raw::concurrent(&mut r, module, &options),
        Probe::Cycles => raw::cycles(&mut r, module, &options),
    }
    for o in &r.outcomes {
        let detail = o.detail.replace(['\t', '\n'], " ");
        channel::send(&format!("check\t{}\t{}\t{detail}\n", o.verdict.label(), o.check));
    }
    Some(ExitCode::SUCCESS)
}
