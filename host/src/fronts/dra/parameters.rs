//! Vendor parameters of a claim: the opaque configuration (`config[].opaque`) a DeviceClass or a
//! ResourceClaim carries for a DRA driver, as the allocation result lists it
//! (`status.allocation.devices.config`). The driver's allocate hook reads them through the ABI
//! 1.3 `claim_parameters` callback as one JSON array: the `parameters` object of every entry for
//! this driver that applies to the claim's requests served here, the class's entries first, then
//! the claim's, each in its listed order; compact, with object keys sorted, so that a driver in C
//! can read it without a full JSON parser.

use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use serde_json::{Map, Value};

use crate::driver::loader::ModuleInfo;

/// The most bytes of parameters one claim hands a driver (the API allows 10 KiB per entry).
pub const MAX_BYTES: usize = 64 << 10;

/// One opaque configuration entry of an allocation.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `source: FromClass` (the DeviceClass's), else the claim's own.
    pub from_class: bool,
    /// The requests it applies to; empty: every request.
    pub requests: Vec<String>,
    pub driver: String,
    pub parameters: Value,
}

/// The opaque entries of an allocation's configuration (entries without `opaque` are for other
/// kinds of configuration and are skipped).
pub fn from_allocation(config: &[DeviceAllocationConfiguration]) -> Vec<Config> {
    config
        .iter()
        .filter_map(|c| {
            let opaque = c.opaque.as_ref()?;
            Some(Config {
                from_class: c.source == "FromClass",
                requests: c.requests.clone().unwrap_or_default(),
                driver: opaque.driver.clone(),
                parameters: opaque.parameters.0.clone(),
            })
        })
        .collect()
}

/// The JSON array of `driver`'s parameters for a claim whose devices of this driver were
/// allocated for `requests` (`request` or `request/subrequest`). The error says which entry is
/// not usable and why.
pub fn for_driver(driver: &str, configs: &[Config], requests: &[String]) -> Result<String, String> {
    let applies =
        |c: &&Config| c.driver == driver && (c.requests.is_empty() || c.requests.iter().any(|r| serves(r, requests)));
    let ordered = configs.iter().filter(|c| c.from_class).chain(configs.iter().filter(|c| !c.from_class));
    let mut out = Vec::new();
    for (i, config) in ordered.filter(applies).enumerate() {
        let Value::Object(_) = &config.parameters else {
            let source = if config.from_class { "the DeviceClass" } else { "the claim" };
            return Err(format!(
                "opaque config entry {i} for driver {driver} (from {source}): parameters must be a JSON object, not {}",
                kind(&config.parameters)
            ));
        };
        out.push(sorted(&config.parameters));
    }
    let text = Value::Array(out).to_string();
    if text.len() > MAX_BYTES {
        return Err(format!(
            "the opaque config for driver {driver} is {} bytes, more than the {MAX_BYTES} a driver is handed",
            text.len()
        ));
    }
    Ok(text)
}

/// Refuses `parameters` (not `[]`) for a driver module that does not read them: preparing the
/// claim as if they were not there would hand out devices without what the claim asked for.
pub fn check_reader(driver: &str, module: &ModuleInfo, parameters: &str) -> Result<(), String> {
    if parameters == "[]" || module.reads_claim_parameters() {
        return Ok(());
    }
    Err(format!(
        "it has opaque config for driver {driver}, but driver module {} (ABI {}.{}) does not read claim \
         parameters (that needs an allocate hook that declares DEVHOST_CAP_CLAIM_PARAMETERS, ABI 1.3)",
        module.name, module.abi_major, module.abi_minor,
    ))
}

/// Whether a config naming request `named` applies to one of `requests`: the same request, or
/// a subrequest of it.
fn serves(named: &str, requests: &[String]) -> bool {
    requests.iter().any(|r| r == named || r.strip_prefix(named).is_some_and(|rest| rest.starts_with('/')))
}

/// `value` with every object's keys in sorted order.
fn sorted(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            Value::Object(keys.into_iter().map(|k| (k.clone(), sorted(&map[k]))).collect::<Map<_, _>>())
        }
        Value::Array(items) => Value::Array(items.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(from_class: bool, requests: &[&str], driver: &str, parameters: Value) -> Config {
        Config {
            from_class,
            requests: requests.iter().map(|r| r.to_string()).collect(),
            driver: driver.into(),
            parameters,
        }
    }

    #[test]
    fn the_class_entries_come_first_then_the_claims_each_for_this_driver_and_its_requests() {
        let configs = [
            config(false, &[], "gpu.example.com", json!({"z": 1, "a": {"y": true, "b": [{"d": 1, "c": 2}]}})),
            config(true, &["gpu"], "gpu.example.com", json!({"from": "class"})),
            config(false, &["other"], "gpu.example.com", json!({"not": "this request"})),
            config(false, &[], "other.example.com", json!({"not": "this driver"})),
            config(false, &["gpu"], "gpu.example.com", json!({"last": 1})),
        ];
        let got = for_driver("gpu.example.com", &configs, &["gpu/big".into()]).unwrap();
        assert_eq!(got, r#"[{"from":"class"},{"a":{"b":[{"c":2,"d":1}],"y":true},"z":1},{"last":1}]"#);
        assert_eq!(for_driver("gpu.example.com", &[], &["gpu".into()]).unwrap(), "[]");
        assert!(!serves("gp", &["gpu".into()]) && serves("gpu", &["gpu".into()]) && serves("gpu", &["gpu/a".into()]));
    }

    #[test]
    fn parameters_that_are_not_an_object_or_too_large_are_refused_by_entry() {
        let configs = [config(true, &[], "d", json!({})), config(false, &[], "d", json!([1]))];
        let error = for_driver("d", &configs, &[]).unwrap_err();
        assert_eq!(
            error,
            "opaque config entry 1 for driver d (from the claim): parameters must be a JSON object, not an array"
        );
        let big = config(false, &[], "d", json!({"x": "y".repeat(MAX_BYTES)}));
        assert!(for_driver("d", &[big], &[]).unwrap_err().contains("more than the 65536 a driver is handed"));
    }

    #[test]
    fn parameters_for_a_module_that_does_not_read_them_are_refused_naming_it() {
        let frozen = ModuleInfo {
            name: "compat-v1.2".into(),
            abi_major: 1,
            abi_minor: 2,
            allocate: true,
            ..ModuleInfo::default()
        };
        assert_eq!(check_reader("d", &frozen, "[]"), Ok(()), "a claim without parameters prepares as before");
        let error = check_reader("d", &frozen, r#"[{"a":1}]"#).unwrap_err();
        assert!(error.contains("driver module compat-v1.2 (ABI 1.2) does not read claim parameters"), "{error}");
        let reader = ModuleInfo { abi_minor: 3, claim_parameters: true, ..frozen.clone() };
        assert_eq!(check_reader("d", &reader, r#"[{"a":1}]"#), Ok(()));
        let no_hook = ModuleInfo { allocate: false, ..reader };
        assert!(check_reader("d", &no_hook, r#"[{"a":1}]"#).is_err(), "the bit without an allocate hook reads nothing");
    }
}
