//! The books checked as a whole: random sequences of everything that
//! changes a charge (start, stop, Sleep, idle sleep, wake, a server that
//! falls asleep or wakes by itself, a server's exit, a takeover, an
//! adoption, a reload, readings) against the books, with a fake supervisor
//! that carries each decision out later, in any order: a victim's exit, a
//! sleep or wake call that ends (or fails, and its run is stopped).
//!
//! After every step: no pool's counted bytes rose past its effective
//! budget unless a reading did it (an overrun is measured, not planned);
//! each resident is charged once (the pool figures are the sum of the
//! residents' charges, and the records and the ledger agree on who holds
//! a reservation); every reservation is released once, by its own run.
//! Once every carried-out move has ended, no resident is left moving.
//!
//! A failure prints its seed (`PROPTEST_RNG_SEED` runs it again).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, RngAlgorithm, TestRng, TestRunner};
use resident_api::{ApiError, pb};
use resident_core::{Policy, PoolName, Tier};
use resident_supervisor::Adoption;

use super::*;

const GB: u64 = 1_000_000_000;

/// Pools `gpu` (8 GB) and `ram` (`ram_gb`); two vLLM-style level-1
/// sleepers (3 GB of `gpu` awake; 0.5 GB of `gpu` and 3 GB of weights in
/// `ram` asleep), a plain GPU server and a host one.
fn config(ram_gb: u64) -> Config {
    let mut text = format!(
        "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/unused.sock\"\nstate_dir = \"/tmp/residentd-unused/state\"\n\n[[pool]]\nname = \"gpu\"\nbudget = \"8GB\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"{ram_gb}GB\"\n"
    );
    for name in ["one", "two"] {
        text += &format!(
            "\n[[workload]]\nname = \"{name}\"\ncommand = [\"/bin/sleep\", \"1\"]\n[workload.memory.gpu]\nweights = \"3GB\"\n[workload.sleep]\nsleep = \"POST /sleep?level=1\"\nwake = \"POST /wake_up\"\n[workload.sleep.memory.gpu]\noverhead = \"0.5GB\"\n[workload.sleep.memory.ram]\nweights = \"3GB\"\n"
        );
    }
    text += "\n[[workload]]\nname = \"plain\"\ncommand = [\"/bin/sleep\", \"1\"]\n[workload.memory.gpu]\nweights = \"2GB\"\n";
    text += "\n[[workload]]\nname = \"host\"\ncommand = [\"/bin/sleep\", \"1\"]\n[workload.memory.ram]\nweights = \"1GB\"\n";
    resident_config::parse(Path::new("books-properties.toml"), &text).expect("a valid config")
}

const WORKLOADS: [&str; 4] = ["one", "two", "plain", "host"];
const IDS: usize = 5;

#[derive(Debug, Clone)]
enum Op {
    /// A Start (or the wake of an asleep one), refuse or evict.
    Start {
        id: usize,
        w: usize,
        evict: bool,
    },
    /// A Stop.
    Stop {
        id: usize,
    },
    /// The Sleep RPC.
    Sleep {
        id: usize,
    },
    /// The idle tick: every quiet sleeper put to sleep, or stopped where
    /// asleep it does not fit.
    Idle,
    /// A server that fell asleep (or woke) by itself.
    FellAsleep {
        id: usize,
    },
    WokeByItself {
        id: usize,
    },
    /// A server that exited (crashed) by itself.
    Exit {
        id: usize,
    },
    /// A process an earlier agent left, taken over as it was.
    TakeOver {
        id: usize,
        w: usize,
        tier: u8,
    },
    /// A process started elsewhere, adopted.
    Adopt {
        id: usize,
        w: usize,
        present_gb: u64,
    },
    /// A reload to a host pool of this size.
    Reload {
        ram_gb: u64,
    },
    /// A reading of what a resident holds.
    Measure {
        id: usize,
        gpu: bool,
        gb: u64,
    },
    /// One of the decisions under way is carried out (an exit, a call
    /// that ends), `ok` or failed.
    Progress {
        pick: usize,
        ok: bool,
    },
    Tick {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..IDS, 0..WORKLOADS.len(), any::<bool>()).prop_map(|(id, w, evict)| Op::Start { id, w, evict }),
        2 => (0..IDS).prop_map(|id| Op::Stop { id }),
        4 => (0..IDS).prop_map(|id| Op::Sleep { id }),
        2 => Just(Op::Idle),
        1 => (0..IDS).prop_map(|id| Op::FellAsleep { id }),
        1 => (0..IDS).prop_map(|id| Op::WokeByItself { id }),
        1 => (0..IDS).prop_map(|id| Op::Exit { id }),
        1 => (0..IDS, 0..WORKLOADS.len(), 0u8..4).prop_map(|(id, w, tier)| Op::TakeOver { id, w, tier }),
        1 => (0..IDS, 0..WORKLOADS.len(), 0u64..4).prop_map(|(id, w, present_gb)| Op::Adopt { id, w, present_gb }),
        1 => prop_oneof![Just(4u64), Just(7), Just(12)].prop_map(|ram_gb| Op::Reload { ram_gb }),
        1 => (0..IDS, any::<bool>(), 0u64..5).prop_map(|(id, gpu, gb)| Op::Measure { id, gpu, gb }),
        8 => (any::<usize>(), prop::bool::weighted(0.85)).prop_map(|(pick, ok)| Op::Progress { pick, ok }),
        2 => (0u64..3_000).prop_map(|ms| Op::Tick { ms }),
    ]
}

