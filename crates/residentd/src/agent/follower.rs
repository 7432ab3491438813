//! The supervisor's transitions applied to the books and the event log,
//! and the periodic work: the probes' readings (`reading.rs`), a failing
//! journal written again, overruns told (`overrun.rs`), the exposure guard
//! (`exposure.rs`), idle expiry, idle sleeps (`sleep.rs`) and owners'
//! leases. A run's terminal event is the one place its memory is
//! released: once, by `follow_supervisor`, before the event is published.

use std::sync::{Arc, Weak};
use std::time::Duration;

use resident_api::pb;
use resident_supervisor::{State, Status, Supervisor};
use tokio::sync::mpsc;

use super::books::{Books, Guarded, Sleepy};
use super::durability::Durability;
use super::exposure::{Exposed, Guard};
use super::overrun;
use super::parts::Parts;
use super::picture::Signals;
use super::reading::Reader;
use super::shared::{Clock, Current};
use super::sleep::Sleeps;
use super::stop::Stopper;
use super::tell::Teller;
use crate::events::EventLog;
use crate::metrics::Metrics;

/// The follower.
#[derive(Debug)]
pub(super) struct Follower {
    config: Current,
    books: Arc<Books>,
    sup: Supervisor,
    events: Arc<EventLog>,
    durability: Arc<Durability>,
    metrics: Arc<Metrics>,
    signals: Arc<Signals>,
    exposure: Guard,
    teller: Arc<Teller>,
    reader: Arc<Reader>,
    stopper: Arc<Stopper>,
    sleeps: Arc<Sleeps>,
    clock: Clock,
}

impl Follower {
    /// The room, on the parts (and the rooms) it uses.
    pub(super) fn new(
        p: &Parts,
        teller: Arc<Teller>,
        reader: Arc<Reader>,
        stopper: Arc<Stopper>,
        sleeps: Arc<Sleeps>,
    ) -> Self {
        Self {
            config: p.config.clone(),
            books: p.books.clone(),
            sup: p.sup.clone(),
            events: p.events.clone(),
            durability: p.durability.clone(),
            metrics: p.metrics.clone(),
            signals: p.signals.clone(),
            exposure: Guard::default(),
            teller,
            reader,
            stopper,
            sleeps,
            clock: p.clock,
        }
    }

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
            self.durability.change();
        }
        if status.state == State::Backoff {
            self.metrics.restarted(&status.workload);
        }
        let mut instance = resident_api::instance(&status.instance, &record.spec, Some(&status));
        self.teller.with_record(&mut instance, &record);
        self.teller.publish(instance, pb::EventKind::Transition);
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

    /// Tells about every overrun that began, changed pools or ended since
    /// the last readings (an `OVERRUN` event), and stops the runs whose
    /// policy says so.
    fn tell_overruns(&self) {
        for told in overrun::changes(&self.books, self.config.get().node.on_overrun) {
            if let Some(record) = self.books.record(&told.id) {
                self.events.publish(pb::Event {
                    instance: Some(self.teller.view(&told.id, &record)),
                    kind: pb::EventKind::Overrun as i32,
                    pool: told.pools.join(","),
                    message: told.message.clone(),
                    ..Default::default()
                });
            }
            if told.stop {
                let stopper = self.stopper.clone();
                let cause = Some((
                    pb::Cause::Overrun,
                    format!("{}; on_overrun = \"stop\"", told.message),
                ));
                let (id, run) = (told.id, told.generation);
                tokio::spawn(async move { stopper.stop(&id, Some(run), None, cause).await });
            }
        }
    }

    /// Stops every READY instance under `expose = "loopback"` that listens
    /// beyond loopback; an adopted one is reported instead (once per run).
    async fn guard_exposure(&self) {
        let guarded: Vec<(Guarded, i32)> = self
            .books
            .loopback_only()
            .into_iter()
            .filter_map(|g| {
                let s = self
                    .sup
                    .status(&g.id)
                    .filter(|s| s.generation == g.generation)?;
                let pid = s.pid.filter(|_| s.state == State::Ready)?;
                let pid = i32::try_from(pid).ok()?;
                Some((g, pid))
            })
            .collect();
        for Exposed { guarded: g, addr } in self.exposure.look(guarded).await {
            let what =
                format!("EXPOSED: listening on {addr}, beyond loopback (expose = \"loopback\")");
            if g.adopted {
                let note = format!("{what}; adopted, so reported and not stopped");
                if self.books.note(&g.id, g.generation, note) {
                    tracing::warn!(instance_id = %g.id, %addr, "an adopted server listens beyond loopback under expose = \"loopback\"; reported, not stopped");
                    self.metrics.exposed(&g.workload);
                    self.teller.publish_view(&g.id);
                }
                continue;
            }
            tracing::warn!(instance_id = %g.id, %addr, "listening beyond loopback under expose = \"loopback\"; stopping");
            self.metrics.exposed(&g.workload);
            let stopper = self.stopper.clone();
            let (id, run) = (g.id, Some(g.generation));
            let cause = Some((pb::Cause::Exposed, what));
            tokio::spawn(async move { stopper.stop(&id, run, None, cause).await });
        }
    }

    /// Stops instances unused for longer than their workload's idle TTL.
    /// Runs every second: only instances of workloads with a TTL are
    /// looked at, so a node without TTLs does no per-instance work.
    fn expire_idle(&self) {
        for (id, run) in self.books.idle(self.clock.now_ms()) {
            tracing::info!(instance_id = %id, "idle TTL reached, stopping");
            let stopper = self.stopper.clone();
            let cause = Some((pb::Cause::Idle, "stopped after its idle TTL".to_string()));
            tokio::spawn(async move { stopper.stop(&id, Some(run), None, cause).await });
        }
    }
}

