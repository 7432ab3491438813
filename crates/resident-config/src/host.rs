//! Every look-up on the machine a configuration is checked on: users and
//! groups by name, each workload's program (found on PATH, a file, executable,
//! not writable by everyone), the `[node.tls]` files, the GGUF headers of
//! `from_gguf`, and whether the agent runs as root. Validation asks
//! `Lookups` and never the machine itself, so a configuration written for
//! another machine can be checked here with every look-up switched off.

use std::path::Path;

use crate::User;
use crate::gguf::GgufModel;

/// The uid or gid a name gets when it is not looked up
/// (`Host::Elsewhere`): `u32::MAX`, `(uid_t)-1`, which the kernel refuses
/// as an id, so a configuration checked for another machine cannot run
/// anything here as a guessed user.
pub const UNRESOLVED_ID: u32 = u32::MAX;

/// Which machine a configuration is checked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Host {
    /// This one, the agent's: every name is resolved and every file read
    /// here, and a name or file missing here is an error.
    #[default]
    Local,
    /// Another machine: nothing is looked up or read on this one. The rules
    /// of the document itself are all checked; these are skipped:
    ///
    /// - `run_as` (node and workload) and `socket_group`: the names are kept,
    ///   uid and gid are `UNRESOLVED_ID`;
    /// - each workload's program: not looked up on PATH, nor checked to be a
    ///   file, executable and not writable by everyone;
    /// - `[node.tls]`: the files are not read, `TlsFiles` holds empty
    ///   vectors;
    /// - `from_gguf`: the file is not read; its weights count 0 bytes and
    ///   its KV cache `kv` if given, else 0 (`kv_type` is still checked
    ///   by name);
    /// - the warnings about workloads that would run as root: none, since
    ///   whether the agent runs as root there is not known here.
    Elsewhere,
}

/// What validation asks the machine, and whether it asks at all.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lookups {
    host: Host,
    /// Whether programs are looked up (`parse` leaves them out even here).
    programs: bool,
}

impl Lookups {
    /// Every look-up `host` calls for.
    pub(crate) fn on(host: Host) -> Self {
        Self {
            host,
            programs: true,
        }
    }

    /// This machine's users, groups, TLS files and GGUF headers, but not
    /// its programs.
    pub(crate) fn local_without_programs() -> Self {
        Self {
            host: Host::Local,
            programs: false,
        }
    }

    pub(crate) fn local(self) -> bool {
        self.host == Host::Local
    }

