//! The core's integration tests, one binary: planner tables, property
//! tests and the reference ledger's cases, with the builders of `support`.

mod support;

mod adopt;
mod any_of;
mod planner;
mod properties;
mod reference;
