//! The placement core of residentd: pools, workload specs, the residency
//! ledger and the planner that decides, for any start, admit (evicting
//! these, possibly none) or refuse (for these reasons).
//!
//! The modules, each importing only those before it: `ledger` (what is
//! held, and the budget arithmetic), `planner` (reads the ledger, decides),
//! `admit` (the one way in: plans with the planner, then changes the
//! ledger).
//!
//! Architecture invariant: this crate does no I/O, reads no clock, spawns
//! nothing and knows no wire format. Time and probe readings come in as
//! arguments, so every decision is a deterministic function of its inputs.

mod admit;
mod ledger;
mod name;
mod planner;
mod reason;
mod spec;
mod units;

pub use admit::{Admission, AdmitError};
pub use ledger::{Charge, NodeState, Phase, PoolConfig, PoolStatus, Resident, Tier};
pub use name::{Excerpt, GroupName, InstanceId, NameError, PoolName, Role, WorkloadName};
pub use planner::{Entry, Plan, PlanError, Policy, Running};
pub use reason::{GroupRule, Holder, Reason, Refusal};
pub use spec::{
    AnyOf, Asleep, Choice, Demand, GpuChoice, GroupDef, GroupError, GroupPolicy, Groups, Spec,
};
pub use units::{GB, Gb, UnitError, parse_bytes};
