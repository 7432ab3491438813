//! Where an upgrade stands (`Upgrade`, SIGUSR2; the process side is
//! `crate::upgrade`), a room with walls: the stage, which refuses changes
//! from the check of the new binary on and tells the listeners when to
//! stop accepting, and what the state directory keeps for the next agent
//! beside the journal (the event history, the holds). The agent's
//! `upgrade` (mod.rs) walks the stages: the new binary checked, every
//! instance handed over (the supervisor lets each process run on), the
//! next agent started, and this one's end: it exits once the next one
//! serves, or executes itself afresh when it did not start.

use std::path::Path;
use std::time::Duration;

use tokio::sync::watch;

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
pub(super) const SETTLE_BOUND: Duration = Duration::from_secs(30);
/// The supervisor's actors get this long to let their processes go.
pub(super) const HAND_OVER_BOUND: Duration = Duration::from_secs(10);

/// Where the event history waits for the next agent, in the state
/// directory.
pub(super) const EVENTS_FILE: &str = "events.handover";

/// Where the holds in force wait for the next agent, in the state
/// directory: `ID<TAB>MS` lines.
const HOLDS_FILE: &str = "holds.handover";

/// Where an upgrade stands, and who waits for its stages.
#[derive(Debug)]
pub(super) struct Upgrades(watch::Sender<Stage>);

impl Default for Upgrades {
    fn default() -> Self {
        Self(watch::Sender::new(Stage::Idle))
    }
}

impl Upgrades {
    /// Whether an upgrade is under way (changes are refused meanwhile).
    pub fn upgrading(&self) -> bool {
        *self.0.borrow() != Stage::Idle
    }

    /// Resolves once an upgrade has begun to hand everything over.
    pub fn handing_over(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.0.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s >= Stage::HandingOver).await;
        }
    }

    /// Resolves once the next agent serves.
    pub fn upgraded(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.0.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s == Stage::Upgraded).await;
        }
    }

    /// Begins an upgrade (changes refused from now on); false when one is
    /// already under way.
    pub fn begin(&self) -> bool {
        self.0.send_if_modified(|s| {
            let idle = *s == Stage::Idle;
            if idle {
                *s = Stage::Checking;
            }
            idle
        })
    }

    /// Moves on to `stage`; `Stage::Idle` gives an upgrade up before
    /// anything was handed over.
    pub fn to(&self, stage: Stage) {
        self.0.send_replace(stage);
    }
}

/// The holds the agent an upgrade replaced handed over, each with what was
/// left of it; the file is removed. Nothing when there is none.
pub(super) fn handed_holds(dir: &Path) -> Vec<(String, u64)> {
    let Ok(bytes) = crate::state_files::read(dir, HOLDS_FILE) else {
        return Vec::new();
    };
    crate::state_files::remove(dir, HOLDS_FILE);
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter_map(|line| {
            let (id, ms) = line.split_once('\t')?;
            Some((id.to_string(), ms.parse().ok()?))
        })
        .collect()
}

/// Writes the holds in force (each instance and what is left of its
/// hold) for the next agent.
pub(super) fn hand_holds_over(dir: &Path, holds: &[(String, u64)]) {
    let text: String = holds
        .iter()
        .map(|(id, ms)| format!("{id}\t{ms}\n"))
        .collect();
    if let Err(e) = crate::state_files::write_new(dir, HOLDS_FILE, text.as_bytes()) {
        tracing::warn!(error = %e, "cannot hand the holds over; their holders renew them");
    }
}
