//! Core and supervisor types into their resident.v1 messages.

use resident_core::{Holder, Plan, PoolStatus, Reason, Spec};
use resident_supervisor::{Exit, State, Status};

use crate::pb;

fn holders(hs: &[Holder]) -> Vec<pb::Holder> {
    hs.iter()
        .map(|h| pb::Holder {
            instance_id: h.instance_id.to_string(),
            role: h.role.to_string(),
            bytes: h.bytes,
        })
        .collect()
}

/// One refusal reason, with its operator text (`temporary` is the whole
/// refusal's, set where the refusal is known). The one mapping of a
/// reason's fields to names: the error details' metadata is read back
/// from the message made here (`error.rs`).
pub fn refusal(reason: &Reason) -> pb::Refusal {
    use pb::refusal::Reason as R;
    let detail = match reason {
        Reason::OverBudget {
            role,
            pool,
            need,
            free,
            budget,
            holders: hs,
        } => R::OverBudget(pb::OverBudget {
            role: role.to_string(),
            pool: pool.to_string(),
            need_bytes: *need,
            free_bytes: *free,
            budget_bytes: *budget,
            holders: holders(hs),
        }),
        Reason::Excluded {
            role,
            with,
            with_instance,
            declared_by,
        } => R::Excluded(pb::Excluded {
            role: role.to_string(),
            with: with.to_string(),
            declared_by: declared_by.to_string(),
            with_instance_id: with_instance.to_string(),
        }),
        Reason::GroupConflict {
            role,
            with,
            with_instance,
            group,
            rule,
        } => R::GroupConflict(pb::GroupConflict {
            role: role.to_string(),
            with: with.to_string(),
            group: group.to_string(),
            rule: rule.as_str().into(),
            with_instance_id: with_instance.to_string(),
        }),
        Reason::HostMemory {
            role,
            pool,
            need,
            available,
            reserve,
            pending,
            holders: hs,
        } => R::HostMemory(pb::HostMemory {
            pool: pool.to_string(),
            need_bytes: *need,
            available_bytes: *available,
            reserve_bytes: *reserve,
            pending_bytes: *pending,
            role: role.to_string(),
            holders: holders(hs),
        }),
    };
    pb::Refusal {
        message: reason.to_string(),
        reason: Some(detail),
        temporary: false,
    }
}

/// A pool's figures.
pub fn pool_status(p: &PoolStatus, available: Option<u64>) -> pb::PoolStatus {
    pb::PoolStatus {
        name: p.name.to_string(),
        budget_bytes: p.budget,
        effective_budget_bytes: p.effective,
        used_bytes: p.used,
        free_bytes: p.free,
        available_bytes: available,
    }
}

/// A plan as a `Placement`, with the pools as they are.
pub fn placement(plan: &Plan, pools: Vec<pb::PoolStatus>) -> pb::Placement {
    let ids = |v: &[resident_core::InstanceId]| v.iter().map(ToString::to_string).collect();
    match plan {
        Plan::Existing => pb::Placement {
            admitted: true,
            pools,
            ..Default::default()
        },
        Plan::Admit {
            sleep,
            evict,
            wait_for,
            ..
        } => pb::Placement {
            admitted: true,
            sleep: ids(sleep),
            evict: ids(evict),
            wait_for: ids(wait_for),
            pools,
            ..Default::default()
        },
        Plan::Refuse(r) => pb::Placement {
            admitted: false,
            refusals: r
                .reasons()
                .iter()
                .map(|reason| pb::Refusal {
                    temporary: r.temporary(),
                    ..refusal(reason)
                })
                .collect(),
            pools,
            ..Default::default()
        },
    }
}

fn state(s: State) -> pb::State {
    match s {
        State::Pending => pb::State::Pending,
        State::Starting => pb::State::Starting,
        State::Ready => pb::State::Ready,
        State::Backoff => pb::State::Backoff,
        State::Stopping => pb::State::Stopping,
        State::Exited => pb::State::Exited,
        State::Failed => pb::State::Failed,
    }
}

/// What `spec` declares, pool by pool.
pub fn demand(spec: &Spec) -> Vec<pb::PoolDemand> {
    spec.demand
        .iter()
        .map(|(pool, d)| pb::PoolDemand {
            pool: pool.to_string(),
            weights_bytes: d.weights,
            kv_budget_bytes: d.kv,
            overhead_bytes: d.overhead,
            reserved_bytes: d.footprint(),
            learned_bytes: d.floor,
            overrun_bytes: 0,
        })
        .collect()
}

/// The any-of demands of `spec`, as the roster shows them.
pub fn any_of(spec: &Spec) -> Vec<pb::AnyOfDemand> {
    spec.any_of
        .iter()
        .map(|a| pb::AnyOfDemand {
            label: a.label.clone(),
            candidates: a.candidates.iter().map(ToString::to_string).collect(),
            count: u32::try_from(a.count).unwrap_or(u32::MAX),
            weights_bytes: a.demand.weights,
            kv_budget_bytes: a.demand.kv,
            overhead_bytes: a.demand.overhead,
            learned_bytes: a.demand.floor,
            reserved_bytes: a.demand.footprint(),
        })
        .collect()
}

/// A run of `id` that a Stop ended before its process was spawned:
/// EXITED, saying so.
pub fn unspawned(id: &str, spec: &Spec) -> pb::Instance {
    pb::Instance {
        state: pb::State::Exited as i32,
        message: "stopped before it was spawned".into(),
        ..instance(id, spec, None)
    }
}

/// An instance: its declared demand from `spec`, and what the supervisor
/// reports (`None`: admitted, not handed to the supervisor yet: PENDING).
pub fn instance(id: &str, spec: &Spec, status: Option<&Status>) -> pb::Instance {
    let demand = demand(spec);
    let mut out = pb::Instance {
        instance_id: id.to_string(),
        workload: spec.workload.to_string(),
        role: spec.role.to_string(),
        state: pb::State::Pending as i32,
        demand,
        priority: spec.priority,
        message: "admitted; waiting for its turn to be spawned".into(),
        ..Default::default()
    };
    if let Some(s) = status {
        out.state = state(s.state) as i32;
        out.pid = s.pid.unwrap_or(0);
        out.port = u32::from(s.port);
        out.restarts = s.restarts;
        out.measured_bytes = s.measured_bytes;
        out.message = s.reason.clone();
        out.oom_killed = s.oom_killed;
        out.started_unix_ms = unix_ms(s.started_at);
        out.measured_unix_ms = unix_ms(s.measured_at);
        if let Some(exit) = s.exit {
            out.exit_code = exit.code();
            out.exit_signal = match exit {
                Exit::Signal(sig) => sig,
                Exit::Code(_) | Exit::Unknown => 0,
            };
        }
    }
    out
}

/// Milliseconds since the Unix epoch, 0 for none (or before the epoch).
fn unix_ms(at: Option<std::time::SystemTime>) -> u64 {
    at.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