/// What the fake supervisor has yet to carry out.
#[derive(Debug, Clone)]
enum Pending {
    /// Run `generation` of `id` will exit (stopped, or evicted).
    Exit(String, u64),
    /// Its sleep (or wake) call will end.
    Call(String, u64, bool),
}

/// How often each kind of change happened over a whole run: a property
/// that never admits, never sleeps or never refuses proves nothing.
#[derive(Debug, Default)]
struct Tally {
    started: std::sync::atomic::AtomicUsize,
    slept: std::sync::atomic::AtomicUsize,
    sleep_refused: std::sync::atomic::AtomicUsize,
    woken: std::sync::atomic::AtomicUsize,
    taken_over: std::sync::atomic::AtomicUsize,
    adopted: std::sync::atomic::AtomicUsize,
    evicted: std::sync::atomic::AtomicUsize,
}

impl Tally {
    fn add(counter: &std::sync::atomic::AtomicUsize) {
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    fn get(counter: &std::sync::atomic::AtomicUsize) -> usize {
        counter.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The test's model and the books under test.
struct World<'t> {
    tally: &'t Tally,
    b: Books,
    config: Arc<Config>,
    now: u64,
    pending: Vec<Pending>,
    /// Which (id, run) hold a reservation.
    held: BTreeSet<(String, u64)>,
}

impl<'t> World<'t> {
    fn new(tally: &'t Tally) -> Self {
        let config = Arc::new(config(4));
        Self {
            tally,
            b: Books::new(&config),
            config,
            now: 1,
            pending: Vec::new(),
            held: BTreeSet::new(),
        }
    }

    fn id(i: usize) -> String {
        format!("i{i}")
    }

    /// What an admission (or a wake) leaves the supervisor to do.
    fn carry(&mut self, a: &Admitted) {
        for v in &a.evictions {
            Tally::add(&self.tally.evicted);
            self.pending.push(Pending::Exit(v.id.clone(), v.generation));
        }
        for s in &a.sleepers {
            self.pending
                .push(Pending::Call(s.id.clone(), s.generation, true));
        }
    }

    /// A stop of run `run` of `id` (any run when `None`) the agent asks.
    fn stop(&mut self, id: &str, run: Option<u64>, cause: pb::Cause) {
        if let Some(c) = self.b.cancel(id, run, cause)
            && c.resident
        {
            self.pending
                .push(Pending::Exit(id.to_string(), c.generation));
        }
    }

    /// A run's end: the one release path.
    fn exit(&mut self, id: &str, generation: u64) -> Result<(), TestCaseError> {
        let expected = self.held.remove(&(id.to_string(), generation));
        prop_assert_eq!(
            self.b.release(id, generation),
            expected,
            "the release of {} run {}",
            id,
            generation
        );
        Ok(())
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        let now = self.now;
        match op {
            Op::Start { id, w, evict } => {
                let id = InstanceId::new(Self::id(id)).expect("an id");
                let w = self.config.workloads[WORKLOADS[w]].clone();
                let policy = if evict { Policy::Evict } else { Policy::Refuse };
                let config = self.config.clone();
                // Place naming the id first: the dry run of this Start.
                let dry = self.b.place(&w, Some(&id), policy, now, None);
                let decided = self.b.admit(&config, &w, &id, policy, now, 0, None, None);
                agrees(&dry, &decided)?;
                match decided {
                    Ok(Decision::Admitted(a)) => {
                        Tally::add(&self.tally.started);
                        prop_assert!(self.held.insert((id.to_string(), a.generation)));
                        self.carry(&a);
                    }
                    Ok(Decision::Wake(a)) => {
                        Tally::add(&self.tally.woken);
                        self.carry(&a);
                        self.pending
                            .push(Pending::Call(id.to_string(), a.generation, false));
                    }
                    _ => {}
                }
            }
            Op::Stop { id } => self.stop(&Self::id(id), None, pb::Cause::Stopped),
            Op::Sleep { id } => {
                let id = Self::id(id);
                match self.b.begin_sleep(&id, None, now) {
                    Ok(s) => self.pending.push(Pending::Call(id, s.generation, true)),
                    Err(ApiError::Refused { .. }) => Tally::add(&self.tally.sleep_refused),
                    Err(_) => {}
                }
            }
            Op::Idle => {
                for (id, run) in self.b.sleepy(now) {
                    match self.b.begin_sleep(&id, Some(run), now) {
                        Ok(s) => self.pending.push(Pending::Call(id, s.generation, true)),
                        Err(ApiError::Refused { .. }) => self.stop(&id, Some(run), pb::Cause::Idle),
                        Err(_) => {}
                    }
                }
            }
            Op::FellAsleep { id } => {
                let id = Self::id(id);
                let Some(r) = self.b.record(&id) else {
                    return Ok(());
                };
                if let Err(ApiError::Refused { .. }) = self.b.fell_asleep(&id, r.generation, now) {
                    self.stop(&id, Some(r.generation), pb::Cause::Idle);
                }
            }
            Op::WokeByItself { id } => {
                let id = InstanceId::new(Self::id(id)).expect("an id");
                let Some(r) = self.b.record(id.as_str()) else {
                    return Ok(());
                };
                if let Err(ApiError::Refused { .. }) = self.b.woke_by_itself(&id, r.generation, now)
                {
                    self.stop(id.as_str(), Some(r.generation), pb::Cause::Overrun);
                }
            }
            Op::Exit { id } => {
                let id = Self::id(id);
                if let Some(r) = self.b.record(&id) {
                    self.exit(&id, r.generation)?;
                }
            }
            Op::TakeOver { id, w, tier } => {
                let id = InstanceId::new(Self::id(id)).expect("an id");
                let w = self.config.workloads[WORKLOADS[w]].clone();
                let sleeps = w.sleep.is_some();
                let as_it_was = match tier {
                    1 if sleeps => Some(Sleepy::Asleep(now)),
                    2 if sleeps => Some(Sleepy::Falling),
                    3 if sleeps => Some(Sleepy::Waking),
                    _ => None,
                };
                let config = self.config.clone();
                let taken = self.b.admit(
                    &config,
                    &w,
                    &id,
                    Policy::Refuse,
                    now,
                    0,
                    None,
                    Some(as_it_was),
                );
                if let Ok(Decision::Admitted(a)) = taken {
                    Tally::add(&self.tally.taken_over);
                    prop_assert!(self.held.insert((id.to_string(), a.generation)));
                    if let Some(s @ (Sleepy::Falling | Sleepy::Waking)) = as_it_was {
                        // Its call is made again once it is READY.
                        let sleep = s == Sleepy::Falling;
                        self.pending
                            .push(Pending::Call(id.to_string(), a.generation, sleep));
                    }
                }
            }
            Op::Adopt { id, w, present_gb } => {
                let id = InstanceId::new(Self::id(id)).expect("an id");
                let w = self.config.workloads[WORKLOADS[w]].clone();
                let adoption = Adoption {
                    pid: 4_000_000 + id.as_str().len() as u32 + now as u32,
                    start_ticks: now,
                    port: 1,
                    manage: true,
                };
                let pool = w.spec.demand.keys().next().cloned();
                let present: BTreeMap<PoolName, u64> =
                    pool.into_iter().map(|p| (p, present_gb * GB)).collect();
                let config = self.config.clone();
                if let Ok((generation, _)) = self.b.adopt(&config, &w, &id, now, adoption, &present)
                {
                    Tally::add(&self.tally.adopted);
                    prop_assert!(self.held.insert((id.to_string(), generation)));
                }
            }
            Op::Reload { ram_gb } => {
                self.config = Arc::new(config(ram_gb));
                self.b.reconfigure(&self.config);
            }
            Op::Measure { id, gpu, gb } => {
                let pool = PoolName::new(if gpu { "gpu" } else { "ram" }).expect("a pool");
                self.b.set_readings(Readings {
                    measured: vec![(Self::id(id), pool, gb * GB)],
                    ..Readings::default()
                });
            }
            Op::Progress { pick, ok } => {
                if self.pending.is_empty() {
                    return Ok(());
                }
                let next = self.pending.remove(pick % self.pending.len());
                self.progress(next, ok)?;
            }
            Op::Tick { ms } => self.now += ms,
        }
        Ok(())
    }

    /// Carries one decision out: an exit, or a call that ends (`ok`) or
    /// fails (its run is then stopped, as `SLEEP_FAILED`).
    fn progress(&mut self, p: Pending, ok: bool) -> Result<(), TestCaseError> {
        match p {
            Pending::Exit(id, generation) => self.exit(&id, generation)?,
            Pending::Call(id, generation, sleep) => {
                let to = if sleep {
                    Sleepy::Asleep(self.now)
                } else {
                    Sleepy::Woken(1)
                };
                let settled = ok && self.b.settle(&id, generation, to);
                if settled && sleep {
                    Tally::add(&self.tally.slept);
                }
                if !settled {
                    // Failed, or its run was stopped meanwhile: a run that
                    // is no longer wanted stops (its stop may be under way).
                    self.stop(&id, Some(generation), pb::Cause::SleepFailed);
                }
            }
        }
        Ok(())
    }

    /// The books' own figures and records, checked against each other and
    /// the model; `before`: each pool's committed bytes before the step.
    fn check(&self, before: &BTreeMap<String, u64>, measured: bool) -> Result<(), TestCaseError> {
        let committed = self.committed();
        let inner = self.b.lock();
        for pool in inner.ledger.pools() {
            let name = pool.name.to_string();
            let sum: u64 = inner
                .ledger
                .residents()
                .map(|r| r.charge(&name).counted())
                .sum();
            prop_assert_eq!(pool.used, sum, "pool {}: charged once each", &name);
            let was = before.get(&name).copied().unwrap_or(0);
            let now = committed.get(&name).copied().unwrap_or(0);
            if let Some(effective) = pool.effective
                && now > effective
                && now > was
            {
                prop_assert!(
                    measured,
                    "pool {} rose from {} to {} committed, past its budget of {}, without a reading",
                    &name,
                    was,
                    now,
                    effective
                );
            }
        }
        prop_assert!(
            inner.ended_is_true(),
            "the ended index and the records differ"
        );
        let residents: BTreeSet<String> =
            inner.ledger.residents().map(|r| r.id.to_string()).collect();
        let model: BTreeSet<String> = self.held.iter().map(|(id, _)| id.clone()).collect();
        prop_assert_eq!(&residents, &model, "who holds a reservation");
        for (id, generation) in &self.held {
            let record = inner.records.get(id);
            prop_assert_eq!(
                record.map(|r| r.generation),
                Some(*generation),
                "{}'s run",
                id
            );
        }
        Ok(())
    }

    /// What each pool is committed to once the moves under way are done:
    /// a resident's charge, except that a leaving one (a victim, a stop)
    /// commits nothing and one falling asleep only its asleep demand (its
    /// readings are dropped when it settles). The
    /// books count both in full meanwhile (no start counts on memory still
    /// in use), so these may pass a budget while victims exit; what may
    /// never pass it is a commitment.
    fn committed(&self) -> BTreeMap<String, u64> {
        let inner = self.b.lock();
        let mut out = BTreeMap::new();
        for pool in inner.ledger.pools() {
            let name = pool.name.to_string();
            let sum: u64 = inner
                .ledger
                .residents()
                .map(|r| {
                    let falling = r.tier == Tier::Moving
                        && inner
                            .records
                            .get(r.id.as_str())
                            .is_some_and(|rec| rec.sleep == Some(Sleepy::Falling));
                    if r.leaving() {
                        0
                    } else if falling {
                        r.spec.asleep_footprint(&name)
                    } else {
                        r.charge(&name).counted()
                    }
                })
                .sum();
            out.insert(name, sum);
        }
        out
    }

    /// Carries out everything under way (calls succeed): then nothing is
    /// left moving, and each record says where its run stands.
    fn quiesce(&mut self) -> Result<(), TestCaseError> {
        let mut rounds = 0;
        while !self.pending.is_empty() {
            rounds += 1;
            prop_assert!(rounds < 1_000, "the moves never end: {:?}", self.pending);
            let next = self.pending.remove(0);
            let before = self.committed();
            self.progress(next, true)?;
            self.check(&before, false)?;
        }
        let inner = self.b.lock();
        for r in inner.ledger.residents() {
            prop_assert!(
                r.tier != Tier::Moving,
                "{} is stuck moving with nothing under way",
                r.id
            );
            let sleep = inner.records.get(r.id.as_str()).and_then(|rec| rec.sleep);
            prop_assert!(
                !matches!(sleep, Some(Sleepy::Falling | Sleepy::Waking)),
                "{}'s record says {:?} with nothing under way",
                r.id,
                sleep
            );
        }
        Ok(())
    }
}

/// A Start's dry run (`place` naming its id) said what the Start then did: the
/// same victims and sleepers for an admission or a wake, not admitted for
/// a refusal.
fn agrees(
    dry: &Result<pb::Placement, ApiError>,
    decided: &Result<Decision, ApiError>,
) -> Result<(), TestCaseError> {
    match (dry, decided) {
        (Ok(p), Ok(Decision::Admitted(a) | Decision::Wake(a))) => {
            let evict: Vec<&str> = a.evictions.iter().map(|e| e.id.as_str()).collect();
            let sleep: Vec<&str> = a.sleepers.iter().map(|s| s.id.as_str()).collect();
            prop_assert!(
                p.admitted,
                "the dry run refused what the Start admitted: {p:?}"
            );
            prop_assert_eq!(&p.evict, &evict, "victims");
            prop_assert_eq!(&p.sleep, &sleep, "sleepers");
        }
        (Ok(p), Err(ApiError::Refused { .. })) => {
            prop_assert!(
                !p.admitted,
                "the dry run admitted what the Start refused: {p:?}"
            );
        }
        (Err(_), Ok(Decision::Admitted(_) | Decision::Wake(_))) => {
            prop_assert!(
                false,
                "the dry run failed where the Start admitted: {dry:?}"
            );
        }
        _ => {}
    }
    Ok(())
}

fn run(tally: &Tally, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut w = World::new(tally);
    for op in ops {
        let measured = matches!(op, Op::Measure { .. });
        let before = w.committed();
        w.apply(op)?;
        w.check(&before, measured)?;
    }
    w.quiesce()
}

#[test]
fn every_charge_is_planned_and_nothing_is_left_moving() {
    // The seed is printed so that a failure can be run again.
    let seed: u64 = std::env::var("PROPTEST_RNG_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_nanos() as u64)
        });
    println!("books property: PROPTEST_RNG_SEED={seed}");
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &bytes);
    let config = RunnerConfig {
        cases: 256,
        failure_persistence: None,
        ..RunnerConfig::default()
    };
    let mut runner = TestRunner::new_with_rng(config, rng);
    let tally = Tally::default();
    let result = runner.run(&proptest::collection::vec(op(), 1..80), |ops| {
        run(&tally, ops)
    });
    if let Err(e) = result {
        panic!("{e} (seed: PROPTEST_RNG_SEED={seed})");
    }
    println!("books property: {tally:?}");
    for (what, n) in [
        ("starts admitted", &tally.started),
        ("sleeps settled", &tally.slept),
        ("sleeps refused", &tally.sleep_refused),
        ("wakes admitted", &tally.woken),
        ("takeovers", &tally.taken_over),
        ("adoptions", &tally.adopted),
        ("evictions", &tally.evicted),
    ] {
        assert!(
            Tally::get(n) > 0,
            "no {what} over the run: {tally:?} (seed {seed})"
        );
    }
}
