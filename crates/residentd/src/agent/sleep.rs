//! Putting servers to sleep and waking them (`[workload.sleep]`): the
//! Sleep RPC, the planner's sleeps (a Start that makes room), idle sleeps,
//! wakes (a Start of a SLEEPING instance), and the sleeps and wakes a run
//! taken over was in the middle of (made again). Each is an HTTP call on the
//! instance's port, with the workload's timeout; the books hold the larger
//! of the two demands while it runs (`books/sleep.rs`). A call that fails,
//! times out or leaves the server not ready stops the instance
//! (SLEEP_FAILED): it is never left holding two demands, or none.

use std::sync::Arc;
use std::time::{Duration, Instant};

use resident_api::{ApiError, pb};
use resident_config::{HttpCall, Workload};
use resident_supervisor::State;

use resident_supervisor::Supervisor;

use super::books::{Books, Sleeper, Sleepy};
use super::durability::Durability;
use super::http::{get_json, http_call};
use super::kv::KvStore;
use super::parts::Parts;
use super::shared::{Clock, Current};
use super::stop::Stopper;
use super::tell::Teller;
use crate::metrics::Metrics;

/// The sleeps and wakes.
#[derive(Debug)]
pub(super) struct Sleeps {
    config: Current,
    books: Arc<Books>,
    sup: Supervisor,
    kv: Arc<KvStore>,
    durability: Arc<Durability>,
    metrics: Arc<Metrics>,
    teller: Arc<Teller>,
    stopper: Arc<Stopper>,
    clock: Clock,
}

impl Sleeps {
    /// The room, on the parts (and the rooms) it uses.
    pub(super) fn new(p: &Parts, teller: Arc<Teller>, stopper: Arc<Stopper>) -> Self {
        Self {
            config: p.config.clone(),
            books: p.books.clone(),
            sup: p.sup.clone(),
            kv: p.kv.clone(),
            durability: p.durability.clone(),
            metrics: p.metrics.clone(),
            teller,
            stopper,
            clock: p.clock,
        }
    }

    /// Puts `id` to sleep (the Sleep RPC); answers once it is SLEEPING.
    pub(super) async fn sleep(self: &Arc<Self>, id: &str) -> Result<pb::Instance, ApiError> {
        let ready = self.sup.status(id).is_some_and(|s| s.state == State::Ready);
        let by_itself = self
            .books
            .record(id)
            .and_then(|r| r.workload.sleep.as_ref().map(|s| s.sleep.is_none()))
            .unwrap_or(false);
        if by_itself {
            return Err(ApiError::FailedPrecondition(format!(
                "instance '{id}' sleeps by itself after its workload's sleep idle; it cannot be put to sleep"
            )));
        }
        if !ready {
            return Err(ApiError::FailedPrecondition(format!(
                "instance '{id}' is not READY: only a serving instance is put to sleep"
            )));
        }
        let sleeper = self.books.begin_sleep(id, None, self.clock.now_ms())?;
        // On a task of its own: a caller that goes away mid-call (a
        // deadline, Ctrl-C) must not leave the instance half asleep.
        let me = self.clone();
        tokio::spawn(async move { me.fall_asleep(&sleeper, "asked").await })
            .await
            .map_err(|e| ApiError::Internal(format!("the sleep task failed: {e}")))??;
        match self.books.record(id) {
            Some(record) => Ok(self.teller.view(id, &record)),
            None => Err(ApiError::NotFound(format!("no instance '{id}'"))),
        }
    }