    /// The user called `name`, with its uid and primary gid.
    pub(crate) fn user(self, name: &str) -> Result<User, String> {
        let (uid, gid) = if !self.local() {
            (UNRESOLVED_ID, UNRESOLVED_ID)
        } else {
            match nix::unistd::User::from_name(name) {
                Ok(Some(found)) => (found.uid.as_raw(), found.gid.as_raw()),
                Ok(None) => return Err(format!("no user {name:?} on this machine")),
                Err(e) => return Err(format!("cannot look up user {name:?}: {e}")),
            }
        };
        // Its groups, as a login would give them (a model's user in the
        // group of the GPU's device nodes reaches them).
        let groups = if self.local() {
            std::ffi::CString::new(name)
                .ok()
                .and_then(|c| nix::unistd::getgrouplist(&c, nix::unistd::Gid::from_raw(gid)).ok())
                .map(|list| list.iter().map(|g| g.as_raw()).collect())
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        Ok(User {
            name: name.to_string(),
            uid,
            gid,
            groups,
        })
    }

    /// The gid of the group called `name`.
    pub(crate) fn group(self, name: &str) -> Result<u32, String> {
        if !self.local() {
            return Ok(UNRESOLVED_ID);
        }
        let found = nix::unistd::Group::from_name(name).ok().flatten();
        let group = found.ok_or_else(|| format!("no group {name:?} on this machine"))?;
        Ok(group.gid.as_raw())
    }

    /// Whether the agent, running as this process does, can trust the
    /// directory `dir` (or the place it would be made): see
    /// `private_dir`. Elsewhere, nothing is checked.
    pub(crate) fn private_dir(self, dir: &Path) -> Result<(), String> {
        if !self.local() {
            return Ok(());
        }
        crate::private_dir::check_or_creatable(dir, nix::unistd::geteuid().as_raw())
    }

    /// The directory the agent runs in (which a relative `cwd` or program
    /// path is taken against); elsewhere, `None`.
    pub(crate) fn current_dir(self) -> Option<std::path::PathBuf> {
        if !self.local() {
            return None;
        }
        std::env::current_dir().ok()
    }

    /// The contents of the file at `path`.
    pub(crate) fn read(self, path: &str) -> Result<Vec<u8>, String> {
        if !self.local() {
            return Ok(Vec::new());
        }
        std::fs::read(path).map_err(|e| format!("cannot read {path:?}: {e}"))
    }

    /// The header of the GGUF file at `path`; elsewhere, a model of no
    /// bytes and no layers (so any KV cache of a known type is 0 bytes).
    pub(crate) fn gguf(self, path: &str) -> Result<GgufModel, String> {
        if !self.local() {
            return Ok(GgufModel::default());
        }
        crate::gguf::read(Path::new(path)).map_err(|e| format!("{path}: {e}"))
    }

    /// The tensor bytes of the GGUF file at `path` (a vision projector);
    /// elsewhere, 0.
    pub(crate) fn gguf_tensor_bytes(self, path: &str) -> Result<u64, String> {
        if !self.local() {
            return Ok(0);
        }
        crate::gguf::tensor_bytes(Path::new(path)).map_err(|e| format!("{path}: {e}"))
    }

    /// The user called `name`, as `run_as` names it: one this agent can
    /// run children as. Elsewhere, as `user`.
    pub(crate) fn run_as(self, name: &str) -> Result<User, String> {
        let user = self.user(name)?;
        if !self.local() {
            return Ok(user);
        }
        let agent = Agent {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            can_change_user: can_change_user(),
        };
        agent.can_run_as(&user)?;
        Ok(user)
    }

    /// Whether the agent, this process, runs as root.
    pub(crate) fn agent_is_root(self) -> bool {
        self.local() && nix::unistd::geteuid().is_root()
    }

    /// What the server `program` (found as the supervisor finds it) is
    /// projected to hold for `ask`, by the projection tool beside it.
    /// `Ok(None)` elsewhere, where nothing is run.
    pub(crate) fn projection(
        self,
        program: &str,
        path: Option<&str>,
        ask: &crate::projection::Ask,
    ) -> Result<Option<crate::projection::Projection>, String> {
        if !(self.local() && self.programs) {
            return Ok(None);
        }
        let agents = std::env::var("PATH").ok();
        let server = resident_supervisor::find_program(program, path.or(agents.as_deref()))
            .map_err(|_| format!("program {program:?} is not on PATH"))?;
        let tool = crate::projection::tool_beside(&server)
            .ok_or_else(|| format!("no {} beside {}", crate::projection::TOOL, server.display()))?;
        crate::projection::project(&tool, ask).map(Some)
    }

    /// Checks that the program of `argv` (a path, or a name on the PATH the
    /// child will have: the workload's own `env.PATH`, else the agent's) is
    /// a file this agent may execute, that the user the child runs as
    /// (`user`, its `run_as`; else the agent's own) can reach and execute
    /// without any capability, and that nobody else may replace: not
    /// writable by everyone.
    pub(crate) fn program(
        self,
        argv: &[String],
        path: Option<&str>,
        user: Option<&User>,
    ) -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt as _;
        if !(self.local() && self.programs) {
            return Ok(());
        }
        let Some(program) = argv.first() else {
            return Err("empty command".into());
        };
        // The lookup the supervisor makes when it spawns.
        let agents = std::env::var("PATH").ok();
        let path = resident_supervisor::find_program(program, path.or(agents.as_deref()))
            .map_err(|_| format!("program {program:?} is not on PATH"))?;
        let meta =
            std::fs::metadata(&path).map_err(|e| format!("program {}: {e}", path.display()))?;
        if !meta.is_file() {
            return Err(format!("program {} is not a file", path.display()));
        }
        if nix::unistd::access(&path, nix::unistd::AccessFlags::X_OK).is_err() {
            return Err(format!("program {} is not executable", path.display()));
        }
        // As the child: another user, or the agent's own without the
        // capabilities it drops (root's DAC override among them). A user
        // of the agent's own uid and gid keeps the agent's groups.
        let (euid, egid) = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        let own_groups = || -> Vec<u32> {
            nix::unistd::getgroups()
                .map(|gs| gs.iter().map(|g| g.as_raw()).collect())
                .unwrap_or_default()
        };
        let (uid, gid, groups) = match user {
            Some(u) if (u.uid, u.gid) != (euid, egid) => (u.uid, u.gid, u.groups.clone()),
            _ => (euid, egid, own_groups()),
        };
        let runner = resident_supervisor::reach::Runner {
            uid,
            gid,
            groups: &groups,
        };
        resident_supervisor::reach::can_run(&path, &runner)?;
        if meta.permissions().mode() & 0o002 != 0 {
            return Err(format!(
                "program {} is writable by every user: anyone could replace what the agent runs",
                path.display()
            ));
        }
        Ok(())
    }
}

