//! residentd, the node agent: joins the placement core, the supervisor and
//! the probes behind the `resident.v1.NodeAgent` gRPC service.
//!
//! Architecture invariant: all admission goes through `Books::admit` (via
//! `Agent::start`), which plans and reserves under the one books lock;
//! nothing else reserves, and only a run's end releases.

pub mod access;
pub mod agent;
pub mod authority;
pub mod connections;
pub mod events;
pub mod journal;
pub mod metrics;
pub mod node_watch;
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
