//! Name rules of the manifest: extended resource names (checked the way the kubelet checks them at
//! registration, so a bad name fails at startup instead of in the kubelet log), driver instance
//! names, the socket file name derived from a resource name, and the glob syntax of `match`.

/// The kubelet prefixes a resource name with this before checking it as a qualified name.
const REQUESTS_PREFIX: &str = "requests.";
/// Longest DNS-1123 subdomain.
const MAX_SUBDOMAIN: usize = 253;
/// Longest name part of a qualified name.
const MAX_NAME_PART: usize = 63;

/// Checks `name` as the kubelet checks an extended resource name (`IsExtendedResourceName`):
/// `<domain>/<name>`, the domain a DNS-1123 subdomain, the name 1–63 characters of
/// `[A-Za-z0-9._-]` starting and ending alphanumeric, nothing containing `kubernetes.io/`, nothing
/// starting with `requests.`. The error says which rule failed.
pub fn check_resource_name(name: &str) -> Result<(), String> {
    if !name.contains('/') {
        return Err(format!("`{name}` has no domain; an extended resource name looks like `example.com/gpu`"));
    }
    if name.contains("kubernetes.io/") {
        return Err(format!("`{name}` contains `kubernetes.io/`, which is reserved for Kubernetes' own resources"));
    }
    if name.starts_with(REQUESTS_PREFIX) {
        return Err(format!("`{name}` starts with `{REQUESTS_PREFIX}`, which the kubelet rejects"));
    }
    let Some((domain, part)) = name.split_once('/') else {
        return Err(format!("`{name}` has no `/`"));
    };
    if part.contains('/') {
        return Err(format!("`{name}` contains more than one `/`"));
    }
    check_domain(domain).map_err(|why| format!("`{name}`: {why}"))?;
    check_name_part(part).map_err(|why| format!("`{name}`: {why}"))
}

/// The kubelet checks `requests.<domain>` as a DNS-1123 subdomain, so the usable domain length is
/// 253 minus the prefix.
fn check_domain(domain: &str) -> Result<(), String> {
    if domain.is_empty() {
        return Err("the domain before `/` is empty".to_owned());
    }
    let limit = MAX_SUBDOMAIN - REQUESTS_PREFIX.len();
    if domain.len() > limit {
        return Err(format!(
            "the domain is {} characters long; at most {limit} are allowed (the kubelet checks \
             `{REQUESTS_PREFIX}<domain>` against the {MAX_SUBDOMAIN}-character limit)",
            domain.len()
        ));
    }
    for label in domain.split('.') {
        let rule = "each dot-separated label of the domain must be lower-case letters, digits and \
                    '-', starting and ending with a letter or digit";
        if label.is_empty() {
            return Err(format!("the domain `{domain}` has an empty label; {rule}"));
        }
        if let Some(bad) = label.chars().find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')) {
            return Err(format!("the domain `{domain}` contains {bad:?}; {rule}"));
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!("the domain label `{label}` starts or ends with '-'; {rule}"));
        }
    }
    Ok(())
}

fn check_name_part(part: &str) -> Result<(), String> {
    let rule = "the part after `/` must be 1-63 characters of letters, digits, '.', '_' and '-', \
                starting and ending with a letter or digit";
    if part.is_empty() {
        return Err(format!("the part after `/` is empty; {rule}"));
    }
    if part.len() > MAX_NAME_PART {
        return Err(format!("the part after `/` is {} characters long; {rule}", part.len()));
    }
    if let Some(bad) = part.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(format!("the part after `/` contains {bad:?}; {rule}"));
    }
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !alnum(part.chars().next()) || !alnum(part.chars().last()) {
        return Err(format!("`{part}` does not start and end with a letter or digit; {rule}"));
    }
    Ok(())
}

/// Driver instance names end up in module file names (`libdevhost_<name>.so`) and log lines, so
/// they are kept to a safe alphabet.
pub(crate) fn check_driver_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the driver name is empty".to_owned());
    }
    if let Some(bad) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))) {
        return Err(format!("driver name `{name}` contains {bad:?}; only letters, digits, '_' and '-' are allowed"));
    }
    Ok(())
}

