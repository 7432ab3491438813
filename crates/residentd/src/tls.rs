//! TCP with mutual TLS, served by our own acceptor (tokio-rustls) rather
//! than tonic's: so that a SIGHUP (or Reload) after a certificate renewal
//! gives new connections the new certificate and CA, and so that a
//! refused handshake (no client certificate, one from another CA, not TLS
//! at all) is logged with the peer's address and the reason. Handshakes
//! run side by side, each bounded, within the connection limits of
//! `connections.rs`, so a client that stalls one delays nobody else.

use std::sync::Arc;

use parking_lot::RwLock;
use resident_config::TlsFiles;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

use crate::connections::{Connections, Counted};

/// The server side of TLS: the current configuration, replaced whole by a
/// reload.
#[derive(Debug)]
pub struct TlsServer {
    config: RwLock<Arc<ServerConfig>>,
}

impl TlsServer {
    /// From the `[node.tls]` files (already checked by the config).
    pub fn new(files: &TlsFiles) -> anyhow::Result<Self> {
        Ok(Self {
            config: RwLock::new(server_config(files)?),
        })
    }

    /// New connections use `files` from now on; ones already open keep
    /// what they shook hands with.
    pub fn reload(&self, files: &TlsFiles) -> anyhow::Result<()> {
        let config = server_config(files)?;
        *self.config.write() = config;
        Ok(())
    }

    fn acceptor(&self) -> TlsAcceptor {
        let config = self.config.read();
        TlsAcceptor::from(config.clone())
    }

    /// The TLS connections accepted on `listener` (within the limits of
    /// `connections`), each after its own handshake; a refused handshake
    /// is logged and the connection closed.
    pub fn incoming(
        self: Arc<Self>,
        listener: TcpListener,
        connections: Arc<Connections>,
    ) -> ReceiverStream<std::io::Result<Counted<TlsStream<TcpStream>>>> {
        connections.tcp(listener, "TLS handshake refused", move |tcp| {
            self.acceptor().accept(tcp)
        })
    }
}

/// A rustls server configuration: the certificate chain and key, client
/// certificates required and verified against the CA, HTTP/2 only.
fn server_config(files: &TlsFiles) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&files.cert).collect::<Result<_, _>>()?;
    let key = PrivateKeyDer::from_pem_slice(&files.key)?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(&files.client_ca) {
        roots.add(ca?)?;
    }
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?;
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}
