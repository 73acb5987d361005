//! A module file read once into a private sealed copy ([`Image`], a memfd), with what the file
//! was then ([`Source`]: identity and SHA-256, to tell on a reload whether it changed), and the
//! trust policy applied to exactly the bytes read ([`open_trusted`]).
//! Whatever happens to the file afterwards, what was checked is what gets loaded, here or in an
//! isolated worker that inherits the copy.

use super::error::LoadError;
use super::trust::{TrustError, file_problems};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The file behind a module: where it was read from, what it was then
/// (identity and SHA-256), to tell on a reload whether it changed since.
#[derive(Clone, Debug)]
pub struct Source {
    /// The file as named (symbolic links resolved).
    pub path: PathBuf,
    /// Lower-case hex SHA-256 of the bytes that were loaded: taken while the
    /// file is read when a pin is to be checked, otherwise only when first
    /// asked for (from the sealed copy, so it is still exactly those bytes),
    /// which keeps hashing out of every start.
    sha256: std::sync::Arc<std::sync::OnceLock<String>>,
    /// The sealed copy the hash is taken from (none for a worker's view).
    bytes: Option<std::sync::Arc<OwnedFd>>,
    id: FileId,
}

impl PartialEq for Source {
    fn eq(&self, other: &Self) -> bool {
        self.path == other.path && self.id == other.id && self.sha256() == other.sha256()
    }
}

impl Eq for Source {}

impl Source {
    /// A worker process's view: the host read the file and kept its facts.
    pub(crate) fn inherited(path: &Path) -> Source {
        Source { path: path.to_path_buf(), sha256: Default::default(), bytes: None, id: (0, 0, 0, 0, 0) }
    }

    /// Lower-case hex SHA-256 of the bytes that were loaded (empty in a
    /// worker's view, or if the sealed copy cannot be read).
    pub fn sha256(&self) -> &str {
        self.sha256.get_or_init(|| {
            let Some(fd) = &self.bytes else { return String::new() };
            fd.try_clone().map(std::fs::File::from).and_then(sha256_read).unwrap_or_default()
        })
    }

    /// Whether the file at `path` now holds other bytes than those loaded
    /// (overwritten in place, replaced by a rename, or removed). A file
    /// that was only touched keeps its hash and counts as unchanged.
    pub fn changed_on_disk(&self) -> bool {
        if file_id(&self.path) == Some(self.id) {
            return false;
        }
        sha256_file(&self.path).map_or(true, |now| now != self.sha256())
    }
}

/// A module's bytes, read once from its file into a sealed memfd that no
/// one can write: what is checked is exactly what is loaded, in this
/// process or in an isolated worker that inherits the descriptor.
#[derive(Debug)]
pub struct Image {
    pub source: Source,
    pub(super) fd: OwnedFd,
    /// Trust problems of the file, found while reading it.
    problems: Vec<TrustError>,
}

impl Image {
    /// Reads the file at `path` and notes (without refusing) what makes it
    /// untrusted; the pin is compared with the bytes read.
    pub fn read(path: &Path) -> Result<Image, LoadError> {
        Self::read_pinned(path, None)
    }

    fn read_pinned(path: &Path, pin: Option<&str>) -> Result<Image, LoadError> {
        use std::os::unix::fs::MetadataExt;
        let read_err = |e: std::io::Error| LoadError::Read { path: path.to_path_buf(), detail: e.to_string() };
        let real = std::fs::canonicalize(path).map_err(read_err)?;
        let mut file = std::fs::File::open(&real).map_err(read_err)?;
        // The descriptor's own metadata: the file whose bytes are read.
        let meta = file.metadata().map_err(read_err)?;
        let mut problems = file_problems(&real, &meta, "module file");
        let copy_err = |e: std::io::Error| LoadError::Copy { path: real.clone(), detail: e.to_string() };
        let fd = memfd(&real).map_err(copy_err)?;
        let mut out = std::fs::File::from(fd);
        // File to file: the kernel copies (copy_file_range or sendfile), no pass through here.
        std::io::copy(&mut file, &mut out).map_err(read_err)?;
        let fd = OwnedFd::from(out);
        let seals = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor we own.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } == -1 {
            return Err(copy_err(std::io::Error::last_os_error()));
        }
        let id = (meta.dev(), meta.ino(), meta.mtime(), meta.mtime_nsec(), meta.size());
        let source = Source {
            path: real.clone(),
            sha256: Default::default(),
            bytes: Some(std::sync::Arc::new(fd.try_clone().map_err(copy_err)?)),
            id,
        };
        // A pin is checked on the sealed bytes, the ones that get loaded.
        if let Some(expected) = pin {
            let found = fd.try_clone().map(std::fs::File::from).and_then(sha256_read).map_err(read_err)?;
            if !found.eq_ignore_ascii_case(expected) {
                problems.push(TrustError::Sha256 {
                    path: real.clone(),
                    expected: expected.to_string(),
                    found: found.clone(),
                });
            }
            let _ = source.sha256.set(found);
        }
        Ok(Image { source, fd, problems })
    }

    /// The sealed copy, for a worker process to receive.
    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }
}

