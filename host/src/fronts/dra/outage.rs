//! Retrying a call to the API server while it is away: capped exponential backoff, and a log an
//! operator can read through a long outage (one WARN when the calls start failing, a reminder
//! every [`REMIND_EVERY`] while they keep failing, one INFO with the outage's length when they
//! work again; the attempts in between are DEBUG). The slice publisher and its watch each keep
//! one.

use std::time::{Duration, Instant};

/// The first wait after a failure; it doubles with each failure in a row.
pub const BACKOFF_MIN: Duration = Duration::from_secs(1);
/// The longest wait between two attempts.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How often a failure that goes on is logged again at WARN.
pub const REMIND_EVERY: Duration = Duration::from_secs(300);

/// The failures in a row of one kind of call, if any.
#[derive(Debug, Default)]
pub struct Outage {
    current: Option<Failing>,
}

#[derive(Debug)]
struct Failing {
    since: Instant,
    attempts: u32,
    warned: Instant,
    next_wait: Duration,
}

/// What to log for a failure, and how long to wait before the next attempt.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The first failure after a success: WARN.
    Started { wait: Duration },
    /// Still failing, and the last WARN is [`REMIND_EVERY`] old: WARN again with the totals.
    Remind { wait: Duration, attempts: u32, for_secs: u64 },
    /// Still failing, said recently: DEBUG.
    Quiet { wait: Duration },
}

impl Verdict {
    /// How long to wait before the next attempt.
    pub fn wait(&self) -> Duration {
        match self {
            Verdict::Started { wait } | Verdict::Remind { wait, .. } | Verdict::Quiet { wait } => *wait,
        }
    }
}

impl Outage {
    /// Counts a failed attempt made at `now`.
    pub fn failed(&mut self, now: Instant) -> Verdict {
        let Some(f) = &mut self.current else {
            self.current = Some(Failing { since: now, attempts: 1, warned: now, next_wait: BACKOFF_MIN * 2 });
            return Verdict::Started { wait: BACKOFF_MIN };
        };
        f.attempts += 1;
        let wait = f.next_wait;
        f.next_wait = (f.next_wait * 2).min(BACKOFF_MAX);
        if now.duration_since(f.warned) >= REMIND_EVERY {
            f.warned = now;
            return Verdict::Remind { wait, attempts: f.attempts, for_secs: now.duration_since(f.since).as_secs() };
        }
        Verdict::Quiet { wait }
    }

    /// A successful attempt at `now`: the failed attempts and how long they lasted, if the
    /// last attempt had failed.
    pub fn succeeded(&mut self, now: Instant) -> Option<(u32, Duration)> {
        self.current.take().map(|f| (f.attempts, now.duration_since(f.since)))
    }
}

/// Where a call is made from: the DRA driver and node, logged as fields of every line.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    pub driver: &'a str,
    pub node: &'a str,
}

/// Logs `verdict` for a failure of `what` ("publish the ResourceSlices") with
/// `error`.
pub fn log_failure(scope: Scope, verdict: &Verdict, what: &str, error: &str) {
    let Scope { driver, node } = scope;
    match verdict {
        Verdict::Started { wait } => tracing::warn!(
            dra_driver = driver,
            node,
            "DRA: cannot {what} of DRA driver {driver} on node {node}, retrying in {} s (then less often, up to every {} s): \
             {error}",
            wait.as_secs(),
            BACKOFF_MAX.as_secs()
        ),
        Verdict::Remind { wait, attempts, for_secs } => tracing::warn!(
            dra_driver = driver,
            node,
            "DRA: still cannot {what} of DRA driver {driver} on node {node} after {attempts} attempts over {for_secs} s, \
             retrying in {} s: {error}",
            wait.as_secs()
        ),
        Verdict::Quiet { wait } => tracing::debug!(
            dra_driver = driver,
            node,
            "DRA: cannot {what} of DRA driver {driver} on node {node}, retrying in {} s: {error}",
            wait.as_secs()
        ),
    }
}

/// Logs that a call (`what`, as for [`log_failure`]) works again after `attempts` failures
/// over `lasted`.
pub fn log_recovery(scope: Scope, what: &str, attempts: u32, lasted: Duration) {
    let Scope { driver, node } = scope;
    tracing::info!(
        dra_driver = driver,
        node,
        "DRA: can {what} of DRA driver {driver} on node {node} again, after {attempts} failed attempts over {} s",
        lasted.as_secs()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_doubles_to_its_cap_and_a_success_starts_over() {
        let mut o = Outage::default();
        let t = Instant::now();
        let waits: Vec<u64> = (0..8).map(|i| o.failed(t + Duration::from_secs(i)).wait().as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(o.succeeded(t + Duration::from_secs(100)), Some((8, Duration::from_secs(100))));
        assert_eq!(o.succeeded(t + Duration::from_secs(101)), None, "nothing to recover from");
        assert_eq!(o.failed(t + Duration::from_secs(102)), Verdict::Started { wait: BACKOFF_MIN });
    }

    #[test]
    fn a_long_outage_warns_first_then_once_per_reminder_period() {
        let mut o = Outage::default();
        let t = Instant::now();
        // Ten minutes of attempts 30 s apart: one start and two reminders, the rest quiet.
        let verdicts: Vec<Verdict> = (0..=20).map(|i| o.failed(t + Duration::from_secs(30 * i))).collect();
        let loud: Vec<&Verdict> = verdicts.iter().filter(|v| !matches!(v, Verdict::Quiet { .. })).collect();
        assert_eq!(
            loud,
            [
                &Verdict::Started { wait: BACKOFF_MIN },
                &Verdict::Remind { wait: BACKOFF_MAX, attempts: 11, for_secs: 300 },
                &Verdict::Remind { wait: BACKOFF_MAX, attempts: 21, for_secs: 600 },
            ]
        );
        assert!(o.current.is_some());
    }
}
