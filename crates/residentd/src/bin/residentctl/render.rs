//! How residentctl prints: aligned tables for people, one JSON document
//! (or one per line for streams) for scripts. Every write's error comes
//! back to the caller (no `println!`, which panics on a closed pipe), so
//! `residentctl ... | head -1` ends quietly (see `main`).

use std::io::{self, IsTerminal as _, Write as _};
use std::time::Duration;

use prost::Message as _;
use resident_api::pb;
use resident_core::Gb;
use serde_json::{Value, json};

/// A line on stdout; a failed write returns its error from the function.
macro_rules! out {
    ($($arg:tt)*) => {
        writeln!(io::stdout().lock(), $($arg)*)?
    };
}

/// A line on stderr; a failed write returns its error from the function.
macro_rules! err {
    ($($arg:tt)*) => {
        writeln!(io::stderr().lock(), $($arg)*)?
    };
}

fn state_name(state: i32) -> &'static str {
    pb::State::try_from(state).map_or("UNKNOWN", |s| s.as_str_name())
}

fn declared(i: &pb::Instance) -> u64 {
    i.demand
        .iter()
        .map(|d| {
            d.weights_bytes
                .saturating_add(d.kv_budget_bytes)
                .saturating_add(d.overhead_bytes)
        })
        .sum()
}

fn instance_json(i: &pb::Instance) -> Value {
    json!({
        "instance_id": i.instance_id,
        "workload": i.workload,
        "role": i.role,
        "state": state_name(i.state),
        "pid": i.pid,
        "port": i.port,
        "exit_code": i.exit_code,
        "exit_signal": i.exit_signal,
        "oom_killed": i.oom_killed,
        "restarts": i.restarts,
        "declared_bytes": declared(i),
        "measured_bytes": i.measured_bytes,
        "measured_unix_ms": i.measured_unix_ms,
        "reserved_bytes": i.reserved_bytes,
        "overrun_bytes": i.overrun_bytes,
        "started_unix_ms": i.started_unix_ms,
        "demand": demand_json(&i.demand),
        "devices": i.devices,
        "server_buffers": i.server_buffers.iter().map(|b| json!({
            "device": b.device, "kind": b.kind, "bytes": b.bytes,
        })).collect::<Vec<_>>(),
        "adopted": i.adopted,
        "managed": i.managed,
        "message": i.message,
    })
}

fn demand_json(demand: &[pb::PoolDemand]) -> Vec<Value> {
    demand
        .iter()
        .map(|d| {
            json!({
                "pool": d.pool, "weights_bytes": d.weights_bytes, "kv_budget_bytes": d.kv_budget_bytes,
                "overhead_bytes": d.overhead_bytes, "reserved_bytes": d.reserved_bytes,
                "overrun_bytes": d.overrun_bytes, "learned_bytes": d.learned_bytes,
            })
        })
        .collect()
}

fn pool_json(p: &pb::PoolStatus) -> Value {
    json!({
        "name": p.name,
        "budget_bytes": p.budget_bytes,
        "effective_budget_bytes": p.effective_budget_bytes,
        "used_bytes": p.used_bytes,
        "free_bytes": p.free_bytes,
        "available_bytes": p.available_bytes,
    })
}

fn refusal_json(r: &pb::Refusal) -> Value {
    use pb::refusal::Reason;
    let (code, detail) = match &r.reason {
        Some(Reason::OverBudget(o)) => (
            "OVER_BUDGET",
            json!({
                "role": o.role, "pool": o.pool, "need_bytes": o.need_bytes, "free_bytes": o.free_bytes,
                "budget_bytes": o.budget_bytes,
                "holders": o.holders.iter().map(holder_json).collect::<Vec<_>>(),
            }),
        ),
        Some(Reason::HostMemory(h)) => (
            "HOST_MEMORY",
            json!({
                "role": h.role, "pool": h.pool, "need_bytes": h.need_bytes, "available_bytes": h.available_bytes,
                "reserve_bytes": h.reserve_bytes, "pending_bytes": h.pending_bytes,
                "holders": h.holders.iter().map(holder_json).collect::<Vec<_>>(),
            }),
        ),
        Some(Reason::Excluded(e)) => (
            "EXCLUDED",
            json!({
                "role": e.role, "with": e.with, "declared_by": e.declared_by, "with_instance_id": e.with_instance_id,
            }),
        ),
        Some(Reason::GroupConflict(g)) => (
            "GROUP_CONFLICT",
            json!({
                "role": g.role, "with": g.with, "group": g.group, "rule": g.rule, "with_instance_id": g.with_instance_id,
            }),
        ),
        None => ("UNKNOWN", Value::Null),
    };
    json!({ "reason": code, "message": r.message, "detail": detail })
}

