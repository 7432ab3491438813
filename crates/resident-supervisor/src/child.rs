//! Spawning and reaping a child without fork: `clone(CLONE_VM |
//! CLONE_VFORK)` (what posix_spawn does inside glibc), so a spawn costs the
//! same however large the agent is, while the child still gets what
//! posix_spawn cannot give: the parent-death signal (unless the instance
//! is to outlive the agent, `Prepared::outlive_agent`). The exit is awaited
//! through a pidfd, so this module is the one owner of reaping its
//! children (tokio never sees them).
//!
//! Everything the child needs is prepared in the parent; the child, which
//! shares the parent's memory until it execs, only makes system calls.
//! It also starts on the parent's descriptor table (`CLONE_FILES`) and
//! first takes one of its own holding only the low descriptors it needs
//! (`close_range` with `CLOSE_RANGE_UNSHARE`; they sit in slots each
//! spawner thread takes when it starts), so a spawn does not copy,
//! then close at exec, every descriptor of an agent that holds several
//! per instance; it then closes the rest of what was copied, so from
//! Linux 5.9 nothing of the agent's but the three streams crosses the
//! exec, even a descriptor opened without close-on-exec (before, the
//! agent's close-on-exec flags decide).
//! The parent blocks every signal around the clone, so no handler of the
//! agent runs in the child; the child resets every handler to the default
//! and unblocks just before exec. Before the exec it also empties every
//! capability set and sets `no_new_privs` (`drop_capabilities`), so no
//! capability of the agent's reaches a model. Each system call has its own `unsafe`
//! block and SAFETY note.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;

use nix::libc;
use nix::sys::signal::{SigSet, SigmaskHow, pthread_sigmask};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use tokio::io::unix::AsyncFd;

/// Stack for the child between clone and exec: it only makes syscalls.
const CHILD_STACK: usize = 64 << 10;

/// A command ready to be spawned: every string already a C string.
#[derive(Debug)]
pub struct Prepared {
    program: CString,
    argv: Vec<CString>,
    envp: Vec<CString>,
    cwd: Option<CString>,
    user: Option<(u32, u32)>,
    /// The supplementary groups it takes with `user`.
    groups: Vec<libc::gid_t>,
    /// `cgroup.procs` of each cgroup the child joins before it execs.
    cgroups: Vec<OwnedFd>,
    /// The write ends its stdout and stderr go to.
    output: [Arc<OwnedFd>; 2],
    /// Whether the child sets its OOM score adjustment back to 0: only
    /// when the agent's own is not 0 (or cannot be read), since the child
    /// inherits it. Left alone, the child never looks up its `/proc/PID`,
    /// whose entries its reaping would otherwise have to invalidate.
    reset_oom: bool,
    /// Whether the child dies with its spawner thread (SIGKILL as its
    /// parent-death signal); off for instances that outlive the agent.
    parent_death: bool,
}

fn c_string(s: impl AsRef<[u8]>, what: &str) -> io::Result<CString> {
    CString::new(s.as_ref().to_vec()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} contains a NUL byte"),
        )
    })
}

/// Finds `program` on `path` (colon-separated; a default system PATH when
/// `None`) unless it names a path: the executable file a spawn would run.
pub fn resolve(program: &str, path: Option<&str>) -> io::Result<PathBuf> {
    if program.contains('/') {
        return Ok(PathBuf::from(program));
    }
    let dirs = path.unwrap_or("/usr/local/bin:/usr/bin:/bin");
    for dir in dirs.split(':').filter(|d| !d.is_empty()) {
        let candidate = Path::new(dir).join(program);
        if nix::unistd::access(&candidate, nix::unistd::AccessFlags::X_OK).is_ok()
            && candidate.is_file()
        {
            return Ok(candidate);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("{program:?} not found on PATH"),
    ))
}

