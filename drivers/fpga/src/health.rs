//! Health signals read from sysfs. Each check returns problems: sentences for
//! the operator's log; a device with any problem is reported Unhealthy, and
//! Healthy again as soon as the next scan finds none.

use crate::seen;
use crate::sysfs::{list, parse_u64, read_attr};
use std::path::Path;

/// Manager states that mean "usable". DFL's FME manager never reports a real
/// state (the kernel returns `unknown` for it until a partial
/// reconfiguration finishes), so `unknown` cannot count as a fault.
const GOOD_MANAGER_STATES: &[&str] = &["operating", "unknown"];

/// A hexadecimal identifier (`afu_id`, `compat_id`, `interface_id`), lower
/// case and without dashes, or a sentence saying why it is not one.
pub fn parse_id(text: &str, path: &Path) -> Result<String, String> {
    let id: String = text.trim().chars().filter(|&c| c != '-').collect::<String>().to_ascii_lowercase();
    let id = id.strip_prefix("0x").unwrap_or(&id).to_string();
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("{} holds {:?}, not a hexadecimal ID", path.display(), text.trim()));
    }
    Ok(id)
}

/// Reads an ID file. `Err` carries the problem (unreadable or garbage).
/// Watched: a reprogrammed or crashed FPGA changes it without a uevent.
pub fn read_id(path: &Path) -> Result<String, String> {
    parse_id(&seen::watched(|| read_attr(path))?, path)
}

/// The driver reports all-ones IDs when the FPGA's firmware has crashed.
pub fn all_ones(id: &str) -> bool {
    !id.is_empty() && id.bytes().all(|b| b == b'f')
}

/// Problems in the error registers under `<dir>/errors/`: any non-zero
/// `errors` or `*_errors` file (also one level down, where the out-of-tree
/// OPAE driver keeps `fme-errors/errors`). Injection controls are skipped.
/// No `errors` directory means the driver does not report errors: no problem.
pub fn error_registers(dir: &Path, who: &str) -> Vec<String> {
    seen::watched(|| error_registers_now(dir, who))
}

fn error_registers_now(dir: &Path, who: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let root = dir.join("errors");
    if !seen::is_dir(&root) {
        return problems;
    }
    let mut files = Vec::new();
    match list(&root, |_| true) {
        Ok(names) => {
            for name in names {
                let p = root.join(&name);
                if p.is_dir() {
                    match list(&p, |_| true) {
                        Ok(inner) => files.extend(inner.into_iter().map(|n| (format!("{name}/{n}"), p.join(n)))),
                        Err(e) => problems.push(format!("{who}: {e}")),
                    }
                } else {
                    files.push((name, p));
                }
            }
        }
        Err(e) => problems.push(format!("{who}: {e}")),
    }
    for (rel, path) in files {
        let leaf = rel.rsplit('/').next().unwrap_or(&rel);
        let is_register = (leaf == "errors" || leaf.ends_with("_errors")) && !leaf.starts_with("inject");
        if !is_register {
            continue;
        }
        match read_attr(&path) {
            Ok(text) => match parse_u64(&text) {
                Some(0) => {}
                Some(_) => problems.push(format!("{who} reports errors: errors/{rel} = {text}")),
                None => problems.push(format!("{who}: {} holds {text:?}, not an error register value", path.display())),
            },
            Err(e) => problems.push(format!("{who}: {e}")),
        }
    }
    problems
}

/// Problems of the FPGA managers under `dir` (DFL: `dfl-fme-mgr.*/fpga_manager/fpgaN`):
/// a `state` other than operating/unknown, or a non-empty `status` (the
/// kernel lists reconfiguration errors there). No manager: no problem.
pub fn managers(dir: &Path, who: &str) -> Vec<String> {
    seen::watched(|| managers_now(dir, who))
}

fn managers_now(dir: &Path, who: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mgr_devs = list(dir, |n| n.starts_with("dfl-fme-mgr.")).unwrap_or_default();
    for mgr_dev in mgr_devs {
        let class_dir = dir.join(&mgr_dev).join("fpga_manager");
        let managers = match list(&class_dir, |_| true) {
            Ok(m) => m,
            Err(e) => {
                problems.push(format!("{who}: {e}"));
                continue;
            }
        };
        for m in managers {
            let mdir = class_dir.join(&m);
            match read_attr(&mdir.join("state")) {
                Ok(state) if GOOD_MANAGER_STATES.contains(&state.as_str()) => {}
                Ok(state) => problems.push(format!("{who}: FPGA manager {m} is in state {state:?}, not operating")),
                Err(e) => problems.push(format!("{who}: {e}")),
            }
            // `status` appeared in kernel 4.19; older kernels simply lack it.
            if let Ok(status) = read_attr(&mdir.join("status"))
                && !status.is_empty()
            {
                problems.push(format!("{who}: FPGA manager {m} reports {:?}", status.replace('\n', "; ")));
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_normalised_and_garbage_is_named() {
        let p = Path::new("/sys/x/afu_id");
        assert_eq!(parse_id("D8424DC4-A4A3-C413-F89E-433683F9040B\n", p).unwrap(), "d8424dc4a4a3c413f89e433683f9040b");
        let e = parse_id("not-an-id", p).unwrap_err();
        assert!(e.contains("/sys/x/afu_id") && e.contains("not-an-id"), "{e}");
        assert!(parse_id("", p).is_err());
    }

    #[test]
    fn all_ones_means_crashed_firmware() {
        assert!(all_ones("ffffffffffffffffffffffffffffffff"));
        assert!(!all_ones("d8424dc4a4a3c413f89e433683f9040b"));
        assert!(!all_ones(""));
    }
}
