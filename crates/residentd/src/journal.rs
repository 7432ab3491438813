//! The journal of instances that should be running, under `state_dir`.
//! After a restart the agent takes over the journaled instances whose
//! processes still run (`instances_outlive_agent`), kills what else its
//! previous run left behind, and starts the rest again, in their original
//! order.
//!
//! Format: a header line `# residentd journal 7`, then one line per change,
//! tab-separated. An instance's line (put, or replace in place):
//! `instance_id  workload  pgid  start_ticks  lease_ms [adopted port |
//! run port restarts [choice]]` (pgid 0: not spawned yet; lease 0: none; a
//! line without the lease, from before leases, reads as none; an adopted
//! instance's pgid is its pid; `run port restarts`: the port of a spawned
//! run and the instance's restarts so far, which a takeover needs: a line
//! without them, from before format 5, is never taken over; `choice`: the
//! pools chosen for its any-of demands, `a,b;c` for two labels, which a
//! takeover keeps; `run-asleep` in place of `run` (format 6): the run
//! was asleep, and a takeover keeps it so; `run-falling` or `run-waking`
//! (format 7): its sleep or wake call was under way, and a takeover makes
//! it again);
//! its removal: `-  instance_id`. A workload's learned footprint
//! (`learn_footprints`): `@  workload  key  pool=bytes ...` (the key a
//! hex digest of what it was learned for, `Workload::footprint_key`; one
//! `pool=bytes` per pool, an any-of demand's under its label), put or
//! replaced whole; its removal: `-@  workload`. Ids, workload and pool
//! names are tokens without tabs, newlines or `=`. A format 2 or 3
//! journal (no learned lines) reads the same.
//!
//! A write appends the lines that changed and syncs the data (one
//! `fdatasync`, no new file or directory entry); every thousand-odd lines
//! the journal is written whole again (write, fsync, rename, fsync of the
//! directory), and so it is at the first write after start and after any
//! failed write, or when the file at the path is no longer the one
//! appended to, as this agent left it. The file is opened for each write,
//! not held open between them. A line cut short by a crash during an
//! append (the last, without its newline) was never acknowledged and is
//! dropped.
//!
//! A damaged journal (garbage, from a newer version) does not stop the
//! agent: what can be read is restored, every line skipped is said, and
//! the file as found is kept aside beside it
//! (`instances.journal.damaged-UNIXTIME`) for the operator.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use resident_supervisor::Leftover;

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
    /// A spawned run's port (0: not known), for its takeover.
    pub port: u16,
    /// The instance's restarts so far (a spawned run's).
    pub restarts: u32,
    /// The pools chosen for each any-of demand, in label order (a spawned
    /// run's; empty when it has none).
    pub chosen: Vec<Vec<String>>,
    /// Where the run stood in its sleep (`[workload.sleep]`).
    pub sleep: Slumber,
}

/// Where a journaled run stood in its sleep (`[workload.sleep]`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Slumber {
    /// Awake (`run`).
    #[default]
    Awake,
    /// Asleep (`run-asleep`): a takeover keeps it so.
    Asleep,
    /// Its sleep call was under way (`run-falling`): the server may be
    /// awake or asleep, and a takeover makes the call again.
    Falling,
    /// Its wake was admitted and under way (`run-waking`): a takeover
    /// makes the wake call again.
    Waking,
}

impl Slumber {
    /// The run's token in a line.
    fn token(self) -> &'static str {
        match self {
            Slumber::Awake => "run",
            Slumber::Asleep => "run-asleep",
            Slumber::Falling => "run-falling",
            Slumber::Waking => "run-waking",
        }
    }

    /// The sleep a run token says; `None` for another token.
    fn of(token: &str) -> Option<Slumber> {
        [
            Slumber::Awake,
            Slumber::Asleep,
            Slumber::Falling,
            Slumber::Waking,
        ]
        .into_iter()
        .find(|s| s.token() == token)
    }
}

