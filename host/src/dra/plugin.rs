//! The DRA plugin service (`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`) the kubelet calls to
//! prepare and unprepare a pod's claims. Every requested claim gets an entry in the answer: a
//! missing one makes the kubelet retry, and a gRPC error makes it drop the whole answer.
//!
//! In progress: a claim's allocation (which devices it got) is read from the API server, which
//! devhost does not do yet, so Prepare fails each claim with an error that says so. Nothing is
//! ever prepared, so Unprepare succeeds for every claim, as the kubelet requires for claims the
//! driver does not know (a pod must never hang in Terminating on us).

use devhost_proto::dra::v1::dra_plugin_server::DraPlugin;
use devhost_proto::dra::v1::{
    NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};
use tonic::{Request, Response, Status};

/// The plugin service of one DRA driver.
pub struct Plugin {
    driver: String,
}

impl Plugin {
    pub fn new(driver: &str) -> Plugin {
        Plugin { driver: driver.to_owned() }
    }
}

#[tonic::async_trait]
impl DraPlugin for Plugin {
    async fn node_prepare_resources(
        &self,
        request: Request<NodePrepareResourcesRequest>,
    ) -> Result<Response<NodePrepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|claim| {
                let error = format!(
                    "devhost DRA driver {}: cannot prepare claim {}/{} (uid {}): reading claim allocations from the \
                     API server is not yet available in this devhost build",
                    self.driver, claim.namespace, claim.name, claim.uid
                );
                tracing::warn!(dra_driver = %self.driver, claim = %format!("{}/{}", claim.namespace, claim.name),
                    "{error}");
                (claim.uid, NodePrepareResourceResponse { devices: Vec::new(), error })
            })
            .collect();
        Ok(Response::new(NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<NodeUnprepareResourcesRequest>,
    ) -> Result<Response<NodeUnprepareResourcesResponse>, Status> {
        let claims = request
            .into_inner()
            .claims
            .into_iter()
            .map(|c| (c.uid, NodeUnprepareResourceResponse::default()))
            .collect();
        Ok(Response::new(NodeUnprepareResourcesResponse { claims }))
    }
}
