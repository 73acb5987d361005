//! What the manifest adds to a driver's failure: where each option the driver complains about is
//! written (`file:line:col` of its key), and, when a resource's `driver` names no declared
//! driver and no module is found for it, the declared driver with a similar name. Drivers only
//! see flattened `key = value` text, so their messages name keys; the manifest knows the spans.

use std::borrow::Cow;

use toml::Spanned;
use toml::de::DeValue;

use super::model::Manifest;
use super::source::Diagnostics;

/// Every flattened option key of a `[driver.X]` table (as [`super::values::flatten_options`]
/// names them) with the location of its key.
pub(super) fn option_locations(driver: &DeValue<'_>, diags: &Diagnostics<'_>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let DeValue::Table(table) = driver
        && let Some(options) = table.get("options")
        && let DeValue::Table(options) = options.get_ref()
    {
        for (key, value) in options.iter() {
            walk(key.get_ref().to_string(), key.span().start, value, diags, &mut out);
        }
    }
    out.sort();
    out
}

fn walk(
    key: String,
    at: usize,
    value: &Spanned<DeValue<'_>>,
    diags: &Diagnostics<'_>,
    out: &mut Vec<(String, String)>,
) {
    match value.get_ref() {
        DeValue::Table(table) => {
            for (sub, v) in table.iter() {
                walk(format!("{key}.{}", sub.get_ref()), sub.span().start, v, diags, out);
            }
        }
        DeValue::Array(items) if items.iter().any(|i| matches!(i.get_ref(), DeValue::Table(_) | DeValue::Array(_))) => {
            for (index, v) in items.iter().enumerate() {
                walk(format!("{key}.{index}"), v.span().start, v, diags, out);
            }
        }
        _ => out.push((key, diags.location(at))),
    }
}

/// The declared name nearest to `name` (at most 2 edits, and fewer than its length), if any.
pub(super) fn similar<'a>(name: &str, declared: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    declared
        .filter(|d| *d != name)
        .map(|d| (strsim::damerau_levenshtein(name, d), d))
        .filter(|(dist, _)| *dist <= 2 && *dist < name.chars().count())
        .min()
        .map(|(_, d)| d)
}

/// The option keys of `options` that `message` names: quoted as `"KEY"` or `` `KEY` ``.
fn named_keys<'a>(message: &str, options: &'a [(String, String)]) -> Vec<&'a (String, String)> {
    options
        .iter()
        .filter(|(key, _)| message.contains(&format!("\"{key}\"")) || message.contains(&format!("`{key}`")))
        .collect()
}

impl Manifest {
    /// `message` (why driver instance `driver` could not be loaded or created) with what the
    /// manifest knows: the location of every option it names, or a similar declared driver
    /// when no module file was found for a driver no `[driver.X]` table declares.
    pub fn explain_driver_failure<'m>(&self, driver: &str, message: &'m str) -> Cow<'m, str> {
        let mut notes = Vec::new();
        if message.contains("option")
            && let Some(options) = self.option_locations.get(driver)
        {
            let named = named_keys(message, options);
            if !named.is_empty() {
                let at: Vec<String> = named.iter().map(|(key, at)| format!("{at}: option \"{key}\"")).collect();
                notes.push(format!("in the manifest: {}", at.join(", ")));
            }
        }
        if message.contains("no module file found")
            && let Some(hint) = self.driver_hints.get(driver)
        {
            notes.push(format!(
                "{}: a resource names driver \"{driver}\", which no [driver.{driver}] table declares: did you mean \"{}\" (declared at {})?",
                hint.at, hint.similar, hint.similar_at
            ));
        }
        if notes.is_empty() { Cow::Borrowed(message) } else { Cow::Owned(format!("{message}; {}", notes.join("; "))) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn similar_names_are_a_few_edits_apart() {
        let declared = ["nvidia", "fpga", "tpu"];
        assert_eq!(similar("nvidai", declared.iter().copied()), Some("nvidia"));
        assert_eq!(similar("nvdia", declared.iter().copied()), Some("nvidia"));
        assert_eq!(similar("tp", declared.iter().copied()), Some("tpu"));
        assert_eq!(similar("acme-npu", declared.iter().copied()), None);
        // Two letters are not a typo of two other letters.
        assert_eq!(similar("ab", ["cd"].iter().copied()), None);
    }

    fn manifest(text: &str) -> Manifest {
        Manifest::parse(text, Path::new("/etc/devhost.toml"), None).expect("parses")
    }

    #[test]
    fn every_option_a_driver_names_is_located() {
        let m = manifest(
            "[driver.t]\nmodule = \"t.so\"\n[driver.t.options]\ncount = 2\n  prefx = \"a\"\n[driver.t.options.topo]\nnuma = 1\n[[resource]]\nname = \"t.com/x\"\ndriver = \"t\"\n",
        );
        let got = m.explain_driver_failure("t", "driver t: create failed: unknown options \"prefx\", \"topo.numa\"");
        assert_eq!(
            got,
            "driver t: create failed: unknown options \"prefx\", \"topo.numa\"; in the manifest: \
             /etc/devhost.toml:5:3: option \"prefx\", /etc/devhost.toml:7:1: option \"topo.numa\""
        );
        // A message that names no option is left as it is.
        assert_eq!(
            m.explain_driver_failure("t", "driver t: create failed: no device"),
            "driver t: create failed: no device"
        );
    }

    #[test]
    fn a_driver_typo_names_the_declared_driver() {
        let m = manifest(
            "[driver.nvidia]\nmodule = \"n.so\"\n[[resource]]\nname = \"nvidia.com/gpu\"\ndriver = \"nvidia\"\n[[resource]]\nname = \"nvidia.com/mig\"\ndriver = \"nvidai\"\n",
        );
        let got = m.explain_driver_failure("nvidai", "driver nvidai: no module file found (tried a.so)");
        assert!(got.contains("/etc/devhost.toml:8:10: a resource names driver \"nvidai\""), "{got}");
        assert!(got.contains("did you mean \"nvidia\" (declared at /etc/devhost.toml:1:1)?"), "{got}");
    }
}
