//! The `WatchNode` stream, one task per watcher: the whole node first (or
//! the kept events after a revision of this agent's epoch), then every
//! event of the log, the pools' figures and holds after each run of
//! events and, when they move without one (a probe reading, a
//! measurement, a hold), at most once per interval; the roster when it
//! changes; a heartbeat when nothing else went out for a while. A watcher
//! that falls behind is sent the whole node again, not an error: what a
//! fleet view keeps is a picture, and a fresh one replaces it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use resident_api::pb;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::time::Instant;
use tonic::Status;

use crate::agent::{Agent, Figures};
use crate::events::Resume;

/// Events sent together before the figures that follow them.
const RUN: usize = 256;

type Tx = crate::outbox::Outbox<pb::NodeUpdate>;

/// How a watch begins and paces itself.
#[derive(Debug, Clone, Copy)]
pub struct Asked {
    /// Resume after this revision (0: the whole node first).
    pub since: u64,
    /// The epoch `since` was read in.
    pub epoch: u64,
    /// The least time between two figures-only updates.
    pub every: Duration,
    /// An update with nothing but the epoch and revision after this long
    /// without one; `None`: never.
    pub heartbeat: Option<Duration>,
}

/// Starts the task of one watcher; its updates come out of the receiver.
pub fn start(
    agent: Arc<Agent>,
    asked: Asked,
    closing: impl Future<Output = ()> + Send + 'static,
) -> crate::outbox::Streamed<pb::NodeUpdate> {
    let (tx, rx) = crate::outbox::outbox();
    let now = Instant::now();
    let watch = NodeWatch {
        epoch: agent.epoch(),
        agent,
        tx,
        asked,
        revision: 0,
        roster: None,
        figures: None,
        figures_at: now,
        sent_at: now,
    };
    tokio::spawn(watch.run(closing));
    rx
}

/// One watcher's state: what it was last sent.
struct NodeWatch {
    agent: Arc<Agent>,
    tx: Tx,
    asked: Asked,
    epoch: u64,
    /// The revision of the latest event sent.
    revision: u64,
    /// The roster generation sent.
    roster: Option<u64>,
    /// The figures sent, and when.
    figures: Option<Figures>,
    figures_at: Instant,
    /// When anything was last sent.
    sent_at: Instant,
}

impl NodeWatch {
    async fn run(mut self, closing: impl Future<Output = ()>) {
        tokio::pin!(closing);
        let mut moved = self.agent.figures_moved();
        moved.borrow_and_update();
        let Some(mut live) = self.begin().await else {
            return;
        };
        // Figures moved since they were last sent; sent once the interval
        // since then has passed.
        let mut pending = false;
        loop {
            let due = self.figures_at + self.asked.every;
            let beat = self.asked.heartbeat.map(|h| self.sent_at + h);
            let sent = tokio::select! {
                biased;
                () = &mut closing => {
                    let msg = format!(
                        "the agent is shutting down; resume with since_revision = {}, epoch = {}",
                        self.revision, self.epoch
                    );
                    let _ = self.tx.send(Err(Status::unavailable(msg))).await;
                    return;
                }
                next = live.recv() => match next {
                    Ok(first) => self.events(first, &mut live).await,
                    Err(RecvError::Lagged(_)) => match self.whole().await {
                        Some(rx) => {
                            live = rx;
                            true
                        }
                        None => false,
                    },
                    Err(RecvError::Closed) => false,
                },
                changed = moved.changed(), if !pending => {
                    pending = true;
                    changed.is_ok()
                }
                () = tokio::time::sleep_until(due), if pending => {
                    pending = false;
                    self.figures_if_moved().await
                }
                () = sleep_until(beat), if beat.is_some() => {
                    self.send(self.update()).await
                }
            };
            if !sent {
                return;
            }
        }
    }