/// An adopted instance's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adopted {
    /// Whether the agent may signal it.
    pub manage: bool,
    /// Its readiness port.
    pub port: u16,
}

/// A workload's learned footprint: the high-water bytes measured per pool
/// (an any-of demand's under its label) for the command and files `key`
/// digests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Learned {
    /// The workload.
    pub workload: String,
    /// What it was learned for (`Workload::footprint_key`).
    pub key: u64,
    /// High-water bytes per pool or any-of label.
    pub pools: BTreeMap<String, u64>,
}

/// The format this agent writes; a header with a higher one is from a
/// newer agent.
const FORMAT: u32 = 7;

/// Lines appended since the journal was last written whole, beyond twice
/// the instances it holds, after which it is written whole again.
const APPENDED_AT_MOST: usize = 1024;

/// What a read of the journal found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// The entries it could read, in order.
    pub entries: Vec<Entry>,
    /// The learned footprints it holds, by workload name.
    pub learned: Vec<Learned>,
    /// The lines it skipped: line number and why.
    pub skipped: Vec<(usize, String)>,
    /// The last line had no newline: an append cut short, dropped.
    pub cut_short: bool,
    /// Where the damaged file was kept, when it was.
    pub kept_aside: Option<PathBuf>,
}

/// The journal file.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    /// The file appended to, and what it holds on disk; `None` before the
    /// first write and after a failed one, so the next is whole.
    log: Mutex<Option<Log>>,
}

/// The journal file as this agent last wrote it. It is opened for each
/// append, not held open between writes (an open file would keep its file
/// system from being remounted read-only).
#[derive(Debug)]
struct Log {
    /// Its device, inode and length as written: the path may come to name
    /// another file, or this one changed by another hand.
    id: (u64, u64, u64),
    /// The entries it holds, in order.
    held: Vec<Entry>,
    /// The learned footprints it holds, by workload.
    learned: BTreeMap<String, Learned>,
    /// Its lines, the header aside.
    lines: usize,
}

