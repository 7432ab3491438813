//! One task per instance drives its lifecycle: spawn, readiness, run, stop
//! or exit, restart with backoff. It is the only writer of the instance's
//! status, so its transitions are published in order.
//!
//! Its first run may be a process an earlier agent spawned and left
//! running (`First`): taken over, not spawned. Such a process is no
//! longer our child, so its exit is seen through a pidfd and its code is
//! unknown (`Exit::Unknown`); the restart policy applies as to any exit.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{Instant, sleep, timeout};

use crate::cgroup::{Cgroups, RunCgroup};
use crate::child::Child;
use crate::logs::{LogRing, OutputPipes, PipeSpares};
use crate::pidfd::Watched;
use crate::spawn::{self, Ports, signal_group};
use crate::spec::{LaunchSpec, Macros};
use crate::status::{Exit, State, Status};
use crate::{procfs, readiness, spawn::command};

/// Leftovers of a group get this long to disappear after SIGKILL.
const LEFTOVER_BOUND: Duration = Duration::from_secs(2);
/// An ended run's output gets this long to be read to its end.
const LOG_DRAIN: Duration = Duration::from_secs(1);

/// A request to stop. Whoever sends it waits for the run's terminal
/// status: that, not a reply, is the answer.
#[derive(Debug)]
pub(crate) struct StopRequest {
    pub(crate) grace: Duration,
    /// Why, when it is not a plain stop ("evicted to make room for ...");
    /// the ended run's reason says it.
    pub(crate) cause: Option<String>,
    /// Let an adopted process go without a signal (shutdown); a child's
    /// actor never gets one.
    pub(crate) detach: bool,
    /// A hand-over to the next agent (an upgrade): the actor lets its
    /// process run on without a signal and ends without a transition (the
    /// instance is not ended: the next agent takes it over), its named
    /// pipes left in place, and says so here.
    pub(crate) hand_over: Option<oneshot::Sender<()>>,
}

/// What the supervisor and the actor share about one instance.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) status: watch::Sender<Status>,
    pub(crate) events: mpsc::UnboundedSender<Status>,
    pub(crate) logs: Arc<LogRing>,
    /// The running group's id, 0 when none (read by the memory sampler).
    pub(crate) pgid: AtomicI32,
    /// The running process's cgroup, if it has one (read by the sampler).
    pub(crate) cgroup: parking_lot::Mutex<Option<Arc<RunCgroup>>>,
}

impl Shared {
    pub(crate) fn cgroup(&self) -> Option<Arc<RunCgroup>> {
        self.cgroup.lock().clone()
    }

    fn set_cgroup(&self, cg: Option<Arc<RunCgroup>>) {
        *self.cgroup.lock() = cg;
    }
}

/// One run of the process: the child, its group and its cgroup.
struct Run {
    process: Process,
    pgid: i32,
    cgroup: Option<Arc<RunCgroup>>,
    /// Whether every process of the run is known to be gone.
    cleared: bool,
}

/// The process of a run: our child, or one taken over from an earlier
/// agent.
enum Process {
    Child(Child),
    TakenOver(Watched),
}

impl Process {
    /// Resolves once it has exited, with how (unknown for a process that
    /// is not our child). Cancel-safe.
    async fn wait(&mut self) -> Exit {
        match self {
            Self::Child(c) => exit_of(c.wait().await),
            Self::TakenOver(w) => {
                w.exited().await;
                Exit::Unknown
            }
        }
    }

    fn taken_over(&self) -> bool {
        matches!(self, Self::TakenOver(_))
    }
}

/// What an actor starts from instead of a spawn: a process an earlier
/// agent spawned for the instance.
pub(crate) enum First {
    /// It still runs (checked through its pidfd): its run goes on.
    Running {
        watched: Watched,
        pid: u32,
        start_ticks: u64,
        restarts: u32,
        /// Its cgroup, when an earlier agent's supervisor made it.
        cgroup: Option<Arc<RunCgroup>>,
    },
    /// It ended (or its pid was reused) while no agent ran: why.
    Gone(String),
}

