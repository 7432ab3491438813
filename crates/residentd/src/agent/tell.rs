//! What the agent tells of its instances, a room of its own: an instance
//! as its record and its current run say (`view`, Get, List), and the
//! events that carry it to watchers (a run that ended unspawned, a note
//! on a run, a pool's reading, a forgotten instance, a refused start).
//! It reads the books and the supervisor and writes only the event log
//! (and the metrics of a refusal).

use std::sync::Arc;

use resident_api::{ApiError, pb};
use resident_core::Policy;
use resident_supervisor::Supervisor;

use super::books::{Books, Record, Sleepy};
use super::parts::Parts;
use super::shared::Clock;
use crate::events::EventLog;
use crate::metrics::Metrics;

/// The teller.
#[derive(Debug)]
pub(super) struct Teller {
    books: Arc<Books>,
    sup: Supervisor,
    events: Arc<EventLog>,
    metrics: Arc<Metrics>,
    clock: Clock,
}

impl Teller {
    /// The room, on the parts (and the rooms) it uses.
    pub(super) fn new(p: &Parts) -> Self {
        Self {
            books: p.books.clone(),
            sup: p.sup.clone(),
            events: p.events.clone(),
            metrics: p.metrics.clone(),
            clock: p.clock,
        }
    }

    /// An instance as its record and its current run say.
    pub(super) fn view(&self, id: &str, record: &Record) -> pb::Instance {
        let status = self
            .sup
            .status(id)
            .filter(|s| s.generation == record.generation);
        let mut out = match status {
            None if record.cancelled => resident_api::unspawned(id, &record.spec),
            _ => resident_api::instance(id, &record.spec, status.as_ref()),
        };
        self.with_record(&mut out, record);
        out
    }

    /// Fills in what the record knows beside the run: the devices of its
    /// chosen pools, whether it was adopted, a note on the run, and its
    /// lease (its length and what is left now).
    pub(super) fn with_record(&self, out: &mut pb::Instance, record: &Record) {
        let now = self.clock.now_ms();
        let devices: Vec<String> = record.devices.iter().map(u32::to_string).collect();
        out.devices = devices.join(",");
        if let Some(a) = record.adopted {
            out.adopted = true;
            out.managed = a.manage;
        }
        let ended = [pb::State::Exited as i32, pb::State::Failed as i32].contains(&out.state);
        // Falling asleep and waking show SLEEPING too: its server is not
        // serving (a request then would find it mid-sleep, or asleep), and
        // a Start waits for the call under way and then wakes it.
        if out.state == pb::State::Ready as i32 {
            let asleep = match record.sleep {
                Some(Sleepy::Asleep(since)) => {
                    let secs = now.saturating_sub(since) / 1000;
                    Some(format!("asleep for {secs} s; a Start wakes it"))
                }
                Some(Sleepy::Falling) => {
                    Some("falling asleep; a Start wakes it once it is asleep".to_string())
                }
                Some(Sleepy::Waking) => Some("waking".to_string()),
                Some(Sleepy::Woken(ms)) => {
                    out.message = format!("{}; WOKEN in {ms} ms", out.message);
                    None
                }
                None => None,
            };
            if let Some(text) = asleep {
                out.state = pb::State::Sleeping as i32;
                out.message = format!("SLEEPING: {text}");
            }
        }
        if let Some(note) = record.note.as_ref().filter(|_| !ended) {
            out.message = format!("{}; {note}", out.message);
        }
        if let Some(o) = record.overrun.as_ref().filter(|_| !ended) {
            out.message = format!("{}; {}", out.message, o.text);
        }
        // The typed word beside the text: why a stop was asked, else what
        // the agent tells of a running one.
        out.cause = match (record.cause, &record.overrun, &record.note) {
            (Some(cause), _, _) => cause,
            (None, Some(_), _) if !ended => pb::Cause::Overrun,
            (None, _, Some(note)) if !ended && note.starts_with("EXPOSED") => pb::Cause::Exposed,
            _ => pb::Cause::Unspecified,
        } as i32;
        for (pool, charge) in self.books.charges(&out.instance_id) {
            out.reserved_bytes = out.reserved_bytes.saturating_add(charge.counted());
            out.overrun_bytes = out.overrun_bytes.saturating_add(charge.overrun());
            if let Some(d) = out.demand.iter_mut().find(|d| d.pool == pool.as_str()) {
                d.overrun_bytes = charge.overrun();
            }
        }
        if let Some(report) = &record.report {
            out.server_buffers = report
                .buffers
                .iter()
                .map(|b| pb::ServerBuffer {
                    device: b.device.clone(),
                    kind: b.kind.as_str().to_string(),
                    bytes: b.bytes,
                })
                .collect();
        }
        out.hold_left_ms = self.books.hold_left(&out.instance_id, now);
        if let Some(lease) = record.lease {
            out.lease_ms = lease.ms;
            out.lease_left_ms = lease.until.saturating_sub(now);
        }
    }

    /// One instance.
    pub(super) fn get(&self, id: &str) -> Result<pb::Instance, ApiError> {
        match self.books.record(id) {
            Some(r) => Ok(self.view(id, &r)),
            None => Err(ApiError::NotFound(format!("no instance '{id}'"))),
        }
    }

    /// Every instance, in id order.
    pub(super) fn list(&self) -> Vec<pb::Instance> {
        let records = self.books.records();
        records.iter().map(|(id, r)| self.view(id, r)).collect()
    }

    /// Tells watchers how an instance whose run was never spawned ended
    /// (EXITED, "stopped before it was spawned"): the one end no
    /// supervisor transition reports.
    pub(super) fn publish_ended(&self, id: &str) {
        let Some(record) = self.books.record(id) else {
            return;
        };
        self.publish(self.view(id, &record), pb::EventKind::Transition);
    }

    /// Tells watchers what is now known of `id` (a note on its run), with
    /// no change of state.
    pub(super) fn publish_view(&self, id: &str) {
        if let Some(record) = self.books.record(id) {
            self.publish(self.view(id, &record), pb::EventKind::Transition);
        }
    }

    /// Tells watchers `kind` of `instance`.
    pub(super) fn publish(&self, instance: pb::Instance, kind: pb::EventKind) {
        self.events.publish(pb::Event {
            instance: Some(instance),
            kind: kind as i32,
            ..Default::default()
        });
    }

    /// Tells watchers what happened to `pool`'s live reading.
    pub(super) fn publish_pool(&self, pool: &str, message: &str) {
        self.events.publish(pb::Event {
            kind: pb::EventKind::Pool as i32,
            pool: pool.to_string(),
            message: message.to_string(),
            ..Default::default()
        });
    }

    /// Tells watchers that an ended instance was dropped, and lets the
    /// supervisor forget its run.
    pub(super) fn forgotten(&self, id: &str, record: &Record) {
        let last = self.view(id, record);
        self.sup.forget(id, record.generation);
        tracing::debug!(instance_id = %id, "forgot an ended instance");
        self.publish(last, pb::EventKind::Forgotten);
    }

    /// Tells watchers (and the metrics) that a start of `workload` was
    /// refused, and why.
    pub(super) fn refused(&self, workload: &str, refusal: &resident_core::Refusal, policy: Policy) {
        tracing::info!(workload, ?policy, reason = %refusal.first(), "start refused");
        self.metrics.refused(refusal.first().code());
        self.events.publish(pb::Event {
            kind: pb::EventKind::Refused as i32,
            refusal: Some(pb::Refusal {
                temporary: refusal.temporary(),
                ..resident_api::refusal(refusal.first())
            }),
            workload: workload.to_string(),
            ..Default::default()
        });
    }
}
