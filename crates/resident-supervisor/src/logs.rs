//! Per-instance log capture: stdout and stderr read by line into a bounded
//! ring (for `tail`) and broadcast to followers. Over-long lines are split,
//! invalid UTF-8 is replaced, and a child that floods its pipes costs the
//! agent no more memory than the ring's bound.
//!
//! A run writes into [`OutputPipes`], whose write ends the agent keeps a
//! copy of for as long as the run lasts. A run's output ends one of two
//! ways. When nothing of the run can be left to write (its cgroup was
//! emptied), the capture is told to read what the pipes hold and stop
//! (`flush`), and the pipes, empty and still open, go to [`PipeSpares`]
//! for a later run: a stop then tears no pipe down and a start makes none.
//! Otherwise (process groups only, or leftovers that outlived the run) the
//! agent drops its write ends and the capture reads to end of file, as
//! long as anything still writes.
//!
//! An instance that outlives the agent writes into named pipes instead
//! (`OutputPipes::named`, one pair per instance in the state directory),
//! which it holds open for reading too: its output waits in them while no
//! agent runs, and the next agent reads on from the same paths.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd as _, OwnedFd};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::net::unix::pipe;
use tokio::sync::{broadcast, oneshot};

/// Which pipe a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// One captured line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// Position in this instance's log, from 1, across restarts.
    pub seq: u64,
    /// The pipe.
    pub stream: Stream,
    /// The text, without its newline.
    pub line: String,
}

/// Bounds of one ring.
#[derive(Debug, Clone, Copy)]
pub struct LogLimits {
    /// Lines kept for `tail`.
    pub lines: usize,
    /// Bytes of text kept for `tail`.
    pub bytes: usize,
    /// Longer lines are split at this many bytes.
    pub max_line: usize,
    /// Lines a follower may fall behind before it is told it lagged.
    pub follow_buffer: usize,
}

impl Default for LogLimits {
    fn default() -> Self {
        Self {
            lines: 2_000,
            bytes: 1 << 20,
            max_line: 16 << 10,
            follow_buffer: 1_024,
        }
    }
}

#[derive(Debug, Default)]
struct Ring {
    lines: VecDeque<LogLine>,
    bytes: usize,
    next_seq: u64,
    /// Made when the first follower comes, dropped when the last has gone:
    /// its buffer is allocated whole, which a node of hundreds of quiet
    /// instances should not pay for.
    followers: Option<broadcast::Sender<LogLine>>,
}

/// The log of one instance.
#[derive(Debug)]
pub struct LogRing {
    limits: LogLimits,
    ring: Mutex<Ring>,
    /// Woken at every line (the readiness probe listens: a server's line
    /// often says it now listens).
    wrote: tokio::sync::Notify,
}

/// Bytes read from a pipe at a time.
const CHUNK: usize = 16 << 10;

/// The buffer asked for each pipe of an instance that outlives the agent:
/// what it can write while no agent reads before a write blocks.
pub const OUTLIVE_PIPE_BYTES: usize = 1 << 20;

