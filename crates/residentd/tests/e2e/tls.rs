//! TCP is served only with mutual TLS (unless the operator writes
//! `insecure = true`): a plaintext client is refused, a client with a
//! certificate from another CA is refused, the right one works, with the
//! role `[node.access]` grants its certificate's names (and none
//! otherwise). Its fixtures (CAs, certificates, a TLS agent) serve the
//! fleet's and the router's TLS tests too.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A certificate authority made for one test.
pub struct Ca {
    pub cert: rcgen::Certificate,
    key: KeyPair,
}

pub fn ca() -> Ca {
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(Vec::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    Ca {
        cert: params.self_signed(&key).expect("self-signed CA"),
        key,
    }
}

/// A certificate for `names`, signed by `ca`: (cert PEM, key PEM).
pub fn leaf(ca: &Ca, names: &[&str]) -> (String, String) {
    leaf_with(ca, names, None, None)
}

/// A certificate for DNS `names`, a SAN `uri` and a subject `cn`.
fn leaf_with(ca: &Ca, names: &[&str], uri: Option<&str>, cn: Option<&str>) -> (String, String) {
    let key = KeyPair::generate().expect("key");
    let mut params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("params");
    if let Some(uri) = uri {
        let uri = uri.to_string().try_into().expect("an ia5 string");
        params.subject_alt_names.push(rcgen::SanType::URI(uri));
    }
    // rcgen's default subject has a CN of its own.
    params.distinguished_name = rcgen::DistinguishedName::new();
    if let Some(cn) = cn {
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
    }
    let cert = params.signed_by(&key, &ca.cert, &ca.key).expect("signed");
    (cert.pem(), key.serialize_pem())
}

async fn client(
    port: u16,
    ca: &str,
    identity: Option<(&str, &str)>,
) -> Result<NodeAgentClient<Channel>, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let endpoint = Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .map_err(|e| e.to_string())?
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .timeout(Duration::from_secs(5));
    let channel = endpoint.connect().await.map_err(|e| format!("{e:?}"))?;
    let mut c = NodeAgentClient::new(channel);
    c.node(pb::NodeRequest {})
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(c)
}

/// Writes `text` to `dir/name`; the path.
pub fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path.display().to_string()
}

#[tokio::test]
async fn tcp_needs_a_client_certificate_from_the_configured_ca() {
    let a = tls_agent("[node.access]\nviewers = [\"cert-dns:client\"]");
    let (port, ca_pem) = (a.port, a.server_ca.clone());
    let (good_cert, good_key) = leaf(&a.client_ca, &["client"]);
    let (bad_cert, bad_key) = leaf(&ca(), &["intruder"]);
    // The right client: wait (bounded) for the agent to listen.
    let mut last = String::new();
    let good = until(async || {
        let c = client(port, &ca_pem, Some((&good_cert, &good_key))).await;
        c.map_err(|e| last = e).ok()
    });
    let mut good = good
        .await
        .unwrap_or_else(|| panic!("the right client never got in: {last}"));
    let node = good
        .node(pb::NodeRequest {})
        .await
        .expect("node")
        .into_inner();
    assert_eq!(node.node, "tls-node");
    // No client certificate: refused.
    let none = client(port, &ca_pem, None).await;
    assert!(none.is_err(), "a client without a certificate got in");
    // A certificate from another CA: refused.
    let other = client(port, &ca_pem, Some((&bad_cert, &bad_key))).await;
    assert!(
        other.is_err(),
        "a client with another CA's certificate got in"
    );
    // Plaintext: refused.
    let plain = async {
        let channel = Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?
            .timeout(Duration::from_secs(5))
            .connect()
            .await?;
        Ok::<_, Box<dyn std::error::Error>>(
            NodeAgentClient::new(channel)
                .node(pb::NodeRequest {})
                .await?,
        )
    };
    assert!(plain.await.is_err(), "a plaintext client got an answer");
}