fn holder_json(h: &pb::Holder) -> Value {
    json!({ "instance_id": h.instance_id, "role": h.role, "bytes": h.bytes })
}

fn print_json(v: &Value) -> io::Result<()> {
    out!("{v}");
    Ok(())
}

/// Prints rows as columns padded to their widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) -> io::Result<()> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| -> io::Result<()> {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out!("{}", padded.join("  ").trim_end());
        Ok(())
    };
    line(header.iter().map(|h| h.to_string()).collect())?;
    for row in rows {
        line(row.clone())?;
    }
    Ok(())
}

/// Time since `started_unix_ms`, kubectl-style: 45s, 12m, 3h, 2d.
fn age(started_unix_ms: u64) -> String {
    if started_unix_ms == 0 {
        return "-".into();
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let secs = now.saturating_sub(started_unix_ms) / 1000;
    match secs {
        0..=119 => format!("{secs}s"),
        120..=7199 => format!("{}m", secs / 60),
        7200..=172_799 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86_400),
    }
}

fn gb_or_dash(bytes: Option<u64>) -> String {
    bytes.map_or("-".into(), |b| Gb(b).to_string())
}

/// Instances as a table (or JSON).
pub fn instances(list: &[pb::Instance], json: bool) -> io::Result<()> {
    if json {
        return print_json(&Value::Array(list.iter().map(instance_json).collect()));
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|i| {
            vec![
                i.instance_id.clone(),
                i.role.clone(),
                state_name(i.state).to_string(),
                match (i.pid, i.adopted) {
                    (0, _) => "-".into(),
                    (pid, true) => format!("{pid} (adopted)"),
                    (pid, false) => pid.to_string(),
                },
                if i.port == 0 {
                    "-".into()
                } else {
                    i.port.to_string()
                },
                Gb(declared(i)).to_string(),
                Gb(i.reserved_bytes).to_string(),
                Gb(i.measured_bytes).to_string(),
                i.restarts.to_string(),
                age(i.started_unix_ms),
                i.message.clone(),
            ]
        })
        .collect();
    let header = [
        "INSTANCE", "ROLE", "STATE", "PID", "PORT", "DECLARED", "RESERVED", "MEASURED", "RESTARTS",
        "AGE", "MESSAGE",
    ];
    table(&header, &rows)
}

/// A workload's totals over its pools (an any-of demand once per pool it
/// takes): declared, reserved at its next start.
fn workload_totals(w: &pb::Workload) -> (u64, u64) {
    let fixed = w.demand.iter().map(|d| {
        let declared = d.weights_bytes + d.kv_budget_bytes + d.overhead_bytes;
        (declared, d.reserved_bytes)
    });
    let any = w.any_of.iter().map(|a| {
        let declared = a.weights_bytes + a.kv_budget_bytes + a.overhead_bytes;
        let n = u64::from(a.count);
        (declared * n, a.reserved_bytes * n)
    });
    fixed
        .chain(any)
        .fold((0, 0), |(d, r), (d1, r1)| (d + d1, r + r1))
}

