//! Mapping a module into this process: `dlopen` of its sealed copy through /proc/self/fd,
//! once per file and content, then the versioned entry symbol and the descriptor's checks
//! before anything else is called. The library handle is leaked on purpose (see the area docs).

use super::error::LoadError;
use super::image::{Image, Source, same_bytes};
use super::module::Module;
use devhost_abi as abi;
use std::ffi::CStr;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

/// Loads and validates the module at `path` (a private copy of its bytes),
/// without the trust checks: see [`super::open_trusted`] for those.
pub fn load(path: &Path) -> Result<Module, LoadError> {
    if !path.exists() {
        return Err(LoadError::Missing { path: path.to_path_buf() });
    }
    let image = Image::read(path)?;
    load_image(&image)
}

/// What loading each file into this process gave, by the bytes loaded: the
/// same bytes are mapped once, as `dlopen` of one path always did, and a
/// module that mapped but failed its checks is not mapped again on every
/// reload.
type Loaded = Vec<(Source, Result<Module, LoadError>)>;
static LOADED: std::sync::Mutex<Loaded> = std::sync::Mutex::new(Vec::new());

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
