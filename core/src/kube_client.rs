//! The Kubernetes client both binaries build the same way: from a kubeconfig file when one is
//! given, else the pod's service account, else the local kubeconfig (`$KUBECONFIG`,
//! `~/.kube/config`). Plain construction; the client itself is kube's.

use std::path::{Path, PathBuf};

/// Why no client could be built.
#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    #[error("no Kubernetes client configuration (in-cluster or kubeconfig): {0}")]
    Config(#[from] kube::config::InferConfigError),
    #[error("kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// A client from `kubeconfig` when given, else the pod's service account, else the local
/// kubeconfig.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, KubeClientError> {
    let config = match kubeconfig {
        Some(path) => {
            let failed = |source| KubeClientError::Kubeconfig {
                path: path.to_path_buf(),
                source,
            };
            let file = kube::config::Kubeconfig::read_from(path).map_err(failed)?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(failed)?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(config)?)
}
