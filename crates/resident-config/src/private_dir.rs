//! The agent's own directories (its state directory, the directory of its
//! socket): what it trusts them to be, and how it makes them.
//!
//! The agent acts on what its state directory holds (a journal names
//! process groups it kills at start-up; handover files; its servers'
//! output pipes), so a directory another user can write is a way to make
//! it kill that user's choice of processes. A directory is trusted when it
//! is a directory (not a symbolic link) owned by the agent's user that
//! neither its group nor others can write, and every directory above it is
//! owned by that user or root and writable by no one else, or is sticky
//! (`/tmp`: others may add entries, but not rename or remove ours).

use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// Group or others may write.
const SHARED_WRITE: u32 = 0o022;
/// The sticky bit.
const STICKY: u32 = 0o1000;

/// Whether `dir` (which must exist) and every directory above it can be
/// trusted by an agent running as `euid`; `Err` says which path and why.
pub fn check(dir: &Path, euid: u32) -> Result<(), String> {
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if meta.file_type().is_symlink() {
        return Err(format!(
            "{} is a symbolic link; give the directory itself",
            dir.display()
        ));
    }
    if !meta.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    if meta.uid() != euid {
        return Err(format!(
            "{} belongs to uid {}, not to the agent's uid {euid}: use a directory of the agent's own",
            dir.display(),
            meta.uid()
        ));
    }
    if meta.mode() & SHARED_WRITE != 0 {
        return Err(format!(
            "{} can be written by its group or others (mode {:o}): chmod go-w it",
            dir.display(),
            meta.mode() & 0o7777
        ));
    }
    ancestors_trusted(dir, euid)
}

/// Every directory above `dir`, symbolic links resolved: owned by `euid`
/// or root, and writable by no one else unless sticky.
fn ancestors_trusted(dir: &Path, euid: u32) -> Result<(), String> {
    let real = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    match real.parent() {
        Some(above) => chain_trusted(dir, above, euid),
        None => Ok(()),
    }
}

/// `from` and every directory above it (symbolic links resolved), where
/// `dir` is or will be: each owned by `euid` or root, and writable by no
/// one else unless sticky.
fn chain_trusted(dir: &Path, from: &Path, euid: u32) -> Result<(), String> {
    let real = std::fs::canonicalize(from).map_err(|e| format!("{}: {e}", from.display()))?;
    for above in real.ancestors() {
        let meta = std::fs::metadata(above).map_err(|e| format!("{}: {e}", above.display()))?;
        let owner_ok = meta.uid() == euid || meta.uid() == 0;
        let mode = meta.mode();
        let write_ok = mode & SHARED_WRITE == 0 || mode & STICKY != 0;
        if !owner_ok || !write_ok {
            return Err(format!(
                "{} lies under {}, which {}: another user could replace it",
                dir.display(),
                above.display(),
                if owner_ok {
                    format!("others can write (mode {:o})", mode & 0o7777)
                } else {
                    format!("belongs to uid {}", meta.uid())
                }
            ));
        }
    }
    Ok(())
}

/// As `check` where `dir` exists; where it does not, whether it can be
/// made safely: the nearest directory above it that exists, and every
/// one above that, trusted as `check` trusts ancestors.
pub fn check_or_creatable(dir: &Path, euid: u32) -> Result<(), String> {
    if std::fs::symlink_metadata(dir).is_ok() {
        return check(dir, euid);
    }
    match dir.ancestors().skip(1).find(|a| a.exists()) {
        Some(existing) => chain_trusted(dir, existing, euid),
        None => Ok(()),
    }
}

/// Makes `dir` (and any missing directory above it) with `mode` where it is
/// missing, then checks it (`check`): a directory someone else made first,
/// or made writable, is refused, never used.
pub fn ensure(dir: &Path, mode: u32, euid: u32) -> Result<(), String> {
    if std::fs::symlink_metadata(dir).is_err() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(dir)
            .map_err(|e| format!("creating {}: {e}", dir.display()))?;
        // The umask may have taken bits the mode asked for: the mode is
        // what was asked.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    check(dir, euid)
}

/// The directory of the Unix socket at `socket`.
pub fn socket_dir(socket: &Path) -> PathBuf {
    socket
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn euid() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn a_private_directory_is_trusted_and_a_shared_one_refused() {
        let top = tempfile::tempdir().expect("tempdir");
        let own = top.path().join("state");
        ensure(&own, 0o700, euid()).expect("made and trusted");
        let mode = std::fs::metadata(&own).expect("meta").mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::set_permissions(&own, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = check(&own, euid()).expect_err("writable by others");
        assert!(e.contains("chmod go-w") && e.contains("state"), "{e}");
        let e = check(&own, euid() + 1).expect_err("another user's");
        assert!(e.contains("not to the agent's uid"), "{e}");
        let link = top.path().join("link");
        std::os::unix::fs::symlink(&own, &link).expect("symlink");
        let e = check(&link, euid()).expect_err("a link");
        assert!(e.contains("symbolic link"), "{e}");
    }

    #[test]
    fn a_directory_under_one_others_can_write_is_refused_unless_it_is_sticky() {
        let top = tempfile::tempdir().expect("tempdir");
        let shared = top.path().join("shared");
        std::fs::create_dir(&shared).expect("mkdir");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let own = shared.join("state");
        let e = ensure(&own, 0o700, euid()).expect_err("under a shared directory");
        assert!(e.contains("another user could replace it"), "{e}");
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).expect("chmod");
        check(&own, euid()).expect("sticky, like /tmp");
        // Not made yet: where it would be made is checked the same way.
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let later = shared.join("later");
        let e = check_or_creatable(&later, euid()).expect_err("under a shared directory");
        assert!(e.contains("another user could replace it"), "{e}");
        check_or_creatable(&top.path().join("later"), euid()).expect("under a private one");
    }
}