    /// Resumes after the revision asked, when it is of this epoch and
    /// kept; otherwise sends the whole node. The live receiver.
    async fn begin(&mut self) -> Option<broadcast::Receiver<pb::Event>> {
        let Asked { since, epoch, .. } = self.asked;
        if since == 0 || epoch != self.epoch {
            return self.whole().await;
        }
        let (events, rx) = match self.agent.events().resume(since, Vec::new) {
            Resume::From(events, rx) => (events, rx),
            Resume::TooOld { .. } => return self.whole().await,
        };
        self.revision = since;
        let n = events.len();
        for (i, e) in events.into_iter().enumerate() {
            self.revision = e.revision;
            let mut update = self.update();
            update.event = Some(e);
            if i + 1 == n {
                self.attach(&mut update, true);
            }
            if !self.send(update).await {
                return None;
            }
        }
        if n == 0 {
            let mut update = self.update();
            self.attach(&mut update, true);
            if !self.send(update).await {
                return None;
            }
        }
        Some(rx)
    }

    /// Sends the whole node (with its figures and roster); the live
    /// receiver, subscribed together with the snapshot.
    async fn whole(&mut self) -> Option<broadcast::Receiver<pb::Event>> {
        let agent = self.agent.clone();
        let (revision, instances, rx) = agent.events().begin(|| agent.list());
        self.revision = revision;
        let mut update = self.update();
        update.node = Some(agent.node_status(revision, instances));
        self.roster = None;
        self.attach(&mut update, true);
        self.send(update).await.then_some(rx)
    }

    /// Sends `first` and the events that are already waiting behind it
    /// (at most `RUN`), the last with the figures as they are now.
    async fn events(
        &mut self,
        first: pb::Event,
        live: &mut broadcast::Receiver<pb::Event>,
    ) -> bool {
        let mut run = vec![first];
        while run.len() < RUN {
            match live.try_recv() {
                Ok(e) => run.push(e),
                Err(TryRecvError::Lagged(_)) => match self.whole().await {
                    Some(rx) => {
                        *live = rx;
                        return true;
                    }
                    None => return false,
                },
                Err(_) => break,
            }
        }
        run.retain(|e| e.revision > self.revision);
        let n = run.len();
        for (i, e) in run.into_iter().enumerate() {
            self.revision = e.revision;
            let mut update = self.update();
            update.event = Some(e);
            if i + 1 == n {
                self.attach(&mut update, true);
            }
            if !self.send(update).await {
                return false;
            }
        }
        true
    }

    /// Sends the figures (and the roster, if it changed) when they differ
    /// from what was sent.
    async fn figures_if_moved(&mut self) -> bool {
        let mut update = self.update();
        if !self.attach(&mut update, false) {
            return true;
        }
        self.send(update).await
    }

    /// Puts the figures on `update` (`always`, or when they moved since
    /// they were last sent) and the roster when it changed; whether
    /// anything was put.
    fn attach(&mut self, update: &mut pb::NodeUpdate, always: bool) -> bool {
        let generation = self.agent.roster_generation();
        let mut put = false;
        if self.roster != Some(generation) {
            update.roster = Some(pb::WorkloadsResponse {
                workloads: self.agent.workloads(),
            });
            self.roster = Some(generation);
            put = true;
        }
        let figures = self.agent.figures();
        let moved = self.figures.as_ref().is_none_or(|f| !f.same_as(&figures));
        if always || moved || put {
            update.figures = Some(figures.to_pb());
            self.figures = Some(figures);
            self.figures_at = Instant::now();
            put = true;
        }
        put
    }

    /// An update with the epoch and revision alone.
    fn update(&self) -> pb::NodeUpdate {
        pb::NodeUpdate {
            epoch: self.epoch,
            revision: self.revision,
            ..Default::default()
        }
    }

    /// False once the watcher has gone.
    async fn send(&mut self, update: pb::NodeUpdate) -> bool {
        self.sent_at = Instant::now();
        self.tx.send(Ok(update)).await
    }
}

/// Sleeps until `at`; never when `None` (the branch is off then).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
