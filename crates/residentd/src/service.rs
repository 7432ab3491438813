//! The `resident.v1.NodeAgent` service: request validation and translation
//! to and from the agent, the streams of Watch and Logs (a followed log
//! ends with its instance's run; WatchNode's is `node_watch.rs`), and the audit line of every call that
//! changes something (who may call is decided before, in `access.rs`). No
//! decision is made here.

use std::future::Future;
use std::sync::{Arc, Weak};

use resident_api::pb;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use crate::access::{self, Caller};
use crate::agent::{AdoptCall, Agent, Hold};
use crate::events::Resume;
use crate::outbox::Streamed;
use crate::validate;

/// The gRPC face of the agent.
#[derive(Debug, Clone)]
pub struct Service {
    agent: Arc<Agent>,
}

impl Service {
    /// A service over `agent`.
    pub fn new(agent: Arc<Agent>) -> Self {
        Self { agent }
    }
}

impl Service {
    /// Runs a call that changes something and writes its audit line: who
    /// (the caller the access layer let through), what, which instance,
    /// and how it ended.
    async fn audited<T>(
        &self,
        rpc: &'static str,
        caller: &Caller,
        instance_id: &str,
        call: impl Future<Output = Result<T, Status>>,
        id_of: impl Fn(&T) -> String,
    ) -> Result<T, Status> {
        let result = call.await;
        match &result {
            Ok(answer) => {
                let id = id_of(answer);
                let id = if id.is_empty() { instance_id } else { &id };
                access::audit(rpc, caller, id, "ok", "");
            }
            Err(status) => {
                let excerpt = resident_core::Excerpt::of(status.message()).to_string();
                access::audit(
                    rpc,
                    caller,
                    instance_id,
                    resident_api::code_name(status.code()),
                    &excerpt,
                );
            }
        }
        result
    }
}

#[tonic::async_trait]
impl pb::node_agent_server::NodeAgent for Service {
    async fn start(
        &self,
        req: Request<pb::StartRequest>,
    ) -> Result<Response<pb::StartResponse>, Status> {
        let _timer = self.agent.metrics().time("Start");
        let caller = Caller::of(&req);
        let r = req.into_inner();
        let excerpt = r.instance_id.clone();
        let call = async {
            let (id, on_full) = validate::start(&r)?;
            let span =
                tracing::info_span!("start", workload = %r.workload, instance_id = %r.instance_id);
            let started = self
                .agent
                .start(&r.workload, id, on_full, r.wait_ready, r.lease_ms)
                .instrument(span)
                .await?;
            Ok(pb::StartResponse {
                instance: Some(started.instance),
                created: started.created,
                evicted: started.evicted,
                slept: started.slept,
            })
        };
        let id_of = |s: &pb::StartResponse| {
            s.instance
                .as_ref()
                .map_or_else(String::new, |i| i.instance_id.clone())
        };
        let answer = self
            .audited("Start", &caller, &excerpt, call, id_of)
            .await?;
        Ok(Response::new(answer))
    }

    async fn stop(
        &self,
        req: Request<pb::StopRequest>,
    ) -> Result<Response<pb::StopResponse>, Status> {
        let _timer = self.agent.metrics().time("Stop");
        let caller = Caller::of(&req);
        let r = req.into_inner();
        let excerpt = r.instance_id.clone();
        let call = async {
            let (id, grace) = validate::stop(&r)?;
            let span = tracing::info_span!("stop", instance_id = %id);
            let instance = self.agent.stop(id.as_str(), grace).instrument(span).await?;
            Ok(pb::StopResponse {
                instance: Some(instance),
            })
        };
        let answer = self
            .audited("Stop", &caller, &excerpt, call, |_| String::new())
            .await?;
        Ok(Response::new(answer))
    }

    async fn adopt(
        &self,
        req: Request<pb::AdoptRequest>,
    ) -> Result<Response<pb::Instance>, Status> {
        let _timer = self.agent.metrics().time("Adopt");
        let caller = Caller::of(&req);
        let admin = req
            .extensions()
            .get::<crate::access::Authorized>()
            .is_some_and(|a| a.role >= resident_config::AccessRole::Admin);
        let r = req.into_inner();
        let excerpt = r.instance_id.clone();
        let call = async {
            let id = validate::adopt(&r)?;
            let span = tracing::info_span!("adopt", workload = %r.workload, instance_id = %id, pid = r.pid);
            let call = AdoptCall {
                workload: r.workload.clone(),
                id,
                pid: r.pid,
                manage: r.manage,
                // Checked by validate::adopt.
                port: u16::try_from(r.port).unwrap_or(0),
                admin,
            };
            Ok(self.agent.adopt(call).instrument(span).await?)
        };
        let answer = self
            .audited("Adopt", &caller, &excerpt, call, |_| String::new())
            .await?;
        Ok(Response::new(answer))
    }

