//! Discovery: where this process's own cgroups are, in the v2 hierarchy
//! (the unified mount, or `/sys/fs/cgroup/unified` on a hybrid machine) and
//! in the v1 memory hierarchy, read from `/proc/self/mountinfo` and
//! `/proc/self/cgroup`. Whether they are writable is found out by
//! `setup.rs`, which tries.

use std::fs;
use std::path::PathBuf;

/// Where the cgroup hierarchies of this process are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hierarchies {
    /// This process's own cgroup in the v2 hierarchy.
    pub v2: Option<PathBuf>,
    /// This process's own cgroup in the v1 memory hierarchy.
    pub v1_memory: Option<PathBuf>,
}

impl Hierarchies {
    /// Reads `/proc/self/mountinfo` and `/proc/self/cgroup`.
    pub fn of_self() -> Self {
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Self::parse(&mounts, &own)
    }

    /// Finds the hierarchies from the texts of `mountinfo` and `cgroup`.
    pub fn parse(mountinfo: &str, cgroup: &str) -> Self {
        let mut out = Self::default();
        for line in mountinfo.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let fields: Vec<&str> = left.split(' ').collect();
            let theirs: Vec<&str> = right.split(' ').collect();
            let (Some(root), Some(point), Some(fstype)) =
                (fields.get(3), fields.get(4), theirs.first())
            else {
                continue;
            };
            let options = theirs.get(2).copied().unwrap_or("");
            let own_path = |matches: &dyn Fn(&str) -> bool| {
                cgroup.lines().find_map(|l| {
                    let mut parts = l.splitn(3, ':');
                    let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                    matches(controllers).then(|| path.to_string())
                })
            };
            let dir = |path: String| {
                let rel = path.strip_prefix(root).unwrap_or(&path).trim_matches('/');
                let dir = PathBuf::from(point);
                if rel.is_empty() { dir } else { dir.join(rel) }
            };
            if *fstype == "cgroup2" && out.v2.is_none() {
                out.v2 = own_path(&|c| c.is_empty()).map(dir);
            } else if *fstype == "cgroup"
                && out.v1_memory.is_none()
                && options.split(',').any(|o| o == "memory")
            {
                out.v1_memory = own_path(&|c| c.split(',').any(|x| x == "memory")).map(dir);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn finds_both_hierarchies_of_a_hybrid_machine() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
35 30 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 30 0:32 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw";
        let cgroup = "4:memory:/box/a1\n1:cpu:/\n0::/svc/agent.service\n";
        let h = Hierarchies::parse(mountinfo, cgroup);
        assert_eq!(
            h.v2.as_deref(),
            Some(Path::new("/sys/fs/cgroup/unified/svc/agent.service"))
        );
        assert_eq!(
            h.v1_memory.as_deref(),
            Some(Path::new("/sys/fs/cgroup/memory/box/a1"))
        );
    }

    #[test]
    fn a_namespaced_mount_root_is_stripped() {
        let mountinfo = "50 40 0:40 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw";
        let h = Hierarchies::parse(mountinfo, "0::/kubepods/pod1/c\n");
        assert_eq!(h.v2.as_deref(), Some(Path::new("/sys/fs/cgroup/c")));
        assert_eq!(h.v1_memory, None);
        let root = Hierarchies::parse(mountinfo, "0::/kubepods/pod1\n");
        assert_eq!(root.v2.as_deref(), Some(Path::new("/sys/fs/cgroup")));
    }
}