impl Journal {
    /// The journal in `state_dir`, made (mode 0700) if missing; a state
    /// directory that is not the agent's own, or that its group or others
    /// can write, is refused (`resident_config::private_dir`): a journal
    /// planted there would name process groups for the agent to kill.
    pub fn open(state_dir: &Path) -> std::io::Result<Self> {
        let euid = nix::unistd::geteuid().as_raw();
        resident_config::private_dir::ensure(state_dir, 0o700, euid).map_err(|why| {
            std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!("state_dir: {why}"),
            )
        })?;
        Ok(Self {
            path: state_dir.join("instances.journal"),
            log: Mutex::new(None),
        })
    }

    /// What the journal on disk holds, changing nothing and saying
    /// nothing (a live agent's journal, read by a test or a tool). A
    /// missing file is an empty journal.
    pub fn peek(&self) -> Found {
        std::fs::read(&self.path).map_or_else(|_| Found::default(), |b| scan(&b))
    }

    /// The entries, in order. A missing file is an empty journal; a line
    /// that does not parse, or a file from a newer format, is skipped with
    /// a warning, and a damaged file is kept aside for the operator.
    pub fn read(&self) -> Found {
        let Ok(bytes) = std::fs::read(&self.path) else {
            return Found::default();
        };
        let mut found = scan(&bytes);
        if found.cut_short {
            tracing::warn!(journal = %self.path.display(), "the journal's last line was cut short (a write the agent never acknowledged): dropped");
        }
        if !found.skipped.is_empty() {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let aside = self.path.with_extension(format!("journal.damaged-{stamp}"));
            let (dir, name) = (
                aside.parent().unwrap_or(Path::new(".")),
                aside
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            );
            match crate::state_files::write_new(dir, &name, &bytes) {
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

    /// Makes the journal on disk hold `entries`, in order, and `learned`:
    /// appends the lines that changed since the last write and syncs them,
    /// or, when that cannot be done (see the module's doc), writes it
    /// whole. Nothing is written when nothing changed. One caller at a
    /// time.
    pub fn write(&self, entries: Vec<Entry>, learned: Vec<Learned>) -> std::io::Result<()> {
        let learned: BTreeMap<String, Learned> = learned
            .into_iter()
            .map(|l| (l.workload.clone(), l))
            .collect();
        let mut log = self.log.lock();
        let live = entries.len() + learned.len();
        if let Some(l) = log.as_mut()
            && let Some((mut text, mut n)) = l.delta(&entries)
            && l.lines + n <= APPENDED_AT_MOST + 2 * live
        {
            n += l.learned_delta(&learned, &mut text);
            if n == 0 {
                return Ok(());
            }
            match l.append(&self.path, &text) {
                Some(Ok(())) => {
                    l.held = entries;
                    l.learned = learned;
                    l.lines += n;
                    return Ok(());
                }
                Some(Err(e)) => {
                    // The next write is whole.
                    *log = None;
                    return Err(e);
                }
                // Not the file this agent left: written whole below.
                None => {}
            }
        }
        *log = None;
        *log = Some(self.write_whole(entries, learned)?);
        Ok(())
    }

    /// Replaces the journal with `entries`, atomically (write, fsync,
    /// rename, fsync of the directory), and says what was written, to
    /// append to. The whole text is made first and written with one call.
    fn write_whole(
        &self,
        entries: Vec<Entry>,
        learned: BTreeMap<String, Learned>,
    ) -> std::io::Result<Log> {
        let mut text = format!("# residentd journal {FORMAT}\n");
        for e in &entries {
            put_line(&mut text, e);
        }
        for l in learned.values() {
            put_learned(&mut text, l);
        }
        let tmp = self.path.with_extension("journal.tmp");
        // Left by a write that failed half-way, if any.
        let _ = std::fs::remove_file(&tmp);
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(text.as_bytes())?;
        // The data and its length; the name is made durable below.
        file.sync_data()?;
        std::fs::rename(&tmp, &self.path)?;
        // The rename itself is on disk once the directory is.
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let meta = file.metadata()?;
        Ok(Log {
            id: (meta.dev(), meta.ino(), meta.len()),
            lines: entries.len() + learned.len(),
            held: entries,
            learned,
        })
    }
}

impl Log {
    /// The lines that turn what the file holds into `entries` and how
    /// many; `None` when appending cannot do it (an instance moved in the
    /// order: only removals, changes in place and additions at the end
    /// can be appended).
    fn delta(&self, entries: &[Entry]) -> Option<(String, usize)> {
        let position: HashMap<&str, usize> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.instance.as_str(), i))
            .collect();
        let (mut text, mut n, mut next) = (String::new(), 0, 0);
        for old in &self.held {
            match position.get(old.instance.as_str()) {
                None => {
                    let _ = writeln!(text, "-\t{}", old.instance);
                    n += 1;
                }
                Some(&i) if i == next => {
                    if entries[i] != *old {
                        put_line(&mut text, &entries[i]);
                        n += 1;
                    }
                    next += 1;
                }
                Some(_) => return None,
            }
        }
        // What is left is new: every instance held was met in order above.
        for e in &entries[next..] {
            put_line(&mut text, e);
            n += 1;
        }
        Some((text, n))
    }

    /// Adds to `text` the lines that turn the learned footprints the file
    /// holds into `learned`, and says how many.
    fn learned_delta(&self, learned: &BTreeMap<String, Learned>, text: &mut String) -> usize {
        let mut n = 0;
        for gone in self.learned.keys().filter(|w| !learned.contains_key(*w)) {
            let _ = writeln!(text, "-@\t{gone}");
            n += 1;
        }
        for (w, l) in learned {
            if self.learned.get(w) != Some(l) {
                put_learned(text, l);
                n += 1;
            }
        }
        n
    }

    /// Appends `text` to the journal at `path` and syncs it (the data and
    /// the file's new length). `None` when the file there is not as this
    /// agent left it (gone, moved, replaced or edited by another hand):
    /// the caller writes it whole instead.
    fn append(&mut self, path: &Path, text: &str) -> Option<std::io::Result<()>> {
        let mut file = std::fs::OpenOptions::new().append(true).open(path).ok()?;
        let m = file.metadata().ok()?;
        if (m.dev(), m.ino(), m.len()) != self.id {
            return None;
        }
        if let Err(e) = file.write_all(text.as_bytes()) {
            // No part of a line left behind for a later read (a full
            // disk can take part of a write).
            let _ = file.set_len(self.id.2);
            return Some(Err(e));
        }
        if let Err(e) = file.sync_data() {
            return Some(Err(e));
        }
        self.id.2 += text.len() as u64;
        Some(Ok(()))
    }
}