/// An anonymous, sealable, close-on-exec memory file named after the module
/// (the name shows in /proc/PID/maps as `/memfd:NAME (deleted)`).
fn memfd(path: &Path) -> std::io::Result<OwnedFd> {
    let base = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let name = std::ffi::CString::new(format!("devhost:{base}").replace('\0', "")).unwrap_or_default();
    // SAFETY: name is a valid C string; the flags are plain bits.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd == -1 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// What identifies the file behind a path: a replaced or rewritten file
/// has a new inode, modification time or size.
type FileId = (u64, u64, i64, i64, u64);

fn file_id(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.size()))
}

/// Whether `a` and `b` hold the same bytes of one file. The same file
/// identity (device, inode, modification time, size) is taken as the same
/// bytes, as on a reload; hashes are compared only when it differs.
pub(super) fn same_bytes(a: &Source, b: &Source) -> bool {
    a.path == b.path && (a.id == b.id || a.sha256() == b.sha256())
}

/// Checks that a module file, and the folder holding it, can only have
/// been written by root (or the user the daemon runs as), and that its
/// SHA-256 matches the manifest's pin if there is one. Symbolic links are
/// followed: the file that would be loaded is the one checked.
pub fn check_trust(path: &Path, sha256_pin: Option<&str>) -> Result<(), Vec<TrustError>> {
    let image = inspect(path, sha256_pin).map_err(|e| vec![e])?;
    if image.problems.is_empty() { Ok(()) } else { Err(image.problems) }
}

fn inspect(path: &Path, sha256_pin: Option<&str>) -> Result<Image, TrustError> {
    Image::read_pinned(path, sha256_pin).map_err(|e| {
        let detail = match e {
            LoadError::Read { detail, .. } | LoadError::Copy { detail, .. } => detail,
            other => other.to_string(),
        };
        TrustError::Inspect { path: path.to_path_buf(), detail }
    })
}

/// Applies the trust policy to a module file: Ok when it is trusted, or
/// when the operator relaxed the checks (then logged loudly); an error text
/// otherwise. A sha256 pin is an explicit operator request and never relaxed.
pub fn enforce_trust(path: &Path, sha256_pin: Option<&str>, allow_untrusted: bool, driver: &str) -> Result<(), String> {
    open_trusted(path, sha256_pin, allow_untrusted, driver).map(drop)
}

/// Reads a module file once into a private sealed copy and applies the
/// trust policy (see [`enforce_trust`]) to exactly the bytes read: the
/// returned [`Image`] is what gets loaded, whatever happens to the file.
pub fn open_trusted(
    path: &Path,
    sha256_pin: Option<&str>,
    allow_untrusted: bool,
    driver: &str,
) -> Result<Image, String> {
    let image = inspect(path, sha256_pin).map_err(|e| format!("untrusted module: {e}"))?;
    if image.problems.is_empty() {
        return Ok(image);
    }
    let text: Vec<String> = image.problems.iter().map(|p| p.to_string()).collect();
    let pinned = image.problems.iter().any(|p| matches!(p, TrustError::Sha256 { .. }));
    if !allow_untrusted || pinned {
        return Err(format!("untrusted module: {}", text.join("; ")));
    }
    tracing::warn!(driver, "LOADING AN UNTRUSTED MODULE (allow_untrusted_modules is set): {}", text.join("; "));
    Ok(image)
}

/// The SHA-256 of a file as lower-case hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    sha256_read(std::fs::File::open(path)?)
}

/// The SHA-256 of what `f` holds from its start, as lower-case hex, whatever
/// its position (the offset of a shared descriptor moves).
fn sha256_read(f: std::fs::File) -> std::io::Result<String> {
    use sha2::Digest;
    use std::os::unix::fs::FileExt;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut at = 0u64;
    loop {
        let n = f.read_at(&mut buf, at)?;
        if n == 0 {
            break;
        }
        at += n as u64;
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
