//! What the console's page is sent, as JSON: the node (pools with what
//! each instance holds in them, the instances, the router's traffic) and
//! each of the agent's Watch events. Plain data only; the page puts every
//! string into the document as text.

use resident_api::pb;
use serde_json::{Value, json};

use crate::metrics::Traffic;

/// The name of a State number, as the API spells it.
pub(crate) fn state_name(state: i32) -> &'static str {
    pb::State::try_from(state).map_or("STATE_UNSPECIFIED", |s| s.as_str_name())
}

/// Whether an instance in `state` holds memory in the books: every state
/// but the ended ones.
fn holds_memory(state: i32) -> bool {
    !matches!(
        pb::State::try_from(state),
        Ok(pb::State::Exited | pb::State::Failed) | Err(_)
    )
}

/// One instance, as a row of the page.
pub fn instance(i: &pb::Instance) -> Value {
    json!({
        "id": i.instance_id,
        "workload": i.workload,
        "state": state_name(i.state),
        "pid": i.pid,
        "port": i.port,
        "reserved": i.reserved_bytes,
        "measured": i.measured_bytes,
        "overrun": i.overrun_bytes,
        "restarts": i.restarts,
        "message": i.message,
        "started_ms": i.started_unix_ms,
        "lease_left_ms": i.lease_left_ms,
        "hold_left_ms": i.hold_left_ms,
    })
}

/// One pool with its figures and, for each instance that holds memory
/// in it, the bytes its reservation there comes to (and its state, so a
/// sleeper's residue is told apart); `unavailable`: the part of the
/// budget a live reading says is not there to be had (budget less
/// effective budget): memory that processes outside the books hold, or
/// that the machine does not have at all (a budget larger than its
/// memory).
fn pool(p: &pb::PoolStatus, instances: &[pb::Instance]) -> Value {
    let held: Vec<Value> = instances
        .iter()
        .filter(|i| holds_memory(i.state))
        .filter_map(|i| {
            let bytes: u64 = i
                .demand
                .iter()
                .filter(|d| d.pool == p.name)
                .map(|d| d.reserved_bytes + d.overrun_bytes)
                .sum();
            (bytes > 0)
                .then(|| json!({"id": i.instance_id, "bytes": bytes, "state": state_name(i.state)}))
        })
        .collect();
    json!({
        "name": p.name,
        "budget": p.budget_bytes,
        "effective": p.effective_budget_bytes,
        "used": p.used_bytes,
        "free": p.free_bytes,
        "available": p.available_bytes,
        "unavailable": p.budget_bytes.zip(p.effective_budget_bytes).map(|(b, e)| b.saturating_sub(e)),
        "held": held,
    })
}

/// The whole node as the page draws it, with the router's traffic:
/// requests in flight and starts waiting on holds per model, the last
/// requests answered.
pub fn node(n: &pb::NodeStatus, traffic: &Traffic) -> Value {
    let mut instances: Vec<&pb::Instance> = n.instances.iter().collect();
    instances.sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
    json!({
        "node": n.node,
        "version": n.version,
        "pools": n.pools.iter().map(|p| pool(p, &n.instances)).collect::<Vec<_>>(),
        "instances": instances.into_iter().map(instance).collect::<Vec<_>>(),
        "traffic": {
            "in_flight": traffic.in_flight,
            "waiting": traffic.waiting,
            "recent": traffic.recent,
        },
    })
}

/// A refusal: the agent's words, whether waiting may help, and the
/// instances holding the memory it needs with their bytes.
pub(crate) fn refusal(r: &pb::Refusal) -> Value {
    let (reason, holders) = match &r.reason {
        Some(pb::refusal::Reason::OverBudget(o)) => ("OVER_BUDGET", o.holders.as_slice()),
        Some(pb::refusal::Reason::HostMemory(h)) => ("HOST_MEMORY", h.holders.as_slice()),
        Some(pb::refusal::Reason::Excluded(_)) => ("EXCLUDED", &[][..]),
        Some(pb::refusal::Reason::GroupConflict(_)) => ("GROUP_CONFLICT", &[][..]),
        None => ("", &[][..]),
    };
    json!({
        "message": r.message,
        "reason": reason,
        "temporary": r.temporary,
        "holders": holders
            .iter()
            .map(|h| json!({"id": h.instance_id, "bytes": h.bytes}))
            .collect::<Vec<_>>(),
    })
}

