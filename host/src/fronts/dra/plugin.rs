//! The DRA plugin service (`k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`, and the same as
//! `v1beta1`) the kubelet calls to
//! prepare and unprepare a pod's claims. Every requested claim gets an entry in the answer: a
//! missing one makes the kubelet retry, and a gRPC error makes it drop the whole answer.
//!
//! The work is [`Claims`]'s; this file only maps the messages of both versions onto it. A claim
//! that cannot be read from the API server fails the whole Prepare call with `UNAVAILABLE`, as
//! the Go helper does; every other failure is the claim's own `error`.

use std::sync::Arc;

use devhost_proto::dra::{v1, v1beta1};
use tonic::{Request, Response, Status};

use super::claims::{ClaimRef, Claims};

/// The plugin service of one DRA driver, served as both v1 and v1beta1 on one socket (the
/// messages are the same on the wire, apart from v1's share ID).
pub struct Plugin {
    claims: Arc<Claims>,
}

impl Plugin {
    /// The service over `claims` (which the stale-claim check shares).
    pub fn new(claims: Arc<Claims>) -> Plugin {
        Plugin { claims }
    }
}

/// v1 and v1beta1 have the same messages (v1 adds a share ID, which devhost does not set): one
/// body serves both versions.
macro_rules! dra_plugin_service {
    ($api:ident) => {
        impl From<$api::Claim> for ClaimRef {
            fn from(c: $api::Claim) -> ClaimRef {
                ClaimRef { namespace: c.namespace, uid: c.uid, name: c.name }
            }
        }

        #[tonic::async_trait]
        impl $api::dra_plugin_server::DraPlugin for Plugin {
            // `..Default::default()` is v1's share ID (absent from v1beta1), which devhost sets to none.
            #[allow(clippy::needless_update)]
            async fn node_prepare_resources(
                &self,
                request: Request<$api::NodePrepareResourcesRequest>,
            ) -> Result<Response<$api::NodePrepareResourcesResponse>, Status> {
                let claims = request.into_inner().claims.into_iter().map(ClaimRef::from).collect();
                let answers = self.claims.prepare(claims).await.map_err(Status::unavailable)?;
                let claims = answers
                    .into_iter()
                    .map(|(uid, answer)| {
                        let response = match answer {
                            Ok(devices) => $api::NodePrepareResourceResponse {
                                devices: devices
                                    .into_iter()
                                    .map(|d| $api::Device {
                                        request_names: d.requests,
                                        pool_name: d.pool,
                                        device_name: d.device,
                                        cdi_device_ids: d.cdi_device_ids,
                                        ..Default::default()
                                    })
                                    .collect(),
                                error: String::new(),
                            },
                            Err(error) => $api::NodePrepareResourceResponse { devices: Vec::new(), error },
                        };
                        (uid, response)
                    })
                    .collect();
                Ok(Response::new($api::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$api::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$api::NodeUnprepareResourcesResponse>, Status> {
                let claims = request.into_inner().claims.into_iter().map(ClaimRef::from).collect();
                let claims = self
                    .claims
                    .unprepare(claims)
                    .await
                    .into_iter()
                    .map(|(uid, answer)| {
                        (uid, $api::NodeUnprepareResourceResponse { error: answer.err().unwrap_or_default() })
                    })
                    .collect();
                Ok(Response::new($api::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

dra_plugin_service!(v1);
dra_plugin_service!(v1beta1);
