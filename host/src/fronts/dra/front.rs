//! The DRA front as the daemon holds it: one [`ServedDriver`] per `api = "dra"` resource whose
//! driver is loaded, kept in step with the manifest at start and at each reload.

use std::path::PathBuf;
use std::sync::Arc;

use super::api::ApiServer;
use super::claims::Settings;
use super::served::{DEFAULT_CDI_DIR, ServedDriver};
use crate::engine::registry::Resource;
use crate::engine::telemetry::Metrics;
use crate::manifest::Manifest;

/// Every DRA resource being served, under one kubelet root directory.
pub struct DraFront {
    root: PathBuf,
    kubeconfig: Option<PathBuf>,
    node_name: Option<String>,
    /// Made when the first DRA resource needs it (a node without DRA resources never needs a
    /// kubeconfig), and again at a later sync if making it failed.
    api: Option<ApiServer>,
    /// Where the served drivers keep claims' CDI specs and their checkpoints.
    settings: Settings,
    served: Vec<(Arc<Resource>, ServedDriver)>,
    /// Resources whose driver could not be served in this round (see [`DraFront::new_round`]).
    failed: Vec<std::sync::Weak<Resource>>,
}

impl DraFront {
    /// No driver served yet; the kubelet root (`kubelet_root_dir`), the API server (`kubeconfig`) and the
    /// node (`node_name`) come from `manifest`, as do the folders of claims' CDI specs
    /// (`cdi_dir`, else [`DEFAULT_CDI_DIR`]) and of the checkpoints (`state_dir`).
    pub fn new(manifest: &Manifest, metrics: Arc<Metrics>) -> DraFront {
        let cdi_dir = manifest.cdi_dir.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_CDI_DIR));
        DraFront {
            root: manifest.kubelet_root_dir.clone(),
            kubeconfig: manifest.kubeconfig.clone(),
            node_name: manifest.node_name.clone(),
            api: None,
            settings: Settings {
                cdi_dir,
                state_dir: manifest.state_dir.clone(),
                metrics,
                pod_resources_socket: manifest.pod_resources_socket.clone(),
                claim_check_interval: manifest.dra_claim_check_interval,
            },
            served: Vec::new(),
            failed: Vec::new(),
        }
    }

    /// The API client, made on first use; an error names why it cannot be made.
    async fn api(&mut self) -> Result<ApiServer, String> {
        if let Some(api) = &self.api {
            return Ok(api.clone());
        }
        let api = ApiServer::connect(self.kubeconfig.as_deref(), self.node_name.as_deref())
            .await
            .map_err(|e| e.to_string())?;
        tracing::info!(node = %api.node, "DRA: API server client ready");
        self.api = Some(api.clone());
        Ok(api)
    }

    /// Serves exactly the DRA resources of `resources` whose driver is loaded: stops serving the
    /// drivers of resources gone or changed (a reload makes a new `Resource` for a changed entry),
    /// then starts the missing ones. A driver that cannot be served costs only its own resource.
    pub async fn sync(&mut self, resources: &[Arc<Resource>]) {
        let wanted: Vec<&Arc<Resource>> =
            resources.iter().filter(|r| r.driver.is_some() && r.config.api.dra_driver().is_some()).collect();
        let (keep, gone): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.served).into_iter().partition(|(r, _)| wanted.iter().any(|w| Arc::ptr_eq(w, r)));
        self.served = keep;
        for (_, served) in gone {
            served.stop().await;
        }
        self.failed.retain(|f| f.strong_count() > 0);
        for r in wanted {
            if self.served.iter().any(|(s, _)| Arc::ptr_eq(s, r)) {
                continue;
            }
            // Once per round: the daemon syncs again as each driver of a reload settles.
            let weak = Arc::downgrade(r);
            if self.failed.iter().any(|f| f.ptr_eq(&weak)) {
                continue;
            }
            let Some(driver) = r.config.api.dra_driver() else { continue };
            let api = match self.api().await {
                Ok(api) => api,
                Err(e) => {
                    tracing::error!(resource = %r.config.name, dra_driver = driver, "not served: {e}");
                    self.failed.push(weak);
                    continue;
                }
            };
            match ServedDriver::start(&self.root, driver, r.clone(), api, &self.settings).await {
                Ok(served) => {
                    tracing::info!(
                        resource = %r.config.name,
                        dra_driver = driver,
                        node = %self.api.as_ref().map_or("", |a| a.node.as_str()),
                        "served through DRA: its devices are published as ResourceSlices and claims allocated \
                         to them are prepared"
                    );
                    self.served.push((r.clone(), served));
                }
                Err(e) => {
                    tracing::error!(resource = %r.config.name, "not served: {e}");
                    self.failed.push(weak);
                }
            }
        }
    }

    /// Starts a round: the next [`DraFront::sync`] tries again the drivers that could not be served.
    /// The daemon starts one per `apply` (each reload), and syncs at each of its installs.
    pub fn new_round(&mut self) {
        self.failed.clear();
    }

    /// Stops every served driver and removes its sockets.
    pub async fn shutdown(&mut self) {
        for (_, served) in std::mem::take(&mut self.served) {
            served.stop().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn front(extra: &str) -> DraFront {
        let text = format!("{extra}[[resource]]\nname = \"example.com/gpu\"\ndriver = \"x\"\napi = \"dra\"\n");
        let manifest = Manifest::parse(&text, std::path::Path::new("/etc/devhost/devhost.toml"), None).unwrap();
        DraFront::new(&manifest, Arc::new(Metrics::new()))
    }

    #[test]
    fn claims_cdi_specs_go_to_the_runtimes_default_folder_unless_cdi_dir_is_set() {
        assert_eq!(front("").settings.cdi_dir, std::path::Path::new("/var/run/cdi"));
        assert_eq!(front("cdi_dir = \"/etc/cdi\"\n").settings.cdi_dir, std::path::Path::new("/etc/cdi"));
        assert_eq!(front("state_dir = \"/srv/state\"\n").settings.state_dir, std::path::Path::new("/srv/state"));
    }
}
