//! The DRA plugin service (`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`, and the same as
//! `v1beta1`) the kubelet calls to
//! prepare and unprepare a pod's claims. Every requested claim gets an entry in the answer: a
//! missing one makes the kubelet retry, and a gRPC error makes it drop the whole answer.
//!
//! In progress: a claim's allocation (which devices it got) is read from the API server, which
//! devhost does not do yet, so Prepare fails each claim with an error that says so. Nothing is
//! ever prepared, so Unprepare succeeds for every claim, as the kubelet requires for claims the
//! driver does not know (a pod must never hang in Terminating on us).

use std::sync::Arc;

use devhost_proto::dra::{v1, v1beta1};
use tonic::{Request, Response, Status};

use super::api::ApiServer;
use crate::engine::registry::Resource;

/// The plugin service of one DRA driver, served as both v1 and v1beta1 on one socket (the
/// messages are the same on the wire, apart from v1's share ID).
pub struct Plugin {
    driver: String,
    /// The manifest resource this driver serves: its devices and its driver instance.
    #[allow(dead_code)] // Read once claims are prepared.
    resource: Arc<Resource>,
    /// Where claims are read from.
    #[allow(dead_code)]
    api: ApiServer,
}

impl Plugin {
    pub fn new(driver: &str, resource: Arc<Resource>, api: ApiServer) -> Plugin {
        Plugin { driver: driver.to_owned(), resource, api }
    }

    /// Why a claim (namespace, uid, name) cannot be prepared yet; logged once per claim asked.
    fn refuse(&self, namespace: &str, uid: &str, name: &str) -> String {
        let error = format!(
            "devhost DRA driver {}: cannot prepare claim {namespace}/{name} (uid {uid}): reading claim allocations \
             from the API server is not yet available in this devhost build",
            self.driver
        );
        tracing::warn!(dra_driver = %self.driver, claim = %format!("{namespace}/{name}"), "{error}");
        error
    }
}

/// v1 and v1beta1 have the same messages (v1 adds a share ID, which nothing sets yet): one body
/// serves both versions.
macro_rules! dra_plugin_service {
    ($api:ident) => {
        #[tonic::async_trait]
        impl $api::dra_plugin_server::DraPlugin for Plugin {
            async fn node_prepare_resources(
                &self,
                request: Request<$api::NodePrepareResourcesRequest>,
            ) -> Result<Response<$api::NodePrepareResourcesResponse>, Status> {
                let claims = request
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| {
                        let error = self.refuse(&c.namespace, &c.uid, &c.name);
                        (c.uid, $api::NodePrepareResourceResponse { devices: Vec::new(), error })
                    })
                    .collect();
                Ok(Response::new($api::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$api::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$api::NodeUnprepareResourcesResponse>, Status> {
                let claims = request
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| (c.uid, $api::NodeUnprepareResourceResponse::default()))
                    .collect();
                Ok(Response::new($api::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_plugin_service!(v1);
dra_plugin_service!(v1beta1);