impl Prepared {
    /// Prepares `argv` with environment `env` (the complete environment of
    /// the child), writing its stdout and stderr to `output`; the program
    /// is looked up on the child's `PATH`.
    pub fn new(
        argv: &[String],
        env: &[(String, String)],
        cwd: Option<&Path>,
        user: Option<(u32, u32)>,
        output: [Arc<OwnedFd>; 2],
    ) -> io::Result<Self> {
        let Some(program) = argv.first() else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "empty command line",
            ));
        };
        let path_var = env
            .iter()
            .find(|(k, _)| k == "PATH")
            .map(|(_, v)| v.as_str());
        let program = c_string(
            resolve(program, path_var)?.as_os_str().as_bytes(),
            "the program",
        )?;
        let argv = argv
            .iter()
            .map(|a| c_string(a, "an argument"))
            .collect::<io::Result<_>>()?;
        let envp = env
            .iter()
            .map(|(k, v)| c_string(format!("{k}={v}"), "an environment variable"))
            .collect::<io::Result<_>>()?;
        let cwd = cwd
            .map(|d| c_string(d.as_os_str().as_bytes(), "the working directory"))
            .transpose()?;
        Ok(Self {
            program,
            argv,
            envp,
            cwd,
            user: user.filter(|&target| target != own_identity()),
            groups: Vec::new(),
            cgroups: Vec::new(),
            output,
            reset_oom: crate::procfs::own_oom_score_adj() != Some(0),
            parent_death: true,
        })
    }

    /// The supplementary groups the child takes with its user (none: its
    /// primary group only).
    pub fn with_groups(mut self, groups: &[u32]) -> Self {
        self.groups = groups.iter().map(|g| *g as libc::gid_t).collect();
        self
    }

    /// Lets the child run on when the agent ends (no parent-death signal).
    pub fn outlive_agent(&mut self) {
        self.parent_death = false;
    }

    /// Has the child join the cgroups whose `cgroup.procs` these are.
    pub fn join_cgroups(&mut self, procs: Vec<OwnedFd>) {
        self.cgroups = procs;
    }
}

/// The agent's own effective uid and gid. A child to run as exactly these
/// needs no identity change, and an unprivileged agent could not make one
/// (setgroups needs CAP_SETGID even to name its own group), so it keeps
/// the agent's identity, supplementary groups included.
fn own_identity() -> (u32, u32) {
    (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    )
}

/// The raw result of a clone: pid and start time.
#[derive(Debug)]
pub struct Spawned {
    pid: libc::pid_t,
    start_ticks: Option<u64>,
}

fn pipe_cloexec() -> io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io::Error::from)
}

/// Clones and execs. Blocks the calling thread until the child has exec'd
/// (or failed to): call it from a long-lived spawner thread only.
pub fn clone_exec(p: &Prepared) -> io::Result<Spawned> {
    SLOTS.with_borrow_mut(|slots| clone_exec_with(p, Slots::of(slots)?))
}

/// Takes this thread's low slots for its children's descriptors, unless
/// it has them: a spawner thread calls it as soon as it starts, while
/// the agent's table is small.
pub fn reserve_slots() -> io::Result<()> {
    SLOTS.with_borrow_mut(|slots| Slots::of(slots).map(drop))
}

