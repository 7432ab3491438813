//! The `[[workload]]` sections: names declared once, role, excludes,
//! memory per pool (`demand.rs`), the command and environment with their
//! macros, readiness and restart (`lifecycle.rs`), stop grace, idle TTL
//! and the user it runs as.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use resident_core::{Role, Spec, WorkloadName};
use resident_supervisor::MACROS;
use toml::Spanned;

use super::demand::memory;
use super::lifecycle::{readiness, restart};
use super::{Result, duration, spanned_str, user};
use crate::ConfigError;
use crate::error::Source;
use crate::host::Lookups;
use crate::{Expose, PoolDef, Workload, raw};

pub(super) fn workloads(
    src: &Source<'_>,
    raw: &[Spanned<raw::Workload>],
    pools: &[PoolDef],
    host: Lookups,
) -> Result<BTreeMap<String, Arc<Workload>>> {
    let mut out = BTreeMap::new();
    let mut errors = Vec::new();
    let mut names = std::collections::BTreeSet::new();
    for w in raw {
        let w = w.get_ref();
        let mut one = || {
            let name = WorkloadName::new(spanned_str(&w.name))
                .map_err(|e| src.err(w.name.span(), "workload.name", e.to_string()))?;
            if !names.insert(name.to_string()) {
                return Err(src.err(
                    w.name.span(),
                    format!("workload[{name}].name"),
                    "declared twice",
                ));
            }
            Ok((name.clone(), workload(src, &name, w, pools, host)?))
        };
        // Every workload is checked, whatever the ones before it hold.
        match one() {
            Ok((name, workload)) => {
                out.insert(name.to_string(), Arc::new(workload));
            }
            Err(e) => errors.push(e),
        }
    }
    ConfigError::all(errors)?;
    aliases_unique(src, raw, &out)?;
    Ok(out)
}

/// `keep_kv = "POOL"`: a disk pool of the node, on a llama-server whose
/// command saves its slots there (`--slot-save-path`, which the flavor
/// passes: the pool's directory and the workload's name).
fn keep_kv(
    src: &Source<'_>,
    name: &WorkloadName,
    w: &raw::Workload,
    pools: &[PoolDef],
    argv: &[String],
    key: &dyn Fn(&str) -> String,
) -> Result<Option<crate::KeepKv>> {
    let Some(asked) = &w.keep_kv else {
        return Ok(None);
    };
    let pool = asked.get_ref();
    let Some(dir) = pools
        .iter()
        .find(|p| p.pool.name.as_str() == pool)
        .and_then(|p| p.path.as_ref())
    else {
        let msg = format!(
            "no disk pool {pool:?} on this node: declare one with [[pool]] name = {pool:?}, path = \"DIR\" and a budget"
        );
        return Err(src.err(asked.span(), key("keep_kv"), msg));
    };
    if w.flavor
        .as_ref()
        .is_none_or(|f| f.get_ref() != "llama-server")
    {
        let msg = "keep_kv saves llama-server's slots: set flavor = \"llama-server\"";
        return Err(src.err(asked.span(), key("keep_kv"), msg));
    }
    let dir = dir.join(name.as_str());
    let saves_there = argv
        .windows(2)
        .any(|p| p[0] == "--slot-save-path" && std::path::Path::new(&p[1]) == dir);
    if !saves_there {
        let msg = format!(
            "the command does not save its slots where keep_kv keeps them: give it --slot-save-path {} (the flavor does, when it writes the command)",
            dir.display()
        );
        return Err(src.err(asked.span(), key("keep_kv"), msg));
    }
    Ok(Some(crate::KeepKv {
        pool: pool.clone(),
        dir,
        save_quiet: save_quiet(w, argv),
    }))
}

/// How long a server that sleeps by itself stays quiet before its
/// conversations are saved: its sleep `idle` less what its command gives
/// the server (`--sleep-idle-seconds`), where the command also serves
/// `--metrics` (how the agent sees it quiet).
fn save_quiet(w: &raw::Workload, argv: &[String]) -> Option<std::time::Duration> {
    let idle = w.sleep.as_ref()?.get_ref().idle.as_ref()?;
    let idle = crate::duration::parse_duration(idle.get_ref()).ok()?;
    let server = argv
        .windows(2)
        .find(|p| p[0] == "--sleep-idle-seconds")
        .and_then(|p| p[1].parse::<u64>().ok())?;
    let quiet = idle.checked_sub(std::time::Duration::from_secs(server))?;
    (argv.iter().any(|a| a == "--metrics") && !quiet.is_zero()).then_some(quiet)
}