/// The socket file name for a resource: `devhost-<domain>_<name>.sock`, e.g. `nvidia.com/h100` →
/// `devhost-nvidia.com_h100.sock`. A valid domain never contains `_`, so two valid resource names
/// never share a socket. Characters a valid name cannot hold are replaced by `_`, so the result is
/// always a bare file name.
pub fn socket_name(resource: &str) -> String {
    let body: String = resource
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' })
        .collect();
    format!("devhost-{body}.sock")
}

/// Matches `text` against a glob: `*` is any run of characters (including none), `?` exactly one
/// character, everything else itself (case-sensitive). Runs in O(pattern × text) at worst, with no
/// recursion, so hostile patterns cannot blow the stack.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let pattern: Vec<char> = pattern.chars().collect();
    let text: Vec<char> = text.chars().collect();
    let (mut p, mut t) = (0, 0);
    // Where to resume after the most recent `*`: the pattern index after it and the text index
    // it is currently assumed to stop at.
    let mut resume: Option<(usize, usize)> = None;
    while let Some(&c) = text.get(t) {
        match pattern.get(p) {
            Some('*') => {
                resume = Some((p + 1, t));
                p += 1;
            }
            Some(&pc) if pc == '?' || pc == c => {
                p += 1;
                t += 1;
            }
            _ => match resume {
                // Let the last `*` swallow one more character and retry from there.
                Some((after_star, star_end)) => {
                    resume = Some((after_star, star_end + 1));
                    p = after_star;
                    t = star_end + 1;
                }
                None => return false,
            },
        }
    }
    pattern.get(p..).is_some_and(|rest| rest.iter().all(|&c| c == '*'))
}

/// The longest class (name segment of a CDI kind) CDI accepts.
const MAX_CLASS: usize = 63;

/// CDI's rule for the vendor and the class: a letter first, a letter or digit last, letters,
/// digits, `_`, `-` and `.` between.
fn check_segment(what: &str, s: &str) -> Result<(), String> {
    let first = s.chars().next().ok_or_else(|| format!("the {what} is empty"))?;
    if !first.is_ascii_alphabetic() {
        return Err(format!("the {what} `{s}` must start with a letter"));
    }
    if !s.chars().last().is_some_and(|c: char| c.is_ascii_alphanumeric()) {
        return Err(format!("the {what} `{s}` must end with a letter or digit"));
    }
    match s.chars().find(|&c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))) {
        Some(bad) => {
            Err(format!("the {what} `{s}` contains {bad:?}; only letters, digits, '_', '-' and '.' are allowed"))
        }
        None => Ok(()),
    }
}