fn clone_exec_with(p: &Prepared, slots: &mut Slots) -> io::Result<Spawned> {
    let (report_r, report_w) = pipe_cloexec()?;
    let mut argv: Vec<*const libc::c_char> = p.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = p.envp.iter().map(|e| e.as_ptr()).collect();
    envp.push(std::ptr::null());
    // What the child needs, in this thread's low slots; the child keeps
    // only descriptors below `keep_below`.
    let placed = slots.place([
        Some(&*p.output[0]),
        Some(&*p.output[1]),
        Some(&report_w),
        p.cgroups.first(),
        p.cgroups.get(1),
    ])?;
    let fds = ChildFds::new(
        [placed.slots.null.as_raw_fd(), placed.fd(0), placed.fd(1)],
        placed.fd(2),
        [placed.fd(3), placed.fd(4)],
    );
    let parent = nix::unistd::getpid().as_raw();
    let program = p.program.as_ptr();
    let cwd = p.cwd.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    let who = Who {
        user: p.user,
        groups: p.groups.as_ptr(),
        ngroups: p.groups.len(),
        reset_oom: p.reset_oom,
        parent_death: p.parent_death,
    };
    let mut stack = vec![0u8; CHILD_STACK];
    let child = Box::new(move || {
        // SAFETY: runs in the vfork'd child; only system calls on memory
        // prepared above, which the parent keeps alive while suspended.
        unsafe { child_main(parent, program, argv.as_ptr(), envp.as_ptr(), cwd, who, fds) }
    });
    // CLONE_FILES: the child starts on the agent's descriptor table and
    // takes a small one of its own as its first step, instead of the
    // kernel copying the whole table at the clone (and exec closing every
    // copy): a spawn costs the same however many descriptors the agent
    // holds (several per instance).
    let flags = nix::sched::CloneFlags::CLONE_VM
        | nix::sched::CloneFlags::CLONE_VFORK
        | nix::sched::CloneFlags::CLONE_FILES;
    // Every signal blocked across the clone, as posix_spawn does: a
    // handler of the agent must never run in the child, which shares its
    // memory. The child unblocks once it has reset every handler.
    let all = SigSet::all();
    let mut before = SigSet::empty();
    pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&all), Some(&mut before))
        .map_err(io::Error::from)?;
    // SAFETY: CLONE_VM|CLONE_VFORK suspends this thread until the child
    // execs or exits; the child touches only the prepared buffers and
    // makes no allocation.
    let before_clone = boottime_ns();
    let cloned = unsafe { nix::sched::clone(child, &mut stack, flags, Some(libc::SIGCHLD)) };
    let after_clone = boottime_ns();
    pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&before), None).map_err(io::Error::from)?;
    // The slots let go of the spawn's descriptors first: the report
    // pipe's end comes only once no copy of its write end is left.
    drop(placed);
    let pid = cloned.map_err(io::Error::from)?;
    drop(report_w);
    // The report pipe is empty and closed by exec when it succeeded;
    // otherwise the child wrote its errno and the step that failed before
    // exiting.
    let mut report = [0u8; 8];
    let n = nix::unistd::read(&report_r, &mut report).unwrap_or(0);
    if n == 8 {
        let _ = nix::sys::wait::waitpid(pid, None);
        let [e0, e1, e2, e3, s0, s1, s2, s3] = report;
        let errno = i32::from_ne_bytes([e0, e1, e2, e3]);
        let step = Step::of(u32::from_ne_bytes([s0, s1, s2, s3]));
        return Err(failed_spawn(p, step, errno));
    }
    Ok(Spawned {
        pid: pid.as_raw(),
        start_ticks: start_ticks(before_clone, after_clone),
    })
}

/// Low descriptor numbers a spawner thread holds for what its children
/// need, taken when it starts (while the agent's table is still small)
/// and kept: a descriptor opened later takes the lowest free
/// number, which in a busy agent's table is at its top. Between spawns
/// every slot holds `/dev/null`.
#[derive(Debug)]
struct Slots {
    /// `/dev/null`: the child's stdin, and what the other slots hold when
    /// idle.
    null: OwnedFd,
    /// [`HELD`] of them, in the order `place` fills them.
    held: Vec<OwnedFd>,
}

/// How many slots a spawn fills besides `/dev/null`: stdout, stderr, the
/// report pipe and two `cgroup.procs` files.
const HELD: usize = 5;

impl Slots {
    /// The slots in `slot`, taken first if it is empty.
    fn of(slot: &mut Option<Slots>) -> io::Result<&mut Slots> {
        match slot {
            Some(s) => Ok(s),
            None => Ok(slot.insert(Slots::new()?)),
        }
    }

    fn new() -> io::Result<Self> {
        let null = nix::fcntl::open(
            "/dev/null",
            nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(io::Error::from)?;
        let held = (0..HELD)
            .map(|_| null.try_clone())
            .collect::<io::Result<_>>()?;
        Ok(Self { null, held })
    }

    /// Puts each of `fds` (in order: stdout, stderr, report, cgroups) in
    /// a slot; the slots go back to `/dev/null` when the returned guard is
    /// dropped.
    fn place(&mut self, fds: [Option<&OwnedFd>; HELD]) -> io::Result<Placed<'_>> {
        let mut placed = Placed {
            slots: self,
            used: [false; HELD],
        };
        for (i, fd) in fds.into_iter().enumerate() {
            if let Some(fd) = fd {
                let slot = &mut placed.slots.held[i];
                nix::unistd::dup3(fd, slot, nix::fcntl::OFlag::O_CLOEXEC)
                    .map_err(io::Error::from)?;
                placed.used[i] = true;
            }
        }
        Ok(placed)
    }
}

