//! What the agent answers without starting or stopping anything: Get,
//! List, the pools, Place, Touch, and a reload of the configuration.

use std::sync::Arc;

use resident_api::{ApiError, pb};
use resident_config::{Config, Workload};
use resident_core::{InstanceId, Policy};

use super::Agent;
use super::books::Sleepy;
use super::books::{Hold, Record};
use super::picture::{self, Figures};
use super::roster::{footprint_key, workload_of};

impl Agent {
    /// An instance as its record and its current run say.
    pub(super) fn view(&self, id: &str, record: &Record) -> pb::Instance {
        let status = self
            .sup
            .status(id)
            .filter(|s| s.generation == record.generation);
        let mut out = match status {
            None if record.cancelled => resident_api::unspawned(id, &record.spec),
            _ => resident_api::instance(id, &record.spec, status.as_ref()),
        };
        self.with_record(&mut out, record);
        out
    }

    /// Fills in what the record knows beside the run: the devices of its
    /// chosen pools, whether it was adopted, a note on the run, and its
    /// lease (its length and what is left now).
    pub(super) fn with_record(&self, out: &mut pb::Instance, record: &Record) {
        let devices: Vec<String> = record.devices.iter().map(u32::to_string).collect();
        out.devices = devices.join(",");
        if let Some(a) = record.adopted {
            out.adopted = true;
            out.managed = a.manage;
        }
        let ended = [pb::State::Exited as i32, pb::State::Failed as i32].contains(&out.state);
        // Falling asleep and waking show SLEEPING too: its server is not
        // serving (a request then would find it mid-sleep, or asleep), and
        // a Start waits for the call under way and then wakes it.
        if out.state == pb::State::Ready as i32 {
            let asleep = match record.sleep {
                Some(Sleepy::Asleep(since)) => {
                    let secs = self.now_ms().saturating_sub(since) / 1000;
                    Some(format!("asleep for {secs} s; a Start wakes it"))
                }
                Some(Sleepy::Falling) => {
                    Some("falling asleep; a Start wakes it once it is asleep".to_string())
                }
                Some(Sleepy::Waking) => Some("waking".to_string()),
                Some(Sleepy::Woken(ms)) => {
                    out.message = format!("{}; WOKEN in {ms} ms", out.message);
                    None
                }
                None => None,
            };
            if let Some(text) = asleep {
                out.state = pb::State::Sleeping as i32;
                out.message = format!("SLEEPING: {text}");
            }
        }
        if let Some(note) = record.note.as_ref().filter(|_| !ended) {
            out.message = format!("{}; {note}", out.message);
        }
        if let Some(o) = record.overrun.as_ref().filter(|_| !ended) {
            out.message = format!("{}; {}", out.message, o.text);
        }
        // The typed word beside the text: why a stop was asked, else what
        // the agent tells of a running one.
        out.cause = match (record.cause, &record.overrun, &record.note) {
            (Some(cause), _, _) => cause,
            (None, Some(_), _) if !ended => pb::Cause::Overrun,
            (None, _, Some(note)) if !ended && note.starts_with("EXPOSED") => pb::Cause::Exposed,
            _ => pb::Cause::Unspecified,
        } as i32;
        for (pool, charge) in self.books.charges(&out.instance_id) {
            out.reserved_bytes = out.reserved_bytes.saturating_add(charge.counted());
            out.overrun_bytes = out.overrun_bytes.saturating_add(charge.overrun());
            if let Some(d) = out.demand.iter_mut().find(|d| d.pool == pool.as_str()) {
                d.overrun_bytes = charge.overrun();
            }
        }
        if let Some(report) = &record.report {
            out.server_buffers = report
                .buffers
                .iter()
                .map(|b| pb::ServerBuffer {
                    device: b.device.clone(),
                    kind: b.kind.as_str().to_string(),
                    bytes: b.bytes,
                })
                .collect();
        }
        out.hold_left_ms = self.books.hold_left(&out.instance_id, self.now_ms());
        if let Some(lease) = record.lease {
            out.lease_ms = lease.ms;
            out.lease_left_ms = lease.until.saturating_sub(self.now_ms());
        }
    }

