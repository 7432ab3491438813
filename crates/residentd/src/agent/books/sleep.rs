//! Sleep in the books: a run put to sleep holds the larger of its demands
//! in each pool while its sleep call runs (`Tier::Moving`), then its
//! asleep demand; a wake is admitted like a start (`admit.rs`) and holds
//! the larger again until its call is done. Nothing here makes the calls.

use resident_api::ApiError;
use resident_core::Tier;

use super::*;

impl Books {
    /// Marks `id` (its run `run`, when given) falling asleep: it must be
    /// resident, awake, not stopping, and its workload able to sleep.
    pub(in crate::agent) fn begin_sleep(
        &self,
        id: &str,
        run: Option<u64>,
    ) -> Result<Sleeper, ApiError> {
        let mut b = self.lock();
        let Some(r) = b.ledger.resident(id) else {
            return Err(ApiError::NotFound(format!(
                "no instance '{id}' holds memory"
            )));
        };
        let why = if r.leaving() {
            Some("is stopping")
        } else if r.spec.asleep.is_none() {
            Some("cannot sleep: its workload has no [workload.sleep]")
        } else {
            match r.tier {
                Tier::Asleep => Some("is asleep already"),
                Tier::Moving => Some("is falling asleep or waking"),
                Tier::Awake => None,
            }
        };
        if let Some(why) = why {
            return Err(ApiError::FailedPrecondition(format!(
                "instance '{id}' {why}"
            )));
        }
        let Some(record) = b
            .records
            .get_mut(id)
            .filter(|r| run.is_none_or(|g| g == r.generation))
        else {
            return Err(ApiError::NotFound(format!(
                "that run of instance '{id}' has ended"
            )));
        };
        if record.adopted.is_some_and(|a| !a.manage) {
            // Its owner runs it: a failed call could not be answered by
            // stopping it.
            return Err(ApiError::FailedPrecondition(format!(
                "instance '{id}' is adopted without manage: the agent does not put it to sleep"
            )));
        }
        record.sleep = Some(Sleepy::Falling);
        let sleeper = Sleeper {
            id: id.to_string(),
            generation: record.generation,
            workload: record.workload.spec.workload.to_string(),
        };
        b.ledger.set_tier(id, Tier::Moving);
        Ok(sleeper)
    }

    /// Settles run `generation` of `id` asleep (`asleep`, at `now`) or
    /// awake (`Woken(ms)`) after its call; tells whoever waits on it.
    /// False when that run holds nothing any more.
    pub(in crate::agent) fn settle(&self, id: &str, generation: u64, to: Sleepy) -> bool {
        let mut b = self.lock();
        let current = b
            .records
            .get(id)
            .is_some_and(|r| r.generation == generation);
        if !current || b.ledger.resident(id).is_none_or(|r| r.leaving()) {
            return false;
        }
        let tier = match to {
            Sleepy::Asleep(_) => Tier::Asleep,
            Sleepy::Woken(_) => Tier::Awake,
            Sleepy::Falling | Sleepy::Waking => Tier::Moving,
        };
        b.ledger.set_tier(id, tier);
        if let Some(r) = b.records.get_mut(id) {
            r.sleep = Some(to);
        }
        for waiter in b.waiters.remove(id).unwrap_or_default() {
            let _ = waiter.send(());
        }
        true
    }

    /// The next admission of `id` (a restore taking over its process,
    /// which a previous agent put to sleep, or was putting to sleep or
    /// waking) enters it `as_it_was`: `Asleep` holding its asleep demand,
    /// `Falling` or `Waking` both its demands, its call to be made again
    /// (`Agent::finish_moves`).
    pub(in crate::agent) fn expect_restored(&self, id: &str, as_it_was: Sleepy) {
        self.lock().restore_asleep.insert(id.to_string(), as_it_was);
    }

    /// Undoes [`Books::expect_restored`] once the restore of `id` has been
    /// decided (admitted, refused or failed).
    pub(in crate::agent) fn expect_awake(&self, id: &str) {
        self.lock().restore_asleep.remove(id);
    }

    /// Whether `id` is resident, not held, and unused for `ms` at `now`.
    pub(in crate::agent) fn quiet(&self, id: &str, now: u64, ms: u64) -> bool {
        let b = self.lock();
        b.ledger
            .resident(id)
            .is_some_and(|r| !r.held(now) && now.saturating_sub(r.last_used) >= ms)
    }

    /// Awake runs of workloads with a sleep `idle`, unused that long and
    /// not held: each id with its run.
    pub(in crate::agent) fn sleepy(&self, now: u64) -> Vec<(String, u64)> {
        let b = self.lock();
        b.records
            .iter()
            .filter(|(_, rec)| rec.stoppable())
            .filter(|(id, rec)| {
                let Some(idle) = rec.workload.sleep.as_ref().and_then(|s| s.idle) else {
                    return false;
                };
                b.ledger.resident(id).is_some_and(|r| {
                    r.can_sleep()
                        && !r.leaving()
                        && !r.held(now)
                        && now.saturating_sub(r.last_used) >= idle.as_millis() as u64
                })
            })
            .map(|(id, rec)| (id.clone(), rec.generation))
            .collect()
    }
}