impl Follower {
    /// A server that died asleep (or falling asleep, or waking) is not
    /// restarted into a process the books hold the wrong demand for: its
    /// run is stopped and its asleep demand released.
    fn died_asleep(&self, status: &Status) {
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
        let stopper = self.stopper.clone();
        tokio::spawn(async move { stopper.stop(&id, run, None, cause).await });
    }

    /// Stops instances whose owner's lease ran out (monotonic time, so a
    /// step of the wall clock changes nothing).
    fn expire_leases(&self) {
        for (id, run, ms) in self.books.leases_expired(self.clock.now_ms()) {
            tracing::info!(instance_id = %id, lease_ms = ms, "lease expired, stopping");
            let stopper = self.stopper.clone();
            let cause = Some((
                pb::Cause::LeaseExpired,
                format!("LEASE_EXPIRED: its owner did not renew its lease of {ms} ms"),
            ));
            tokio::spawn(async move { stopper.stop(&id, Some(run), None, cause).await });
        }
    }
}

/// Applies every supervisor transition to the books and the event log.
pub(super) async fn follow_supervisor(
    agent: Weak<Follower>,
    mut rx: mpsc::UnboundedReceiver<Status>,
) {
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
pub(super) async fn tick(agent: Weak<Follower>) {
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(agent) = agent.upgrade() else {
            return;
        };
        if agent.durability.failing().is_some() {
            // Try again: starts resume once the state_dir takes writes.
            agent.durability.change();
        }
        // Holds run out with time, and a node of static budgets reads
        // nothing: the fleet views look again once a second (a reading
        // has told them already).
        if !agent.reader.refresh_async(&agent.config.get()).await {
            agent.signals.figures_may_have_moved();
        }
        agent.tell_overruns();
        // Once the agent closes or hands over, the books list no idle run
        // and no lapsed lease (`Books::close`): nothing moves after the
        // last journal write.
        agent.expire_idle();
        agent.sleeps.sleep_idle();
        agent.expire_leases();
        agent.guard_exposure().await;
    }
}
