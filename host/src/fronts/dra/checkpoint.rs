//! What one DRA driver has prepared, kept in `<state_dir>/dra-<driver>.json` so that
//! NodePrepareResources stays idempotent and NodeUnprepareResources still knows a claim's devices
//! after a devhost restart (the kubelet asks again after its own restarts and after reboots).
//! Written atomically (a temporary file beside it, flushed, renamed over it). A file that cannot
//! be read as a checkpoint is set aside as `<name>.corrupt-<unix seconds>` and logged by name;
//! devhost then starts from an empty checkpoint instead of failing.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The checkpoint's format version (`version` in the file).
pub const VERSION: u32 = 1;
/// At most this many claims are kept per driver; Prepare refuses more.
pub const MAX_CLAIMS: usize = 4096;
/// A checkpoint file larger than this is not read (set aside as corrupt).
pub const MAX_FILE_BYTES: u64 = 32 << 20;

/// One device of a prepared claim, as answered to the kubelet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedDevice {
    /// The driver's device ID.
    pub id: String,
    /// The request names (subrequest suffix dropped) the device was allocated for.
    pub requests: Vec<String>,
    pub pool: String,
    /// The DRA device name in the ResourceSlice.
    pub device: String,
    /// Fully-qualified CDI device IDs the container gets for this device.
    pub cdi_device_ids: Vec<String>,
    /// Prepared for admin access: shared with other claims, never released for this one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admin_access: bool,
}

/// One prepared claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreparedClaim {
    pub namespace: String,
    pub name: String,
    pub devices: Vec<PreparedDevice>,
    /// The claim's CDI spec file, if one was written (no edits at all: none).
    pub cdi_spec: Option<PathBuf>,
    /// The spec file's content, to write it again when it is gone (CDI folders on tmpfs).
    pub cdi_spec_content: Option<String>,
    /// The pods (in the claim's namespace) the claim was reserved for when it was prepared: while
    /// one of them still runs on the node, the claim is never taken for stale. Empty in entries
    /// written before devhost kept them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
}