/// The slots while a spawn uses them.
struct Placed<'a> {
    slots: &'a mut Slots,
    used: [bool; HELD],
}

impl Placed<'_> {
    /// Slot `i`'s number while it is in use, else -1.
    fn fd(&self, i: usize) -> RawFd {
        if self.used[i] {
            self.slots.held[i].as_raw_fd()
        } else {
            -1
        }
    }
}

impl Drop for Placed<'_> {
    fn drop(&mut self) {
        let Slots { null, held } = &mut *self.slots;
        for (slot, used) in held.iter_mut().zip(self.used) {
            // Nothing of the spawn stays open in a slot (a pipe's write
            // end would keep its reader from ever seeing the end).
            if used && nix::unistd::dup3(&*null, slot, nix::fcntl::OFlag::O_CLOEXEC).is_err() {
                // Not seen in practice (the slot is open): the slot is
                // given up rather than left holding the spawn's end.
                match null.try_clone() {
                    Ok(fresh) => *slot = fresh,
                    Err(e) => {
                        tracing::error!(error = %e, "a spawn slot cannot be reset; aborting rather than keep a child's pipe open");
                        std::process::abort();
                    }
                }
            }
        }
    }
}

thread_local! {
    /// This spawner thread's slots, taken as it starts.
    static SLOTS: std::cell::RefCell<Option<Slots>> = const { std::cell::RefCell::new(None) };
}

/// `CLOCK_BOOTTIME` in nanoseconds: the clock of a process's start time.
fn boottime_ns() -> Option<u64> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME).ok()?;
    let secs = u64::try_from(t.tv_sec()).ok()?;
    let nanos = u64::try_from(t.tv_nsec()).ok()?;
    Some(secs * 1_000_000_000 + nanos)
}

/// The child's start time as `/proc/PID/stat` gives it (clock ticks after
/// boot), known without reading it: the kernel stamps the start during
/// the clone, between the two clock readings, so when both fall in the
/// same tick that tick is the start time. `None` when they straddle a
/// tick (then `/proc` must say).
fn start_ticks(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    let before = crate::procfs::boottime_ticks(before?)?;
    let after = crate::procfs::boottime_ticks(after?)?;
    (before == after).then_some(before)
}

/// The step between clone and exec at which a child failed, as it
/// reports it (after its errno) on its report pipe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Step {
    /// Its own descriptor table.
    Table = 1,
    /// Its own process group.
    Group,
    /// Into its cgroups.
    Cgroup,
    /// Its stdin, stdout and stderr.
    Streams,
    /// Into its working directory.
    Cwd,
    /// Its user, group and supplementary groups.
    User,
    /// Its capabilities emptied.
    Capabilities,
    /// Its parent-death signal.
    ParentDeath,
    /// The exec of the program.
    Exec,
}

impl Step {
    fn of(n: u32) -> Option<Self> {
        [
            Self::Table,
            Self::Group,
            Self::Cgroup,
            Self::Streams,
            Self::Cwd,
            Self::User,
            Self::Capabilities,
            Self::ParentDeath,
            Self::Exec,
        ]
        .into_iter()
        .find(|s| *s as u32 == n)
    }
}

