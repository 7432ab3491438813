//! Why a start is unplaceable, as data. The `Display` text is the operator-
//! facing form that the design brief fixes; the fields are what the API
//! puts into structured error details.

use std::fmt;

use crate::name::{GroupName, InstanceId, PoolName, Role};
use crate::units::Gb;

/// Who holds memory in a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The resident instance.
    pub instance_id: InstanceId,
    /// Its role.
    pub role: Role,
    /// Bytes it holds in the pool.
    pub bytes: u64,
}

/// Which group rule two instances break.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupRule {
    /// Both are members of one swap group.
    Swap,
    /// One is a member of an exclusive group, the other of another
    /// non-persistent group.
    Exclusive,
}

impl GroupRule {
    /// The rule's name in messages and details.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Swap => "swap",
            Self::Exclusive => "exclusive",
        }
    }
}

/// One reason a target cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// The pool's budget (configured, or tightened by a live reading to
    /// exactly the configured figure) has not enough free.
    OverBudget {
        /// The target's role.
        role: Role,
        /// The short pool.
        pool: PoolName,
        /// Bytes the target needs there.
        need: u64,
        /// Bytes free there now.
        free: u64,
        /// The pool's effective budget.
        budget: u64,
        /// Who holds the rest, in ledger order.
        holders: Vec<Holder>,
    },
    /// An exclusion between the target and a resident, either direction.
    Excluded {
        /// The target's role.
        role: Role,
        /// The resident's role.
        with: Role,
        /// The resident instance.
        with_instance: InstanceId,
        /// The role whose `excludes` names the other.
        declared_by: Role,
    },
    /// A group rule between the target and a resident.
    GroupConflict {
        /// The target's role.
        role: Role,
        /// The resident's role.
        with: Role,
        /// The resident instance.
        with_instance: InstanceId,
        /// The group whose rule applies.
        group: GroupName,
        /// Which rule.
        rule: GroupRule,
    },
    /// A probe-bound pool's live ceiling is tighter than the budget and the
    /// target does not fit under it.
    HostMemory {
        /// The target's role.
        role: Role,
        /// The short pool.
        pool: PoolName,
        /// Bytes the target needs there.
        need: u64,
        /// What the probe last read as available.
        available: u64,
        /// The pool's configured headroom.
        reserve: u64,
        /// Declared but not yet touched by residents.
        pending: u64,
        /// Who holds memory in the pool, in ledger order.
        holders: Vec<Holder>,
    },
}

impl Reason {
    /// The stable machine-readable name (`google.rpc.ErrorInfo.reason`).
    pub fn code(&self) -> &'static str {
        match self {
            Self::OverBudget { .. } => "OVER_BUDGET",
            Self::Excluded { .. } => "EXCLUDED",
            Self::GroupConflict { .. } => "GROUP_CONFLICT",
            Self::HostMemory { .. } => "HOST_MEMORY",
        }
    }

    /// Whether the reason is about memory (budget or live ceiling) rather
    /// than a co-residency rule.
    pub fn is_memory(&self) -> bool {
        matches!(self, Self::OverBudget { .. } | Self::HostMemory { .. })
    }

    /// The pool a memory reason is about; `None` for a co-residency rule.
    pub fn pool(&self) -> Option<&PoolName> {
        match self {
            Self::OverBudget { pool, .. } | Self::HostMemory { pool, .. } => Some(pool),
            Self::Excluded { .. } | Self::GroupConflict { .. } => None,
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OverBudget {
                role,
                pool,
                need,
                free,
                budget,
                holders,
            } => {
                write!(
                    f,
                    "unplaceable: '{role}' needs {} but only {} of the {} '{pool}' pool is free (held by ",
                    Gb(*need),
                    Gb(*free),
                    Gb(*budget)
                )?;
                write_holders(f, holders)?;
                f.write_str(")")
            }
            Self::Excluded {
                role,
                with,
                declared_by,
                ..
            } => write!(
                f,
                "unplaceable: '{role}' cannot be resident beside '{with}' ('{declared_by}' excludes it)"
            ),
            Self::GroupConflict {
                role,
                with,
                group,
                rule,
                ..
            } => {
                let why = match rule {
                    GroupRule::Swap => "swaps its members: one at a time",
                    GroupRule::Exclusive => "is exclusive",
                };
                write!(
                    f,
                    "unplaceable: '{role}' cannot be resident beside '{with}' (group '{group}' {why})"
                )
            }
            Self::HostMemory {
                role,
                pool,
                need,
                available,
                reserve,
                pending,
                holders,
            } => {
                write!(
                    f,
                    "unplaceable: '{role}' needs {} but the live '{pool}' pool has only {} free ({} available, less {} reserve, less {} declared but not yet in use; held by ",
                    Gb(*need),
                    Gb(available.saturating_sub(*reserve).saturating_sub(*pending)),
                    Gb(*available),
                    Gb(*reserve),
                    Gb(*pending)
                )?;
                write_holders(f, holders)?;
                f.write_str(")")
            }
        }
    }
}

