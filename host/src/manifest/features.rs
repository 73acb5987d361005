//! Manifest keys of the features every vendor gets from the host: CDI spec files (`cdi_dir`), the
//! Node Feature Discovery file (`nfd_features_dir`), the
//! metrics endpoint (`metrics_addr`), and per resource sharing (`replicas`,
//! `one_replica_per_container`) and the Allocate answer's form (`device_list_strategy`). Each
//! check reports at the key's own line and column, like the rest of the manifest.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use toml::Spanned;

use super::model::DeviceListStrategy;
use super::source::Diagnostics;

/// The most IDs one device may be advertised as: a typo such as `replicas = 100000` would
/// otherwise build a device list larger than the kubelet's gRPC message limit.
pub(super) const MAX_REPLICAS: i64 = 1024;

/// `cdi_dir`, resolved against the manifest's folder like the other paths.
pub(super) fn cdi_dir(value: &Option<Spanned<String>>, base: &Path, diags: &mut Diagnostics<'_>) -> Option<PathBuf> {
    let dir = value.as_ref()?;
    if dir.get_ref().is_empty() {
        diags.error(dir.span(), "cdi_dir", "the path is empty; leave cdi_dir out to write no CDI specs");
        return None;
    }
    Some(base.join(dir.get_ref()))
}

/// `cdi_spec_dirs`, each resolved against the manifest's folder; the runtime's defaults when
/// left out.
pub(super) fn cdi_spec_dirs(
    value: &Option<Spanned<Vec<Spanned<String>>>>,
    base: &Path,
    diags: &mut Diagnostics<'_>,
) -> Vec<PathBuf> {
    let Some(dirs) = value else { return super::model::DEFAULT_CDI_SPEC_DIRS.iter().map(PathBuf::from).collect() };
    if dirs.get_ref().is_empty() {
        let message = "the list is empty; leave cdi_spec_dirs out for the runtime's defaults (/etc/cdi, /var/run/cdi)";
        diags.error(dirs.span(), "cdi_spec_dirs", message);
    }
    let mut out = Vec::new();
    for dir in dirs.get_ref() {
        if dir.get_ref().is_empty() {
            diags.error(dir.span(), "cdi_spec_dirs", "a path is empty");
        } else {
            out.push(base.join(dir.get_ref()));
        }
    }
    out
}

/// `nfd_features_dir`, resolved against the manifest's folder like the other paths.
pub(super) fn nfd_features_dir(
    value: &Option<Spanned<String>>,
    base: &Path,
    diags: &mut Diagnostics<'_>,
) -> Option<PathBuf> {
    let dir = value.as_ref()?;
    if dir.get_ref().is_empty() {
        diags.error(
            dir.span(),
            "nfd_features_dir",
            "the path is empty; leave nfd_features_dir out to write no NFD file",
        );
        return None;
    }
    Some(base.join(dir.get_ref()))
}

/// `metrics_addr`: an IP address and port. Host names are refused rather than resolved, so the
/// address the host listens on never depends on DNS at start.
pub(super) fn metrics_addr(value: &Option<Spanned<String>>, diags: &mut Diagnostics<'_>) -> Option<SocketAddr> {
    let text = value.as_ref()?;
    match text.get_ref().parse() {
        Ok(addr) => Some(addr),
        Err(_) => {
            let message = format!(
                "`{}` is not a socket address; write IP:PORT, e.g. \"0.0.0.0:9400\" or \"[::]:9400\" (host names \
                 are not accepted)",
                text.get_ref()
            );
            diags.error(text.span(), "metrics_addr", message);
            None
        }
    }
}

/// `replicas` of a resource: 1 (no sharing) unless set.
pub(super) fn replicas(value: Option<&Spanned<i64>>, section: &str, diags: &mut Diagnostics<'_>) -> u32 {
    let Some(n) = value else { return 1 };
    match u32::try_from(*n.get_ref()) {
        Ok(r) if (1..=MAX_REPLICAS).contains(&i64::from(r)) => r,
        _ => {
            let message =
                format!("replicas is {}; it must be a whole number from 1 (no sharing) to {MAX_REPLICAS}", n.get_ref());
            diags.error(n.span(), &format!("{section}.replicas"), message);
            1
        }
    }
}

/// `device_list_strategy` of a resource; `cdi` needs the top-level `cdi_dir`.
pub(super) fn strategy(
    value: Option<&Spanned<DeviceListStrategy>>,
    section: &str,
    cdi_dir_set: bool,
    diags: &mut Diagnostics<'_>,
) -> DeviceListStrategy {
    let Some(s) = value else { return DeviceListStrategy::default() };
    if *s.get_ref() == DeviceListStrategy::Cdi && !cdi_dir_set {
        let message = "device_list_strategy = \"cdi\" needs the top-level cdi_dir (the folder the container runtime \
                       reads CDI specs from, e.g. \"/var/run/cdi\")";
        diags.error(s.span(), &format!("{section}.device_list_strategy"), message);
    }
    *s.get_ref()
}

/// With `cdi_dir` set, the resource name is also the CDI kind of its spec file.
pub(super) fn cdi_kind(name: &Spanned<String>, section: &str, diags: &mut Diagnostics<'_>) {
    if let Err(why) = super::names::check_kind(name.get_ref()) {
        let message = format!("{why} (with cdi_dir set, the resource name is the kind of its CDI spec)");
        diags.error(name.span(), &format!("{section}.name"), message);
    }
}
