//! gRPC client channels over unix domain sockets.
//!
//! tonic only dials TCP on its own, so these helpers give it a connector that
//! opens a `UnixStream` instead. The URI is a placeholder that is never
//! resolved; its authority `localhost` is what grpc-go (the kubelet) sends for
//! unix sockets too, and is accepted by every HTTP/2 server we talk to.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Error, Uri};

/// Placeholder target; only its authority reaches the server.
const DUMMY_URI: &str = "http://localhost";

/// Opens a gRPC channel to the unix socket at `path`.
///
/// The connection is made before this returns, so a missing socket or a
/// refused connection is reported here rather than on the first call. If the
/// connection later breaks, the channel redials the same path.
pub async fn connect_uds(path: impl AsRef<Path>) -> Result<Channel, Error> {
    connect(path.as_ref().to_path_buf(), None).await
}

/// Like [`connect_uds`], but gives up when connecting takes longer than
/// `timeout` (the kubelet uses 10 s for plugin sockets).
pub async fn connect_uds_timeout(path: impl AsRef<Path>, timeout: Duration) -> Result<Channel, Error> {
    connect(path.as_ref().to_path_buf(), Some(timeout)).await
}

async fn connect(path: PathBuf, timeout: Option<Duration>) -> Result<Channel, Error> {
    let mut endpoint = Endpoint::from_static(DUMMY_URI);
    if let Some(timeout) = timeout {
        endpoint = endpoint.connect_timeout(timeout);
    }
    endpoint
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}
