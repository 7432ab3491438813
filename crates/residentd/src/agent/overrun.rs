//! Overruns: an instance measured above its reservation. The books count
//! the measured bytes as soon as they are read (`Resident::charge`); this
//! room words what changed, once per change of the pools overrun: the
//! instance's message, the `OVERRUN` event's pool list and text, a log
//! line, and whether `on_overrun = "stop"` stops the run. The agent
//! publishes the event and makes the stop (`follower.rs`).

use resident_config::OnOverrun;
use resident_core::{Charge, PoolName};

use super::books::Books;

/// Bytes as the overrun's words give them: megabytes with one decimal
/// (a gigabyte's one decimal would read as zero for small servers).
fn mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

/// `OVERRUN: ...` for one run's overrunning pools.
pub(super) fn words(pools: &[(&PoolName, Charge)]) -> String {
    let each: Vec<String> = pools
        .iter()
        .map(|(pool, c)| {
            format!(
                "measured {} in pool '{pool}', {} above its reservation of {}",
                mb(c.measured),
                mb(c.overrun()),
                mb(c.reserved)
            )
        })
        .collect();
    format!("OVERRUN: {}", each.join("; "))
}

/// One overrun that began, changed pools or ended, as the agent tells it.
#[derive(Debug)]
pub(super) struct Told {
    /// The instance.
    pub id: String,
    /// Its run.
    pub generation: u64,
    /// The instance's message: the overrun's words, or that it is back
    /// within its reservation.
    pub message: String,
    /// The pools overrun now (none once it ended).
    pub pools: Vec<String>,
    /// Whether its policy stops the run (`on_overrun = "stop"`, a run the
    /// agent may stop, still overrunning).
    pub stop: bool,
}

/// Every overrun that began, changed pools or ended since the last
/// readings, logged once each.
pub(super) fn changes(books: &Books, node_default: OnOverrun) -> Vec<Told> {
    let mut out = Vec::new();
    for change in books.sync_overruns(node_default, words) {
        let message = match &change.overrun {
            Some(o) => {
                tracing::warn!(instance_id = %change.id, "{}", o.text);
                o.text.clone()
            }
            None => {
                tracing::info!(instance_id = %change.id, "back within its reservation");
                "back within its reservation".to_string()
            }
        };
        let pools: Vec<String> = change
            .overrun
            .as_ref()
            .map(|o| o.pools.iter().map(ToString::to_string).collect())
            .unwrap_or_default();
        let stop =
            change.on_overrun == OnOverrun::Stop && change.stoppable && change.overrun.is_some();
        if stop {
            tracing::warn!(instance_id = %change.id, "on_overrun = \"stop\": stopping");
        }
        out.push(Told {
            id: change.id,
            generation: change.generation,
            message,
            pools,
            stop,
        });
    }
    out
}
