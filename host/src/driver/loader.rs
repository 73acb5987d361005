//! Module loading: read a driver `.so` once into a private, sealed copy
//! ([`Image`], a memfd), check ownership, mode and the sha256 pin on exactly
//! those bytes, `dlopen` the copy, resolve its versioned entry symbol and
//! check the descriptor before anything else is called. The original file
//! can then be overwritten, truncated or replaced without touching the code
//! that runs. Modules are never unloaded: the library handle is leaked on
//! purpose, because driver threads and thread-local destructors may outlive
//! any call.

use devhost_abi as abi;
use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

/// A validated driver module.
#[derive(Clone, Copy)]
pub struct Module {
    pub desc: &'static abi::devhost_driver_desc,
    /// Bytes of the descriptor the driver declared (fields past it are absent).
    pub declared: usize,
    pub name: &'static str,
    pub version: &'static str,
    pub description: &'static str,
    /// The file the bytes were read from, as it was then.
    pub source: &'static Source,
}

/// Why a module could not be loaded. Every message names the file.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: module file not found")]
    Missing { path: PathBuf },
    #[error(
        "{path}: cannot be loaded (not an ELF shared object for this architecture, or a dependency is missing): {detail}"
    )]
    Dlopen { path: PathBuf, detail: String },
    #[error("{path}: no entry symbol `{symbol}` (not a devhost driver, or built for another ABI major)")]
    NoEntry { path: PathBuf, symbol: &'static str },
    #[error("{path}: entry symbol returned NULL")]
    NullDescriptor { path: PathBuf },
    #[error("{path}: wrong magic 0x{found:08x} in the driver descriptor (expected 0x{expected:08x})")]
    BadMagic { path: PathBuf, found: u32, expected: u32 },
    #[error("{path}: unsupported ABI major version {found} (this host supports {supported})")]
    Major { path: PathBuf, found: u16, supported: u16 },
    #[error("{path}: driver descriptor too small: {found} bytes declared, at least {min} required")]
    TooSmall { path: PathBuf, found: u32, min: usize },
    #[error("{path}: required function `{field}` is NULL in the driver descriptor")]
    MissingFunction { path: PathBuf, field: &'static str },
    #[error("{path}: cannot read the module file: {detail}")]
    Read { path: PathBuf, detail: String },
    #[error("{path}: cannot make a private copy of the module (memfd_create): {detail}")]
    Copy { path: PathBuf, detail: String },
    #[error(
        "{path}: cannot open its private copy through {proc_path}: /proc is not mounted here (devhost loads every module from a sealed copy through /proc/self/fd)"
    )]
    NoProc { path: PathBuf, proc_path: PathBuf },
    #[error("{path}: driver {field} is NULL or not valid UTF-8")]
    BadString { path: PathBuf, field: &'static str },
}

/// Loads and validates the module at `path` (a private copy of its bytes),
/// without the trust checks: see [`open_trusted`] for those.
pub fn load(path: &Path) -> Result<Module, LoadError> {
    if !path.exists() {
        return Err(LoadError::Missing { path: path.to_path_buf() });
    }
    let image = Image::read(path)?;
    load_image(&image)
}

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
    fd: OwnedFd,
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

/// What loading each file into this process gave, by the bytes loaded: the
/// same bytes are mapped once, as `dlopen` of one path always did, and a
/// module that mapped but failed its checks is not mapped again on every
/// reload.
type Loaded = Vec<(Source, Result<Module, LoadError>)>;
static LOADED: std::sync::Mutex<Loaded> = std::sync::Mutex::new(Vec::new());

/// Whether `a` and `b` hold the same bytes of one file. The same file
/// identity (device, inode, modification time, size) is taken as the same
/// bytes, as on a reload; hashes are compared only when it differs.
fn same_bytes(a: &Source, b: &Source) -> bool {
    a.path == b.path && (a.id == b.id || a.sha256() == b.sha256())
}

/// Loads an image into this process (once per file and content).
pub fn load_image(image: &Image) -> Result<Module, LoadError> {
    let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, done)) = loaded.iter().find(|(s, _)| same_bytes(s, &image.source)) {
        return done.clone();
    }
    // A descriptor of its own that stays open for good: glibc knows a
    // loaded object by its name, so /proc/self/fd/N must never name
    // another file while this one is mapped.
    let dup =
        image.fd.try_clone().map_err(|e| LoadError::Copy { path: image.source.path.clone(), detail: e.to_string() })?;
    let source: &'static Source = Box::leak(Box::new(image.source.clone()));
    let fd = dup.into_raw_fd();
    let result = load_fd(fd, &image.source.path, source);
    if let Err(LoadError::Dlopen { .. }) = result {
        // Nothing was mapped: the descriptor may go, and the next reload
        // tries again (a missing dependency may have been installed).
        // SAFETY: fd is ours (from into_raw_fd) and nothing else uses it.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
        return result;
    }
    loaded.push((image.source.clone(), result.clone()));
    result
}

