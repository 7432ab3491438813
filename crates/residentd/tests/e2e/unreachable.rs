//! residentctl when it cannot reach the agent: each cause in its own
//! words, naming the path or endpoint and what to do (issue #46): no
//! socket there, a path that is not a socket, a socket left behind, a
//! socket (or its directory) of a group this user is not in, a host name
//! that does not resolve, nothing listening on a port, a certificate that
//! names another host, a CA that did not sign it, a client certificate
//! the agent refuses, plaintext against TLS and TLS against plaintext. Where the words give a fix, the fix is
//! tried and works.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::{Command, Output};

use crate::support::*;
use crate::tls::{ca, leaf, tls_agent_named, write};

const CTL: &str = env!("CARGO_BIN_EXE_residentctl");

/// residentctl with `args` and nothing from this process's environment
/// that names an agent.
fn ctl(args: &[&str]) -> Output {
    ctl_env(args, &[])
}

/// As [`ctl`], with the variables `env`.
fn ctl_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(CTL);
    for var in [
        "RESIDENTD_SOCKET",
        "RESIDENTD_ENDPOINT",
        "RESIDENTD_CA",
        "RESIDENTD_CERT",
        "RESIDENTD_KEY",
        "RESIDENTD_TLS_NAME",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied())
        .args(args)
        .output()
        .expect("run residentctl")
}

/// What residentctl said on stderr, once it failed (exit 1) without a word
/// on stdout.
fn failed(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        o.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!err.contains("transport error"), "{err}");
    err
}

/// Asserts that `said` holds each of `words`.
#[track_caller]
fn says(said: &str, words: &[&str]) {
    for w in words {
        assert!(said.contains(w), "{w:?} is missing from: {said}");
    }
}