/// The roster as a table (or JSON).
pub fn workloads(list: &[pb::Workload], json: bool) -> io::Result<()> {
    if json {
        let each = list.iter().map(|w| {
            let (declared, reserved) = workload_totals(w);
            json!({
                "name": w.name,
                "aliases": w.aliases,
                "role": w.role,
                "declared_bytes": declared,
                "learned_bytes": w.learned_bytes,
                "reserved_bytes": reserved,
                "concurrency_limit": w.concurrency_limit,
                "demand": demand_json(&w.demand),
                "any_of": w.any_of.iter().map(|a| json!({
                    "label": a.label, "candidates": a.candidates, "count": a.count,
                    "weights_bytes": a.weights_bytes, "kv_budget_bytes": a.kv_budget_bytes,
                    "overhead_bytes": a.overhead_bytes, "learned_bytes": a.learned_bytes,
                    "reserved_bytes": a.reserved_bytes,
                })).collect::<Vec<_>>(),
            })
        });
        return print_json(&Value::Array(each.collect()));
    }
    let rows: Vec<Vec<String>> =
        list.iter()
            .map(|w| {
                let (declared, reserved) = workload_totals(w);
                let pools: Vec<String> =
                    w.demand
                        .iter()
                        .map(|d| d.pool.clone())
                        .chain(w.any_of.iter().map(|a| {
                            format!("{}({} of {})", a.label, a.count, a.candidates.join("|"))
                        }))
                        .collect();
                vec![
                    w.name.clone(),
                    if w.aliases.is_empty() {
                        "-".into()
                    } else {
                        w.aliases.join(",")
                    },
                    w.role.clone(),
                    pools.join(","),
                    Gb(declared).to_string(),
                    if w.learned_bytes == 0 {
                        "-".into()
                    } else {
                        Gb(w.learned_bytes).to_string()
                    },
                    Gb(reserved).to_string(),
                ]
            })
            .collect();
    let header = [
        "WORKLOAD", "ALIASES", "ROLE", "POOLS", "DECLARED", "LEARNED", "RESERVED",
    ];
    table(&header, &rows)
}

/// One instance: its row, then what its server reported allocating
/// (device, kind, bytes), beside the reservation and the measurement.
pub fn instance(i: &pb::Instance, json: bool) -> io::Result<()> {
    instances(std::slice::from_ref(i), json)?;
    if json || i.server_buffers.is_empty() {
        return Ok(());
    }
    let total: u64 = i.server_buffers.iter().map(|b| b.bytes).sum();
    out!("");
    out!("its server reports {} in buffers:", Gb(total));
    let rows: Vec<Vec<String>> = i
        .server_buffers
        .iter()
        .map(|b| vec![b.device.clone(), b.kind.clone(), Gb(b.bytes).to_string()])
        .collect();
    table(&["DEVICE", "BUFFER", "BYTES"], &rows)
}

/// A started instance and who was evicted for it.
pub fn started(r: &pb::StartResponse, json: bool) -> io::Result<()> {
    if json {
        return print_json(&json!({
            "created": r.created,
            "slept": r.slept,
            "evicted": r.evicted,
            "instance": r.instance.as_ref().map(instance_json),
        }));
    }
    if !r.slept.is_empty() {
        out!("put to sleep: {}", r.slept.join(", "));
    }
    if !r.evicted.is_empty() {
        out!("evicted: {}", r.evicted.join(", "));
    }
    let woken = r
        .instance
        .as_ref()
        .is_some_and(|i| i.message.contains("WOKEN"));
    if woken {
        out!("woken (the same process, nothing started)");
    } else if !r.created {
        out!("already running (nothing started)");
    }
    instances(&r.instance.iter().cloned().collect::<Vec<_>>(), false)
}

/// Pools as a table.
fn pools(list: &[pb::PoolStatus]) -> io::Result<()> {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|p| {
            vec![
                p.name.clone(),
                gb_or_dash(p.budget_bytes),
                gb_or_dash(p.effective_budget_bytes),
                Gb(p.used_bytes).to_string(),
                gb_or_dash(p.free_bytes),
                gb_or_dash(p.available_bytes),
            ]
        })
        .collect();
    table(
        &["POOL", "BUDGET", "EFFECTIVE", "USED", "FREE", "AVAILABLE"],
        &rows,
    )
}

/// The node: pools, then instances.
pub fn node(n: &pb::NodeStatus, json: bool) -> io::Result<()> {
    if json {
        return print_json(&json!({
            "node": n.node,
            "version": n.version,
            "agent_pid": n.agent_pid,
            "pools": n.pools.iter().map(pool_json).collect::<Vec<_>>(),
            "instances": n.instances.iter().map(instance_json).collect::<Vec<_>>(),
        }));
    }
    out!(
        "node {} (residentd {}, pid {})\n",
        n.node,
        n.version,
        n.agent_pid
    );
    pools(&n.pools)?;
    out!();
    instances(&n.instances, false)
}

fn reasons(list: &[pb::Refusal]) -> io::Result<()> {
    for r in list {
        err!("  {}", r.message);
        let holders = match &r.reason {
            Some(pb::refusal::Reason::OverBudget(o)) => &o.holders,
            Some(pb::refusal::Reason::HostMemory(h)) => &h.holders,
            _ => continue,
        };
        for h in holders {
            err!("      {:<24} {:<16} {}", h.instance_id, h.role, Gb(h.bytes));
        }
    }
    Ok(())
}

