//! Where a driver's module comes from: the manifest's candidate files, read
//! once per (re)load into a checked private copy ([`crate::driver::loader`]),
//! and whether a running instance's file has changed since.

use crate::driver::instance::Instance;
use crate::driver::loader::{self, Module};
use crate::manifest::DriverConfig;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Modules read and loaded during one `apply`, by file: drivers resolve in
/// parallel, and a second instance of one module waits for the first read
/// instead of reading (and hashing) the file again.
pub(crate) type ModuleCache = Arc<Mutex<HashMap<PathBuf, Arc<std::sync::OnceLock<Result<Module, String>>>>>>;

/// Finds a driver's module, reads it into a private copy, checks that those
/// bytes can be trusted, and loads them; the same bytes are loaded once.
/// Blocking (file reads, hashing, `dlopen`): run on the instance's own thread.
pub(crate) fn resolve(cfg: &DriverConfig, allow_untrusted: bool, cache: &ModuleCache) -> Result<Module, String> {
    let path = module_path(cfg)?;
    let cell = cache.lock().unwrap_or_else(|p| p.into_inner()).entry(path.clone()).or_default().clone();
    cell.get_or_init(|| {
        let image = loader::open_trusted(&path, cfg.sha256.as_deref(), allow_untrusted, &cfg.name)
            .map_err(|e| format!("driver {}: {e}", cfg.name))?;
        loader::load_image(&image).map_err(|e| format!("driver {}: {e}", cfg.name))
    })
    .clone()
}

/// The module file a driver instance uses: the first candidate that exists.
pub(crate) fn module_path(cfg: &DriverConfig) -> Result<PathBuf, String> {
    let Some(path) = cfg.module_candidates.iter().find(|p| p.exists()) else {
        let tried: Vec<String> = cfg.module_candidates.iter().map(|p| p.display().to_string()).collect();
        return Err(format!("driver {}: no module file found (tried {})", cfg.name, tried.join(", ")));
    };
    Ok(path.clone())
}

/// Whether a running instance's module file now holds other bytes (or
/// another candidate file would be picked): a reload then loads it anew.
pub(crate) fn module_changed(cfg: &DriverConfig, inst: &Instance) -> Option<PathBuf> {
    let path = module_path(cfg).ok()?;
    let source = inst.source();
    let moved = std::fs::canonicalize(&path).ok().is_some_and(|real| real != source.path);
    (moved || source.changed_on_disk()).then_some(path)
}