/// The error of a child that failed at `step` with `errno`, naming what
/// it could not do: the program (and, refused for want of permission, the
/// directory or file in the way), the working directory, and the user it
/// runs as.
fn failed_spawn(p: &Prepared, step: Option<Step>, errno: i32) -> io::Error {
    let os = io::Error::from_raw_os_error(errno);
    let (uid, gid) = p.user.unwrap_or_else(own_identity);
    let groups: Vec<u32> = if p.user.is_some() {
        p.groups.clone()
    } else {
        nix::unistd::getgroups()
            .map(|gs| gs.iter().map(|g| g.as_raw()).collect())
            .unwrap_or_default()
    };
    let runner = crate::reach::Runner {
        uid,
        gid,
        groups: &groups,
    };
    let who = crate::reach::user_of(&runner);
    let program = Path::new(std::ffi::OsStr::from_bytes(p.program.as_bytes()));
    let what = match step {
        Some(Step::Exec) => {
            let why = (errno == libc::EACCES)
                .then(|| crate::reach::can_run(program, &runner).err())
                .flatten();
            why.unwrap_or_else(|| format!("cannot execute {} as {who}", program.display()))
        }
        Some(Step::Cwd) => {
            let cwd = p.cwd.as_ref().map_or_else(String::new, |c| {
                String::from_utf8_lossy(c.as_bytes()).into_owned()
            });
            format!("cannot enter its working directory {cwd} as {who}")
        }
        Some(Step::User) => format!("cannot become {who}"),
        Some(Step::Cgroup) => "cannot join its cgroup".to_string(),
        Some(Step::Capabilities) => "cannot empty its capability sets".to_string(),
        Some(Step::ParentDeath) => "cannot set its parent-death signal".to_string(),
        Some(Step::Streams) => "cannot set up its output".to_string(),
        Some(Step::Group) => "cannot lead a process group of its own".to_string(),
        Some(Step::Table) | None => "cannot set up its descriptors".to_string(),
    };
    io::Error::new(os.kind(), format!("{what}: {os}"))
}

/// Who the child becomes: its user and group, and whether it sets its OOM
/// score back to 0 (see `Prepared`).
#[derive(Debug, Clone, Copy)]
struct Who {
    user: Option<(u32, u32)>,
    /// Its supplementary groups (`Prepared::groups`, which the parent
    /// keeps alive while the child runs on its memory); none: its primary
    /// group alone.
    groups: *const libc::gid_t,
    ngroups: usize,
    reset_oom: bool,
    parent_death: bool,
}

#[derive(Debug, Clone, Copy)]
struct ChildFds {
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    report: RawFd,
    /// `cgroup.procs` files to write `0` (this process) to; -1: none.
    cgroups: [RawFd; 2],
    /// The above, in order (-1 for each cgroup not joined).
    own: [RawFd; 6],
    /// Above the highest of the above: the child's own table starts with
    /// the agent's descriptors below this only.
    keep_below: RawFd,
}

impl ChildFds {
    fn new([stdin, stdout, stderr]: [RawFd; 3], report: RawFd, cgroups: [RawFd; 2]) -> Self {
        let mut own = [stdin, stdout, stderr, report, cgroups[0], cgroups[1]];
        own.sort_unstable();
        Self {
            stdin,
            stdout,
            stderr,
            report,
            cgroups,
            own,
            // A multiple of 64: kernels before 5.18 (without its fix
            // backported) copy a table cut elsewhere with the bitmap of
            // its last word short.
            keep_below: (own[own.len() - 1].max(2) + 64) / 64 * 64,
        }
    }
}

