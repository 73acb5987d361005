//! Module loading: read a driver `.so` once into a private, sealed copy
//! ([`Image`], a memfd), check ownership, mode and the sha256 pin on exactly
//! those bytes, `dlopen` the copy, resolve its versioned entry symbol and
//! check the descriptor before anything else is called. The original file
//! can then be overwritten, truncated or replaced without touching the code
//! that runs. Modules are never unloaded: the library handle is leaked on
//! purpose, because driver threads and thread-local destructors may outlive
//! any call.

mod dlopen;
mod error;
mod image;
mod module;
mod trust;

pub use dlopen::{load, load_fd, load_image};
pub use error::LoadError;
pub use image::{Image, Source, check_trust, enforce_trust, open_trusted, sha256_file};
pub use module::{Module, ModuleInfo};
pub use trust::TrustError;
pub(crate) use trust::file_problems;
