//! Files the agent writes and reads in its state directory (the
//! damaged-journal copy, the handover files), opened relative to a handle
//! on that directory and never through a symbolic link: a new file is made
//! with `O_CREAT | O_EXCL | O_NOFOLLOW` (whatever was at its name removed
//! first), an existing one read with `O_NOFOLLOW`. The directory itself is
//! checked at start-up (`resident_config::private_dir`): the agent's own,
//! writable by no one else.

use std::io::{Read as _, Write as _};
use std::os::fd::OwnedFd;
use std::path::Path;

use nix::fcntl::{OFlag, openat};
use nix::sys::stat::Mode;

fn dir_handle(dir: &Path) -> std::io::Result<OwnedFd> {
    let flags = OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_RDONLY;
    nix::fcntl::open(dir, flags, Mode::empty())
        .map_err(|e| std::io::Error::other(format!("{}: {e}", dir.display())))
}

/// Writes `bytes` as a new file `name` in `dir` (mode 0600), replacing
/// whatever was there (a file, or a link, which is removed, never
/// followed).
pub fn write_new(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let at = |e: nix::errno::Errno| std::io::Error::other(format!("{}/{name}: {e}", dir.display()));
    let handle = dir_handle(dir)?;
    match nix::unistd::unlinkat(&handle, name, nix::unistd::UnlinkatFlags::NoRemoveDir) {
        Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
        Err(e) => return Err(at(e)),
    }
    let flags =
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = openat(&handle, name, flags, Mode::S_IRUSR | Mode::S_IWUSR).map_err(at)?;
    std::fs::File::from(fd).write_all(bytes)
}

/// The contents of file `name` in `dir`, read without following a link
/// (one there is an error, as is a file that is not a regular file).
pub fn read(dir: &Path, name: &str) -> std::io::Result<Vec<u8>> {
    let handle = dir_handle(dir)?;
    let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
    let fd = openat(&handle, name, flags, Mode::empty()).map_err(|e| {
        let kind = if e == nix::errno::Errno::ENOENT {
            std::io::ErrorKind::NotFound
        } else {
            std::io::ErrorKind::Other
        };
        std::io::Error::new(kind, format!("{}/{name}: {e}", dir.display()))
    })?;
    let mut file = std::fs::File::from(fd);
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other(format!(
            "{}/{name} is not a regular file",
            dir.display()
        )));
    }
    let mut out = Vec::new();
    file.read_to_end(&mut out)?;
    Ok(out)
}

/// Removes file `name` from `dir` (nothing when it is not there).
pub fn remove(dir: &Path, name: &str) {
    if let Ok(handle) = dir_handle(dir) {
        let _ = nix::unistd::unlinkat(&handle, name, nix::unistd::UnlinkatFlags::NoRemoveDir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_at_the_name_is_replaced_never_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("target");
        std::fs::write(&target, "keep").expect("write");
        std::os::unix::fs::symlink(&target, dir.path().join("holds.handover")).expect("link");
        assert!(
            read(dir.path(), "holds.handover").is_err(),
            "not read through a link"
        );
        write_new(dir.path(), "holds.handover", b"a\t5\n").expect("written");
        assert_eq!(std::fs::read_to_string(&target).expect("read"), "keep");
        assert_eq!(read(dir.path(), "holds.handover").expect("read"), b"a\t5\n");
        remove(dir.path(), "holds.handover");
        assert_eq!(
            read(dir.path(), "holds.handover").map_err(|e| e.kind()),
            Err(std::io::ErrorKind::NotFound)
        );
    }
}