impl Shared {
    /// Moves to `state` for `reason`, applies `edit`, and publishes.
    pub(crate) fn transition(&self, state: State, reason: String, edit: impl FnOnce(&mut Status)) {
        let mut snapshot = None;
        self.status.send_modify(|s| {
            s.state = state;
            s.reason = reason;
            edit(s);
            snapshot = Some(s.clone());
        });
        if let Some(s) = snapshot {
            tracing::debug!(instance_id = %s.instance, state = %s.state, reason = %s.reason, "transition");
            let _ = self.events.send(s);
        }
    }
}

/// How a run of the process ended.
enum End {
    NotReady,
    Exited(Exit),
    Stop(Option<StopRequest>),
}

pub(crate) struct Actor {
    pub(crate) spec: LaunchSpec,
    pub(crate) port: u16,
    pub(crate) shared: Arc<Shared>,
    pub(crate) stops: mpsc::Receiver<StopRequest>,
    pub(crate) ports: Arc<Ports>,
    /// Where runs get their cgroups; `None`: process groups only.
    pub(crate) cgroups: Option<Arc<Cgroups>>,
    /// Where runs get their output pipes.
    pub(crate) pipes: Arc<PipeSpares>,
    /// The current run's output.
    pub(crate) output: Option<RunOutput>,
    /// Where the named pipes of instances that outlive the agent are
    /// (`None`: they die with it, and write into anonymous pipes).
    pub(crate) outlive: Option<Arc<std::path::Path>>,
    /// The process the first run takes over, if any.
    pub(crate) first: Option<First>,
    /// Handed over to the next agent: nothing of the instance is undone.
    pub(crate) handed_over: bool,
}

/// A run's output while it runs: the task reading it, the signal that has
/// the task read what is left and hand the pipes back, and the agent's
/// copies of the write ends (dropped when the pipes are not to be reused,
/// so that the task reads to end of file).
pub(crate) struct RunOutput {
    reader: tokio::task::JoinHandle<Option<[pipe::Receiver; 2]>>,
    flush: oneshot::Sender<()>,
    writers: [Arc<OwnedFd>; 2],
}

impl Actor {
    pub(crate) async fn run(mut self) {
        self.lifecycle().await;
        self.shared.pgid.store(0, Ordering::Relaxed);
        self.ports.release(self.port);
        if let Some(dir) = &self.outlive
            && !self.handed_over
        {
            OutputPipes::remove_named(dir, &self.spec.instance);
        }
    }

    /// Lets `run` go to the next agent: its output is no longer read here
    /// (what is unread stays in its named pipes), its process is not
    /// signalled, and no transition is published.
    fn hand_over(&mut self, run: Option<Run>, done: oneshot::Sender<()>) {
        if let Some(output) = self.output.take() {
            output.reader.abort();
        }
        if let Some(run) = run {
            match run.process {
                Process::Child(child) => child.let_go(),
                Process::TakenOver(watched) => drop(watched),
            }
        }
        self.handed_over = true;
        let _ = done.send(());
    }