    async fn reload(
        &self,
        req: Request<pb::ReloadRequest>,
    ) -> Result<Response<pb::ReloadResponse>, Status> {
        let _timer = self.agent.metrics().time("Reload");
        let caller = Caller::of(&req);
        let call = async {
            let agent = self.agent.clone();
            // Reading and validating the file blocks (it may look up users,
            // programs and GGUF headers).
            let reloaded = tokio::task::spawn_blocking(move || agent.reload())
                .await
                .map_err(|e| Status::internal(format!("the reload failed: {e}")))?;
            let warnings = reloaded.map_err(|e| {
                Status::failed_precondition(format!("the configuration was not reloaded: {e}"))
            })?;
            let config = self.agent.config();
            Ok(pb::ReloadResponse {
                config: config.source.display().to_string(),
                warnings,
            })
        };
        let answer = self
            .audited("Reload", &caller, "", call, |_| String::new())
            .await?;
        Ok(Response::new(answer))
    }

    async fn get(&self, req: Request<pb::GetRequest>) -> Result<Response<pb::Instance>, Status> {
        let _timer = self.agent.metrics().time("Get");
        let id = validate::instance_id("instance_id", &req.get_ref().instance_id)?;
        let _span = tracing::info_span!("get", instance_id = %id).entered();
        Ok(Response::new(self.agent.get(id.as_str())?))
    }

    async fn list(
        &self,
        _req: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        let _timer = self.agent.metrics().time("List");
        Ok(Response::new(pb::ListResponse {
            instances: self.agent.list(),
        }))
    }

    async fn place(
        &self,
        req: Request<pb::PlaceRequest>,
    ) -> Result<Response<pb::Placement>, Status> {
        let _timer = self.agent.metrics().time("Place");
        let r = req.into_inner();
        let (on_full, id) = validate::place(&r)?;
        let span = tracing::info_span!("place", workload = %r.workload);
        let placement = self
            .agent
            .place(&r.workload, on_full, id.as_ref())
            .instrument(span);
        Ok(Response::new(placement.await?))
    }

    async fn touch(
        &self,
        req: Request<pb::TouchRequest>,
    ) -> Result<Response<pb::Instance>, Status> {
        let _timer = self.agent.metrics().time("Touch");
        let caller = Caller::of(&req);
        let r = req.into_inner();
        let excerpt = r.instance_id.clone();
        let call = async {
            let id = validate::instance_id("instance_id", &r.instance_id)?;
            let _span = tracing::info_span!("touch", instance_id = %id).entered();
            let hold = if r.release_hold {
                Hold::Release
            } else {
                Hold::For(r.hold_ms)
            };
            Ok(self.agent.touch(id.as_str(), hold)?)
        };
        let answer = self
            .audited("Touch", &caller, &excerpt, call, |_| String::new())
            .await?;
        Ok(Response::new(answer))
    }

    async fn sleep(
        &self,
        req: Request<pb::SleepRequest>,
    ) -> Result<Response<pb::Instance>, Status> {
        let _timer = self.agent.metrics().time("Sleep");
        let caller = Caller::of(&req);
        let r = req.into_inner();
        let excerpt = r.instance_id.clone();
        let call = async {
            let id = validate::instance_id("instance_id", &r.instance_id)?;
            let span = tracing::info_span!("sleep", instance_id = %id);
            Ok(self.agent.sleep(id.as_str()).instrument(span).await?)
        };
        let answer = self
            .audited("Sleep", &caller, &excerpt, call, |_| String::new())
            .await?;
        Ok(Response::new(answer))
    }

    type WatchStream = Streamed<pb::Event>;