/// A placement answer.
pub fn placement(p: &pb::Placement, json: bool) -> io::Result<()> {
    if json {
        return print_json(&json!({
            "admitted": p.admitted,
            "sleep": p.sleep,
            "evict": p.evict,
            "wait_for": p.wait_for,
            "refusals": p.refusals.iter().map(refusal_json).collect::<Vec<_>>(),
            "pools": p.pools.iter().map(pool_json).collect::<Vec<_>>(),
            "demand": demand_json(&p.demand),
            "free_after_bytes": p.free_after_bytes,
        }));
    }
    let pools: Vec<&str> = p.demand.iter().map(|d| d.pool.as_str()).collect();
    let on = if pools.is_empty() {
        String::new()
    } else {
        format!(" in {}", pools.join(", "))
    };
    let mut moves = Vec::new();
    if !p.sleep.is_empty() {
        moves.push(format!("putting {} to sleep", p.sleep.join(", ")));
    }
    if !p.evict.is_empty() {
        moves.push(format!("evicting {}", p.evict.join(", ")));
    }
    match (p.admitted, moves.is_empty()) {
        (true, true) => out!("fits{on}"),
        (true, false) => out!("fits{on} after {}", moves.join(", then ")),
        (false, _) => {
            err!("does not fit:");
            reasons(&p.refusals)?;
        }
    }
    Ok(())
}

/// A refused start: the reasons, readably (who holds what).
pub fn refusal(status: &tonic::Status, json: bool) -> io::Result<()> {
    let placement = tonic_types::pb::Status::decode(status.details())
        .ok()
        .and_then(|rpc| {
            rpc.details
                .into_iter()
                .find(|a| a.type_url.ends_with("/resident.v1.Placement"))
                .and_then(|a| pb::Placement::decode(a.value.as_slice()).ok())
        });
    if json {
        let refusals = placement
            .as_ref()
            .map(|p| p.refusals.iter().map(refusal_json).collect::<Vec<_>>());
        return print_json(&json!({ "refused": status.message(), "refusals": refusals }));
    }
    err!("refused:");
    match placement {
        Some(p) => reasons(&p.refusals)?,
        None => err!("  {}", status.message()),
    }
    Ok(())
}

/// A reload: the file read, and its warnings (on stderr).
pub fn reloaded(r: &pb::ReloadResponse, json: bool) -> io::Result<()> {
    if json {
        return print_json(&json!({ "config": r.config, "warnings": r.warnings }));
    }
    for w in &r.warnings {
        err!("residentctl: warning: {w}");
    }
    out!("reloaded {}", r.config);
    Ok(())
}

/// An upgrade: from which version to which.
pub fn upgraded(r: &pb::UpgradeResponse, json: bool) -> io::Result<()> {
    if json {
        return print_json(&json!({ "old_version": r.old_version, "new_version": r.new_version }));
    }
    out!("upgraded residentd {} -> {}", r.old_version, r.new_version);
    Ok(())
}

/// One log line, on stdout whichever stream it came from.
pub fn log_line(l: &pb::LogLine, json: bool) -> io::Result<()> {
    if json {
        let stream = pb::LogStream::try_from(l.stream).map_or("UNKNOWN", |s| s.as_str_name());
        return print_json(&json!({ "seq": l.seq, "stream": stream, "line": l.line }));
    }
    // Both streams go to stdout, so that `logs ID | grep` sees a server
    // that logs to stderr, as most do.
    out!("{}", l.line);
    Ok(())
}

/// The end of a followed log: how the instance's run ended, as the agent
/// reports it now (`None`: the agent no longer knows the instance).
pub fn log_end(id: &str, now: Option<&pb::Instance>) -> io::Result<()> {
    match now {
        Some(i) if i.state == pb::State::Exited as i32 => {
            err!("residentctl: instance {id} has exited ({})", i.message);
        }
        Some(i) if i.state == pb::State::Failed as i32 => {
            err!("residentctl: instance {id} has failed ({})", i.message);
        }
        Some(i) => err!(
            "residentctl: the log of instance {id} ended; it is {} ({})",
            state_name(i.state),
            i.message
        ),
        None => err!("residentctl: instance {id} has ended and is gone"),
    }
    Ok(())
}