/// Who the agent is, as far as running a child as another user goes.
#[derive(Debug, Clone, Copy)]
struct Agent {
    uid: u32,
    gid: u32,
    /// Whether it holds CAP_SETUID and CAP_SETGID.
    can_change_user: bool,
}

impl Agent {
    /// Whether children can run as `user`: as the agent itself (no change
    /// is made), or as anyone when the agent may change identity.
    fn can_run_as(self, user: &User) -> Result<(), String> {
        if (user.uid, user.gid) == (self.uid, self.gid) || self.can_change_user {
            return Ok(());
        }
        Err(format!(
            "the agent runs as uid {} (gid {}) and cannot run children as {:?} \
             (uid {}, gid {}): that needs root or CAP_SETUID and CAP_SETGID; \
             set run_as to the agent's own user or leave it out",
            self.uid, self.gid, user.name, user.uid, user.gid
        ))
    }
}

/// Whether this process holds CAP_SETUID and CAP_SETGID (its effective
/// set, from `/proc/self/status`); where that cannot be read, whether it
/// is root.
fn can_change_user() -> bool {
    const CAP_SETGID: u32 = 6;
    const CAP_SETUID: u32 = 7;
    let effective = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(line.trim(), 16).ok()
        });
    match effective {
        Some(caps) => caps & (1 << CAP_SETGID) != 0 && caps & (1 << CAP_SETUID) != 0,
        None => nix::unistd::geteuid().is_root(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(agent: (u32, u32, bool), user: (u32, u32), fits: bool) {
        let agent = Agent {
            uid: agent.0,
            gid: agent.1,
            can_change_user: agent.2,
        };
        let user = User {
            groups: Vec::new(),
            name: "llm".into(),
            uid: user.0,
            gid: user.1,
        };
        let said = agent.can_run_as(&user);
        assert_eq!(said.is_ok(), fits, "{agent:?} as {user:?}: {said:?}");
        if let Err(e) = said {
            assert!(e.contains("\"llm\" (uid"), "{e}");
            assert!(e.contains(&format!("uid {}", agent.uid)), "{e}");
        }
    }

    #[test]
    fn children_run_as_the_agent_itself_or_anyone_when_it_may_change_user() {
        // The packaged unit: User=residentd, run_as = "residentd".
        check((998, 998, false), (998, 998), true);
        check((998, 998, false), (1000, 1000), false);
        // Same uid, another primary group: setgid needs the privilege too.
        check((998, 998, false), (998, 100), false);
        check((0, 0, true), (1000, 1000), true);
        check((0, 0, true), (0, 0), true);
        // An unprivileged agent given the capabilities (AmbientCapabilities=).
        check((998, 998, true), (1000, 1000), true);
    }

    #[test]
    fn this_process_reads_its_own_capabilities() {
        // The kernel's own answer: setting this thread's supplementary
        // groups to what they are changes nothing, and needs CAP_SETGID.
        let groups = nix::unistd::getgroups().expect("getgroups");
        let may = nix::unistd::setgroups(&groups).is_ok();
        assert_eq!(can_change_user(), may, "CapEff read against setgroups");
    }
}