    async fn lifecycle(&mut self) {
        let mut consecutive = 0u32;
        loop {
            let run = match self.first.take() {
                Some(First::Running {
                    watched,
                    pid,
                    start_ticks,
                    restarts,
                    cgroup,
                }) => Some(self.take_over(watched, (pid, start_ticks, restarts), cgroup)),
                Some(First::Gone(why)) => {
                    // Long gone, for all we know: it counts as a run that
                    // was stable.
                    let long = self.spec.restart.stable_after;
                    if self
                        .after_exit(Exit::Unknown, why, long, &mut consecutive)
                        .await
                    {
                        continue;
                    }
                    return;
                }
                None => self.spawn().await,
            };
            let Some(mut run) = run else {
                return;
            };
            let started = Instant::now();
            let end = match self.until_ready(&mut run.process).await {
                Ok(()) => {
                    self.shared.transition(State::Ready, "ready".into(), |_| {});
                    tokio::select! {
                        req = self.stops.recv() => End::Stop(req),
                        exit = run.process.wait() => End::Exited(exit),
                    }
                }
                Err(end) => end,
            };
            let exit = match end {
                End::Stop(Some(StopRequest {
                    hand_over: Some(done),
                    ..
                })) => {
                    return self.hand_over(Some(run), done);
                }
                End::Stop(req) => {
                    let grace = req.as_ref().map_or(self.spec.stop_grace, |r| r.grace);
                    let cause = req.as_ref().and_then(|r| r.cause.clone());
                    let cause = cause.unwrap_or_else(|| "stopped".into());
                    let exit = self.terminate(&mut run, grace).await;
                    // A run that ended on the stop's SIGTERM (or by
                    // exiting) was not ended by the OOM killer, whose kill
                    // is a SIGKILL: its counter is not read.
                    let by_the_stop = matches!(exit, Exit::Code(_))
                        || exit == Exit::Signal(Signal::SIGTERM as i32);
                    let oom = self.end_run(&run, !by_the_stop).await;
                    return self.finish(
                        State::Exited,
                        format!("{cause} ({exit}{oom})"),
                        Some(exit),
                    );
                }
                End::NotReady => {
                    let exit = self.terminate(&mut run, self.spec.stop_grace).await;
                    let oom = self.end_run(&run, true).await;
                    let limit = self.spec.readiness_timeout;
                    self.finish(
                        State::Failed,
                        format!("not ready within {limit:?}{oom}"),
                        Some(exit),
                    );
                    return;
                }
                End::Exited(exit) => exit,
            };
            run.cleared = clear_leftovers(run.pgid, run.cgroup.as_deref()).await;
            let oom = self.end_run(&run, true).await;
            if !self
                .after_exit(
                    exit,
                    format!("{exit}{oom}"),
                    started.elapsed(),
                    &mut consecutive,
                )
                .await
            {
                return;
            }
        }
    }

    /// After a run ended by itself (`exit`, told as `what`, after
    /// `ran_for`): ends the instance (false), or waits out the restart
    /// policy's backoff and says to run again (true).
    async fn after_exit(
        &mut self,
        exit: Exit,
        what: String,
        ran_for: Duration,
        consecutive: &mut u32,
    ) -> bool {
        let policy = self.spec.restart;
        if ran_for >= policy.stable_after {
            *consecutive = 0;
        }
        if !policy.wants_restart(exit.success()) {
            let state = if exit.success() || exit == Exit::Unknown {
                State::Exited
            } else {
                State::Failed
            };
            self.finish(state, what, Some(exit));
            return false;
        }
        if *consecutive >= policy.max_restarts {
            let reason = format!("gave up after {consecutive} restarts: {what}");
            self.finish(State::Failed, reason, Some(exit));
            return false;
        }
        let delay = policy.delay(*consecutive);
        *consecutive += 1;
        let reason = format!(
            "{what}; restart {consecutive} of {} in {delay:?}",
            policy.max_restarts
        );
        self.shared.transition(State::Backoff, reason, |s| {
            s.restarts += 1;
            s.exit = Some(exit);
            s.pid = None;
            s.start_ticks = None;
        });
        tokio::select! {
            _ = sleep(delay) => true,
            req = self.stops.recv() => {
                let (hand_over, cause) = match req {
                    Some(r) => (r.hand_over, r.cause),
                    None => (None, None),
                };
                match hand_over {
                    // No process to hand over: the next agent finds it
                    // gone and restarts it by the same policy.
                    Some(done) => self.hand_over(None, done),
                    None => {
                        let why = cause.map_or_else(
                            || "stopped during backoff".to_string(),
                            |c| format!("{c} (stopped during backoff)"),
                        );
                        self.finish(State::Exited, why, Some(exit))
                    }
                }
                false
            }
        }
    }

