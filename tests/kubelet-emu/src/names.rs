//! The two pieces of `RegisterRequest` the kubelet interprets itself: the
//! resource name, which must be an *extended* resource name, and the endpoint,
//! which is joined to the device-plugins directory like Go's
//! `filepath.Join` (join, then lexical clean).

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Longest DNS-1123 subdomain (the prefix of a qualified name).
const MAX_SUBDOMAIN_LEN: usize = 253;
/// Longest name part of a qualified name.
const MAX_NAME_LEN: usize = 63;
/// Quota prefix the kubelet glues onto the name before validating it.
const REQUESTS_PREFIX: &str = "requests.";

/// True when `name` is accepted by the kubelet as a device plugin resource.
pub fn is_extended_resource_name(name: &str) -> bool {
    check_extended_resource_name(name).is_ok()
}

/// Checks `name` the way the kubelet's `IsExtendedResourceName` does and says
/// why it is rejected.
///
/// Rules: it must have a domain prefix (contain `/`), must not be in the
/// reserved `kubernetes.io/` namespace, must not start with `requests.`, and
/// `requests.<name>` must be a qualified name: one `/`, a lower-case DNS-1123
/// subdomain before it, and 1–63 characters of `[A-Za-z0-9._-]` after it that
/// start and end alphanumeric.
pub fn check_extended_resource_name(name: &str) -> Result<(), String> {
    if !name.contains('/') {
        return Err("it has no domain prefix (expected e.g. \"vendor.com/device\"); \
                    unprefixed names are native resources"
            .to_string());
    }
    if name.contains("kubernetes.io/") {
        return Err("the kubernetes.io/ namespace is reserved for native resources".to_string());
    }
    if name.starts_with(REQUESTS_PREFIX) {
        return Err(format!("it must not start with {REQUESTS_PREFIX:?}"));
    }
    // The kubelet validates the quota form of the name, so the prefix length
    // limit includes "requests.".
    let quota = format!("{REQUESTS_PREFIX}{name}");
    let mut parts = quota.split('/');
    let (prefix, local) = match (parts.next(), parts.next(), parts.next()) {
        (Some(prefix), Some(local), None) => (prefix, local),
        _ => return Err("it must contain exactly one '/'".to_string()),
    };
    check_subdomain(prefix).map_err(|why| format!("prefix {:?} {why}", &prefix[REQUESTS_PREFIX.len()..]))?;
    check_name_part(local).map_err(|why| format!("name part {local:?} {why}"))
}

/// DNS-1123 subdomain: dot-separated labels of `[a-z0-9-]`, each starting and
/// ending alphanumeric, at most 253 characters in all.
fn check_subdomain(s: &str) -> Result<(), String> {
    if s.len() > MAX_SUBDOMAIN_LEN {
        return Err(format!("is longer than {MAX_SUBDOMAIN_LEN} characters"));
    }
    let label_ok = |label: &str| {
        let bytes = label.as_bytes();
        let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        match (bytes.first(), bytes.last()) {
            (Some(first), Some(last)) => alnum(first) && alnum(last) && bytes.iter().all(|b| alnum(b) || *b == b'-'),
            _ => false,
        }
    };
    if s.split('.').all(label_ok) {
        Ok(())
    } else {
        Err("is not a DNS-1123 subdomain (lower-case alphanumerics, '-' and '.', \
             each label starting and ending alphanumeric)"
            .to_string())
    }
}

/// Name part of a qualified name: 1–63 characters of `[A-Za-z0-9._-]`,
/// starting and ending alphanumeric.
fn check_name_part(s: &str) -> Result<(), String> {
    let bytes = s.as_bytes();
    let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
        return Err("is empty".to_string());
    };
    if bytes.len() > MAX_NAME_LEN {
        return Err(format!("is longer than {MAX_NAME_LEN} characters"));
    }
    let inner_ok = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
    if first.is_ascii_alphanumeric() && last.is_ascii_alphanumeric() && bytes.iter().all(inner_ok) {
        Ok(())
    } else {
        Err("must consist of alphanumerics, '-', '_' or '.', \
             and start and end with an alphanumeric"
            .to_string())
    }
}