/// The child between clone and exec. It shares the parent's memory, so it
/// only makes system calls on buffers the parent prepared. It starts with
/// every signal blocked (the parent blocked them around the clone), so no
/// handler of the parent can run here; it resets every handler to the
/// default, and unblocks only just before exec.
///
/// # Safety
/// Must run only as the clone callback of `clone_exec`, with pointers
/// that stay valid until it execs or exits (the parent is suspended).
unsafe fn child_main(
    parent: libc::pid_t,
    program: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: *const libc::c_char,
    who: Who,
    fds: ChildFds,
) -> isize {
    let fail = |fds: ChildFds, step: Step| -> isize {
        // SAFETY: errno is this thread's, readable at any time.
        let errno = unsafe { *libc::__errno_location() };
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&errno.to_ne_bytes());
        bytes[4..].copy_from_slice(&(step as u32).to_ne_bytes());
        // SAFETY: a write of 8 bytes from a local buffer to our pipe (at
        // most PIPE_BUF: the parent reads it whole).
        unsafe { libc::write(fds.report, bytes.as_ptr().cast(), 8) };
        // SAFETY: ends this process without running anything of the
        // parent's (no atexit handlers, no flushing of shared buffers).
        unsafe { libc::_exit(127) }
    };
    // First a descriptor table of its own, before any descriptor is
    // touched: until then it is the agent's (CLONE_FILES). Only the
    // descriptors below `keep_below` are copied into it.
    // SAFETY: close_range with integer arguments; with UNSHARE it acts on
    // this process's new table only.
    let own_table = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            fds.keep_below,
            u32::MAX,
            libc::CLOSE_RANGE_UNSHARE,
        )
    } == 0;
    // Before Linux 5.9 (no close_range): a copy of the whole table.
    // SAFETY: unshare of this process's descriptor table.
    if !own_table && unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
        return fail(fds, Step::Table);
    }
    // Of what was copied, only its own: the slots of other spawner
    // threads sit among these (a copy of another spawn's report pipe
    // would keep that spawn waiting until this child execs), and so may a
    // descriptor of the agent opened without close-on-exec.
    let mut next = 0;
    for fd in fds.own.into_iter().filter(|fd| *fd >= 0) {
        if fd > next {
            // SAFETY: close_range with integer arguments, on this
            // process's own table.
            unsafe { libc::syscall(libc::SYS_close_range, next as u32, (fd - 1) as u32, 0u32) };
        }
        next = fd + 1;
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, next as u32, u32::MAX, 0u32) };
    // A server starts with default dispositions: handlers would be the
    // parent's code, and ignored signals (Rust ignores SIGPIPE) would stay
    // ignored through exec.
    // The kernel's own sigaction (handler, flags, restorer, mask), all
    // zero: SIG_DFL, no flags, nothing masked. The raw system call, since
    // glibc's wrapper refuses the signals it reserves (32 and 33), which
    // the agent may have inherited ignored.
    let default = [0u64; 4];
    for signal in 1..=64 {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        // SAFETY: rt_sigaction with a valid 32-byte struct and an 8-byte
        // signal set; this process has its own handler table (no
        // CLONE_SIGHAND), so the parent's is untouched.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                signal,
                default.as_ptr(),
                std::ptr::null_mut::<u64>(),
                8,
            )
        };
    }
    // SAFETY: setpgid on this process.
    if unsafe { libc::setpgid(0, 0) } != 0 {
        return fail(fds, Step::Group);
    }
    // Into the instance's cgroups before anything of the server runs.
    for fd in fds.cgroups.into_iter().filter(|fd| *fd >= 0) {
        // SAFETY: a 1-byte write from a static buffer to a descriptor the
        // parent opened and keeps open.
        if unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) } != 1 {
            return fail(fds, Step::Cgroup);
        }
    }
    for (from, to) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)] {
        // SAFETY: dup2 of descriptors the parent opened, in this process's
        // own table.
        if unsafe { libc::dup2(from, to) } < 0 {
            return fail(fds, Step::Streams);
        }
    }
    // SAFETY: chdir to a NUL-terminated path the parent prepared.
    if !cwd.is_null() && unsafe { libc::chdir(cwd) } != 0 {
        return fail(fds, Step::Cwd);
    }
    // The agent may protect itself from the OOM killer (systemd's
    // OOMScoreAdjust); its servers must not inherit that. Raising the score
    // is always allowed; where /proc is absent, nothing happens.
    let oom = if who.reset_oom {
        // SAFETY: open of a static NUL-terminated path.
        unsafe {
            libc::open(
                c"/proc/self/oom_score_adj".as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            )
        }
    } else {
        -1
    };
    if oom >= 0 {
        // SAFETY: a 1-byte write to the descriptor just opened, then its
        // close.
        unsafe {
            libc::write(oom, b"0".as_ptr().cast(), 1);
            libc::close(oom);
        }
    }
    if let Some((uid, gid)) = who.user {
        // Raw system calls: glibc's wrappers would signal every thread of
        // the parent, whose memory this child shares.
        let own = [gid];
        let (groups, n) = if who.ngroups > 0 {
            (who.groups, who.ngroups)
        } else {
            (own.as_ptr(), 1)
        };
        // SAFETY: setgroups with the parent's prepared list (or a
        // one-element local array) and its length, then setgid and setuid
        // with plain integers.
        let changed = unsafe {
            libc::syscall(libc::SYS_setgroups, n, groups) == 0
                && libc::syscall(libc::SYS_setgid, gid) == 0
                && libc::syscall(libc::SYS_setuid, uid) == 0
        };
        if !changed {
            return fail(fds, Step::User);
        }
    }
    // No capability crosses the exec: an agent given CAP_SETUID (ambient,
    // for `run_as` without root) must not hand it to its models, and a
    // model running as root must not regain the bounding set at exec.
    // After the credential change above, which needed CAP_SETUID/SETGID.
    if drop_capabilities().is_err() {
        return fail(fds, Step::Capabilities);
    }
    // After any credential change, which would clear it.
    // SAFETY: prctl with integer arguments.
    if who.parent_death && unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) } != 0 {
        return fail(fds, Step::ParentDeath);
    }
    // SAFETY: getppid takes nothing.
    if who.parent_death && unsafe { libc::getppid() } != parent {
        // SAFETY: as in `fail`.
        unsafe { libc::_exit(127) };
    }
    // Last, every signal unblocked: one that came meanwhile is delivered
    // now, with its default action.
    // SAFETY: a zeroed sigset_t is a valid set, emptied by sigemptyset.
    unsafe {
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
    }
    // SAFETY: execve with NUL-terminated strings and NULL-terminated
    // arrays the parent prepared and keeps alive while suspended.
    unsafe { libc::execve(program, argv, envp) };
    fail(fds, Step::Exec)
}

