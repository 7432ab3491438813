//! The supervisor's transitions applied to the books and the event log,
//! and the periodic work (probe readings, idle expiry, owners' leases). A
//! run's terminal event is the one place its memory is released: once, by
//! `follow_supervisor`, before the event is published.

use std::sync::{Arc, Weak};
use std::time::Duration;

use resident_api::pb;
use resident_supervisor::{State, Status};
use tokio::sync::mpsc;

use super::Agent;
use super::books::Sleepy;

impl Agent {
    fn on_transition(&self, status: Status) {
        let record = self.books.record(&status.instance);
        let Some(mut record) = record.filter(|r| r.generation == status.generation) else {
            return;
        };
        if status.state == State::Ready && record.workload.reports_buffers {
            self.read_report(&status.instance, status.generation);
            record = self.books.record(&status.instance).unwrap_or(record);
        }
        if matches!(status.state, State::Starting) || status.state.is_terminal() {
            self.persist();
        }
        if status.state == State::Backoff {
            self.metrics.restarted(&status.workload);
        }
        let mut instance = resident_api::instance(&status.instance, &record.spec, Some(&status));
        self.with_record(&mut instance, &record);
        self.events.publish(pb::Event {
            instance: Some(instance),
            kind: pb::EventKind::Transition as i32,
            ..Default::default()
        });
    }

    /// Reads what the server of run `generation` of `id` reported
    /// allocating while it loaded, from its output (the ring's last lines,
    /// the last load's), into its record.
    fn read_report(&self, id: &str, generation: u64) {
        let Some(logs) = self.sup.logs(id) else {
            return;
        };
        let lines = logs.tail(usize::MAX);
        let report = resident_config::report::Report::read(lines.iter().map(|l| l.line.as_str()));
        if report.buffers.is_empty() {
            tracing::debug!(instance_id = %id, "its server reported no buffers");
            return;
        }
        let each: Vec<String> = report
            .buffers
            .iter()
            .map(|b| {
                format!(
                    "{} {} {}",
                    b.device,
                    b.kind.as_str(),
                    resident_core::Gb(b.bytes)
                )
            })
            .collect();
        tracing::info!(instance_id = %id, "its server reports {}", each.join(", "));
        self.books.set_report(id, generation, report);
    }

    /// Tells watchers how an instance whose run was never spawned ended
    /// (EXITED, "stopped before it was spawned"): the one end no
    /// supervisor transition reports.
    pub(super) fn publish_ended(&self, id: &str) {
        let Some(record) = self.books.record(id) else {
            return;
        };
        self.persist();
        self.events.publish(pb::Event {
            instance: Some(self.view(id, &record)),
            kind: pb::EventKind::Transition as i32,
            ..Default::default()
        });
    }

    /// Tells watchers what happened to `pool`'s live reading.
    pub(super) fn publish_pool(&self, pool: &str, message: &str) {
        self.events.publish(pb::Event {
            kind: pb::EventKind::Pool as i32,
            pool: pool.to_string(),
            message: message.to_string(),
            ..Default::default()
        });
    }

    /// Tells watchers what is now known of `id` (a note on its run), with
    /// no change of state.
    pub(super) fn publish_view(&self, id: &str) {
        if let Some(record) = self.books.record(id) {
            self.events.publish(pb::Event {
                instance: Some(self.view(id, &record)),
                kind: pb::EventKind::Transition as i32,
                ..Default::default()
            });
        }
    }

    /// Stops instances unused for longer than their workload's idle TTL.
    /// Runs every second: only instances of workloads with a TTL are
    /// looked at, so a node without TTLs does no per-instance work.
    fn expire_idle(self: &Arc<Self>) {
        for (id, run) in self.books.idle(self.now_ms()) {
            tracing::info!(instance_id = %id, "idle TTL reached, stopping");
            let me = self.clone();
            let cause = Some((pb::Cause::Idle, "stopped after its idle TTL".to_string()));
            tokio::spawn(async move { me.stop_because(&id, Some(run), None, cause).await });
        }
    }
}

impl Agent {
    /// A server that died asleep (or falling asleep, or waking) is not
    /// restarted into a process the books hold the wrong demand for: its
    /// run is stopped and its asleep demand released.
    fn died_asleep(self: &Arc<Self>, status: &Status) {
        let asleep = self
            .books
            .record(&status.instance)
            .filter(|r| r.generation == status.generation)
            .is_some_and(|r| {
                matches!(
                    r.sleep,
                    Some(Sleepy::Asleep(_) | Sleepy::Falling | Sleepy::Waking)
                )
            });
        if !asleep {
            return;
        }
        let id = status.instance.to_string();
        let run = Some(status.generation);
        tracing::warn!(instance_id = %id, "its server died while asleep; stopping it");
        let cause = Some((
            pb::Cause::SleepFailed,
            format!(
                "SLEEP_FAILED: its server died while asleep ({})",
                status.reason
            ),
        ));
        let me = self.clone();
        tokio::spawn(async move { me.stop_because(&id, run, None, cause).await });
    }

    /// Stops instances whose owner's lease ran out (monotonic time, so a
    /// step of the wall clock changes nothing).
    fn expire_leases(self: &Arc<Self>) {
        for (id, run, ms) in self.books.leases_expired(self.now_ms()) {
            tracing::info!(instance_id = %id, lease_ms = ms, "lease expired, stopping");
            let me = self.clone();
            let cause = Some((
                pb::Cause::LeaseExpired,
                format!("LEASE_EXPIRED: its owner did not renew its lease of {ms} ms"),
            ));
            tokio::spawn(async move { me.stop_because(&id, Some(run), None, cause).await });
        }
    }
}

/// Applies every supervisor transition to the books and the event log.
pub(super) async fn follow_supervisor(agent: Weak<Agent>, mut rx: mpsc::UnboundedReceiver<Status>) {
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, 256).await > 0 {
        let Some(agent) = agent.upgrade() else {
            return;
        };
        // What has queued up is taken together, its runs' ends released
        // first: a Stop waiting for its release does not wait behind the
        // events published before its own (a storm of stops queues two
        // per instance). Events are still published in order.
        for status in batch.iter().filter(|s| s.state.is_terminal()) {
            agent.books.release(&status.instance, status.generation);
        }
        for status in batch.iter().filter(|s| s.state == State::Backoff) {
            agent.died_asleep(status);
        }
        for status in batch.drain(..) {
            agent.on_transition(status);
        }
    }
}

/// Periodic work: probe readings, idle expiry, leases and the exposure
/// guard.
pub(super) async fn tick(agent: Weak<Agent>) {
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(agent) = agent.upgrade() else {
            return;
        };
        if agent.journal_failing().is_some() {
            // Try again: starts resume once the state_dir takes writes.
            agent.persist();
        }
        agent.refresh_probes_async(&agent.config()).await;
        agent.tell_overruns();
        // Once the agent closes or hands over, the books list no idle run
        // and no lapsed lease (`Books::close`): nothing moves after the
        // last journal write.
        agent.expire_idle();
        agent.sleep_idle();
        agent.expire_leases();
        agent.guard_exposure().await;
    }
}