/// A TLS agent on a free port (its server certificate names
/// `localhost`, unless made by [`tls_agent_named`]), the CAs' PEM, its
/// directory and log.
pub struct TlsAgent {
    child: std::process::Child,
    pub port: u16,
    metrics: u16,
    /// The CA that signed the agent's certificate.
    pub server_ca: String,
    /// The CA the agent takes client certificates of.
    pub client_ca: Ca,
    pub dir: tempfile::TempDir,
    log: std::path::PathBuf,
}

impl Drop for TlsAgent {
    /// The agent and every instance it left (they outlive it).
    fn drop(&mut self) {
        end_agent(&mut self.child, &self.dir.path().join("state"));
    }
}

/// An agent serving mutual TLS on a TCP port, granting `access`.
fn tls_agent(access: &str) -> TlsAgent {
    tls_agent_with(access, false)
}

/// As [`tls_agent`]; `with_socket`: a Unix socket too, `agent.sock` in
/// its directory.
fn tls_agent_with(access: &str, with_socket: bool) -> TlsAgent {
    let body = "[[pool]]\nname = \"ram\"\nbudget = \"1GB\"\n\n[[workload]]\nname = \"nap\"\ncommand = [\"/bin/sleep\", \"3600\"]\n[workload.memory.ram]\nweights = \"1MB\"\n";
    tls_agent_serving(access, with_socket, body)
}

/// A TLS agent named `tls-node` granting `access`, with `body` (its pools
/// and workloads) after `[node]`; `with_socket` as in [`tls_agent_with`].
pub fn tls_agent_serving(access: &str, with_socket: bool, body: &str) -> TlsAgent {
    tls_agent_named(&["localhost"], access, with_socket, body)
}

/// As [`tls_agent_serving`], its certificate naming `names` (DNS names or
/// IP addresses).
pub fn tls_agent_named(names: &[&str], access: &str, with_socket: bool, body: &str) -> TlsAgent {
    let (server_ca, client_ca) = (ca(), ca());
    let (server_cert, server_key) = leaf(&server_ca, names);
    let dir = tempfile::tempdir().expect("tempdir");
    let (port, metrics) = (free_port(), free_port());
    let tcp = format!("\"tcp://127.0.0.1:{port}\"");
    let listen = match with_socket {
        true => format!("[\"unix://{}/agent.sock\", {tcp}]", dir.path().display()),
        false => tcp,
    };
    let config = format!(
        "[node]\nname = \"tls-node\"\nlisten = {listen}\nstate_dir = \"{}/state\"\nmetrics_listen = \"127.0.0.1:{metrics}\"\n{access}\n[node.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\n{body}",
        dir.path().display(),
        write(dir.path(), "server.pem", &server_cert),
        write(dir.path(), "server.key", &server_key),
        write(dir.path(), "client-ca.pem", &client_ca.cert.pem()),
    );
    let config_path = write(dir.path(), "residentd.toml", &config);
    let log = dir.path().join("residentd.log");
    let child = Command::new(RESIDENTD)
        .args(["--config", &config_path])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("start residentd");
    TlsAgent {
        child,
        port,
        metrics,
        server_ca: server_ca.cert.pem(),
        client_ca,
        dir,
        log,
    }
}

/// A client with a client certificate (no call made).
async fn channel(a: &TlsAgent, cert: &str, key: &str) -> NodeAgentClient<Channel> {
    NodeAgentClient::new(connect_tls(a, cert, key).await)
}

/// The PERMISSION_DENIED message of `r`; panics on anything else.
fn denied<T: std::fmt::Debug>(r: Result<T, tonic::Status>, what: &str) -> String {
    match r {
        Err(e) if e.code() == tonic::Code::PermissionDenied => e.message().to_string(),
        other => panic!("{what}: {other:?}"),
    }
}

/// A channel with a client certificate, once the agent listens.
pub async fn connect_tls(a: &TlsAgent, cert: &str, key: &str) -> Channel {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&a.server_ca))
        .domain_name("localhost")
        .identity(Identity::from_pem(cert, key));
    let endpoint = Endpoint::from_shared(format!("https://127.0.0.1:{}", a.port))
        .expect("endpoint")
        .tls_config(tls)
        .expect("tls")
        .timeout(Duration::from_secs(5));
    let channel = until(async || endpoint.connect().await.ok()).await;
    channel.expect("the agent listens")
}

