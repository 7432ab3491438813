//! The journal of instances that should be running, under `state_dir`,
//! replaced atomically (write, fsync, rename, fsync of the directory) at
//! every change. After a
//! restart the agent kills what its previous run left behind and starts the
//! journaled instances again, in their original order.
//!
//! Format: a header line `# residentd journal 2`, then one instance per
//! line, tab-separated:
//! `instance_id  workload  pgid  start_ticks  lease_ms [adopted port]`
//! (pgid 0: not spawned yet; lease 0: none; a line without the lease, from
//! before leases, reads as none; an adopted instance's pgid is its pid).
//! Ids and workload names are tokens without tabs or newlines.
//!
//! A damaged journal (cut short, garbage, from a newer version) does not
//! stop the agent: what can be read is restored, every line skipped is
//! said, and the file as found is kept aside beside it
//! (`instances.journal.damaged-UNIXTIME`) for the operator.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;
use resident_supervisor::procfs;

/// One journaled instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The instance.
    pub instance: String,
    /// Its workload.
    pub workload: String,
    /// Its process group, 0 when none.
    pub pgid: i32,
    /// The group leader's start time, against pid reuse.
    pub start_ticks: u64,
    /// The owner's lease in milliseconds, 0 for none.
    pub lease_ms: u64,
    /// Entered by Adopt (its process is `pgid`, started at `start_ticks`):
    /// re-adopted, never killed, by the next agent.
    pub adopted: Option<Adopted>,
}

/// An adopted instance's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adopted {
    /// Whether the agent may signal it.
    pub manage: bool,
    /// Its readiness port.
    pub port: u16,
}

/// The format this agent writes; a header with a higher one is from a
/// newer agent.
const FORMAT: u32 = 2;

/// What a read of the journal found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// The entries it could read, in order.
    pub entries: Vec<Entry>,
    /// The lines it skipped: line number and why.
    pub skipped: Vec<(usize, String)>,
    /// Where the damaged file was kept, when it was.
    pub kept_aside: Option<PathBuf>,
}

/// The journal file.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
}

impl Journal {
    /// The journal in `state_dir` (created if missing).
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(state_dir)?;
        Ok(Self {
            path: state_dir.join("instances.journal"),
        })
    }

    /// The entries, in order. A missing file is an empty journal; a line
    /// that does not parse, or a file from a newer format, is skipped with
    /// a warning, and a damaged file is kept aside for the operator.
    pub fn read(&self) -> Found {
        let Ok(bytes) = std::fs::read(&self.path) else {
            return Found::default();
        };
        let mut found = Found::default();
        for (n, line) in bytes.split(|b| *b == b'\n').enumerate() {
            let number = n + 1;
            let Ok(line) = std::str::from_utf8(line) else {
                found.skipped.push((number, "not text".into()));
                continue;
            };
            if line.trim().is_empty() {
                continue;
            }
            if let Some(header) = line.strip_prefix("# residentd journal ") {
                match header.trim().parse::<u32>() {
                    Ok(v) if v <= FORMAT => {}
                    Ok(v) => found.skipped.push((
                        number,
                        format!("written by a newer residentd (format {v}, this one reads {FORMAT}); its lines are read as far as they are understood"),
                    )),
                    Err(_) => found.skipped.push((number, "an unreadable header".into())),
                }
                continue;
            }
            match parse(line) {
                Some(entry) => found.entries.push(entry),
                None => {
                    let excerpt = resident_core::Excerpt::of(line);
                    found
                        .skipped
                        .push((number, format!("cannot be read: {excerpt}")));
                }
            }
        }
        if !found.skipped.is_empty() {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let aside = self.path.with_extension(format!("journal.damaged-{stamp}"));
            match std::fs::write(&aside, &bytes) {
                Ok(()) => found.kept_aside = Some(aside),
                Err(e) => {
                    tracing::error!(journal = %self.path.display(), error = %e, "cannot keep the damaged journal aside")
                }
            }
            for (line, why) in &found.skipped {
                tracing::warn!(journal = %self.path.display(), line, "journal line skipped: {why}");
            }
            tracing::warn!(
                journal = %self.path.display(),
                restored = found.entries.len(),
                skipped = found.skipped.len(),
                kept_aside = ?found.kept_aside,
                "the journal was damaged: restoring what could be read"
            );
        }
        found
    }

    /// Replaces the journal with `entries`, atomically: the whole text is
    /// made first and written with one call (a `write!` per field on the
    /// file was a system call per fragment, a thousand per write of a
    /// hundred instances).
    pub fn write(&self, entries: &[Entry]) -> std::io::Result<()> {
        use std::fmt::Write as _;
        let mut text = format!("# residentd journal {FORMAT}\n");
        for e in entries {
            // Writing into a String cannot fail.
            let _ = write!(
                text,
                "{}\t{}\t{}\t{}\t{}",
                e.instance, e.workload, e.pgid, e.start_ticks, e.lease_ms
            );
            let _ = match e.adopted {
                Some(a) => {
                    let how = if a.manage {
                        "adopted-managed"
                    } else {
                        "adopted"
                    };
                    writeln!(text, "\t{how}\t{}", a.port)
                }
                None => writeln!(text),
            };
        }
        let tmp = self.path.with_extension("journal.tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        // The data and its length; the name is made durable below.
        f.sync_data()?;
        std::fs::rename(&tmp, &self.path)?;
        // The rename itself is on disk once the directory is.
        match self.path.parent() {
            Some(dir) => std::fs::File::open(dir)?.sync_all(),
            None => Ok(()),
        }
    }
}

