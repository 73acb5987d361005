//! The manifest parser and builder (`Manifest::parse`: TOML with spans, serde shapes, the checks
//! serde cannot make, path resolution) on arbitrary text: no panic, the same answer twice, and
//! every refusal a non-empty list of diagnostics that each name `file:line:column` and a field.
#![no_main]

use devhost::manifest::Manifest;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

const FILE: &str = "/etc/devhost/devhost.toml";

fn located(location: &str) -> bool {
    let mut parts = location.rsplitn(3, ':');
    let col = parts.next().and_then(|c| c.parse::<usize>().ok());
    let line = parts.next().and_then(|l| l.parse::<usize>().ok());
    parts.next() == Some(FILE) && col.is_some_and(|c| c >= 1) && line.is_some_and(|l| l >= 1)
}

fuzz_target!(|text: &str| {
    let first = Manifest::parse(text, Path::new(FILE), None);
    let again = Manifest::parse(text, Path::new(FILE), None);
    assert_eq!(format!("{first:?}"), format!("{again:?}"), "parsing is not deterministic");
    if let Err(errors) = first {
        assert!(!errors.0.is_empty(), "an Err with no diagnostics");
        for d in &errors.0 {
            assert!(located(&d.location), "diagnostic without file:line:col: {d}");
            assert!(!d.message.is_empty(), "diagnostic without a message: {d}");
        }
    }
});
