//! The driver's options (the manifest's `[driver.X.options]`), parsed and
//! checked once in `create`. Every option is documented in
//! `docs/drivers/nvidia.md`.

use devhost_sdk::{Error, Options, Result};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

/// Every option this driver understands.
pub const KNOWN_OPTIONS: &[&str] = &[
    "nvml_lib",
    "sysfs_root",
    "devfs_root",
    "driver_root",
    "device_id_strategy",
    "device_list_strategy",
    "cdi_kind",
    "ignored_xids",
    "recovery_period",
    "health_without_events",
    "health_check_interval",
];

/// Xids that an application causes, not the GPU: a fault in one container
/// must not take the GPU away from everyone (NVIDIA's plugin ignores the same).
pub const DEFAULT_IGNORED_XIDS: &[u64] = &[13, 31, 43, 45, 68, 109];
pub const DEFAULT_RECOVERY_PERIOD: Duration = Duration::from_secs(60);
/// How often each Healthy GPU answers one cheap NVML question, so that a GPU
/// lost without an event is noticed: a few microseconds per GPU per second.
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// How a device is named to the container runtime (`NVIDIA_VISIBLE_DEVICES`
/// and CDI names). The device ID the kubelet sees is always the UUID.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdStrategy {
    Uuid,
    Index,
}

/// Which container edits a device carries; several may be combined.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ListStrategies {
    pub envvar: bool,
    pub device_nodes: bool,
    pub cdi: bool,
}

impl ListStrategies {
    /// Whether devices carry their nodes and the driver's files: `device-nodes` hands them out,
    /// `cdi` has devhost define its CDI names by them.
    pub fn describes_nodes(&self) -> bool {
        self.device_nodes || self.cdi
    }
}

/// The health of a GPU the driver cannot watch for Xid events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WithoutEvents {
    Unhealthy,
    Healthy,
}

/// Health-checking settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthConfig {
    pub ignored_xids: BTreeSet<u64>,
    /// `None`: an Unhealthy GPU stays Unhealthy until the daemon restarts.
    pub recovery_period: Option<Duration>,
    pub without_events: WithoutEvents,
    /// `None`: no periodic check (only events and recovery probes ask NVML).
    pub check_interval: Option<Duration>,
}

/// All options of one driver instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub nvml_lib: String,
    pub sysfs_root: PathBuf,
    pub devfs_root: PathBuf,
    pub driver_root: PathBuf,
    pub id_strategy: IdStrategy,
    pub list: ListStrategies,
    pub cdi_kind: String,
    pub health: HealthConfig,
}

impl Config {
    /// Parses the options; errors name the option and the bad value.
    pub fn from_options(options: &Options) -> Result<Config> {
        options.deny_unknown(KNOWN_OPTIONS)?;
        let id_strategy = match options.get_or("device_id_strategy", "uuid").trim() {
            "uuid" => IdStrategy::Uuid,
            "index" => IdStrategy::Index,
            other => return Err(bad("device_id_strategy", other, "uuid or index")),
        };
        let mut list = ListStrategies::default();
        for name in options.list("device_list_strategy").unwrap_or_else(|| vec!["envvar".into()]) {
            match name.as_str() {
                "envvar" => list.envvar = true,
                "device-nodes" => list.device_nodes = true,
                "cdi" => list.cdi = true,
                other => return Err(bad("device_list_strategy", other, "envvar, device-nodes or cdi")),
            }
        }
        if list == ListStrategies::default() {
            return Err(bad("device_list_strategy", "", "at least one of envvar, device-nodes, cdi"));
        }
        let cdi_kind = options.get_or("cdi_kind", "nvidia.com/gpu").trim().to_string();
        let valid_kind = cdi_kind
            .split_once('/')
            .is_some_and(|(vendor, class)| vendor.contains('.') && !class.is_empty() && !cdi_kind.contains(['=', ' ']));
        if !valid_kind {
            return Err(bad("cdi_kind", &cdi_kind, "vendor.com/class, e.g. nvidia.com/gpu"));
        }
        let ignored_xids = match options.list("ignored_xids") {
            None => DEFAULT_IGNORED_XIDS.iter().copied().collect(),
            Some(items) => items
                .iter()
                .map(|x| x.parse::<u64>().map_err(|_| bad("ignored_xids", x, "a list of Xid numbers")))
                .collect::<Result<_>>()?,
        };
        let recovery_period = match options.get("recovery_period") {
            None => Some(DEFAULT_RECOVERY_PERIOD),
            Some(text) => parse_period(text).ok_or_else(|| {
                bad("recovery_period", text, "a duration like \"60s\", \"500ms\", \"2m\", or \"never\"")
            })?,
        };
        let without_events = match options.get_or("health_without_events", "unhealthy").trim() {
            "unhealthy" => WithoutEvents::Unhealthy,
            "healthy" => WithoutEvents::Healthy,
            other => return Err(bad("health_without_events", other, "unhealthy or healthy")),
        };
        let check_interval = match options.get("health_check_interval") {
            None => Some(DEFAULT_CHECK_INTERVAL),
            Some(text) => parse_period(text).filter(|p| p.is_none_or(|d| !d.is_zero())).ok_or_else(|| {
                bad("health_check_interval", text, "a duration like \"1s\", \"500ms\", \"1m\", or \"never\"")
            })?,
        };
        Ok(Config {
            nvml_lib: options.get_or("nvml_lib", "libnvidia-ml.so.1").to_string(),
            sysfs_root: PathBuf::from(options.get_or("sysfs_root", "/sys")),
            // Host paths handed to the kubelet must be absolute.
            devfs_root: absolute(options.get_or("devfs_root", "/dev")),
            driver_root: absolute(options.get_or("driver_root", "/")),
            id_strategy,
            list,
            cdi_kind,
            health: HealthConfig { ignored_xids, recovery_period, without_events, check_interval },
        })
    }
}

