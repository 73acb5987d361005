//! Manifest keys of device release: where the kubelet's PodResources socket
//! is (`pod_resources_socket`), how often it is asked who holds which
//! device (`pod_resources_interval`), and where the container runtime's CRI
//! socket is (`runtime_socket`), asked whether a device's last holder has
//! exited before its release hook runs. See `release`, `podresources` and
//! `containers` in the host.

use std::path::{Path, PathBuf};

use toml::Spanned;

use super::model::{DEFAULT_POD_RESOURCES_SOCKET, DEFAULT_RUNTIME_SOCKET, MAX_SOCKET_PATH};
use super::source::Diagnostics;

/// `pod_resources_socket`, resolved against the manifest's folder like the
/// other paths. A missing socket is not an error here: it is the normal case
/// on old kubelets, and the host logs it once at run time.
pub(super) fn socket(value: &Option<Spanned<String>>, base: &Path, diags: &mut Diagnostics<'_>) -> PathBuf {
    socket_path(value, "pod_resources_socket", "the kubelet's default", DEFAULT_POD_RESOURCES_SOCKET, base, diags)
}

/// `runtime_socket`: the CRI socket of the node's container runtime. Missing
/// at run time is not an error either (the host warns once and releases
/// without asking).
pub(super) fn runtime_socket(value: &Option<Spanned<String>>, base: &Path, diags: &mut Diagnostics<'_>) -> PathBuf {
    socket_path(value, "runtime_socket", "containerd's default", DEFAULT_RUNTIME_SOCKET, base, diags)
}

fn socket_path(
    value: &Option<Spanned<String>>,
    key: &str,
    default_is: &str,
    default: &str,
    base: &Path,
    diags: &mut Diagnostics<'_>,
) -> PathBuf {
    let Some(text) = value else { return PathBuf::from(default) };
    if text.get_ref().is_empty() {
        let message = format!("the path is empty; leave {key} out for {default_is}");
        diags.error(text.span(), key, message);
        return PathBuf::from(default);
    }
    let path = base.join(text.get_ref());
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        let message = format!(
            "the socket path {} is {len} bytes long; a unix socket path may have at most {MAX_SOCKET_PATH} bytes",
            path.display()
        );
        diags.error(text.span(), key, message);
    }
    path
}

#[cfg(test)]
mod tests {
    use crate::manifest::{DEFAULT_POD_RESOURCES_INTERVAL, Manifest, ManifestErrors};
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    const PATH: &str = "/etc/devhost/devhost.toml";

    fn parse(text: &str) -> Result<Manifest, ManifestErrors> {
        Manifest::parse(text, Path::new(PATH), None)
    }

    fn only_error(text: &str) -> String {
        match parse(text) {
            Ok(m) => panic!("expected an error, got {m:?}"),
            Err(ManifestErrors(d)) if d.len() == 1 => d[0].to_string(),
            Err(ManifestErrors(d)) => panic!("expected one error, got {d:?}"),
        }
    }

    #[test]
    fn defaults_are_the_kubelets_socket_and_two_seconds() {
        let m = parse("").unwrap();
        assert_eq!(m.pod_resources_socket, PathBuf::from("/var/lib/kubelet/pod-resources/kubelet.sock"));
        assert_eq!(m.runtime_socket, PathBuf::from("/run/containerd/containerd.sock"));
        assert_eq!(
            (m.pod_resources_interval, DEFAULT_POD_RESOURCES_INTERVAL),
            (Duration::from_secs(2), m.pod_resources_interval)
        );
    }

    #[test]
    fn keys_are_read_and_relative_paths_resolved() {
        let m = parse("pod_resources_socket = \"run/pr.sock\"\npod_resources_interval = \"500ms\"\n").unwrap();
        assert_eq!(m.pod_resources_socket, PathBuf::from("/etc/devhost/run/pr.sock"));
        assert_eq!(m.pod_resources_interval, Duration::from_millis(500));
        let m = parse("pod_resources_socket = \"/abs/kubelet.sock\"\npod_resources_interval = 5\n").unwrap();
        assert_eq!(
            (m.pod_resources_socket, m.pod_resources_interval),
            (PathBuf::from("/abs/kubelet.sock"), Duration::from_secs(5))
        );
    }

    #[test]
    fn empty_socket_path_is_an_error_at_its_value() {
        let error = only_error("pod_resources_socket = \"\"\n");
        assert!(error.starts_with(&format!("{PATH}:1:24: pod_resources_socket: the path is empty")), "{error}");
    }

    #[test]
    fn overlong_socket_path_is_an_error_naming_the_length() {
        let long = format!("/{}/kubelet.sock", "d".repeat(100));
        let error = only_error(&format!("\n\npod_resources_socket = \"{long}\"\n"));
        assert!(
            error.starts_with(&format!("{PATH}:3:24: pod_resources_socket: the socket path {long} is 114 bytes")),
            "{error}"
        );
    }

    #[test]
    fn bad_intervals_are_errors_at_their_value() {
        let error = only_error("pod_resources_interval = \"0s\"\n");
        assert!(error.starts_with(&format!("{PATH}:1:26: pod_resources_interval: duration `0s` is zero")), "{error}");
        let error = only_error("pod_resources_interval = \"soon\"\n");
        assert!(error.contains("pod_resources_interval: `soon` is not a duration"), "{error}");
    }
}