/// Every alias names one workload: none repeats a workload's name or
/// another alias.
fn aliases_unique(
    src: &Source<'_>,
    raw: &[Spanned<raw::Workload>],
    workloads: &BTreeMap<String, Arc<Workload>>,
) -> Result<()> {
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for w in raw {
        let w = w.get_ref();
        let owner = w.name.get_ref().as_str();
        for (i, alias) in w.aliases.iter().enumerate() {
            let a = alias.get_ref().as_str();
            let clash = if workloads.contains_key(a) {
                Some(format!("is the name of workload '{a}'"))
            } else {
                seen.get(a)
                    .map(|other| format!("is already an alias of workload '{other}'"))
            };
            if let Some(why) = clash {
                return Err(src.err(alias.span(), format!("workload[{owner}].aliases[{i}]"), why));
            }
            seen.insert(a, owner);
        }
    }
    Ok(())
}

fn workload(
    src: &Source<'_>,
    name: &WorkloadName,
    w: &raw::Workload,
    pools: &[PoolDef],
    host: Lookups,
) -> Result<Workload> {
    let key = |k: &str| format!("workload[{name}].{k}");
    let (mut spec, memory) = spec(src, name, w, pools, &key, host)?;
    let sleep = match super::sleep::sleep(src, w, &spec, pools, &key, host)? {
        Some((sleep, asleep)) => {
            spec.asleep = Some(asleep);
            Some(sleep)
        }
        None => None,
    };
    let (argv, env) = command(src, w, &key)?;
    let keep_kv = keep_kv(src, name, w, pools, &argv, &key)?;
    let uses_device = argv
        .iter()
        .chain(env.values())
        .any(|s| s.contains(DEVICE_MACRO));
    if uses_device {
        device_macro(src, w, &spec, pools, &key)?;
    }
    let (readiness, readiness_timeout) = readiness(src, w, &key)?;
    let restart = restart(src, w, &key)?;
    let stop_grace = match &w.stop_grace {
        Some(d) => duration(src, d, &key("stop_grace"))?,
        None => Duration::from_secs(10),
    };
    let idle_ttl = match &w.idle_ttl {
        Some(d) => Some(duration(src, d, &key("idle_ttl"))?).filter(|d| !d.is_zero()),
        None => None,
    };
    let on_overrun = w
        .on_overrun
        .as_ref()
        .map(|s| super::node::on_overrun(src, s, &key("on_overrun")))
        .transpose()?;
    let host_bytes = pools
        .iter()
        .filter(|p| p.device.is_none())
        .map(|p| spec.footprint(p.pool.name.as_str()))
        .fold(0u64, u64::saturating_add);
    let aliases = w
        .aliases
        .iter()
        .enumerate()
        .map(|(i, a)| {
            WorkloadName::new(spanned_str(a))
                .map(|n| n.to_string())
                .map_err(|e| src.err(a.span(), key(&format!("aliases[{i}]")), e.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let concurrency_limit = match &w.concurrency_limit {
        Some(n) if *n.get_ref() == 0 => {
            return Err(src.err(n.span(), key("concurrency_limit"), "must be at least 1"));
        }
        n => n.as_ref().map(|n| *n.get_ref()),
    };
    let expose = match &w.expose {
        None if w.flavor.is_some() => Expose::Loopback,
        None => Expose::Any,
        Some(e) => match e.get_ref().as_str() {
            "loopback" => Expose::Loopback,
            "any" => Expose::Any,
            other => {
                return Err(src.err(
                    e.span(),
                    key("expose"),
                    format!("'{other}' is neither \"loopback\" nor \"any\""),
                ));
            }
        },
    };
    let reports_buffers = w
        .flavor
        .as_ref()
        .is_some_and(|f| ["llama-server", "llama-cpp-python"].contains(&f.get_ref().as_str()));
    Ok(Workload {
        sleep,
        keep_kv,
        reports_buffers,
        reservation: memory.notes,
        reservation_warnings: memory.warnings,
        on_overrun,
        expose,
        host_bytes,
        aliases,
        concurrency_limit,
        spec: Arc::new(spec),
        argv,
        env,
        pass_env: w.pass_env.clone(),
        cwd: w.cwd.as_ref().map(PathBuf::from),
        readiness,
        readiness_timeout,
        restart,
        stop_grace,
        idle_ttl,
        run_as: w
            .run_as
            .as_ref()
            .map(|u| user(src, u, &key("run_as"), host))
            .transpose()?,
    })
}

/// What the planner needs: role, priority, excludes and memory per pool.
fn spec(
    src: &Source<'_>,
    name: &WorkloadName,
    w: &raw::Workload,
    pools: &[PoolDef],
    key: &dyn Fn(&str) -> String,
    host: Lookups,
) -> Result<(Spec, super::demand::Memory)> {
    let mut spec = Spec::new(name.clone());
    if let Some(role) = &w.role {
        spec.role = Role::new(spanned_str(role))
            .map_err(|e| src.err(role.span(), key("role"), e.to_string()))?;
    }
    spec.priority = w.priority;
    for x in &w.excludes {
        let bare = x.get_ref().strip_prefix("role:").unwrap_or(x.get_ref());
        Role::new(bare).map_err(|e| src.err(x.span(), key("excludes"), e.to_string()))?;
        spec.excludes.push(x.get_ref().clone());
    }
    let mut memory = memory(src, &w.memory, pools, key, host)?;
    spec.demand = std::mem::take(&mut memory.fixed);
    spec.any_of = std::mem::take(&mut memory.any_of);
    Ok((spec, memory))
}

/// The argv (a program first) and the environment, their macros checked.
fn command(
    src: &Source<'_>,
    w: &raw::Workload,
    key: &dyn Fn(&str) -> String,
) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    let command = super::raw_command(w);
    let argv = command.get_ref().clone();
    if argv.first().is_none_or(|p| p.is_empty()) {
        return Err(src.err(
            command.span(),
            key("command"),
            "must name a program (an argv list, never a shell string)",
        ));
    }
    for arg in &argv {
        check_macros(arg).map_err(|m| src.err(command.span(), key("command"), m))?;
    }
    let mut env = BTreeMap::new();
    for (k, v) in &w.env {
        check_macros(v.get_ref()).map_err(|m| src.err(v.span(), key(&format!("env.{k}")), m))?;
        env.insert(k.clone(), v.get_ref().clone());
    }
    Ok((argv, env))
}

/// `${DEVICE}` is usable only where every pool an any-of demand may
/// choose has a device index.
fn device_macro(
    src: &Source<'_>,
    w: &raw::Workload,
    spec: &Spec,
    pools: &[PoolDef],
    key: &dyn Fn(&str) -> String,
) -> Result<()> {
    let span = super::raw_command(w).span();
    if spec.any_of.is_empty() {
        let msg = "${DEVICE} names the devices an any_of demand chose, and this workload has none";
        return Err(src.err(span, key("command"), msg));
    }
    for a in &spec.any_of {
        let unindexed = a.candidates.iter().find(|c| {
            pools
                .iter()
                .any(|p| p.pool.name == **c && p.index.is_none())
        });
        if let Some(c) = unindexed {
            let msg = format!(
                "${{DEVICE}}: pool '{c}' of memory.{}.any_of has no device index (device = \"nvml:N\", or index = N)",
                a.label
            );
            return Err(src.err(span, key("command"), msg));
        }
    }
    Ok(())
}

/// The macro the config fills in at launch: the chosen devices' indexes.
const DEVICE_MACRO: &str = "${DEVICE}";

/// Refuses `${NAME}` for a NAME neither the supervisor nor the launch
/// (`${DEVICE}`) fills in.
fn check_macros(s: &str) -> std::result::Result<(), String> {
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            return Err(format!("{s:?}: unterminated ${{"));
        };
        let name = &after[..end];
        if !MACROS.contains(&name) && name != "DEVICE" {
            return Err(format!(
                "{s:?}: unknown macro ${{{name}}} (known: ${{PORT}}, ${{INSTANCE}}, ${{WORKLOAD}}, ${{ROLE}}, ${{DEVICE}})"
            ));
        }
        rest = &after[end + 1..];
    }
    Ok(())
}
