//! `[node.tls]`: each file parsed and the three checked against each other
//! when the config loads, every mistake named `FILE:LINE: node.tls.KEY`.

#![allow(clippy::disallowed_methods)] // clippy.toml is for src/validate/ only

use std::path::Path;

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use resident_config::parse;

struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn write(&self, name: &str, text: &str) -> String {
        let path = self.path(name);
        std::fs::write(&path, text).expect("write");
        path
    }
}

/// A CA, a server certificate signed by it with its key, and another key.
fn files() -> Files {
    let dir = tempfile::tempdir().expect("tempdir");
    let files = Files { dir };
    let ca_key = KeyPair::generate().expect("key");
    let mut ca = CertificateParams::new(Vec::new()).expect("params");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).expect("ca");
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["node-7.example".to_string()])
        .expect("params")
        .signed_by(&key, &ca, &ca_key)
        .expect("signed");
    files.write("ca.pem", &ca.pem());
    files.write("server.pem", &cert.pem());
    files.write("server.key", &key.serialize_pem());
    files.write(
        "other.key",
        &KeyPair::generate().expect("key").serialize_pem(),
    );
    files.write("empty.pem", "");
    files
}

fn config(f: &Files, cert: &str, key: &str, ca: &str) -> String {
    format!(
        "[node]\nname = \"n\"\nlisten = \"tcp://127.0.0.1:7443\"\n[node.tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n",
        f.path(cert),
        f.path(key),
        f.path(ca)
    )
}

#[test]
fn matching_files_are_valid() {
    let f = files();
    let c = parse(
        Path::new("r.toml"),
        &config(&f, "server.pem", "server.key", "ca.pem"),
    );
    assert!(c.is_ok(), "{:?}", c.err());
}

#[test]
fn each_mistake_is_named_with_its_file_line_and_key() {
    let f = files();
    let check = |cert: &str, key: &str, ca: &str, want: &str| {
        let err = parse(Path::new("/etc/residentd.toml"), &config(&f, cert, key, ca))
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "want {want:?} in: {err}");
    };
    // The key given as the certificate (and so the certificate as the key).
    check(
        "server.key",
        "server.pem",
        "ca.pem",
        "/etc/residentd.toml:5: node.tls.cert: holds a private key, not a certificate",
    );
    check(
        "empty.pem",
        "server.key",
        "ca.pem",
        "/etc/residentd.toml:5: node.tls.cert: the file is empty",
    );
    check(
        "server.pem",
        "server.pem",
        "ca.pem",
        "/etc/residentd.toml:6: node.tls.key: holds a certificate, not a private key",
    );
    check(
        "server.pem",
        "other.key",
        "ca.pem",
        "/etc/residentd.toml:6: node.tls.key: does not match the certificate in",
    );
    check(
        "server.pem",
        "server.key",
        "server.key",
        "/etc/residentd.toml:7: node.tls.client_ca: holds a private key, not a certificate",
    );
    check(
        "server.pem",
        "server.key",
        "missing.pem",
        "/etc/residentd.toml:7: node.tls.client_ca: ",
    );
}
