//! GPU sharing asked for by a DRA claim's parameters (ABI 1.3), turned into the container's
//! environment. A claim or its DeviceClass passes, for the driver's DRA driver name:
//!
//! ```json
//! {"sharing": {"strategy": "MPS", "mps": {"activeThreadPercentage": 50, "pinnedMemoryLimit": "10Gi"}}}
//! ```
//!
//! `strategy` is `Exclusive` (the default: nothing added) or `MPS`: the CUDA MPS client settings
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (1 to 100) and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (a
//! limit per device, as the container numbers them: `0=10240M,1=10240M`), each optional. The
//! MPS control daemon itself is the node's (NVIDIA's `nvidia-cuda-mps-control`), as are its pipe
//! and log folders. `TimeSlicing` is refused: the time slice is a GPU-wide setting
//! (`nvidia-smi compute-policy`), not one claim's. Later entries override earlier ones (the
//! claim's over its class's); anything unknown or out of range is refused with a message that
//! names it, which fails the claim's NodePrepareResources.

use serde_json::{Map, Value};

/// What a claim's parameters ask for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Sharing {
    /// `Some` with the MPS strategy.
    pub mps: Option<Mps>,
}

/// The MPS client settings of a claim.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Mps {
    pub active_thread_percentage: Option<u32>,
    pub pinned_memory_limit_mib: Option<u64>,
}

/// Reads the JSON array the host hands allocate. An error says what is wrong.
pub fn parse(json: &str) -> Result<Sharing, String> {
    let entries: Vec<Map<String, Value>> =
        serde_json::from_str(json).map_err(|e| format!("claim parameters are not a list of objects: {e}"))?;
    let mut sharing = Sharing::default();
    for entry in &entries {
        for (key, value) in entry {
            match key.as_str() {
                "sharing" => sharing = parse_sharing(value)?,
                other => return Err(format!("unknown parameter {other:?}; the nvidia driver takes \"sharing\"")),
            }
        }
    }
    Ok(sharing)
}

fn parse_sharing(value: &Value) -> Result<Sharing, String> {
    let object = value.as_object().ok_or("sharing must be an object")?;
    only(object, "sharing", &["strategy", "mps"])?;
    let strategy = match object.get("strategy") {
        None => "Exclusive",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(format!("sharing.strategy must be a string, not {other}")),
    };
    match strategy {
        "Exclusive" if object.contains_key("mps") => Err("sharing.mps needs strategy \"MPS\"".to_owned()),
        "Exclusive" => Ok(Sharing::default()),
        "MPS" => Ok(Sharing { mps: Some(parse_mps(object.get("mps"))?) }),
        "TimeSlicing" => Err("sharing.strategy TimeSlicing is not a claim's to set: the time slice is a GPU-wide \
                              setting (nvidia-smi compute-policy); use MPS, or share one claim"
            .to_owned()),
        other => Err(format!("unknown sharing.strategy {other:?}; expected \"Exclusive\" or \"MPS\"")),
    }
}

fn parse_mps(value: Option<&Value>) -> Result<Mps, String> {
    let Some(value) = value else { return Ok(Mps::default()) };
    let object = value.as_object().ok_or("sharing.mps must be an object")?;
    only(object, "sharing.mps", &["activeThreadPercentage", "pinnedMemoryLimit"])?;
    let active_thread_percentage = match object.get("activeThreadPercentage") {
        None => None,
        Some(v) => match v.as_u64() {
            Some(n @ 1..=100) => Some(n as u32),
            _ => {
                return Err(format!(
                    "sharing.mps.activeThreadPercentage must be a whole number from 1 to 100, not {v}"
                ));
            }
        },
    };
    let pinned_memory_limit_mib = match object.get("pinnedMemoryLimit") {
        None => None,
        Some(v) => Some(mebibytes(v).ok_or_else(|| {
            format!("sharing.mps.pinnedMemoryLimit must be a size such as \"512Mi\" or \"10Gi\" (or MiB as a number), not {v}")
        })?),
    };
    Ok(Mps { active_thread_percentage, pinned_memory_limit_mib })
}

/// Refuses keys of `object` outside `known`.
fn only(object: &Map<String, Value>, at: &str, known: &[&str]) -> Result<(), String> {
    match object.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(format!("unknown key {at}.{k}; expected {}", known.join(", "))),
        None => Ok(()),
    }
}