#[tokio::test]
async fn certificates_get_the_roles_their_names_are_granted() {
    let a = tls_agent(
        "[node.access]\nviewers = [\"cert-dns:dashboard.example\"]\noperators = [\"cert-cn:orchestrator\"]\nadmins = [\"cert-uri:spiffe://example/admin\"]",
    );
    let (viewer_cert, viewer_key) = leaf(&a.client_ca, &["dashboard.example"]);
    let (op_cert, op_key) = leaf_with(&a.client_ca, &["op.example"], None, Some("orchestrator"));
    let (admin_cert, admin_key) =
        leaf_with(&a.client_ca, &[], Some("spiffe://example/admin"), None);
    let (nobody_cert, nobody_key) = leaf(&a.client_ca, &["stranger.example"]);
    let start = || pb::StartRequest {
        workload: "nap".into(),
        instance_id: "n".into(),
        ..Default::default()
    };

    // Viewer: reads, no changes.
    let mut v = channel(&a, &viewer_cert, &viewer_key).await;
    let node = until(async || v.node(pb::NodeRequest {}).await.ok()).await;
    assert!(node.is_some(), "the viewer reads");
    let msg = denied(v.start(start()).await, "a viewer's Start");
    assert!(
        msg.contains("Start needs the operator role; cert-dns:dashboard.example from 127.0.0.1:"),
        "{msg}"
    );
    assert!(msg.ends_with("has the viewer role"), "{msg}");
    // Operator: starts and stops; no reload.
    let mut o = channel(&a, &op_cert, &op_key).await;
    o.start(start()).await.expect("the operator starts");
    let msg = denied(o.reload(pb::ReloadRequest {}).await, "an operator's Reload");
    assert!(
        msg.contains("Reload needs the admin role; cert-cn:orchestrator"),
        "{msg}"
    );
    // Admin: reloads.
    let mut ad = channel(&a, &admin_cert, &admin_key).await;
    let r = ad
        .reload(pb::ReloadRequest {})
        .await
        .expect("the admin reloads");
    assert!(r.into_inner().config.ends_with("residentd.toml"));
    // A certificate of the right CA whose names are granted nothing: not
    // even a read, and the health service neither.
    let mut n = channel(&a, &nobody_cert, &nobody_key).await;
    let msg = denied(n.node(pb::NodeRequest {}).await, "a stranger's Node");
    assert!(msg.contains("has no role"), "{msg}");
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        connect_tls(&a, &nobody_cert, &nobody_key).await,
    );
    let h = health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await;
    assert_eq!(
        h.map_err(|e| e.code()).err(),
        Some(tonic::Code::PermissionDenied)
    );
    o.stop(pb::StopRequest {
        instance_id: "n".into(),
        grace_ms: 0,
    })
    .await
    .expect("the operator stops");
    // Every change is in the audit trail, allowed or not, with who.
    let log = std::fs::read_to_string(&a.log).expect("log");
    let audit: Vec<&str> = log.lines().filter(|l| l.contains(" audit: ")).collect();
    let has = |rpc: &str, who: &str, outcome: &str| {
        audit.iter().any(|l| {
            l.contains(&format!("rpc=\"{rpc}\""))
                && l.contains(who)
                && l.contains(&format!("outcome=\"{outcome}\""))
        })
    };
    assert!(
        has("Start", "cert-dns:dashboard.example", "denied"),
        "{audit:#?}"
    );
    assert!(has("Start", "cert-cn:orchestrator", "ok"), "{audit:#?}");
    assert!(
        has("Reload", "cert-cn:orchestrator", "denied"),
        "{audit:#?}"
    );
    assert!(
        has("Reload", "cert-uri:spiffe://example/admin", "ok"),
        "{audit:#?}"
    );
    assert!(has("Stop", "cert-cn:orchestrator", "ok"), "{audit:#?}");
    // Refusals are counted by the role they needed.
    let port = a.metrics;
    let body = tokio::task::spawn_blocking(move || crate::metrics::scrape(port))
        .await
        .expect("joined");
    let count = |role: &str| {
        let series = format!("residentd_access_denied_total{{role=\"{role}\"}} ");
        body.lines()
            .find_map(|l| l.strip_prefix(&series))
            .map(|v| v.trim().to_string())
    };
    assert_eq!(count("operator").as_deref(), Some("1"), "{body}");
    assert_eq!(count("admin").as_deref(), Some("1"), "{body}");
    assert_eq!(
        count("viewer").as_deref(),
        Some("2"),
        "Node and health: {body}"
    );
}

