//! The taint an unhealthy device of a DRA resource carries in its ResourceSlice, and whether a
//! claim's allocation tolerates it. A leaf: the slices publish the taint, Prepare checks it.

use k8s_openapi::api::resource::v1::{DeviceTaint, DeviceToleration};

use crate::driver::device::Device;
use crate::manifest::TaintEffect;

/// Longest label value, which a taint's value must be.
const MAX_TAINT_VALUE: usize = 63;

/// The key of the taint an unhealthy device of DRA driver `driver` carries: `<driver>/unhealthy`.
pub fn taint_key(driver: &str) -> String {
    format!("{driver}/unhealthy")
}

/// The driver's health reason as a taint value (a label value): every character other than a
/// letter, digit, `-`, `_` or `.` becomes `-`, runs of `-` are one, both ends are alphanumeric,
/// at most 63 characters. `None` without a reason (or with nothing left of it).
pub fn taint_value(reason: Option<&str>) -> Option<String> {
    let mut value = String::new();
    for c in reason?.chars() {
        let c = if c.is_ascii_alphanumeric() || matches!(c, '_' | '.') { c } else { '-' };
        if !(c == '-' && value.ends_with('-')) {
            value.push(c);
        }
    }
    let trimmed: String =
        value.trim_matches(|c: char| !c.is_ascii_alphanumeric()).chars().take(MAX_TAINT_VALUE).collect();
    let trimmed = trimmed.trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    (!trimmed.is_empty()).then(|| trimmed.to_owned())
}

/// The health taint of `device`, unhealthy, for DRA driver `driver`.
pub fn health_taint(driver: &str, device: &Device, effect: TaintEffect) -> DeviceTaint {
    DeviceTaint {
        key: taint_key(driver),
        value: taint_value(device.health_reason.as_deref()),
        effect: effect.as_str().to_owned(),
        time_added: None,
    }
}

/// One toleration of a claim's request, as its allocation result copied it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Toleration {
    /// Empty: every key (with `exists`).
    pub key: String,
    /// Operator `Exists` (any value); else `Equal`, the default.
    pub exists: bool,
    pub value: String,
    /// Empty: every effect.
    pub effect: String,
}

impl From<&DeviceToleration> for Toleration {
    fn from(t: &DeviceToleration) -> Toleration {
        Toleration {
            key: t.key.clone().unwrap_or_default(),
            exists: t.operator.as_deref() == Some("Exists"),
            value: t.value.clone().unwrap_or_default(),
            effect: t.effect.clone().unwrap_or_default(),
        }
    }
}

/// Whether one of `tolerations` tolerates `taint`, by the API's rules: an empty effect matches
/// every effect, an empty key (with `Exists`) every key, `Exists` any value and `Equal` the
/// same value.
pub fn tolerates(tolerations: &[Toleration], taint: &DeviceTaint) -> bool {
    tolerations.iter().any(|t| {
        (t.effect.is_empty() || t.effect == taint.effect)
            && (t.key.is_empty() || t.key == taint.key)
            && (t.exists || t.value == taint.value.as_deref().unwrap_or_default())
    })
}
