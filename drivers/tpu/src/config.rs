//! The driver's options, parsed and checked once in `create` so that a typo stops the host at
//! start-up with a message naming the option, not at the first allocation.

use crate::discover::Roots;
use devhost_sdk::{Error, Options, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Every option the driver accepts.
pub const OPTIONS: &[&str] = &[
    "sysfs_root",
    "devfs_root",
    "allocation",
    "poll_interval",
    "topology",
    "accelerator_type",
    "worker_id",
    "worker_hostnames",
    "metrics_port_base",
    "process_port_base",
];

/// How chips are shared between containers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// A container gets every chip of the host (GKE's behaviour).
    WholeHost,
    /// A container gets a box of 1, 2, 4 or 8 chips.
    Boxes,
}

impl Policy {
    /// The option value naming the policy.
    pub fn name(self) -> &'static str {
        match self {
            Policy::WholeHost => "whole-host",
            Policy::Boxes => "boxes",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub roots: Roots,
    pub policy: Policy,
    /// `None`: no poll thread.
    pub poll_interval: Option<Duration>,
    /// Slice topology for multi-host slices (`4x4x8`); `None`: the allocation's own shape.
    pub topology: Option<Vec<u32>>,
    pub accelerator_type: Option<String>,
    pub worker_id: u32,
    /// `None`: `localhost` (single host).
    pub worker_hostnames: Option<Vec<String>>,
    pub metrics_port_base: u16,
    pub process_port_base: u16,
}

impl Config {
    pub fn from_options(options: &Options) -> Result<Config> {
        options.deny_unknown(OPTIONS)?;
        let policy = match options.get_or("allocation", "whole-host").trim() {
            "whole-host" => Policy::WholeHost,
            "boxes" => Policy::Boxes,
            other => {
                return Err(Error::invalid_argument(format!(
                    "option \"allocation\": {other:?} is not a policy; use \"whole-host\" or \"boxes\""
                )));
            }
        };
        let topology = options.get("topology").map(parse_topology).transpose()?;
        let worker_hostnames = options.list("worker_hostnames");
        let worker_id: u32 = options.parse_or("worker_id", 0)?;
        if let Some(hosts) = &worker_hostnames {
            if hosts.is_empty() {
                return Err(Error::invalid_argument("option \"worker_hostnames\" is empty"));
            }
            if worker_id as usize >= hosts.len() {
                return Err(Error::invalid_argument(format!(
                    "option \"worker_id\" is {worker_id}, but \"worker_hostnames\" lists only {} host(s)",
                    hosts.len()
                )));
            }
        }
        let multi_host = topology.is_some() || worker_id != 0 || worker_hostnames.as_ref().is_some_and(|h| h.len() > 1);
        if policy == Policy::Boxes && multi_host {
            return Err(Error::invalid_argument(
                "options \"topology\", \"worker_id\" and \"worker_hostnames\" describe a multi-host slice, \
                 which takes whole hosts; they need allocation = \"whole-host\"",
            ));
        }
        let accelerator_type = match options.get("accelerator_type").map(str::trim) {
            Some("") => {
                return Err(Error::invalid_argument("option \"accelerator_type\" is empty"));
            }
            other => other.map(str::to_string),
        };
        Ok(Config {
            roots: Roots {
                sysfs: absolute("sysfs_root", options.get_or("sysfs_root", "/sys"))?,
                devfs: absolute("devfs_root", options.get_or("devfs_root", "/dev"))?,
            },
            policy,
            poll_interval: parse_interval(options.get_or("poll_interval", "5s"))?,
            topology,
            accelerator_type,
            worker_id,
            worker_hostnames,
            metrics_port_base: port(options, "metrics_port_base", 8431)?,
            process_port_base: port(options, "process_port_base", 8476)?,
        })
    }
}

/// Device specs need absolute host paths; a relative root (the demo's) is taken from the host's
/// working directory.
fn absolute(key: &str, value: &str) -> Result<PathBuf> {
    std::path::absolute(Path::new(value))
        .map_err(|e| Error::invalid_argument(format!("option \"{key}\": {value:?} is not a usable path: {e}")))
}

fn port(options: &Options, key: &str, default: u16) -> Result<u16> {
    match options.parse_or(key, default)? {
        0 => Err(Error::invalid_argument(format!("option \"{key}\": port 0 is not allowed"))),
        p => Ok(p),
    }
}

/// `4x4x8` or `2x4`: two or three positive dimensions.
fn parse_topology(text: &str) -> Result<Vec<u32>> {
    let bad = || {
        Error::invalid_argument(format!(
            "option \"topology\": {text:?} is not a topology; write two or three positive numbers joined by 'x', e.g. \"2x4\" or \"4x4x8\""
        ))
    };
    let dims: Vec<u32> = text.trim().split('x').map(|d| d.parse::<u32>().map_err(|_| bad())).collect::<Result<_>>()?;
    if !(2..=3).contains(&dims.len()) || dims.contains(&0) {
        return Err(bad());
    }
    Ok(dims)
}

/// `5s`, `500ms`, `1m`, or a bare number of seconds; `0` or `off` disables polling.
fn parse_interval(text: &str) -> Result<Option<Duration>> {
    let text = text.trim();
    if text == "0" || text == "off" {
        return Ok(None);
    }
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let bad = || {
        Error::invalid_argument(format!(
            "option \"poll_interval\": {text:?} is not a duration; write e.g. \"5s\", \"500ms\", \"1m\", or \"off\""
        ))
    };
    let amount: u64 = digits.parse().map_err(|_| bad())?;
    let duration = match unit {
        "" | "s" => Duration::from_secs(amount),
        "ms" => Duration::from_millis(amount),
        "m" => Duration::from_secs(amount.checked_mul(60).ok_or_else(bad)?),
        _ => return Err(bad()),
    };
    Ok(if duration.is_zero() { None } else { Some(duration) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pairs: &[(&str, &str)]) -> Result<Config> {
        Config::from_options(&Options::new(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()))
    }

    #[test]
    fn defaults_match_the_docs() {
        let c = config(&[]).unwrap();
        assert_eq!(c.roots, Roots { sysfs: "/sys".into(), devfs: "/dev".into() });
        assert_eq!(c.policy, Policy::WholeHost);
        assert_eq!(c.poll_interval, Some(Duration::from_secs(5)));
        assert_eq!((c.metrics_port_base, c.process_port_base, c.worker_id), (8431, 8476, 0));
        assert_eq!((c.topology, c.worker_hostnames, c.accelerator_type), (None, None, None));
    }

    #[test]
    fn values_parse() {
        let c = config(&[
            ("topology", "4x4x8"),
            ("worker_id", "3"),
            ("worker_hostnames", "a,b,c,d"),
            ("poll_interval", "250ms"),
            ("sysfs_root", "config/sim/tpu/sys"),
        ])
        .unwrap();
        assert_eq!(c.topology, Some(vec![4, 4, 8]));
        assert_eq!(c.worker_hostnames.unwrap().len(), 4);
        assert_eq!(c.poll_interval, Some(Duration::from_millis(250)));
        assert!(c.roots.sysfs.is_absolute() && c.roots.sysfs.ends_with("config/sim/tpu/sys"));
        assert_eq!(config(&[("poll_interval", "off")]).unwrap().poll_interval, None);
        assert_eq!(config(&[("poll_interval", "2")]).unwrap().poll_interval, Some(Duration::from_secs(2)));
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("allocation", "shared")], "\"allocation\""),
            (&[("topology", "4x0")], "\"topology\""),
            (&[("topology", "8")], "\"topology\""),
            (&[("poll_interval", "5h")], "\"poll_interval\""),
            (&[("worker_id", "2"), ("worker_hostnames", "a,b")], "\"worker_id\""),
            (&[("allocation", "boxes"), ("topology", "4x4")], "whole-host"),
            (&[("metrics_port_base", "0")], "\"metrics_port_base\""),
            (&[("bogus", "1")], "\"bogus\""),
        ];
        for (pairs, needle) in cases {
            let e = config(pairs).unwrap_err();
            assert!(e.message.contains(needle), "{pairs:?}: {e}");
        }
    }
}