/// One watch event.
pub fn event(e: &pb::Event, json: bool) -> io::Result<()> {
    let kind = pb::EventKind::try_from(e.kind).map_or("UNKNOWN", |k| k.as_str_name());
    if json {
        return print_json(&json!({
            "revision": e.revision,
            "kind": kind,
            "instance": e.instance.as_ref().map(instance_json),
            "refusal": e.refusal.as_ref().map(refusal_json),
            "workload": e.workload,
            "pool": e.pool,
            "message": e.message,
        }));
    }
    if !e.pool.is_empty() {
        out!(
            "{:>6} {:<10} pool {}: {}",
            e.revision,
            kind,
            e.pool,
            e.message
        );
        return Ok(());
    }
    match (&e.instance, &e.refusal) {
        (Some(i), _) => out!(
            "{:>6} {:<10} {:<24} {:<9} {}",
            e.revision,
            kind,
            i.instance_id,
            state_name(i.state),
            i.message
        ),
        (None, Some(r)) => out!("{:>6} {:<10} {}", e.revision, kind, r.message),
        (None, None) => out!("{:>6} {kind}", e.revision),
    }
    Ok(())
}

/// A bar of `width` cells: held (#), free (.), foreign (x).
fn bar(p: &pb::PoolStatus, width: usize) -> String {
    let Some(budget) = p
        .budget_bytes
        .or(p.effective_budget_bytes)
        .filter(|b| *b > 0)
    else {
        return format!("[{}] unbounded", " ".repeat(width));
    };
    let effective = p.effective_budget_bytes.unwrap_or(budget).min(budget);
    let cells = |bytes: u64| ((u128::from(bytes) * width as u128) / u128::from(budget)) as usize;
    let held = cells(p.used_bytes.min(budget)).min(width);
    let foreign = cells(budget - effective).min(width - held);
    let free = width - held - foreign;
    format!(
        "[{}{}{}]",
        "#".repeat(held),
        ".".repeat(free),
        "x".repeat(foreign)
    )
}

/// One frame of `residentctl top`: each pool as a bar, then instances.
pub fn top(n: &pb::NodeStatus) -> io::Result<()> {
    let mut stdout = io::stdout().lock();
    if stdout.is_terminal() {
        write!(stdout, "\x1b[2J\x1b[H")?;
    }
    drop(stdout);
    out!(
        "{} (residentd {})   # held  . free  x foreign",
        n.node,
        n.version
    );
    for p in &n.pools {
        out!(
            "{:<10} {} {} used of {} (effective {})",
            p.name,
            bar(p, 40),
            Gb(p.used_bytes),
            gb_or_dash(p.budget_bytes),
            gb_or_dash(p.effective_budget_bytes)
        );
    }
    out!();
    instances(&n.instances, false)?;
    io::stdout().flush()
}

/// A spinner on stderr while waiting, when stderr is a terminal.
pub struct Spinner {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Spinner {
    pub fn start(label: String) -> Self {
        if !io::stderr().is_terminal() {
            return Self {
                stop: None,
                thread: None,
            };
        }
        let (stop, rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let frames = ['|', '/', '-', '\\'];
            let mut n = 0;
            // Draws until told to stop (a message, or the sender dropped).
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                rx.recv_timeout(Duration::from_millis(100))
            {
                // Nothing to do if the terminal has gone.
                let mut stderr = io::stderr().lock();
                let _ = write!(stderr, "\r{} {label}", frames[n % frames.len()]);
                let _ = stderr.flush();
                n += 1;
            }
            let _ = write!(io::stderr(), "\r{}\r", " ".repeat(label.len() + 2));
        });
        Self {
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_show_held_free_and_foreign() {
        let pool = |budget, effective, used| pb::PoolStatus {
            name: "p".into(),
            budget_bytes: budget,
            effective_budget_bytes: effective,
            used_bytes: used,
            ..Default::default()
        };
        assert_eq!(bar(&pool(Some(100), Some(100), 50), 10), "[#####.....]");
        // A foreign process holds 30 of 100: the effective budget is 70.
        assert_eq!(bar(&pool(Some(100), Some(70), 20), 10), "[##.....xxx]");
        assert_eq!(bar(&pool(Some(100), Some(0), 0), 4), "[xxxx]");
        assert_eq!(bar(&pool(None, None, 5), 3), "[   ] unbounded");
    }
}
