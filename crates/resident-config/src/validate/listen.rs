//! Where the API listens (`node.listen`) and its TLS files (`[node.tls]`):
//! a Unix socket, or TCP only with TLS or an explicit `insecure`. Each TLS
//! file is parsed and the three are checked against each other (a
//! certificate where one belongs, a private key that matches it), so a
//! mistake is named here rather than by a failing TLS listener.

use std::path::PathBuf;

use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use toml::Spanned;

use super::Result;
use crate::error::Source;
use crate::host::Lookups;
use crate::{Listen, TlsFiles, raw};

/// The three PEM files, read through `host` and, when read here, checked.
pub(super) fn tls(src: &Source<'_>, t: &raw::Tls, host: Lookups) -> Result<TlsFiles> {
    let read = |s: &Spanned<String>, key: &str| {
        host.read(s.get_ref())
            .map_err(|m| src.err(s.span(), key, m))
    };
    let files = TlsFiles {
        cert: read(&t.cert, "node.tls.cert")?,
        key: read(&t.key, "node.tls.key")?,
        client_ca: read(&t.client_ca, "node.tls.client_ca")?,
    };
    if host.local() {
        let at = |s: &Spanned<String>, key: &str, m: String| src.err(s.span(), key, m);
        let chain = certificates(&files.cert, "the server's certificate chain")
            .map_err(|m| at(&t.cert, "node.tls.cert", m))?;
        let key = private_key(&files.key).map_err(|m| at(&t.key, "node.tls.key", m))?;
        let cert_path = t.cert.get_ref();
        matching(chain, key, cert_path).map_err(|m| at(&t.key, "node.tls.key", m))?;
        let cas = certificates(&files.client_ca, "the CA that signs client certificates")
            .map_err(|m| at(&t.client_ca, "node.tls.client_ca", m))?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in cas {
            roots.add(ca).map_err(|e| {
                at(
                    &t.client_ca,
                    "node.tls.client_ca",
                    format!("holds a certificate that cannot serve as a CA: {e}"),
                )
            })?;
        }
    }
    Ok(files)
}

/// What a PEM file holds, for a message: its block labels.
fn labels(pem: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(pem);
    let mut out: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("-----BEGIN ")?.strip_suffix("-----"))
        .map(String::from)
        .collect();
    out.dedup();
    out
}

/// The certificates of a PEM file that must hold `what`.
fn certificates(
    pem: &[u8],
    what: &str,
) -> std::result::Result<Vec<CertificateDer<'static>>, String> {
    if pem.iter().all(u8::is_ascii_whitespace) {
        return Err(format!("the file is empty: it should hold {what} (PEM)"));
    }
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| format!("is not valid PEM: {e}"))?;
    if certs.is_empty() {
        let found = labels(pem);
        if found.iter().any(|l| l.contains("PRIVATE KEY")) {
            return Err(format!(
                "holds a private key, not a certificate: it should hold {what} (are the files swapped?)"
            ));
        }
        return Err(format!(
            "holds no PEM certificate (found: {}): it should hold {what}",
            if found.is_empty() {
                "no PEM block".to_string()
            } else {
                found.join(", ")
            }
        ));
    }
    Ok(certs)
}

/// The private key of a PEM file.
fn private_key(pem: &[u8]) -> std::result::Result<PrivateKeyDer<'static>, String> {
    if pem.iter().all(u8::is_ascii_whitespace) {
        return Err("the file is empty: it should hold the server's private key (PEM)".into());
    }
    PrivateKeyDer::from_pem_slice(pem).map_err(|_| {
        let found = labels(pem);
        if found.iter().any(|l| l == "CERTIFICATE") {
            "holds a certificate, not a private key (are cert and key swapped?)".to_string()
        } else {
            format!(
                "holds no PEM private key (PKCS#8, PKCS#1 or SEC1; found: {})",
                if found.is_empty() {
                    "no PEM block".to_string()
                } else {
                    found.join(", ")
                }
            )
        }
    })
}

/// Whether `key` is the private key of `chain`'s first certificate.
fn matching(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    cert_path: &str,
) -> std::result::Result<(), String> {
    let provider = rustls::crypto::ring::default_provider();
    match rustls::sign::CertifiedKey::from_der(chain, key, &provider) {
        Ok(_) => Ok(()),
        Err(rustls::Error::InconsistentKeys(_)) => Err(format!(
            "does not match the certificate in {cert_path:?} (another key pair's private key)"
        )),
        Err(e) => Err(format!(
            "cannot be used with the certificate in {cert_path:?}: {e}"
        )),
    }
}

/// Every address of `listen` (one, or a list), each a Unix socket or TCP;
/// `tcp_allowed`: TLS is configured, or plaintext was asked for.
pub(super) fn listen(
    src: &Source<'_>,
    l: &Spanned<raw::Listen>,
    tcp_allowed: bool,
) -> Result<Vec<Listen>> {
    let (texts, list) = match l.get_ref() {
        raw::Listen::One(one) => (std::slice::from_ref(one), false),
        raw::Listen::Many(many) => (many.as_slice(), true),
    };
    if texts.is_empty() {
        return Err(src.err(
            l.span(),
            "node.listen",
            "names no address: give at least one",
        ));
    }
    let mut out: Vec<Listen> = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let key = if list {
            format!("node.listen[{i}]")
        } else {
            "node.listen".to_string()
        };
        let one = address(text, tcp_allowed).map_err(|m| src.err(l.span(), key.clone(), m))?;
        if out.contains(&one) {
            return Err(src.err(l.span(), key, format!("{text:?} is listed twice")));
        }
        out.push(one);
    }
    Ok(out)
}

fn address(text: &str, tcp_allowed: bool) -> std::result::Result<Listen, String> {
    if let Some(path) = text.strip_prefix("unix://") {
        if !path.starts_with('/') {
            return Err(format!("{text:?}: the socket path must be absolute"));
        }
        return Ok(Listen::Unix(PathBuf::from(path)));
    }
    if let Some(addr) = text.strip_prefix("tcp://") {
        let addr = addr
            .parse()
            .map_err(|_| format!("{text:?}: expected tcp://HOST:PORT with an IP address"))?;
        if !tcp_allowed {
            return Err(
                "TCP needs TLS with client certificates: add [node.tls] with cert, key \
                        and client_ca, or set insecure = true to accept plaintext TCP"
                    .into(),
            );
        }
        return Ok(Listen::Tcp(addr));
    }
    Err(format!(
        "{text:?}: expected unix:///PATH or tcp://HOST:PORT"
    ))
}
