//! The roster as requests name it: a workload by its name or alias, and
//! the key its footprint is learned under. A leaf every room may import.

use std::sync::Arc;

use resident_api::ApiError;
use resident_config::{Config, Workload};

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
