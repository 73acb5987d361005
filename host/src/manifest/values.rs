//! Value shapes of the manifest that need more than serde's defaults: durations (`"500ms"`,
//! `"10s"`, `"2m"` or whole seconds) and driver options, which are flattened into sorted
//! key/value text pairs because that is all the C ABI can carry (`devhost_kv`).

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use toml::Value;

/// A positive duration as written in the manifest. Validation happens inside deserialisation so
/// that a bad value is reported at its own line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DurationSetting(pub Duration);

const DURATION_FORMS: &str = "a positive whole number of seconds or a string such as \"500ms\", \"10s\" or \"2m\"";

impl<'de> de::Deserialize<'de> for DurationSetting {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(DurationVisitor)
    }
}

struct DurationVisitor;

impl Visitor<'_> for DurationVisitor {
    type Value = DurationSetting;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a duration: {DURATION_FORMS}")
    }

    fn visit_i64<E: de::Error>(self, secs: i64) -> Result<Self::Value, E> {
        match u64::try_from(secs) {
            Ok(secs) => self.visit_u64(secs),
            Err(_) => Err(E::custom(format!("duration {secs} is negative; expected {DURATION_FORMS}"))),
        }
    }

    fn visit_u64<E: de::Error>(self, secs: u64) -> Result<Self::Value, E> {
        if secs == 0 {
            return Err(E::custom(format!("duration 0 is not allowed; expected {DURATION_FORMS}")));
        }
        Ok(DurationSetting(Duration::from_secs(secs)))
    }

    fn visit_f64<E: de::Error>(self, secs: f64) -> Result<Self::Value, E> {
        Err(E::custom(format!("duration {secs} has a fraction; write milliseconds instead (e.g. \"1500ms\")")))
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
        parse_duration(text).map(DurationSetting).map_err(E::custom)
    }
}

/// Parses `<digits><unit>` with unit `ms`, `s` or `m`; zero and overflowing values are errors.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let bad = || format!("`{text}` is not a duration; expected {DURATION_FORMS}");
    if digits.is_empty() {
        return Err(bad());
    }
    let amount: u64 = digits.parse().map_err(|_| format!("duration `{text}` is too large"))?;
    if amount == 0 {
        return Err(format!("duration `{text}` is zero; it must be positive"));
    }
    match unit {
        "ms" => Ok(Duration::from_millis(amount)),
        "s" => Ok(Duration::from_secs(amount)),
        "m" => amount.checked_mul(60).map(Duration::from_secs).ok_or_else(|| format!("duration `{text}` is too large")),
        "" => Err(format!("duration `{text}` has no unit; write `{text}s`, or the integer {text} for seconds")),
        _ => Err(bad()),
    }
}

/// Flattens a driver's options table into `(key, value)` text pairs sorted by key: nested tables
/// join their keys with '.', arrays of scalars become one comma-joined value, arrays holding tables
/// or arrays are indexed (`key.0.sub`). Strings are verbatim; numbers, booleans and datetimes are
/// rendered as TOML writes them. Returns the pairs and the keys that came out twice (a quoted
/// `"a.b"` next to a nested `a.b`), which the caller reports.
pub(crate) fn flatten_options(options: &toml::Table) -> (Vec<(String, String)>, Vec<String>) {
    let mut out = Vec::new();
    for (key, value) in options {
        flatten_into(key.clone(), value, &mut out);
    }
    out.sort();
    let mut duplicates: Vec<String> =
        out.windows(2).filter(|pair| pair[0].0 == pair[1].0).map(|pair| pair[0].0.clone()).collect();
    duplicates.dedup();
    (out, duplicates)
}

fn flatten_into(key: String, value: &Value, out: &mut Vec<(String, String)>) {
    match value {
        Value::Table(table) => {
            for (sub, value) in table {
                flatten_into(format!("{key}.{sub}"), value, out);
            }
        }
        Value::Array(items) if items.iter().all(is_scalar) => {
            let joined: Vec<String> = items.iter().map(scalar_text).collect();
            out.push((key, joined.join(",")));
        }
        Value::Array(items) => {
            for (index, value) in items.iter().enumerate() {
                flatten_into(format!("{key}.{index}"), value, out);
            }
        }
        scalar => out.push((key, scalar_text(scalar))),
    }
}

fn is_scalar(value: &Value) -> bool {
    !matches!(value, Value::Table(_) | Value::Array(_))
}

fn scalar_text(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        Value::Datetime(datetime) => datetime.to_string(),
        // Display on a toml Value writes it as TOML would (1.0, 1e20 as 100000000000000000000.0,
        // inf, nan), which is what drivers are told to expect.
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duration_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
    }

    #[test]
    fn bad_duration_strings_are_rejected() {
        for text in ["", "0s", "0ms", "-5s", "10", "10h", "1.5s", "s", " 10s", "10 s", "10S"] {
            assert!(parse_duration(text).is_err(), "{text:?} was accepted");
        }
        assert!(parse_duration("99999999999999999999s").unwrap_err().contains("too large"));
        assert!(parse_duration(&format!("{}m", u64::MAX)).unwrap_err().contains("too large"));
        assert!(parse_duration("10").unwrap_err().contains("no unit"));
    }

    fn table(text: &str) -> toml::Table {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn options_flatten_nested_tables_and_scalars() {
        let options = table(
            "z = 'verbatim \"text\"'\nn = 42\nneg = -7\nf = 1.5\nwhole = 3.0\nb = true\n\
             d = 1979-05-27T07:32:00Z\n[nested]\ninner = 'x'\n[nested.deeper]\nk = false\n",
        );
        let (pairs, duplicates) = flatten_options(&options);
        let expected: Vec<(String, String)> = [
            ("b", "true"),
            ("d", "1979-05-27T07:32:00Z"),
            ("f", "1.5"),
            ("n", "42"),
            ("neg", "-7"),
            ("nested.deeper.k", "false"),
            ("nested.inner", "x"),
            ("whole", "3.0"),
            ("z", "verbatim \"text\""),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(pairs, expected);
        assert!(duplicates.is_empty());
    }

    #[test]
    fn options_flatten_arrays() {
        let options = table(
            "list = ['a', 'b', 3, true]\nempty = []\n\
             [[dev]]\npath = '/dev/a'\n[[dev]]\npath = '/dev/b'\nmode = 6\n",
        );
        let (pairs, _) = flatten_options(&options);
        let expected: Vec<(String, String)> = [
            ("dev.0.path", "/dev/a"),
            ("dev.1.mode", "6"),
            ("dev.1.path", "/dev/b"),
            ("empty", ""),
            ("list", "a,b,3,true"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(pairs, expected);
    }

    #[test]
    fn options_colliding_after_flattening_are_reported() {
        let options = table("\"a.b\" = 1\n[a]\nb = 2\n");
        let (_, duplicates) = flatten_options(&options);
        assert_eq!(duplicates, vec!["a.b".to_string()]);
    }
}
