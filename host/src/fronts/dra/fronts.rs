//! The DRA fronts of the daemon: one [`DraFront`] per `api = "dra"` resource whose driver is
//! loaded, kept in step with the manifest at start and at each reload.

use std::path::PathBuf;
use std::sync::Arc;

use super::DraFront;
use crate::engine::registry::Resource;

/// Every DRA resource being served, under one kubelet root directory.
pub struct Fronts {
    root: PathBuf,
    served: Vec<(Arc<Resource>, DraFront)>,
}

impl Fronts {
    /// No front yet; `root` is the kubelet's root directory (`kubelet_root_dir`).
    pub fn new(root: PathBuf) -> Fronts {
        Fronts { root, served: Vec::new() }
    }

    /// Serves exactly the DRA resources of `resources` whose driver is loaded: stops the fronts
    /// of resources gone or changed (a reload makes a new `Resource` for a changed entry), then
    /// starts the missing ones. A front that cannot start costs only its own resource.
    pub async fn sync(&mut self, resources: &[Arc<Resource>]) {
        let wanted: Vec<&Arc<Resource>> =
            resources.iter().filter(|r| r.driver.is_some() && r.config.api.dra_driver().is_some()).collect();
        let (keep, gone): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.served).into_iter().partition(|(r, _)| wanted.iter().any(|w| Arc::ptr_eq(w, r)));
        self.served = keep;
        for (_, front) in gone {
            front.stop().await;
        }
        for r in wanted {
            if self.served.iter().any(|(s, _)| Arc::ptr_eq(s, r)) {
                continue;
            }
            let Some(driver) = r.config.api.dra_driver() else { continue };
            match DraFront::start(&self.root, driver).await {
                Ok(front) => {
                    tracing::warn!(
                        resource = %r.config.name,
                        dra_driver = driver,
                        "served through DRA, which is in progress: the kubelet can register the driver, but devhost \
                         publishes no ResourceSlices and cannot prepare claims yet, so no pod gets these devices"
                    );
                    self.served.push((r.clone(), front));
                }
                Err(e) => tracing::error!(resource = %r.config.name, "not served: {e}"),
            }
        }
    }

    /// Stops every front and removes its sockets.
    pub async fn shutdown(&mut self) {
        for (_, front) in std::mem::take(&mut self.served) {
            front.stop().await;
        }
    }
}