/// An instance's line, newline included.
fn put_line(text: &mut String, e: &Entry) {
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
        None if e.port != 0 && e.pgid > 0 => {
            let run = e.sleep.token();
            let _ = write!(text, "\t{run}\t{}\t{}", e.port, e.restarts);
            if !e.chosen.is_empty() {
                let choice: Vec<String> = e.chosen.iter().map(|pools| pools.join(",")).collect();
                let _ = write!(text, "\t{}", choice.join(";"));
            }
            writeln!(text)
        }
        None => writeln!(text),
    };
}

/// A learned footprint's line, newline included.
fn put_learned(text: &mut String, l: &Learned) {
    let _ = write!(text, "@\t{}\t{:016x}", l.workload, l.key);
    for (pool, bytes) in &l.pools {
        let _ = write!(text, "\t{pool}={bytes}");
    }
    let _ = writeln!(text);
}

/// One line of the journal.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    /// An instance, put in its place (or at the end when new).
    Put(Entry),
    /// An instance taken out.
    Remove(String),
    /// A workload's learned footprint, put or replaced.
    Learned(Learned),
    /// A workload's learned footprint forgotten.
    Forget(String),
}

/// Reads a journal's bytes: its entries once every line is applied in
/// order, and what could not be read.
fn scan(bytes: &[u8]) -> Found {
    let mut found = Found::default();
    // A last line without its newline is an append cut short by a crash:
    // it was never acknowledged, so it is dropped.
    let whole = match bytes.iter().rposition(|b| *b == b'\n') {
        Some(end) => &bytes[..=end],
        None => &bytes[..0],
    };
    found.cut_short = whole.len() < bytes.len();
    // Entries in their order, a removed one left as a hole; by id, where.
    let mut slots: Vec<Option<Entry>> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    let mut learned: BTreeMap<String, Learned> = BTreeMap::new();
    for (n, line) in whole.split(|b| *b == b'\n').enumerate() {
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
            Some(Line::Put(entry)) => match at.get(&entry.instance) {
                Some(&i) => slots[i] = Some(entry),
                None => {
                    at.insert(entry.instance.clone(), slots.len());
                    slots.push(Some(entry));
                }
            },
            Some(Line::Remove(id)) => {
                if let Some(i) = at.remove(&id) {
                    slots[i] = None;
                }
            }
            Some(Line::Learned(l)) => {
                learned.insert(l.workload.clone(), l);
            }
            Some(Line::Forget(w)) => {
                learned.remove(&w);
            }
            None => {
                let excerpt = resident_core::Excerpt::of(line);
                found
                    .skipped
                    .push((number, format!("cannot be read: {excerpt}")));
            }
        }
    }
    found.entries = slots.into_iter().flatten().collect();
    found.learned = learned.into_values().collect();
    found
}

