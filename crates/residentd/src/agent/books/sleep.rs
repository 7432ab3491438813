//! Sleep in the books. A sleep is planned like a start (`Entry::Sleep`,
//! under refuse: what its asleep demand adds must fit beside what it holds
//! awake, a vLLM level-1 server's weights moving into host memory), then
//! the run holds the larger of its demands in each pool while its call
//! runs (`Tier::Moving`), then settles asleep; a wake is admitted like a
//! start (`admit.rs`) and holds the larger again until its call is done.
//! What lowers a charge (a call done, a server that fell asleep by
//! itself) is settled with the ledger's `settle`, which never raises one.
//! Nothing here makes the calls.

use resident_api::ApiError;
use resident_core::{AdmitError, Entry, Policy, Tier};

use super::*;

impl Books {
    /// Plans `id` (its run `run`, when given) falling asleep, under
    /// refuse, and marks it so: it must be resident, awake, not stopping,
    /// its workload able to sleep, and its asleep demand must fit beside
    /// what it holds (refused, with the same Placement and reasons as a
    /// refused start, changing nothing). Refused once the agent is closing.
    pub(in crate::agent) fn begin_sleep(
        &self,
        id: &str,
        run: Option<u64>,
        now: u64,
    ) -> Result<Sleeper, ApiError> {
        let mut b = self.lock();
        if b.closed {
            return Err(ApiError::Unavailable(
                "the agent is closing: nothing is put to sleep".into(),
            ));
        }
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
        let spec = r.spec.clone();
        let Some(record) = b
            .records
            .get(id)
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
        let iid =
            InstanceId::new(id).map_err(|e| ApiError::invalid("instance_id", e.to_string()))?;
        match b.ledger.admit(&iid, Entry::Sleep, Policy::Refuse, now) {
            Ok(_) => {}
            Err(AdmitError::Refused(refusal)) => {
                return Err(super::admit::refused(&b.ledger, refusal, &spec));
            }
            Err(AdmitError::Invalid(e)) => return Err(plan_error(e)),
        }
        let Some(record) = b.records.get_mut(id) else {
            return Err(ApiError::NotFound(format!("no instance '{id}'")));
        };
        record.sleep = Some(Sleepy::Falling);
        Ok(Sleeper {
            id: id.to_string(),
            generation: record.generation,
            workload: record.workload.spec.workload.to_string(),
        })
    }

    /// Settles run `generation` of `id`, moving, asleep (`Asleep`, at its
    /// instant) or awake (`Woken(ms)`) after its call; tells whoever waits
    /// on it. False when that run holds nothing any more, or is not moving.
    pub(in crate::agent) fn settle(&self, id: &str, generation: u64, to: Sleepy) -> bool {
        let mut b = self.lock();
        let current = b
            .records
            .get(id)
            .is_some_and(|r| r.generation == generation);
        let moving = b
            .ledger
            .resident(id)
            .is_some_and(|r| !r.leaving() && r.tier == Tier::Moving);
        if !current || !moving {
            return false;
        }
        settled(&mut b, id, to)
    }

    /// Run `generation` of `id`, awake, fell asleep by itself (llama-server
    /// after its idle time): settled asleep where that lowers what it is
    /// charged (the usual case: its model freed), planned as a sleep
    /// otherwise. `Ok(false)`: nothing to do (not that run, not awake);
    /// a refusal when its asleep demand does not fit.
    pub(in crate::agent) fn fell_asleep(
        &self,
        id: &str,
        generation: u64,
        now: u64,
    ) -> Result<bool, ApiError> {
        {
            let mut b = self.lock();
            let current = b
                .records
                .get(id)
                .is_some_and(|r| r.generation == generation && !r.cancelled);
            let awake = b
                .ledger
                .resident(id)
                .is_some_and(|r| !r.leaving() && r.tier == Tier::Awake);
            if !current || !awake {
                return Ok(false);
            }
            if b.ledger.settle(id, Tier::Asleep) {
                return Ok(settled(&mut b, id, Sleepy::Asleep(now)));
            }
        }
        // Its asleep demand is larger somewhere: planned like any sleep.
        self.begin_sleep(id, Some(generation), now)?;
        Ok(self.settle(id, generation, Sleepy::Asleep(now)))
    }

    /// Run `generation` of `id`, asleep, woke by itself (a request reached
    /// its server directly, not through a Start): its wake planned under
    /// refuse and settled awake. `Ok(false)`: nothing to do; a refusal
    /// when its awake demand does not fit beside the others (the caller
    /// stops it: the memory it takes is not there).
    pub(in crate::agent) fn woke_by_itself(
        &self,
        id: &InstanceId,
        generation: u64,
        now: u64,
    ) -> Result<bool, ApiError> {
        let mut b = self.lock();
        let current = b
            .records
            .get(id.as_str())
            .is_some_and(|r| r.generation == generation && !r.cancelled);
        let Some(spec) = b
            .ledger
            .resident(id.as_str())
            .filter(|r| current && !r.leaving() && r.tier == Tier::Asleep)
            .map(|r| r.spec.clone())
        else {
            return Ok(false);
        };
        match b.ledger.admit(id, Entry::Wake, Policy::Refuse, now) {
            Ok(_) => {}
            Err(AdmitError::Refused(refusal)) => {
                return Err(super::admit::refused(&b.ledger, refusal, &spec));
            }
            Err(AdmitError::Invalid(e)) => return Err(plan_error(e)),
        }
        b.ledger.settle(id.as_str(), Tier::Awake);
        Ok(settled(&mut b, id.as_str(), Sleepy::Woken(0)))
    }

    /// Whether `id` is resident, not held, and unused for `ms` at `now`.
    pub(in crate::agent) fn quiet(&self, id: &str, now: u64, ms: u64) -> bool {
        let b = self.lock();
        b.ledger
            .resident(id)
            .is_some_and(|r| !r.held(now) && now.saturating_sub(r.last_used) >= ms)
    }

    /// Awake runs of workloads with a sleep `idle`, unused that long and
    /// not held: each id with its run. None once the agent is closing.
    pub(in crate::agent) fn sleepy(&self, now: u64) -> Vec<(String, u64)> {
        let b = self.lock();
        if b.closed {
            return Vec::new();
        }
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

/// Settles `id` (already current and resident) at `to` in the ledger and
/// its record, and tells whoever waits on it. False when the ledger would
/// have to raise a charge for it (that is planned, never settled).
fn settled(b: &mut Inner, id: &str, to: Sleepy) -> bool {
    let tier = match to {
        Sleepy::Asleep(_) => Tier::Asleep,
        Sleepy::Woken(_) => Tier::Awake,
        Sleepy::Falling | Sleepy::Waking => Tier::Moving,
    };
    let already = b.ledger.resident(id).is_some_and(|r| r.tier == tier);
    if !already && !b.ledger.settle(id, tier) {
        return false;
    }
    if let Some(r) = b.records.get_mut(id) {
        r.sleep = Some(to);
    }
    for waiter in b.waiters.remove(id).unwrap_or_default() {
        let _ = waiter.send(());
    }
    true
}
