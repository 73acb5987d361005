//! What makes a module file untrusted ([`TrustError`]): who may write it or the folders above
//! it, who owns them, and a sha256 pin that does not match. A leaf: the sealed copy's reading
//! ([`super::image`]) notes these problems, the trust policy there decides what they refuse.

use std::path::{Path, PathBuf};

/// Why a module file is not trusted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrustError {
    #[error("{path}: cannot inspect: {detail}")]
    Inspect { path: PathBuf, detail: String },
    #[error("{path}: {what} is writable by {who} (mode {mode:04o}): they could replace the code devhost runs")]
    Writable { path: PathBuf, what: &'static str, who: &'static str, mode: u32 },
    #[error("{path}: {what} is owned by uid {uid}, not by root or the daemon's user (uid {euid})")]
    Owner { path: PathBuf, what: &'static str, uid: u32, euid: u32 },
    #[error("{path}: sha256 mismatch: the manifest pins {expected}, the file is {found}")]
    Sha256 { path: PathBuf, expected: String, found: String },
}

/// What makes the file `real` (whose open descriptor gave `meta`; a
/// module file, or the worker program, as `what` says) untrusted: its own
/// mode and owner, then its folder's and the folders' above it.
pub(crate) fn file_problems(real: &Path, meta: &std::fs::Metadata, what: &'static str) -> Vec<TrustError> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let mut problems = Vec::new();
    let folder = real.parent().unwrap_or(Path::new("/")).to_path_buf();
    let folder_meta = std::fs::metadata(&folder);
    let checked = [(real.to_path_buf(), what, Ok(meta.clone())), (folder.clone(), "its folder", folder_meta)];
    for (p, what, meta) in checked {
        let meta = match meta {
            Ok(m) => m,
            Err(e) => {
                problems.push(TrustError::Inspect { path: p, detail: e.to_string() });
                continue;
            }
        };
        let mode = meta.mode() & 0o7777;
        // Group/other write on the folder lets someone swap the file (or, with the
        // sticky bit, plant one the manifest names before it exists): refuse both.
        let writable = match (mode & 0o020 != 0, mode & 0o002 != 0) {
            (true, true) => Some("group and others"),
            (true, false) => Some("its group"),
            (false, true) => Some("others"),
            (false, false) => None,
        };
        if let Some(who) = writable {
            problems.push(TrustError::Writable { path: p.clone(), what, who, mode });
        }
        if meta.uid() != 0 && meta.uid() != euid {
            problems.push(TrustError::Owner { path: p.clone(), what, uid: meta.uid(), euid });
        }
    }
    // Folders above: whoever can rename one of them can swap the whole tree,
    // unless the sticky bit (as on /tmp) stops them renaming what is not theirs.
    for ancestor in folder.ancestors().skip(1) {
        let Ok(meta) = std::fs::metadata(ancestor) else { continue };
        let mode = meta.mode() & 0o7777;
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            let who = if mode & 0o002 != 0 { "others" } else { "its group" };
            problems.push(TrustError::Writable { path: ancestor.to_path_buf(), what: "a folder above it", who, mode });
        }
        if meta.uid() != 0 && meta.uid() != euid {
            problems.push(TrustError::Owner {
                path: ancestor.to_path_buf(),
                what: "a folder above it",
                uid: meta.uid(),
                euid,
            });
        }
    }
    problems
}
