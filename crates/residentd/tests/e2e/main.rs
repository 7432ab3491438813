//! The end-to-end tests of residentd: one binary, a module per topic, each
//! starting the real `residentd` (and `residentctl`) and talking to it over
//! its socket, with the helpers of `support`. `router` runs
//! residentd-router (its library, in the test process) in front of it;
//! `console` opens the router's page in a headless chromium; `package`
//! builds the Debian package and, as root, installs it for real and
//! purges it.
//!
//! `cargo test -p residentd --test e2e lifecycle::` runs one topic.

mod support;

mod adopt;
mod attacks;
mod books;
mod chaos;
mod clock;
mod connections;
mod console;
mod device;
mod fleet;
mod footprint;
mod gpu_choice;
mod hostile_input;
mod interop;
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
mod security;
mod shutdown;
mod sleep;
mod systemd;
mod takeover;
mod tls;
mod unreachable;
mod watch_node;
