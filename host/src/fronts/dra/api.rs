//! The DRA front's way to the API server: one [`kube::Client`] for every DRA resource of the
//! node, made from the manifest's `kubeconfig` (or, without one, the pod's service account,
//! then `$KUBECONFIG`), and the name of this node (`node_name`, else `$NODE_NAME`, else the
//! host name). Making the client reads files only; nothing is asked of the API server here,
//! so a server that is down costs the calls that need it, not the start of the daemon.

use std::path::{Path, PathBuf};

use kube::config::{KubeConfigOptions, Kubeconfig};

/// The environment variable the DaemonSet sets to the node's name (downward API, `spec.nodeName`).
pub const NODE_NAME_ENV: &str = "NODE_NAME";

/// Why the API server cannot be reached.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("cannot read the kubeconfig {}: {source}", path.display())]
    Kubeconfig { path: PathBuf, source: kube::config::KubeconfigError },
    #[error(
        "no way to reach the API server: set `kubeconfig` in the manifest, or run in a pod with a service \
         account token mounted, or set $KUBECONFIG ({0})"
    )]
    Infer(kube::config::InferConfigError),
    #[error("cannot make an API client: {0}")]
    Client(kube::Error),
    #[error(
        "this node's name is unknown: set `node_name` in the manifest or ${NODE_NAME_ENV} (the DaemonSet sets it \
         from spec.nodeName), or give the machine a host name"
    )]
    NoNodeName,
}

/// A client of the API server and the node the DRA resources are published for.
#[derive(Clone)]
pub struct ApiServer {
    pub client: kube::Client,
    /// This node's name (`spec.nodeName` of its ResourceSlices; the pool name).
    pub node: String,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer").field("node", &self.node).finish_non_exhaustive()
    }
}

impl ApiServer {
    /// A client from `kubeconfig` (the manifest's), else in-cluster, else `$KUBECONFIG`; the
    /// node is `node_name`, else `$NODE_NAME`, else the host name.
    pub async fn connect(kubeconfig: Option<&Path>, node_name: Option<&str>) -> Result<ApiServer, ApiError> {
        let node = node_name
            .map(str::to_owned)
            .or_else(|| std::env::var(NODE_NAME_ENV).ok().filter(|n| !n.is_empty()))
            .or_else(host_name)
            .ok_or(ApiError::NoNodeName)?;
        let config = match kubeconfig {
            Some(path) => {
                let file = Kubeconfig::read_from(path)
                    .map_err(|source| ApiError::Kubeconfig { path: path.to_path_buf(), source })?;
                kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                    .await
                    .map_err(|source| ApiError::Kubeconfig { path: path.to_path_buf(), source })?
            }
            None => kube::Config::infer().await.map_err(ApiError::Infer)?,
        };
        // No retries inside the client: kube's default layer repeats a 429, 503 or 504 up to 15
        // times (after the server's Retry-After, 1 s under priority and fairness), so a claim's
        // read would wait out its 10 s deadline on a server that sheds load and report "no
        // answer", and each publishing pass would ask about once a second for 30 s. The callers
        // retry themselves: the kubelet repeats a failed Prepare, the publisher backs off.
        let mut config = config;
        config.default_retry = false;
        let client = kube::Client::try_from(config).map_err(ApiError::Client)?;
        Ok(ApiServer { client, node })
    }
}

/// The kernel's host name, lower-cased as node names are.
fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim().to_ascii_lowercase();
    (!name.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_kubeconfig_gives_a_client_for_the_named_node_without_asking_the_server() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        std::fs::write(
            &path,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:1\n    \
             insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: abc\ncontexts:\n- name: x\n  \
             context:\n    cluster: c\n    user: u\ncurrent-context: x\n",
        )
        .unwrap();
        let api = ApiServer::connect(Some(&path), Some("node-1")).await.unwrap();
        assert_eq!(api.node, "node-1");
    }

    #[tokio::test]
    async fn a_missing_kubeconfig_is_named() {
        let err = ApiServer::connect(Some(Path::new("/nonexistent/kubeconfig")), Some("n")).await.unwrap_err();
        let text = err.to_string();
        assert!(text.contains("/nonexistent/kubeconfig"), "{text}");
    }
}