fn parse(line: &str) -> Option<Line> {
    let mut fields = line.split('\t');
    let first = fields.next()?;
    let second = fields.next()?;
    let third = fields.next();
    if first == "-" && third.is_none() {
        return Some(Line::Remove(second.to_string()));
    }
    if first == "-@" && third.is_none() {
        return Some(Line::Forget(second.to_string()));
    }
    if first == "@" {
        let key = u64::from_str_radix(third?, 16).ok()?;
        let pools = fields
            .map(|f| {
                let (pool, bytes) = f.split_once('=')?;
                Some((pool.to_string(), bytes.parse().ok()?))
            })
            .collect::<Option<BTreeMap<String, u64>>>()?;
        return Some(Line::Learned(Learned {
            workload: second.to_string(),
            key,
            pools,
        }));
    }
    let entry = Entry {
        instance: first.to_string(),
        workload: second.to_string(),
        pgid: third?.parse().ok()?,
        start_ticks: fields.next()?.parse().ok()?,
        // Journals written before leases have four fields.
        lease_ms: match fields.next() {
            Some(ms) => ms.parse().ok()?,
            None => 0,
        },
        adopted: None,
        port: 0,
        restarts: 0,
        chosen: Vec::new(),
        sleep: Slumber::Awake,
    };
    // An adopted instance has two more: how, and its port; a spawned run
    // may have `run`, its port, the restarts so far, and its choice.
    let mut restarts = 0;
    let mut chosen = Vec::new();
    let mut sleep = Slumber::Awake;
    let (adopted, port) = match (fields.next(), fields.next()) {
        (None, _) => (None, 0),
        (Some(run), Some(port)) if Slumber::of(run).is_some() => {
            sleep = Slumber::of(run)?;
            restarts = fields.next()?.parse().ok()?;
            if let Some(choice) = fields.next() {
                chosen = choice
                    .split(';')
                    .map(|pools| pools.split(',').map(str::to_string).collect())
                    .collect();
            }
            (None, port.parse().ok()?)
        }
        (Some(how), Some(port)) => {
            let manage = match how {
                "adopted" => false,
                "adopted-managed" => true,
                _ => return None,
            };
            let port = port.parse().ok()?;
            (Some(Adopted { manage, port }), port)
        }
        (Some(_), None) => return None,
    };
    let entry = Entry {
        adopted,
        port,
        restarts,
        chosen,
        sleep,
        ..entry
    };
    fields.next().is_none().then_some(Line::Put(entry))
}

/// Forgets what an earlier run left in `state_dir`, for an agent that
/// starts afresh (the embedded example: a demo's second run should not
/// bring its first run's instances back): each journaled process group
/// still running is killed, as `kill_leftovers` does (adopted processes
/// are let go), and the directory is removed, to be made anew. Refuses,
/// as `Journal::open` does, a directory that is not the agent's own.
/// Returns how many instances the journal listed.
pub fn start_afresh(state_dir: &Path) -> std::io::Result<usize> {
    if !state_dir.exists() {
        return Ok(0);
    }
    let entries = Journal::open(state_dir)?.peek().entries;
    kill_leftovers(&entries);
    std::fs::remove_dir_all(state_dir)?;
    Ok(entries.len())
}