/// A size in MiB: a positive number of MiB, or a string with the unit `Mi` or `Gi`.
fn mebibytes(v: &Value) -> Option<u64> {
    let n = match v {
        Value::Number(n) => n.as_u64()?,
        Value::String(s) => {
            let (digits, factor) = match (s.strip_suffix("Gi"), s.strip_suffix("Mi")) {
                (Some(d), _) => (d, 1024),
                (_, Some(d)) => (d, 1),
                _ => return None,
            };
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            digits.parse::<u64>().ok()?.checked_mul(factor)?
        }
        _ => return None,
    };
    (n > 0).then_some(n)
}

/// The environment for `sharing` in a container given devices with `memory_mib` each (in the
/// container's order), or why the devices cannot honour it.
pub fn env(sharing: &Sharing, ids: &[&str], memory_mib: &[Option<u64>]) -> Result<Vec<(String, String)>, String> {
    let Some(mps) = &sharing.mps else { return Ok(Vec::new()) };
    let mut env = Vec::new();
    if let Some(p) = mps.active_thread_percentage {
        env.push(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_owned(), p.to_string()));
    }
    if let Some(limit) = mps.pinned_memory_limit_mib {
        for (id, memory) in ids.iter().zip(memory_mib) {
            if let Some(total) = memory
                && limit > *total
            {
                return Err(format!(
                    "sharing.mps.pinnedMemoryLimit of {limit} MiB is more than device {id} has ({total} MiB)"
                ));
            }
        }
        let per_device: Vec<String> = (0..ids.len()).map(|i| format!("{i}={limit}M")).collect();
        env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_owned(), per_device.join(",")));
    }
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mps_settings_become_the_clients_env_and_later_entries_win() {
        let json = r#"[{"sharing":{"strategy":"Exclusive"}},{"sharing":{"mps":{"activeThreadPercentage":50,"pinnedMemoryLimit":"10Gi"},"strategy":"MPS"}}]"#;
        let sharing = parse(json).unwrap();
        assert_eq!(sharing.mps, Some(Mps { active_thread_percentage: Some(50), pinned_memory_limit_mib: Some(10240) }));
        let env = env(&sharing, &["GPU-a", "GPU-b"], &[Some(81559), Some(81559)]).unwrap();
        assert_eq!(
            env,
            [
                ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".to_owned(), "50".to_owned()),
                ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".to_owned(), "0=10240M,1=10240M".to_owned())
            ]
        );
        assert_eq!(parse("[]").unwrap(), Sharing::default());
        assert_eq!(parse(r#"[{"sharing":{"strategy":"MPS"}}]"#).unwrap().mps, Some(Mps::default()));
        assert_eq!(
            parse(r#"[{"sharing":{"mps":{"pinnedMemoryLimit":512},"strategy":"MPS"}}]"#)
                .unwrap()
                .mps
                .unwrap()
                .pinned_memory_limit_mib,
            Some(512)
        );
        assert!(super::env(&Sharing::default(), &["GPU-a"], &[None]).unwrap().is_empty(), "exclusive adds nothing");
    }

    #[test]
    fn bad_parameters_are_refused_naming_what_is_wrong() {
        let error = |json: &str| parse(json).unwrap_err();
        assert!(error(r#"[{"shareing":{}}]"#).contains(r#"unknown parameter "shareing""#));
        assert!(error(r#"[{"sharing":{"strategy":"TimeSlicing"}}]"#).contains("GPU-wide setting"));
        assert!(error(r#"[{"sharing":{"strategy":"Spatial"}}]"#).contains(r#"unknown sharing.strategy "Spatial""#));
        assert!(error(r#"[{"sharing":{"mps":{},"strategy":"Exclusive"}}]"#).contains("needs strategy \"MPS\""));
        assert!(
            error(r#"[{"sharing":{"mps":{"activeThreadPercentage":0},"strategy":"MPS"}}]"#).contains("from 1 to 100")
        );
        assert!(error(r#"[{"sharing":{"mps":{"pinnedMemoryLimit":"10GB"},"strategy":"MPS"}}]"#).contains("\"10Gi\""));
        assert!(
            error(r#"[{"sharing":{"mps":{"threads":1},"strategy":"MPS"}}]"#)
                .contains("unknown key sharing.mps.threads")
        );
        assert!(error(r#"{"sharing":{}}"#).contains("not a list of objects"));
        let big = parse(r#"[{"sharing":{"mps":{"pinnedMemoryLimit":"100Gi"},"strategy":"MPS"}}]"#).unwrap();
        let too_much = env(&big, &["GPU-a"], &[Some(81559)]).unwrap_err();
        assert_eq!(too_much, "sharing.mps.pinnedMemoryLimit of 102400 MiB is more than device GPU-a has (81559 MiB)");
    }
}
