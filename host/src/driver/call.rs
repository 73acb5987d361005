//! The vocabulary of a driver call, shared by the in-process instance, its driver thread and the
//! isolated worker's supervisor and channel: why a call failed ([`CallError`]), a driver's status
//! in words ([`status_error`]), a failing `create` being retried ([`CreateRetry`]), and the timing
//! constants both backends use. A leaf: it imports nothing else of the driver side but the call
//! state the callbacks collect, so everyone can import it without a circle.

use crate::driver::callbacks::CallState;
use devhost_abi as abi;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Why a driver call did not succeed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CallError {
    #[error("driver {driver}: {call} failed ({status}): {message}")]
    Status { driver: String, call: &'static str, code: abi::devhost_status, status: &'static str, message: String },
    #[error("driver {driver}: {call} did not return within {timeout:?}")]
    Timeout { driver: String, call: &'static str, timeout: Duration },
    #[error("driver {driver} is hung in {call} for {secs} s; call refused")]
    Hung { driver: String, call: &'static str, secs: u64 },
    #[error("driver {driver} is broken after a panic; call refused")]
    Poisoned { driver: String },
    /// An in-process instance whose driver thread has ended (the instance is stopping).
    #[error("driver {driver}: driver thread is gone")]
    ThreadGone { driver: String },
    /// An isolated driver whose worker process is down (crashed, killed,
    /// restarting) or could not be started.
    #[error("driver {driver}: {reason}")]
    Unavailable {
        driver: String,
        reason: String,
        /// The call the worker was lost in, if it was in one (`create`: a create failure).
        during: Option<&'static str>,
    },
}

/// Why [`crate::driver::instance::Instance::load_and_create`] gave no instance.
#[derive(Debug)]
pub enum StartError {
    /// The module could not be read, trusted or loaded (the loader's words).
    Load(String),
    /// The driver's thread could not start, or its `create` failed.
    Create(CallError),
}

impl CallError {
    /// A call refused or failed because the driver's worker process is not there to take it.
    pub fn unavailable(driver: &str, reason: impl Into<String>) -> CallError {
        CallError::Unavailable { driver: driver.to_string(), reason: reason.into(), during: None }
    }

    /// A call whose worker process was lost while it ran (`reason`), typed by the call it was in.
    pub fn lost_in(driver: &str, call: &'static str, reason: &str) -> CallError {
        CallError::Unavailable {
            driver: driver.to_string(),
            reason: format!("{reason} during {call}"),
            during: Some(call),
        }
    }

    /// Whether the driver's `create` itself failed (an error, a deadline,
    /// a worker that died in it), as opposed to its module not loading:
    /// the daemon retries these.
    pub fn is_create_failure(&self) -> bool {
        match self {
            CallError::Status { call, .. } | CallError::Timeout { call, .. } => *call == "create",
            CallError::Unavailable { during, .. } => *during == Some("create"),
            _ => false,
        }
    }

    /// The message without the driver's name in front (`driver NAME: `), for a line that names
    /// the driver already; the whole message for the kinds that name it within their sentence.
    pub fn detail(&self) -> String {
        match self {
            CallError::Status { call, status, message, .. } => format!("{call} failed ({status}): {message}"),
            CallError::Timeout { call, timeout, .. } => format!("{call} did not return within {timeout:?}"),
            CallError::ThreadGone { .. } => "driver thread is gone".to_string(),
            CallError::Unavailable { reason, .. } => reason.clone(),
            CallError::Hung { .. } | CallError::Poisoned { .. } => self.to_string(),
        }
    }
}

/// What a driver call returns: its status and what it emitted.
pub type Answer = (abi::devhost_status, CallState);

/// A driver call's answer, or why there is none.
pub type Outcome = Result<Answer, CallError>;

/// The error for a call that returned `status` (not OK), with the driver's message.
pub(crate) fn status_error(
    driver: &str,
    call: &'static str,
    status: abi::devhost_status,
    state: CallState,
) -> CallError {
    let message = match (state.error, status_name(status)) {
        (Some(m), _) => m,
        (None, "unknown status code") => format!("driver returned unknown status code {status}"),
        (None, name) => format!("driver returned {name} without a message"),
    };
    CallError::Status { driver: driver.to_string(), call, code: status, status: status_name(status), message }
}

fn status_name(code: abi::devhost_status) -> &'static str {
    match code {
        abi::DEVHOST_ERR_INVALID_ARGUMENT => "INVALID_ARGUMENT",
        abi::DEVHOST_ERR_NOT_FOUND => "NOT_FOUND",
        abi::DEVHOST_ERR_UNAVAILABLE => "UNAVAILABLE",
        abi::DEVHOST_ERR_TIMEOUT => "TIMEOUT",
        abi::DEVHOST_ERR_INTERNAL => "INTERNAL",
        abi::DEVHOST_ERR_PANIC => "PANIC",
        abi::DEVHOST_ERR_UNSUPPORTED => "UNSUPPORTED",
        abi::DEVHOST_ERR_RESOURCE_EXHAUSTED => "RESOURCE_EXHAUSTED",
        abi::DEVHOST_ERR_FAILED_PRECONDITION => "FAILED_PRECONDITION",
        _ => "unknown status code",
    }
}

/// A driver whose `create` failed and is being retried, with the capped
/// backoff of worker restarts (`devhost list`, `/status`, metrics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateRetry {
    /// Failed attempts so far.
    pub attempts: u32,
    pub last_error: String,
    pub next_attempt: Instant,
}

/// The retry state one instance shares with whatever retries its create.
pub(crate) type CreateState = Arc<Mutex<Option<CreateRetry>>>;

/// Restart delays of an isolated driver's worker: doubled after each
/// failure, from MIN up to MAX (and back to MIN once a worker has stayed up
/// a while). In-process create retries use the same delays.
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// How long a caller waits for a driver call's answer on its own thread
/// before it parks its task (in process, the answer the driver thread sends;
/// isolated, the caller reads its worker's channel meanwhile,
/// `isolation::conn`). Most hooks answer within a few microseconds:
/// catching the answer here saves the driver thread waking the runtime and
/// the runtime's thread parking and unparking (a cross-thread wake-up that
/// costs tens of microseconds on a loaded machine), at the price of at most
/// this much busy time on a runtime thread for a slow call.
pub(crate) const ANSWER_SPIN: Duration = Duration::from_micros(50);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_detail_is_the_message_after_the_drivers_name() {
        let d = "gpu".to_string();
        let errors = [
            CallError::Status {
                driver: d.clone(),
                call: "create",
                code: abi::DEVHOST_ERR_INTERNAL,
                status: "INTERNAL",
                message: "no".into(),
            },
            CallError::Timeout { driver: d.clone(), call: "scan", timeout: Duration::from_secs(5) },
            CallError::ThreadGone { driver: d.clone() },
            CallError::lost_in("gpu", "create", "its worker process exited"),
            CallError::Hung { driver: d.clone(), call: "scan", secs: 3 },
            CallError::Poisoned { driver: d.clone() },
        ];
        for e in errors {
            let text = e.to_string();
            let stripped = text.strip_prefix("driver gpu: ").unwrap_or(&text);
            assert_eq!(e.detail(), stripped, "{e:?}");
        }
    }

    #[test]
    fn a_worker_lost_in_create_is_a_create_failure_and_one_lost_elsewhere_is_not() {
        assert!(CallError::lost_in("gpu", "create", "its worker process exited").is_create_failure());
        assert!(!CallError::lost_in("gpu", "scan", "its worker process exited").is_create_failure());
        assert!(!CallError::unavailable("gpu", "its worker process is stopped").is_create_failure());
    }
}
