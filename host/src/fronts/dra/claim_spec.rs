//! The CDI spec of one prepared claim: what the container runtime injects for the claim's
//! devices. Fixed here and documented in docs/features.md:
//! - kind `<DRA driver>/claim` (`gpu.example.com/claim`; `devhost check` refuses a driver name
//!   that cannot be a CDI vendor);
//! - one CDI device per allocated device, named `<claim UID>-<DRA device name>`, so the names of
//!   two claims never meet (the runtime sees every claim's spec under the same kind);
//! - file `devhost.dra_<driver>_<claim UID>.json` in the CDI folder (not the `devhost-` prefix
//!   of the per-resource specs, which devhost prunes as stale);
//! - each device carries its own scanned edits that the claim's composition kept, plus the
//!   claim-wide part: what the composition joined (`X_VISIBLE_DEVICES=0,1`) or the driver's
//!   allocate hook added or replaced. The runtime applies a spec's devices in turn, so the
//!   claim-wide part is on every device rather than at spec level, where a device's own value
//!   of the same key would win. Annotations have no CDI edit and are not delivered.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::driver::device::Edits;

/// The CDI kind of `driver`'s claims.
pub fn kind(driver: &str) -> String {
    format!("{driver}/claim")
}

/// The CDI device name of DRA device `device` in claim `uid`.
pub fn claim_device_name(uid: &str, device: &str) -> String {
    format!("{uid}-{device}")
}

/// The fully-qualified CDI device ID of DRA device `device` in claim `uid`.
pub fn qualified_name(driver: &str, uid: &str, device: &str) -> String {
    format!("{}={}", kind(driver), claim_device_name(uid, device))
}

/// The spec file of claim `uid` in `cdi_dir`.
pub fn path(cdi_dir: &Path, driver: &str, uid: &str) -> PathBuf {
    cdi_dir.join(format!("devhost.dra_{driver}_{uid}.json"))
}

/// The claim UID of a spec file named as [`path`] names `driver`'s specs; `None` for any other
/// file (another driver's, a temporary file, someone else's spec).
pub fn uid_of<'a>(file_name: &'a str, driver: &str) -> Option<&'a str> {
    let uid = file_name.strip_prefix("devhost.dra_")?.strip_prefix(driver)?.strip_prefix('_')?.strip_suffix(".json")?;
    (!uid.is_empty() && !uid.contains('_')).then_some(uid)
}

/// Each device's edits in the claim's spec: `devices` are (CDI device name, the device's own
/// scanned edits) and `total` the claim's composed and amended edits. A device keeps those of
/// its own edits that `total` kept unchanged; what `total` holds that no device has verbatim is
/// claim-wide and goes on every device.
pub fn split(devices: &[(String, &Edits)], total: &Edits) -> Vec<(String, Edits)> {
    let own: Vec<Edits> = devices
        .iter()
        .map(|(_, e)| Edits {
            device_nodes: e.device_nodes.iter().filter(|n| total.device_nodes.contains(n)).cloned().collect(),
            mounts: e.mounts.iter().filter(|m| total.mounts.contains(m)).cloned().collect(),
            envs: e.envs.iter().filter(|kv| total.envs.contains(kv)).cloned().collect(),
            ..Edits::default()
        })
        .collect();
    let claim_wide = Edits {
        device_nodes: total
            .device_nodes
            .iter()
            .filter(|n| !own.iter().any(|o| o.device_nodes.contains(n)))
            .cloned()
            .collect(),
        mounts: total.mounts.iter().filter(|m| !own.iter().any(|o| o.mounts.contains(m))).cloned().collect(),
        envs: total.envs.iter().filter(|kv| !own.iter().any(|o| o.envs.contains(kv))).cloned().collect(),
        ..Edits::default()
    };
    devices
        .iter()
        .zip(own)
        .map(|((name, _), mut edits)| {
            edits.device_nodes.extend(claim_wide.device_nodes.iter().cloned());
            edits.mounts.extend(claim_wide.mounts.iter().cloned());
            edits.envs.extend(claim_wide.envs.iter().cloned());
            (name.clone(), edits)
        })
        .collect()
}

/// The spec of a claim of `driver`, or `None` when no device has any edit (then no file is
/// written and the devices are answered without CDI IDs).
pub fn render(driver: &str, entries: &[(String, Edits)]) -> Option<String> {
    let bytes = crate::engine::cdi::render_entries(&kind(driver), entries)?;
    String::from_utf8(bytes).ok()
}

