//! The Debian package (`scripts/package-deb`, `packaging/deb/`), built from
//! this build's binaries with the agent built again with NVML: its files,
//! control fields, conffile and maintainer scripts, lintian clean (each
//! override needed); then installed for real with apt, where the
//! maintainer scripts make the system user and the state directory, the
//! packaged agent runs as that user with the installed config and starts a
//! model through the packaged residentctl; purged after, failure or not.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

use crate::support::*;

mod install;

const CONFFILE: &str = "/etc/residentd/residentd.toml";

/// Whether `tool` is on PATH.
fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|dir| dir.join(tool).is_file()))
}

/// Whether `ok`; when not, says the test is skipped because of `why`
/// (CI has everything, so there it fails instead).
fn need(ok: bool, why: &str) -> bool {
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "{why}");
        skip(why);
    }
    ok
}

/// Runs `cmd`, which must succeed; its stdout.
fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The target directory of this build (`target/`).
fn target_dir() -> PathBuf {
    Path::new(RESIDENTD)
        .ancestors()
        .nth(2)
        .expect("RESIDENTD is target/PROFILE/residentd")
        .to_path_buf()
}

/// The agent built with the `nvml` feature: this build's own when the
/// tests were built with it, else a debug build of it (no debug info) in
/// `target/package`, apart from this build's binaries, which tests run
/// meanwhile. About 2.5 minutes on 2 cores the first time.
fn nvml_agent() -> PathBuf {
    if cfg!(feature = "nvml") {
        return PathBuf::from(RESIDENTD);
    }
    let dir = target_dir().join("package");
    let began = Instant::now();
    run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(workspace())
            .args([
                "build",
                "-p",
                "residentd",
                "--features",
                "nvml",
                "--bin",
                "residentd",
            ])
            .arg("--target-dir")
            .arg(&dir)
            .env("CARGO_PROFILE_DEV_DEBUG", "0"),
    );
    eprintln!("the nvml agent built in {:?}", began.elapsed());
    dir.join("debug/residentd")
}

/// The package, built once for every test here by `scripts/package-deb`
/// from this build's binaries into `target/package/debian`; `None` after
/// saying why it cannot be built here. Every caller that gets `None` says
/// so (a `SKIPPED:` line of its own), not only the first.
fn package() -> Option<&'static Path> {
    static DEB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = DEB.get_or_init(|| {
        let tools = ["dpkg-deb", "dpkg-shlibdeps", "strip"];
        if !tools.iter().all(|t| on_path(t)) {
            return Err(
                "no dpkg-deb, dpkg-shlibdeps or strip (Debian's dpkg-dev and binutils)".into(),
            );
        }
        let router = Path::new(RESIDENTD).with_file_name("residentd-router");
        if !router.exists() {
            return Err("no residentd-router beside residentd: cargo build -p residentd-router (cargo test --workspace builds it)".into());
        }
        let bins = tempfile::tempdir().expect("tempdir");
        for (from, name) in [
            (nvml_agent(), "residentd"),
            (env!("CARGO_BIN_EXE_residentctl").into(), "residentctl"),
            (router, "residentd-router"),
        ] {
            std::fs::copy(&from, bins.path().join(name)).expect("copy a binary");
        }
        let out = target_dir().join("package/debian");
        let began = Instant::now();
        // xz's fastest level: 12 s instead of about a minute for these
        // debug binaries; what the package holds is the same.
        let said = run(Command::new(workspace().join("scripts/package-deb"))
            .env("DPKG_DEB_COMPRESSOR_LEVEL", "1")
            .arg("--bin-dir")
            .arg(bins.path())
            .arg("--out")
            .arg(&out));
        eprintln!("scripts/package-deb took {:?}", began.elapsed());
        let deb = PathBuf::from(said.trim());
        assert!(deb.starts_with(&out) && deb.exists(), "{said}");
        Ok(deb)
    });
    match built {
        Ok(deb) => Some(deb),
        Err(why) => {
            need(false, why);
            None
        }
    }
}

/// `dpkg-deb -c`'s listing: each path (without the leading `.`) with its
/// mode and owner.
fn contents(deb: &Path) -> BTreeMap<String, (String, String)> {
    run(Command::new("dpkg-deb").arg("-c").arg(deb))
        .lines()
        .map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let path = f[5].trim_start_matches('.').trim_end_matches('/');
            (path.to_string(), (f[0].to_string(), f[1].to_string()))
        })
        .collect()
}

