//! Which kubelet API serves a resource (`api`: the Device Plugin API or Dynamic Resource
//! Allocation), the DRA driver name a DRA resource is published under (`dra_driver`, or one
//! derived from the resource name), and the rule that a device is served by exactly one API.

use std::collections::BTreeMap;

use toml::Spanned;

use super::model::{ResourceApi, ResourceConfig, TaintEffect};
use super::source::Diagnostics;

/// Longest DRA driver name the API server accepts (`DriverNameMaxLength`).
pub const MAX_DRA_DRIVER_NAME: usize = 63;

/// `dra_taint_effect` of a resource: only with `api = "dra"`, `"NoSchedule"` (the default) or
/// `"NoExecute"`.
pub(super) fn taint_effect(
    value: Option<&Spanned<String>>,
    api: &ResourceApi,
    section: &str,
    diags: &mut Diagnostics<'_>,
) -> TaintEffect {
    let Some(value) = value else { return TaintEffect::default() };
    let field = format!("{section}.dra_taint_effect");
    if api.dra_driver().is_none() {
        diags.error(value.span(), &field, "only applies with api = \"dra\"");
        return TaintEffect::default();
    }
    match value.get_ref().as_str() {
        "NoSchedule" => TaintEffect::NoSchedule,
        "NoExecute" => TaintEffect::NoExecute,
        other => {
            let message = format!("unknown taint effect {other:?}; expected \"NoSchedule\" or \"NoExecute\"");
            diags.error(value.span(), &field, message);
            TaintEffect::default()
        }
    }
}

/// The DRA driver name derived from a (valid) extended resource name `<domain>/<name>`: the
/// name part lower-cased, every character other than a letter, digit, `-` or `.` turned into `-`,
/// then `.<domain>`. `nvidia.com/h100` → `h100.nvidia.com`, `example.com/Big_GPU` →
/// `big-gpu.example.com`. The result still has to pass [`check_dra_driver_name`].
pub fn derive_dra_driver_name(resource: &str) -> String {
    let (domain, name) = resource.split_once('/').unwrap_or(("", resource));
    let name: String = name
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.') { c } else { '-' })
        .collect();
    if domain.is_empty() { name } else { format!("{name}.{domain}") }
}

/// A DRA driver name is a lower-case DNS subdomain of at most 63 characters (the API server's
/// rule for `ResourceSlice.spec.driver`) that starts with a letter (a CDI vendor's rule: the
/// CDI kind of prepared claims is `<driver>/claim`).
pub fn check_dra_driver_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the DRA driver name is empty".to_owned());
    }
    if name.len() > MAX_DRA_DRIVER_NAME {
        return Err(format!(
            "the DRA driver name `{name}` is {} characters long; at most {MAX_DRA_DRIVER_NAME} are allowed",
            name.len()
        ));
    }
    let rule = "a DRA driver name is a DNS subdomain: dot-separated labels of lower-case letters, digits and '-', \
                each starting and ending with a letter or digit, e.g. `gpu.example.com`";
    for label in name.split('.') {
        let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
        let chars_ok = label.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if label.is_empty() || !chars_ok || !alnum(label.chars().next()) || !alnum(label.chars().last()) {
            return Err(format!("`{name}` is not a valid DRA driver name; {rule}"));
        }
    }
    // Prepared claims get the CDI kind `<driver>/claim`, and a CDI vendor starts with a letter.
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        return Err(format!(
            "the DRA driver name `{name}` starts with a digit; devhost names the CDI kind of its claims \
             `{name}/claim`, and a CDI vendor must start with a letter"
        ));
    }
    Ok(())
}

/// Longest node name the API server accepts (a DNS subdomain).
pub const MAX_NODE_NAME: usize = 253;

/// Whether `name` is a lower-case DNS subdomain (dot-separated labels of letters, digits and
/// `-`, each starting and ending with a letter or digit).
fn is_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.split('.').all(|label| {
            let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
            label.len() <= 63
                && label.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && alnum(label.chars().next())
                && alnum(label.chars().last())
        })
}

