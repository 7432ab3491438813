//! The agent's part of an upgrade (`Upgrade`, SIGUSR2; the process side is
//! `crate::upgrade`): changes refused while it runs, the new binary
//! checked, every instance handed over (the supervisor lets each process
//! run on; the journal and the event history are written for the next
//! agent), the next agent started, and this one's end: it exits once the
//! next one serves, or executes itself afresh when it did not start.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use resident_api::{ApiError, pb};

use super::Agent;

/// Where an upgrade stands, in the order it goes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Stage {
    /// No upgrade.
    #[default]
    Idle,
    /// The new binary is being checked: changes are refused.
    Checking,
    /// Everything is being handed over: the listeners stop accepting.
    HandingOver,
    /// The next agent serves.
    Upgraded,
}

/// Starts admitted before the upgrade began get this long to be spawned.
const SETTLE_BOUND: Duration = Duration::from_secs(30);
/// The supervisor's actors get this long to let their processes go.
const HAND_OVER_BOUND: Duration = Duration::from_secs(10);

/// Where the event history waits for the next agent, in the state
/// directory.
pub(super) const EVENTS_FILE: &str = "events.handover";

/// Where the holds in force wait for the next agent, in the state
/// directory: `ID<TAB>MS` lines.
const HOLDS_FILE: &str = "holds.handover";

impl Agent {
    /// After a restore: the holds the agent an upgrade replaced handed
    /// over, each for what was left of it (the file is removed).
    pub(super) fn take_holds(&self) {
        let dir = self.config().node.state_dir.clone();
        let Ok(bytes) = crate::state_files::read(&dir, HOLDS_FILE) else {
            return;
        };
        crate::state_files::remove(&dir, HOLDS_FILE);
        let text = String::from_utf8_lossy(&bytes);
        for line in text.lines() {
            let Some((id, ms)) = line.split_once('\t') else {
                continue;
            };
            if let Ok(ms) = ms.parse::<u64>() {
                self.books.touch(id, self.now_ms(), super::Hold::For(ms));
            }
        }
    }

    /// Whether an upgrade is under way (changes are refused meanwhile).
    pub fn upgrading(&self) -> bool {
        *self.upgrade.borrow() != Stage::Idle
    }

    /// Resolves once an upgrade has begun to hand everything over.
    pub fn handing_over(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.upgrade.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s >= Stage::HandingOver).await;
        }
    }

    /// Resolves once the next agent serves.
    pub fn upgraded(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.upgrade.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s == Stage::Upgraded).await;
        }
    }

    /// Replaces this agent with the binary now at its path, without
    /// stopping an instance. Answers once the next agent serves.
    /// FAILED_PRECONDITION when the new binary fails its check (nothing
    /// changed); INTERNAL when it did not start: this agent then executes
    /// itself afresh and takes everything over again.
    pub async fn upgrade(self: Arc<Self>) -> Result<pb::UpgradeResponse, ApiError> {
        let old_version = env!("CARGO_PKG_VERSION").to_string();
        if !self.config().node.instances_outlive_agent {
            return Err(ApiError::FailedPrecondition(
                "instances_outlive_agent = false: every instance would die with this agent; restart it instead".into(),
            ));
        }
        let began = self.upgrade.send_if_modified(|s| {
            let idle = *s == Stage::Idle;
            if idle {
                *s = Stage::Checking;
            }
            idle
        });
        if !began {
            return Err(ApiError::Unavailable(
                "an upgrade is already under way".into(),
            ));
        }
        let back = |e: ApiError| {
            self.upgrade.send_replace(Stage::Idle);
            Err(e)
        };
        let new_version = match crate::upgrade::check_next().await {
            Ok(v) => v,
            Err(why) => {
                return back(ApiError::FailedPrecondition(format!(
                    "the new binary was not started: {why}; nothing changed"
                )));
            }
        };
        tracing::info!(old = %old_version, new = %new_version, "upgrading: the new binary passed its check");
        // Starts admitted before changes were refused are spawned first,
        // so the journal names every process.
        let deadline = Instant::now() + SETTLE_BOUND;
        while self
            .list()
            .iter()
            .any(|i| i.state == pb::State::Pending as i32)
        {
            if Instant::now() >= deadline {
                return back(ApiError::Unavailable(
                    "starts are still under way; try the upgrade again".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // From here on this process image ends: the next agent serves, or
        // this one runs afresh.
        self.upgrade.send_replace(Stage::HandingOver);
        // Nothing the agent decides by itself (an idle sleep or stop, a
        // lease's expiry) begins after the journal below.
        self.books.close();
        self.closing.store(true, Ordering::Release);
        self.durability.seal();
        self.closed.send_replace(true);
        self.sup.hand_over(HAND_OVER_BOUND).await;
        let me = self.clone();
        let _ = tokio::task::spawn_blocking(move || me.write_journal_now(true)).await;
        let state_dir = self.config().node.state_dir.clone();
        if let Err(e) = self.events.save(&state_dir, EVENTS_FILE) {
            tracing::warn!(error = %e, "cannot hand the event history over; watchers will list again");
        }
        let holds: String = self
            .books
            .holds(self.now_ms())
            .into_iter()
            .map(|(id, ms)| format!("{id}\t{ms}\n"))
            .collect();
        if let Err(e) = crate::state_files::write_new(&state_dir, HOLDS_FILE, holds.as_bytes()) {
            tracing::warn!(error = %e, "cannot hand the holds over; their holders renew them");
        }
        tracing::info!("every instance handed over; starting the new binary");
        match crate::upgrade::start_next().await {
            Ok(next) => {
                crate::upgrade::hand_main_pid(next.pid);
                self.upgrade.send_replace(Stage::Upgraded);
                tracing::info!(pid = next.pid, version = %next.version, "the upgraded agent serves");
                Ok(pb::UpgradeResponse {
                    old_version,
                    new_version: next.version,
                })
            }
            Err(why) => {
                tracing::error!(error = %why, "the new binary did not start; this agent executes itself afresh");
                // After the answer has gone out.
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    let e = crate::upgrade::reexec_self();
                    tracing::error!(error = %e, "cannot execute the agent afresh");
                    std::process::exit(1);
                });
                Err(ApiError::Internal(format!(
                    "the new binary did not start: {why}; this agent ({old_version}) goes on, executed afresh"
                )))
            }
        }
    }
}