#[test]
fn the_package_holds_its_files_and_passes_lintian() {
    let Some(deb) = package() else { return };
    let files = contents(deb);
    let mut want = vec![
        ("/usr/bin/residentd", "-rwxr-xr-x"),
        ("/usr/bin/residentctl", "-rwxr-xr-x"),
        ("/usr/bin/residentd-router", "-rwxr-xr-x"),
        ("/lib/systemd/system/residentd.service", "-rw-r--r--"),
        ("/lib/systemd/system/residentd-router.service", "-rw-r--r--"),
        (CONFFILE, "-rw-r--r--"),
        ("/usr/share/doc/residentd/copyright", "-rw-r--r--"),
        ("/usr/share/doc/residentd/changelog.Debian.gz", "-rw-r--r--"),
        ("/usr/share/doc/residentd/README.md", "-rw-r--r--"),
        (
            "/usr/share/doc/residentd/examples/backoff.conf",
            "-rw-r--r--",
        ),
        ("/usr/share/lintian/overrides/residentd", "-rw-r--r--"),
    ];
    // Each unit's Documentation= is in the package.
    let units = ["residentd.service", "residentd-router.service"];
    let docs: Vec<String> = units
        .iter()
        .flat_map(|u| {
            let text = std::fs::read_to_string(workspace().join("systemd").join(u)).expect("unit");
            text.lines()
                .filter_map(|l| l.strip_prefix("Documentation=file:").map(str::to_string))
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(docs.len(), 2, "{docs:?}");
    want.extend(docs.iter().map(|d| (d.as_str(), "-rw-r--r--")));
    for (path, mode) in want {
        let Some((m, owner)) = files.get(path) else {
            panic!("{path} is not in the package: {files:#?}")
        };
        assert_eq!((m.as_str(), owner.as_str()), (mode, "root/root"), "{path}");
    }
    let places = [
        "/usr/bin",
        "/lib/systemd/system",
        "/etc/residentd",
        "/usr/share/doc/residentd",
        "/usr/share/lintian/overrides/residentd",
    ];
    for path in files.keys() {
        assert!(
            places
                .iter()
                .any(|p| path.starts_with(p) || p.starts_with(path.as_str())),
            "{path}: outside the package's own places"
        );
    }

    let field = |name: &str| run(Command::new("dpkg-deb").arg("-f").arg(deb).arg(name));
    assert_eq!(field("Package").trim(), "residentd");
    assert_eq!(
        field("Version").trim(),
        format!("{}-1", env!("CARGO_PKG_VERSION"))
    );
    let arch = run(Command::new("dpkg").arg("--print-architecture"));
    assert_eq!(field("Architecture").trim(), arch.trim());
    let depends = field("Depends");
    assert!(
        depends.contains("libc6 (>= ") && depends.contains("passwd"),
        "{depends}"
    );
    assert!(
        field("Installed-Size")
            .trim()
            .parse::<u64>()
            .expect("a size")
            > 1000
    );

    let control = tempfile::tempdir().expect("tempdir");
    run(Command::new("dpkg-deb")
        .arg("-e")
        .arg(deb)
        .arg(control.path().join("c")));
    let control = control.path().join("c");
    let conffiles = std::fs::read_to_string(control.join("conffiles")).expect("conffiles");
    assert_eq!(
        conffiles,
        format!("{CONFFILE}\n"),
        "the config is the one conffile"
    );
    for script in ["postinst", "prerm", "postrm"] {
        let path = control.join(script);
        let mode = std::fs::metadata(&path).expect(script).mode();
        assert_eq!(mode & 0o777, 0o755, "{script}");
        run(Command::new("sh").arg("-n").arg(&path));
    }
    // The packaged files are the workspace's.
    let tree = tempfile::tempdir().expect("tempdir");
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(tree.path()));
    for (packaged, source) in [
        (CONFFILE, "systemd/residentd.toml"),
        (
            "/lib/systemd/system/residentd.service",
            "systemd/residentd.service",
        ),
        (
            "/lib/systemd/system/residentd-router.service",
            "systemd/residentd-router.service",
        ),
    ] {
        let read = |p: PathBuf| std::fs::read(&p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
        assert!(
            read(tree.path().join(&packaged[1..])) == read(workspace().join(source)),
            "{packaged} differs from {source}"
        );
    }

    if !need(
        on_path("lintian"),
        "no lintian (Debian package lintian; .ci/run installs it)",
    ) {
        return;
    }
    // -I shows the informational tags too, where an override that no
    // longer matches anything would show.
    // Its own TMPDIR: lintian leaves its ELF caches (mldbm-elf-*) there.
    let tmp = tempfile::tempdir().expect("tempdir");
    let said = run(Command::new("lintian")
        .args(["--fail-on", "error,warning", "-I"])
        .env("TMPDIR", tmp.path())
        .arg(deb));
    for line in said.lines() {
        assert!(
            !line.starts_with("E:") && !line.starts_with("W:"),
            "lintian: {line}\n{said}"
        );
        assert!(
            !line.contains("unused-override") && !line.contains("mismatched-override"),
            "an override in packaging/deb/lintian-overrides is not needed: {line}"
        );
    }
}

/// What the maintainer scripts ask of systemd, read from their text: a
/// package installed or upgraded never starts, restarts or stops the
/// agent (a restart stops every model); only a removal stops it.
#[test]
fn the_maintainer_scripts_never_start_or_restart_the_agent() {
    let dir = workspace().join("packaging/deb");
    let callers = ["systemctl", "deb-systemd-invoke", "invoke-rc.d", "service"];
    let starts = [
        "start",
        "restart",
        "try-restart",
        "reload-or-restart",
        "try-reload-or-restart",
        "condrestart",
    ];
    let mut stops = Vec::new();
    for script in ["postinst", "prerm", "postrm"] {
        let path = dir.join(script);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let code: Vec<&str> = text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .collect();
        for (n, line) in code.iter().enumerate() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if !words.iter().any(|w| callers.contains(w)) {
                continue;
            }
            let at = format!("{script}:{}: {line}", n + 1);
            assert!(
                !words.iter().any(|w| starts.contains(w)),
                "{at}: starts or restarts a unit"
            );
            if words.contains(&"stop") {
                // The nearest condition above it names the removal.
                let guard = code[..n].iter().rev().find(|l| l.starts_with("if "));
                assert!(
                    guard.is_some_and(|g| g.contains("\"$1\" = \"remove\"")),
                    "{at}: stops a unit, and not only at a removal ({guard:?})"
                );
                stops.push(at);
            }
        }
    }
    // The check sees the one stop there is: prerm's, at a removal.
    assert_eq!(stops.len(), 1, "{stops:?}");
    assert!(stops[0].starts_with("prerm:"), "{stops:?}");
}