/// `filepath.Join(dir, endpoint)` as Go computes it: concatenate with `/`
/// (an empty endpoint adds nothing), then remove `.` segments, empty segments
/// and `name/..` pairs without touching the file system. An absolute endpoint
/// therefore stays *inside* `dir`, while `..` can climb out of it.
pub fn join_endpoint(dir: &Path, endpoint: &str) -> PathBuf {
    let mut joined = dir.as_os_str().as_bytes().to_vec();
    if !endpoint.is_empty() {
        joined.push(b'/');
        joined.extend_from_slice(endpoint.as_bytes());
    }
    PathBuf::from(OsStr::from_bytes(&clean(&joined)))
}

/// Go's `path.Clean` on raw bytes.
fn clean(path: &[u8]) -> Vec<u8> {
    let rooted = path.first() == Some(&b'/');
    let mut kept: Vec<&[u8]> = Vec::new();
    for segment in path.split(|b| *b == b'/') {
        match segment {
            b"" | b"." => {}
            b".." => match kept.last() {
                Some(last) if *last != b".." => {
                    kept.pop();
                }
                // `..` at the root is the root; a relative path keeps it.
                _ if rooted => {}
                _ => kept.push(segment),
            },
            _ => kept.push(segment),
        }
    }
    let mut out = Vec::with_capacity(path.len());
    if rooted {
        out.push(b'/');
    }
    out.extend_from_slice(&kept.join(&b'/'));
    if out.is_empty() {
        out.push(b'.');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_vendor_names() {
        for name in [
            "nvidia.com/gpu",
            "example.com/GPU_x.1",
            "a/b",
            "x-1.y/z",
            "fpga.intel.com/region-ce48969398f05f33946d560708be108a",
        ] {
            assert_eq!(check_extended_resource_name(name), Ok(()), "{name}");
        }
    }

    #[test]
    fn rejects_what_the_kubelet_rejects() {
        for (name, why) in [
            ("gpu", "no domain prefix"),
            ("Example.com/gpu", "DNS-1123"),
            ("example.com/a/b", "exactly one '/'"),
            ("kubernetes.io/x", "reserved"),
            ("foo.kubernetes.io/x", "reserved"),
            ("requests.example.com/gpu", "requests."),
            ("/gpu", "DNS-1123"),
            ("example.com/", "is empty"),
            ("example.com/-gpu", "start and end"),
            ("example.com/gpu-", "start and end"),
            ("example.com/g+u", "alphanumerics"),
            ("example..com/gpu", "DNS-1123"),
            ("-example.com/gpu", "DNS-1123"),
            ("example_x.com/gpu", "DNS-1123"),
        ] {
            let err = check_extended_resource_name(name).expect_err(name);
            assert!(err.contains(why), "{name}: {err}");
        }
    }

    #[test]
    fn length_limits_match_qualified_names() {
        let name63 = format!("example.com/{}", "n".repeat(63));
        assert!(is_extended_resource_name(&name63));
        let name64 = format!("example.com/{}", "n".repeat(64));
        assert!(!is_extended_resource_name(&name64));
        // "requests." (9 characters) + domain must fit in 253, so 244 is the
        // longest domain the kubelet accepts.
        let domain = |len: usize| {
            let first = "d".repeat(len - 3 * 61);
            [first.as_str(), &"d".repeat(60), &"d".repeat(60), &"d".repeat(60)].join(".")
        };
        assert_eq!(domain(244).len(), 244);
        assert!(is_extended_resource_name(&format!("{}/x", domain(244))));
        assert!(!is_extended_resource_name(&format!("{}/x", domain(245))));
    }

    #[test]
    fn endpoint_is_joined_and_cleaned_like_go() {
        let dir = Path::new("/var/lib/kubelet/device-plugins/");
        let join = |e| join_endpoint(dir, e);
        assert_eq!(join("gpu.sock"), Path::new("/var/lib/kubelet/device-plugins/gpu.sock"));
        assert_eq!(join("/x/y.sock"), Path::new("/var/lib/kubelet/device-plugins/x/y.sock"));
        assert_eq!(join("./a//b.sock"), Path::new("/var/lib/kubelet/device-plugins/a/b.sock"));
        assert_eq!(join("../evil.sock"), Path::new("/var/lib/kubelet/evil.sock"));
        assert_eq!(join("../../../../../../x"), Path::new("/x"));
        assert_eq!(join(""), Path::new("/var/lib/kubelet/device-plugins"));
        assert_eq!(join_endpoint(Path::new("rel"), "../../a"), Path::new("../a"));
        assert_eq!(join_endpoint(Path::new("rel"), ".."), Path::new("."));
    }
}