#[tokio::test]
async fn without_an_access_table_a_tls_caller_is_granted_nothing() {
    let a = tls_agent("");
    let (cert, key) = leaf(&a.client_ca, &["client"]);
    let mut c = channel(&a, &cert, &key).await;
    let r = until(async || match c.node(pb::NodeRequest {}).await {
        Err(e) if e.code() == tonic::Code::PermissionDenied => Some(e),
        _ => None,
    })
    .await;
    assert!(
        r.is_some(),
        "a TLS caller is denied until [node.access] grants it"
    );
}

#[test]
fn tcp_without_tls_is_refused_unless_insecure_is_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = format!(
        "[node]\nname = \"n\"\nlisten = \"tcp://127.0.0.1:1\"\nstate_dir = \"{}/state\"\n",
        dir.path().display()
    );
    let path = write(dir.path(), "c.toml", &text);
    let out = Command::new(RESIDENTD)
        .args(["--check-config", &path])
        .output()
        .expect("run");
    assert_eq!(
        out.status.code(),
        Some(78),
        "a config error exits with EX_CONFIG"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("c.toml:3: node.listen: TCP needs TLS with client certificates"),
        "{err}"
    );
    let insecure = text.replace("[node]\n", "[node]\ninsecure = true\n");
    let path = write(dir.path(), "c.toml", &insecure);
    let out = Command::new(RESIDENTD)
        .args(["--check-config", &path])
        .output()
        .expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("valid"));
}

