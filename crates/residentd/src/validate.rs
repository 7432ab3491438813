//! Validation of requests, before anything is looked up: every field a
//! client sends is checked here, and every violation of a request is
//! reported together (`google.rpc.BadRequest`). Kept apart from the
//! service so that the fuzz targets and property tests reach it.

use std::time::Duration;

use resident_api::{ApiError, pb};
use resident_core::{InstanceId, Policy};

/// Longest accepted workload name or instance id in a request.
pub const MAX_ID: usize = 128;
/// Most log lines one `Logs` call may ask for.
pub const MAX_TAIL: u32 = 100_000;
/// The longest owner's lease a Start may ask for: a week.
pub const MAX_LEASE_MS: u64 = 7 * 24 * 3600 * 1000;

/// A `Policy` enum value: unspecified means the node's default.
pub fn policy(field: &str, value: i32) -> Result<Option<Policy>, ApiError> {
    match pb::Policy::try_from(value) {
        Ok(pb::Policy::Unspecified) => Ok(None),
        Ok(pb::Policy::Refuse) => Ok(Some(Policy::Refuse)),
        Ok(pb::Policy::Evict) => Ok(Some(Policy::Evict)),
        Err(_) => Err(ApiError::invalid(field, format!("{value} is not a Policy"))),
    }
}

/// A workload name: non-empty and bounded (the roster decides the rest).
pub fn workload_name(field: &str, value: &str) -> Result<(), ApiError> {
    if value.is_empty() {
        return Err(ApiError::invalid(
            field,
            "must name a workload of the roster",
        ));
    }
    if value.len() > MAX_ID {
        return Err(ApiError::invalid(
            field,
            format!("longer than {MAX_ID} bytes"),
        ));
    }
    Ok(())
}

/// A required instance id, validated.
pub fn instance_id(field: &str, value: &str) -> Result<InstanceId, ApiError> {
    InstanceId::new(value).map_err(|e| ApiError::invalid(field, e.to_string()))
}

/// A Start: the instance id (generated when empty) and the policy.
pub fn start(r: &pb::StartRequest) -> Result<(Option<InstanceId>, Option<Policy>), ApiError> {
    let mut bad = Vec::new();
    let mut keep = |e: ApiError| match e {
        ApiError::InvalidArgument(v) => bad.extend(v),
        other => bad.push(("request".into(), other.to_string())),
    };
    if let Err(e) = workload_name("workload", &r.workload) {
        keep(e);
    }
    let id = if r.instance_id.is_empty() {
        None
    } else {
        instance_id("instance_id", &r.instance_id)
            .map_err(&mut keep)
            .ok()
    };
    let on_full = policy("on_full", r.on_full)
        .map_err(&mut keep)
        .ok()
        .flatten();
    if r.lease_ms > MAX_LEASE_MS {
        keep(ApiError::invalid(
            "lease_ms",
            format!("at most {MAX_LEASE_MS} (a week)"),
        ));
    }
    if bad.is_empty() {
        Ok((id, on_full))
    } else {
        Err(ApiError::InvalidArgument(bad))
    }
}

/// An Adopt: the instance id; the pid and port checked for range.
pub fn adopt(r: &pb::AdoptRequest) -> Result<InstanceId, ApiError> {
    let mut bad = Vec::new();
    let mut keep = |e: ApiError| match e {
        ApiError::InvalidArgument(v) => bad.extend(v),
        other => bad.push(("request".into(), other.to_string())),
    };
    if r.pid <= 1 || r.pid > i32::MAX as u32 {
        keep(ApiError::invalid(
            "pid",
            format!("{} is not the pid of a process to adopt", r.pid),
        ));
    }
    if let Err(e) = workload_name("workload", &r.workload) {
        keep(e);
    }
    let id = instance_id("instance_id", &r.instance_id)
        .map_err(&mut keep)
        .ok();
    if r.port > u32::from(u16::MAX) {
        keep(ApiError::invalid(
            "port",
            format!("{} is not a TCP port", r.port),
        ));
    }
    match id {
        Some(id) if bad.is_empty() => Ok(id),
        _ => Err(ApiError::InvalidArgument(bad)),
    }
}

