//! Each optional hook once, the way a pod's life calls them (watch_start,
//! allocate, preferred_allocation, pre_start, release), then destroy: each
//! in the module's worker process, within the call deadline. A hook that
//! crashes or hangs fails its own check and the next one gets a new worker.

use super::report::{Report, Verdict};
use super::subject::Subject;
use crate::driver::device::Device;
use crate::driver::instance::{CallError, Instance};
use devhost_abi as abi;
use std::time::Instant;

fn ms(d: std::time::Duration) -> String {
    format!("{} ms", d.as_millis())
}

/// Adds the check for one answered call; the value when it succeeded.
async fn answered<T>(
    r: &mut Report,
    s: &mut Subject,
    (check, call): (&'static str, &str),
    (started, pid): (Instant, Option<u32>),
    result: Result<T, CallError>,
) -> Option<T> {
    match result {
        Ok(v) => {
            r.add(check, Verdict::Pass, format!("answered in {}", ms(started.elapsed())));
            Some(v)
        }
        Err(e) => {
            let why = s.failed(call, pid, e).await;
            r.add(check, Verdict::Fail, why);
            None
        }
    }
}

/// Each optional hook once, with the first device the scan reported.
pub(super) async fn run(r: &mut Report, s: &mut Subject, devices: &[Device]) {
    const CHECKS: [&str; 6] = [
        "watch_start",
        "allocate",
        "claim parameters",
        "preferred_allocation",
        "pre_start",
        "release after the pod ends",
    ];
    let m = match s.live() {
        Ok(inst) => inst.module.clone(),
        Err(why) => return CHECKS.iter().for_each(|c| r.add(c, Verdict::Skip, why.clone())),
    };
    let first: Vec<String> = devices.iter().take(1).map(|d| d.id.clone()).collect();
    let none = |r: &mut Report, check, what: &str| r.add(check, Verdict::Skip, format!("no {what} hook"));
    if !m.watch {
        none(r, "watch_start", "watch");
    } else {
        call(r, s, "watch_start", &[], async |inst, _| inst.watch_start().await).await;
    }
    if first.is_empty() {
        for check in &CHECKS[1..] {
            r.add(check, Verdict::Skip, "no device to call it with");
        }
        return;
    }
    if !m.allocate {
        none(r, "allocate", "allocate");
    } else if m.allocate_claims_only {
        let why = "DEVHOST_CAP_ALLOCATE_CLAIMS_ONLY: the host calls it only for DRA claims (see claim parameters)";
        r.add("allocate", Verdict::Skip, why);
    } else {
        call(r, s, "allocate", &first, async |inst, ids| inst.allocate(ids, None).await.map(drop)).await;
    }
    if !m.reads_claim_parameters() {
        r.add(
            "claim parameters",
            Verdict::Skip,
            "the driver does not declare DEVHOST_CAP_CLAIM_PARAMETERS with an allocate hook: the host refuses DRA \
             claims that carry parameters for it",
        );
    } else {
        claim_parameters(r, s, &first).await;
    }
    if !m.preferred_allocation {
        none(r, "preferred_allocation", "preferred_allocation");
    } else {
        preferred(r, s, devices, &first).await;
    }
    if !m.pre_start {
        none(r, "pre_start", "pre_start");
    } else {
        call(r, s, "pre_start", &first, async |inst, ids| inst.pre_start(ids).await).await;
    }
    if !m.release {
        none(r, "release after the pod ends", "release");
    } else {
        release(r, s, &first).await;
    }
}

/// One hook named `check` with `ids`, through `f`, on the live instance.
async fn call(
    r: &mut Report,
    s: &mut Subject,
    check: &'static str,
    ids: &[String],
    f: impl AsyncFnOnce(&Instance, Vec<String>) -> Result<(), CallError>,
) {
    let inst = match s.live() {
        Ok(inst) => inst.clone(),
        Err(why) => return r.add(check, Verdict::Skip, why),
    };
    let (started, pid) = (Instant::now(), s.pid());
    let result = f(&inst, ids.to_vec()).await;
    answered(r, s, (check, check), (started, pid), result).await;
}

/// A DRA claim's allocate (ABI 1.3): without parameters (`[]`) it must pass; with a key no
/// driver can know it should be refused with INVALID_ARGUMENT, so that a misspelt setting fails
/// the claim instead of being ignored.
async fn claim_parameters(r: &mut Report, s: &mut Subject, first: &[String]) {
    const CHECK: &str = "claim parameters";
    const UNKNOWN: &str = r#"[{"devhost-conformance-unknown-key":true}]"#;
    let inst = match s.live() {
        Ok(inst) => inst.clone(),
        Err(why) => return r.add(CHECK, Verdict::Skip, why),
    };
    let pid = s.pid();
    if let Err(e) = inst.allocate(first.to_vec(), Some("[]".into())).await {
        let why = s.failed(CHECK, pid, e).await;
        return r.add(CHECK, Verdict::Fail, format!("a claim without parameters ([]): {why}"));
    }
    let pid = s.pid();
    match inst.allocate(first.to_vec(), Some(UNKNOWN.into())).await {
        Ok(_) => r.add(
            CHECK,
            Verdict::Warn,
            format!("{UNKNOWN} was accepted: refuse unknown keys (INVALID_ARGUMENT), or a misspelt setting is ignored"),
        ),
        Err(CallError::Status { code: abi::DEVHOST_ERR_INVALID_ARGUMENT, message, .. }) => {
            r.add(CHECK, Verdict::Pass, format!("[] accepted; an unknown key refused with INVALID_ARGUMENT: {message}"))
        }
        Err(e @ CallError::Status { .. }) => {
            r.add(CHECK, Verdict::Warn, format!("an unknown key was refused, but not with INVALID_ARGUMENT: {e}"))
        }
        Err(e) => {
            let why = s.failed(CHECK, pid, e).await;
            r.add(CHECK, Verdict::Fail, why);
        }
    }
}

/// A proposal for two devices that must include the first one.
async fn preferred(r: &mut Report, s: &mut Subject, devices: &[Device], first: &[String]) {
    const CHECK: &str = "preferred_allocation";
    let inst = match s.live() {
        Ok(inst) => inst.clone(),
        Err(why) => return r.add(CHECK, Verdict::Skip, why),
    };
    let all: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
    let size = all.len().min(2) as u32;
    let (started, pid) = (Instant::now(), s.pid());
    let result = inst.preferred(all.clone(), first.to_vec(), size).await;
    let took = started.elapsed();
    match result {
        Ok(Some(ids)) if !ids.starts_with(first) || ids.iter().any(|i| !all.contains(i)) => r.add(
            CHECK,
            Verdict::Warn,
            format!("proposed {ids:?} for must_include {first:?} of {all:?}: the host repairs it and logs a warning"),
        ),
        Ok(_) => r.add(CHECK, Verdict::Pass, format!("answered in {}", ms(took))),
        Err(e) => {
            let why = s.failed(CHECK, pid, e).await;
            r.add(CHECK, Verdict::Fail, why);
        }
    }
}

/// The pod that got `first` ended: release once, then again as the host's
/// retry after a missed deadline would (it must be repeatable).
async fn release(r: &mut Report, s: &mut Subject, first: &[String]) {
    const CHECK: &str = "release after the pod ends";
    let inst = match s.live() {
        Ok(inst) => inst.clone(),
        Err(why) => return r.add(CHECK, Verdict::Skip, why),
    };
    let (started, pid) = (Instant::now(), s.pid());
    let once = inst.release(first.to_vec()).await;
    let took = started.elapsed();
    let again = match &once {
        Err(e) if !matches!(e, CallError::Status { .. }) => {
            let why = s.failed("release", pid, e.clone()).await;
            return r.add(CHECK, Verdict::Fail, why);
        }
        _ => inst.release(first.to_vec()).await,
    };
    if let Err(e) = &again
        && !matches!(e, CallError::Status { .. })
    {
        let why = s.failed("release", pid, e.clone()).await;
        return r.add(CHECK, Verdict::Fail, format!("a repeated release: {why}"));
    }
    let refused =
        |e: &CallError| matches!(e, CallError::Status { code, .. } if *code != devhost_abi::DEVHOST_ERR_NOT_FOUND);
    match (once, again) {
        (Err(e), _) if refused(&e) => r.add(CHECK, Verdict::Fail, e.to_string()),
        (_, Err(e)) if refused(&e) => r.add(CHECK, Verdict::Fail, format!("a repeated release failed: {e}")),
        _ => r.add(CHECK, Verdict::Pass, format!("{} for {first:?}, and repeatable", ms(took))),
    }
}

/// The daemon's stop: watch_stop and destroy in the worker, which must
/// then exit cleanly.
pub(super) async fn destroy(r: &mut Report, s: &mut Subject) {
    const CHECK: &str = "destroy";
    if let Err(why) = s.live() {
        return r.add(CHECK, Verdict::Skip, why);
    }
    match s.destroy().await {
        Ok(took) => r.add(CHECK, Verdict::Pass, format!("returned in {}; the worker process exited cleanly", ms(took))),
        Err(why) => r.add(CHECK, Verdict::Fail, why),
    }
}
