//! A minimal devhost driver written with the Rust SDK, the template for
//! Rust vendors: `count` fake accelerators, paired two by two, each handed
//! out as `/dev/null` under a per-device name plus an environment variable.
//! A DRA claim may pass `{"greeting": "<text>"}` as its opaque parameters
//! (ABI 1.3): the container then gets `REX_GREETING`; anything else refuses the
//! claim. No `unsafe` anywhere: the SDK owns the C boundary.

#![deny(unsafe_code)]

use devhost_sdk::{Driver, Edits, Error, Health, Hooks, Host, Options, Result, Scan};

struct Example {
    count: u32,
    prefix: String,
}

impl Driver for Example {
    const HOOKS: Hooks = Hooks { allocate: true, ..Hooks::NONE };
    const READS_CLAIM_PARAMETERS: bool = true;

    fn create(_host: Host, options: &Options) -> Result<Self> {
        options.deny_unknown(&["count", "prefix"])?;
        let count = options.parse_or("count", 2u32)?;
        let prefix = options.get_or("prefix", "rex").to_string();
        log::info!("example-rust: {count} device(s) named {prefix}-N");
        Ok(Example { count, prefix })
    }

    fn scan(&self, scan: &mut Scan<'_>) -> Result<()> {
        for i in 0..self.count {
            let id = format!("{}-{i}", self.prefix);
            let partner = format!("{}-{}", self.prefix, i ^ 1);
            let mut dev = scan.device(&id, Health::Healthy, Some(0));
            dev.attr("model", "example-rust-v1")
                .attr("index", &i.to_string())
                .device_node("/dev/null", &format!("/dev/rex{i}"), "rw")
                .env("REX_VISIBLE_DEVICES", &id);
            if i ^ 1 < self.count {
                dev.link(&partner, 10);
            }
        }
        Ok(())
    }

    fn allocate(&self, device_ids: &[&str], edits: &mut Edits<'_>) -> Result<()> {
        // Validate before adding anything: a refusal leaves the claim unprepared.
        let greeting = match edits.claim_parameters() {
            Some(json) => greeting(json)?,
            None => None, // a device-plugin container, or a host older than ABI 1.3
        };
        edits.env("REX_ALLOCATED_COUNT", &device_ids.len().to_string());
        if let Some(greeting) = greeting {
            edits.env("REX_GREETING", &greeting);
        }
        Ok(())
    }
}

/// The greeting a claim's parameters ask for (the last entry that sets one wins), or an error
/// naming what is wrong.
fn greeting(json: &str) -> Result<Option<String>> {
    let entries: Vec<serde_json::Map<String, serde_json::Value>> = serde_json::from_str(json)
        .map_err(|e| Error::invalid_argument(format!("claim parameters are not a list of objects: {e}")))?;
    let mut greeting = None;
    for entry in entries {
        for (key, value) in entry {
            match (key.as_str(), value) {
                ("greeting", serde_json::Value::String(text)) if (1..=64).contains(&text.len()) => {
                    greeting = Some(text);
                }
                ("greeting", other) => {
                    return Err(Error::invalid_argument(format!(
                        "parameter greeting must be a string of 1 to 64 bytes, not {other}"
                    )));
                }
                (other, _) => {
                    return Err(Error::invalid_argument(format!(
                        "unknown parameter {other:?}; example-rust takes only \"greeting\""
                    )));
                }
            }
        }
    }
    Ok(greeting)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_last_greeting_wins_and_anything_else_is_refused_by_name() {
        assert_eq!(super::greeting("[]").unwrap(), None);
        assert_eq!(super::greeting(r#"[{"greeting":"hi"},{"greeting":"ho"}]"#).unwrap().as_deref(), Some("ho"));
        let unknown = super::greeting(r#"[{"colour":"red"}]"#).unwrap_err().to_string();
        assert!(unknown.contains(r#"unknown parameter "colour""#), "{unknown}");
        let long = format!(r#"[{{"greeting":"{}"}}]"#, "x".repeat(65));
        assert!(super::greeting(&long).unwrap_err().to_string().contains("1 to 64 bytes"));
        assert!(super::greeting("{}").unwrap_err().to_string().contains("not a list of objects"));
    }
}

devhost_sdk::export_driver!(
    Example,
    name = "example-rust",
    version = env!("CARGO_PKG_VERSION"),
    description = "Fake accelerators from the Rust SDK template"
);