#[test]
fn a_missing_socket_says_so_names_the_path_and_who_named_it() {
    let o = ctl(&["--socket", "/nonexistent/x.sock", "ls"]);
    says(
        &failed(&o),
        &[
            "cannot reach residentd at /nonexistent/x.sock: no such socket",
            "nor its directory /nonexistent",
            "(--socket named it)",
            "Is residentd running?",
            "point --socket or RESIDENTD_SOCKET at that path",
            "the default is /run/residentd/residentd.sock",
        ],
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("agent.sock");
    let path = path.to_str().expect("a UTF-8 path");
    let o = ctl_env(&["ls"], &[("RESIDENTD_SOCKET", path)]);
    let said = failed(&o);
    says(
        &said,
        &[
            &format!("cannot reach residentd at {path}: no such socket"),
            "(RESIDENTD_SOCKET named it)",
        ],
    );
    assert!(!said.contains("nor its directory"), "{said}");
    let o = ctl(&["--endpoint", &format!("unix://{path}"), "ls"]);
    says(
        &failed(&o),
        &[
            "(--endpoint named it)",
            "point --endpoint or RESIDENTD_ENDPOINT",
        ],
    );
    // Neither flag nor variable: the default path, named as such.
    if Path::new("/run/residentd/residentd.sock").exists() {
        return skip("the default socket's case: /run/residentd/residentd.sock exists here");
    }
    let o = ctl(&["ls"]);
    says(
        &failed(&o),
        &[
            "cannot reach residentd at /run/residentd/residentd.sock: no such socket",
            "this is the default path: neither --socket nor RESIDENTD_SOCKET is set",
        ],
    );
}

#[test]
fn a_path_that_is_not_a_socket_says_what_it_is() {
    let o = ctl(&["--socket", "/etc/passwd", "ls"]);
    says(
        &failed(&o),
        &[
            "cannot reach residentd at /etc/passwd: it is a regular file, not a socket",
            "Point --socket or RESIDENTD_SOCKET at the agent's socket",
        ],
    );
    // A directory: the sockets in it are named.
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("agent.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind");
    let o = ctl(&["--socket", &dir.path().display().to_string(), "ls"]);
    says(
        &failed(&o),
        &[
            &format!(
                "cannot reach residentd at {}: it is a directory, not a socket",
                dir.path().display()
            ),
            &format!("the sockets in it: {}", socket.display()),
        ],
    );
    let o = ctl(&["--socket", "/etc/passwd/agent.sock", "ls"]);
    says(
        &failed(&o),
        &["/etc/passwd/agent.sock: a part of that path is not a directory"],
    );
}

#[test]
fn a_socket_left_behind_says_no_agent_listens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("agent.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
    let o = ctl(&["--socket", &socket.display().to_string(), "ls"]);
    says(
        &failed(&o),
        &[
            &format!(
                "cannot reach residentd at {}: connection refused",
                socket.display()
            ),
            "the socket is there but no agent listens on it",
            "systemctl start residentd",
        ],
    );
}

/// A group that uid 65534 (nobody, nogroup) is not in, by name and gid.
fn a_group_of_others() -> Option<(String, u32)> {
    ["adm", "disk", "daemon", "sys"].iter().find_map(|name| {
        let group = nix::unistd::Group::from_name(name).ok()??;
        let gid = group.gid.as_raw();
        (gid != 65534 && !group.mem.iter().any(|m| m == "nobody")).then_some((group.name, gid))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_of_a_group_this_user_is_not_in_names_the_group_to_join() {
    if !nix::unistd::geteuid().is_root() {
        return skip("needs root: the caller of another user is made with setuid");
    }
    let Some((group, gid)) = a_group_of_others() else {
        return skip("no group here that nobody is not in (adm, disk, daemon, sys)");
    };
    let d = Daemon::start(&format!(
        "socket_group = \"{group}\"\n{}",
        pool("ram", "1GB")
    ))
    .await;
    let (dir, socket) = (d.dir.path(), d.socket.clone());
    // Other users may pass the directory; the socket is the agent's: mode
    // 0660, group `group`.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let nobody =
        |groups: &[u32]| tokio::task::block_in_place(|| as_nobody_on(&socket, groups, &["ls"]));
    let at = format!("cannot reach residentd at {}", socket.display());
    says(
        &failed(&nobody(&[])),
        &[
            &format!("{at}: permission denied: the socket belongs to group {group} (mode 0660)"),
            "user nobody is not in that group",
            &format!("Join it: sudo usermod -aG {group} nobody, then log in again"),
            &format!("newgrp {group}"),
        ],
    );
    // In that group, the same user gets in.
    let o = nobody(&[gid]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The directory on the way, of that group and closed to others.
    std::os::unix::fs::chown(dir, Some(0), Some(gid)).expect("chown");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o750)).expect("chmod");
    says(
        &failed(&nobody(&[])),
        &[
            &format!(
                "{at}: permission denied: the directory {} belongs to group {group} (mode 0750)",
                dir.display()
            ),
            &format!("sudo usermod -aG {group} nobody"),
        ],
    );
    assert!(nobody(&[gid]).status.success());
}

#[test]
fn a_host_that_does_not_resolve_says_so() {
    let o = ctl(&["--endpoint", "http://no-such-host.invalid:7443", "ls"]);
    says(
        &failed(&o),
        &[
            "cannot reach residentd at http://no-such-host.invalid:7443: the host name \
             no-such-host.invalid did not resolve",
            "give the agent's IP address",
        ],
    );
}

#[test]
fn a_port_where_nothing_listens_says_so() {
    let port = free_port();
    let o = ctl(&["--endpoint", &format!("http://127.0.0.1:{port}"), "ls"]);
    says(
        &failed(&o),
        &[&format!(
            "cannot reach residentd at http://127.0.0.1:{port}: connection refused: nothing \
             listens on 127.0.0.1:{port}"
        )],
    );
}

/// An agent over TLS whose certificate names `localhost` and
/// `node-7.example`, and the files of a client it takes: its CA, a
/// client certificate and key; their paths.
struct TlsFiles {
    agent: crate::tls::TlsAgent,
    ca: String,
    cert: String,
    key: String,
}

impl TlsFiles {
    /// residentctl over TLS at `endpoint` with these files and `more`.
    fn ctl(&self, endpoint: &str, more: &[&str]) -> Output {
        let mut args = vec![
            "--endpoint",
            endpoint,
            "--ca",
            &self.ca,
            "--cert",
            &self.cert,
            "--key",
            &self.key,
        ];
        args.extend(more);
        ctl(&args)
    }
}

async fn tls_files() -> TlsFiles {
    let body = pool("ram", "1GB");
    let agent = tls_agent_named(
        &["localhost", "node-7.example"],
        "[node.access]\nviewers = [\"cert-dns:client\"]",
        false,
        &body,
    );
    let dir = agent.dir.path();
    let (cert, key) = leaf(&agent.client_ca, &["client"]);
    let files = TlsFiles {
        ca: write(dir, "server-ca.pem", &agent.server_ca),
        cert: write(dir, "client.pem", &cert),
        key: write(dir, "client.key", &key),
        agent,
    };
    let endpoint = format!("https://localhost:{}", files.agent.port);
    let up = until(async || {
        let o = tokio::task::block_in_place(|| files.ctl(&endpoint, &["node"]));
        o.status.success().then_some(())
    })
    .await;
    assert!(up.is_some(), "the TLS agent never answered");
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_other_names_suggests_tls_name_and_lists_its_names() {
    let f = tls_files().await;
    let endpoint = format!("https://127.0.0.1:{}", f.agent.port);
    let o = tokio::task::block_in_place(|| f.ctl(&endpoint, &["node"]));
    says(
        &failed(&o),
        &[
            &format!(
                "cannot reach residentd at {endpoint}: the agent's certificate is not valid \
                 for 127.0.0.1 (the endpoint's host)"
            ),
            "it names localhost, node-7.example",
            "Give one of those with --tls-name (or RESIDENTD_TLS_NAME), e.g. --tls-name localhost",
        ],
    );
    let o =
        tokio::task::block_in_place(|| f.ctl(&endpoint, &["--tls-name", "other.example", "node"]));
    says(
        &failed(&o),
        &[
            "the agent's certificate is not valid for other.example (--tls-name)",
            "it names localhost, node-7.example",
        ],
    );
    // As it says: one of its names.
    let o =
        tokio::task::block_in_place(|| f.ctl(&endpoint, &["--tls-name", "node-7.example", "node"]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_another_ca_signed_says_so() {
    let f = tls_files().await;
    let endpoint = format!("https://localhost:{}", f.agent.port);
    // A CA of the same name (the fixtures' CAs all have rcgen's), and one
    // of another name.
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(Vec::new()).expect("params");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "Another CA");
    let named = params.self_signed(&key).expect("a CA");
    for (file, pem, why) in [
        ("same-name-ca.pem", ca().cert.pem(), "BadSignature"),
        ("other-ca.pem", named.pem(), "UnknownIssuer"),
    ] {
        let other = write(f.agent.dir.path(), file, &pem);
        let o = tokio::task::block_in_place(|| {
            ctl(&[
                "--endpoint",
                &endpoint,
                "--ca",
                &other,
                "--cert",
                &f.cert,
                "--key",
                &f.key,
                "node",
            ])
        });
        says(
            &failed(&o),
            &[
                &format!(
                    "cannot reach residentd at {endpoint}: the agent's certificate is not \
                     signed by the CA in --ca {other}"
                ),
                why,
                "give the CA that signed the agent's [node.tls] cert",
            ],
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_the_agent_refuses_says_so() {
    let f = tls_files().await;
    let endpoint = format!("https://localhost:{}", f.agent.port);
    let (cert, key) = leaf(&ca(), &["client"]);
    let dir = f.agent.dir.path();
    let (cert, key) = (
        write(dir, "foreign.pem", &cert),
        write(dir, "foreign.key", &key),
    );
    let o = tokio::task::block_in_place(|| {
        ctl(&[
            "--endpoint",
            &endpoint,
            "--ca",
            &f.ca,
            "--cert",
            &cert,
            "--key",
            &key,
            "node",
        ])
    });
    says(
        &failed(&o),
        &[
            &format!(
                "cannot reach residentd at {endpoint}: the agent refused this client's \
                 certificate (--cert {cert}; it said "
            ),
            "give a certificate signed by the CA the agent's [node.tls] client_ca names",
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_against_tls_says_the_endpoint_speaks_tls() {
    let f = tls_files().await;
    let port = f.agent.port;
    let o = tokio::task::block_in_place(|| {
        ctl(&["--endpoint", &format!("http://localhost:{port}"), "node"])
    });
    says(
        &failed(&o),
        &[
            &format!(
                "cannot reach residentd at http://localhost:{port}: it speaks TLS, not \
                 plaintext"
            ),
            &format!("use https://localhost:{port} with --ca, --cert and --key"),
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_against_plaintext_says_the_endpoint_speaks_plaintext() {
    // An agent with insecure = true: plaintext on TCP, and its socket.
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let config = format!(
        "[node]\nname = \"plain\"\ninsecure = true\nlisten = [\"unix://{0}/agent.sock\", \
         \"tcp://127.0.0.1:{port}\"]\nstate_dir = \"{0}/state\"\n\n{1}",
        dir.path().display(),
        pool("ram", "1GB")
    );
    std::fs::write(dir.path().join("residentd.toml"), config).expect("config");
    let d = Daemon::start_in(dir).await;
    // Any certificate will do: the handshake never gets that far.
    let issuer = ca();
    let (cert, key) = leaf(&issuer, &["client"]);
    let files = d.dir.path();
    let (ca_path, cert, key) = (
        write(files, "ca.pem", &issuer.cert.pem()),
        write(files, "client.pem", &cert),
        write(files, "client.key", &key),
    );
    let endpoint = format!("https://127.0.0.1:{port}");
    let o = tokio::task::block_in_place(|| {
        ctl(&[
            "--endpoint",
            &endpoint,
            "--ca",
            &ca_path,
            "--cert",
            &cert,
            "--key",
            &key,
            "node",
        ])
    });
    says(
        &failed(&o),
        &[
            &format!(
                "cannot reach residentd at {endpoint}: it does not speak TLS but plaintext \
                 HTTP/2 (an agent with insecure = true)"
            ),
            &format!("use http://127.0.0.1:{port}"),
        ],
    );
    // As it says.
    let o = tokio::task::block_in_place(|| {
        ctl(&["--endpoint", &format!("http://127.0.0.1:{port}"), "node"])
    });
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
