//! The core's integration tests, one binary: planner tables, property
//! tests, the pool figures and the reference ledger's cases, with the
//! builders of `support`.

mod support;

mod adopt;
mod any_of;
mod figures;
mod planner;
mod properties;
mod reference;
mod sleep;
