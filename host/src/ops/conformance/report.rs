//! What the battery finds: one [`Outcome`] a check, in a [`Report`] rendered as the lines
//! `devhost conformance` prints, and the `KEY=VALUE` options it hands to `create`. A leaf of the
//! battery: every check fills in a report, and none of this uses them.

use std::fmt::Write as _;
use std::time::Duration;

/// The deadline every call gets: the manifest's default `call_timeout`.
pub const DEADLINE: Duration = crate::manifest::DEFAULT_CALL_TIMEOUT;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Pass,
    /// Works, but an operator or the kubelet would notice something.
    Warn,
    Fail,
    /// Not applicable to this module (a hook it does not have).
    Skip,
}

impl Verdict {
    /// The verdict a report line's label names.
    pub(super) fn of_label(label: &str) -> Option<Verdict> {
        [Verdict::Pass, Verdict::Warn, Verdict::Fail, Verdict::Skip].into_iter().find(|v| v.label() == label)
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
            Verdict::Skip => "SKIP",
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub check: &'static str,
    pub verdict: Verdict,
    pub detail: String,
}

#[derive(Debug)]
pub struct Report {
    pub module: String,
    pub outcomes: Vec<Outcome>,
}

impl Report {
    pub(super) fn add(&mut self, check: &'static str, verdict: Verdict, detail: impl Into<String>) {
        self.outcomes.push(Outcome { check, verdict, detail: detail.into() });
    }

    /// No check failed (warnings and skips are allowed).
    pub fn passed(&self) -> bool {
        !self.outcomes.iter().any(|o| o.verdict == Verdict::Fail)
    }

    pub fn outcome(&self, check: &str) -> Option<&Outcome> {
        self.outcomes.iter().find(|o| o.check == check)
    }

    pub fn render(&self) -> String {
        let mut s = format!("devhost conformance: {}\n", self.module);
        let width = self.outcomes.iter().map(|o| o.check.len()).max().unwrap_or(0);
        for o in &self.outcomes {
            let _ = writeln!(s, "{}  {:<width$}  {}", o.verdict.label(), o.check, o.detail);
        }
        let count = |v| self.outcomes.iter().filter(|o| o.verdict == v).count();
        let _ = writeln!(
            s,
            "{}: {} passed, {} warned, {} failed, {} skipped",
            if self.passed() { "CONFORMS" } else { "DOES NOT CONFORM" },
            count(Verdict::Pass),
            count(Verdict::Warn),
            count(Verdict::Fail),
            count(Verdict::Skip)
        );
        s
    }
}

/// Parses `KEY=VALUE` words into driver options.
pub fn parse_options(words: &[String]) -> Result<Vec<(String, String)>, String> {
    let mut out: Vec<(String, String)> = Vec::new();
    for w in words {
        let Some((k, v)) = w.split_once('=') else {
            return Err(format!("--options {w:?}: expected KEY=VALUE"));
        };
        if k.is_empty() {
            return Err(format!("--options {w:?}: the key is empty"));
        }
        if out.iter().any(|(seen, _)| seen == k) {
            return Err(format!("--options: key {k:?} given twice"));
        }
        out.push((k.to_string(), v.to_string()));
    }
    // The host hands options to create sorted by key, as the manifest does.
    out.sort();
    Ok(out)
}
