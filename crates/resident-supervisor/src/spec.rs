//! What the supervisor needs to run one instance: the command line, its
//! environment, readiness, restart and stop settings, and the macros that
//! fill `${PORT}` and friends in.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// How to tell that a started server is ready to serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Ready as soon as it is spawned.
    None,
    /// Ready once a TCP connect to `127.0.0.1:PORT` succeeds.
    Tcp,
    /// Ready once `GET path` on `127.0.0.1:PORT` answers 200.
    Http {
        /// The request path, starting with `/`.
        path: String,
    },
}

/// When a process that exited is started again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartMode {
    /// Never.
    Never,
    /// After an exit with a non-zero code or a signal.
    OnFailure,
    /// After any exit that was not asked for.
    Always,
}

/// Restart policy with exponential backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// When to restart.
    pub mode: RestartMode,
    /// Consecutive restarts before giving up.
    pub max_restarts: u32,
    /// The first delay; it doubles per consecutive try.
    pub backoff: Duration,
    /// The cap on the delay.
    pub backoff_max: Duration,
    /// A run at least this long resets the consecutive count and the delay.
    pub stable_after: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        Self {
            mode: RestartMode::OnFailure,
            max_restarts: 5,
            backoff: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            stable_after: Duration::from_secs(60),
        }
    }
}

impl RestartPolicy {
    /// The delay before consecutive try `n` (0-based): `backoff * 2^n`,
    /// capped at `backoff_max`.
    pub fn delay(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX);
        self.backoff.saturating_mul(factor).min(self.backoff_max)
    }

    /// Whether an exit with `success` calls for a restart under this mode.
    pub fn wants_restart(&self, success: bool) -> bool {
        match self.mode {
            RestartMode::Never => false,
            RestartMode::OnFailure => !success,
            RestartMode::Always => true,
        }
    }
}

/// Everything needed to run one instance.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// The instance id (unique among live instances).
    pub instance: String,
    /// The workload it is a copy of.
    pub workload: String,
    /// Its role.
    pub role: String,
    /// Program and arguments, never passed through a shell. Macros allowed.
    pub argv: Vec<String>,
    /// Environment set over a cleared one. Macros allowed in values.
    pub env: BTreeMap<String, String>,
    /// Variables of the agent's environment passed through, besides
    /// `PATH`, `HOME` and `LANG`.
    pub pass_env: Vec<String>,
    /// Working directory; the agent's when `None`.
    pub cwd: Option<PathBuf>,
    /// Run as this uid and gid, with `groups` as its supplementary groups;
    /// the agent's own uid and gid leave the child as the agent is, with
    /// its supplementary groups.
    pub user: Option<(u32, u32)>,
    /// The supplementary groups of `user` (its own, as `getgrouplist`
    /// lists them); empty: its primary group only.
    pub groups: Vec<u32>,
    /// How readiness is probed.
    pub readiness: Readiness,
    /// How long readiness may take.
    pub readiness_timeout: Duration,
    /// What happens after an exit.
    pub restart: RestartPolicy,
    /// SIGTERM to SIGKILL.
    pub stop_grace: Duration,
    /// The most memory its cgroup may hold, where cgroups can limit
    /// memory; `None`: no limit.
    pub memory_limit: Option<u64>,
    /// An opaque tag the caller chooses (an incarnation number), echoed in
    /// every status, so that a late event of an earlier run of the same id
    /// can be told apart.
    pub generation: u64,
}

impl LaunchSpec {
    /// A spec running `argv` with defaults: no readiness, restart on
    /// failure, 10 s grace.
    pub fn new(instance: impl Into<String>, argv: Vec<String>) -> Self {
        let instance = instance.into();
        Self {
            workload: instance.clone(),
            role: instance.clone(),
            instance,
            argv,
            env: BTreeMap::new(),
            pass_env: Vec::new(),
            cwd: None,
            user: None,
            groups: Vec::new(),
            readiness: Readiness::None,
            readiness_timeout: Duration::from_secs(120),
            restart: RestartPolicy::default(),
            stop_grace: Duration::from_secs(10),
            memory_limit: None,
            generation: 0,
        }
    }
}

/// The values macros expand to.
#[derive(Debug, Clone)]
pub struct Macros<'a> {
    /// `${PORT}`.
    pub port: u16,
    /// `${INSTANCE}`.
    pub instance: &'a str,
    /// `${WORKLOAD}`.
    pub workload: &'a str,
    /// `${ROLE}`.
    pub role: &'a str,
}

/// The macro names the supervisor fills in.
pub const MACROS: [&str; 4] = ["PORT", "INSTANCE", "WORKLOAD", "ROLE"];

impl Macros<'_> {
    /// Replaces every known `${NAME}` in `s`; anything else stays as written.
    pub fn expand(&self, s: &str) -> String {
        if !s.contains("${") {
            return s.to_string();
        }
        let port = self.port.to_string();
        s.replace("${PORT}", &port)
            .replace("${INSTANCE}", self.instance)
            .replace("${WORKLOAD}", self.workload)
            .replace("${ROLE}", self.role)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_cap() {
        let p = RestartPolicy {
            backoff: Duration::from_millis(100),
            backoff_max: Duration::from_millis(700),
            ..RestartPolicy::default()
        };
        let delays: Vec<u128> = (0..5).map(|n| p.delay(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 700, 700]);
        assert_eq!(p.delay(400), Duration::from_millis(700));
    }

    #[test]
    fn macros_expand_in_place() {
        let m = Macros {
            port: 8080,
            instance: "i-1",
            workload: "coder",
            role: "r",
        };
        assert_eq!(m.expand("--port=${PORT}"), "--port=8080");
        assert_eq!(m.expand("${INSTANCE}/${WORKLOAD}/${ROLE}"), "i-1/coder/r");
        assert_eq!(m.expand("${HOME}"), "${HOME}");
    }
}
