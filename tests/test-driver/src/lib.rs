//! A Rust SDK driver for the host's tests. With no options it reports
//! `count` healthy devices; options make it misbehave on purpose:
//! `panic_in` / `hang_in` name a call (create, scan, allocate, preferred,
//! pre_start, watch_start; scans misbehave from the second on, and a scan
//! hangs only once), `hang_ms` bounds a hang, `fail_create` makes
//! create refuse with that message, `fail_create_until` makes create fail
//! (UNAVAILABLE, as a device not ready at boot) until that file exists, `bad_ids` emits invalid and duplicate
//! IDs next to good ones, `propose` makes the preferred hook propose these
//! comma-separated IDs verbatim. `health_file` names a file read at every
//! scan: each line `ID REASON…` makes that device Unhealthy with that reason
//! (ABI 1.2 `device_health_reason`; a line with only the ID gives no reason).
//! `scan_log` names a file each scan appends one line to, so that a test
//! can count the scans the driver ran.

use devhost_sdk::{Driver, Edits, Error, Health, Hooks, Host, Options, Preferred, PreferredRequest, Result, Scan};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

struct TestDriver {
    count: u32,
    prefix: String,
    panic_in: String,
    hang_in: String,
    hang: Duration,
    bad_ids: bool,
    propose: Option<Vec<String>>,
    health_file: Option<String>,
    scan_log: Option<String>,
    scans: AtomicU32,
    host: Host,
}

impl TestDriver {
    fn misbehave(&self, call: &str) {
        if self.panic_in == call {
            panic!("test driver told to panic in {call}");
        }
        if self.hang_in == call {
            std::thread::sleep(self.hang);
        }
    }
}

impl TestDriver {
    /// (ID, reason) of every device `health_file` names; none without the file.
    fn unhealthy(&self) -> Vec<(String, String)> {
        let Some(path) = &self.health_file else { return Vec::new() };
        let text = std::fs::read_to_string(path).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let (id, reason) = l.trim().split_once(' ').unwrap_or((l.trim(), ""));
                (!id.is_empty()).then(|| (id.to_string(), reason.trim().to_string()))
            })
            .collect()
    }
}

fn misbehave_create(options: &Options) -> Result<()> {
    if options.get("panic_in") == Some("create") {
        panic!("test driver told to panic in create");
    }
    if options.get("hang_in") == Some("create") {
        std::thread::sleep(Duration::from_millis(options.parse_or("hang_ms", 60_000u64)?));
    }
    if let Some(msg) = options.get("fail_create") {
        return Err(Error::invalid_argument(msg.to_string()));
    }
    if let Some(path) = options.get("fail_create_until")
        && !std::path::Path::new(path).exists()
    {
        return Err(Error::unavailable(format!("device not ready: {path} does not exist yet")));
    }
    Ok(())
}

impl Driver for TestDriver {
    const HOOKS: Hooks =
        Hooks { allocate: true, preferred_allocation: true, pre_start: true, watch: true, ..Hooks::NONE };

    fn create(host: Host, options: &Options) -> Result<Self> {
        options.deny_unknown(&[
            "count",
            "prefix",
            "panic_in",
            "hang_in",
            "hang_ms",
            "fail_create",
            "fail_create_until",
            "bad_ids",
            "propose",
            "health_file",
            "scan_log",
        ])?;
        misbehave_create(options)?;
        Ok(TestDriver {
            count: options.parse_or("count", 4u32)?,
            prefix: options.get_or("prefix", "t").to_string(),
            panic_in: options.get_or("panic_in", "").to_string(),
            hang_in: options.get_or("hang_in", "").to_string(),
            hang: Duration::from_millis(options.parse_or("hang_ms", 60_000u64)?),
            bad_ids: options.bool_or("bad_ids", false)?,
            propose: options.list("propose"),
            health_file: options.get("health_file").map(str::to_string),
            scan_log: options.get("scan_log").map(str::to_string),
            scans: AtomicU32::new(0),
            host,
        })
    }

    fn scan(&self, scan: &mut Scan<'_>) -> Result<()> {
        // The first scan (at start-up) behaves, so that hangs and panics hit
        // a resource that is already registered; a hang happens once (the
        // second scan), so the tests can watch the driver come back.
        let n = self.scans.fetch_add(1, Ordering::Relaxed);
        if let Some(path) = &self.scan_log {
            use std::io::Write;
            let line = format!("scan {n}\n");
            let appended = std::fs::OpenOptions::new().create(true).append(true).open(path);
            if let Err(e) = appended.and_then(|mut f| f.write_all(line.as_bytes())) {
                return Err(Error::internal(format!("scan_log {path}: {e}")));
            }
        }
        if n > 0 && (self.hang_in != "scan" || n == 1) {
            self.misbehave("scan");
        }
        let unhealthy = self.unhealthy();
        for i in 0..self.count {
            let id = format!("{}-{i}", self.prefix);
            let reason = unhealthy.iter().find(|(u, _)| *u == id).map(|(_, r)| r.as_str());
            let health = if reason.is_some() { Health::Unhealthy } else { Health::Healthy };
            let mut device = scan.device(&id, health, Some(i % 2));
            if let Some(r) = reason {
                device.reason(r);
            }
            device.attr("index", &i.to_string()).attr("model", "testdrv").env("TESTDRV_VISIBLE", &id).device_node(
                "/dev/null",
                "/dev/testdrv",
                "rw",
            );
        }
        if self.bad_ids {
            scan.device("", Health::Healthy, None);
            scan.device(&"x".repeat(64), Health::Healthy, None);
            scan.device("has space", Health::Healthy, None);
            scan.device("a::b", Health::Healthy, None);
            scan.device(&format!("{}-0", self.prefix), Health::Healthy, None);
        }
        Ok(())
    }

    fn allocate(&self, device_ids: &[&str], edits: &mut Edits<'_>) -> Result<()> {
        self.misbehave("allocate");
        edits.env("TESTDRV_ALLOCATED", &device_ids.join(","));
        Ok(())
    }

    fn preferred_allocation(&self, request: &PreferredRequest<'_>, out: &mut Preferred<'_>) -> Result<()> {
        self.misbehave("preferred");
        match &self.propose {
            Some(ids) => ids.iter().for_each(|id| {
                out.prefer(id);
            }),
            None => request.available.iter().rev().take(request.size).for_each(|id| {
                out.prefer(id);
            }),
        }
        Ok(())
    }

    fn pre_start(&self, _device_ids: &[&str]) -> Result<()> {
        self.misbehave("pre_start");
        Ok(())
    }

    fn watch_start(&self) -> Result<()> {
        self.misbehave("watch_start");
        self.host.devices_changed();
        Ok(())
    }
}

devhost_sdk::export_driver!(TestDriver, name = "testdrv", version = "0.0.1");