    /// Makes the sleep call of `s`, marked falling asleep in the books,
    /// and settles it asleep; a failed call stops it. The journal says
    /// falling asleep before the call is made, and asleep before this
    /// returns (with `durable_answers`): a crash at any point leaves the
    /// next agent knowing where it stood.
    pub(super) async fn fall_asleep(
        self: &Arc<Self>,
        s: &Sleeper,
        why: &str,
    ) -> Result<(), ApiError> {
        self.teller.publish_view(&s.id);
        self.journal_move(&s.id).await;
        let Some((call, timeout, port)) = self.sleep_call(&s.id, s.generation, true) else {
            return Err(ApiError::NotFound(format!(
                "that run of instance '{}' has ended",
                s.id
            )));
        };
        // A server that sleeps by itself has fallen asleep already (the
        // agent read it): nothing to call.
        let called = match &call {
            Some(call) => {
                tracing::info!(instance_id = %s.id, why, %call, "putting to sleep");
                http_call(port, call, timeout).await.map(drop)
            }
            None => {
                tracing::info!(instance_id = %s.id, why, "fell asleep by itself");
                Ok(())
            }
        };
        let call = call.map_or_else(String::new, |c| c.to_string());
        match called {
            Ok(()) => {
                if !self
                    .books
                    .settle(&s.id, s.generation, Sleepy::Asleep(self.clock.now_ms()))
                {
                    return Err(ApiError::Aborted(format!(
                        "instance '{}' was stopped while it fell asleep",
                        s.id
                    )));
                }
                self.metrics.slept(&s.workload);
                self.teller.publish_view(&s.id);
                self.journal_now().await.map_err(|e| {
                    ApiError::Unavailable(format!(
                        "instance '{}' is asleep, but the journal does not say so: {e}",
                        s.id
                    ))
                })
            }
            Err(e) => {
                let text = format!("SLEEP_FAILED: its sleep call ({call}) {e}");
                self.sleep_failed(&s.id, s.generation, text.clone()).await;
                Err(ApiError::Internal(format!("instance '{}': {text}", s.id)))
            }
        }
    }

    /// Makes the wake call of run `generation` of `id`, marked waking in
    /// the books, waits for its readiness, and settles it awake; a failed
    /// wake stops it.
    pub(super) async fn wake_up(
        self: &Arc<Self>,
        id: &str,
        generation: u64,
        workload: &str,
    ) -> Result<(), ApiError> {
        let began = Instant::now();
        self.teller.publish_view(id);
        self.journal_move(id).await;
        let Some((call, timeout, port)) = self.sleep_call(id, generation, false) else {
            return Err(ApiError::NotFound(format!(
                "that run of instance '{id}' has ended"
            )));
        };
        let call = match call {
            Some(call) => {
                tracing::info!(instance_id = %id, %call, "waking");
                Some(call)
            }
            // It wakes by itself at the request the books admitted it for.
            None => None,
        };
        let path = self
            .books
            .record(id)
            .and_then(|r| match &r.workload.readiness {
                resident_supervisor::Readiness::Http { path } => Some(path.clone()),
                _ => None,
            });
        let woke = async {
            let Some(call) = &call else {
                return Ok(());
            };
            http_call(port, call, timeout).await?;
            if let Some(path) = path {
                ready_again(port, &path, timeout.saturating_sub(began.elapsed())).await?;
            }
            Ok::<_, String>(())
        };
        let woke = woke.await;
        if woke.is_ok() && call.is_none() {
            self.restore_after_sleep(id, generation, port).await;
        }
        match woke {
            Ok(()) => {
                let ms = u64::try_from(began.elapsed().as_millis()).unwrap_or(u64::MAX);
                if !self.books.settle(id, generation, Sleepy::Woken(ms)) {
                    return Err(ApiError::Aborted(format!(
                        "instance '{id}' was stopped while it woke"
                    )));
                }
                self.metrics.woke(workload, began.elapsed().as_secs_f64());
                self.teller.publish_view(id);
                self.journal_now().await.map_err(|e| {
                    ApiError::Unavailable(format!(
                        "instance '{id}' is awake, but the journal does not say so: {e}"
                    ))
                })
            }
            Err(e) => {
                let call = call.map_or_else(String::new, |c| c.to_string());
                let text = format!("SLEEP_FAILED: its wake call ({call}) {e}");
                self.sleep_failed(id, generation, text.clone()).await;
                Err(ApiError::Internal(format!("instance '{id}': {text}")))
            }
        }
    }

    /// A server that slept by itself lost its slots: one that keeps its
    /// conversations has them restored as it wakes (the restore call wakes
    /// it), before the request the wake was admitted for reaches it.
    async fn restore_after_sleep(self: &Arc<Self>, id: &str, generation: u64, port: u16) {
        let Some(record) = self.books.record(id).filter(|r| r.generation == generation) else {
            return;
        };
        if record.workload.keep_kv.is_none() {
            return;
        }
        self.kv
            .restore(id, &record.workload, port)
            .await
            .count(&self.metrics);
    }

