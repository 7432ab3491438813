//! The agent's journal: what should be running, written at every change,
//! and restored after a restart.
//!
//! Answers are durable: every change takes a number (`persist`), and a
//! Start or Stop answers only once a journal write that began after its
//! change has reached the disk (`durable`); the numbering, group commit
//! and waiting are `durability.rs`'s, what the journal holds (the books'
//! rows, each run's group) is composed here; a write appends only what
//! changed (`journal.rs`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use resident_api::ApiError;
use resident_core::{InstanceId, Policy};

use super::Agent;
use super::books::Sleepy;
use crate::journal;

impl Agent {
    /// After a restart: admits the journaled instances again in their
    /// original order (PENDING, memory reserved) and returns, so the agent
    /// serves at once; each is then taken over or spawned in a task of its
    /// own. With `instances_outlive_agent`, a run the previous agent left
    /// running (the same pid and start time, its port journaled) is taken
    /// over, never restarted; one that ended meanwhile goes by its restart
    /// policy. What else the previous run left behind (recorded process
    /// groups, checked against pid reuse) is killed first. Adopted ones
    /// are never killed: adopted again when the same process still runs.
    /// Instances that no longer fit, or whose workload left the roster,
    /// are reported and dropped (a process left running for one is
    /// stopped).
    pub async fn restore(self: &Arc<Self>) {
        // The journal, which of its runs still run (to take over), and
        // what else the previous run left (killed): read and done on a
        // blocking thread.
        let me = self.clone();
        let outlive = self.config().node.instances_outlive_agent;
        let (found, taken, killed) = tokio::task::spawn_blocking(move || {
            let found = me.durability.journal().read();
            let (taken, others): (Vec<_>, Vec<_>) = found
                .entries
                .iter()
                .cloned()
                .partition(|e| outlive && taken_over(e).is_some_and(|p| still_runs(&p)));
            let killed = journal::kill_leftovers(&others);
            (found, taken, killed)
        })
        .await
        .unwrap_or_default();
        self.books.set_learned(found.learned);
        let entries = found.entries;
        if entries.is_empty() {
            self.take_holds();
            self.sup.clear_dead_agents();
            return;
        }
        tracing::info!(
            instances = entries.len(),
            taking_over = taken.len(),
            killed,
            "restoring journaled instances"
        );
        // First every instance is admitted (PENDING, its memory reserved,
        // so no new start can take it) and every adoption taken back; the
        // agent then serves while the instances are spawned side by side.
        let mut admitted = Vec::new();
        // Runs taken over falling asleep come last: each is planned for
        // its asleep demand (nothing counts on its memory until its sleep
        // is made again), so a run waking beside it, admitted first,
        // finds the room the interrupted swap was making.
        let (falling, rest): (Vec<_>, Vec<_>) = entries.into_iter().partition(|e| {
            e.sleep == journal::Slumber::Falling && taken.iter().any(|t| t.instance == e.instance)
        });
        for e in rest.into_iter().chain(falling) {
            let Ok(id) = InstanceId::new(e.instance.as_str()) else {
                continue;
            };
            if let Some(a) = e.adopted {
                self.readopt(&e, id, a).await;
                continue;
            }
            let (workload, policy) = (&e.workload, Some(Policy::Refuse));
            // A restored lease runs afresh from now: its owner has had no
            // agent to renew it with.
            let answer = super::admission::Answer::Prompt;
            let process = taken_over(&e).filter(|_| outlive);
            // Its process sleeps on (admitted with its asleep demand, it
            // stays SLEEPING), or its sleep or wake was under way (it holds
            // both demands until `finish_moves` makes the call again); a
            // run taken over holds the pools it was given.
            let as_it_was = match e.sleep {
                journal::Slumber::Awake => None,
                journal::Slumber::Asleep => Some(Sleepy::Asleep(self.now_ms())),
                journal::Slumber::Falling => Some(Sleepy::Falling),
                journal::Slumber::Waking => Some(Sleepy::Waking),
            };
            let taken = process.map(|_| super::admission::TakenOver {
                chosen: &e.chosen,
                as_it_was,
            });
            let restored = self
                .admit_start(
                    workload,
                    Some(id),
                    policy,
                    false,
                    e.lease_ms,
                    answer,
                    taken.as_ref(),
                )
                .await;
            match restored {
                Ok(super::admission::Admission::New(request, a)) => {
                    let request = match process {
                        Some(p) => request.taking_over(p),
                        None => request,
                    };
                    admitted.push((e, request, a, process.is_some()));
                }
                Ok(super::admission::Admission::Existing(_)) => {}
                Err(err) => {
                    tracing::warn!(
                        instance_id = %e.instance, workload = %e.workload, error = %err,
                        "a journaled instance could not be restored"
                    );
                    if process.is_some() {
                        journal::kill_leftovers(std::slice::from_ref(&e));
                    }
                }
            }
        }
        self.persist();
        self.take_holds();
        // Every process taken over has its run (and its cgroup) by now
        // (taken-over runs are launched below, before any other spawn);
        // what else dead agents left in cgroups can go.
        let me = self.clone();
        tokio::spawn(async move {
            // What the previous run left of the journaled groups is gone
            // (bounded) before their new runs start: one scan of the
            // process table per round for all of them; a zombie holds no
            // memory and does not count.
            let groups: std::collections::HashSet<i32> = admitted
                .iter()
                .filter(|(e, _, _, taken)| e.pgid > 1 && !taken)
                .map(|(e, _, _, _)| e.pgid)
                .collect();
            // Processes taken over first: their runs exist (and their
            // cgroups are known) once each launch has answered.
            let (first, rest): (Vec<_>, Vec<_>) =
                admitted.into_iter().partition(|(_, _, _, taken)| *taken);
            let mut launches = tokio::task::JoinSet::new();
            for (e, request, a, _) in first {
                let me = me.clone();
                launches.spawn(async move { me.restored(e, request, a).await });
            }
            let mut moves = Vec::new();
            while let Some(launched) = launches.join_next().await {
                moves.extend(launched.ok().flatten());
            }
            // Sleeps and wakes that were under way are made again on a
            // task of their own: the rest of the restore goes on.
            let mover = me.clone();
            tokio::spawn(async move { mover.finish_moves(moves).await });
            me.sup.clear_dead_agents();
            let deadline = Instant::now() + Duration::from_secs(5);
            let groups = Arc::new(groups);
            while !groups.is_empty() && Instant::now() < deadline {
                let scanned = groups.clone();
                let left = tokio::task::spawn_blocking(move || groups_left(&scanned))
                    .await
                    .unwrap_or(false);
                if !left {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            for (e, request, a, _) in rest {
                let me = me.clone();
                tokio::spawn(async move { me.restored(e, request, a).await });
            }
        });
    }

    /// Carries out one restored admission, saying how it went. A run
    /// taken over whose sleep or wake was under way (admitted so) comes
    /// back as a move to make again: its id, run and which.
    async fn restored(
        self: Arc<Self>,
        e: journal::Entry,
        request: super::admission::Request,
        a: super::books::Admitted,
    ) -> Option<(String, u64, Sleepy)> {
        let generation = a.generation;
        match self.clone().carry_out(request, a).await {
            Ok(_) => {
                tracing::info!(instance_id = %e.instance, workload = %e.workload, pid = e.pgid, "restored");
                let moving = self.books.record(&e.instance).and_then(|r| {
                    (r.generation == generation)
                        .then_some(r.sleep)
                        .flatten()
                        .filter(|s| matches!(s, Sleepy::Falling | Sleepy::Waking))
                });
                moving.map(|s| (e.instance, generation, s))
            }
            Err(err) => {
                tracing::warn!(
                    instance_id = %e.instance, workload = %e.workload, error = %err,
                    "a journaled instance could not be restored"
                );
                None
            }
        }
    }

    /// Adopts a journaled adoption again if its process (the same pid and
    /// start time) still runs.
    async fn readopt(self: &Arc<Self>, e: &journal::Entry, id: InstanceId, a: journal::Adopted) {
        let call = super::AdoptCall {
            workload: e.workload.clone(),
            id,
            pid: u32::try_from(e.pgid).unwrap_or(0),
            manage: a.manage,
            port: a.port,
            // Authorized when it was first adopted.
            admin: true,
        };
        let answer = super::admission::Answer::Prompt;
        match self
            .adopt_answering(call, Some(e.start_ticks), answer)
            .await
        {
            Ok(_) => {
                tracing::info!(instance_id = %e.instance, pid = e.pgid, "adopted again")
            }
            Err(err) => tracing::warn!(
                instance_id = %e.instance, pid = e.pgid, error = %err,
                "a journaled adoption was not adopted again"
            ),
        }
    }

    /// After a restore: the holds the agent an upgrade replaced handed
    /// over, each for what was left of it.
    fn take_holds(&self) {
        let dir = self.config().node.state_dir.clone();
        for (id, ms) in super::upgrade::handed_holds(&dir) {
            self.books.touch(&id, self.now_ms(), super::Hold::For(ms));
        }
    }

    /// Numbers a change the journal must record and has the writer write
    /// it (`durability.rs`); once shutdown has begun the journal stays as
    /// shutdown wrote it.
    pub(super) fn persist(&self) -> u64 {
        self.durability.change()
    }

    /// Why the last journal write failed, while it has not succeeded since.
    pub(super) fn journal_failing(&self) -> Option<String> {
        self.durability.failing()
    }

    /// Waits until the journal on disk holds change `change` (and every
    /// earlier one). Err when the write failed or the agent is shutting
    /// down before it could be made.
    pub(super) async fn durable(&self, change: u64) -> Result<(), ApiError> {
        self.durability.settled(change, self.closing()).await
    }

    /// Writes the journal now (blocking: it fsyncs): what the books hold,
    /// with each run's group. Once sealed only the sealing write (at
    /// shutdown, at a hand-over) goes through.
    pub(super) fn write_journal_now(&self, sealing: bool) {
        let rows = || (self.journal_entries(), self.books.learned_rows());
        if let Some(ok) = self.durability.write(sealing, rows) {
            self.metrics().journal_written(ok);
        }
    }

    /// What the journal should hold now: resident instances no Stop or
    /// eviction asked for, in admission order, with their running group.
    /// The books are read under their lock; the process table after it is
    /// released. Reads /proc: called by the journal writer, on a blocking
    /// thread.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn journal_entries(&self) -> Vec<journal::Entry> {
        let live = self.books.journal_rows();
        // A group's start time comes from its spawn; when the spawn could
        // not tell, it is read from /proc once per process, not at every
        // write: a storm of starts writes often. Called only by the one
        // journal writer.
        let mut known = self.start_ticks.lock();
        // Ended runs' readings go now and then, not at every write.
        if known.len() > 2 * live.len() + 64 {
            let ids: std::collections::HashSet<&str> = live.iter().map(|r| r.id.as_str()).collect();
            known.retain(|id, _| ids.contains(id.as_str()));
        }
        live.into_iter()
            .map(|row| {
                let (id, generation) = (row.id, row.generation);
                let run = self.sup.pid(&id, generation);
                let (pid, spawned_at, port, restarts) = match run {
                    Some(r) => (r.pid as i32, r.start_ticks, r.port, r.restarts),
                    None => (0, None, 0, 0),
                };
                // Kept for the run and its pid, so a reused pid is read anew.
                let start_ticks = match (known.get(id.as_str()), spawned_at) {
                    // Known from the spawn itself: the child's /proc entry
                    // is never looked up.
                    (_, Some(ticks)) if pid > 0 => ticks,
                    (Some(t), _) if (t.generation, t.pid) == (generation, pid) => t.ticks,
                    // No group yet (not spawned, or between runs): nothing
                    // to read.
                    _ if pid <= 0 => 0,
                    _ => {
                        let ticks =
                            resident_supervisor::procfs::stat(pid).map_or(0, |s| s.start_ticks);
                        if ticks > 0 {
                            let t = Ticks {
                                generation,
                                pid,
                                ticks,
                            };
                            known.insert(id.clone(), t);
                        }
                        ticks
                    }
                };
                match row.adopted {
                    // Its own pid and start time, whatever its state.
                    Some(a) => journal::Entry {
                        instance: id,
                        workload: row.workload,
                        pgid: a.pid as i32,
                        start_ticks: a.start_ticks,
                        lease_ms: 0,
                        adopted: Some(journal::Adopted {
                            manage: a.manage,
                            port: a.port,
                        }),
                        port: a.port,
                        restarts: 0,
                        chosen: Vec::new(),
                        sleep: journal::Slumber::Awake,
                    },
                    None => journal::Entry {
                        instance: id,
                        workload: row.workload,
                        pgid: pid,
                        start_ticks,
                        lease_ms: row.lease_ms,
                        adopted: None,
                        port,
                        restarts,
                        chosen: row.chosen,
                        sleep: row.sleep,
                    },
                }
            })
            .collect()
    }
}

/// The process a journaled spawned run left, as a takeover names it: only
/// a run whose port was journaled (format 5 on) can be taken over.
fn taken_over(e: &journal::Entry) -> Option<resident_supervisor::TakeOver> {
    let pid = u32::try_from(e.pgid).ok().filter(|p| *p > 1)?;
    (e.adopted.is_none() && e.port != 0 && e.start_ticks != 0).then_some(
        resident_supervisor::TakeOver {
            pid,
            start_ticks: e.start_ticks,
            port: e.port,
            restarts: e.restarts,
        },
    )
}

/// Whether a process of `groups` (process group ids) is alive (a zombie
/// holds no memory). Walks /proc: on a blocking thread.
#[allow(clippy::disallowed_methods)]
fn groups_left(groups: &std::collections::HashSet<i32>) -> bool {
    resident_supervisor::procfs::scan()
        .iter()
        .any(|p| p.state != 'Z' && groups.contains(&p.pgrp))
}

/// Whether the process is still the one journaled (pid and start time).
/// Reads /proc: on a blocking thread.
#[allow(clippy::disallowed_methods)]
fn still_runs(p: &resident_supervisor::TakeOver) -> bool {
    let pid = i32::try_from(p.pid).unwrap_or(0);
    resident_supervisor::procfs::stat(pid)
        .is_some_and(|s| s.start_ticks == p.start_ticks && s.state != 'Z')
}

/// The start time of a journaled run's group leader, read once per run
/// and pid.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ticks {
    generation: u64,
    pid: i32,
    ticks: u64,
}

/// Rewrites the journal whenever it is marked out of date, on a blocking
/// thread (the write fsyncs). Changes made during a write are all taken
/// by the next one.
pub(super) async fn write_journal(agent: std::sync::Weak<Agent>) {
    loop {
        let Some(strong) = agent.upgrade() else {
            return;
        };
        let notified = async {
            strong.durability.dirtied().await;
        };
        // Wake now and then, to notice when the agent is gone.
        let wait = tokio::time::timeout(Duration::from_secs(10), notified);
        if wait.await.is_err() {
            drop(strong);
            continue;
        }
        let writer = strong.clone();
        let _ = tokio::task::spawn_blocking(move || writer.write_journal_now(false)).await;
    }
}
