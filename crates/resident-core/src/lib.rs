//! The placement core of residentd: pools, workload specs, the residency
//! ledger and the planner that decides, for any start, admit (evicting
//! these, possibly none) or refuse (for these reasons).
//!
//! Architecture invariant: this crate does no I/O, reads no clock, spawns
//! nothing and knows no wire format. Time and probe readings come in as
//! arguments, so every decision is a deterministic function of its inputs.

mod name;
mod planner;
mod reason;
mod spec;
mod state;
mod units;

pub use name::{Excerpt, GroupName, InstanceId, NameError, PoolName, Role, WorkloadName};
pub use planner::{Plan, PlanError, Policy};
pub use reason::{GroupRule, Holder, Reason, Refusal};
pub use spec::{
    AnyOf, Asleep, Choice, Demand, GpuChoice, GroupDef, GroupError, GroupPolicy, Groups, Spec,
};
pub use state::{
    Admission, AdmitError, Charge, NodeState, Phase, PoolConfig, PoolStatus, Resident, Tier,
};
pub use units::{GB, Gb, UnitError, parse_bytes};