    /// Has the journal written as the books stand now and, with
    /// `durable_answers`, waits until it is on disk (the answer that
    /// follows is then a promise a crash keeps).
    async fn journal_now(&self) -> Result<(), ApiError> {
        let durable = self.config.get().node.durable_answers;
        self.durability.commit(durable).await
    }

    /// The journal written with `id` falling asleep or waking, before its
    /// call is made; a failed write is said, and the call made anyway (the
    /// journal's state is reported as failing meanwhile).
    async fn journal_move(&self, id: &str) {
        if let Err(e) = self.journal_now().await {
            tracing::warn!(instance_id = id, error = %e, "the journal does not say the sleep or wake under way");
        }
    }

    /// The sleep (or wake) call of run `generation` of `id`, its timeout
    /// and the port it goes to; `None` when that run has ended or its
    /// workload cannot sleep.
    fn sleep_call(
        &self,
        id: &str,
        generation: u64,
        sleep: bool,
    ) -> Option<(Option<HttpCall>, Duration, u16)> {
        let record = self
            .books
            .record(id)
            .filter(|r| r.generation == generation)?;
        let s = record.workload.sleep.as_ref()?;
        let status = self.sup.status(id).filter(|s| s.generation == generation)?;
        let call = if sleep {
            s.sleep.clone()
        } else {
            s.wake.clone()
        };
        Some((call, s.timeout, status.port))
    }

    /// Stops run `generation` of `id` after a failed sleep or wake: its
    /// memory (the larger of its demands, held while the call ran) is
    /// released when its process group has exited.
    async fn sleep_failed(&self, id: &str, generation: u64, text: String) {
        tracing::warn!(instance_id = id, "{text}; stopping it");
        let cause = Some((pb::Cause::SleepFailed, text));
        if let Err(e) = self.stopper.stop(id, Some(generation), None, cause).await {
            tracing::warn!(instance_id = id, error = %e, "stopping after a failed sleep call");
        }
    }

    /// Makes again, on runs taken over from an agent that ended mid-way,
    /// the sleeps and wakes it was making (each `(id, run, Falling or
    /// Waking)`, admitted so: holding both demands): the sleeps first, side
    /// by side, then the wakes, so no wake takes memory back before a
    /// sleeper it made room with has let it go. Each call waits for its
    /// run to be READY; vLLM answers a sleep while asleep, or a wake while
    /// awake, as done, so the server and the books agree again. A run that
    /// ends first is stopped by its end (`died_asleep`); one whose workload
    /// no longer sleeps, or whose call fails, is stopped (SLEEP_FAILED).
    pub(super) async fn finish_moves(self: Arc<Self>, moves: Vec<(String, u64, Sleepy)>) {
        let (falls, wakes): (Vec<_>, Vec<_>) = moves
            .into_iter()
            .partition(|(_, _, s)| matches!(s, Sleepy::Falling));
        for batch in [falls, wakes] {
            let mut calls = tokio::task::JoinSet::new();
            for (id, generation, to) in batch {
                let me = self.clone();
                calls.spawn(async move { me.finish_move(&id, generation, to).await });
            }
            while calls.join_next().await.is_some() {}
        }
    }

    async fn finish_move(self: &Arc<Self>, id: &str, generation: u64, to: Sleepy) {
        let ready = self
            .sup
            .wait_for(id, |s| {
                s.generation != generation || s.state == State::Ready || s.state.is_terminal()
            })
            .await
            .is_some_and(|s| s.generation == generation && s.state == State::Ready);
        let Some(record) = self.books.record(id).filter(|r| r.generation == generation) else {
            return;
        };
        if !ready {
            return;
        }
        let workload = record.workload.spec.workload.to_string();
        let done = if record.workload.sleep.is_none() {
            let text = "SLEEP_FAILED: its sleep or wake was under way when the agent ended, and its workload no longer sleeps".to_string();
            self.sleep_failed(id, generation, text).await;
            return;
        } else if matches!(to, Sleepy::Falling) {
            let sleeper = Sleeper {
                id: id.to_string(),
                generation,
                workload,
            };
            self.fall_asleep(&sleeper, "taken over falling asleep")
                .await
        } else {
            self.wake_up(id, generation, &workload).await
        };
        match done {
            Ok(()) => tracing::info!(instance_id = id, ?to, "finished the move taken over"),
            Err(e) => {
                tracing::warn!(instance_id = id, ?to, error = %e, "the move taken over did not finish")
            }
        }
    }