#[test]
fn tls_files_that_do_not_fit_together_exit_78_at_check_and_at_start() {
    let (server_ca, other) = (ca(), ca());
    let (cert, _key) = leaf(&server_ca, &["localhost"]);
    let (_, wrong_key) = leaf(&other, &["elsewhere"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = format!(
        "[node]\nname = \"n\"\nlisten = \"tcp://127.0.0.1:{}\"\nstate_dir = \"{}/state\"\n[node.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n",
        free_port(),
        dir.path().display(),
        write(dir.path(), "server.pem", &cert),
        write(dir.path(), "wrong.key", &wrong_key),
        write(dir.path(), "ca.pem", &server_ca.cert.pem()),
    );
    let path = write(dir.path(), "c.toml", &config);
    for args in [vec!["--check-config", &path], vec!["--config", &path]] {
        let out = Command::new(RESIDENTD).args(&args).output().expect("run");
        assert_eq!(out.status.code(), Some(78), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("c.toml:7: node.tls.key: does not match the certificate in"),
            "{args:?}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_and_tls_together_residentctl_over_tcp_and_renewed_certificates() {
    let a = tls_agent_with(
        "[node.access]\noperators = [\"cert-cn:ops\", \"uid:0\"]",
        true,
    );
    let (dir, port, log) = (&a.dir, a.port, &a.log);
    let socket = dir.path().join("agent.sock");
    let renewed_ca = ca();
    let (op_cert, op_key) = leaf_with(&a.client_ca, &[], None, Some("ops"));
    let ca_path = write(dir.path(), "server-ca.pem", &a.server_ca);
    let cert_path = write(dir.path(), "ops.pem", &op_cert);
    let key_path = write(dir.path(), "ops.key", &op_key);
    let ctl = |ca: &str, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_residentctl"))
            .args(["--endpoint", &format!("https://localhost:{port}")])
            .env("RESIDENTD_CA", ca)
            .env("RESIDENTD_CERT", &cert_path)
            .env("RESIDENTD_KEY", &key_path)
            .args(args)
            .output()
            .expect("residentctl")
    };
    // Over TCP with the client certificate: an operator.
    let up = until(async || ctl(&ca_path, &["node"]).status.success().then_some(())).await;
    assert!(up.is_some(), "residentctl never reached the TLS listener");
    let o = ctl(&ca_path, &["start", "nap", "--id", "t"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The same agent over its Unix socket.
    let mut c = connect(&socket).await;
    assert_eq!(ids_of(&mut c).await, ["t"]);

    // A client without a certificate: its handshake is refused and logged.
    let none = client(port, &a.server_ca, None).await;
    assert!(none.is_err());
    let logged = until(async || {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        text.lines()
            .find(|l| l.contains("TLS handshake refused") && l.contains("peer=127.0.0.1:"))
            .map(String::from)
    })
    .await;
    assert!(logged.is_some(), "the refused handshake is logged");

    // The server certificate is renewed (by another CA) in place: after a
    // SIGHUP, new connections get it.
    let (new_cert, new_key) = leaf(&renewed_ca, &["localhost"]);
    let renewed_ca_path = write(dir.path(), "renewed-ca.pem", &renewed_ca.cert.pem());
    assert!(
        !ctl(&renewed_ca_path, &["node"]).status.success(),
        "the old certificate is not trusted by the renewed CA"
    );
    write(dir.path(), "server.pem", &new_cert);
    write(dir.path(), "server.key", &new_key);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(a.child.id() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .expect("SIGHUP");
    let renewed = until(async || {
        ctl(&renewed_ca_path, &["node"])
            .status
            .success()
            .then_some(())
    })
    .await;
    assert!(
        renewed.is_some(),
        "new connections get the renewed certificate"
    );
    assert!(
        !ctl(&ca_path, &["node"]).status.success(),
        "and no longer the old one"
    );
    let text = std::fs::read_to_string(log).unwrap_or_default();
    assert!(text.contains("TLS certificates reloaded"), "{text}");
}

#[tokio::test]
async fn a_handshake_that_never_finishes_is_cut_off() {
    let a = tls_agent("[node.access]\nviewers = [\"cert-cn:x\"]");
    // A client that connects and never says a word.
    let mut stalled = until(async || std::net::TcpStream::connect(("127.0.0.1", a.port)).ok())
        .await
        .expect("the agent listens");
    stalled
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let started = std::time::Instant::now();
    let mut buf = [0u8; 16];
    let read = std::io::Read::read(&mut stalled, &mut buf);
    // Closed by the agent (end of stream or a reset), not by our timeout.
    let closed = match &read {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    };
    assert!(closed, "{read:?} after {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(15));
    let logged = until(async || {
        let log = std::fs::read_to_string(&a.log).unwrap_or_default();
        log.contains("TLS handshake refused").then_some(log)
    })
    .await
    .expect("logged");
    assert!(logged.contains("longer than 10 s"), "{logged}");
}

/// Every RPC of the contract, as `c` calls it with instance id `id`:
/// (name, whether it changes something, the answer's code; OK when it
/// succeeded).
async fn every_rpc(c: &mut NodeAgentClient<Channel>, id: &str) -> Vec<(&'static str, tonic::Code)> {
    let code = |r: Result<(), tonic::Status>| r.map_or_else(|e| e.code(), |()| tonic::Code::Ok);
    let mut out = Vec::new();
    let start = pb::StartRequest {
        workload: "nap".into(),
        instance_id: id.into(),
        ..Default::default()
    };
    out.push(("Start", code(c.start(start).await.map(drop))));
    let touch = pb::TouchRequest {
        instance_id: id.into(),
        ..Default::default()
    };
    out.push(("Touch", code(c.touch(touch).await.map(drop))));
    let get = pb::GetRequest {
        instance_id: id.into(),
    };
    out.push(("Get", code(c.get(get).await.map(drop))));
    out.push(("List", code(c.list(pb::ListRequest {}).await.map(drop))));
    let place = pb::PlaceRequest {
        workload: "nap".into(),
        on_full: 0,
        ..Default::default()
    };
    out.push(("Place", code(c.place(place).await.map(drop))));
    out.push(("Node", code(c.node(pb::NodeRequest {}).await.map(drop))));
    out.push((
        "Workloads",
        code(c.workloads(pb::WorkloadsRequest {}).await.map(drop)),
    ));
    let watch = pb::WatchRequest { since_revision: 0 };
    out.push(("Watch", code(c.watch(watch).await.map(drop))));
    let logs = pb::LogsRequest {
        instance_id: id.into(),
        tail: 1,
        follow: false,
    };
    out.push(("Logs", code(c.logs(logs).await.map(drop))));
    let adopt = pb::AdoptRequest {
        pid: 999_999,
        workload: "nap".into(),
        instance_id: format!("{id}-adopted"),
        ..Default::default()
    };
    out.push(("Adopt", code(c.adopt(adopt).await.map(drop))));
    out.push((
        "Reload",
        code(c.reload(pb::ReloadRequest {}).await.map(drop)),
    ));
    let stop = pb::StopRequest {
        instance_id: id.into(),
        grace_ms: 0,
    };
    out.push(("Stop", code(c.stop(stop).await.map(drop))));
    out
}

#[tokio::test]
async fn each_rpc_is_allowed_or_denied_as_the_role_table_says() {
    let a = tls_agent(
        "[node.access]\nviewers = [\"cert-dns:v.example\"]\noperators = [\"cert-dns:o.example\"]\nadmins = [\"cert-dns:a.example\"]",
    );
    let need = |rpc: &str| match rpc {
        "Start" | "Stop" | "Touch" | "Adopt" => 1,
        "Reload" => 2,
        _ => 0,
    };
    // (client name, its role: none -1, viewer 0, operator 1, admin 2)
    let clients = [
        ("stranger.example", -1),
        ("v.example", 0),
        ("o.example", 1),
        ("a.example", 2),
    ];
    for (name, role) in clients {
        let (cert, key) = leaf(&a.client_ca, &[name]);
        let mut c = channel(&a, &cert, &key).await;
        // Wait (bounded) for the listener with a call every role may make
        // or be refused: any answer from the agent will do.
        let up = until(async || {
            c.node(pb::NodeRequest {})
                .await
                .err()
                .map_or(Some(()), |e| {
                    (e.code() == tonic::Code::PermissionDenied).then_some(())
                })
        })
        .await;
        assert!(up.is_some(), "{name} reaches the agent");
        let id = format!("i-{}", name.split('.').next().unwrap_or(name));
        for (rpc, code) in every_rpc(&mut c, &id).await {
            let allowed = role >= need(rpc);
            assert_eq!(
                code == tonic::Code::PermissionDenied,
                !allowed,
                "{name} (role {role}) calling {rpc}: {code:?}"
            );
        }
    }
    // Only the operator's and the admin's starts happened (and were
    // stopped by them); a denied call changed nothing.
    let (cert, key) = leaf(&a.client_ca, &["a.example"]);
    let mut admin = channel(&a, &cert, &key).await;
    assert_eq!(ids_of(&mut admin).await, ["i-a", "i-o"]);
    // An audit line for each call that changes something, allowed or not,
    // naming its caller.
    let log = std::fs::read_to_string(&a.log).expect("log");
    for (name, role) in clients {
        for rpc in ["Start", "Stop", "Touch", "Adopt", "Reload"] {
            let outcome = if role >= need(rpc) {
                ""
            } else {
                "outcome=\"denied\""
            };
            let found = log.lines().any(|l| {
                l.contains(" audit: ")
                    && l.contains(&format!("rpc=\"{rpc}\""))
                    && l.contains(&format!("cert-dns:{name}"))
                    && l.contains(outcome)
            });
            assert!(found, "no audit line of {name}'s {rpc}");
        }
    }
}