/// A Stop: the instance and the grace asked for (its own when 0).
pub fn stop(r: &pb::StopRequest) -> Result<(InstanceId, Option<Duration>), ApiError> {
    let id = instance_id("instance_id", &r.instance_id)?;
    Ok((
        id,
        (r.grace_ms > 0).then(|| Duration::from_millis(r.grace_ms)),
    ))
}

/// A Place: the policy.
pub fn place(r: &pb::PlaceRequest) -> Result<(Option<Policy>, Option<InstanceId>), ApiError> {
    workload_name("workload", &r.workload)?;
    let on_full = policy("on_full", r.on_full)?;
    let id = match r.instance_id.as_str() {
        "" => None,
        id => Some(instance_id("instance_id", id)?),
    };
    Ok((on_full, id))
}

/// The default least time between two figures-only updates of a
/// `WatchNode`, and the bounds a request may set.
pub const FIGURES_EVERY: Duration = Duration::from_millis(250);
const FIGURES_EVERY_MS: std::ops::RangeInclusive<u32> = 50..=60_000;
const HEARTBEAT_MS: std::ops::RangeInclusive<u32> = 100..=3_600_000;

/// A WatchNode: the figures' least interval and the heartbeat (none
/// when 0).
pub fn watch_node(r: &pb::WatchNodeRequest) -> Result<(Duration, Option<Duration>), ApiError> {
    let mut bad = Vec::new();
    if r.figures_every_ms != 0 && !FIGURES_EVERY_MS.contains(&r.figures_every_ms) {
        bad.push((
            "figures_every_ms".to_string(),
            format!("{} is not 0 or 50 to 60000", r.figures_every_ms),
        ));
    }
    if r.heartbeat_ms != 0 && !HEARTBEAT_MS.contains(&r.heartbeat_ms) {
        bad.push((
            "heartbeat_ms".to_string(),
            format!("{} is not 0 or 100 to 3600000", r.heartbeat_ms),
        ));
    }
    if !bad.is_empty() {
        return Err(ApiError::InvalidArgument(bad));
    }
    let every = match r.figures_every_ms {
        0 => FIGURES_EVERY,
        ms => Duration::from_millis(u64::from(ms)),
    };
    let heartbeat = (r.heartbeat_ms > 0).then(|| Duration::from_millis(u64::from(r.heartbeat_ms)));
    Ok((every, heartbeat))
}

/// A Logs call: the instance.
pub fn logs(r: &pb::LogsRequest) -> Result<InstanceId, ApiError> {
    let id = instance_id("instance_id", &r.instance_id)?;
    if r.tail > MAX_TAIL {
        return Err(ApiError::invalid(
            "tail",
            format!("at most {MAX_TAIL} lines"),
        ));
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_watch_node_paces_within_its_bounds(every in any::<u32>(), heartbeat in any::<u32>()) {
            let r = pb::WatchNodeRequest {
                figures_every_ms: every,
                heartbeat_ms: heartbeat,
                ..Default::default()
            };
            match watch_node(&r) {
                Ok((e, h)) => {
                    let want = if every == 0 { FIGURES_EVERY } else { Duration::from_millis(u64::from(every)) };
                    prop_assert_eq!(e, want);
                    prop_assert!(FIGURES_EVERY_MS.contains(&(e.as_millis() as u32)));
                    prop_assert_eq!(h.is_none(), heartbeat == 0);
                    prop_assert!(h.is_none_or(|h| HEARTBEAT_MS.contains(&(h.as_millis() as u32))));
                }
                Err(ApiError::InvalidArgument(v)) => {
                    prop_assert!(!v.is_empty());
                    prop_assert!(
                        (every != 0 && !FIGURES_EVERY_MS.contains(&every))
                            || (heartbeat != 0 && !HEARTBEAT_MS.contains(&heartbeat))
                    );
                }
                Err(e) => prop_assert!(false, "not an invalid argument: {e}"),
            }
        }
    }
}
