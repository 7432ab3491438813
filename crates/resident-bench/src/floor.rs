//! The floor of the placement rows: a tonic service with the agent's
//! contract that does no work (Place answers an empty Placement at once),
//! served the same way the agent serves, on a Unix socket, in a process of
//! its own.

use std::path::Path;
use std::pin::Pin;

use resident_api::pb;
use resident_api::pb::node_agent_server::{NodeAgent, NodeAgentServer};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

#[derive(Debug, Default)]
struct Floor;

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

fn none<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("the floor answers Place only"))
}

#[tonic::async_trait]
impl NodeAgent for Floor {
    async fn start(
        &self,
        _: Request<pb::StartRequest>,
    ) -> Result<Response<pb::StartResponse>, Status> {
        none()
    }
    async fn stop(
        &self,
        _: Request<pb::StopRequest>,
    ) -> Result<Response<pb::StopResponse>, Status> {
        none()
    }
    async fn get(&self, _: Request<pb::GetRequest>) -> Result<Response<pb::Instance>, Status> {
        none()
    }
    async fn list(
        &self,
        _: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        none()
    }
    async fn place(&self, _: Request<pb::PlaceRequest>) -> Result<Response<pb::Placement>, Status> {
        Ok(Response::new(pb::Placement::default()))
    }
    async fn touch(&self, _: Request<pb::TouchRequest>) -> Result<Response<pb::Instance>, Status> {
        none()
    }
    type WatchStream = Streamed<pb::Event>;
    async fn watch(
        &self,
        _: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        none()
    }
    type WatchNodeStream = Streamed<pb::NodeUpdate>;
    async fn watch_node(
        &self,
        _: Request<pb::WatchNodeRequest>,
    ) -> Result<Response<Self::WatchNodeStream>, Status> {
        none()
    }
    type LogsStream = Streamed<pb::LogLine>;
    async fn logs(
        &self,
        _: Request<pb::LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        none()
    }
    async fn node(&self, _: Request<pb::NodeRequest>) -> Result<Response<pb::NodeStatus>, Status> {
        none()
    }
    async fn workloads(
        &self,
        _: Request<pb::WorkloadsRequest>,
    ) -> Result<Response<pb::WorkloadsResponse>, Status> {
        none()
    }
    async fn adopt(&self, _: Request<pb::AdoptRequest>) -> Result<Response<pb::Instance>, Status> {
        none()
    }
    async fn forget_footprint(
        &self,
        _: Request<pb::ForgetFootprintRequest>,
    ) -> Result<Response<pb::Workload>, Status> {
        none()
    }
    async fn reload(
        &self,
        _: Request<pb::ReloadRequest>,
    ) -> Result<Response<pb::ReloadResponse>, Status> {
        none()
    }

    async fn upgrade(
        &self,
        _: Request<pb::UpgradeRequest>,
    ) -> Result<Response<pb::UpgradeResponse>, Status> {
        none()
    }

    async fn sleep(&self, _: Request<pb::SleepRequest>) -> Result<Response<pb::Instance>, Status> {
        none()
    }
}

/// Serves the floor on `socket` until killed.
pub fn serve(socket: &Path) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let listener = tokio::net::UnixListener::bind(socket)?;
        tonic::transport::Server::builder()
            .add_service(NodeAgentServer::new(Floor))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
            .await?;
        Ok(())
    })
}
