//! The `[[group]]` sections: names, members that are workloads of the
//! roster, and a workload in one group only.

use std::collections::BTreeMap;
use std::sync::Arc;

use resident_core::{GroupDef, GroupName, GroupPolicy, Groups, WorkloadName};
use toml::Spanned;

use super::{Result, spanned_str};
use crate::error::Source;
use crate::{Workload, raw};

pub(super) fn groups(
    src: &Source<'_>,
    raw: &[Spanned<raw::Group>],
    workloads: &BTreeMap<String, Arc<Workload>>,
) -> Result<Groups> {
    let mut defs = Vec::new();
    let mut member_of: BTreeMap<String, String> = BTreeMap::new();
    for g in raw {
        let g = g.get_ref();
        let name = GroupName::new(spanned_str(&g.name))
            .map_err(|e| src.err(g.name.span(), "group.name", e.to_string()))?;
        let mut members = Vec::new();
        for m in &g.members {
            let key = format!("group[{name}].members");
            if !workloads.contains_key(m.get_ref()) {
                return Err(src.err(
                    m.span(),
                    key,
                    format!("no workload {:?} in the roster", m.get_ref()),
                ));
            }
            if let Some(first) = member_of.insert(m.get_ref().clone(), name.to_string())
                && first != name.as_str()
            {
                let msg = format!(
                    "workload {:?} is already a member of group '{first}'",
                    m.get_ref()
                );
                return Err(src.err(m.span(), key, msg));
            }
            members.push(
                WorkloadName::new(m.get_ref().as_str())
                    .map_err(|e| src.err(m.span(), key, e.to_string()))?,
            );
        }
        let policy = GroupPolicy {
            swap: g.swap,
            exclusive: g.exclusive,
            persistent: g.persistent,
        };
        defs.push(GroupDef {
            name,
            members,
            policy,
        });
    }
    let span = raw.first().map_or(0..0, Spanned::span);
    Groups::new(defs).map_err(|e| src.err(span, "group", e.to_string()))
}