    /// The epoch of this agent's revisions (drawn when it began afresh;
    /// an upgrade hands it over with the history).
    pub fn epoch(&self) -> u64 {
        self.events.epoch()
    }

    /// The whole node, as `Node` answers: `revision` and `instances` as
    /// read together by the caller (the revision first), the pools read
    /// now.
    pub fn node_status(&self, revision: u64, instances: Vec<pb::Instance>) -> pb::NodeStatus {
        picture::node_status(
            &self.config(),
            revision,
            instances,
            self.pools(),
            self.epoch(),
        )
    }

    /// The pools' figures and every hold in force, now.
    pub fn figures(&self) -> Figures {
        let now = self.now_ms();
        Figures::new(self.pools(), self.books.holds(now), now)
    }

    /// Changes each time the figures may have moved without an event.
    pub fn figures_moved(&self) -> tokio::sync::watch::Receiver<u64> {
        self.signals.figures_moved()
    }

    /// Counts changes of the roster (`Workloads`' answer).
    pub fn roster_generation(&self) -> u64 {
        self.signals.roster_generation()
    }

    /// One instance.
    pub fn get(&self, id: &str) -> Result<pb::Instance, ApiError> {
        match self.books.record(id) {
            Some(r) => Ok(self.view(id, &r)),
            None => Err(ApiError::NotFound(format!("no instance '{id}'"))),
        }
    }

    /// Every instance, in id order.
    pub fn list(&self) -> Vec<pb::Instance> {
        let records = self.books.records();
        records.iter().map(|(id, r)| self.view(id, r)).collect()
    }

    /// The pools as they are; a disk pool's figures are its own books':
    /// what its saved conversations hold (`keep_kv`), its budget tightened
    /// by its filesystem's free space.
    pub fn pools(&self) -> Vec<pb::PoolStatus> {
        let mut pools = self.books.pools();
        for disk in self.kv.pools() {
            if let Some(p) = pools.iter_mut().find(|p| p.name == disk.name) {
                *p = disk;
            }
        }
        pools
    }

    /// The placement query: what a Start would do, changing nothing; of
    /// a Start naming `id`, when given.
    pub async fn place(
        self: &Arc<Self>,
        workload: &str,
        policy: Option<Policy>,
        id: Option<&InstanceId>,
    ) -> Result<pb::Placement, ApiError> {
        let config = self.config();
        let w = workload_of(&config, workload)?;
        let policy = policy.unwrap_or(config.node.on_full);
        self.refresh_probes_async(&config).await;
        let key = self.keys.recent(&config, &w);
        self.books.place(&w, id, policy, self.now_ms(), key)
    }

    /// The roster: every workload with its declared demand, raised by
    /// what was learned for the command and files it resolves to now.
    pub fn workloads(&self) -> Vec<pb::Workload> {
        let config = self.config();
        config
            .workloads
            .iter()
            .map(|(name, w)| self.roster_entry(&config, name, w))
            .collect()
    }

    fn roster_entry(&self, config: &Config, name: &str, w: &Workload) -> pb::Workload {
        let spec = self.books.learned_spec(w, footprint_key(config, w));
        let learned = spec.demand.values().map(|d| d.floor).sum::<u64>()
            + spec
                .any_of
                .iter()
                .map(|a| a.demand.floor * a.count as u64)
                .sum::<u64>();
        let group = config
            .groups
            .of(name)
            .map(|(group, rules)| pb::WorkloadGroup {
                name: group.to_string(),
                swap: rules.swap,
                exclusive: rules.exclusive,
                persistent: rules.persistent,
            });
        pb::Workload {
            name: name.to_string(),
            aliases: w.aliases.clone(),
            role: w.spec.role.to_string(),
            demand: resident_api::demand(&spec),
            concurrency_limit: w.concurrency_limit.unwrap_or(0),
            any_of: resident_api::any_of(&spec),
            learned_bytes: learned,
            priority: w.spec.priority,
            excludes: w.spec.excludes.clone(),
            group,
            can_sleep: w.spec.asleep.as_ref().is_some_and(|a| !a.by_itself),
        }
    }