/// Writes `content` to `path` atomically (temporary file beside it, flushed, renamed), so a
/// runtime never reads half a spec. The error names the file.
pub fn write(path: &Path, content: &str) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let named = |e: io::Error| io::Error::new(e.kind(), format!("CDI spec {}: {e}", path.display()));
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(named)?;
    let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // No `.json` suffix: runtimes watching the folder load only `.json` and `.yaml` files.
    let temp = dir.join(format!(".{file}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&temp)?;
        f.write_all(content.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&temp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&temp);
        return Err(named(e));
    }
    Ok(())
}

/// Removes the spec at `path`; a file already gone is fine. The error names the file.
pub fn remove(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io::Error::new(e.kind(), format!("CDI spec {}: {e}", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::device::DeviceNode;

    #[test]
    fn uid_of_reads_back_only_this_drivers_spec_names() {
        let name = |uid: &str| {
            path(Path::new("/cdi"), "gpu.example.com", uid).file_name().unwrap().to_string_lossy().into_owned()
        };
        assert_eq!(uid_of(&name("3f2a-11"), "gpu.example.com"), Some("3f2a-11"));
        assert_eq!(uid_of(&name("3f2a-11"), "gpu.example"), None, "another driver's");
        assert_eq!(uid_of(&name("3f2a-11"), "example.com"), None);
        assert_eq!(uid_of(&format!(".{}.77.tmp", name("u")), "gpu.example.com"), None, "a temporary file");
        assert_eq!(uid_of("devhost.dra_gpu.example.com_.json", "gpu.example.com"), None);
        assert_eq!(uid_of("nvidia.yaml", "gpu.example.com"), None);
    }

    fn node(host: &str, container: &str) -> DeviceNode {
        DeviceNode { host_path: host.into(), container_path: container.into(), permissions: "rw".into() }
    }

    fn edits(nodes: Vec<DeviceNode>, envs: &[(&str, &str)]) -> Edits {
        Edits {
            device_nodes: nodes,
            envs: envs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Edits::default()
        }
    }

    #[test]
    fn each_device_keeps_its_own_edits_and_gets_the_claim_wide_ones() {
        let a = edits(vec![node("/dev/a", "/dev/a")], &[("VIS", "0"), ("SAME", "x")]);
        let b = edits(vec![node("/dev/b", "/dev/b")], &[("VIS", "1"), ("SAME", "x")]);
        // As device::compose and a hook would leave them: VIS joined, one key added by the hook.
        let total = edits(
            vec![node("/dev/a", "/dev/a"), node("/dev/b", "/dev/b")],
            &[("VIS", "0,1"), ("SAME", "x"), ("HOOK", "y")],
        );
        let split = split(&[("u-a".into(), &a), ("u-b".into(), &b)], &total);
        assert_eq!(split[0].0, "u-a");
        assert_eq!(split[0].1.device_nodes, [node("/dev/a", "/dev/a")], "only its own node");
        let env = |i: usize| split[i].1.envs.clone();
        let kv = |k: &str, v: &str| (k.to_string(), v.to_string());
        assert_eq!(env(0), [kv("SAME", "x"), kv("VIS", "0,1"), kv("HOOK", "y")]);
        assert_eq!(env(1), [kv("SAME", "x"), kv("VIS", "0,1"), kv("HOOK", "y")]);
        assert!(!env(0).contains(&kv("VIS", "0")), "a value the composition replaced is not kept");
    }

    #[test]
    fn the_spec_has_the_claim_kind_and_one_device_per_allocated_device() {
        let a = edits(vec![node("/dev/a", "/dev/a")], &[("K", "v")]);
        let text = render("gpu.example.com", &[("uid-1-gpu-0".into(), a)]).unwrap();
        let spec: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(spec["kind"], "gpu.example.com/claim");
        assert_eq!(spec["devices"][0]["name"], "uid-1-gpu-0");
        assert_eq!(spec["devices"][0]["containerEdits"]["env"][0], "K=v");
        assert_eq!(spec["devices"][0]["containerEdits"]["deviceNodes"][0]["hostPath"], "/dev/a");
        assert!(render("gpu.example.com", &[("n".into(), Edits::default())]).is_none(), "CDI forbids empty devices");
        assert_eq!(qualified_name("gpu.example.com", "uid-1", "gpu-0"), "gpu.example.com/claim=uid-1-gpu-0");
        crate::manifest::check_kind(&kind("gpu.example.com")).unwrap();
    }

    #[test]
    fn claim_specs_survive_the_pruning_of_stale_resource_specs() {
        let dir = tempfile::tempdir().unwrap();
        let file = path(dir.path(), "gpu.example.com", "uid-1");
        write(&file, "{}\n").unwrap();
        crate::engine::cdi::CdiWriter::new(dir.path()).remove_stale(&[]).unwrap();
        assert!(file.exists(), "{} was pruned", file.display());
        remove(&file).unwrap();
        remove(&file).unwrap();
        assert!(!file.exists());
    }
}