/// One Watch event.
pub fn event(e: &pb::Event) -> Value {
    let kind =
        pb::EventKind::try_from(e.kind).map_or("EVENT_KIND_UNSPECIFIED", |k| k.as_str_name());
    let i = e.instance.as_ref();
    json!({
        "revision": e.revision,
        "kind": kind,
        "instance": i.map(|i| i.instance_id.as_str()).unwrap_or_default(),
        "state": i.map(|i| state_name(i.state)).unwrap_or_default(),
        "workload": if e.workload.is_empty() { i.map(|i| i.workload.as_str()).unwrap_or_default() } else { e.workload.as_str() },
        "message": if e.message.is_empty() { i.map(|i| i.message.as_str()).unwrap_or_default() } else { e.message.as_str() },
        "pool": e.pool,
        "refusal": e.refusal.as_ref().map(refusal),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(id: &str, pool: &str, bytes: u64, state: pb::State) -> pb::Instance {
        pb::Instance {
            instance_id: id.into(),
            state: state as i32,
            demand: vec![pb::PoolDemand {
                pool: pool.into(),
                reserved_bytes: bytes,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_pool_shows_what_each_live_instance_holds_in_it() {
        let n = pb::NodeStatus {
            pools: vec![pb::PoolStatus {
                name: "gpu0".into(),
                budget_bytes: Some(10),
                used_bytes: 7,
                free_bytes: Some(3),
                ..Default::default()
            }],
            instances: vec![
                held("b", "gpu0", 4, pb::State::Ready),
                held("a", "gpu0", 3, pb::State::Starting),
                held("gone", "gpu0", 5, pb::State::Exited),
                held("elsewhere", "ram", 9, pb::State::Ready),
            ],
            ..Default::default()
        };
        let v = node(&n, &Traffic::default());
        let pool = &v["pools"][0];
        assert_eq!(
            pool["held"],
            json!([{"id": "b", "bytes": 4, "state": "READY"}, {"id": "a", "bytes": 3, "state": "STARTING"}])
        );
        assert_eq!(
            (pool["free"].clone(), pool["effective"].clone()),
            (json!(3), Value::Null)
        );
        let ids: Vec<&str> = v["instances"]
            .as_array()
            .expect("instances")
            .iter()
            .filter_map(|i| i["id"].as_str())
            .collect();
        assert_eq!(ids, ["a", "b", "elsewhere", "gone"]);
    }

    #[test]
    fn a_refusal_keeps_the_agents_words_and_holders() {
        let e = pb::Event {
            revision: 9,
            kind: pb::EventKind::Refused as i32,
            workload: "big".into(),
            refusal: Some(pb::Refusal {
                message: "unplaceable: 'big' needs 8.0 GB".into(),
                temporary: true,
                reason: Some(pb::refusal::Reason::OverBudget(pb::OverBudget {
                    holders: vec![pb::Holder {
                        instance_id: "small".into(),
                        bytes: 6,
                        ..Default::default()
                    }],
                    ..Default::default()
                })),
            }),
            ..Default::default()
        };
        let v = event(&e);
        assert_eq!(
            (v["kind"].as_str(), v["workload"].as_str()),
            (Some("REFUSED"), Some("big"))
        );
        let r = &v["refusal"];
        assert_eq!(r["message"], "unplaceable: 'big' needs 8.0 GB");
        assert_eq!(r["holders"], json!([{"id": "small", "bytes": 6}]));
        assert_eq!(
            (r["reason"].as_str(), r["temporary"].as_bool()),
            (Some("OVER_BUDGET"), Some(true))
        );
    }
}
