//! The registration service the kubelet's plugin watcher calls on the socket in
//! `plugins_registry`: it asks what the plugin is (GetInfo), then reports whether it registered it.

use std::path::Path;
use std::sync::{Arc, Mutex};

use devhost_proto::pluginregistration::registration_server::Registration as RegistrationService;
use devhost_proto::pluginregistration::{InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse};
use tonic::{Request, Response, Status};

/// The last registration verdict the kubelet sent: (registered, error).
pub type RegistrationVerdict = Arc<Mutex<Option<(bool, String)>>>;

/// The services offered on the plugin socket, most preferred first (the kubelet takes the first
/// it knows): v1 first, v1beta1 for 1.32 and 1.33 kubelets; then the optional resource health
/// service, v1 (1.37) before v1alpha1 (1.34 to 1.36), which the kubelet watches when it knows one.
pub const SUPPORTED_VERSIONS: &[&str] = &[
    devhost_proto::DRA_V1_SERVICE,
    devhost_proto::DRA_V1BETA1_SERVICE,
    devhost_proto::DRA_HEALTH_V1_SERVICE,
    devhost_proto::DRA_HEALTH_V1ALPHA1_SERVICE,
];

/// Answers the plugin watcher for one DRA driver.
pub struct Registration {
    driver: String,
    endpoint: String,
    verdict: RegistrationVerdict,
}

impl Registration {
    /// `endpoint`: the plugin socket as the kubelet sees it (host path = container path).
    pub fn new(driver: &str, endpoint: &Path, verdict: RegistrationVerdict) -> Registration {
        Registration { driver: driver.to_owned(), endpoint: endpoint.display().to_string(), verdict }
    }
}

#[tonic::async_trait]
impl RegistrationService for Registration {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: devhost_proto::DRA_PLUGIN_TYPE.to_owned(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| (*v).to_owned()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(dra_driver = %self.driver, "the kubelet registered the DRA driver");
        } else {
            tracing::error!(dra_driver = %self.driver, "the kubelet refused the DRA driver: {}", status.error);
        }
        *self.verdict.lock().unwrap_or_else(|p| p.into_inner()) = Some((status.plugin_registered, status.error));
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