/// `path` made absolute against the working directory (no symlinks resolved).
fn absolute(path: &str) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| PathBuf::from(path))
}

fn bad(option: &str, value: &str, expected: &str) -> Error {
    Error::invalid_argument(format!("option \"{option}\": {value:?} is not valid; expected {expected}"))
}

/// A duration: `500ms`, `60s`, `2m`, `1h`, a bare number of seconds, or
/// `never`/`off` (recovery disabled, `Some(None)`). `None` when malformed.
pub fn parse_period(text: &str) -> Option<Option<Duration>> {
    let text = text.trim();
    if matches!(text, "never" | "off") {
        return Some(None);
    }
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().ok()?;
    let seconds = match unit.trim() {
        "ms" => number / 1000.0,
        "" | "s" => number,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        _ => return None,
    };
    Duration::try_from_secs_f64(seconds).ok().map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(pairs: &[(&str, &str)]) -> Options {
        Options::new(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn defaults_match_the_docs() {
        let c = Config::from_options(&opts(&[])).unwrap();
        assert_eq!(c.nvml_lib, "libnvidia-ml.so.1");
        assert_eq!(c.sysfs_root, PathBuf::from("/sys"));
        assert_eq!(c.devfs_root, PathBuf::from("/dev"));
        assert_eq!(c.driver_root, PathBuf::from("/"));
        assert_eq!(c.id_strategy, IdStrategy::Uuid);
        assert_eq!(c.list, ListStrategies { envvar: true, ..Default::default() });
        assert_eq!(c.health.ignored_xids.iter().copied().collect::<Vec<_>>(), vec![13, 31, 43, 45, 68, 109]);
        assert_eq!(c.health.recovery_period, Some(Duration::from_secs(60)));
        assert_eq!(c.health.without_events, WithoutEvents::Unhealthy);
        assert_eq!(c.health.check_interval, Some(Duration::from_secs(1)));
    }

    #[test]
    fn health_check_interval_takes_durations_or_never_but_not_zero() {
        let c = Config::from_options(&opts(&[("health_check_interval", "250ms")])).unwrap();
        assert_eq!(c.health.check_interval, Some(Duration::from_millis(250)));
        let c = Config::from_options(&opts(&[("health_check_interval", "never")])).unwrap();
        assert_eq!(c.health.check_interval, None);
        for bad in ["0", "0s", "often"] {
            let e = Config::from_options(&opts(&[("health_check_interval", bad)])).unwrap_err();
            assert!(e.message.contains("health_check_interval") && e.message.contains(bad), "{e}");
        }
    }

    #[test]
    fn strategies_combine_and_unknown_ones_are_named() {
        let c = Config::from_options(&opts(&[("device_list_strategy", "cdi,device-nodes")])).unwrap();
        assert_eq!(c.list, ListStrategies { envvar: false, device_nodes: true, cdi: true });
        let e = Config::from_options(&opts(&[("device_list_strategy", "volume-mounts")])).unwrap_err();
        assert!(e.message.contains("device_list_strategy") && e.message.contains("volume-mounts"), "{e}");
    }

    #[test]
    fn empty_ignored_xids_ignores_nothing_and_garbage_is_rejected() {
        let c = Config::from_options(&opts(&[("ignored_xids", "")])).unwrap();
        assert!(c.health.ignored_xids.is_empty());
        let e = Config::from_options(&opts(&[("ignored_xids", "13,x")])).unwrap_err();
        assert!(e.message.contains("ignored_xids") && e.message.contains("\"x\""), "{e}");
    }

    #[test]
    fn unknown_option_is_rejected() {
        let e = Config::from_options(&opts(&[("mig_strategy", "mixed")])).unwrap_err();
        assert!(e.message.contains("mig_strategy"), "{e}");
    }

    #[test]
    fn relative_host_roots_become_absolute() {
        let c = Config::from_options(&opts(&[("devfs_root", "sim/dev"), ("driver_root", "sim/driver")])).unwrap();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(c.devfs_root, cwd.join("sim/dev"));
        assert_eq!(c.driver_root, cwd.join("sim/driver"));
    }

    #[test]
    fn bad_cdi_kind_is_rejected() {
        assert!(Config::from_options(&opts(&[("cdi_kind", "gpu")])).is_err());
        assert!(Config::from_options(&opts(&[("cdi_kind", "example.com/gpu")])).is_ok());
    }

    #[test]
    fn periods_parse_in_common_units() {
        assert_eq!(parse_period("60s"), Some(Some(Duration::from_secs(60))));
        assert_eq!(parse_period("250ms"), Some(Some(Duration::from_millis(250))));
        assert_eq!(parse_period("2m"), Some(Some(Duration::from_secs(120))));
        assert_eq!(parse_period("30"), Some(Some(Duration::from_secs(30))));
        assert_eq!(parse_period("never"), Some(None));
        assert_eq!(parse_period("soon"), None);
        assert_eq!(parse_period("5 parsecs"), None);
    }
}