/// `coder-daily 55.0 GB, coder-small 9.0 GB`, or `nothing`: each holder
/// by its instance id, with its role where that differs (`c1 (coder)
/// 9.0 GB`: two instances of one role are told apart).
fn write_holders(f: &mut fmt::Formatter<'_>, holders: &[Holder]) -> fmt::Result {
    if holders.is_empty() {
        return f.write_str("nothing");
    }
    for (i, h) in holders.iter().enumerate() {
        let sep = if i == 0 { "" } else { ", " };
        write!(f, "{sep}{}", h.instance_id)?;
        if h.role.as_str() != h.instance_id.as_str() {
            write!(f, " ({})", h.role)?;
        }
        write!(f, " {}", Gb(h.bytes))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(id: &str, role: &str, bytes: u64) -> Holder {
        Holder {
            instance_id: InstanceId::new(id).expect("an id"),
            role: Role::new(role).expect("a role"),
            bytes,
        }
    }

    #[test]
    fn refusals_name_each_holder_by_instance_and_role_where_it_differs() {
        let over = |holders: Vec<Holder>| {
            Reason::OverBudget {
                role: Role::new("planner").expect("a role"),
                pool: PoolName::new("ram").expect("a pool"),
                need: 500_000_000,
                free: 40_000_000,
                budget: 8 * crate::GB,
                holders,
            }
            .to_string()
        };
        let cases = [
            (
                vec![holder("coder-daily", "coder-daily", 55 * crate::GB)],
                "held by coder-daily 55.0 GB)",
            ),
            (
                vec![
                    holder("c1", "coder", 9 * crate::GB),
                    holder("c2", "coder", 9 * crate::GB),
                ],
                "held by c1 (coder) 9.0 GB, c2 (coder) 9.0 GB)",
            ),
            (vec![], "held by nothing)"),
        ];
        for (holders, tail) in cases {
            let text = over(holders);
            assert!(
                text.starts_with("unplaceable: 'planner' needs 0.5 GB but only 40.0 MB of the 8.0 GB 'ram' pool is free (")
                    && text.ends_with(tail),
                "{text}"
            );
        }
    }
}

/// A refused placement: every reason that stands, never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    reasons: Vec<Reason>,
    temporary: bool,
}

impl Refusal {
    /// A refusal for these reasons. `None` when there are none.
    pub fn new(reasons: Vec<Reason>) -> Option<Self> {
        (!reasons.is_empty()).then_some(Self {
            reasons,
            temporary: false,
        })
    }

    /// Whether only residents under a hold block the target (under the
    /// evict policy): once the holds lapse it would be admitted.
    pub fn temporary(&self) -> bool {
        self.temporary
    }

    pub(crate) fn mark_temporary(mut self) -> Self {
        self.temporary = true;
        self
    }

    /// Every reason, co-residency rules first, then pools by name.
    pub fn reasons(&self) -> &[Reason] {
        &self.reasons
    }

    /// The first reason, whose text a refused RPC carries as its message.
    pub fn first(&self) -> &Reason {
        &self.reasons[0]
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.reasons.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Refusal {}
