//! When an instance of a workload counts as ready (`[workload.readiness]`)
//! and how it is restarted (`[workload.restart]`).

use std::time::Duration;

use resident_supervisor::{Readiness, RestartMode, RestartPolicy};

use super::{Result, duration};
use crate::error::Source;
use crate::raw;

pub(super) fn readiness(
    src: &Source<'_>,
    w: &raw::Workload,
    key: &dyn Fn(&str) -> String,
) -> Result<(Readiness, Duration)> {
    let default_timeout = Duration::from_secs(120);
    let Some(r) = &w.readiness else {
        return Ok((Readiness::None, default_timeout));
    };
    let raw = r.get_ref();
    let chosen = [
        raw.http.is_some(),
        raw.tcp == Some(true),
        raw.none == Some(true),
    ];
    if chosen.iter().filter(|c| **c).count() != 1 {
        return Err(src.err(
            r.span(),
            key("readiness"),
            "set exactly one of http = \"/path\", tcp = true or none = true",
        ));
    }
    let readiness = match &raw.http {
        Some(path) if !path.starts_with('/') => {
            return Err(src.err(
                r.span(),
                key("readiness.http"),
                format!("{path:?} must start with '/'"),
            ));
        }
        Some(path) => Readiness::Http { path: path.clone() },
        None if raw.tcp == Some(true) => Readiness::Tcp,
        None => Readiness::None,
    };
    let timeout = match &raw.timeout {
        Some(t) => duration(src, t, &key("readiness.timeout"))?,
        None => default_timeout,
    };
    Ok((readiness, timeout))
}

pub(super) fn restart(
    src: &Source<'_>,
    w: &raw::Workload,
    key: &dyn Fn(&str) -> String,
) -> Result<RestartPolicy> {
    let mut policy = RestartPolicy::default();
    let Some(r) = &w.restart else {
        return Ok(policy);
    };
    let raw = r.get_ref();
    if let Some(p) = &raw.policy {
        policy.mode = match p.get_ref().as_str() {
            "never" => RestartMode::Never,
            "on-failure" => RestartMode::OnFailure,
            "always" => RestartMode::Always,
            other => {
                let msg = format!(
                    "{other:?} is not a restart policy (use \"never\", \"on-failure\" or \"always\")"
                );
                return Err(src.err(p.span(), key("restart.policy"), msg));
            }
        };
    }
    if let Some(m) = raw.max_restarts {
        policy.max_restarts = m;
    }
    if let Some(b) = &raw.backoff {
        policy.backoff = duration(src, b, &key("restart.backoff"))?;
    }
    if let Some(b) = &raw.backoff_max {
        policy.backoff_max = duration(src, b, &key("restart.backoff_max"))?;
    }
    if let Some(s) = &raw.stable_after {
        policy.stable_after = duration(src, s, &key("restart.stable_after"))?;
    }
    if policy.backoff_max < policy.backoff {
        return Err(src.err(
            r.span(),
            key("restart.backoff_max"),
            "must not be shorter than backoff",
        ));
    }
    Ok(policy)
}