/// Loads the sealed copy open as `fd` (kept open for good); messages name
/// `path`, the file it was read from. A worker process loads its module so.
pub fn load_fd(fd: RawFd, path: &Path, source: &'static Source) -> Result<Module, LoadError> {
    let p = || path.to_path_buf();
    let proc_path = PathBuf::from(format!("/proc/self/fd/{fd}"));
    if !Path::new("/proc/self/fd").is_dir() {
        return Err(LoadError::NoProc { path: p(), proc_path });
    }
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL;
    // SAFETY: loading a module runs its initialisers; loading driver code is
    // this daemon's job, and the trust checks happen before this call.
    let lib = unsafe { libloading::os::unix::Library::open(Some(&proc_path), flags) }.map_err(|e| {
        LoadError::Dlopen { path: p(), detail: dl_detail(&e).replace(&proc_path.display().to_string(), "module") }
    })?;
    // SAFETY: the symbol's type is fixed by the ABI for this name.
    let entry: abi::EntryFn = match unsafe { lib.get::<abi::EntryFn>(b"devhost_driver_entry_v1\0") } {
        Ok(sym) => *sym,
        Err(_) => return Err(LoadError::NoEntry { path: p(), symbol: abi::DEVHOST_ENTRY_SYMBOL_V1 }),
    };
    // Never dlclose: see the module docs.
    std::mem::forget(lib);
    // SAFETY: the entry point takes no arguments and returns a static descriptor.
    let raw = unsafe { entry() };
    if raw.is_null() {
        return Err(LoadError::NullDescriptor { path: p() });
    }
    // Read the fixed header first: magic and size decide how much else is valid.
    // SAFETY: every descriptor starts with magic and struct_size (u32 each).
    let (magic, size) = unsafe { ((*raw).magic, (*raw).struct_size) };
    if magic != abi::DEVHOST_DRIVER_MAGIC {
        return Err(LoadError::BadMagic { path: p(), found: magic, expected: abi::DEVHOST_DRIVER_MAGIC });
    }
    // SAFETY: the version fields follow the header in every 1.x descriptor.
    let major = unsafe { (*raw).abi_major };
    if major != abi::DEVHOST_ABI_MAJOR {
        return Err(LoadError::Major { path: p(), found: major, supported: abi::DEVHOST_ABI_MAJOR });
    }
    if (size as usize) < abi::DESC_MIN_SIZE_V1 {
        return Err(LoadError::TooSmall { path: p(), found: size, min: abi::DESC_MIN_SIZE_V1 });
    }
    // SAFETY: at least the v1.0 prefix is present; later fields are read only
    // through `Module::field_present`.
    let desc: &'static abi::devhost_driver_desc = unsafe { &*raw };
    for (field, present) in
        [("create", desc.create.is_some()), ("destroy", desc.destroy.is_some()), ("scan", desc.scan.is_some())]
    {
        if !present {
            return Err(LoadError::MissingFunction { path: p(), field });
        }
    }
    let name =
        static_str(desc.name).filter(|s| !s.is_empty()).ok_or(LoadError::BadString { path: p(), field: "name" })?;
    let version = static_str(desc.version).ok_or(LoadError::BadString { path: p(), field: "version" })?;
    let description = if desc.description.is_null() {
        ""
    } else {
        static_str(desc.description).ok_or(LoadError::BadString { path: p(), field: "description" })?
    };
    Ok(Module { desc, declared: size as usize, name, version, description, source })
}

/// What identifies the file behind a path: a replaced or rewritten file
/// has a new inode, modification time or size.
type FileId = (u64, u64, i64, i64, u64);

fn file_id(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.size()))
}