impl LogRing {
    /// An empty ring.
    pub fn new(limits: LogLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            ring: Mutex::new(Ring::default()),
            wrote: tokio::sync::Notify::new(),
        })
    }

    fn push(&self, stream: Stream, line: String) {
        let mut ring = self.ring.lock();
        ring.next_seq += 1;
        let entry = LogLine {
            seq: ring.next_seq,
            stream,
            line,
        };
        ring.bytes += entry.line.len();
        // Sent under the lock so followers see lines in seq order.
        match &ring.followers {
            Some(tx) if tx.receiver_count() > 0 => {
                let _ = tx.send(entry.clone());
            }
            Some(_) => ring.followers = None,
            None => {}
        }
        ring.lines.push_back(entry);
        while ring.lines.len() > self.limits.lines || ring.bytes > self.limits.bytes {
            match ring.lines.pop_front() {
                Some(old) => ring.bytes -= old.line.len(),
                None => break,
            }
        }
        drop(ring);
        self.wrote.notify_waiters();
    }

    /// Notified at every new line; nothing is stored for a waiter that
    /// comes later.
    pub fn wrote(&self) -> &tokio::sync::Notify {
        &self.wrote
    }

    /// The last `n` lines, oldest first.
    pub fn tail(&self, n: usize) -> Vec<LogLine> {
        let ring = self.ring.lock();
        let skip = ring.lines.len().saturating_sub(n);
        ring.lines.iter().skip(skip).cloned().collect()
    }

    /// The last `n` lines and a subscription to every later line, with no
    /// gap and no repeat between the two.
    pub fn tail_and_follow(&self, n: usize) -> (Vec<LogLine>, broadcast::Receiver<LogLine>) {
        let mut ring = self.ring.lock();
        let buffer = self.limits.follow_buffer.max(1);
        let rx = ring
            .followers
            .get_or_insert_with(|| broadcast::channel(buffer).0)
            .subscribe();
        let skip = ring.lines.len().saturating_sub(n);
        (ring.lines.iter().skip(skip).cloned().collect(), rx)
    }

    /// Bytes of text held now (at most `limits.bytes`).
    pub fn held_bytes(&self) -> usize {
        self.ring.lock().bytes
    }

    /// Reads a run's stdout and stderr, line by line, into the ring: one
    /// task for both pipes. It ends at end of file on both, or when
    /// `flush` fires: then it reads what the pipes hold now (with a system
    /// call, not trusting readiness the reactor may not have seen yet),
    /// ends each pipe's last line, and hands both pipes back for another
    /// run. A dropped `flush` means none will come: read to end of file.
    /// Nothing is held for a pipe while it is quiet: the read buffer lives
    /// on the stack of the call that drains what is ready.
    pub async fn capture(
        self: Arc<Self>,
        stdout: pipe::Receiver,
        stderr: pipe::Receiver,
        flush: oneshot::Receiver<()>,
    ) -> Option<[pipe::Receiver; 2]> {
        let mut pipes = [(Stream::Stdout, stdout), (Stream::Stderr, stderr)]
            .map(|(stream, pipe)| (stream, Some(pipe), Lines::new(self.limits.max_line)));
        let mut flush = Some(flush);
        loop {
            let readable = async {
                match (&pipes[0].1, &pipes[1].1) {
                    (None, None) => None,
                    (Some(out), None) => Some(out.readable().await),
                    (None, Some(err)) => Some(err.readable().await),
                    (Some(out), Some(err)) => Some(tokio::select! {
                        r = out.readable() => r,
                        r = err.readable() => r,
                    }),
                }
            };
            let flushed = async {
                match flush.as_mut() {
                    Some(f) => f.await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            let ready = tokio::select! {
                ready = readable => match ready {
                    Some(ready) => ready,
                    None => return None,
                },
                asked = flushed => {
                    flush = None;
                    if asked {
                        return self.read_out(pipes);
                    }
                    continue;
                }
            };
            // Both are read: a pipe not ready costs nothing (tokio knows it
            // is not, and makes no system call). When the wait itself
            // failed (the runtime is going), what was read is kept.
            for (stream, pipe, lines) in &mut pipes {
                let Some(p) = pipe else { continue };
                let open = matches!(self.drain(|b| p.try_read(b), *stream, lines), Ok(true));
                if !open || ready.is_err() {
                    lines.finish(&self, *stream);
                    *pipe = None;
                }
            }
        }
    }

    /// Reads everything the pipes hold now and ends each one's last line;
    /// the pipes back when both are still open (no end of file, no error).
    fn read_out(
        &self,
        pipes: [(Stream, Option<pipe::Receiver>, Lines); 2],
    ) -> Option<[pipe::Receiver; 2]> {
        let [out, err] = pipes.map(|(stream, pipe, mut lines)| {
            let pipe = pipe.filter(|p| {
                // A system call per read: the reactor may not have seen
                // the last writes yet.
                let read = |b: &mut [u8]| nix::unistd::read(p.as_fd(), b).map_err(io::Error::from);
                matches!(self.drain(read, stream, &mut lines), Ok(true))
            });
            lines.finish(self, stream);
            pipe
        });
        Some([out?, err?])
    }

    /// Feeds what `read` gives until the pipe behind it is empty (would
    /// block); false at its end.
    fn drain(
        &self,
        mut read: impl FnMut(&mut [u8]) -> io::Result<usize>,
        stream: Stream,
        lines: &mut Lines,
    ) -> io::Result<bool> {
        let mut chunk = [0u8; CHUNK];
        loop {
            match read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => lines.feed(self, stream, &chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Adds the lines of `bytes` (a last line without a newline included).
    pub fn push_bytes(&self, stream: Stream, bytes: &[u8]) {
        let mut lines = Lines::new(self.limits.max_line);
        lines.feed(self, stream, bytes);
        lines.finish(self, stream);
    }
}

/// The two pipes a run writes its output into: the agent's read ends
/// (registered with the runtime) and its own copies of the write ends,
/// which the child gets as stdout and stderr. The copies keep a pipe open
/// between its writers, so that one pipe can serve run after run.
#[derive(Debug)]
pub struct OutputPipes {
    readers: [pipe::Receiver; 2],
    writers: [Arc<OwnedFd>; 2],
}

impl OutputPipes {
    /// Two new pipes (within a runtime).
    pub fn new() -> io::Result<Self> {
        let make = || -> io::Result<(pipe::Receiver, Arc<OwnedFd>)> {
            let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
            Ok((pipe::Receiver::from_owned_fd(r)?, Arc::new(w)))
        };
        let (stdout, out_w) = make()?;
        let (stderr, err_w) = make()?;
        Ok(Self {
            readers: [stdout, stderr],
            writers: [out_w, err_w],
        })
    }

    /// The pipes of instance `id` that outlive the agent: named pipes
    /// `ID.stdout` and `ID.stderr` in `dir`, made when missing (or when
    /// something else is at the path). The write ends are opened for
    /// reading and writing, so a child holding them is a reader of its own
    /// pipes: while no agent reads, a write never meets a pipe without a
    /// reader (no EPIPE, no SIGPIPE), and what is written stays in the
    /// pipe, whose buffer is raised to `OUTLIVE_PIPE_BYTES` where the
    /// kernel allows (beyond that a write blocks, it never loses a byte).
    /// The next agent opens the same paths and reads on from there.
    pub fn named(dir: &std::path::Path, id: &str) -> io::Result<Self> {
        use nix::fcntl::{FcntlArg, OFlag, fcntl, open};
        use nix::sys::stat::{Mode, fstat, lstat};
        use std::os::unix::fs::DirBuilderExt as _;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let euid = nix::unistd::geteuid().as_raw();
        // A named pipe the agent may reuse: a FIFO of its own user that no
        // one else can open (never a link, a file, or another user's pipe).
        let ours = |st: &nix::sys::stat::FileStat| {
            st.st_mode & nix::libc::S_IFMT == nix::libc::S_IFIFO
                && st.st_uid == euid
                && st.st_mode & 0o077 == 0
        };
        let make = |stream: &str| -> io::Result<(pipe::Receiver, Arc<OwnedFd>)> {
            let path = dir.join(format!("{id}.{stream}"));
            if !lstat(&path).is_ok_and(|st| ours(&st)) {
                let _ = std::fs::remove_file(&path);
                nix::unistd::mkfifo(&path, Mode::S_IRUSR | Mode::S_IWUSR)
                    .map_err(|e| io::Error::other(format!("{}: {e}", path.display())))?;
            }
            let at = |e: nix::errno::Errno| io::Error::other(format!("{}: {e}", path.display()));
            let nofollow = OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            let writer = open(&path, OFlag::O_RDWR | nofollow, Mode::empty()).map_err(at)?;
            // What was opened is what was checked (nothing swapped in
            // between).
            if !fstat(&writer).is_ok_and(|st| ours(&st)) {
                return Err(io::Error::other(format!(
                    "{} is not a named pipe of the agent's own",
                    path.display()
                )));
            }
            let size = i32::try_from(OUTLIVE_PIPE_BYTES).unwrap_or(i32::MAX);
            if let Err(e) = fcntl(&writer, FcntlArg::F_SETPIPE_SZ(size)) {
                tracing::debug!(pipe = %path.display(), error = %e, "cannot raise the pipe's buffer; it keeps the kernel's default");
            }
            let reader = open(
                &path,
                OFlag::O_RDONLY | OFlag::O_NONBLOCK | nofollow,
                Mode::empty(),
            )
            .map_err(at)?;
            Ok((pipe::Receiver::from_owned_fd(reader)?, Arc::new(writer)))
        };
        let (stdout, out_w) = make("stdout")?;
        let (stderr, err_w) = make("stderr")?;
        Ok(Self {
            readers: [stdout, stderr],
            writers: [out_w, err_w],
        })
    }

    /// Removes instance `id`'s named pipes from `dir` (its last run has
    /// ended).
    pub fn remove_named(dir: &std::path::Path, id: &str) {
        for stream in ["stdout", "stderr"] {
            let _ = std::fs::remove_file(dir.join(format!("{id}.{stream}")));
        }
    }

    /// The write ends, for stdout and stderr.
    pub fn writers(&self) -> [Arc<OwnedFd>; 2] {
        self.writers.clone()
    }

    /// The read ends, and the write ends apart: what a run's capture reads
    /// and what the agent holds meanwhile.
    pub fn split(self) -> ([pipe::Receiver; 2], [Arc<OwnedFd>; 2]) {
        (self.readers, self.writers)
    }

    /// Whole again, from what `split` gave.
    pub fn join(readers: [pipe::Receiver; 2], writers: [Arc<OwnedFd>; 2]) -> Self {
        Self { readers, writers }
    }
}

/// Emptied pipes kept for later runs, at most `bound` pairs.
#[derive(Debug)]
pub struct PipeSpares {
    spares: Mutex<Vec<OutputPipes>>,
    bound: usize,
}

impl PipeSpares {
    /// No spares yet; at most `bound` kept.
    pub fn new(bound: usize) -> Self {
        Self {
            spares: Mutex::new(Vec::new()),
            bound,
        }
    }

    fn spares(&self) -> parking_lot::MutexGuard<'_, Vec<OutputPipes>> {
        self.spares.lock()
    }

    /// A spare pair, or new pipes.
    pub fn take(&self) -> io::Result<OutputPipes> {
        match self.spares().pop() {
            Some(pipes) => Ok(pipes),
            None => OutputPipes::new(),
        }
    }

    /// Keeps `pipes` for a later run, which only pipes no process can
    /// still write to may be (past the bound they are closed).
    pub fn put(&self, pipes: OutputPipes) {
        let mut spares = self.spares();
        if spares.len() < self.bound {
            spares.push(pipes);
        }
    }
}

/// Cuts a byte stream into lines of at most `max` bytes.
#[derive(Debug)]
struct Lines {
    pending: Vec<u8>,
    max: usize,
}

impl Lines {
    fn new(max: usize) -> Self {
        Self {
            pending: Vec::new(),
            max: max.max(1),
        }
    }

    fn feed(&mut self, ring: &LogRing, stream: Stream, mut rest: &[u8]) {
        while !rest.is_empty() {
            let room = self.max - self.pending.len();
            let window = &rest[..rest.len().min(room)];
            match window.iter().position(|b| *b == b'\n') {
                Some(i) => {
                    self.pending.extend_from_slice(&window[..i]);
                    self.emit(ring, stream);
                    rest = &rest[i + 1..];
                }
                None => {
                    self.pending.extend_from_slice(window);
                    rest = &rest[window.len()..];
                    if self.pending.len() == self.max {
                        self.emit(ring, stream);
                    }
                }
            }
        }
        if self.pending.is_empty() && self.pending.capacity() > 1024 {
            // A long line passed; a quiet instance keeps no big buffer.
            self.pending = Vec::new();
        }
    }

    fn finish(&mut self, ring: &LogRing, stream: Stream) {
        if !self.pending.is_empty() {
            self.emit(ring, stream);
        }
    }

    fn emit(&mut self, ring: &LogRing, stream: Stream) {
        if self.pending.last() == Some(&b'\r') {
            self.pending.pop();
        }
        let line = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        ring.push(stream, line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(lines: usize, bytes: usize, max_line: usize) -> Arc<LogRing> {
        LogRing::new(LogLimits {
            lines,
            bytes,
            max_line,
            follow_buffer: 16,
        })
    }

    async fn feed(r: &Arc<LogRing>, input: &[u8]) {
        r.push_bytes(Stream::Stdout, input);
    }

    fn texts(lines: Vec<LogLine>) -> Vec<String> {
        lines.into_iter().map(|l| l.line).collect()
    }

    #[tokio::test]
    async fn splits_lines_long_lines_and_replaces_bad_utf8() {
        let r = ring(100, 1 << 20, 4);
        feed(&r, b"ab\ncdefgh\r\n\xffz\nlast").await;
        assert_eq!(texts(r.tail(10)), ["ab", "cdef", "gh", "\u{fffd}z", "last"]);
    }

    #[tokio::test]
    async fn keeps_the_last_lines_within_both_bounds() {
        let r = ring(3, 1 << 20, 64);
        feed(&r, b"1\n2\n3\n4\n5\n").await;
        assert_eq!(texts(r.tail(10)), ["3", "4", "5"]);
        assert_eq!(texts(r.tail(2)), ["4", "5"]);
        let r = ring(100, 6, 64);
        feed(&r, b"aaa\nbbb\nccc\n").await;
        assert_eq!(texts(r.tail(10)), ["bbb", "ccc"]);
        assert!(r.held_bytes() <= 6);
    }

    #[tokio::test]
    async fn one_capture_reads_both_pipes_to_their_ends_whichever_closes_first() {
        use tokio::io::AsyncWriteExt as _;
        let r = ring(100, 1 << 20, 64);
        let (mut out_tx, out_rx) = pipe::pipe().expect("pipe");
        let (mut err_tx, err_rx) = pipe::pipe().expect("pipe");
        // No flush will come: the capture reads to the end of both.
        let (_, flushed) = oneshot::channel();
        let capture = tokio::spawn(r.clone().capture(out_rx, err_rx, flushed));
        err_tx.write_all(b"e1\ne2 unfinished").await.expect("write");
        drop(err_tx);
        // Read on with stderr closed: the capture goes on with stdout.
        out_tx.write_all(b"o1\n").await.expect("write");
        lines(&r, 3).await;
        out_tx.write_all(b"o2\n").await.expect("write");
        drop(out_tx);
        let handed_back = tokio::time::timeout(std::time::Duration::from_secs(10), capture)
            .await
            .expect("the capture ends when both pipes have")
            .expect("capture");
        assert!(
            handed_back.is_none(),
            "pipes at their end are not handed back"
        );
        assert_eq!(
            by_stream(&r),
            [
                (Stream::Stdout, "o1".to_string()),
                (Stream::Stdout, "o2".to_string()),
                (Stream::Stderr, "e1".to_string()),
                (Stream::Stderr, "e2 unfinished".to_string()),
            ]
        );
    }

    /// The ring's lines with their pipe, stdout's first (the order between
    /// two pipes is the reader's, each pipe's own is kept).
    fn by_stream(r: &LogRing) -> Vec<(Stream, String)> {
        let mut lines: Vec<(Stream, String)> = r
            .tail(100)
            .into_iter()
            .map(|l| (l.stream, l.line))
            .collect();
        lines.sort_by_key(|(s, _)| *s == Stream::Stderr);
        lines
    }

    /// Waits until the ring holds `n` lines.
    async fn lines(r: &LogRing, n: usize) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            // Enabled before the look, so a line pushed in between wakes it.
            let wrote = r.wrote().notified();
            tokio::pin!(wrote);
            wrote.as_mut().enable();
            if r.tail(usize::MAX).len() >= n {
                return;
            }
            let waited = tokio::time::timeout_at(deadline, wrote).await;
            assert!(waited.is_ok(), "not {n} lines: {:?}", r.tail(10));
        }
    }

    #[tokio::test]
    async fn a_flushed_capture_reads_what_is_left_and_hands_the_pipes_to_the_next_run() {
        let spares = PipeSpares::new(1);
        let first = ring(100, 1 << 20, 64);
        let pipes = spares.take().expect("pipes");
        let [out_w, err_w] = pipes.writers();
        let ([out, err], writers) = pipes.split();
        let (flush, flushed) = oneshot::channel();
        let capture = tokio::spawn(first.clone().capture(out, err, flushed));
        // What a run wrote, read while it runs...
        nix::unistd::write(&*out_w, b"seen\n").expect("write");
        lines(&first, 1).await;
        // ...and what it wrote last, maybe unseen by the reactor yet, with
        // a last line that has no newline: the flush reads both.
        nix::unistd::write(&*out_w, b"last\npartial").expect("write");
        nix::unistd::write(&*err_w, b"err tail").expect("write");
        flush.send(()).expect("the capture waits for the flush");
        let readers = tokio::time::timeout(std::time::Duration::from_secs(10), capture)
            .await
            .expect("a flushed capture ends")
            .expect("capture")
            .expect("open pipes are handed back");
        assert_eq!(
            by_stream(&first),
            [
                (Stream::Stdout, "seen".to_string()),
                (Stream::Stdout, "last".to_string()),
                (Stream::Stdout, "partial".to_string()),
                (Stream::Stderr, "err tail".to_string()),
            ]
        );
        // The same pipes, spare, then a new run's: it reads only its own.
        spares.put(OutputPipes::join(readers, writers));
        let again = spares.take().expect("the spare");
        let [out_w2, _] = again.writers();
        assert!(Arc::ptr_eq(&out_w, &out_w2), "the spare pair is reused");
        let second = ring(100, 1 << 20, 64);
        let ([out, err], _writers) = again.split();
        let (_flush, flushed) = oneshot::channel();
        let _capture = tokio::spawn(second.clone().capture(out, err, flushed));
        nix::unistd::write(&*out_w2, b"next run\n").expect("write");
        lines(&second, 1).await;
        assert_eq!(texts(second.tail(10)), ["next run"]);
    }

    #[tokio::test]
    async fn spares_past_the_bound_are_closed() {
        let spares = PipeSpares::new(1);
        let (a, b) = (
            OutputPipes::new().expect("a"),
            OutputPipes::new().expect("b"),
        );
        let [a_w, _] = a.writers();
        let [b_w, _] = b.writers();
        spares.put(a);
        spares.put(b);
        let kept = spares.take().expect("the spare");
        let [kept_w, _] = kept.writers();
        assert!(Arc::ptr_eq(&kept_w, &a_w));
        // The pair past the bound was dropped: its write end is ours alone.
        assert_eq!(Arc::strong_count(&b_w), 1);
        let fresh = spares.take().expect("new pipes once none is spare");
        let [fresh_w, _] = fresh.writers();
        assert!(!Arc::ptr_eq(&fresh_w, &a_w));
    }

    #[tokio::test]
    async fn followers_continue_where_the_tail_ends() {
        let r = ring(100, 1 << 20, 64);
        feed(&r, b"old\n").await;
        let (tail, mut rx) = r.tail_and_follow(5);
        feed(&r, b"new\n").await;
        assert_eq!(texts(tail), ["old"]);
        let next = rx.recv().await.expect("a followed line");
        assert_eq!((next.seq, next.line.as_str()), (2, "new"));
    }
}
