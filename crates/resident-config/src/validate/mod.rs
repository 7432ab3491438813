//! From the raw document to a `Config`: every rule of the design brief's
//! config contract, each failure reported with file, line and key. One
//! file per section (`node.rs` with `listen.rs`, `pools.rs`, `groups.rs`,
//! `workloads.rs` with `demand.rs` and `lifecycle.rs`, after `flavor.rs`
//! has filled in what a workload's flavor implies); this one runs them in
//! order and holds the helpers they share. No section asks the machine
//! anything itself: every look-up goes through `Lookups` (`host.rs`),
//! which clippy holds it to (`disallowed-methods` in the crate's
//! clippy.toml, on for this module).

#![warn(clippy::disallowed_methods)]

mod access;
mod demand;
pub(crate) mod flavor;
mod groups;
mod lifecycle;
mod listen;
mod node;
mod pools;
mod sleep;
mod workloads;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use resident_core::parse_bytes;
use toml::Spanned;

use crate::duration::parse_duration;
use crate::error::Source;
use crate::host::Lookups;
use crate::raw::{self, Quantity};
use crate::{Config, ConfigError, NodeConfig, User, Workload};

type Result<T> = std::result::Result<T, ConfigError>;

pub(crate) fn validate(file: &Path, text: &str, host: Lookups) -> Result<Config> {
    let src = Source { file, text };
    let doc = raw::document(&src)?;
    // Every section is checked, so a config is fixed in one round: the
    // workloads against every pool whose name reads (a wrong pool stands
    // in), the groups once the workloads hold.
    let mut errors = Vec::new();
    let node = node::node(&src, &doc.node, host).map_err(|e| errors.push(e));
    let (pools, pool_errors) = pools::pools(&src, &doc.pool);
    errors.extend(pool_errors);
    let mut flavored = Vec::new();
    let mut flavor_errors = Vec::new();
    for w in &doc.workload {
        match flavor::apply(&src, w.get_ref(), &pools) {
            Ok(mut raw) => {
                anchor_program(&mut raw, host);
                flavored.push(Spanned::new(w.span(), raw))
            }
            Err(e) => flavor_errors.push(e),
        }
    }
    let node_user = node.as_ref().ok().and_then(|n| n.run_as.as_ref());
    if let Err(e) = programs(&src, &flavored, node_user, host) {
        errors.push(e);
    }
    let workloads = ConfigError::all(flavor_errors)
        .and_then(|()| workloads::workloads(&src, &flavored, &pools, host))
        .map_err(|e| errors.push(e));
    let groups = match &workloads {
        Ok(w) => groups::groups(&src, &doc.group, w).map_err(|e| errors.push(e)),
        Err(()) => Err(()),
    };
    ConfigError::all(errors)?;
    let (Ok(node), Ok(workloads), Ok(groups)) = (node, workloads, groups) else {
        unreachable!("a section that failed said why");
    };
    let mut warnings: Vec<String> = workloads
        .values()
        .flat_map(|w| w.reservation_warnings.iter().cloned())
        .collect();
    warnings.extend(root_warnings(&node, &workloads, host));
    warnings.extend(access_warnings(&node));
    Ok(Config {
        source: file.to_path_buf(),
        node,
        pools,
        groups,
        workloads,
        warnings,
    })
}

/// A program named by a relative path (`bin/server`, `./server`) is made
/// absolute here, once, against the directory it runs in (its `cwd`, or
/// the agent's own): the file checked at load is the file spawned, whatever
/// directory the agent is in when it spawns. A program without a `/` is
/// looked up on PATH, and one with a macro is left as written.
fn anchor_program(w: &mut raw::Workload, host: Lookups) {
    let Some(command) = w.command.as_mut() else {
        return;
    };
    let Some(program) = command.get_mut().first_mut() else {
        return;
    };
    if !program.contains('/') || program.starts_with('/') || program.contains("${") {
        return;
    }
    let runs_in = match w.cwd.as_ref().map(std::path::PathBuf::from) {
        Some(cwd) if cwd.is_absolute() => Some(cwd),
        Some(cwd) => host.current_dir().map(|d| d.join(cwd)),
        None => host.current_dir(),
    };
    if let Some(dir) = runs_in {
        *program = dir.join(&*program).display().to_string();
    }
}

/// Each workload's program, as `Lookups::program` checks it: every one,
/// as the user it runs as (its own `run_as`, else the node's; a name that
/// does not resolve is reported with its key, and its program is checked
/// as the agent's).
fn programs(
    src: &Source<'_>,
    raw: &[Spanned<raw::Workload>],
    node_user: Option<&User>,
    host: Lookups,
) -> Result<()> {
    let errors = raw
        .iter()
        .filter_map(|w| {
            let name = spanned_str(&w.get_ref().name);
            let command = raw_command(w.get_ref());
            let path = w.get_ref().env.get("PATH").map(|p| p.get_ref().as_str());
            let own = w
                .get_ref()
                .run_as
                .as_ref()
                .map(|u| host.user(u.get_ref()).ok());
            let user = match &own {
                Some(resolved) => resolved.as_ref(),
                None => node_user,
            };
            host.program(command.get_ref(), path, user)
                .map_err(|m| src.err(command.span(), format!("workload[{name}].command"), m))
                .err()
        })
        .collect();
    ConfigError::all(errors)
}

/// Roles `[node.access]` grants to no one: root and the agent's own user
/// hold every role anyway, and no one else holds these.
fn access_warnings(node: &NodeConfig) -> Vec<String> {
    let Some(a) = &node.access else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if a.operators.is_empty() && a.admins.is_empty() {
        out.push(if a.viewers.is_empty() {
            "node.access grants no role to anyone: only root and the agent's own user may call the agent".to_string()
        } else {
            "node.access grants operator to no one: only root and the agent's own user may start, stop, touch or adopt".to_string()
        });
    }
    out
}

/// Workloads that would run as root while the agent is root.
fn root_warnings(
    node: &NodeConfig,
    workloads: &BTreeMap<String, Arc<Workload>>,
    host: Lookups,
) -> Vec<String> {
    if !host.agent_is_root() {
        return Vec::new();
    }
    workloads
        .iter()
        .filter(|(_, w)| w.run_as.as_ref().or(node.run_as.as_ref()).is_none_or(|u| u.uid == 0))
        .map(|(name, _)| {
            format!("workload[{name}] would run as root: set run_as (in [node] or on the workload) to a user of its own")
        })
        .collect()
}

fn spanned_str(s: &Spanned<String>) -> &str {
    s.get_ref().as_str()
}

/// A `run_as` user: one the agent can run children as.
fn user(src: &Source<'_>, u: &Spanned<String>, key: &str, host: Lookups) -> Result<User> {
    host.run_as(u.get_ref())
        .map_err(|m| src.err(u.span(), key, m))
}

fn bytes(src: &Source<'_>, q: &Spanned<Quantity>, key: &str) -> Result<u64> {
    match q.get_ref() {
        Quantity::Bytes(b) => Ok(*b),
        Quantity::Text(t) => parse_bytes(t).map_err(|e| src.err(q.span(), key, e.to_string())),
    }
}

fn duration(src: &Source<'_>, d: &Spanned<String>, key: &str) -> Result<Duration> {
    parse_duration(d.get_ref()).map_err(|e| src.err(d.span(), key, e))
}

/// A workload's command, once `flavor::apply` has run (it refuses a
/// workload with neither a command nor a flavor).
fn raw_command(w: &raw::Workload) -> &Spanned<Vec<String>> {
    w.command
        .as_ref()
        .expect("flavor::apply leaves every workload with a command")
}
