//! Driver options: the manifest's `[driver.X.options]` table, flattened by
//! the host to dotted keys with text values.

use crate::error::{Error, Result};
use std::str::FromStr;

/// The options of one driver instance.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pairs: Vec<(String, String)>,
}

impl Options {
    pub fn new(pairs: Vec<(String, String)>) -> Self {
        Options { pairs }
    }

    /// The raw text of an option.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// The text of an option, or `default`.
    pub fn get_or<'a>(&'a self, key: &str, default: &'a str) -> &'a str {
        self.get(key).unwrap_or(default)
    }

    /// Parses an option; `Ok(None)` when absent, an error naming the key and
    /// value when it does not parse.
    pub fn parse<T: FromStr>(&self, key: &str) -> Result<Option<T>>
    where
        T::Err: std::fmt::Display,
    {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<T>()
                .map(Some)
                .map_err(|e| Error::invalid_argument(format!("option \"{key}\": {v:?} is not valid: {e}"))),
        }
    }

    /// Parses an option or returns `default` when absent.
    pub fn parse_or<T: FromStr>(&self, key: &str, default: T) -> Result<T>
    where
        T::Err: std::fmt::Display,
    {
        Ok(self.parse(key)?.unwrap_or(default))
    }

    /// A boolean option (`true`/`false`, `1`/`0`, `yes`/`no`).
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key).map(|v| v.trim().to_ascii_lowercase()) {
            None => Ok(default),
            Some(v) => match v.as_str() {
                "true" | "1" | "yes" | "on" => Ok(true),
                "false" | "0" | "no" | "off" => Ok(false),
                _ => Err(Error::invalid_argument(format!("option \"{key}\": {v:?} is not a boolean"))),
            },
        }
    }

    /// A comma-separated list option (TOML arrays arrive joined with ',').
    pub fn list(&self, key: &str) -> Option<Vec<String>> {
        self.get(key).map(|v| v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect())
    }

    /// Every option as (key, value).
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// Fails when an option's key is not in `known`, naming every such key (a key `a.b` is
    /// known when `a` or `a.*` is listed as `"a.*"`).
    pub fn deny_unknown(&self, known: &[&str]) -> Result<()> {
        let unknown: Vec<String> = self
            .pairs
            .iter()
            .map(|(k, _)| k)
            .filter(|k| {
                !known.iter().any(|n| match n.strip_suffix(".*") {
                    Some(prefix) => k.starts_with(prefix) && k[prefix.len()..].starts_with('.'),
                    None => n == k,
                })
            })
            .map(|k| format!("\"{k}\""))
            .collect();
        if unknown.is_empty() {
            return Ok(());
        }
        // Every unknown key at once: the host points at each one in the manifest.
        let mut names: Vec<&str> = known.to_vec();
        names.sort_unstable();
        let what = if unknown.len() == 1 { "unknown option" } else { "unknown options" };
        Err(Error::invalid_argument(format!("{what} {} (known options: {})", unknown.join(", "), names.join(", "))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(p: &[(&str, &str)]) -> Options {
        Options::new(p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn parse_names_key_and_value_on_error() {
        let e = opts(&[("count", "abc")]).parse::<u32>("count").unwrap_err();
        assert!(e.message.contains("\"count\"") && e.message.contains("abc"), "{e}");
    }

    #[test]
    fn deny_unknown_names_the_key() {
        let o = opts(&[("count", "1"), ("topology.x", "2"), ("bogus", "3")]);
        let e = o.deny_unknown(&["count", "topology.*"]).unwrap_err();
        assert!(e.message.contains("\"bogus\""), "{e}");
        assert!(opts(&[("topology.x", "1")]).deny_unknown(&["topology.*"]).is_ok());
        assert!(opts(&[("topologyx", "1")]).deny_unknown(&["topology.*"]).is_err());
    }

    #[test]
    fn deny_unknown_names_every_unknown_key() {
        let o = opts(&[("bogus", "1"), ("count", "1"), ("prefx", "a")]);
        let e = o.deny_unknown(&["count", "prefix"]).unwrap_err();
        assert_eq!(e.message, "unknown options \"bogus\", \"prefx\" (known options: count, prefix)");
    }

    #[test]
    fn list_and_bool() {
        let o = opts(&[("xids", "13, 31,43"), ("on", "yes")]);
        assert_eq!(o.list("xids").unwrap(), vec!["13", "31", "43"]);
        assert!(o.bool_or("on", false).unwrap());
        assert!(o.bool_or("missing", true).unwrap());
    }
}