    /// Forgets what was learned for `workload` (a name or alias) and
    /// answers with its roster entry once the journal on disk no longer
    /// holds it.
    pub async fn forget_footprint(&self, workload: &str) -> Result<pb::Workload, ApiError> {
        let config = self.config();
        let w = workload_of(&config, workload)?;
        let name = w.spec.workload.to_string();
        if self.books.forget_learned(&name) {
            tracing::info!(workload = %name, "learned footprint forgotten");
            self.signals.roster_changed();
            let change = self.persist();
            self.durable(change).await?;
        }
        Ok(self.roster_entry(&config, &name, &w))
    }

    /// Marks a use of `id` and protects it from eviction, or ends that
    /// protection, as `hold` says.
    pub fn touch(&self, id: &str, hold: Hold) -> Result<pb::Instance, ApiError> {
        if !self.books.touch(id, self.now_ms(), hold) {
            self.get(id)?;
            return Err(ApiError::FailedPrecondition(format!(
                "instance '{id}' is not resident"
            )));
        }
        if !matches!(hold, Hold::For(0)) {
            self.signals.figures_may_have_moved();
        }
        self.get(id)
    }

    /// Tells watchers that an ended instance was dropped, and lets the
    /// supervisor forget its run.
    pub(super) fn forgotten(&self, id: &str, record: &Record) {
        let last = self.view(id, record);
        self.sup.forget(id, record.generation);
        tracing::debug!(instance_id = %id, "forgot an ended instance");
        self.events.publish(pb::Event {
            instance: Some(last),
            kind: pb::EventKind::Forgotten as i32,
            ..Default::default()
        });
    }

    /// Re-reads the configuration file: workloads, groups and pools change;
    /// running instances are not touched. An invalid file changes nothing.
    pub fn reload(&self) -> Result<Vec<String>, resident_config::ConfigError> {
        let old = self.config();
        let new = resident_config::load(&old.source)?;
        let mut warnings = new.warnings.clone();
        warnings.extend(restart_needed(&old, &new));
        // What follows the config outside the agent (new certificates for
        // new connections) takes it first; an error changes nothing.
        for hook in self.reload_hooks.lock().0.iter() {
            hook(&old, &new)?;
        }
        for w in &warnings {
            tracing::warn!("{w}");
        }
        // The agent's snapshot first, then the books': an admission
        // decided on either old snapshot meanwhile is decided again.
        let new = Arc::new(new);
        *self.config.write() = new.clone();
        self.books.reconfigure(&new);
        self.kv.configure(&new);
        self.open_device_probes();
        self.refresh_probes();
        self.signals.roster_changed();
        Ok(warnings)
    }
}

/// Every changed key that a reload does not apply: each takes effect at
/// the next start of the agent.
fn restart_needed(old: &resident_config::Config, new: &resident_config::Config) -> Vec<String> {
    let (o, n) = (&old.node, &new.node);
    let changed = [
        ("listen", o.listen != n.listen),
        ("state_dir", o.state_dir != n.state_dir),
        ("metrics_listen", o.metrics_listen != n.metrics_listen),
        ("socket_group", o.socket_group != n.socket_group),
        ("cgroups", o.cgroups != n.cgroups),
        ("sample_every", o.sample_every != n.sample_every),
        (
            "keepalive_interval",
            o.keepalive_interval != n.keepalive_interval,
        ),
        (
            "keepalive_timeout",
            o.keepalive_timeout != n.keepalive_timeout,
        ),
        // Certificates are reloaded; adding or removing TLS is not.
        ("tls", o.tls.is_some() != n.tls.is_some()),
        ("insecure", o.insecure != n.insecure),
        ("name", o.name != n.name),
    ];
    changed
        .iter()
        .filter(|(_, c)| *c)
        .map(|(key, _)| {
            format!("node.{key} changed: it takes effect at the next restart of the agent")
        })
        .collect()
}
