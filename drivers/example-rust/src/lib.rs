//! A minimal devhost driver written with the Rust SDK, the template for
//! Rust vendors: `count` fake accelerators, paired two by two, each handed
//! out as `/dev/null` under a per-device name plus an environment variable.
//! No `unsafe` anywhere: the SDK owns the C boundary.

#![deny(unsafe_code)]

use devhost_sdk::{Driver, Edits, Health, Hooks, Host, Options, Result, Scan};

struct Example {
    count: u32,
    prefix: String,
}

impl Driver for Example {
    const HOOKS: Hooks = Hooks { allocate: true, ..Hooks::NONE };

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
        edits.env("REX_ALLOCATED_COUNT", &device_ids.len().to_string());
        Ok(())
    }
}

devhost_sdk::export_driver!(
    Example,
    name = "example-rust",
    version = env!("CARGO_PKG_VERSION"),
    description = "Fake accelerators from the Rust SDK template"
);