    /// Puts to sleep the instances unused for longer than their workload's
    /// sleep `idle`. Runs every second with the idle TTLs. One whose asleep
    /// demand does not fit (a vLLM level-1 server's weights, with no room
    /// in host memory) is stopped instead, as its idle time would have
    /// stopped it without sleep, its message saying why.
    pub(super) fn sleep_idle(self: &Arc<Self>) {
        self.follow_sleepers();
        for (id, run) in self.books.sleepy(self.clock.now_ms()) {
            let ready = self
                .sup
                .status(&id)
                .is_some_and(|s| s.generation == run && s.state == State::Ready);
            if !ready {
                continue;
            }
            let me = self.clone();
            match self.books.begin_sleep(&id, Some(run), self.clock.now_ms()) {
                Ok(sleeper) => {
                    tokio::spawn(async move { me.fall_asleep(&sleeper, "idle").await });
                }
                Err(ApiError::Refused { refusal, .. }) => {
                    let text = format!(
                        "stopped after its sleep idle: asleep it does not fit ({})",
                        refusal.first()
                    );
                    tracing::info!(instance_id = %id, "{text}");
                    let cause = Some((pb::Cause::Idle, text));
                    tokio::spawn(async move { me.stopper.stop(&id, Some(run), None, cause).await });
                }
                Err(_) => {}
            }
        }
    }
}

impl Sleeps {
    /// Reads, for each READY instance of a workload that sleeps by itself
    /// (`follow`: llama-server's `/props`), whether its server sleeps now,
    /// and follows it in the books: asleep, its asleep demand held; awake
    /// again (a request that reached it directly, not through a Start),
    /// its awake demand held again.
    fn follow_sleepers(self: &Arc<Self>) {
        let followed = self.books.followed();
        self.kv.forget_runs(|id, generation| {
            followed
                .iter()
                .any(|(i, r)| i == id && r.generation == generation)
        });
        for (id, record) in followed {
            let Some((path, idle_ms)) = record.workload.sleep.as_ref().and_then(|s| {
                let idle_ms = s
                    .idle
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                Some((s.follow.clone()?, idle_ms))
            }) else {
                continue;
            };
            let Some(status) = self
                .sup
                .status(&id)
                .filter(|s| s.generation == record.generation && s.state == State::Ready)
            else {
                continue;
            };
            if record.cancelled || matches!(record.sleep, Some(Sleepy::Falling | Sleepy::Waking)) {
                continue;
            }
            let me = self.clone();
            let asleep_now = matches!(record.sleep, Some(Sleepy::Asleep(_)));
            let (workload, generation, port) = (
                record.workload.spec.workload.to_string(),
                record.generation,
                status.port,
            );
            let w = record.workload.clone();
            tokio::spawn(async move {
                let get = HttpCall {
                    method: "GET".to_string(),
                    path,
                };
                let Ok(body) = http_call(port, &get, Duration::from_secs(2)).await else {
                    return;
                };
                let Some(sleeping) = is_sleeping(&body) else {
                    return;
                };
                // Held, or used within its idle time (a wake the books
                // admitted whose request has not reached it yet): not
                // asleep for long, whatever it says now.
                let quiet = me.books.quiet(&id, me.clock.now_ms(), idle_ms);
                if sleeping && !asleep_now && quiet {
                    me.fell_asleep_by_itself(&id, generation, &workload).await;
                } else if !sleeping && asleep_now {
                    me.woke_by_itself(&id, generation, &workload).await;
                } else if !sleeping {
                    me.save_before_sleep(&id, generation, &w, port).await;
                }
            });
        }
    }

