//! Everything the books are asked or told besides admission: records,
//! pools, uses and leases, probe readings and overruns, idle expiry, and
//! the journal's rows.

use std::collections::BTreeMap;

use resident_api::pb;
use resident_config::Config;
use resident_core::{Charge, PoolName};
use resident_supervisor::Adoption;

use crate::journal::Slumber;

use super::*;

impl Books {
    /// Notes what was found about `id`'s run `generation` (shown in its
    /// message); false when that run is no longer current or already has
    /// this note.
    pub(in crate::agent) fn note(&self, id: &str, generation: u64, note: String) -> bool {
        let mut b = self.lock();
        match b.records.get_mut(id) {
            Some(r) if r.generation == generation && r.note.as_ref() != Some(&note) => {
                r.note = Some(note);
                true
            }
            _ => false,
        }
    }

    /// Whether `generation` is still `id`'s run and no Stop asked for it.
    pub(in crate::agent) fn wanted(&self, id: &str, generation: u64) -> bool {
        let b = self.lock();
        b.records
            .get(id)
            .is_some_and(|r| r.generation == generation && !r.cancelled)
    }

    /// The record of `id`.
    pub(in crate::agent) fn record(&self, id: &str) -> Option<Record> {
        self.lock().records.get(id).cloned()
    }

