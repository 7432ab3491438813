//! `[workload.sleep]`: the calls that put a workload's server to sleep and
//! wake it (`"POST /sleep?level=1"` on its port), when it sleeps by itself
//! (`idle`), and what it holds asleep (`[workload.sleep.memory.POOL]`,
//! or `.LABEL` of one of its any-of tables: then on each pool chosen for
//! it). The flavor `vllm` fills these in for vLLM's sleep mode: level 1
//! moves the weights to the host pool and keeps a residue (`residue`) on
//! each GPU; level 2 discards the weights. The flavor `llama-server`
//! sleeps by itself after `idle` (`--sleep-idle-seconds`), which the agent
//! follows through `/props`, and wakes by itself at the next request.

use std::collections::BTreeMap;
use std::time::Duration;

use resident_core::{Asleep, Demand, PoolName, Spec};
use toml::Spanned;

use super::demand::demand;
use super::{Result, bytes, duration};
use crate::error::Source;
use crate::host::Lookups;
use crate::{HttpCall, PoolDef, Sleep, raw};

/// What vLLM keeps on each GPU while asleep unless `residue` says: its
/// CUDA context and allocator pools.
const VLLM_RESIDUE: u64 = 1_000_000_000;

/// The workload's sleep, when it has a `[workload.sleep]` table.
pub(super) fn sleep(
    src: &Source<'_>,
    w: &raw::Workload,
    spec: &Spec,
    pools: &[PoolDef],
    key: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<Option<(Sleep, Asleep)>> {
    let Some(table) = &w.sleep else {
        return Ok(None);
    };
    let t = table.get_ref();
    let k = |s: &str| key(&format!("sleep.{s}"));
    let vllm = w.flavor.as_ref().is_some_and(|f| f.get_ref() == "vllm");
    if w.flavor
        .as_ref()
        .is_some_and(|f| f.get_ref() == "llama-server")
    {
        return llama_server(src, w, table, spec, pools, &k, host).map(Some);
    }
    let level = match &t.level {
        Some(l) if !vllm => {
            return Err(src.err(l.span(), k("level"), "is vLLM's: set flavor = \"vllm\""));
        }
        Some(l) if ![1, 2].contains(l.get_ref()) => {
            return Err(src.err(l.span(), k("level"), "vLLM sleeps at level 1 or 2"));
        }
        Some(l) => *l.get_ref(),
        None => 1,
    };
    let call = |name: &str, given: &Option<Spanned<String>>, default: Option<String>| match (
        given, default,
    ) {
        (Some(c), _) => parse_call(c.get_ref()).map_err(|e| src.err(c.span(), k(name), e)),
        (None, Some(d)) => Ok(parse_call(&d).expect("a flavor's call parses")),
        (None, None) => Err(src.err(
            table.span(),
            k(name),
            "missing: the HTTP call on the instance's port, such as \"POST /sleep\"",
        )),
    };
    let sleep_call = call(
        "sleep",
        &t.sleep,
        vllm.then(|| format!("POST /sleep?level={level}")),
    )?;
    let wake = call("wake", &t.wake, vllm.then(|| "POST /wake_up".to_string()))?;
    let idle = match &t.idle {
        Some(d) => Some(duration(src, d, &k("idle"))?).filter(|d| !d.is_zero()),
        None => None,
    };
    let timeout = match &t.timeout {
        Some(d) => duration(src, d, &k("timeout"))?,
        None => Duration::from_secs(60),
    };
    let asleep = if t.memory.is_empty() && vllm {
        let residue = match &t.residue {
            Some(q) => bytes(src, q, &k("residue"))?,
            None => VLLM_RESIDUE,
        };
        vllm_asleep(spec, pools, level, residue)
    } else {
        if let Some(r) = &t.residue {
            return Err(src.err(r.span(), k("residue"), "is vLLM's: set flavor = \"vllm\""));
        }
        asleep_memory(src, &t.memory, spec, pools, &k, host)?
    };
    let sleep = Sleep {
        sleep: Some(sleep_call),
        wake: Some(wake),
        follow: None,
        idle,
        timeout,
    };
    Ok(Some((sleep, asleep)))
}

/// llama-server sleeps by itself after `idle` unused (the flavor passes
/// `--sleep-idle-seconds`), says so in `/props` (`is_sleeping`), and wakes
/// by itself at the next request: no calls. Asleep it keeps its process
/// (its runtime, without the model) in each pool it holds, and the
/// prompt cache it was given in the host table (it keeps the cache
/// asleep: the e2e test `llama::llama_servers_prompt_cache_...`), unless
/// tables say otherwise.
fn llama_server(
    src: &Source<'_>,
    w: &raw::Workload,
    table: &Spanned<raw::Sleep>,
    spec: &Spec,
    pools: &[PoolDef],
    k: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<(Sleep, Asleep)> {
    let t = table.get_ref();
    for (name, given) in [("sleep", &t.sleep), ("wake", &t.wake)] {
        if let Some(c) = given {
            let msg = "llama-server sleeps and wakes by itself: leave the calls out";
            return Err(src.err(c.span(), k(name), msg));
        }
    }
    for (name, given) in [
        ("level", t.level.as_ref().map(Spanned::span)),
        ("residue", t.residue.as_ref().map(Spanned::span)),
    ] {
        if let Some(span) = given {
            return Err(src.err(span, k(name), "is vLLM's: set flavor = \"vllm\""));
        }
    }
    let idle = match &t.idle {
        Some(d) => duration(src, d, &k("idle"))?,
        None => Duration::ZERO,
    };
    let timeout = match &t.timeout {
        Some(d) => duration(src, d, &k("timeout"))?,
        None => Duration::from_secs(60),
    };
    let mut asleep = if t.memory.is_empty() {
        let process = Demand {
            overhead: super::flavor::LLAMA_SERVER_PROCESS,
            ..Demand::default()
        };
        // As awake: a declared overhead is the workload's own figure and
        // stands (the cache is not added to it).
        let cache = |pool: &PoolName| match w
            .memory
            .get(pool.as_str())
            .filter(|d| d.get_ref().overhead.is_none())
            .and_then(|d| d.get_ref().prompt_cache)
        {
            Some(raw::PromptCache::Bytes(b)) => b,
            _ => 0,
        };
        Asleep {
            demand: spec
                .demand
                .keys()
                .map(|p| {
                    let held = Demand {
                        overhead: process.overhead.saturating_add(cache(p)),
                        ..process
                    };
                    (p.clone(), held)
                })
                .collect(),
            any_of: spec.any_of.iter().map(|_| process).collect(),
            by_itself: true,
        }
    } else {
        asleep_memory(src, &t.memory, spec, pools, k, host)?
    };
    asleep.by_itself = true;
    let sleep = Sleep {
        sleep: None,
        wake: None,
        follow: Some("/props".to_string()),
        idle: Some(idle).filter(|d| !d.is_zero()),
        timeout,
    };
    Ok((sleep, asleep))
}

/// `"METHOD /path"`.
fn parse_call(s: &str) -> std::result::Result<HttpCall, String> {
    let mut words = s.split_whitespace();
    let (Some(method), Some(path), None) = (words.next(), words.next(), words.next()) else {
        return Err(format!(
            "{s:?}: give the method and the path, as \"POST /sleep\""
        ));
    };
    if !method.chars().all(|c| c.is_ascii_uppercase()) {
        return Err(format!("{s:?}: the method is an upper-case word, as POST"));
    }
    if !path.starts_with('/') || path.chars().any(|c| c.is_ascii_control()) {
        return Err(format!("{s:?}: the path starts with /"));
    }
    Ok(HttpCall {
        method: method.to_string(),
        path: path.to_string(),
    })
}

/// The asleep tables: each a pool of the node or an any-of label of the
/// awake memory.
fn asleep_memory(
    src: &Source<'_>,
    tables: &BTreeMap<String, Spanned<raw::Demand>>,
    spec: &Spec,
    pools: &[PoolDef],
    k: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<Asleep> {
    let mut out = Asleep {
        demand: BTreeMap::new(),
        any_of: vec![Demand::default(); spec.any_of.len()],
        by_itself: false,
    };
    for (label, d) in tables {
        let tk = |s: &str| k(&format!("memory.{label}.{s}"));
        if let Some(a) = d.get_ref().any_of.as_ref() {
            let msg = "an asleep table names a pool, or the label of an any_of table of the workload's memory";
            return Err(src.err(a.span(), tk("any_of"), msg));
        }
        // What a sleeping server holds is often a residue alone: weights
        // may be left out.
        let mut d = d.clone();
        let span = d.span();
        let raw = d.get_mut();
        if raw.weights.is_none() && raw.from_gguf.is_none() {
            raw.weights = Some(Spanned::new(span, raw::Quantity::Bytes(0)));
        }
        let (demand, _, _) = demand(src, &d, &tk, host)?;
        if let Some(i) = spec.any_of.iter().position(|a| a.label == *label) {
            out.any_of[i] = demand;
        } else if pools.iter().any(|p| p.pool.name.as_str() == label) {
            let pool = PoolName::new(label.as_str())
                .map_err(|e| src.err(d.span(), k("memory"), e.to_string()))?;
            out.demand.insert(pool, demand);
        } else {
            let msg = format!(
                "no pool {label:?} on this node, and no any_of table {label:?} in the workload's memory"
            );
            return Err(src.err(d.span(), k(&format!("memory.{label}")), msg));
        }
    }
    if out.any_of.iter().all(|d| *d == Demand::default()) {
        out.any_of.clear();
    }
    Ok(out)
}

/// vLLM's asleep demand: `residue` on each GPU pool it holds; at level 1
/// its weights in the host pool (the first pool bound to no device).
fn vllm_asleep(spec: &Spec, pools: &[PoolDef], level: u8, residue: u64) -> Asleep {
    let is_device = |name: &PoolName| {
        pools
            .iter()
            .any(|p| p.pool.name == *name && (p.device.is_some() || p.index.is_some()))
    };
    let host_pool = pools
        .iter()
        .find(|p| p.host)
        .or_else(|| pools.iter().find(|p| p.device_free()))
        .map(|p| p.pool.name.clone());
    let residue = Demand {
        overhead: residue,
        ..Demand::default()
    };
    let mut out = Asleep::default();
    let mut weights = 0u64;
    for (pool, d) in &spec.demand {
        if is_device(pool) {
            out.demand.insert(pool.clone(), residue);
            weights = weights.saturating_add(d.weights);
        }
    }
    for a in &spec.any_of {
        out.any_of.push(residue);
        let count = u64::try_from(a.count).unwrap_or(u64::MAX);
        weights = weights.saturating_add(a.demand.weights.saturating_mul(count));
    }
    if level == 1
        && weights > 0
        && let Some(host) = host_pool
    {
        let held = out.demand.entry(host).or_default();
        held.weights = held.weights.saturating_add(weights);
    }
    out
}