impl PreparedClaim {
    /// The driver's device IDs the claim holds and its Unprepare releases: not those it got for
    /// admin access, which other claims may be using.
    pub fn device_ids(&self) -> Vec<String> {
        self.devices.iter().filter(|d| !d.admin_access).map(|d| d.id.clone()).collect()
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct File {
    version: u32,
    driver: String,
    claims: BTreeMap<String, PreparedClaim>,
}

/// The prepared claims of one DRA driver, by claim UID, and the file they are kept in.
#[derive(Debug)]
pub struct Checkpoint {
    driver: String,
    path: PathBuf,
    pub claims: BTreeMap<String, PreparedClaim>,
}

/// The checkpoint file of `driver` in `state_dir`.
pub fn path(state_dir: &Path, driver: &str) -> PathBuf {
    state_dir.join(format!("dra-{driver}.json"))
}

impl Checkpoint {
    /// Reads the checkpoint of `driver` from `state_dir`; a missing file is an empty
    /// checkpoint, an unreadable one is set aside (logged) and also gives an empty one.
    pub fn load(state_dir: &Path, driver: &str) -> Checkpoint {
        let path = path(state_dir, driver);
        let claims = match read(&path, driver) {
            Ok(Some(claims)) => {
                if !claims.is_empty() {
                    tracing::info!(dra_driver = driver, path = %path.display(), claims = claims.len(),
                        "DRA: going on from the checkpoint of prepared claims");
                }
                claims
            }
            Ok(None) => BTreeMap::new(),
            Err(why) => {
                set_aside(&path, driver, &why);
                BTreeMap::new()
            }
        };
        Checkpoint { driver: driver.to_owned(), path, claims }
    }

    /// The file this checkpoint is kept in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device IDs prepared for claims other than `uid`: device ID → (claim UID, claim).
    pub fn holder_of(&self, id: &str, except_uid: &str) -> Option<(&str, &PreparedClaim)> {
        self.claims
            .iter()
            .filter(|(uid, _)| uid.as_str() != except_uid)
            .find(|(_, c)| c.devices.iter().any(|d| d.id == id && !d.admin_access))
            .map(|(uid, c)| (uid.as_str(), c))
    }

    /// Writes the checkpoint atomically. The error names the file.
    pub fn save(&self) -> io::Result<()> {
        let file = File { version: VERSION, driver: self.driver.clone(), claims: self.claims.clone() };
        let mut bytes = serde_json::to_vec_pretty(&file).map_err(io::Error::other)?;
        bytes.push(b'\n');
        let named = |e: io::Error| io::Error::new(e.kind(), format!("DRA checkpoint {}: {e}", self.path.display()));
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(named)?;
        let temp = dir.join(format!(".dra-{}.json.{}.tmp", self.driver, std::process::id()));
        let written = write_synced(&temp, &bytes).and_then(|()| std::fs::rename(&temp, &self.path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&temp);
            return Err(named(e));
        }
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// The claims in the file at `path`, `None` when there is no file, or why it is not a
/// checkpoint of `driver`.
fn read(path: &Path, driver: &str) -> Result<Option<BTreeMap<String, PreparedClaim>>, String> {
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    if meta.len() > MAX_FILE_BYTES {
        return Err(format!("it is {} bytes long, more than the {MAX_FILE_BYTES} a checkpoint may have", meta.len()));
    }
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let file: File = serde_json::from_slice(&bytes).map_err(|e| format!("not a DRA checkpoint: {e}"))?;
    if file.version != VERSION {
        return Err(format!("format version {} is not {VERSION}", file.version));
    }
    if file.driver != driver {
        return Err(format!("it belongs to DRA driver {}", file.driver));
    }
    Ok(Some(file.claims))
}

/// Renames an unreadable checkpoint out of the way, so it is kept for a post-mortem and never
/// read again.
fn set_aside(path: &Path, driver: &str, why: &str) {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let aside = PathBuf::from(format!("{}.corrupt-{secs}", path.display()));
    match std::fs::rename(path, &aside) {
        Ok(()) => tracing::error!(dra_driver = driver, path = %path.display(), moved_to = %aside.display(),
            "DRA: the checkpoint of prepared claims cannot be read ({why}); set aside, starting with no prepared \
             claims (claims the kubelet prepares again are prepared anew)"),
        Err(e) => tracing::error!(dra_driver = driver, path = %path.display(),
            "DRA: the checkpoint of prepared claims cannot be read ({why}) nor set aside ({e}); starting with no \
             prepared claims"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(id: &str) -> PreparedClaim {
        PreparedClaim {
            namespace: "ns".into(),
            name: "c".into(),
            devices: vec![PreparedDevice {
                id: id.into(),
                requests: vec!["r".into()],
                pool: "node".into(),
                device: id.into(),
                cdi_device_ids: vec![format!("d.example.com/claim=u-{id}")],
                admin_access: false,
            }],
            cdi_spec: Some("/run/cdi/x.json".into()),
            cdi_spec_content: Some("{}".into()),
            pods: vec!["p".into()],
        }
    }

    #[test]
    fn an_entry_written_before_pods_were_kept_reads_as_no_pods() {
        let dir = tempfile::tempdir().unwrap();
        let mut cp = Checkpoint::load(dir.path(), "d.example.com");
        cp.claims.insert("uid-1".into(), claim("gpu-0"));
        cp.save().unwrap();
        let text = std::fs::read_to_string(cp.path()).unwrap();
        assert!(text.contains("\"pods\": [\n        \"p\"\n      ]"), "{text}");
        std::fs::write(cp.path(), text.replace(",\n      \"pods\": [\n        \"p\"\n      ]", "")).unwrap();
        let old = Checkpoint::load(dir.path(), "d.example.com");
        assert_eq!(old.claims["uid-1"].pods, Vec::<String>::new(), "{}", std::fs::read_to_string(cp.path()).unwrap());
        assert_eq!(old.claims["uid-1"].devices, cp.claims["uid-1"].devices);
    }

    #[test]
    fn a_saved_checkpoint_is_read_back_by_a_new_load() {
        let dir = tempfile::tempdir().unwrap();
        let mut cp = Checkpoint::load(dir.path(), "d.example.com");
        assert!(cp.claims.is_empty());
        cp.claims.insert("uid-1".into(), claim("gpu-0"));
        cp.save().unwrap();
        assert_eq!(cp.path(), dir.path().join("dra-d.example.com.json"));
        let mut again = Checkpoint::load(dir.path(), "d.example.com");
        assert_eq!(again.claims, cp.claims);
        assert_eq!(again.holder_of("gpu-0", "uid-2").map(|(u, _)| u), Some("uid-1"));
        assert!(again.holder_of("gpu-0", "uid-1").is_none(), "a claim does not conflict with itself");
        let mut admin = claim("gpu-1");
        admin.devices[0].admin_access = true;
        again.claims.insert("uid-3".into(), admin);
        assert!(again.holder_of("gpu-1", "uid-2").is_none(), "admin access holds no device");
        assert!(again.claims["uid-3"].device_ids().is_empty(), "nor does its Unprepare release it");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file is left behind");
    }

    #[test]
    fn a_corrupt_checkpoint_is_set_aside_and_an_empty_one_used() {
        let dir = tempfile::tempdir().unwrap();
        let file = path(dir.path(), "d.example.com");
        std::fs::write(&file, "{ not json").unwrap();
        let cp = Checkpoint::load(dir.path(), "d.example.com");
        assert!(cp.claims.is_empty());
        assert!(!file.exists());
        let aside: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(aside.len() == 1 && aside[0].starts_with("dra-d.example.com.json.corrupt-"), "{aside:?}");
        assert_eq!(std::fs::read_to_string(dir.path().join(&aside[0])).unwrap(), "{ not json");
    }

    #[test]
    fn another_drivers_checkpoint_is_not_taken_for_ours() {
        let dir = tempfile::tempdir().unwrap();
        let mut other = Checkpoint::load(dir.path(), "other.example.com");
        other.claims.insert("uid-1".into(), claim("gpu-0"));
        other.save().unwrap();
        std::fs::rename(path(dir.path(), "other.example.com"), path(dir.path(), "d.example.com")).unwrap();
        assert!(Checkpoint::load(dir.path(), "d.example.com").claims.is_empty());
    }
}
