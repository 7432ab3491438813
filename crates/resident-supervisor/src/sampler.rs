//! Sampling the resident bytes of running instances. The files read (each
//! run's `cgroup.procs`, each member's `/proc/PID/statm`) are kept open
//! between samples and re-read in place, and a run's member list is read
//! only every few samples, so a node of hundreds of idle instances costs
//! about one small read per process per period, not an open, a stat,
//! reads and a close of two files.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::sync::Arc;

use crate::cgroup::RunCgroup;

/// What one instance is measured by: its cgroup, or its process group.
pub(crate) type Target = (i32, Option<Arc<RunCgroup>>);

/// Samples between two reads of a run's member list: members rarely
/// change, and generating `cgroup.procs` costs the kernel more than the
/// rest of a sample. A member that is gone forces a read at once; a helper
/// forked since the last read is counted within this many samples.
const MEMBERS_EVERY: u32 = 5;

/// One run's member list and the file it comes from.
#[derive(Debug)]
struct RunFiles {
    procs: File,
    members: Vec<i32>,
    /// Samples until the member list is read again.
    stale_in: u32,
}

/// Open files, kept from one sample to the next.
#[derive(Debug, Default)]
pub(crate) struct Sampler {
    /// Each run's files, by its group id (one run, one cgroup).
    runs: HashMap<i32, RunFiles>,
    statm: HashMap<i32, File>,
    buf: Vec<u8>,
    seen_runs: HashSet<i32>,
    seen_pids: HashSet<i32>,
}

/// Reads the whole of `file` (a procfs or cgroupfs seq file) from its
/// start into `buf`.
fn read_from_start(file: &File, buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    let mut chunk = [0u8; 4096];
    loop {
        let n = file.read_at(&mut chunk, buf.len() as u64)?;
        buf.extend_from_slice(&chunk[..n]);
        // These are seq files: a read returns all it has up to the size
        // asked for, so a short read is the end (one read per sample).
        if n < chunk.len() {
            return Ok(());
        }
    }
}

impl Sampler {
    /// Resident bytes per target, keyed by group id.
    pub(crate) fn sample(&mut self, targets: &[Target]) -> HashMap<i32, u64> {
        let mut sums = HashMap::new();
        let mut by_group = Vec::new();
        self.seen_runs.clear();
        self.seen_pids.clear();
        for (pgid, cgroup) in targets {
            match cgroup {
                Some(cgroup) => {
                    let bytes = self.cgroup_bytes(*pgid, cgroup);
                    sums.insert(*pgid, bytes);
                }
                None => by_group.push(*pgid),
            }
        }
        let (runs, pids) = (&self.seen_runs, &self.seen_pids);
        self.runs.retain(|p, _| runs.contains(p));
        self.statm.retain(|p, _| pids.contains(p));
        if !by_group.is_empty() {
            sums.extend(crate::procfs::group_rss(&by_group));
        }
        sums
    }

    /// The resident bytes of the members of one run's cgroup.
    fn cgroup_bytes(&mut self, pgid: i32, cgroup: &RunCgroup) -> u64 {
        self.seen_runs.insert(pgid);
        let Some(mut run) = self.runs.remove(&pgid).or_else(|| {
            Some(RunFiles {
                procs: File::open(cgroup.procs_path()?).ok()?,
                members: Vec::new(),
                stale_in: 0,
            })
        }) else {
            return 0;
        };
        let mut fresh = false;
        if run.stale_in == 0 {
            fresh = self.read_members(&mut run);
        } else {
            run.stale_in -= 1;
        }
        let mut bytes = self.members_bytes(&run.members);
        if bytes.is_none() && !fresh {
            // A member is gone: the list is out of date now.
            self.read_members(&mut run);
            bytes = self.members_bytes(&run.members);
        }
        self.runs.insert(pgid, run);
        bytes.unwrap_or(0)
    }

    /// Sum over `members`; None when one of them is gone.
    fn members_bytes(&mut self, members: &[i32]) -> Option<u64> {
        let page = crate::procfs::page_size();
        let mut bytes = 0u64;
        let mut all_there = true;
        for &pid in members {
            self.seen_pids.insert(pid);
            match self.resident_pages(pid) {
                Some(pages) => bytes = bytes.saturating_add(pages.saturating_mul(page)),
                None => all_there = false,
            }
        }
        all_there.then_some(bytes)
    }

    /// Reads the run's `cgroup.procs`; false when it cannot be read (the
    /// members are then none).
    fn read_members(&mut self, run: &mut RunFiles) -> bool {
        run.stale_in = MEMBERS_EVERY - 1;
        run.members.clear();
        if read_from_start(&run.procs, &mut self.buf).is_err() {
            return false;
        }
        run.members.extend(
            self.buf
                .split(|b| *b == b'\n')
                .filter_map(|l| std::str::from_utf8(l).ok()?.trim().parse::<i32>().ok()),
        );
        true
    }

    /// The second field of `/proc/PID/statm`; None once the process is
    /// gone (an open statm of a dead process reads as an error, never as
    /// the process that reused its pid).
    fn resident_pages(&mut self, pid: i32) -> Option<u64> {
        let file = match self.statm.entry(pid) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(File::open(format!("/proc/{pid}/statm")).ok()?),
        };
        if read_from_start(file, &mut self.buf).is_err() {
            self.statm.remove(&pid);
            return None;
        }
        std::str::from_utf8(&self.buf)
            .ok()
            .and_then(|t| t.split_whitespace().nth(1)?.parse().ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rereads_its_own_statm_in_place() {
        let mut s = Sampler::default();
        let me = std::process::id() as i32;
        let before = s.resident_pages(me).expect("own statm");
        assert!(before > 0);
        // Touch 16 MiB; the same open file shows it.
        let big = std::hint::black_box(vec![1u8; 16 << 20]);
        let after = s.resident_pages(me).expect("own statm");
        assert!(
            after >= before + (12 << 20) / crate::procfs::page_size(),
            "{before} -> {after} pages"
        );
        assert_eq!(s.statm.len(), 1, "one file, kept open");
        drop(big);
    }
}
