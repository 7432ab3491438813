//! residentd, the node agent: joins the placement core, the supervisor and
//! the probes behind the `resident.v1.NodeAgent` gRPC service.
//!
//! Architecture invariant: every charge goes through the ledger's one
//! `admit` (by `Books::admit`, `adopt`, `begin_sleep` and the wakes), which
//! plans and reserves under the one books lock; only a run's end releases.
//!
//! The file system and /proc scans (clippy.toml's `disallowed-methods`)
//! are kept out of the agent's async code: the lint is on in `agent/`
//! alone, whose blocking work runs on blocking threads.

// The sync modules (the journal, the server's set-up, the handover files)
// may touch the file system; `agent/` may not (see its module).
#![allow(clippy::disallowed_methods)]

pub mod access;
pub mod agent;
pub mod authority;
pub mod connections;
pub mod events;
pub mod journal;
pub mod metrics;
pub mod node_watch;
pub mod outbox;
pub mod server;
pub mod service;
pub mod state_files;
pub mod tls;
pub mod upgrade;
pub mod validate;

/// The example configuration `residentd` runs when given no `--config`:
/// a small real demo workload that works on any laptop with Python 3. It
/// runs as it is with `--config examples/laptop.toml` too; without
/// `--config`, `main` moves its socket and state to a per-user directory.
pub const DEFAULT_CONFIG: &str = include_str!("../../../examples/laptop.toml");