    /// A server that keeps its conversations and sleeps by itself saves
    /// them once it has been quiet for its workload's `save_quiet` (read
    /// from its `/metrics`, which does not restart its idle timer) with
    /// something new since the last save; the save restarts its timer,
    /// and it sleeps the rest of its idle time after.
    async fn save_before_sleep(&self, id: &str, generation: u64, w: &Workload, port: u16) {
        let Some(after) = w.keep_kv.as_ref().and_then(|k| k.save_quiet) else {
            return;
        };
        let Ok(page) = get_json(port, "/metrics", Duration::from_secs(2)).await else {
            return;
        };
        if !self
            .kv
            .save_due(id, generation, activity(&page), Instant::now(), after)
        {
            return;
        }
        tracing::info!(instance_id = %id, "quiet ahead of its sleep: saving its conversations");
        self.kv.save(id, w, port).await.count(&self.metrics);
    }

    /// Follows a server that fell asleep by itself: settled asleep in the
    /// books (planned as a sleep where its asleep demand is larger; one
    /// that does not fit is stopped, as its idle time would have stopped
    /// it without sleep).
    async fn fell_asleep_by_itself(self: &Arc<Self>, id: &str, generation: u64, workload: &str) {
        match self.books.fell_asleep(id, generation, self.clock.now_ms()) {
            Ok(true) => {
                tracing::info!(instance_id = %id, %workload, "fell asleep by itself");
                self.metrics.slept(workload);
                self.teller.publish_view(id);
                self.durability.change();
            }
            Ok(false) => {}
            Err(ApiError::Refused { refusal, .. }) => {
                let text = format!(
                    "stopped: it fell asleep by itself, and asleep it does not fit ({})",
                    refusal.first()
                );
                tracing::warn!(instance_id = %id, "{text}");
                let cause = Some((pb::Cause::Idle, text));
                let _ = self.stopper.stop(id, Some(generation), None, cause).await;
            }
            Err(e) => {
                tracing::warn!(instance_id = %id, error = %e, "following a server that fell asleep")
            }
        }
    }

    /// Follows a server that woke by itself (a request reached it
    /// directly, not through a Start): its wake planned under refuse; one
    /// whose awake demand does not fit is stopped (OVERRUN: the memory it
    /// takes is not there).
    async fn woke_by_itself(self: &Arc<Self>, id: &str, generation: u64, workload: &str) {
        let Ok(iid) = resident_core::InstanceId::new(id) else {
            return;
        };
        match self
            .books
            .woke_by_itself(&iid, generation, self.clock.now_ms())
        {
            Ok(true) => {
                tracing::warn!(instance_id = %id, %workload, "woke by itself (a request reached it directly, not through a Start): its awake demand is held again");
                self.metrics.woke(workload, 0.0);
                self.durability.change();
                self.teller.publish_view(id);
            }
            Ok(false) => {}
            Err(ApiError::Refused { refusal, .. }) => {
                let text = format!(
                    "OVERRUN: it woke by itself (a request reached it directly), and awake it does not fit ({})",
                    refusal.first()
                );
                tracing::warn!(instance_id = %id, "{text}; stopping it");
                let cause = Some((pb::Cause::Overrun, text));
                let _ = self.stopper.stop(id, Some(generation), None, cause).await;
            }
            Err(e) => {
                tracing::warn!(instance_id = %id, error = %e, "following a server that woke by itself")
            }
        }
    }
}

/// What changes on llama-server's `/metrics` page while it works: its
/// decode calls, cached prompt tokens, and requests in progress or
/// deferred.
fn activity(page: &str) -> String {
    const SEEN: [&str; 4] = [
        "llamacpp:n_decode_total ",
        "llamacpp:prompt_tokens_cached_total ",
        "llamacpp:requests_processing ",
        "llamacpp:requests_deferred ",
    ];
    page.lines()
        .filter(|l| SEEN.iter().any(|s| l.starts_with(s)))
        .collect::<Vec<_>>()
        .join(";")
}

/// `"is_sleeping": true|false` in a JSON body (llama-server's `/props`).
fn is_sleeping(body: &str) -> Option<bool> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    v.get("is_sleeping")?.as_bool()
}

/// Waits until `GET path` answers 2xx on `port`, for at most `within`.
async fn ready_again(port: u16, path: &str, within: Duration) -> Result<(), String> {
    let get = HttpCall {
        method: "GET".to_string(),
        path: path.to_string(),
    };
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match http_call(port, &get, left.min(Duration::from_secs(2))).await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!(
                    "woke, but its readiness ({get}) never answered: {e}"
                ));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}
