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
        Ok(User {
            name: name.to_string(),
            uid,
            gid,
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
            return Ok(GgufModel {
                architecture: String::new(),
                weights_bytes: 0,
                layers: 0,
                kv_heads: 0,
                key_length: 0,
                value_length: 0,
                context_length: 0,
            });
        }
        crate::gguf::read(Path::new(path)).map_err(|e| format!("{path}: {e}"))
    }

    /// Whether the agent, this process, runs as root.
    pub(crate) fn agent_is_root(self) -> bool {
        self.local() && nix::unistd::geteuid().is_root()
    }

    /// Checks that the program of `argv` (a path, or a name on the PATH the
    /// child will have: the workload's own `env.PATH`, else the agent's) is
    /// a file this agent may execute and that nobody else may replace: not
    /// writable by everyone.
    pub(crate) fn program(self, argv: &[String], path: Option<&str>) -> Result<(), String> {
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
        if meta.permissions().mode() & 0o002 != 0 {
            return Err(format!(
                "program {} is writable by every user: anyone could replace what the agent runs",
                path.display()
            ));
        }
        Ok(())
    }
}
