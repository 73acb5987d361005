//! The kubelet's side of the battery: the module behind a real endpoint,
//! registered with the embedded kubelet emulator, as `devhost sim` runs it.
//! The kubelet must see every device, and an Allocate with an unknown or a
//! repeated ID must be refused before it reaches the driver.

use super::report::{Report, Verdict};
use crate::driver::device::Device;
use crate::engine::registry::Mode;
use crate::manifest::Manifest;
use crate::ops::daemon::Daemon;
use kubelet_emu::Kubelet;
use std::path::Path;
use std::time::Duration;

const RESOURCE: &str = "conformance.devhost.io/device";
const REGISTER_WAIT: Duration = Duration::from_secs(10);

fn quoted(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

/// A one-driver, one-resource manifest for the module, in `dir`.
fn manifest(dir: &Path, module: &Path, options: &[(String, String)]) -> Result<Manifest, String> {
    let module = std::path::absolute(module).map_err(|e| format!("{}: {e}", module.display()))?;
    let mut text = format!(
        "allow_untrusted_modules = true\n[driver.conformance]\nmodule = {}\n[driver.conformance.options]\n",
        quoted(&module.display().to_string())
    );
    for (k, v) in options {
        text.push_str(&format!("{} = {}\n", quoted(k), quoted(v)));
    }
    text.push_str(&format!("[[resource]]\nname = {}\ndriver = \"conformance\"\n", quoted(RESOURCE)));
    let path = dir.join("conformance.toml");
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut manifest = Manifest::load(&path, Some(dir)).map_err(|e| e.to_string())?;
    // Its lock and state live and die with the scratch folder, never in the node's folders.
    manifest.lock_dir = dir.join("lock");
    manifest.state_dir = dir.join("state");
    Ok(manifest)
}

pub(super) async fn kubelet_checks(r: &mut Report, module: &Path, options: &[(String, String)], devices: &[Device]) {
    const LISTED: &str = "kubelet sees every device";
    const REFUSED: &str = "unknown and duplicate IDs refused";
    let dir = match tempfile_dir() {
        Ok(d) => d,
        Err(e) => return r.add(LISTED, Verdict::Fail, e),
    };
    let manifest = match manifest(&dir.0, module, options) {
        Ok(m) => m,
        Err(e) => return r.add(LISTED, Verdict::Fail, format!("cannot write a manifest for the module: {e}")),
    };
    let kubelet = match Kubelet::start(&dir.0) {
        Ok(k) => k,
        Err(e) => return r.add(LISTED, Verdict::Fail, format!("cannot start the kubelet emulator: {e}")),
    };
    // The daemon `run` starts (without a kubelet's pod resources), on the scratch folder.
    let daemon = match Daemon::start(manifest, Mode::Simulate).await {
        Ok(d) => d,
        Err(e) => return r.add(LISTED, Verdict::Fail, format!("the daemon did not start: {e}")),
    };
    let wanted: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
    let listed = kubelet.wait_list_count(RESOURCE, 1, REGISTER_WAIT).await;
    let seen: Vec<String> = kubelet.devices(RESOURCE).unwrap_or_default().into_iter().map(|d| d.id).collect();
    match listed {
        Err(e) => r.add(LISTED, Verdict::Fail, format!("{RESOURCE}: {e}")),
        Ok(()) if seen != wanted => {
            r.add(LISTED, Verdict::Fail, format!("ListAndWatch sent {seen:?}, the scan {wanted:?}"))
        }
        Ok(()) => r.add(LISTED, Verdict::Pass, format!("registered; ListAndWatch sent {} device(s)", seen.len())),
    }
    match wanted.first() {
        None => r.add(REFUSED, Verdict::Skip, "no device to request"),
        Some(id) => {
            let unknown = kubelet.allocate(RESOURCE, vec![vec!["no-such-device-0".into()]]).await;
            let twice = kubelet.allocate(RESOURCE, vec![vec![id.clone(), id.clone()]]).await;
            let good = kubelet.allocate(RESOURCE, vec![vec![id.clone()]]).await;
            let invalid = |res: &Result<_, tonic::Status>| matches!(res, Err(s) if s.code() == tonic::Code::InvalidArgument || s.code() == tonic::Code::NotFound);
            if !invalid(&unknown) {
                r.add(REFUSED, Verdict::Fail, format!("Allocate([no-such-device-0]) was not refused: {unknown:?}"));
            } else if !invalid(&twice) {
                r.add(REFUSED, Verdict::Fail, format!("Allocate([{id}, {id}]) was not refused: {twice:?}"));
            } else if let Err(e) = good {
                r.add(REFUSED, Verdict::Fail, format!("Allocate([{id}]) after the refusals failed: {}", e.message()));
            } else {
                r.add(
                    REFUSED,
                    Verdict::Pass,
                    format!("both refused with INVALID_ARGUMENT; Allocate([{id}]) then answered"),
                );
            }
        }
    }
    daemon.shutdown().await;
    kubelet.stop();
}

/// A private folder for the kubelet emulator's sockets, removed on drop.
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir() -> Result<Scratch, String> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "devhost-conformance-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(Scratch(dir))
}
