//! Sampling the resident bytes of running instances. The files read every
//! period (each run's `cgroup.procs`, each member's `/proc/PID/statm`) are
//! kept open between samples and re-read in place, so a node of hundreds
//! of idle instances costs one small read per process per period, not an
//! open, a stat, reads and a close.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt as _;
use std::sync::Arc;

use crate::cgroup::RunCgroup;

/// What one instance is measured by: its cgroup, or its process group.
pub(crate) type Target = (i32, Option<Arc<RunCgroup>>);

/// Open files, kept from one sample to the next.
#[derive(Debug, Default)]
pub(crate) struct Sampler {
    /// A run's `cgroup.procs`, by its group id (one run, one cgroup).
    procs: HashMap<i32, File>,
    statm: HashMap<i32, File>,
    buf: Vec<u8>,
    members: Vec<i32>,
    seen_procs: HashSet<i32>,
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
        let page = crate::procfs::page_size();
        let mut sums = HashMap::new();
        let mut by_group = Vec::new();
        self.seen_procs.clear();
        self.seen_pids.clear();
        let mut members = std::mem::take(&mut self.members);
        for (pgid, cgroup) in targets {
            let Some(cgroup) = cgroup else {
                by_group.push(*pgid);
                continue;
            };
            self.read_members(*pgid, cgroup, &mut members);
            self.seen_procs.insert(*pgid);
            let mut bytes = 0u64;
            for &pid in &members {
                bytes = bytes.saturating_add(self.resident_pages(pid).saturating_mul(page));
                self.seen_pids.insert(pid);
            }
            sums.insert(*pgid, bytes);
        }
        self.members = members;
        let (procs, pids) = (&self.seen_procs, &self.seen_pids);
        self.procs.retain(|p, _| procs.contains(p));
        self.statm.retain(|p, _| pids.contains(p));
        if !by_group.is_empty() {
            sums.extend(crate::procfs::group_rss(&by_group));
        }
        sums
    }

    /// The pids in the run's `cgroup.procs`, into `out`.
    fn read_members(&mut self, pgid: i32, cgroup: &RunCgroup, out: &mut Vec<i32>) {
        out.clear();
        let open = || File::open(cgroup.procs_path()?).ok();
        if read_cached(&mut self.procs, &mut self.buf, pgid, open) {
            out.extend(
                self.buf
                    .split(|b| *b == b'\n')
                    .filter_map(|l| std::str::from_utf8(l).ok()?.trim().parse::<i32>().ok()),
            );
        }
    }

    /// The second field of `/proc/PID/statm`; 0 once the process is gone
    /// (an open statm of a dead process reads as an error, never as the
    /// process that reused its pid).
    fn resident_pages(&mut self, pid: i32) -> u64 {
        let open = || File::open(format!("/proc/{pid}/statm")).ok();
        if !read_cached(&mut self.statm, &mut self.buf, pid, open) {
            return 0;
        }
        std::str::from_utf8(&self.buf)
            .ok()
            .and_then(|t| t.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0)
    }
}

/// Reads the file cached under `key` (opened with `open` the first time)
/// into `buf`; false, and the file forgotten, when it cannot be read.
fn read_cached(
    files: &mut HashMap<i32, File>,
    buf: &mut Vec<u8>,
    key: i32,
    open: impl FnOnce() -> Option<File>,
) -> bool {
    let file = match files.entry(key) {
        Entry::Occupied(e) => e.into_mut(),
        Entry::Vacant(v) => match open() {
            Some(f) => v.insert(f),
            None => return false,
        },
    };
    if read_from_start(file, buf).is_ok() {
        return true;
    }
    files.remove(&key);
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rereads_its_own_statm_in_place() {
        let mut s = Sampler::default();
        let me = std::process::id() as i32;
        let before = s.resident_pages(me);
        assert!(before > 0);
        // Touch 16 MiB; the same open file shows it.
        let big = vec![1u8; 16 << 20];
        let after = s.resident_pages(me);
        assert!(
            after >= before + (12 << 20) / crate::procfs::page_size(),
            "{before} -> {after} pages"
        );
        assert_eq!(s.statm.len(), 1, "one file, kept open");
        drop(big);
    }
}