    async fn watch(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let _timer = self.agent.metrics().time("Watch");
        let since = req.get_ref().since_revision;
        let agent = self.agent.clone();
        let (first, mut live) = match self.agent.events().resume(since, || agent.list()) {
            Resume::From(first, live) => (first, live),
            Resume::TooOld { oldest } => {
                return Err(Status::out_of_range(format!(
                    "revision {since} is not in the kept history (oldest resumable: {oldest}); list again and watch from 0"
                )));
            }
        };
        let (tx, rx) = crate::outbox::outbox();
        let closing = self.agent.closing();
        tokio::spawn(async move {
            tokio::pin!(closing);
            let mut last = first.last().map_or(since, |e| e.revision);
            for e in first {
                if !tx.send(Ok(e)).await {
                    return;
                }
            }
            loop {
                let next = tokio::select! {
                    next = live.recv() => next,
                    () = &mut closing => {
                        let msg = format!("the agent is shutting down; resume with since_revision = {last}");
                        let _ = tx.send(Err(Status::unavailable(msg))).await;
                        return;
                    }
                };
                match next {
                    Ok(e) if e.revision <= last => continue,
                    Ok(e) => {
                        last = e.revision;
                        if !tx.send(Ok(e)).await {
                            return;
                        }
                    }
                    Err(RecvError::Lagged(_)) => {
                        let msg =
                            format!("watcher fell behind; resume with since_revision = {last}");
                        let _ = tx.send(Err(Status::resource_exhausted(msg))).await;
                        return;
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(rx))
    }

    type LogsStream = Streamed<pb::LogLine>;

    async fn logs(
        &self,
        req: Request<pb::LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        let _timer = self.agent.metrics().time("Logs");
        let r = req.into_inner();
        let id = validate::logs(&r)?;
        let _span = tracing::info_span!("logs", instance_id = %id).entered();
        // Subscribed before the state is read: an end after the read is
        // then an event this follower sees.
        let events = self.agent.events().subscribe();
        let now = self.agent.get(id.as_str())?;
        let Some(ring) = self.agent.supervisor().logs(id.as_str()) else {
            return Ok(Response::new(Box::pin(tokio_stream::empty())));
        };
        let (tx, rx) = crate::outbox::outbox();
        let id = id.to_string();
        if !r.follow {
            let tail = ring.tail(r.tail as usize);
            tokio::spawn(async move {
                for l in tail {
                    if !tx.send(Ok(log_line(l, &id))).await {
                        return;
                    }
                }
            });
            return Ok(Response::new(rx));
        }
        let (tail, live) = ring.tail_and_follow(r.tail as usize);
        let follower = LogFollower {
            ended: run_ended(&now),
            id,
            live,
            events,
            agent: Arc::downgrade(&self.agent),
            tx,
        };
        tokio::spawn(follower.run(tail, self.agent.closing()));
        Ok(Response::new(rx))
    }

    async fn node(
        &self,
        _req: Request<pb::NodeRequest>,
    ) -> Result<Response<pb::NodeStatus>, Status> {
        let _timer = self.agent.metrics().time("Node");
        let revision = self.agent.events().revision();
        let instances = self.agent.list();
        Ok(Response::new(self.agent.node_status(revision, instances)))
    }

    type WatchNodeStream = Streamed<pb::NodeUpdate>;

    async fn watch_node(
        &self,
        req: Request<pb::WatchNodeRequest>,
    ) -> Result<Response<Self::WatchNodeStream>, Status> {
        let _timer = self.agent.metrics().time("WatchNode");
        let r = req.into_inner();
        let (every, heartbeat) = validate::watch_node(&r)?;
        let asked = crate::node_watch::Asked {
            since: r.since_revision,
            epoch: r.epoch,
            every,
            heartbeat,
        };
        let rx = crate::node_watch::start(self.agent.clone(), asked, self.agent.closing());
        Ok(Response::new(rx))
    }

    async fn workloads(
        &self,
        _req: Request<pb::WorkloadsRequest>,
    ) -> Result<Response<pb::WorkloadsResponse>, Status> {
        let _timer = self.agent.metrics().time("Workloads");
        let workloads = self.agent.workloads();
        Ok(Response::new(pb::WorkloadsResponse { workloads }))
    }

    async fn upgrade(
        &self,
        req: Request<pb::UpgradeRequest>,
    ) -> Result<Response<pb::UpgradeResponse>, Status> {
        let _timer = self.agent.metrics().time("Upgrade");
        let caller = Caller::of(&req);
        let call = async { Ok(self.agent.clone().upgrade().await?) };
        let answer = self
            .audited("Upgrade", &caller, "", call, |_| String::new())
            .await?;
        Ok(Response::new(answer))
    }

    async fn forget_footprint(
        &self,
        req: Request<pb::ForgetFootprintRequest>,
    ) -> Result<Response<pb::Workload>, Status> {
        let _timer = self.agent.metrics().time("ForgetFootprint");
        let caller = Caller::of(&req);
        let workload = req.into_inner().workload;
        let call = async { Ok(self.agent.forget_footprint(&workload).await?) };
        let entry = self
            .audited("ForgetFootprint", &caller, "", call, |_| String::new())
            .await?;
        Ok(Response::new(entry))
    }
}

fn log_line(l: resident_supervisor::LogLine, id: &str) -> pb::LogLine {
    pb::LogLine {
        line: l.line,
        stream: match l.stream {
            resident_supervisor::Stream::Stdout => pb::LogStream::Stdout as i32,
            resident_supervisor::Stream::Stderr => pb::LogStream::Stderr as i32,
        },
        seq: l.seq,
        instance_id: id.to_string(),
    }
}

/// Whether the agent holds `i` as ended for good (no process, no restart).
fn run_ended(i: &pb::Instance) -> bool {
    i.state == pb::State::Exited as i32 || i.state == pb::State::Failed as i32
}

/// A `Logs` call with `follow`: the tail, then every new line until the
/// instance's run ends (the stream then ends OK), the agent shuts down or
/// the caller goes away.
struct LogFollower {
    id: String,
    /// The run had ended when the call came.
    ended: bool,
    live: broadcast::Receiver<resident_supervisor::LogLine>,
    /// The agent's events, which say when the run ends.
    events: broadcast::Receiver<pb::Event>,
    agent: Weak<Agent>,
    tx: crate::outbox::Outbox<pb::LogLine>,
}

impl LogFollower {
    async fn run(
        mut self,
        tail: Vec<resident_supervisor::LogLine>,
        closing: impl Future<Output = ()>,
    ) {
        tokio::pin!(closing);
        for l in tail {
            if !self.send(l).await {
                return;
            }
        }
        if self.ended {
            return self.drain().await;
        }
        loop {
            tokio::select! {
                // Lines first: those of a run come before the event of its end.
                biased;
                next = self.live.recv() => match next {
                    Ok(l) => {
                        if !self.send(l).await {
                            return;
                        }
                    }
                    Err(RecvError::Lagged(n)) => return self.lagged(n).await,
                    Err(RecvError::Closed) => return,
                },
                event = self.events.recv() => {
                    if self.ends_run(event) {
                        return self.drain().await;
                    }
                }
                () = &mut closing => {
                    let _ = self.tx.send(Err(Status::unavailable("the agent is shutting down"))).await;
                    return;
                }
            }
        }
    }

    /// Whether `event` (or, when events were missed, the agent's state now)
    /// says that the run has ended or the instance is gone.
    fn ends_run(&self, event: Result<pb::Event, RecvError>) -> bool {
        match event {
            Ok(e) => e.instance.is_some_and(|i| {
                i.instance_id == self.id
                    && (run_ended(&i) || e.kind == pb::EventKind::Forgotten as i32)
            }),
            Err(RecvError::Lagged(_)) => match self.agent.upgrade().map(|a| a.get(&self.id)) {
                Some(Ok(i)) => run_ended(&i),
                None | Some(Err(_)) => true,
            },
            Err(RecvError::Closed) => true,
        }
    }

    /// Sends the lines the ended run left in the follower's buffer.
    async fn drain(&mut self) {
        loop {
            match self.live.try_recv() {
                Ok(l) => {
                    if !self.send(l).await {
                        return;
                    }
                }
                Err(TryRecvError::Lagged(n)) => return self.lagged(n).await,
                Err(_) => return,
            }
        }
    }

    async fn lagged(&self, n: u64) {
        let msg = format!("log follower fell behind by {n} lines");
        let _ = self.tx.send(Err(Status::resource_exhausted(msg))).await;
    }

    /// False once the caller has gone.
    async fn send(&self, l: resident_supervisor::LogLine) -> bool {
        self.tx.send(Ok(log_line(l, &self.id))).await
    }
}