    /// The run of a process an earlier agent spawned and left running:
    /// its group, its cgroup, and its output read on from its named pipes.
    fn take_over(
        &mut self,
        watched: Watched,
        (pid, start_ticks, restarts): (u32, u64, u32),
        cgroup: Option<Arc<RunCgroup>>,
    ) -> Run {
        let pgid = pid as i32;
        self.shared.pgid.store(pgid, Ordering::Relaxed);
        self.shared.set_cgroup(cgroup.clone());
        if let Some(dir) = self.outlive.clone() {
            match OutputPipes::named(&dir, &self.spec.instance) {
                Ok(pipes) => self.capture(pipes),
                Err(e) => {
                    tracing::warn!(instance_id = %self.spec.instance, error = %e, "cannot read on from the output of a process taken over");
                }
            }
        }
        self.shared.transition(
            State::Starting,
            format!("taken over pid {pid} from an earlier agent"),
            |s| {
                s.pid = Some(pid);
                s.start_ticks = Some(start_ticks);
                s.restarts = restarts;
                // When it was spawned, not now: its age goes on.
                s.started_at = crate::procfs::wall_time_of_ticks(start_ticks)
                    .or_else(|| Some(std::time::SystemTime::now()));
            },
        );
        Run {
            process: Process::TakenOver(watched),
            pgid,
            cgroup,
            cleared: false,
        }
    }

    /// Starts reading a run's output from `pipes`.
    fn capture(&mut self, pipes: OutputPipes) {
        let ([out, err], writers) = pipes.split();
        let (flush, flushed) = oneshot::channel();
        let reader = tokio::spawn(self.shared.logs.clone().capture(out, err, flushed));
        self.output = Some(RunOutput {
            reader,
            flush,
            writers,
        });
    }

    /// Spawns the process and publishes STARTING; FAILED when it cannot.
    async fn spawn(&mut self) -> Option<Run> {
        let spec = &self.spec;
        let macros = Macros {
            port: self.port,
            instance: &spec.instance,
            workload: &spec.workload,
            role: &spec.role,
        };
        let program = spec.argv.first().cloned().unwrap_or_default();
        let pipes = match &self.outlive {
            Some(dir) => OutputPipes::named(dir, &spec.instance),
            None => self.pipes.take(),
        };
        let pipes = match pipes {
            Ok(pipes) => pipes,
            Err(e) => {
                let reason = format!("cannot make the output pipes of {program:?}: {e}");
                self.finish(State::Failed, reason, None);
                return None;
            }
        };
        let cgroup = match self.make_cgroup().await {
            Ok(cg) => cg,
            Err(e) => {
                let reason = format!("cannot make the cgroup of {program:?}: {e}");
                self.pipes.put(pipes);
                self.finish(State::Failed, reason, None);
                return None;
            }
        };
        let outlive = self.outlive.is_some();
        let prepared = command(spec, &macros, pipes.writers()).and_then(|mut cmd| {
            if let Some(cg) = &cgroup {
                cmd.join_cgroups(cg.procs_files()?);
            }
            if outlive {
                cmd.outlive_agent();
            }
            Ok(cmd)
        });
        let spawned = match prepared {
            Ok(cmd) => spawn::spawn(cmd).await,
            Err(e) => Err(e),
        };
        let child = match spawned {
            Ok(child) => child,
            Err(e) => {
                if let (Some(cg), Some(cgroups)) = (cgroup, &self.cgroups) {
                    cgroups.recycle(&cg, false);
                }
                // Nothing ran: a child that failed before exec writes
                // only to its report pipe, and is reaped by now.
                self.pipes.put(pipes);
                self.finish(
                    State::Failed,
                    format!("cannot start {program:?}: {e}"),
                    None,
                );
                return None;
            }
        };
        // A spawned child that has not been waited for always has an id.
        let pid = child.id().unwrap_or_default();
        let pgid = pid as i32;
        let start_ticks = child.start_ticks();
        self.shared.pgid.store(pgid, Ordering::Relaxed);
        self.shared.set_cgroup(cgroup.clone());
        self.capture(pipes);
        self.shared
            .transition(State::Starting, format!("spawned pid {pid}"), |s| {
                s.pid = Some(pid);
                s.start_ticks = start_ticks;
                s.started_at = Some(std::time::SystemTime::now());
            });
        Some(Run {
            process: Process::Child(child),
            pgid,
            cgroup,
            cleared: false,
        })
    }

