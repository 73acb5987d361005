//! Shared test harness: the compiled C module loaded by the real host
//! loader, instances created by the real host, and a `tracing` layer that
//! keeps what the host logs for a driver so tests can assert on it.
#![allow(dead_code)] // each test binary uses a different part

use devhost::driver::instance::{CallError, Instance};
use devhost::driver::loader::{self, Module};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// The deadline of every driver call; generous, the calls take microseconds.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The module this build compiled, through the host's own loader.
pub fn module() -> Module {
    let path = Path::new(devhost_example_c::BUILT_PATH);
    loader::load(path).unwrap_or_else(|e| panic!("loading the example: {e}"))
}

/// Creates an instance named `name` (what the host logs as `driver`).
pub async fn try_create(name: &str, options: &[(&str, &str)]) -> Result<Arc<Instance>, CallError> {
    capture_logs();
    let options: Vec<(String, String)> = options.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Instance::create(name, module(), &options, CALL_TIMEOUT).await
}

pub async fn create(name: &str, options: &[(&str, &str)]) -> Arc<Instance> {
    try_create(name, options).await.unwrap_or_else(|e| panic!("create {options:?}: {e}"))
}

/// The status and message of a driver's refusal; panics on other errors.
pub fn refusal(error: &CallError) -> (devhost_abi::devhost_status, &str) {
    match error {
        CallError::Status { code, message, .. } => (*code, message),
        other => panic!("expected the driver's status, got {other}"),
    }
}

/// One event the host logged with a `driver` field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLine {
    pub level: tracing::Level,
    pub message: String,
}

fn log_store() -> &'static Mutex<Vec<(String, LogLine)>> {
    static LOGS: OnceLock<Mutex<Vec<(String, LogLine)>>> = OnceLock::new();
    LOGS.get_or_init(Mutex::default)
}

/// What the host logged for the instance named `driver`, in order.
pub fn logs_of(driver: &str) -> Vec<LogLine> {
    let logs = log_store().lock().unwrap_or_else(|p| p.into_inner());
    logs.iter().filter(|(d, _)| d == driver).map(|(_, line)| line.clone()).collect()
}

/// Installs the capturing layer process-wide, once. It must be global, not
/// `set_default`: the host logs from each instance's driver thread.
fn capture_logs() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let subscriber = tracing_subscriber::registry().with(Capture);
        tracing::subscriber::set_global_default(subscriber).expect("no other global subscriber");
    });
}

struct Capture;

impl<S: tracing::Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if let Some(driver) = fields.driver {
            let line = LogLine { level: *event.metadata().level(), message: fields.message };
            let mut logs = log_store().lock().unwrap_or_else(|p| p.into_inner());
            logs.push((driver, line));
        }
    }
}

#[derive(Default)]
struct Fields {
    driver: Option<String>,
    message: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "driver" => self.driver = Some(value.to_owned()),
            "message" => self.message = value.to_owned(),
            _ => {}
        }
    }

    // `%name` fields and the formatted message arrive here; their Debug is
    // their text without quotes.
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "driver" => self.driver = Some(format!("{value:?}")),
            "message" => self.message = format!("{value:?}"),
            _ => {}
        }
    }
}

/// Live threads of this process whose name is `name`. A thread the driver
/// starts inherits the name of the thread that started it, so this counts a
/// driver's watch thread beside the host worker that created it.
pub fn threads_named(name: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        panic!("/proc/self/task is not readable");
    };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end_matches('\n') == name)
        .count()
}