fn parse(line: &str) -> Option<Entry> {
    let mut fields = line.split('\t');
    let entry = Entry {
        instance: fields.next()?.to_string(),
        workload: fields.next()?.to_string(),
        pgid: fields.next()?.parse().ok()?,
        start_ticks: fields.next()?.parse().ok()?,
        // Journals written before leases have four fields.
        lease_ms: match fields.next() {
            Some(ms) => ms.parse().ok()?,
            None => 0,
        },
        adopted: None,
    };
    // An adopted instance has two more: how, and its port.
    let adopted = match (fields.next(), fields.next()) {
        (None, _) => None,
        (Some(how), Some(port)) => Some(Adopted {
            manage: match how {
                "adopted" => false,
                "adopted-managed" => true,
                _ => return None,
            },
            port: port.parse().ok()?,
        }),
        (Some(_), None) => return None,
    };
    let entry = Entry { adopted, ..entry };
    fields.next().is_none().then_some(entry)
}

/// Kills what is left of each entry's process group from a previous run,
/// after one scan of the process table. Returns how many processes were
/// signalled. A group is ours when its leader still runs with the
/// recorded start time, or when the leader is gone but members remain (a
/// live group id cannot be reused as a pid). Adopted processes are never
/// touched.
pub fn kill_leftovers(entries: &[Entry]) -> usize {
    let table = procfs::scan();
    let mut killed = 0;
    for entry in entries {
        if entry.pgid <= 1 || entry.adopted.is_some() {
            continue;
        }
        let leader = table.iter().find(|p| p.pid == entry.pgid);
        if leader.is_some_and(|l| l.start_ticks != entry.start_ticks) {
            continue;
        }
        let members = table
            .iter()
            .filter(|p| p.pgrp == entry.pgid && p.state != 'Z')
            .count();
        if members > 0 {
            let pgid = nix::unistd::Pid::from_raw(entry.pgid);
            let _ = nix::sys::signal::killpg(pgid, Signal::SIGKILL);
            killed += members;
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_damaged_journal_gives_what_it_can_and_is_kept_aside() {
        let dir = tempfile::tempdir().expect("tempdir");
        let j = Journal::open(dir.path()).expect("open");
        let mut damaged = b"# residentd journal 9\na\tw\t0\t0\t0\n".to_vec();
        damaged.extend_from_slice(b"\xff\xfe garbage\nb\tw\t12\nc\tw\t0\t0\t0\n");
        std::fs::write(dir.path().join("instances.journal"), &damaged).expect("write");
        let found = j.read();
        let ids: Vec<&str> = found.entries.iter().map(|e| e.instance.as_str()).collect();
        assert_eq!(ids, ["a", "c"]);
        let lines: Vec<usize> = found.skipped.iter().map(|(n, _)| *n).collect();
        assert_eq!(lines, [1, 3, 4], "{:?}", found.skipped);
        assert!(found.skipped[0].1.contains("newer residentd (format 9"));
        let aside = found.kept_aside.expect("kept aside");
        assert_eq!(
            std::fs::read(aside).expect("read"),
            damaged,
            "kept as found"
        );
    }

    #[test]
    fn writes_and_reads_back_in_order() {
        let dir = std::env::temp_dir().join(format!("journal-test-{}", std::process::id()));
        let j = Journal::open(&dir).expect("open");
        assert_eq!(j.read(), Found::default());
        let entries = vec![
            Entry {
                instance: "b".into(),
                workload: "w".into(),
                pgid: 42,
                start_ticks: 7,
                lease_ms: 30_000,
                adopted: None,
            },
            Entry {
                instance: "c".into(),
                workload: "w".into(),
                pgid: 4242,
                start_ticks: 9,
                lease_ms: 0,
                adopted: Some(Adopted {
                    manage: true,
                    port: 8080,
                }),
            },
            Entry {
                instance: "a".into(),
                workload: "v".into(),
                pgid: 0,
                start_ticks: 0,
                lease_ms: 0,
                adopted: None,
            },
        ];
        j.write(&entries).expect("write");
        let found = j.read();
        assert_eq!(found.entries, entries);
        assert!(found.skipped.is_empty() && found.kept_aside.is_none());
        assert_eq!(parse("a\tb\tnot-a-number\t0"), None);
        assert_eq!(parse("a\tb\t1\t2\t3\textra"), None);
        assert_eq!(parse("a\tb\t1\t2\t3\tadopted\t80\textra"), None);
        assert_eq!(parse("a\tb\t1\t2\t3\tkidnapped\t80"), None);
        let adopted = parse("a\tb\t1\t2\t0\tadopted\t0").expect("an adopted line");
        assert_eq!(adopted.adopted.map(|a| a.manage), Some(false));
        // A journal from before leases: four fields, no lease.
        let old = parse("a\tb\t1\t2").expect("a line of four fields");
        assert_eq!(old.lease_ms, 0);
        let _ = std::fs::remove_dir_all(dir);
    }
}
