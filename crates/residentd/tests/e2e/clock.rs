//! The wall clock stepping hours forward or back (an operator's `date -s`,
//! NTP correcting a bad clock, a VM resumed) changes nothing the agent
//! times: idle TTLs, owners' leases and restart backoff run on the
//! monotonic clock. The agent runs with `tests/shims/clockstep.rs`
//! preloaded, which steps its CLOCK_REALTIME alone, while the test watches;
//! an instance's start time (wall clock) shows that the step reached it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::support::*;
use resident_api::pb;

/// Compiles the shim into `dir`; `None` (after saying so) where rustc
/// cannot. CI has the toolchain, so there it fails instead.
fn shim(dir: &Path) -> Option<PathBuf> {
    let out = dir.join("libclockstep.so");
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/shims/clockstep.rs");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let built = Command::new(rustc)
        .args([
            "--edition",
            "2024",
            "--crate-type",
            "cdylib",
            "-C",
            "opt-level=1",
            "-o",
        ])
        .arg(&out)
        .arg(&source)
        .status();
    if matches!(built, Ok(s) if s.success()) {
        return Some(out);
    }
    let why = format!("cannot compile the clock shim with rustc: {built:?}");
    assert!(std::env::var_os("CI").is_none(), "{why}");
    skip(&why);
    None
}

/// Sets the agent's wall clock to the real one plus `seconds`.
fn step(file: &Path, seconds: i64) {
    std::fs::write(file, seconds.to_string()).expect("write the clock offset");
}

fn unix_ms() -> i64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970");
    i64::try_from(now.as_millis()).expect("in range")
}

#[tokio::test]
async fn a_wall_clock_step_leaves_idle_ttls_leases_and_backoff_alone() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let Some(shim) = shim(dir.path()) else {
        return;
    };
    let clock = dir.path().join("clock-offset");
    step(&clock, 0);
    let mut config = pool("ram", "20GB");
    config += &sleeper("hour", "ram", 1, "idle_ttl = \"1h\"");
    config += &sleeper("brief", "ram", 1, "idle_ttl = \"2s\"");
    config += &sleeper("plain", "ram", 1, "");
    config += &shell(
        "crashing",
        "sleep 0.2; exit 3",
        "policy = \"on-failure\"\nmax_restarts = 1000\nbackoff = \"300ms\"\nbackoff_max = \"300ms\"",
    );
    write_config(dir.path(), &config);
    let mut d = Daemon::start_in_with(dir, |cmd| {
        cmd.env("LD_PRELOAD", &shim).env("CLOCKSTEP_FILE", &clock);
    })
    .await;
    d.started("hour", "hour").await;
    let owned = d.client.start(leased("plain", "owned", 3_600_000)).await;
    owned.expect("a leased start");
    d.started("crashing", "crashing").await;

    // Two hours forward.
    step(&clock, 2 * 3600);
    d.started("plain", "witness").await;
    let witness = d.wait_state("witness", pb::State::Ready).await;
    let ahead_s = (i64::try_from(witness.started_unix_ms).expect("in range") - unix_ms()) / 1000;
    assert!(
        (7100..7300).contains(&ahead_s),
        "the agent's wall clock runs {ahead_s} s ahead, not two hours: the shim did not step it"
    );
    // A 2 s TTL started now runs out after 2 s; by then a TTL or lease
    // reckoned on the wall clock would have ended the hour-long ones.
    d.started("brief", "brief").await;
    let brief = d.wait_state("brief", pb::State::Exited).await;
    assert!(brief.message.contains("idle TTL"), "{brief:?}");
    let hour = d.get("hour").await;
    assert_eq!(
        hour.state,
        pb::State::Ready as i32,
        "1 h TTL kept: {hour:?}"
    );
    let owned = d.get("owned").await;
    assert_eq!(
        owned.state,
        pb::State::Ready as i32,
        "1 h lease kept: {owned:?}"
    );
    assert!(
        owned.lease_left_ms > 3_500_000,
        "the lease did not lose the step: {owned:?}"
    );

    // Three hours back (one behind the real clock), with a 2 s TTL, a
    // 1.5 s lease and a 300 ms backoff all under way: each still runs out.
    d.started("brief", "brief-again").await;
    let lapsing = d.client.start(leased("plain", "lapsing", 1_500)).await;
    lapsing.expect("a leased start");
    let restarts = d.get("crashing").await.restarts;
    step(&clock, -3600);
    let brief = d.wait_state("brief-again", pb::State::Exited).await;
    assert!(brief.message.contains("idle TTL"), "{brief:?}");
    let lapsed = d.wait_state("lapsing", pb::State::Exited).await;
    assert!(lapsed.message.starts_with("LEASE_EXPIRED"), "{lapsed:?}");
    let mut last = 0;
    let restarted = eventually(async || {
        last = d.get("crashing").await.restarts;
        last >= restarts + 3
    })
    .await;
    assert!(
        restarted,
        "restarts went from {restarts} to {last} only after the step back"
    );
    let hour = d.get("hour").await;
    assert_eq!(hour.state, pb::State::Ready as i32, "{hour:?}");
}