/// The whole error chain: the dlerror text may sit in the error or in its source (libloading
/// 0.8 puts it in the message, 0.9 in the source).
fn dl_detail(e: &libloading::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn static_str(p: *const std::ffi::c_char) -> Option<&'static str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the ABI requires static NUL-terminated strings; the module is never unloaded.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

macro_rules! optional_field {
    ($self:ident, $field:ident) => {
        if abi::field_present(
            $self.declared,
            std::mem::offset_of!(abi::devhost_driver_desc, $field),
            std::mem::size_of::<usize>(),
        ) {
            $self.desc.$field
        } else {
            None
        }
    };
}

impl Module {
    pub fn allocate(&self) -> Option<abi::IdsFn> {
        optional_field!(self, allocate)
    }
    pub fn preferred_allocation(&self) -> Option<abi::PreferredAllocationFn> {
        optional_field!(self, preferred_allocation)
    }
    pub fn pre_start(&self) -> Option<abi::IdsFn> {
        optional_field!(self, pre_start)
    }
    pub fn watch_start(&self) -> Option<abi::ScanFn> {
        optional_field!(self, watch_start)
    }
    pub fn watch_stop(&self) -> Option<abi::WatchStopFn> {
        optional_field!(self, watch_stop)
    }
    /// ABI 1.1; a 1.0 descriptor ends before it, so a 1.0 module has none.
    pub fn release(&self) -> Option<abi::IdsFn> {
        optional_field!(self, release)
    }
    /// Calls the driver's `create` with `options`. The instance pointer is
    /// non-null only when the status is OK: a failed create owns nothing, so
    /// nothing it left must ever reach `destroy`.
    ///
    /// # Safety
    /// `api` must point to a host API table that outlives the instance.
    pub unsafe fn create_instance(
        &self,
        api: *const abi::devhost_host_api,
        options: &[(String, String)],
    ) -> (abi::devhost_status, crate::driver::callbacks::CallState, *mut std::ffi::c_void) {
        use crate::driver::callbacks::{CallCtx, CallKind};
        let kvs: Vec<abi::devhost_kv> = options
            .iter()
            .map(|(k, v)| abi::devhost_kv { key: abi::devhost_str::from_str(k), value: abi::devhost_str::from_str(v) })
            .collect();
        let ctx = CallCtx::new(CallKind::Create);
        let mut out: *mut std::ffi::c_void = std::ptr::null_mut();
        let Some(create) = self.desc.create else { return (abi::DEVHOST_ERR_INTERNAL, ctx.into_state(), out) };
        // SAFETY: the API table outlives the call (contract), the options live
        // for the call, and out is a valid slot.
        let status = unsafe { create(api, kvs.as_ptr(), kvs.len(), ctx.as_raw(), &mut out) };
        let mut st = ctx.into_state();
        if status != abi::DEVHOST_OK {
            return (status, st, std::ptr::null_mut());
        }
        if out.is_null() {
            st.error = Some("create returned OK but no instance".into());
            return (abi::DEVHOST_ERR_INTERNAL, st, out);
        }
        (status, st, out)
    }

    /// Stops and destroys a live instance: `watch_stop` (when the driver has
    /// it), then `destroy`.
    ///
    /// # Safety
    /// `inst` must come from this module's `create`, no other call may run on
    /// it, and it must not be used afterwards.
    pub unsafe fn teardown(&self, inst: *mut std::ffi::c_void) {
        if inst.is_null() {
            return;
        }
        if let Some(stop) = self.watch_stop() {
            // SAFETY: per the function contract.
            unsafe { stop(inst) };
        }
        if let Some(destroy) = self.desc.destroy {
            // SAFETY: per the function contract; destroy is called exactly once.
            unsafe { destroy(inst) };
        }
    }

    pub fn concurrent(&self) -> bool {
        self.desc.capabilities & abi::DEVHOST_CAP_CONCURRENT != 0
    }

    /// Human-readable list of hooks and capability bits, for `devhost drivers`.
    pub fn capabilities(&self) -> Vec<&'static str> {
        let mut caps = Vec::new();
        if self.allocate().is_some() {
            caps.push("allocate");
        }
        if self.preferred_allocation().is_some() {
            caps.push("preferred_allocation");
        }
        if self.pre_start().is_some() {
            caps.push("pre_start");
        }
        if self.watch_start().is_some() {
            caps.push("watch");
        }
        if self.release().is_some() {
            caps.push("release");
        }
        if self.concurrent() {
            caps.push("concurrent");
        }
        caps
    }

    pub fn abi_version(&self) -> String {
        format!("{}.{}", self.desc.abi_major, self.desc.abi_minor)
    }

    /// The facts about this module that need no code: see [`ModuleInfo`].
    pub fn info(&self) -> ModuleInfo {
        ModuleInfo {
            name: self.name.to_string(),
            version: self.version.to_string(),
            description: self.description.to_string(),
            abi_major: self.desc.abi_major,
            abi_minor: self.desc.abi_minor,
            allocate: self.allocate().is_some(),
            preferred_allocation: self.preferred_allocation().is_some(),
            pre_start: self.pre_start().is_some(),
            watch: self.watch_start().is_some(),
            release: self.release().is_some(),
            concurrent: self.concurrent(),
        }
    }
}

/// What a module declared about itself, without its code: which optional
/// hooks it has and how it names itself. Every driver instance carries one,
/// whether the module is mapped into this process or into an isolated
/// worker process (which reports it when it starts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleInfo {
    pub name: String,
    pub version: String,
    pub description: String,
    pub abi_major: u16,
    pub abi_minor: u16,
    pub allocate: bool,
    pub preferred_allocation: bool,
    pub pre_start: bool,
    pub watch: bool,
    pub release: bool,
    pub concurrent: bool,
}

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
