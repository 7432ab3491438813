//! The restore after a restart or an upgrade: the journal read, what the
//! previous agent left behind killed, every journaled instance admitted
//! again (PENDING, its memory reserved) and then taken over or spawned,
//! adoptions taken back, the sleeps and wakes under way made again, and
//! the holds handed over taken.

use std::sync::Arc;
use std::time::{Duration, Instant};

use resident_core::{InstanceId, Policy};
use resident_supervisor::Supervisor;

use super::admission::{Admission, Admissions, Answer, Request, TakenOver};
use super::adoption::AdoptCall;
use super::books::{Admitted, Books, Hold, Sleepy};
use super::durability::Durability;
use super::parts::Parts;
use super::shared::{Clock, Current};
use super::sleep::Sleeps;
use crate::journal;

/// The restorer.
#[derive(Debug)]
pub(super) struct Restorer {
    config: Current,
    books: Arc<Books>,
    sup: Supervisor,
    durability: Arc<Durability>,
    admissions: Arc<Admissions>,
    sleeps: Arc<Sleeps>,
    clock: Clock,
}

impl Restorer {
    /// The room, on the parts (and the rooms) it uses.
    pub(super) fn new(p: &Parts, admissions: Arc<Admissions>, sleeps: Arc<Sleeps>) -> Self {
        Self {
            config: p.config.clone(),
            books: p.books.clone(),
            sup: p.sup.clone(),
            durability: p.durability.clone(),
            admissions,
            sleeps,
            clock: p.clock,
        }
    }

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
    pub(super) async fn restore(self: &Arc<Self>) {
        // The journal, which of its runs still run (to take over), and
        // what else the previous run left (killed): read and done on a
        // blocking thread.
        let me = self.clone();
        let outlive = self.config.get().node.instances_outlive_agent;
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
            let answer = Answer::Prompt;
            let process = taken_over(&e).filter(|_| outlive);
            // Its process sleeps on (admitted with its asleep demand, it
            // stays SLEEPING), or its sleep or wake was under way (it holds
            // both demands until `finish_moves` makes the call again); a
            // run taken over holds the pools it was given.
            let as_it_was = match e.sleep {
                journal::Slumber::Awake => None,
                journal::Slumber::Asleep => Some(Sleepy::Asleep(self.clock.now_ms())),
                journal::Slumber::Falling => Some(Sleepy::Falling),
                journal::Slumber::Waking => Some(Sleepy::Waking),
            };
            let taken = process.map(|_| TakenOver {
                chosen: &e.chosen,
                as_it_was,
            });
            let restored = self
                .admissions
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
                Ok(Admission::New(request, a)) => {
                    let request = match process {
                        Some(p) => request.taking_over(p),
                        None => request,
                    };
                    admitted.push((e, request, a, process.is_some()));
                }
                Ok(Admission::Existing(_)) => {}
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
        self.durability.change();
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
            let sleeps = me.sleeps.clone();
            tokio::spawn(async move { sleeps.finish_moves(moves).await });
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
        request: Request,
        a: Admitted,
    ) -> Option<(String, u64, Sleepy)> {
        let generation = a.generation;
        match self.admissions.clone().carry_out(request, a).await {
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
        let call = AdoptCall {
            workload: e.workload.clone(),
            id,
            pid: u32::try_from(e.pgid).unwrap_or(0),
            manage: a.manage,
            port: a.port,
            // Authorized when it was first adopted.
            admin: true,
        };
        let answer = Answer::Prompt;
        match self
            .admissions
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
        let dir = self.config.get().node.state_dir.clone();
        for (id, ms) in super::upgrade::handed_holds(&dir) {
            self.books.touch(&id, self.clock.now_ms(), Hold::For(ms));
        }
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
