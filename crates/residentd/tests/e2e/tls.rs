//! TCP is served only with mutual TLS (unless the operator writes
//! `insecure = true`): a plaintext client is refused, a client with a
//! certificate from another CA is refused, the right one works.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn ca() -> Ca {
    let key = KeyPair::generate().expect("key");
    let mut params = CertificateParams::new(Vec::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    Ca {
        cert: params.self_signed(&key).expect("self-signed CA"),
        key,
    }
}

/// A certificate for `names`, signed by `ca`: (cert PEM, key PEM).
fn leaf(ca: &Ca, names: &[&str]) -> (String, String) {
    let key = KeyPair::generate().expect("key");
    let params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        .expect("params");
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

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    path.display().to_string()
}

#[tokio::test]
async fn tcp_needs_a_client_certificate_from_the_configured_ca() {
    let (server_ca, client_ca, other_ca) = (ca(), ca(), ca());
    let (server_cert, server_key) = leaf(&server_ca, &["localhost"]);
    let (good_cert, good_key) = leaf(&client_ca, &["client"]);
    let (bad_cert, bad_key) = leaf(&other_ca, &["intruder"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let config = format!(
        "[node]\nname = \"tls-node\"\nlisten = \"tcp://127.0.0.1:{port}\"\nstate_dir = \"{}/state\"\n[node.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"1GB\"\n",
        dir.path().display(),
        write(dir.path(), "server.pem", &server_cert),
        write(dir.path(), "server.key", &server_key),
        write(dir.path(), "client-ca.pem", &client_ca.cert.pem()),
    );
    let config_path = write(dir.path(), "residentd.toml", &config);
    let mut agent = Command::new(RESIDENTD)
        .args(["--config", &config_path])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start residentd");
    let ca_pem = server_ca.cert.pem();
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
    let _ = agent.kill();
    let _ = agent.wait();
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
