//! The roster as requests name it: a workload by its name or alias, and
//! the key its footprint is learned under. A leaf every room may import.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use resident_api::ApiError;
use resident_config::{Config, Workload};

/// How long a dry run (Place) reuses a workload's footprint key.
const KEY_REUSE: Duration = Duration::from_secs(1);

/// The workload `name` (or alias) of `config`'s roster.
pub(super) fn workload_of(config: &Config, name: &str) -> Result<Arc<Workload>, ApiError> {
    if name.is_empty() {
        return Err(ApiError::invalid(
            "workload",
            "must name a workload of the roster",
        ));
    }
    config.workload(name).cloned().ok_or_else(|| {
        let name = resident_core::Excerpt::of(name);
        ApiError::NotFound(format!("no workload {name} in the roster"))
    })
}

/// What `w`'s footprint is learned for under `config`: its key, or `None`
/// when the node does not learn (`learn_footprints = false`).
pub(super) fn footprint_key(config: &Config, w: &Workload) -> Option<u64> {
    config.node.learn_footprints.then(|| w.footprint_key())
}

/// The footprint keys read lately. A key costs a `stat` of the program and
/// of each file the command line names: a Start reads it afresh every
/// time, and a Place, the hot dry run a scheduler asks many times a
/// second, reuses one read within [`KEY_REUSE`] for the same definition
/// of the workload (a reload makes another). So a model file replaced
/// on disk shows in a Place's learned footprint at most a second late,
/// and in a Start at once.
#[derive(Debug, Default)]
pub(super) struct Keys(Mutex<HashMap<String, Read>>);

/// A key as read: for which definition of the workload, and when.
#[derive(Debug)]
struct Read {
    of: Arc<Workload>,
    at: Instant,
    key: u64,
}

impl Keys {
    /// `w`'s key under `config`, read now (a Start's).
    pub fn fresh(&self, config: &Config, w: &Arc<Workload>) -> Option<u64> {
        let key = footprint_key(config, w)?;
        self.0.lock().insert(
            w.spec.workload.to_string(),
            Read {
                of: w.clone(),
                at: Instant::now(),
                key,
            },
        );
        Some(key)
    }

    /// `w`'s key under `config`, as read within the last [`KEY_REUSE`] for
    /// this definition of it, else read now (a Place's).
    pub fn recent(&self, config: &Config, w: &Arc<Workload>) -> Option<u64> {
        self.recent_at(config, w, Instant::now())
    }

    /// [`Keys::recent`] as of `now`.
    fn recent_at(&self, config: &Config, w: &Arc<Workload>, now: Instant) -> Option<u64> {
        if !config.node.learn_footprints {
            return None;
        }
        let reused = self
            .0
            .lock()
            .get(w.spec.workload.as_str())
            .and_then(|read| {
                let age = now.saturating_duration_since(read.at);
                (Arc::ptr_eq(&read.of, w) && age < KEY_REUSE).then_some(read.key)
            });
        reused.or_else(|| self.fresh(config, w))
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // plain tests: no runtime to block
mod tests {
    use super::*;

    /// A roster of one workload whose command names `model`.
    fn naming(model: &std::path::Path) -> Config {
        let text = format!(
            "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/unused.sock\"\nstate_dir = \"/tmp/residentd-unused/state\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"1GB\"\n\n[[workload]]\nname = \"m\"\ncommand = [\"/bin/sleep\", \"{}\"]\n[workload.memory.ram]\nweights = \"1MB\"\n",
            model.display()
        );
        resident_config::parse(std::path::Path::new("roster-test.toml"), &text)
            .expect("a valid config")
    }

    #[test]
    fn a_place_reuses_a_key_read_within_a_second_and_a_start_reads_afresh() {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = dir.path().join("model.gguf");
        std::fs::write(&model, b"one").expect("write");
        let config = naming(&model);
        let w = workload_of(&config, "m").expect("the workload");
        let keys = Keys::default();
        // Ages are counted from the read's own instant, so a slow machine
        // cannot age a read by accident.
        let first = keys.recent(&config, &w).expect("learning is on");
        let read = keys.0.lock().get("m").map(|r| r.at).expect("kept");
        assert_eq!(first, w.footprint_key());
        // The model replaced on disk: another key, which a Place sees
        // once its read is a second old, and a Start at once.
        std::fs::write(&model, b"a longer model").expect("write");
        let replaced = w.footprint_key();
        assert_ne!(replaced, first);
        assert_eq!(keys.recent_at(&config, &w, read), Some(first));
        let later = read + KEY_REUSE;
        assert_eq!(keys.recent_at(&config, &w, later), Some(replaced));
        std::fs::write(&model, b"the model as it was: one").expect("write");
        let again = w.footprint_key();
        assert_eq!(keys.fresh(&config, &w), Some(again));
        let read = keys.0.lock().get("m").map(|r| r.at).expect("kept");
        assert_eq!(keys.recent_at(&config, &w, read), Some(again));
        // Another definition of the workload (a reload) is read afresh.
        std::fs::write(&model, b"a third model, longer still").expect("write");
        let reloaded = naming(&model);
        let w2 = workload_of(&reloaded, "m").expect("the workload");
        assert_eq!(keys.recent(&reloaded, &w2), Some(w2.footprint_key()));
        assert_ne!(w2.footprint_key(), again);
    }
}
