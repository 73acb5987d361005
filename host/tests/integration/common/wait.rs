//! Waiting for what a test expects to become true, the one way every area waits: poll a
//! condition, and fail naming what was awaited (with whatever context the caller adds, such as
//! the daemon's log) when it does not come in time.

use std::time::{Duration, Instant};

use super::WAIT;

/// How often a condition is polled.
const POLL: Duration = Duration::from_millis(10);

/// Waits until `cond` holds, at most [`WAIT`]; fails naming `what`.
pub async fn eventually(what: &str, cond: impl FnMut() -> bool) {
    eventually_with(what, WAIT, cond, String::new).await
}

/// Waits until `cond` holds, at most `within`; fails naming `what`.
pub async fn eventually_within(what: &str, within: Duration, cond: impl FnMut() -> bool) {
    eventually_with(what, within, cond, String::new).await
}

/// Waits until `cond` holds, at most `within`; fails naming `what` followed by `context()`
/// (the daemon's log, the last value seen), which is read only then.
pub async fn eventually_with(
    what: &str,
    within: Duration,
    mut cond: impl FnMut() -> bool,
    context: impl FnOnce() -> String,
) {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() >= within {
            panic!("timed out after {within:?} waiting for {what}{}", context());
        }
        tokio::time::sleep(POLL).await;
    }
}