/// Empties the ambient, inheritable, permitted and effective capability
/// sets of the calling (child) process and sets `no_new_privs`, so that
/// the exec grants nothing: with `no_new_privs` the kernel limits what an
/// exec as root would take from the bounding set to the (now empty)
/// permitted set, and no set-user-id or file-capability binary the child
/// runs can raise it. Raw system calls only (the child shares the
/// parent's memory until it execs).
fn drop_capabilities() -> Result<(), ()> {
    // SAFETY: prctl with integer arguments.
    let cleared = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    // EINVAL: a kernel before 4.3 has no ambient set; nothing to clear.
    // SAFETY: reading errno, a thread-local the call above set.
    if cleared != 0 && unsafe { *libc::__errno_location() } != libc::EINVAL {
        return Err(());
    }
    /// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
    const VERSION_3: u32 = 0x2008_0522;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let none = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset with a version-3 header and the two data words that
    // version reads, both locals that outlive the call.
    let set =
        unsafe { libc::syscall(libc::SYS_capset, std::ptr::from_ref(&header), none.as_ptr()) };
    if set != 0 {
        return Err(());
    }
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(());
    }
    Ok(())
}

/// A running child: its pid and a pidfd for its exit.
#[derive(Debug)]
pub struct Child {
    pid: u32,
    start_ticks: Option<u64>,
    pidfd: AsyncFd<OwnedFd>,
    status: Option<ExitStatus>,
}

impl Child {
    /// Wraps a spawned child for the current runtime.
    pub fn new(s: Spawned) -> io::Result<Self> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, s.pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the syscall just returned this fd, owned by nobody else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        // SAFETY: an OwnedFd keeps the same descriptor open for as long as
        // the AsyncFd owns it.
        let pidfd =
            unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
                .map_err(|e| e.into_parts().1)?;
        Ok(Self {
            pid: s.pid as u32,
            start_ticks: s.start_ticks,
            pidfd,
            status: None,
        })
    }

    /// The pid, until the child has been reaped.
    pub fn id(&self) -> Option<u32> {
        self.status.is_none().then_some(self.pid)
    }

    /// Its start time in clock ticks after boot, as `/proc/PID/stat` gives
    /// it, when the spawn could tell without reading `/proc`.
    pub fn start_ticks(&self) -> Option<u64> {
        self.start_ticks
    }

    /// Waits for the exit and reaps the child. Cancel-safe.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(status) = self.status {
            return Ok(status);
        }
        loop {
            let mut ready = self.pidfd.readable().await?;
            let id = Id::PIDFd(self.pidfd.get_ref().as_fd());
            let raw = match waitid(id, WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG) {
                Ok(WaitStatus::Exited(_, code)) => (code & 0xff) << 8,
                Ok(WaitStatus::Signaled(_, signal, core)) => {
                    signal as i32 | if core { 0x80 } else { 0 }
                }
                Ok(_) => {
                    ready.clear_ready();
                    continue;
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(io::Error::from(e)),
            };
            let status = ExitStatus::from_raw(raw);
            self.status = Some(status);
            return Ok(status);
        }
    }
}

