//! What the agent answers without starting or stopping anything: the
//! pools, Node and a fleet view's figures, Place, Touch, the roster, and a
//! reload of the configuration (Get and List are the teller's).

use std::sync::Arc;

use parking_lot::Mutex;
use resident_api::{ApiError, pb};
use resident_config::{Config, Workload};
use resident_core::{InstanceId, Policy};

use super::books::{Books, Hold};
use super::durability::Durability;
use super::kv::KvStore;
use super::parts::Parts;
use super::picture::{self, Figures, Signals};
use super::reading::Reader;
use super::roster::{Keys, footprint_key, workload_of};
use super::shared::{Clock, Current};
use super::tell::Teller;
use crate::events::EventLog;

/// Something outside the agent that follows the config (`on_reload`).
pub type ReloadHook =
    Box<dyn Fn(&Config, &Config) -> Result<(), resident_config::ConfigError> + Send + Sync>;

/// The hooks `on_reload` registered, in order.
#[derive(Default)]
pub(super) struct ReloadHooks(Vec<ReloadHook>);

impl std::fmt::Debug for ReloadHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} reload hooks", self.0.len())
    }
}

/// The queries and the reload.
#[derive(Debug)]
pub(super) struct Queries {
    config: Current,
    books: Arc<Books>,
    kv: Arc<KvStore>,
    events: Arc<EventLog>,
    durability: Arc<Durability>,
    signals: Arc<Signals>,
    teller: Arc<Teller>,
    reader: Arc<Reader>,
    keys: Arc<Keys>,
    clock: Clock,
    /// What follows the config outside the agent (the TLS listeners'
    /// certificates), asked at each reload before anything changes.
    reload_hooks: Mutex<ReloadHooks>,
}

impl Queries {
    /// The room, on the parts (and the rooms) it uses.
    pub(super) fn new(p: &Parts, teller: Arc<Teller>, reader: Arc<Reader>) -> Self {
        Self {
            config: p.config.clone(),
            books: p.books.clone(),
            kv: p.kv.clone(),
            events: p.events.clone(),
            durability: p.durability.clone(),
            signals: p.signals.clone(),
            teller,
            reader,
            keys: p.keys.clone(),
            clock: p.clock,
            reload_hooks: Mutex::default(),
        }
    }

    /// The epoch of this agent's revisions (drawn when it began afresh;
    /// an upgrade hands it over with the history).
    pub(super) fn epoch(&self) -> u64 {
        self.events.epoch()
    }

    /// The whole node, as `Node` answers: `revision` and `instances` as
    /// read together by the caller (the revision first), the pools read
    /// now.
    pub(super) fn node_status(
        &self,
        revision: u64,
        instances: Vec<pb::Instance>,
    ) -> pb::NodeStatus {
        picture::node_status(
            &self.config.get(),
            revision,
            instances,
            self.pools(),
            self.epoch(),
        )
    }

    /// The pools' figures and every hold in force, now.
    pub(super) fn figures(&self) -> Figures {
        let now = self.clock.now_ms();
        Figures::new(self.pools(), self.books.holds(now), now)
    }

    /// Changes each time the figures may have moved without an event.
    pub(super) fn figures_moved(&self) -> tokio::sync::watch::Receiver<u64> {
        self.signals.figures_moved()
    }

    /// Counts changes of the roster (`Workloads`' answer).
    pub(super) fn roster_generation(&self) -> u64 {
        self.signals.roster_generation()
    }

    /// The pools as they are; a disk pool's figures are its own books':
    /// what its saved conversations hold (`keep_kv`), its budget tightened
    /// by its filesystem's free space.
    pub(super) fn pools(&self) -> Vec<pb::PoolStatus> {
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
    pub(super) async fn place(
        self: &Arc<Self>,
        workload: &str,
        policy: Option<Policy>,
        id: Option<&InstanceId>,
    ) -> Result<pb::Placement, ApiError> {
        let config = self.config.get();
        let w = workload_of(&config, workload)?;
        let policy = policy.unwrap_or(config.node.on_full);
        self.reader.refresh_async(&config).await;
        let key = self.keys.recent(&config, &w);
        self.books.place(&w, id, policy, self.clock.now_ms(), key)
    }

    /// The roster: every workload with its declared demand, raised by
    /// what was learned for the command and files it resolves to now.
    pub(super) fn workloads(&self) -> Vec<pb::Workload> {
        let config = self.config.get();
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
    pub(super) async fn forget_footprint(&self, workload: &str) -> Result<pb::Workload, ApiError> {
        let config = self.config.get();
        let w = workload_of(&config, workload)?;
        let name = w.spec.workload.to_string();
        if self.books.forget_learned(&name) {
            tracing::info!(workload = %name, "learned footprint forgotten");
            self.signals.roster_changed();
            self.durability.commit(true).await?;
        }
        Ok(self.roster_entry(&config, &name, &w))
    }

    /// Marks a use of `id` and protects it from eviction, or ends that
    /// protection, as `hold` says.
    pub(super) fn touch(&self, id: &str, hold: Hold) -> Result<pb::Instance, ApiError> {
        if !self.books.touch(id, self.clock.now_ms(), hold) {
            self.teller.get(id)?;
            return Err(ApiError::FailedPrecondition(format!(
                "instance '{id}' is not resident"
            )));
        }
        if !matches!(hold, Hold::For(0)) {
            self.signals.figures_may_have_moved();
        }
        self.teller.get(id)
    }

    /// Re-reads the configuration file: workloads, groups and pools change;
    /// running instances are not touched. An invalid file changes nothing.
    pub(super) fn reload(&self) -> Result<Vec<String>, resident_config::ConfigError> {
        let old = self.config.get();
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
        self.config.set(new.clone());
        self.books.reconfigure(&new);
        self.kv.configure(&new);
        self.reader.open_device_probes();
        self.reader.refresh();
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

impl Queries {
    /// Has `hook` take each reloaded config (old, new) before the agent
    /// does.
    pub(super) fn on_reload(&self, hook: ReloadHook) {
        self.reload_hooks.lock().0.push(hook);
    }
}
