//! What every room of the agent reads and none owns: the agent's clock,
//! the configuration in force, and whether the agent is closing. Each is
//! a small handle, cloned into the rooms that need it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use parking_lot::RwLock;
use resident_config::Config;

/// Monotonic milliseconds since the agent began: holds, leases, idle
/// times and sleeps are measured on it, so a step of the wall clock
/// changes none of them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Clock(Instant);

impl Clock {
    pub(super) fn new() -> Self {
        Self(Instant::now())
    }

    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// The configuration in force. A request takes it once and decides on
/// that one snapshot, so a reload never mixes two configs in it.
#[derive(Debug, Clone)]
pub(super) struct Current(Arc<RwLock<Arc<Config>>>);

impl Current {
    pub(super) fn new(config: Arc<Config>) -> Self {
        Self(Arc::new(RwLock::new(config)))
    }

    pub(super) fn get(&self) -> Arc<Config> {
        self.0.read().clone()
    }

    pub(super) fn set(&self, config: Arc<Config>) {
        *self.0.write() = config;
    }
}

/// The agent's end: first no new admission (`close`), then, once the last
/// journal is written, every long wait and stream ends (`finish`).
#[derive(Debug, Clone)]
pub(super) struct Closing(Arc<Ends>);

#[derive(Debug)]
struct Ends {
    closing: AtomicBool,
    closed: tokio::sync::watch::Sender<bool>,
}

impl Closing {
    pub(super) fn new() -> Self {
        Self(Arc::new(Ends {
            closing: AtomicBool::new(false),
            closed: tokio::sync::watch::Sender::new(false),
        }))
    }

    /// No new admission from now on.
    pub(super) fn close(&self) {
        self.0.closing.store(true, Ordering::Release);
    }

    /// Whether `close` was called.
    pub(super) fn is_closing(&self) -> bool {
        self.0.closing.load(Ordering::Acquire)
    }

    /// Ends every wait on [`Closing::finished`].
    pub(super) fn finish(&self) {
        self.0.closed.send_replace(true);
    }

    /// Resolves once `finish` was called.
    pub(super) fn finished(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.0.closed.subscribe();
        async move {
            let _ = rx.wait_for(|closed| *closed).await;
        }
    }
}