impl Child {
    /// Lets the child go without waiting for it (handed over to the next
    /// agent, which watches it through a pidfd of its own).
    pub fn let_go(mut self) {
        self.status = Some(ExitStatus::from_raw(0));
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if self.status.is_none() {
            // Reap it if it is already gone; a live child dropped here
            // would be a supervisor bug, so say so.
            let id = Id::PIDFd(self.pidfd.get_ref().as_fd());
            if let Ok(WaitStatus::StillAlive) =
                waitid(id, WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG)
            {
                tracing::error!(pid = self.pid, "a live child was dropped unreaped");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spawns_descriptors_sit_in_low_slots_and_leave_none_behind() {
        let mut slots = Slots::new().expect("slots");
        // A busy agent: the pipe comes after many descriptors.
        let file = std::fs::File::open("/dev/null").expect("open");
        let _many: Vec<_> = (0..100).map(|_| file.try_clone().expect("dup")).collect();
        let (read, write) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
                .expect("pipe");
        {
            let placed = slots.place([Some(&write), None, None, None, None]);
            let placed = placed.expect("placed");
            assert!(
                placed.fd(0) < write.as_raw_fd(),
                "the slot is below the pipe"
            );
            assert_eq!(placed.fd(1), -1, "an unused slot is not handed out");
            // The slot is the pipe's write end while placed.
            nix::unistd::write(&placed.slots.held[0], b"x").expect("write via the slot");
        }
        // Once the spawn is done no copy of the write end is left: with
        // the original closed, the reader sees the end (a copy left in
        // the slot would answer EAGAIN, not end of file).
        drop(write);
        let mut buf = [0u8; 4];
        assert_eq!(nix::unistd::read(&read, &mut buf), Ok(1));
        assert_eq!(nix::unistd::read(&read, &mut buf), Ok(0), "end of file");
    }

    /// On a thread of its own, as a spawner: a descriptor without
    /// close-on-exec opened before the thread takes its slots (so below
    /// them, and copied into the child's first table), then a child that
    /// says whether it holds that number.
    fn spawn_beside_a_leaky_descriptor() -> Option<String> {
        std::thread::spawn(|| {
            let file = std::fs::File::open("/dev/null").expect("open");
            // nix's dup sets no close-on-exec.
            let leaky = nix::unistd::dup(&file).expect("dup");
            reserve_slots().expect("slots");
            let highest = SLOTS.with_borrow(|s| {
                let s = s.as_ref().expect("slots");
                s.held.iter().chain([&s.null]).map(|f| f.as_raw_fd()).max()
            });
            if highest.is_none_or(|h| h < leaky.as_raw_fd()) {
                // A hole below it took a slot: not the case under test.
                return None;
            }
            let (read, write) = pipe_cloexec().expect("pipe");
            let write = Arc::new(write);
            let n = leaky.as_raw_fd();
            let script = format!("[ -e /proc/$$/fd/{n} ] && echo leaked || echo clean");
            let argv = ["/bin/sh".to_string(), "-c".into(), script];
            let p =
                Prepared::new(&argv, &[], None, None, [write.clone(), write]).expect("prepared");
            let spawned = clone_exec(&p).expect("spawned");
            drop(p);
            let pid = nix::unistd::Pid::from_raw(spawned.pid);
            nix::sys::wait::waitpid(pid, None).expect("reaped");
            let mut out = String::new();
            std::io::Read::read_to_string(&mut std::fs::File::from(read), &mut out).expect("read");
            Some(out)
        })
        .join()
        .expect("the thread")
    }

    #[test]
    fn a_descriptor_without_close_on_exec_below_the_slots_stays_out() {
        let said = (0..20)
            .find_map(|_| spawn_beside_a_leaky_descriptor())
            .expect("a leaky descriptor below the slots within 20 tries");
        assert_eq!(said.trim(), "clean");
    }
}
