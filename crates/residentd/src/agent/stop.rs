//! Stopping a run, a room of its own: the books cancel it (one critical
//! section), a server that keeps its KV saves its conversations, the
//! supervisor stops its group, the run's terminal event releases its
//! memory, and the answer waits for the journal. Every stop goes through
//! here: a Stop, an eviction, an idle TTL, a lease, an overrun, a failed
//! sleep.

use std::sync::Arc;
use std::time::Duration;

use resident_api::{ApiError, pb};
use resident_supervisor::{State, Supervisor, SupervisorError};

use super::books::Books;
use super::durability::Durability;
use super::kv::KvStore;
use super::parts::Parts;
use super::shared::Current;
use super::tell::Teller;
use crate::metrics::Metrics;

/// The stopper.
#[derive(Debug)]
pub(super) struct Stopper {
    config: Current,
    books: Arc<Books>,
    sup: Supervisor,
    kv: Arc<KvStore>,
    durability: Arc<Durability>,
    metrics: Arc<Metrics>,
    teller: Arc<Teller>,
}

impl Stopper {
    /// The room, on the parts (and the rooms) it uses.
    pub(super) fn new(p: &Parts, teller: Arc<Teller>) -> Self {
        Self {
            config: p.config.clone(),
            books: p.books.clone(),
            sup: p.sup.clone(),
            kv: p.kv.clone(),
            durability: p.durability.clone(),
            metrics: p.metrics.clone(),
            teller,
        }
    }

    /// Stops an instance and answers once its group has exited, its
    /// memory is released and the journal on disk no longer lists it. With
    /// `cause`, the ended run's message gives it instead of "stopped" (an
    /// eviction, an idle TTL); with `run`, only that run of `id`: the
    /// agent's own stops are decided for a run, and get NotFound once a
    /// later run of the id has replaced it, which they never end.
    pub(super) async fn stop(
        &self,
        id: &str,
        run: Option<u64>,
        grace: Option<Duration>,
        cause: Option<(pb::Cause, String)>,
    ) -> Result<pb::Instance, ApiError> {
        let (kind, cause) = match cause {
            Some((kind, text)) => (kind, Some(text)),
            None => (pb::Cause::Stopped, None),
        };
        if let Some(a) = self.books.record(id).and_then(|r| r.adopted)
            && !a.manage
        {
            return Err(ApiError::FailedPrecondition(format!(
                "instance '{id}' was adopted without manage: the agent never signals pid {}; it leaves the books when that process exits",
                a.pid
            )));
        }
        let Some(c) = self.books.cancel(id, run, kind) else {
            return Err(ApiError::NotFound(match run {
                Some(g) => format!("run {g} of instance '{id}' has ended"),
                None => format!("no instance '{id}'"),
            }));
        };
        let (mut stopping, mut ended) = (None, None);
        if c.resident {
            self.keep_conversations(id, c.generation).await;
            match self.sup.stop_run(id, c.generation, grace, cause).await {
                Ok(s) => stopping = Some(s),
                // Not spawned yet: the Start that finds it cancelled ends
                // it (before or right after its spawn).
                Err(SupervisorError::NotFound(_) | SupervisorError::NotTheRun { .. }) => {}
                Err(e) => tracing::warn!(instance_id = id, error = %e, "stop"),
            }
        } else {
            // Ended already: its last status, before a Start replaces it.
            ended = self.sup.status(id);
        }
        // Released by the run's terminal event (or, for a run not yet
        // spawned, by the Start that finds it cancelled); the end is read
        // after it, when it is there already: one wake-up for this stop,
        // not one for each of the run's transitions as well.
        self.books.released(id, c.generation).await;
        if let Some(s) = stopping {
            ended = Some(s.ended().await);
        }
        // With `durable_answers`, the journal no longer lists it: a crash
        // cannot bring it back.
        let durable = self.config.get().node.durable_answers;
        self.durability.commit(durable).await?;
        // The run this Stop ended, never a new one that a Start has begun
        // under the same id meanwhile.
        let ended = ended
            .or_else(|| self.sup.status(id))
            .filter(|s| s.generation == c.generation);
        if let Some(status) = ended {
            let mut out = resident_api::instance(id, &c.spec, Some(&status));
            match self.books.record(id) {
                Some(r) if r.generation == c.generation => self.teller.with_record(&mut out, &r),
                _ => out.cause = kind as i32,
            }
            return Ok(out);
        }
        // No process of the run: it was stopped before its spawn.
        Ok(match self.books.record(id) {
            Some(r) if r.generation == c.generation => self.teller.view(id, &r),
            _ => resident_api::unspawned(id, &c.spec),
        })
    }

    /// Before a stop: a READY server of a workload that keeps its KV
    /// (`keep_kv`) saves its conversations to its disk pool. Whatever comes
    /// of it, the stop goes on.
    async fn keep_conversations(&self, id: &str, generation: u64) {
        let Some(record) = self.books.record(id).filter(|r| r.generation == generation) else {
            return;
        };
        if record.workload.keep_kv.is_none() {
            return;
        }
        let Some(status) = self
            .sup
            .status(id)
            .filter(|s| s.generation == generation && s.state == State::Ready)
        else {
            return;
        };
        self.kv
            .save(id, &record.workload, status.port)
            .await
            .count(&self.metrics);
    }
}