/// The top-level `node_name`: a node name as the API server spells it.
pub(super) fn node_name(value: &Option<Spanned<String>>, diags: &mut Diagnostics<'_>) -> Option<String> {
    let value = value.as_ref()?;
    let name = value.get_ref();
    if name.len() > MAX_NODE_NAME || !is_subdomain(name) {
        diags.error(
            value.span(),
            "node_name",
            format!(
                "`{name}` is not a node name; a node name is a lower-case DNS subdomain of at most {MAX_NODE_NAME} \
                 characters, as `kubectl get nodes` shows it"
            ),
        );
        return None;
    }
    Some(name.clone())
}

/// `api` and `dra_driver` of one resource. `name_ok`: the resource name itself passed its check
/// (a bad name is reported once, at the name, not again as a bad derived driver name).
pub(super) fn api(
    api: Option<&Spanned<String>>,
    dra_driver: Option<&Spanned<String>>,
    name: &Spanned<String>,
    name_ok: bool,
    section: &str,
    diags: &mut Diagnostics<'_>,
) -> ResourceApi {
    let dra = match api {
        None => false,
        Some(value) => match value.get_ref().as_str() {
            "device-plugin" => false,
            "dra" => true,
            other => {
                let message = format!("unknown api {other:?}; expected \"device-plugin\" or \"dra\"");
                diags.error(value.span(), &format!("{section}.api"), message);
                return ResourceApi::DevicePlugin;
            }
        },
    };
    let field = format!("{section}.dra_driver");
    match (dra, dra_driver) {
        (false, Some(driver)) => {
            diags.error(driver.span(), &field, "only applies with api = \"dra\"");
            ResourceApi::DevicePlugin
        }
        (false, None) => ResourceApi::DevicePlugin,
        (true, Some(driver)) => {
            if let Err(why) = check_dra_driver_name(driver.get_ref()) {
                diags.error(driver.span(), &field, why);
            }
            ResourceApi::Dra { driver_name: driver.get_ref().clone() }
        }
        (true, None) => {
            let derived = derive_dra_driver_name(name.get_ref());
            if name_ok && let Err(why) = check_dra_driver_name(&derived) {
                let message = format!(
                    "the DRA driver name derived from `{}` is unusable: {why}; set `dra_driver` to a valid one",
                    name.get_ref()
                );
                let span = api.map_or(name.span(), Spanned::span);
                diags.error(span, &format!("{section}.api"), message);
            }
            ResourceApi::Dra { driver_name: derived }
        }
    }
}

/// Devices of one driver instance selected by two of its resources where either is served
/// through DRA: a device is served by exactly one API, so `devhost check` refuses these. One
/// message per device and pair, naming both resources with their `file:line:column`.
/// `resources` is the whole manifest's list; only those of `driver` are looked at.
pub fn api_conflicts<'a>(
    resources: &[ResourceConfig],
    driver: &str,
    devices: impl IntoIterator<Item = (&'a str, &'a BTreeMap<String, String>)>,
) -> Vec<String> {
    let mine: Vec<&ResourceConfig> = resources.iter().filter(|r| r.driver == driver).collect();
    let mut problems = Vec::new();
    for (id, attrs) in devices {
        let selecting: Vec<&ResourceConfig> = mine.iter().copied().filter(|r| r.matches(id, attrs)).collect();
        for (i, first) in selecting.iter().enumerate() {
            for second in &selecting[i + 1..] {
                if first.api == ResourceApi::DevicePlugin && second.api == ResourceApi::DevicePlugin {
                    continue;
                }
                problems.push(format!(
                    "{}: device `{id}` of driver `{driver}` is selected by resource `{}` (api = \"{}\") and by \
                     resource `{}` (api = \"{}\", at {}); a device is served by exactly one API, so narrow one \
                     resource's `match`",
                    second.location,
                    second.name,
                    second.api.as_str(),
                    first.name,
                    first.api.as_str(),
                    first.location,
                ));
            }
        }
    }
    problems
}
