//! The supervisor's transitions applied to the books and the event log,
//! and the periodic work: the probes' readings fed into the books and
//! their health told, overruns told (`overrun.rs`), the exposure guard
//! (`exposure.rs`), idle expiry and owners' leases. A run's terminal
//! event is the one place its memory is released: once, by
//! `follow_supervisor`, before the event is published.

use std::sync::{Arc, Weak};
use std::time::Duration;

use resident_api::pb;
use resident_config::Config;
use resident_core::PoolName;
use resident_supervisor::{State, Status};
use tokio::sync::mpsc;

use super::Agent;
use super::books::Readings;
use super::books::{Guarded, Sleepy};
use super::exposure::Exposed;
use super::overrun;

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

    /// Tells about every overrun that began, changed pools or ended since
    /// the last readings (an `OVERRUN` event), and stops the runs whose
    /// policy says so.
    fn tell_overruns(self: &Arc<Self>) {
        for told in overrun::changes(&self.books, self.config().node.on_overrun) {
            if let Some(record) = self.books.record(&told.id) {
                self.events.publish(pb::Event {
                    instance: Some(self.view(&told.id, &record)),
                    kind: pb::EventKind::Overrun as i32,
                    pool: told.pools.join(","),
                    message: told.message.clone(),
                    ..Default::default()
                });
            }
            if told.stop {
                let me = self.clone();
                let cause = Some((
                    pb::Cause::Overrun,
                    format!("{}; on_overrun = \"stop\"", told.message),
                ));
                let (id, run) = (told.id, told.generation);
                tokio::spawn(async move { me.stop_because(&id, Some(run), None, cause).await });
            }
        }
    }

    /// Stops every READY instance under `expose = "loopback"` that listens
    /// beyond loopback; an adopted one is reported instead (once per run).
    async fn guard_exposure(self: &Arc<Self>) {
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
                    self.publish_view(&g.id);
                }
                continue;
            }
            tracing::warn!(instance_id = %g.id, %addr, "listening beyond loopback under expose = \"loopback\"; stopping");
            self.metrics.exposed(&g.workload);
            let me = self.clone();
            let (id, run) = (g.id, Some(g.generation));
            let cause = Some((pb::Cause::Exposed, what));
            tokio::spawn(async move { me.stop_because(&id, run, None, cause).await });
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
        // Holds run out with time, and a node of static budgets reads
        // nothing: the fleet views look again once a second (a reading
        // has told them already).
        if !agent.refresh_probes_async(&agent.config()).await {
            agent.signals.figures_may_have_moved();
        }
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

/// The live readings: the probes' (`probes.rs`) of host- and device-bound
/// pools fed into the ledger, and their health told.
impl Agent {
    /// Reads the live probes into the books: host memory for host-bound
    /// pools, device readings, and each instance's measured bytes. The
    /// probes and `/proc` are read first; the books' lock is taken once,
    /// for the numbers alone.
    pub fn refresh_probes(&self) {
        let _ = self.refresh_probes_with(&self.config());
    }

    /// [`Agent::refresh_probes_with`] from async code. Where a device probe
    /// is open (an NVML call, a reading file, and the /proc scan that
    /// per-process device use needs) it runs on a blocking thread, so a
    /// slow driver never holds one of the runtime's threads; a node of host
    /// pools only reads /proc/meminfo (one small read) in place.
    pub(super) async fn refresh_probes_async(self: &Arc<Self>, config: &Arc<Config>) -> bool {
        if !self.probes.has_devices() {
            return self.refresh_probes_with(config);
        }
        let (me, config) = (self.clone(), config.clone());
        tokio::task::spawn_blocking(move || me.refresh_probes_with(&config))
            .await
            .unwrap_or(false)
    }

    /// [`Agent::refresh_probes`] under the request's config snapshot. On a
    /// blocking thread where a device probe is open; on a node of host
    /// pools alone, in place: one read of /proc/meminfo. Whether there was
    /// anything to read (and the fleet views were told).
    #[allow(clippy::disallowed_methods)]
    pub(super) fn refresh_probes_with(&self, config: &Config) -> bool {
        let mut readings = Readings {
            available: self.probes.devices(),
            measured: self
                .probes
                .device_use(|| {
                    let runs = self.sup.list().into_iter();
                    runs.filter_map(|s| Some((s.instance.to_string(), s.pid?)))
                        .collect()
                })
                .into_iter()
                .filter_map(|(id, pool, bytes)| Some((id, PoolName::new(pool).ok()?, bytes)))
                .collect(),
            host: Vec::new(),
            host_pools: config
                .pools
                .iter()
                .filter(|p| p.host)
                .map(|p| p.pool.name.clone())
                .collect(),
            learn: config.node.learn_footprints,
        };
        // Only host-bound pools count measured bytes; a node without one
        // skips the copy of every status (this runs every second).
        if !readings.host_pools.is_empty() {
            let host = self.probes.host();
            for pool in &readings.host_pools {
                readings.available.push((pool.to_string(), host));
            }
            readings.host = self
                .sup
                .list()
                .into_iter()
                .map(|s| (s.instance.to_string(), s.measured_bytes))
                .collect();
        }
        // A node whose pools all have static budgets reads nothing: then
        // nothing moved, and a Start or a Place does not wake every fleet
        // view (the tick still does, once a second).
        if readings.available.is_empty() && readings.measured.is_empty() {
            return false;
        }
        self.probe_health(&readings.available);
        if self.books.set_readings(readings) {
            self.persist();
            self.signals.roster_changed();
        }
        self.signals.figures_may_have_moved();
        true
    }

    /// Tells when a pool's live reading fails (no reading: its configured
    /// budget stands in) and when it comes back: a log line, a POOL event
    /// and the metrics, once per change.
    fn probe_health(&self, available: &[(String, Option<u64>)]) {
        for h in self.probes.health(available) {
            self.metrics.pool_live(&h.pool, h.live);
            if h.live {
                if h.known {
                    tracing::info!(pool = %h.pool, "live readings are back");
                    self.publish_pool(&h.pool, "live readings are back");
                }
            } else {
                let message =
                    "no live reading: its configured budget stands in until readings come back";
                tracing::warn!(pool = %h.pool, "{message}");
                self.publish_pool(&h.pool, message);
            }
        }
    }

    /// Opens the probe of every device-bound pool of the config in force.
    pub(super) fn open_device_probes(&self) {
        self.probes.open(&self.config());
    }
}
