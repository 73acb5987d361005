//! Keeps the log readable under periodic rescans: each problem is logged
//! when it first appears and once more when it clears, not on every scan.

use std::collections::BTreeSet;
use std::sync::Mutex;

#[derive(Default)]
pub struct Reporter {
    last: Mutex<BTreeSet<String>>,
}

/// What changed since the previous scan.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub new: Vec<String>,
    pub cleared: Vec<String>,
}

impl Reporter {
    /// Records this scan's problems and returns the ones to log.
    pub fn update(&self, current: impl IntoIterator<Item = String>) -> Changes {
        let current: BTreeSet<String> = current.into_iter().collect();
        // A poisoned lock only means an earlier scan panicked mid-update;
        // the set is still a valid (if stale) memory of what was logged.
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let changes = Changes {
            new: current.difference(&last).cloned().collect(),
            cleared: last.difference(&current).cloned().collect(),
        };
        *last = current;
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_reported_once_and_when_cleared() {
        let r = Reporter::default();
        let a = || "port dfl-port.0 reports errors".to_string();
        assert_eq!(r.update([a()]).new, [a()]);
        assert_eq!(r.update([a()]), Changes::default());
        assert_eq!(r.update([]).cleared, [a()]);
    }
}
