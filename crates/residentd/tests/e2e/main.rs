//! The end-to-end tests of residentd: one binary, a module per topic, each
//! starting the real `residentd` (and `residentctl`) and talking to it over
//! its socket, with the helpers of `support`. `router` runs
//! residentd-router (its library, in the test process) in front of it,
//! and `router_attacks` performs on it the attacks a review found;
//! `console` opens the router's page in a headless chromium; `package`
//! builds the Debian package and, as root, installs it for real and
//! purges it.
//!
//! `cargo test -p residentd --test e2e lifecycle::` runs one topic.

#![allow(clippy::disallowed_methods)] // crates/residentd/clippy.toml is for agent/ only

mod support;

mod adopt;
mod attacks;
mod books;
mod chaos;
mod clock;
mod connections;
mod console;
mod device;
mod docs;
mod examples;
mod fleet;
mod footprint;
mod gpu_choice;
mod hostile_input;
mod interop;
mod keep_kv;
mod leases;
mod lifecycle;
mod llama;
mod load;
mod metrics;
mod oom;
mod package;
mod placement;
mod prometheus;
mod residentctl;
mod router;
mod router_attacks;
mod security;
mod serving;
mod shutdown;
mod sleep;
mod systemd;
mod takeover;
mod tls;
mod unreachable;
mod watch_node;
