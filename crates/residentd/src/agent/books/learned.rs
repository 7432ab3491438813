//! Learned footprints (`learn_footprints`): a workload's high-water
//! measured bytes per pool, for the command and files it resolved to
//! (`Workload::footprint_key`), raise the reservation of its next
//! admission (`Demand::floor`). Learned from every reading of its runs;
//! kept in the journal; a run under another key starts afresh; an
//! operator forgets them (`ForgetFootprint`).
//!
//! A figure is raised when a reading exceeds it by more than
//! max(1 MiB, 1%): what is kept is within that of the true high-water
//! (readings are a second apart anyway), and a server whose memory
//! creeps does not make the journal write every second.

use std::collections::BTreeMap;
use std::sync::Arc;

use resident_config::Workload;
use resident_core::{PoolName, Spec};

use super::*;
use crate::journal;

/// One workload's learned footprint in the books.
#[derive(Debug, Clone)]
pub(super) struct Learning {
    pub(super) held: journal::Learned,
    /// The newest run it was learned from (0: read from the journal): a
    /// run under another key replaces it only when newer, so an old run
    /// still up after a reload does not undo what the new one taught.
    pub(super) generation: u64,
}

/// By how much a reading must exceed a learned figure to raise it.
fn step(held: u64) -> u64 {
    (1 << 20).max(held / 100)
}

/// Where `pool` of a run of `spec` is learned: the pool itself for a
/// fixed demand, the label of the any-of demand it was chosen for.
fn place_of(spec: &Spec, pool: &PoolName) -> String {
    if spec.demand.contains_key(pool) {
        return pool.to_string();
    }
    spec.any_of
        .iter()
        .find(|a| a.candidates.contains(pool))
        .map_or_else(|| pool.to_string(), |a| a.label.clone())
}

impl Inner {
    /// The spec `w` is admitted with: its declared spec, each demand
    /// raised to what was learned for `key` (`None`: not learning).
    pub(super) fn learned_spec(&self, w: &Workload, key: Option<u64>) -> Arc<Spec> {
        let learned = key.and_then(|key| {
            let l = self.learned.get(w.spec.workload.as_str())?;
            (l.held.key == key && !l.held.pools.is_empty()).then_some(&l.held.pools)
        });
        let Some(pools) = learned else {
            return w.spec.clone();
        };
        let mut spec = (*w.spec).clone();
        for (pool, d) in &mut spec.demand {
            d.floor = pools.get(pool.as_str()).copied().unwrap_or(0);
        }
        for a in &mut spec.any_of {
            a.demand.floor = pools.get(&a.label).copied().unwrap_or(0);
        }
        Arc::new(spec)
    }

    /// Raises the learned figures to the runs' last readings; says
    /// whether any rose (the journal is then written).
    pub(super) fn learn(&mut self) -> bool {
        let Inner {
            ledger,
            records,
            learned,
            ..
        } = self;
        let mut rose = false;
        for (id, rec) in records.iter() {
            let Some(key) = rec.footprint_key else {
                continue;
            };
            let Some(r) = ledger.resident(id) else {
                continue;
            };
            if r.measured.values().all(|b| *b == 0) {
                continue;
            }
            let workload = rec.workload.spec.workload.to_string();
            let l = learned.entry(workload.clone()).or_insert_with(|| Learning {
                held: journal::Learned {
                    workload,
                    key,
                    pools: BTreeMap::new(),
                },
                generation: rec.generation,
            });
            if l.held.key != key {
                if l.generation >= rec.generation {
                    continue;
                }
                l.held.key = key;
                l.held.pools.clear();
                rose = true;
            }
            l.generation = l.generation.max(rec.generation);
            for (pool, bytes) in &r.measured {
                let held = l
                    .held
                    .pools
                    .entry(place_of(&rec.workload.spec, pool))
                    .or_insert(0);
                if *bytes > held.saturating_add(step(*held)) {
                    *held = *bytes;
                    rose = true;
                }
            }
        }
        rose
    }
}

impl Books {
    /// What the journal held at start.
    pub(in crate::agent) fn set_learned(&self, learned: Vec<journal::Learned>) {
        let mut b = self.lock();
        b.learned = learned
            .into_iter()
            .map(|held| {
                let l = Learning {
                    held,
                    generation: 0,
                };
                (l.held.workload.clone(), l)
            })
            .collect();
    }

    /// What the journal should hold.
    pub(in crate::agent) fn learned_rows(&self) -> Vec<journal::Learned> {
        let b = self.lock();
        b.learned
            .values()
            .filter(|l| !l.held.pools.is_empty())
            .map(|l| l.held.clone())
            .collect()
    }

    /// Forgets what was learned for `workload`; says whether anything was.
    pub(in crate::agent) fn forget_learned(&self, workload: &str) -> bool {
        let mut b = self.lock();
        // Runs still up teach again from their next readings; their
        // reservations stay as admitted.
        b.learned.remove(workload).is_some()
    }

    /// The spec `w` would be admitted with now (the roster's figures).
    pub(in crate::agent) fn learned_spec(&self, w: &Workload, key: Option<u64>) -> Arc<Spec> {
        self.lock().learned_spec(w, key)
    }
}
