//! The `[[pool]]` sections: names declared once, budget and reserve, and
//! what a live pool is bound to (host memory or one device).

use std::collections::BTreeSet;
use std::ops::Range;

use resident_core::{PoolConfig, PoolName};
use toml::Spanned;

use super::{Result, bytes, spanned_str};
use crate::error::Source;
use crate::{ConfigError, PoolDef, raw};

/// Every pool, and the errors of those that are wrong: a wrong pool whose
/// name reads stands in with no budget, so the workloads that name it
/// are checked too (the config is refused anyway).
pub(super) fn pools(
    src: &Source<'_>,
    raw: &[Spanned<raw::Pool>],
) -> (Vec<PoolDef>, Vec<ConfigError>) {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for p in raw {
        match pool(src, p, &mut seen) {
            Ok(def) => out.push(def),
            Err(e) => {
                errors.push(e);
                if let Ok(name) = PoolName::new(spanned_str(&p.get_ref().name))
                    && !out.iter().any(|d: &PoolDef| d.pool.name == name)
                {
                    out.push(PoolDef {
                        pool: PoolConfig {
                            name,
                            budget: None,
                            reserve: 0,
                            live: false,
                        },
                        host: false,
                        device: None,
                        index: None,
                        path: None,
                    });
                }
            }
        }
    }
    (out, errors)
}

/// One `[[pool]]`; `seen`: the names before it.
fn pool(
    src: &Source<'_>,
    p: &Spanned<raw::Pool>,
    seen: &mut BTreeSet<PoolName>,
) -> Result<PoolDef> {
    {
        let span = p.span();
        let p = p.get_ref();
        let name = PoolName::new(spanned_str(&p.name))
            .map_err(|e| src.err(p.name.span(), "pool.name", e.to_string()))?;
        let key = |k: &str| format!("pool[{name}].{k}");
        if !seen.insert(name.clone()) {
            return Err(src.err(p.name.span(), key("name"), "declared twice"));
        }
        let budget = p
            .budget
            .as_ref()
            .map(|b| bytes(src, b, &key("budget")))
            .transpose()?;
        let reserve = p
            .reserve
            .as_ref()
            .map(|r| bytes(src, r, &key("reserve")))
            .transpose()?
            .unwrap_or(0);
        if let Some(d) = &p.device {
            device(src, d, p.host, span.clone(), &key("device"))?;
        }
        let live = p.host || p.device.is_some();
        let nvml = p.device.as_ref().and_then(|d| {
            d.get_ref()
                .strip_prefix("nvml:")
                .and_then(|n| n.parse::<u32>().ok())
        });
        let index = match (&p.index, nvml) {
            (Some(i), Some(n)) if *i.get_ref() != n => {
                let msg = format!(
                    "{} differs from the device's index {n} (nvml:{n})",
                    i.get_ref()
                );
                return Err(src.err(i.span(), key("index"), msg));
            }
            (Some(i), _) if p.host => {
                let msg = "a pool of host memory has no device index";
                return Err(src.err(i.span(), key("index"), msg));
            }
            (Some(i), _) => Some(*i.get_ref()),
            (None, n) => n,
        };
        let path = match &p.path {
            None => None,
            Some(at) if p.host || p.device.is_some() || p.index.is_some() => {
                let msg = "a disk pool (path) holds saved conversations, not memory: it is bound to no host memory or device";
                return Err(src.err(at.span(), key("path"), msg));
            }
            Some(at) if !at.get_ref().starts_with('/') => {
                let msg = format!(
                    "{:?}: a disk pool's directory must be absolute",
                    at.get_ref()
                );
                return Err(src.err(at.span(), key("path"), msg));
            }
            Some(_) if budget.is_none() => {
                let msg = "a disk pool needs a budget: the bytes its directory may hold";
                return Err(src.err(span, key("budget"), msg));
            }
            Some(at) => Some(std::path::PathBuf::from(at.get_ref())),
        };
        Ok(PoolDef {
            pool: PoolConfig {
                name,
                budget,
                reserve,
                live,
            },
            host: p.host,
            device: p.device.as_ref().map(|d| d.get_ref().clone()),
            index,
            path,
        })
    }
}

/// `device = "nvml:N"` or `"file:/path"`, on a pool not bound to host
/// memory (`pool` is the span of the whole pool, `host` its `host` key).
fn device(
    src: &Source<'_>,
    d: &Spanned<String>,
    host: bool,
    pool: Range<usize>,
    key: &str,
) -> Result<()> {
    let text = d.get_ref();
    let nvml = text
        .strip_prefix("nvml:")
        .is_some_and(|n| n.parse::<u32>().is_ok());
    let file = text
        .strip_prefix("file:")
        .is_some_and(|p| p.starts_with('/'));
    if !(nvml || file) {
        let msg = format!(
            "{text:?}: expected \"nvml:N\" (a GPU) or \"file:/path\" (a reading kept in a file)"
        );
        return Err(src.err(d.span(), key, msg));
    }
    if host {
        return Err(src.err(
            pool,
            key,
            "a pool is bound to host memory or to a device, not both",
        ));
    }
    Ok(())
}
