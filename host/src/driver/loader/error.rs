//! Why a module could not be loaded: [`LoadError`], whose every message names the file. A leaf,
//! so that reading the file ([`super::image`]) and mapping it ([`super::dlopen`]) both speak it.

use std::path::PathBuf;

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
