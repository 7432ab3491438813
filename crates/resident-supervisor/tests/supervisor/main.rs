//! The supervisor's integration tests, one binary: lifecycle, restarts,
//! logs and memory, and cgroups, with real children (`resident-testchild`)
//! and real signals; everything they share is in `support`.

mod support;

mod adopted;
mod cgroups;
mod lifecycle;
mod restarts_logs_memory;