    /// The cgroup of the next run (made on a blocking thread: mkdir of a
    /// cgroup can take the kernel a while).
    async fn make_cgroup(&self) -> std::io::Result<Option<Arc<RunCgroup>>> {
        let Some(cgroups) = self.cgroups.clone() else {
            return Ok(None);
        };
        let limit = self.spec.memory_limit;
        if cgroups.has_spare() {
            return cgroups.create(limit).map(|cg| Some(Arc::new(cg)));
        }
        tokio::task::spawn_blocking(move || cgroups.create(limit))
            .await
            .map_err(std::io::Error::other)?
            .map(|cg| Some(Arc::new(cg)))
    }

    /// After a run's processes are gone: reads its output to the end,
    /// hands its cgroup back, and says whether the OOM killer ended it (a
    /// text to append to the reason, empty when not); `may_be_oom`: false
    /// when the run's end rules the OOM killer out, and its counters are
    /// not read.
    async fn end_run(&mut self, run: &Run, may_be_oom: bool) -> String {
        // Emptied, a cgroup shows that no process of the run can still
        // write to its pipes (only a privileged one could have moved out
        // of it), so they can serve another run.
        // Named pipes are the instance's own: not spares for others.
        let reusable = run.cleared && run.cgroup.is_some() && self.outlive.is_none();
        self.drain_logs(reusable).await;
        self.shared.pgid.store(0, Ordering::Relaxed);
        self.shared.set_cgroup(None);
        let (Some(cg), Some(cgroups)) = (&run.cgroup, &self.cgroups) else {
            self.set_oom_killed(false);
            return String::new();
        };
        let kills = if may_be_oom { cg.oom_kills() } else { 0 };
        let limit = cg.limit();
        if run.process.taken_over() {
            // An earlier agent's cgroup, not one of this supervisor's.
            cg.remove();
        } else {
            cgroups.recycle(cg, run.cleared);
        }
        self.set_oom_killed(kills > 0);
        match (kills, limit) {
            (0, _) => String::new(),
            (_, Some(bytes)) => format!(", OOM-killed at its memory limit of {bytes} bytes"),
            (_, None) => ", OOM-killed".into(),
        }
    }

    /// Records whether the OOM killer ended the run, without a wake-up of
    /// the status's watchers: the transition that follows every end of a
    /// run (its terminal status, or BACKOFF) publishes it.
    fn set_oom_killed(&self, oom_killed: bool) {
        self.shared.status.send_if_modified(|s| {
            s.oom_killed = oom_killed;
            false
        });
    }

    /// Ok once ready; otherwise how the run ended first.
    async fn until_ready(&mut self, process: &mut Process) -> Result<(), End> {
        let deadline = Instant::now() + self.spec.readiness_timeout;
        // Only a listener of the run's own processes counts.
        let shared = self.shared.clone();
        let owners: readiness::Owners = Arc::new(move || match shared.cgroup() {
            Some(cg) => cg.members(),
            None => procfs::group_members(shared.pgid.load(Ordering::Relaxed)),
        });
        let output = Some(self.shared.logs.wrote());
        tokio::select! {
            req = self.stops.recv() => Err(End::Stop(req)),
            exit = process.wait() => Err(End::Exited(exit)),
            ready = readiness::wait_ready(&self.spec.readiness, self.port, deadline, output, Some(owners)) => {
                if ready { Ok(()) } else { Err(End::NotReady) }
            }
        }
    }