/// SIGKILLs what is left of each entry's process group from a previous
/// run (`resident_supervisor::kill_leftovers`); adopted processes are
/// never touched. Returns how many processes were signalled.
pub fn kill_leftovers(entries: &[Entry]) -> usize {
    let groups: Vec<Leftover> = entries
        .iter()
        .filter(|e| e.adopted.is_none())
        .map(|e| Leftover {
            pgid: e.pgid,
            start_ticks: e.start_ticks,
        })
        .collect();
    resident_supervisor::kill_leftovers(&groups)
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
                port: 8081,
                restarts: 2,
                chosen: vec![vec!["gpu1".into(), "gpu3".into()], vec!["host".into()]],
                sleep: Slumber::Asleep,
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
                port: 8080,
                restarts: 0,
                chosen: Vec::new(),
                sleep: Slumber::Awake,
            },
            Entry {
                instance: "a".into(),
                workload: "v".into(),
                pgid: 0,
                start_ticks: 0,
                lease_ms: 0,
                adopted: None,
                port: 0,
                restarts: 0,
                chosen: Vec::new(),
                sleep: Slumber::Awake,
            },
        ];
        j.write(entries.clone(), Vec::new()).expect("write");
        let found = j.read();
        assert_eq!(found.entries, entries);
        assert!(found.skipped.is_empty() && found.kept_aside.is_none());
        assert_eq!(parse("a\tb\tnot-a-number\t0"), None);
        assert_eq!(parse("a\tb\t1\t2\t3\textra"), None);
        assert_eq!(parse("a\tb\t1\t2\t3\tadopted\t80\textra"), None);
        assert_eq!(parse("a\tb\t1\t2\t3\tkidnapped\t80"), None);
        let Some(Line::Put(adopted)) = parse("a\tb\t1\t2\t0\tadopted\t0") else {
            panic!("an adopted line");
        };
        assert_eq!(adopted.adopted.map(|a| a.manage), Some(false));
        // A journal from before leases: four fields, no lease.
        let Some(Line::Put(old)) = parse("a\tb\t1\t2") else {
            panic!("a line of four fields");
        };
        assert_eq!((old.lease_ms, old.port), (0, 0));
        // A spawned run's port (format 5), which a takeover needs.
        let Some(Line::Put(run)) = parse("a\tb\t1\t2\t0\trun\t8090\t3") else {
            panic!("a line with its run's port and restarts");
        };
        assert_eq!((run.port, run.restarts, run.adopted), (8090, 3, None));
        // A sleep or wake under way (format 7).
        for (token, sleep) in [
            ("run-falling", Slumber::Falling),
            ("run-waking", Slumber::Waking),
        ] {
            let Some(Line::Put(moving)) = parse(&format!("a\tb\t1\t2\t0\t{token}\t8090\t0")) else {
                panic!("a line with {token}");
            };
            assert_eq!(moving.sleep, sleep);
            let mut text = String::new();
            put_line(&mut text, &moving);
            assert!(text.contains(&format!("\t{token}\t")), "{text}");
        }
        assert_eq!(parse("a\tb\t1\t2\t0\trun-dozing\t8090\t0"), None);
        assert_eq!(parse("a\tb\t1\t2\t0\trun\tx\t0"), None);
        assert_eq!(parse("a\tb\t1\t2\t0\trun\t8090"), None);
        assert_eq!(parse("-\ta"), Some(Line::Remove("a".into())));
        let _ = std::fs::remove_dir_all(dir);
    }

    fn entry(id: &str, pgid: i32) -> Entry {
        Entry {
            instance: id.into(),
            workload: "w".into(),
            pgid,
            start_ticks: 7,
            lease_ms: 0,
            adopted: None,
            port: 0,
            restarts: 0,
            chosen: Vec::new(),
            sleep: Slumber::Awake,
        }
    }

    fn inode(path: &Path) -> u64 {
        std::fs::metadata(path).expect("journal").ino()
    }

    #[test]
    fn changes_are_appended_and_the_journal_is_written_whole_now_and_then() {
        let dir = tempfile::tempdir().expect("tempdir");
        let j = Journal::open(dir.path()).expect("open");
        let path = dir.path().join("instances.journal");
        let text = || std::fs::read_to_string(&path).expect("journal");
        // The first write is whole.
        let mut live = vec![entry("a", 0), entry("b", 0)];
        j.write(live.clone(), Vec::new()).expect("write");
        assert_eq!(
            text(),
            "# residentd journal 7\na\tw\t0\t7\t0\nb\tw\t0\t7\t0\n"
        );
        let first = inode(&path);
        // A change in place, a removal and an addition are appended.
        live = vec![entry("a", 42), entry("c", 0)];
        j.write(live.clone(), Vec::new()).expect("write");
        assert!(
            text().ends_with("b\tw\t0\t7\t0\na\tw\t42\t7\t0\n-\tb\nc\tw\t0\t7\t0\n"),
            "{}",
            text()
        );
        assert_eq!(inode(&path), first, "appended to, not replaced");
        assert_eq!(j.peek().entries, live);
        // Nothing changed: nothing written.
        let before = text();
        j.write(live.clone(), Vec::new()).expect("write");
        assert_eq!(text(), before);
        // An instance that moved in the order: written whole.
        live = vec![entry("c", 0), entry("a", 42)];
        j.write(live.clone(), Vec::new()).expect("write");
        assert_ne!(inode(&path), first, "written whole");
        assert_eq!(j.peek().entries, live);
        // Many changes: the file stays bounded, written whole again now
        // and then, and always reads back as the last write.
        for round in 0..3000 {
            live[0].pgid = round;
            j.write(live.clone(), Vec::new()).expect("write");
        }
        assert_eq!(j.read().entries, live);
        let lines = text().lines().count();
        assert!(
            lines <= APPENDED_AT_MOST + 2 * live.len() + 1,
            "{lines} lines"
        );
        // A journal replaced behind the agent's back is written whole, not
        // appended to a file no longer at its path.
        std::fs::write(&path, "# residentd journal 3\n").expect("replace");
        live[1].pgid = 1;
        j.write(live.clone(), Vec::new()).expect("write");
        assert_eq!(j.peek().entries, live);
    }

    fn learned(workload: &str, key: u64, pools: &[(&str, u64)]) -> Learned {
        Learned {
            workload: workload.into(),
            key,
            pools: pools.iter().map(|(p, b)| (p.to_string(), *b)).collect(),
        }
    }

    #[test]
    fn learned_footprints_are_journaled_replaced_and_forgotten() {
        let dir = tempfile::tempdir().expect("tempdir");
        let j = Journal::open(dir.path()).expect("open");
        let path = dir.path().join("instances.journal");
        let text = || std::fs::read_to_string(&path).expect("journal");
        let live = vec![entry("a", 5)];
        let mut known = vec![learned("w", 0xabc, &[("host", 120_000_000), ("gpu", 7)])];
        j.write(live.clone(), known.clone()).expect("write");
        assert_eq!(
            text(),
            "# residentd journal 7\na\tw\t5\t7\t0\n@\tw\t0000000000000abc\tgpu=7\thost=120000000\n"
        );
        assert_eq!(j.peek().learned, known);
        // A higher figure replaces the line (appended); another workload
        // is added beside it.
        known = vec![
            learned("v", 1, &[("host", 1)]),
            learned("w", 0xabc, &[("host", 130_000_000), ("gpu", 7)]),
        ];
        j.write(live.clone(), known.clone()).expect("write");
        assert!(
            text().ends_with(
                "@\tv\t0000000000000001\thost=1\n@\tw\t0000000000000abc\tgpu=7\thost=130000000\n"
            ),
            "{}",
            text()
        );
        assert_eq!(j.peek().learned, known);
        // Nothing changed: nothing written.
        let before = text();
        j.write(live.clone(), known.clone()).expect("write");
        assert_eq!(text(), before);
        // Forgotten.
        known.remove(1);
        j.write(live.clone(), known.clone()).expect("write");
        assert!(text().ends_with("-@\tw\n"), "{}", text());
        let found = j.read();
        assert_eq!((found.entries, found.learned), (live, known));
        assert!(found.skipped.is_empty());
        // Lines that do not parse are skipped, not taken for zero.
        assert_eq!(parse("@\tw\tnot-hex\thost=1"), None);
        assert_eq!(parse("@\tw\t1\thost"), None);
        assert_eq!(parse("@\tw\t1\thost=-3"), None);
    }

    #[test]
    fn a_last_line_cut_short_is_dropped_not_damage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let j = Journal::open(dir.path()).expect("open");
        let path = dir.path().join("instances.journal");
        std::fs::write(
            &path,
            "# residentd journal 3\na\tw\t0\t7\t0\n-\ta\nb\tw\t0\t7",
        )
        .expect("write");
        let found = j.read();
        assert!(found.entries.is_empty(), "{found:?}");
        assert!(found.cut_short);
        assert!(found.skipped.is_empty() && found.kept_aside.is_none());
        // A format 2 journal reads as before.
        std::fs::write(&path, "# residentd journal 2\na\tw\t5\t7\t0\n").expect("write");
        assert_eq!(j.read().entries, [entry("a", 5)]);
    }
}