/// Checks that a resource name can serve as a CDI kind (`<vendor>/<class>`). Every valid
/// extended resource name passes except those whose domain or name part starts with a digit.
pub fn check_kind(resource: &str) -> Result<(), String> {
    let Some((vendor, class)) = resource.split_once('/') else {
        return Err(format!("`{resource}` is not of the form <vendor>/<class> that a CDI kind needs"));
    };
    let why = check_segment("vendor", vendor).and_then(|()| check_segment("class", class)).and_then(|()| {
        if class.len() > MAX_CLASS {
            Err(format!("the class `{class}` is longer than {MAX_CLASS} characters"))
        } else {
            Ok(())
        }
    });
    why.map_err(|why| format!("`{resource}` cannot be a CDI kind: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_resource_names_pass() {
        for name in ["nvidia.com/gpu", "example.com/GPU_x.1", "a/b", "x-1.example.com/h100", "example.com/a"] {
            assert_eq!(check_resource_name(name), Ok(()), "{name}");
        }
    }

    #[test]
    fn resource_name_without_domain_is_rejected() {
        let err = check_resource_name("gpu").unwrap_err();
        assert!(err.contains("no domain"), "{err}");
    }

    #[test]
    fn resource_name_with_upper_case_domain_is_rejected() {
        let err = check_resource_name("Example.com/gpu").unwrap_err();
        assert!(err.contains("domain `Example.com` contains 'E'"), "{err}");
    }

    #[test]
    fn resource_name_with_two_slashes_is_rejected() {
        let err = check_resource_name("example.com/a/b").unwrap_err();
        assert!(err.contains("more than one `/`"), "{err}");
    }

    #[test]
    fn kubernetes_io_names_are_reserved() {
        for name in ["kubernetes.io/gpu", "foo.kubernetes.io/gpu", "a/kubernetes.io/b"] {
            let err = check_resource_name(name).unwrap_err();
            assert!(err.contains("reserved"), "{name}: {err}");
        }
    }

    #[test]
    fn requests_prefix_is_rejected() {
        let err = check_resource_name("requests.example.com/gpu").unwrap_err();
        assert!(err.contains("starts with `requests.`"), "{err}");
    }

    #[test]
    fn domain_labels_must_start_and_end_alphanumeric() {
        assert!(check_resource_name("-a.com/gpu").is_err());
        assert!(check_resource_name("a-.com/gpu").is_err());
        assert!(check_resource_name("a..com/gpu").is_err());
        assert!(check_resource_name("/gpu").unwrap_err().contains("empty"));
    }

    #[test]
    fn domain_length_counts_the_requests_prefix() {
        let label = "a".repeat(61);
        let long = [label.as_str(); 4].join("."); // 247 characters: fine alone, not with "requests."
        assert_eq!(long.len(), 247);
        let err = check_resource_name(&format!("{long}/gpu")).unwrap_err();
        assert!(err.contains("at most 244"), "{err}");
        let ok = &long[..244];
        assert_eq!(check_resource_name(&format!("{ok}/gpu")), Ok(()));
    }

    #[test]
    fn name_part_rules() {
        assert!(check_resource_name("a.com/").unwrap_err().contains("empty"));
        let long = "x".repeat(64);
        assert!(check_resource_name(&format!("a.com/{long}")).is_err());
        assert_eq!(check_resource_name(&format!("a.com/{}", "x".repeat(63))), Ok(()));
        assert!(check_resource_name("a.com/_gpu").is_err());
        assert!(check_resource_name("a.com/gpu.").is_err());
        assert!(check_resource_name("a.com/g pu").unwrap_err().contains("' '"));
    }

    #[test]
    fn driver_names_allow_only_safe_characters() {
        assert_eq!(check_driver_name("nvidia_2-b"), Ok(()));
        assert!(check_driver_name("").unwrap_err().contains("empty"));
        assert!(check_driver_name("../x").is_err());
        assert!(check_driver_name("a.b").is_err());
    }

    #[test]
    fn socket_name_is_readable_and_derived_from_the_resource() {
        assert_eq!(socket_name("nvidia.com/h100"), "devhost-nvidia.com_h100.sock");
        assert_eq!(socket_name("a/../b"), "devhost-a_.._b.sock");
    }

    #[test]
    fn glob_literals_and_wildcards() {
        assert!(glob_match("H100", "H100"));
        assert!(!glob_match("H100", "h100"));
        assert!(glob_match("*H100*", "NVIDIA H100 80GB HBM3"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a*", "a"));
        assert!(!glob_match("a*", "ba"));
        assert!(glob_match("?", "é"));
        assert!(!glob_match("?", ""));
        assert!(!glob_match("a?", "a"));
        assert!(glob_match("a*b*c", "axxbyybzc"));
        assert!(!glob_match("a*b*c", "axxbyyb"));
        assert!(glob_match("*.*", "x.y.z"));
        assert!(!glob_match("", "x"));
        assert!(glob_match("", ""));
    }

    #[test]
    fn glob_with_many_stars_is_fast() {
        let pattern = "*a".repeat(50) + "b";
        let text = "a".repeat(2000);
        assert!(!glob_match(&pattern, &text));
    }

    #[test]
    fn kinds_follow_cdi_rules() {
        for ok in ["nvidia.com/gpu", "example.com/GPU_x.1", "a/b"] {
            assert_eq!(check_kind(ok), Ok(()), "{ok}");
        }
        let err = check_kind("1x.example.com/gpu").unwrap_err();
        assert!(err.contains("vendor `1x.example.com` must start with a letter"), "{err}");
        let err = check_kind("example.com/1gpu").unwrap_err();
        assert!(err.contains("class `1gpu`"), "{err}");
    }
}
