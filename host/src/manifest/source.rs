//! Turning byte offsets into `file:line:column` and collecting every problem in one pass.
//!
//! serde stops at the first error of a struct. To report all of them, [`deserialize_section`]
//! retries: after an error it finds the key the error points into, records the error, drops that
//! key and deserialises again, until the section goes through or an error points at no key.

use std::ops::Range;
use std::path::Path;

use serde::de::DeserializeOwned;
use toml::Spanned;
use toml::de::{DeValue, ValueDeserializer};

use super::model::Diagnostic;

/// Bounds the retry loop of one section, which costs a clone of the section per retry.
const MAX_ERRORS_PER_SECTION: usize = 64;

/// Collects diagnostics for one manifest, each remembered with its byte offset so the report can
/// be given in file order.
pub(crate) struct Diagnostics<'a> {
    path: &'a Path,
    text: &'a str,
    items: Vec<(usize, Diagnostic)>,
}

impl<'a> Diagnostics<'a> {
    pub(crate) fn new(path: &'a Path, text: &'a str) -> Self {
        Diagnostics { path, text, items: Vec::new() }
    }

    /// `file:line:column` (both 1-based, the column counted in characters) of a byte offset.
    /// Offsets past the end or inside a character are clamped, never a panic.
    pub(crate) fn location(&self, offset: usize) -> String {
        let bytes = self.text.as_bytes();
        let before = bytes.get(..offset).unwrap_or(bytes);
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let line_start = before.iter().rposition(|&b| b == b'\n').map_or(0, |newline| newline + 1);
        let column = before
            .get(line_start..)
            .unwrap_or_default()
            .iter()
            .filter(|&&b| b & 0xC0 != 0x80) // count UTF-8 lead bytes only: one per character
            .count()
            + 1;
        format!("{}:{line}:{column}", self.path.display())
    }

    pub(crate) fn error(&mut self, span: Range<usize>, field: &str, message: impl Into<String>) {
        let diagnostic =
            Diagnostic { location: self.location(span.start), field: field.to_owned(), message: message.into() };
        self.items.push((span.start, diagnostic));
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The diagnostics in file order (errors found at the same place keep the order found).
    pub(crate) fn into_sorted(mut self) -> Vec<Diagnostic> {
        self.items.sort_by_key(|(offset, _)| *offset);
        self.items.into_iter().map(|(_, d)| d).collect()
    }
}

/// Deserialises one table of the manifest (`section` names it in messages, e.g. `driver.nvidia`;
/// empty for the top level), recording every error found in it. Returns the value built from the
/// keys that were fine, or `None` when the section could not be built at all (a required key
/// missing, or the section is not a table).
pub(crate) fn deserialize_section<T: DeserializeOwned>(
    value: &Spanned<DeValue<'_>>,
    section: &str,
    diags: &mut Diagnostics<'_>,
) -> Option<T> {
    let mut current = value.clone();
    let mut dropped: Vec<String> = Vec::new();
    loop {
        let error = match T::deserialize(ValueDeserializer::from(current.clone())) {
            Ok(built) => return Some(built),
            Err(error) => error,
        };
        let span = error.span().unwrap_or_else(|| value.span());
        let path = match current.get_ref() {
            DeValue::Table(_) => key_path(&current, &span),
            _ => Vec::new(),
        };
        let field = join_field(section, &path);
        let Some(top_key) = path.first() else {
            // An error about the section itself. A "missing field" for a key we dropped after its
            // own error is a consequence, not news.
            let consequence = dropped.iter().any(|key| error.message() == format!("missing field `{key}`"));
            if !consequence {
                diags.error(span, &field, error.message());
            }
            return None;
        };
        diags.error(span, &field, error.message());
        if dropped.len() >= MAX_ERRORS_PER_SECTION {
            diags.error(value.span(), section, "too many errors here; fix the ones above first");
            return None;
        }
        let top_key = top_key.clone();
        if let DeValue::Table(table) = current.get_mut() {
            table.remove(top_key.as_str());
        }
        dropped.push(top_key);
    }
}

/// The key path (tables by key, arrays by index) leading to the entry whose key or scalar value
/// covers `span`. Tables written as `[a.b]` headers are not inside their parent's span, so the
/// search descends into every table and array rather than pruning by span.
fn key_path(value: &Spanned<DeValue<'_>>, span: &Range<usize>) -> Vec<String> {
    let covers = |outer: Range<usize>| outer.start <= span.start && span.end <= outer.end;
    match value.get_ref() {
        DeValue::Table(table) => {
            for (key, child) in table.iter() {
                let deeper = key_path(child, span);
                if !deeper.is_empty() {
                    return [vec![key.get_ref().to_string()], deeper].concat();
                }
                if covers(key.span()) || covers(child.span()) {
                    return vec![key.get_ref().to_string()];
                }
            }
            Vec::new()
        }
        DeValue::Array(items) => {
            for (index, child) in items.iter().enumerate() {
                let deeper = key_path(child, span);
                if !deeper.is_empty() {
                    return [vec![format!("[{index}]")], deeper].concat();
                }
                if covers(child.span()) {
                    return vec![format!("[{index}]")];
                }
            }
            Vec::new()
        }
        _ => Vec::new(),
    }
}

/// `driver.nvidia` + [`options`, `x`] → `driver.nvidia.options.x`; array indexes attach without
/// a dot (`resource[2]`).
pub(crate) fn join_field(section: &str, path: &[String]) -> String {
    let mut field = section.to_owned();
    for part in path {
        if !field.is_empty() && !part.starts_with('[') {
            field.push('.');
        }
        field.push_str(part);
    }
    field
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_counts_lines_and_characters() {
        let text = "ab\nçd = 1\n\nx";
        let diags = Diagnostics::new(Path::new("m.toml"), text);
        assert_eq!(diags.location(0), "m.toml:1:1");
        assert_eq!(diags.location(2), "m.toml:1:3");
        assert_eq!(diags.location(3), "m.toml:2:1");
        // 'ç' is two bytes; the 'd' after it is the second character of line 2.
        assert_eq!(diags.location(5), "m.toml:2:2");
        assert_eq!(diags.location(text.len() - 1), "m.toml:4:1");
    }

    #[test]
    fn location_clamps_offsets_out_of_range() {
        let diags = Diagnostics::new(Path::new("m.toml"), "a\nb");
        assert_eq!(diags.location(999), "m.toml:2:2");
        // Inside a multi-byte character: still a location, never a panic.
        let diags = Diagnostics::new(Path::new("m.toml"), "é");
        assert_eq!(diags.location(1), "m.toml:1:2");
    }

    #[test]
    fn join_field_uses_dots_and_brackets() {
        let path = vec!["[2]".to_string(), "match".to_string()];
        assert_eq!(join_field("resource", &path), "resource[2].match");
        assert_eq!(join_field("", &["kubelet_dir".to_string()]), "kubelet_dir");
    }
}
