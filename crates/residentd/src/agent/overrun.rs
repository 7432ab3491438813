//! Overruns: an instance measured above its reservation. The books count
//! the measured bytes as soon as they are read (`Resident::charge`); this
//! room tells about it, once per change of the pools overrun: the
//! instance's message and an `OVERRUN` event with both figures, a log
//! line, and, under `on_overrun = "stop"`, a stop with reason `OVERRUN`.

use std::sync::Arc;

use resident_api::pb;
use resident_config::OnOverrun;
use resident_core::{Charge, PoolName};

use super::Agent;

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

impl Agent {
    /// Tells about every overrun that began, changed pools or ended since
    /// the last readings, and stops the runs whose policy says so.
    pub(super) fn tell_overruns(self: &Arc<Self>) {
        let node_default = self.config().node.on_overrun;
        for change in self.books.sync_overruns(node_default, words) {
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
            if let Some(record) = self.books.record(&change.id) {
                self.events.publish(pb::Event {
                    instance: Some(self.view(&change.id, &record)),
                    kind: pb::EventKind::Overrun as i32,
                    pool: pools.join(","),
                    message: message.clone(),
                    ..Default::default()
                });
            }
            let stop = change.on_overrun == OnOverrun::Stop && change.stoppable;
            if let (true, Some(_)) = (stop, &change.overrun) {
                tracing::warn!(instance_id = %change.id, "on_overrun = \"stop\": stopping");
                let me = self.clone();
                let cause = Some((
                    pb::Cause::Overrun,
                    format!("{message}; on_overrun = \"stop\""),
                ));
                let (id, run) = (change.id, change.generation);
                tokio::spawn(async move { me.stop_because(&id, Some(run), None, cause).await });
            }
        }
    }
}