    /// The records of workloads whose servers sleep by themselves (their
    /// `/props` followed), in id order: nothing is copied for the rest
    /// (this runs every second).
    pub(in crate::agent) fn followed(&self) -> Vec<(String, Record)> {
        let b = self.lock();
        b.records
            .iter()
            .filter(|(_, r)| {
                r.workload
                    .sleep
                    .as_ref()
                    .is_some_and(|s| s.follow.is_some())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Every record, in id order.
    pub(in crate::agent) fn records(&self) -> Vec<(String, Record)> {
        let b = self.lock();
        b.records
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The live instances the exposure guard watches (`expose =
    /// "loopback"`): id, workload, run, and whether it was adopted.
    /// Nothing is copied for the rest.
    pub(in crate::agent) fn loopback_only(&self) -> Vec<Guarded> {
        let b = self.lock();
        b.records
            .iter()
            .filter(|(_, r)| r.workload.expose == resident_config::Expose::Loopback && !r.cancelled)
            .map(|(id, r)| Guarded {
                id: id.clone(),
                workload: r.workload.spec.workload.to_string(),
                generation: r.generation,
                adopted: r.adopted.is_some(),
            })
            .collect()
    }

    /// What `id` is charged in each pool it asks of; empty when it holds
    /// no reservation.
    pub(in crate::agent) fn charges(&self, id: &str) -> Vec<(PoolName, Charge)> {
        let b = self.lock();
        let Some(r) = b.ledger.resident(id) else {
            return Vec::new();
        };
        r.spec
            .pools()
            .map(|p| (p.clone(), r.charge(p.as_str())))
            .collect()
    }

    /// Brings every record's overrun up to the ledger's last readings
    /// (`text` words one run's overrunning pools) and returns the runs
    /// whose overrun began, changed pools or ended. The words of a
    /// continuing overrun follow the readings without a change listed.
    pub(in crate::agent) fn sync_overruns(
        &self,
        node_default: resident_config::OnOverrun,
        text: impl Fn(&[(&PoolName, Charge)]) -> String,
    ) -> Vec<OverrunChange> {
        let mut b = self.lock();
        let Inner {
            ledger, records, ..
        } = &mut *b;
        let mut now: BTreeMap<String, Vec<(&PoolName, Charge)>> = BTreeMap::new();
        for (id, pool, charge) in ledger.overruns() {
            now.entry(id.to_string()).or_default().push((pool, charge));
        }
        let now: BTreeMap<String, Overrun> = now
            .into_iter()
            .map(|(id, pools)| {
                let overrun = Overrun {
                    pools: pools.iter().map(|(p, _)| (*p).clone()).collect(),
                    text: text(&pools),
                };
                (id, overrun)
            })
            .collect();
        let mut changes = Vec::new();
        for (id, r) in records.iter_mut() {
            let next = now.get(id).cloned();
            if ledger.resident(id).is_none() {
                // An ended run: its last words stay with its end.
                r.overrun = None;
                continue;
            }
            let changed = r.overrun.as_ref().map(|o| &o.pools) != next.as_ref().map(|o| &o.pools);
            r.overrun = next;
            if changed {
                changes.push(OverrunChange {
                    id: id.clone(),
                    generation: r.generation,
                    overrun: r.overrun.clone(),
                    stoppable: r.stoppable(),
                    on_overrun: r.workload.on_overrun.unwrap_or(node_default),
                });
            }
        }
        changes
    }

    /// The pools as they are.
    pub(in crate::agent) fn pools(&self) -> Vec<pb::PoolStatus> {
        let b = self.lock();
        pool_statuses(&b.ledger, &b.ledger.pools())
    }

    /// Records a use of `id` and renews its lease; false when it holds no
    /// reservation.
    pub(in crate::agent) fn touch(&self, id: &str, now: u64, hold: Hold) -> bool {
        let mut b = self.lock();
        let used = match hold {
            Hold::For(ms) => b.ledger.touch(id, now, ms),
            Hold::Release => b.ledger.release_hold(id, now),
        };
        if !used {
            return false;
        }
        if let Some(lease) = b.records.get_mut(id).and_then(|r| r.lease.as_mut()) {
            lease.until = now.saturating_add(lease.ms);
        }
        true
    }

    /// Keeps what run `generation` of `id`'s server reported allocating.
    pub(in crate::agent) fn set_report(
        &self,
        id: &str,
        generation: u64,
        report: resident_config::report::Report,
    ) {
        let mut b = self.lock();
        if let Some(r) = b.records.get_mut(id).filter(|r| r.generation == generation) {
            r.report = Some(report);
        }
    }

    /// What is left at `now` of the hold on resident `id` (0: none).
    pub(in crate::agent) fn hold_left(&self, id: &str, now: u64) -> u64 {
        let b = self.lock();
        b.ledger
            .resident(id)
            .map_or(0, |r| r.hold_until.saturating_sub(now))
    }

    /// Every hold still in force at `now`: the instance and how many
    /// milliseconds are left of it (an upgrade hands them over).
    pub(in crate::agent) fn holds(&self, now: u64) -> Vec<(String, u64)> {
        let b = self.lock();
        b.ledger
            .residents()
            .filter(|r| r.hold_until > now)
            .map(|r| (r.id.to_string(), r.hold_until - now))
            .collect()
    }

    /// Resident instances no Stop asked for whose lease ran out by `now`,
    /// with the lease's length; none once the agent is closing.
    pub(in crate::agent) fn leases_expired(&self, now: u64) -> Vec<(String, u64, u64)> {
        let b = self.lock();
        if b.closed {
            return Vec::new();
        }
        b.records
            .iter()
            .filter(|(id, r)| !r.cancelled && b.ledger.resident(id).is_some())
            .filter_map(|(id, r)| {
                let lease = r.lease?;
                (lease.until <= now).then(|| (id.clone(), r.generation, lease.ms))
            })
            .collect()
    }

    /// New pools and groups (a reload); residents keep their reservations.
    /// From here on, admissions decide on `config` only.
    pub(in crate::agent) fn reconfigure(&self, config: &Arc<Config>) {
        let mut b = self.lock();
        b.config = config.clone();
        b.ledger
            .reconfigure(config.pool_configs(), config.groups.clone());
        b.ledger.set_gpu_choice(config.node.gpu_choice);
    }

    /// Probe readings: bytes available per pool, and bytes measured per
    /// instance and pool. Host-measured bytes (`host`) count against the
    /// first host-bound pool (of `host_pools`) the instance declares.
    /// With `readings.learn`, learned footprints rise with them: says
    /// whether any rose (the journal is to be written).
    pub(in crate::agent) fn set_readings(&self, readings: Readings) -> bool {
        let mut b = self.lock();
        for (pool, available) in readings.available {
            b.ledger.set_available(&pool, available);
        }
        for (id, pool, bytes) in readings.measured {
            b.ledger.set_measured(&id, &pool, bytes);
        }
        for (id, bytes) in readings.host {
            let pool = b.ledger.resident(&id).and_then(|r| {
                r.spec
                    .demand
                    .keys()
                    .find(|k| readings.host_pools.contains(k))
                    .cloned()
            });
            if let Some(pool) = pool {
                b.ledger.set_measured(&id, &pool, bytes);
            }
        }
        readings.learn && b.learn()
    }

    /// Resident, not cancelled instances of workloads with an idle TTL
    /// that have gone unused (and unheld) for longer than it, with their
    /// current run; none once the agent is closing.
    pub(in crate::agent) fn idle(&self, now: u64) -> Vec<(String, u64)> {
        let b = self.lock();
        if b.closed {
            return Vec::new();
        }
        b.records
            .iter()
            .filter(|(_, rec)| rec.stoppable())
            .filter(|(id, rec)| {
                let Some(ttl) = rec.workload.idle_ttl else {
                    return false;
                };
                b.ledger.resident(id).is_some_and(|r| {
                    !r.leaving()
                        && !r.held(now)
                        && now.saturating_sub(r.last_used) >= ttl.as_millis() as u64
                })
            })
            .map(|(id, rec)| (id.clone(), rec.generation))
            .collect()
    }

    /// What the journal should hold: resident instances no Stop asked for,
    /// in admission order.
    pub(in crate::agent) fn journal_rows(&self) -> Vec<JournalRow> {
        let b = self.lock();
        // From the residents, not the records: the records also keep up to
        // `max_instances` ended runs, and the journal is written often.
        let mut rows: Vec<JournalRow> = b
            .ledger
            .residents()
            .filter_map(|res| {
                let id = res.id.as_str();
                b.records.get(id).map(|r| (id, r, res.tier))
            })
            .filter(|(_, r, _)| !r.cancelled)
            .map(|(id, r, tier)| JournalRow {
                sleep: match (tier, r.sleep) {
                    (resident_core::Tier::Asleep, _) => Slumber::Asleep,
                    (resident_core::Tier::Moving, Some(Sleepy::Waking)) => Slumber::Waking,
                    (resident_core::Tier::Moving, _) => Slumber::Falling,
                    (resident_core::Tier::Awake, _) => Slumber::Awake,
                },
                id: id.to_string(),
                workload: r.workload.spec.workload.to_string(),
                generation: r.generation,
                lease_ms: r.lease.map_or(0, |l| l.ms),
                adopted: r.adopted,
                chosen: r
                    .chosen
                    .iter()
                    .map(|pools| pools.iter().map(|p| p.to_string()).collect())
                    .collect(),
            })
            .collect();
        rows.sort_by_key(|r| r.generation);
        rows
    }

    /// The ids that hold a reservation.
    pub(in crate::agent) fn resident_ids(&self) -> Vec<String> {
        let b = self.lock();
        b.ledger.residents().map(|r| r.id.to_string()).collect()
    }
}

/// An instance the exposure guard checks.
#[derive(Debug)]
pub(in crate::agent) struct Guarded {
    pub(in crate::agent) id: String,
    pub(in crate::agent) workload: String,
    pub(in crate::agent) generation: u64,
    /// Adopted: reported, never stopped.
    pub(in crate::agent) adopted: bool,
}

/// One instance as the journal keeps it.
#[derive(Debug)]
pub(in crate::agent) struct JournalRow {
    pub(in crate::agent) id: String,
    pub(in crate::agent) workload: String,
    pub(in crate::agent) generation: u64,
    pub(in crate::agent) lease_ms: u64,
    pub(in crate::agent) adopted: Option<Adoption>,
    /// The pools chosen for each any-of demand, in label order.
    pub(in crate::agent) chosen: Vec<Vec<String>>,
    /// Where it stands in its sleep (`[workload.sleep]`).
    pub(in crate::agent) sleep: Slumber,
}

/// Probe readings for [`Books::set_readings`].
#[derive(Debug, Default)]
pub(in crate::agent) struct Readings {
    pub(in crate::agent) available: Vec<(String, Option<u64>)>,
    pub(in crate::agent) measured: Vec<(String, PoolName, u64)>,
    pub(in crate::agent) host: Vec<(String, u64)>,
    pub(in crate::agent) host_pools: Vec<PoolName>,
    /// Whether footprints are learned from them (`learn_footprints`).
    pub(in crate::agent) learn: bool,
}
