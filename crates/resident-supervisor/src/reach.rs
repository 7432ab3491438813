//! Whether a user can run a program: search permission on every directory
//! on the way to it, execute permission on the file (and read, for a
//! script the kernel hands to its `#!` interpreter, which then reads it),
//! judged from owners and modes as the kernel judges a process of that
//! uid, gid and groups that holds no capability, as a model does (the
//! child empties its capability sets before exec, root's included). The
//! agent's own `access(2)` answers for the agent instead: as root it may
//! pass where the model, without `CAP_DAC_OVERRIDE`, is refused.
//!
//! A directory or file with a POSIX ACL (`system.posix_acl_access`) is
//! not judged (its mode's group bits are then the ACL's mask, not a
//! group's grant): the spawn finds out.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use nix::libc;

/// The identity a child runs with.
#[derive(Debug, Clone, Copy)]
pub struct Runner<'a> {
    /// Its uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
    /// Its supplementary groups.
    pub groups: &'a [u32],
}

impl Runner<'_> {
    /// Whether `meta`'s mode grants this identity `want` (a mask of the
    /// owner's bits: 0o1 execute or search, 0o4 read).
    fn granted(&self, meta: &std::fs::Metadata, want: u32) -> bool {
        let mode = meta.mode();
        let shift = if meta.uid() == self.uid {
            6
        } else if meta.gid() == self.gid || self.groups.contains(&meta.gid()) {
            3
        } else {
            0
        };
        (mode >> shift) & want == want
    }
}

/// Whether `path` has a POSIX access ACL, which its mode alone does not
/// describe.
fn has_acl(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: getxattr with a NUL-terminated path and name, asking only
    // for the value's size (a null buffer of length 0).
    let n = unsafe {
        libc::getxattr(
            c.as_ptr(),
            c"system.posix_acl_access".as_ptr(),
            std::ptr::null_mut(),
            0,
        )
    };
    n > 0
}

/// The directories a lookup of `path` searches, outermost first: those of
/// the path as written, then those of the file it resolves to (through
/// symbolic links), each once.
fn directories(path: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let real = std::fs::canonicalize(path).ok();
    for p in [Some(path), real.as_deref()].into_iter().flatten() {
        for dir in p.ancestors().skip(1) {
            if !dir.as_os_str().is_empty() && !out.iter().any(|d| d == dir) {
                out.push(dir.to_path_buf());
            }
        }
    }
    out.sort_by_key(|d| d.components().count());
    out
}

/// `who` as messages name it: `user "llm" (uid 999, gid 999)`.
pub fn user_of(who: &Runner<'_>) -> String {
    let name = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(who.uid))
        .ok()
        .flatten()
        .map(|u| format!("user {:?} ", u.name))
        .unwrap_or_default();
    format!("{name}(uid {}, gid {})", who.uid, who.gid)
}

/// Whether `who` can execute the file at `path` (absolute, as the spawn
/// resolves it): `Err` names the program, the user and the directory or
/// file that stops it, with its mode and owner.
pub fn can_run(path: &Path, who: &Runner<'_>) -> Result<(), String> {
    let stopped = |at: &Path, meta: &std::fs::Metadata, what: &str| {
        Err(format!(
            "program {} cannot be run by {}: {} (mode {:04o}, owner uid {}, group {}) is not {what} for it",
            path.display(),
            user_of(who),
            at.display(),
            meta.mode() & 0o7777,
            meta.uid(),
            meta.gid(),
        ))
    };
    for dir in directories(path) {
        let Ok(meta) = std::fs::metadata(&dir) else {
            continue;
        };
        if !has_acl(&dir) && !who.granted(&meta, 0o1) {
            return stopped(&dir, &meta, "searchable");
        }
    }
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(());
    };
    if has_acl(path) {
        return Ok(());
    }
    if !who.granted(&meta, 0o1) {
        return stopped(path, &meta, "executable");
    }
    if is_script(path) && !who.granted(&meta, 0o4) {
        return stopped(
            path,
            &meta,
            "readable (a script, which its interpreter reads)",
        );
    }
    Ok(())
}

/// Whether the file at `path` begins with `#!`.
fn is_script(path: &Path) -> bool {
    use std::io::Read as _;
    let mut head = [0u8; 2];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok_and(|()| &head == b"#!")
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use super::*;

    fn mode(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    #[test]
    fn a_directory_on_the_way_that_the_user_may_not_search_is_named() {
        let dir = tempfile_dir();
        let inner = dir.join("private");
        std::fs::create_dir(&inner).expect("mkdir");
        let program = inner.join("server");
        std::fs::write(&program, b"\x7fELF").expect("write");
        mode(&program, 0o755);
        let me = nix::unistd::geteuid().as_raw();
        let my_gid = nix::unistd::getegid().as_raw();
        // Another user, in no group of the file's.
        let other = Runner {
            uid: me.wrapping_add(1000),
            gid: my_gid.wrapping_add(1000),
            groups: &[],
        };
        let owner = Runner {
            uid: me,
            gid: my_gid,
            groups: &[],
        };
        mode(&inner, 0o700);
        let said = can_run(&program, &other).expect_err("another user cannot search 0700");
        assert!(
            said.contains(&format!("program {}", program.display()))
                && said.contains(&format!("uid {}", other.uid))
                && said.contains(&format!("{} (mode 0700", inner.display()))
                && said.contains("is not searchable for it"),
            "{said}"
        );
        assert!(can_run(&program, &owner).is_ok(), "its owner can");
        // The group's bit, for a member of the directory's group.
        mode(&inner, 0o710);
        let member = Runner {
            groups: &[my_gid],
            ..other
        };
        assert!(can_run(&program, &member).is_ok());
        assert!(can_run(&program, &other).is_err());
        mode(&inner, 0o711);
        assert!(can_run(&program, &other).is_ok(), "others may search 0711");
        // The file itself: executable by its owner only.
        mode(&program, 0o700);
        let said = can_run(&program, &other).expect_err("not executable by others");
        assert!(said.contains("is not executable"), "{said}");
        // A script must also be readable: its interpreter reads it.
        std::fs::write(&program, b"#!/bin/sh\nexit 0\n").expect("write");
        mode(&program, 0o711);
        let said = can_run(&program, &other).expect_err("a script others cannot read");
        assert!(said.contains("is not readable"), "{said}");
        mode(&program, 0o755);
        assert!(can_run(&program, &other).is_ok());
        mode(&inner, 0o755);
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn the_directories_of_a_link_and_of_its_target_are_searched() {
        let dir = tempfile_dir();
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::create_dir(&a).expect("mkdir");
        std::fs::create_dir(&b).expect("mkdir");
        std::fs::write(b.join("real"), b"\x7fELF").expect("write");
        std::os::unix::fs::symlink(b.join("real"), a.join("link")).expect("symlink");
        let dirs = directories(&a.join("link"));
        assert!(dirs.contains(&a) && dirs.contains(&b), "{dirs:?}");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    /// A fresh directory of this test's own (the supervisor's tests use
    /// no tempfile crate).
    fn tempfile_dir() -> PathBuf {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "reach-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::canonicalize(&dir).expect("canonical")
    }
}
