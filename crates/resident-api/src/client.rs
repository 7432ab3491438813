//! Connecting a generated client to an agent's Unix socket.

use std::future::Future;
use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::pb::node_agent_client::NodeAgentClient;

/// A client of the agent listening on the Unix socket at `path`.
pub async fn connect_unix(
    path: impl AsRef<Path>,
) -> Result<NodeAgentClient<Channel>, tonic::transport::Error> {
    Ok(NodeAgentClient::new(
        channel_unix(path.as_ref().to_path_buf()).await?,
    ))
}

/// A channel over the Unix socket at `path` (the URI's authority is only a
/// placeholder; every connection goes to the socket).
pub async fn channel_unix(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    endpoint_unix(Endpoint::from_static("http://localhost"), path).await
}

/// A channel over the Unix socket at `path` with the settings of
/// `endpoint` (windows, timeouts); its URI is only a placeholder.
pub async fn endpoint_unix(
    endpoint: Endpoint,
    path: PathBuf,
) -> Result<Channel, tonic::transport::Error> {
    endpoint.connect_with_connector(unix_connector(path)).await
}

/// As [`endpoint_unix`], connecting at the first call instead of now, so a
/// client can be made before the agent is up.
pub fn endpoint_unix_lazy(endpoint: Endpoint, path: PathBuf) -> Channel {
    endpoint.connect_with_connector_lazy(unix_connector(path))
}

/// Every connection to the socket at `path`.
fn unix_connector(
    path: PathBuf,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<UnixStream>,
    Error = std::io::Error,
    Future = impl Future<Output = std::io::Result<TokioIo<UnixStream>>> + Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |_: Uri| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
    })
}
