//! The agent's events for every viewer of the console: one Watch per
//! router, not one per open page, begun when the first page opens.
//!
//! It starts [`BACKLOG`] events before the agent's revision at that time
//! (`NodeStatus.revision`), so a page opened later still shows what
//! happened before it: the last [`KEPT`] events are kept and sent to each
//! page as it opens. An event heard live is stamped with the time the
//! router heard it; one from the backlog has no time (the agent's events
//! carry none). When the Watch ends (the agent restarted, or fell out of
//! reach) it is resumed from the last revision seen, or from the agent's
//! current one when that is no longer kept.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use resident_api::pb;
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::view;
use crate::agent::Agent;

/// How many events the feed keeps for a page that opens.
pub const KEPT: usize = 200;
/// How far back the first Watch begins.
const BACKLOG: u64 = KEPT as u64;
/// How long the feed waits before asking an agent out of reach again.
const RETRY: Duration = Duration::from_secs(2);
/// How long after a Watch ended it is resumed.
const RESUME: Duration = Duration::from_millis(200);

/// The shared feed.
#[derive(Debug, Default)]
pub struct Feed {
    kept: Arc<Mutex<VecDeque<Arc<Value>>>>,
    live: OnceLock<broadcast::Sender<Arc<Value>>>,
}

impl Feed {
    /// The kept events, oldest first, and every later one: begins the
    /// Watch on the first call.
    pub fn follow(&self, agent: &Agent) -> (Vec<Arc<Value>>, broadcast::Receiver<Arc<Value>>) {
        let live = self.live.get_or_init(|| {
            let (tx, _) = broadcast::channel(1024);
            tokio::spawn(watch(agent.clone(), tx.clone(), self.kept.clone()));
            tx
        });
        // Under the lock the watcher keeps and sends under: no event is
        // both in the copy and received, or in neither.
        let kept = self.kept.lock();
        (kept.iter().cloned().collect(), live.subscribe())
    }
}

/// Follows the agent for as long as the router runs.
async fn watch(
    agent: Agent,
    tx: broadcast::Sender<Arc<Value>>,
    kept: Arc<Mutex<VecDeque<Arc<Value>>>>,
) {
    // The last revision seen; events up to `heard_from` are the backlog.
    let mut last: Option<u64> = None;
    let mut heard_from = 0;
    loop {
        let from = match last {
            Some(r) => r,
            None => match agent.node().await {
                Ok(n) => {
                    heard_from = n.revision;
                    // Revision 0 asks for a snapshot: the backlog starts
                    // after the first event then.
                    n.revision.saturating_sub(BACKLOG).max(n.revision.min(1))
                }
                Err(s) => {
                    tracing::debug!(error = %s.message(), "console: the agent cannot be asked; again soon");
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
            },
        };
        let mut events = match agent.watch_since(from).await {
            Ok(e) => e,
            Err(s) if s.code() == tonic::Code::OutOfRange => {
                // Not kept (the agent restarted, or a backlog too long):
                // from the agent's revision now, without a backlog.
                tracing::debug!(from, error = %s.message(), "console: watching from now");
                last = None;
                match agent.node().await {
                    Ok(n) => {
                        heard_from = n.revision;
                        last = Some(n.revision);
                    }
                    Err(_) => tokio::time::sleep(RETRY).await,
                }
                continue;
            }
            Err(s) => {
                tracing::debug!(error = %s.message(), "console: cannot watch the agent; again soon");
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        while let Ok(Some(e)) = events.message().await {
            if e.kind == pb::EventKind::Snapshot as i32 {
                continue;
            }
            last = Some(e.revision);
            let v = Arc::new(stamped(&e, e.revision > heard_from));
            let mut k = kept.lock();
            if k.len() == KEPT {
                k.pop_front();
            }
            k.push_back(v.clone());
            let _ = tx.send(v);
        }
        // Ended: resumed at once, but never in a busy loop.
        tokio::time::sleep(RESUME).await;
    }
}

/// An event as the page draws it: `time_ms` when heard live.
fn stamped(e: &pb::Event, live: bool) -> Value {
    let mut v = view::event(e);
    v["time_ms"] = if live { json!(now_ms()) } else { Value::Null };
    v
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
