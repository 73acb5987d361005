//! The driver's options, parsed and checked once in `create`.

use crate::devices::Mode;
use crate::discover::Scope;
use crate::sysfs::Roots;
use crate::xrt::normalize_vendor;
use devhost_sdk::{Error, Options, Result};
use std::path::PathBuf;
use std::time::Duration;

pub const KNOWN: &[&str] = &["mode", "sysfs_root", "devfs_root", "poll_interval", "udev", "xrt_vendors"];

/// Rescans for health changes (which raise no uevent) this often by default:
/// an error shows within a second, for about 0.1 ms of CPU per round.
pub const DEFAULT_POLL: Duration = Duration::from_secs(1);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub roots: Roots,
    pub mode: Mode,
    pub scope: Scope,
    /// `None` when polling is switched off (`poll_interval = "0"`).
    pub poll_interval: Option<Duration>,
    /// Try the udev kernel monitor for hot-plug.
    pub udev: bool,
}

impl Config {
    pub fn from_options(options: &Options) -> Result<Config> {
        options.deny_unknown(KNOWN)?;
        let mode_text = options.get_or("mode", "port");
        let mode = Mode::parse(mode_text).ok_or_else(|| {
            Error::invalid_argument(format!("option \"mode\": {mode_text:?} is not one of port, region, region-devel"))
        })?;
        let poll = match options.get("poll_interval") {
            None => DEFAULT_POLL,
            Some(text) => parse_duration(text).ok_or_else(|| {
                Error::invalid_argument(format!(
                    "option \"poll_interval\": {text:?} is not a duration (e.g. \"5s\", \"500ms\", \"1m\", \"0\" to disable)"
                ))
            })?,
        };
        let mut scope = Scope::default();
        if let Some(vendors) = options.list("xrt_vendors") {
            if let Some(bad) = vendors.iter().find(|v| !is_vendor_id(v)) {
                return Err(Error::invalid_argument(format!(
                    "option \"xrt_vendors\": {bad:?} is not a PCI vendor ID (e.g. \"0x10ee\")"
                )));
            }
            scope.xrt_vendors = vendors.iter().map(|v| normalize_vendor(v)).collect();
        }
        let root = |key: &str, default: &str| -> Result<PathBuf> {
            let v = options.get_or(key, default).trim();
            if v.is_empty() {
                return Err(Error::invalid_argument(format!("option \"{key}\" is empty")));
            }
            // Device specs need absolute host paths; a relative root (the
            // demo's) is taken from the host's working folder.
            std::path::absolute(v)
                .map_err(|e| Error::invalid_argument(format!("option \"{key}\": cannot make {v:?} absolute: {e}")))
        };
        Ok(Config {
            roots: Roots { sys: root("sysfs_root", "/sys")?, dev: root("devfs_root", "/dev")? },
            mode,
            scope,
            poll_interval: (!poll.is_zero()).then_some(poll),
            udev: options.bool_or("udev", true)?,
        })
    }
}

fn is_vendor_id(v: &str) -> bool {
    let hex = v.trim().trim_start_matches("0x").trim_start_matches("0X");
    hex.len() == 4 && hex.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `"5s"`, `"500ms"`, `"2m"`, or a bare number of seconds.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let t = text.trim();
    let (num, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let n: u64 = num.parse().ok()?;
    match unit.trim() {
        "" | "s" => Some(Duration::from_secs(n)),
        "ms" => Some(Duration::from_millis(n)),
        "m" => n.checked_mul(60).map(Duration::from_secs),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(p: &[(&str, &str)]) -> Options {
        Options::new(p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn defaults_follow_the_docs() {
        let c = Config::from_options(&opts(&[])).unwrap();
        assert_eq!(c.roots, Roots { sys: "/sys".into(), dev: "/dev".into() });
        assert_eq!(c.mode, Mode::Port);
        assert_eq!(c.poll_interval, Some(DEFAULT_POLL));
        assert!(c.udev);
        assert_eq!(c.scope, Scope::default());
    }

    #[test]
    fn bad_values_name_the_option() {
        for (k, v) in [("mode", "af"), ("poll_interval", "soon"), ("xrt_vendors", "xilinx"), ("udev", "maybe")] {
            let e = Config::from_options(&opts(&[(k, v)])).unwrap_err();
            assert!(e.message.contains(k), "{e}");
        }
        let e = Config::from_options(&opts(&[("sysfs", "/x")])).unwrap_err();
        assert!(e.message.contains("\"sysfs\""), "{e}");
    }

    #[test]
    fn options_are_applied() {
        let c = Config::from_options(&opts(&[
            ("mode", "region-devel"),
            ("sysfs_root", "config/sim/fpga/sys"),
            ("poll_interval", "0"),
            ("udev", "false"),
            ("xrt_vendors", "10EE,0x1d0f"),
        ]))
        .unwrap();
        assert_eq!(c.mode, Mode::RegionDevel);
        assert!(c.roots.sys.is_absolute() && c.roots.sys.ends_with("config/sim/fpga/sys"), "{:?}", c.roots.sys);
        assert_eq!(c.poll_interval, None);
        assert!(!c.udev);
        assert_eq!(c.scope.xrt_vendors, ["0x10ee", "0x1d0f"]);
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("7"), Some(Duration::from_secs(7)));
        assert_eq!(parse_duration("1h"), None);
        assert_eq!(parse_duration(""), None);
    }
}