    /// SIGTERM (and SIGCONT, so a stopped process can act on it) to the
    /// group, `grace`, then SIGKILL; returns once the group is gone.
    async fn terminate(&mut self, run: &mut Run, grace: Duration) -> Exit {
        let reason = format!("stopping: SIGTERM, SIGKILL after {grace:?}");
        self.shared.transition(State::Stopping, reason, |_| {});
        let cg = run.cgroup.as_deref();
        // The group gets the graceful stop; a process that left it
        // (setsid) is killed with the rest of the cgroup once the group is
        // done, which spares every stop a read of the cgroup's members.
        let _ = signal_group(run.pgid, Signal::SIGTERM);
        let _ = signal_group(run.pgid, Signal::SIGCONT);
        let exit = match timeout(grace, run.process.wait()).await {
            Ok(exit) => exit,
            Err(_) => {
                tracing::info!(instance_id = %self.spec.instance, pid = run.pgid, "grace over, killing the group");
                let _ = signal_group(run.pgid, Signal::SIGKILL);
                if let Some(cg) = cg {
                    cg.kill_all();
                }
                run.process.wait().await
            }
        };
        run.cleared = clear_leftovers(run.pgid, cg).await;
        exit
    }

    /// Waits (bounded) until the run's output is read to its end, so that
    /// an ended instance's log holds its last lines. With `reusable` (no
    /// process of the run can be left to write), the capture reads what
    /// the pipes hold and hands them back, and they go to the spares.
    /// Otherwise the agent lets go of its write ends: the group is gone by
    /// now, so the pipes reach their end unless something outside it
    /// holds them.
    async fn drain_logs(&mut self, reusable: bool) {
        let Some(RunOutput {
            reader,
            flush,
            writers,
        }) = self.output.take()
        else {
            return;
        };
        if reusable {
            let _ = flush.send(());
        } else {
            drop(flush);
        }
        // Not reusable: the write ends go here, so the capture reads to
        // end of file.
        let writers = reusable.then_some(writers);
        match timeout(LOG_DRAIN, reader).await {
            Ok(Ok(Some(readers))) => {
                if let Some(writers) = writers {
                    self.pipes.put(OutputPipes::join(readers, writers));
                }
            }
            Ok(_) => {}
            Err(_) => {
                tracing::warn!(instance_id = %self.spec.instance, "output still open after exit; not waiting for it");
            }
        }
    }

    fn finish(&self, state: State, reason: String, exit: Option<Exit>) {
        self.shared.pgid.store(0, Ordering::Relaxed);
        self.shared.set_cgroup(None);
        self.shared.transition(state, reason, |s| {
            s.pid = None;
            s.start_ticks = None;
            s.measured_bytes = 0;
            s.measured_at = None;
            if exit.is_some() {
                s.exit = exit;
            }
        });
    }
}

fn exit_of(status: std::io::Result<std::process::ExitStatus>) -> Exit {
    status.map(Exit::from).unwrap_or(Exit::Code(-1))
}

/// Kills whatever is left of group `pgid` and of the run's cgroup
/// (helpers the leader forked, and with a cgroup also those that left the
/// group) and waits, bounded, until none is left; false when some are
/// still there at the bound.
pub(crate) async fn clear_leftovers(pgid: i32, cgroup: Option<&RunCgroup>) -> bool {
    if pgid <= 1 {
        return true;
    }
    let deadline = Instant::now() + LEFTOVER_BOUND;
    let mut pause = Duration::from_micros(500);
    loop {
        // No such group (ESRCH): no member is left, not even a zombie.
        let group_gone = matches!(
            killpg(Pid::from_raw(pgid), Signal::SIGKILL),
            Err(Errno::ESRCH)
        );
        let in_cgroup = cgroup.filter(|cg| cg.populated());
        if let Some(cg) = in_cgroup {
            cg.kill_all();
        }
        // Zombies still count as members until their new parent reaps
        // them; only live members matter, so /proc says.
        let left =
            in_cgroup.is_some() || (!group_gone && !crate::procfs::group_members(pgid).is_empty());
        if !left {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}
