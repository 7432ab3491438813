//! Why residentctl could not reach the agent, in words that say what to
//! do. tonic's own text for every such failure is only "transport error";
//! here the cause is classified before it is flattened to text: the
//! socket path looked at first (nothing there, not a socket, a directory
//! on the way this user may not pass), the `io::ErrorKind` and the rustls
//! error on the failure's source chain, and, only once something failed,
//! a second look at the endpoint: does its host resolve, does it speak
//! TLS, does it speak plaintext HTTP/2, which names its certificate has.
//! Nothing here runs on a connection that works.

use std::error::Error;
use std::fmt::Write as _;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::DEFAULT_SOCKET;

/// How long each second look at an endpoint may take.
const PROBE: Duration = Duration::from_secs(3);

/// Who named the socket or endpoint: a flag, its variable, or nobody (the
/// default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Given {
    Flag,
    Env,
    Default,
}

/// The agent's Unix socket as residentctl was told it.
pub struct Socket<'a> {
    pub path: &'a Path,
    pub given: Given,
    /// Through `--endpoint unix:///PATH` rather than `--socket`.
    pub by_endpoint: bool,
}

impl Socket<'_> {
    fn at(&self) -> String {
        format!("cannot reach residentd at {}", self.path.display())
    }

    /// The flag and variable that name the socket.
    fn flags(&self) -> &'static str {
        match self.by_endpoint {
            true => "--endpoint or RESIDENTD_ENDPOINT",
            false => "--socket or RESIDENTD_SOCKET",
        }
    }

    /// Where this path came from, for a user who did not know.
    fn origin(&self) -> String {
        let (flag, env) = match self.by_endpoint {
            true => ("--endpoint", "RESIDENTD_ENDPOINT"),
            false => ("--socket", "RESIDENTD_SOCKET"),
        };
        match self.given {
            Given::Flag => format!("{flag} named it"),
            Given::Env => format!("{env} named it"),
            Given::Default => {
                "this is the default path: neither --socket nor RESIDENTD_SOCKET is set".to_string()
            }
        }
    }

    /// Before connecting: `Err` with the words when nothing, or nothing
    /// this user may reach, is a socket at the path.
    pub fn check(&self) -> Result<(), String> {
        match std::fs::metadata(self.path) {
            Ok(m) if m.file_type().is_socket() => Ok(()),
            Ok(m) => Err(self.not_a_socket(&m)),
            Err(e) => Err(self.failed(&e)),
        }
    }

    /// The words for a connection to the socket that failed with `e`.
    pub fn explain(&self, e: &(dyn Error + 'static)) -> String {
        match find_io(e) {
            Some(io) => self.failed(io),
            None => format!("{}: {}", self.at(), causes(e)),
        }
    }

    fn failed(&self, e: &io::Error) -> String {
        match e.kind() {
            io::ErrorKind::NotFound => self.missing(),
            io::ErrorKind::PermissionDenied => self.denied(),
            io::ErrorKind::ConnectionRefused => format!(
                "{}: connection refused: the socket is there but no agent listens on it \
                 (residentd stopped and left it behind, or is starting). Start residentd \
                 (systemctl start residentd), or see why it stopped (journalctl -u residentd)",
                self.at()
            ),
            _ if e.raw_os_error() == Some(nix::libc::ENOTDIR) => format!(
                "{}: a part of that path is not a directory. Point {} at the agent's socket \
                 (its config's listen = \"unix://PATH\")",
                self.at(),
                self.flags()
            ),
            _ => format!("{}: {e}", self.at()),
        }
    }

    fn missing(&self) -> String {
        let dir = self.path.parent().filter(|d| !d.as_os_str().is_empty());
        let no_dir = match dir {
            Some(d) if !d.exists() => format!(", nor its directory {}", d.display()),
            _ => String::new(),
        };
        let default = match self.path == Path::new(DEFAULT_SOCKET) {
            true => String::new(),
            false => format!(" (the default is {DEFAULT_SOCKET})"),
        };
        format!(
            "{}: no such socket: nothing is at that path{no_dir} ({}). Is residentd running? \
             It listens where its config's listen = \"unix://PATH\" says; point {} at that \
             path{default}",
            self.at(),
            self.origin(),
            self.flags()
        )
    }

    fn not_a_socket(&self, m: &std::fs::Metadata) -> String {
        let t = m.file_type();
        let kind = if t.is_dir() {
            "a directory"
        } else if t.is_file() {
            "a regular file"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() {
            "a character device"
        } else if t.is_block_device() {
            "a block device"
        } else {
            "something else"
        };
        let mut said = format!("{}: it is {kind}, not a socket", self.at());
        if t.is_dir() {
            let inside = sockets_in(self.path);
            if !inside.is_empty() {
                let _ = write!(said, " (the sockets in it: {})", inside.join(", "));
            }
        }
        let _ = write!(
            said,
            ". Point {} at the agent's socket (its config's listen = \"unix://PATH\"; \
             the default is {DEFAULT_SOCKET})",
            self.flags()
        );
        said
    }

    /// Permission denied: on the socket itself, or on a directory on the
    /// way that this user may not pass.
    fn denied(&self) -> String {
        let blocking = self
            .path
            .ancestors()
            .skip(1)
            .filter(|d| !d.as_os_str().is_empty())
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .find(|d| nix::unistd::access(*d, nix::unistd::AccessFlags::X_OK).is_err());
        let (what, path, bit) = match blocking {
            Some(dir) => ("the directory", dir, 0o010),
            None => ("the socket", self.path, 0o020),
        };
        let Ok(m) = std::fs::metadata(path) else {
            return format!("{}: permission denied", self.at());
        };
        let mode = m.mode() & 0o7777;
        let group = group_name(m.gid());
        let owner = nix::unistd::User::from_uid(m.uid().into())
            .ok()
            .flatten()
            .map_or_else(|| format!("uid {}", m.uid()), |u| u.name);
        let place = match blocking {
            Some(dir) => format!("{what} {}", dir.display()),
            None => what.to_string(),
        };
        if mode & bit == 0 {
            let only = match m.uid() {
                0 => "root".to_string(),
                _ => format!("{owner} and root"),
            };
            return format!(
                "{}: permission denied: {place} is mode {mode:04o} (owner {owner}, group \
                 {group}), which lets no group in: only {only} may open it. The agent's \
                 socket_group setting gives a group access (mode 0660)",
                self.at()
            );
        }
        let me = nix::unistd::User::from_uid(nix::unistd::getuid())
            .ok()
            .flatten();
        let (user, login) = match &me {
            Some(u) => (format!("user {}", u.name), u.name.clone()),
            None => (
                format!("uid {}", nix::unistd::getuid()),
                "$USER".to_string(),
            ),
        };
        let holds = nix::unistd::getgroups().is_ok_and(|gs| gs.contains(&m.gid().into()))
            || nix::unistd::getegid().as_raw() == m.gid();
        let listed = me.as_ref().is_some_and(|u| {
            nix::unistd::Group::from_gid(m.gid().into())
                .ok()
                .flatten()
                .is_some_and(|g| g.mem.contains(&u.name))
        });
        if holds {
            // In the group and still refused: an ACL or a security module.
            return format!(
                "{}: permission denied, although {place} belongs to group {group} (mode \
                 {mode:04o}) and this process is in it: an ACL or a security module (AppArmor, \
                 SELinux) refuses it",
                self.at()
            );
        }
        if listed {
            return format!(
                "{}: permission denied: {place} belongs to group {group} (mode {mode:04o}); \
                 {user} is a member of {group}, but this login session began before joining \
                 it. Log in again (or run newgrp {group})",
                self.at()
            );
        }
        format!(
            "{}: permission denied: {place} belongs to group {group} (mode {mode:04o}) and \
             {user} is not in that group. Join it: sudo usermod -aG {group} {login}, then log \
             in again (or run newgrp {group})",
            self.at()
        )
    }
}

/// The sockets directly in `dir`, a few at most.
fn sockets_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<String> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .map(|e| e.path().display().to_string())
        .collect();
    found.sort();
    found.truncate(4);
    found
}

/// The name of group `gid`, or its number when it has none.
fn group_name(gid: u32) -> String {
    nix::unistd::Group::from_gid(gid.into())
        .ok()
        .flatten()
        .map_or_else(|| format!("gid {gid}"), |g| g.name)
}

/// The TLS side of a TCP endpoint as residentctl was told it.
pub struct Tls {
    /// The name the certificate is checked against.
    pub name: String,
    /// Whether --tls-name (or its variable) gave it.
    pub name_given: bool,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    /// What those files held (PEM), and the key's.
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

/// An agent over TCP: `http://` (`tls` none) or `https://`.
pub struct Tcp<'a> {
    pub endpoint: &'a str,
    pub host: String,
    pub port: u16,
    pub tls: Option<Tls>,
}

impl Tcp<'_> {
    fn at(&self) -> String {
        format!("cannot reach residentd at {}", self.endpoint)
    }

    fn authority(&self) -> String {
        match self.host.parse::<Ipv6Addr>() {
            Ok(_) => format!("[{}]:{}", self.host, self.port),
            Err(_) => format!("{}:{}", self.host, self.port),
        }
    }

    /// The words for a connection that failed with `e`.
    pub async fn explain(&self, e: &(dyn Error + 'static)) -> String {
        match self.diagnose(e).await {
            Some(words) => words,
            None => format!("{}: {}", self.at(), causes(e)),
        }
    }

    /// What is wrong with the endpoint, when `e` (a failed connection or
    /// call) or a second look at the endpoint says.
    pub async fn diagnose(&self, e: &(dyn Error + 'static)) -> Option<String> {
        if self.host.parse::<IpAddr>().is_err()
            && let Err(dns) = tokio::net::lookup_host((self.host.as_str(), self.port)).await
        {
            let tls_name = match self.tls {
                Some(_) => " (with --tls-name set to a name its certificate has)",
                None => "",
            };
            return Some(format!(
                "{}: the host name {} did not resolve ({dns}). Check its spelling, or give \
                 the agent's IP address{tls_name}",
                self.at(),
                self.host
            ));
        }
        if find_io(e).is_some_and(|io| io.kind() == io::ErrorKind::ConnectionRefused) {
            return Some(format!(
                "{}: connection refused: nothing listens on {}. Is residentd running there, \
                 with tcp://IP:{} in its listen?",
                self.at(),
                self.authority(),
                self.port
            ));
        }
        if let Some(tls) = &self.tls {
            if let Some(words) = self.tls_refused(tls, e).await {
                return Some(words);
            }
            if speaks_h2c(&self.host, self.port).await {
                return Some(format!(
                    "{}: it does not speak TLS but plaintext HTTP/2 (an agent with insecure = \
                     true): use http://{}, or give the agent [node.tls]",
                    self.at(),
                    self.authority()
                ));
            }
        } else if self.presents_certificate(&self.host).await.is_some() {
            return Some(format!(
                "{}: it speaks TLS, not plaintext: use https://{} with --ca, --cert and --key \
                 (or RESIDENTD_CA, RESIDENTD_CERT and RESIDENTD_KEY)",
                self.at(),
                self.authority()
            ));
        }
        None
    }

    /// The words for a handshake that rustls refused, where the error says
    /// why.
    async fn tls_refused(&self, tls: &Tls, e: &(dyn Error + 'static)) -> Option<String> {
        let Some(refused) = find::<rustls::Error>(e) else {
            // An alert after the handshake (TLS 1.3 refuses a client's
            // certificate so) reaches the call through h2, which keeps
            // only its text, or not even that when the connection's end
            // wins the race: shake hands again to hear it.
            let alert = self.alert_after_handshake(tls).await?;
            return Some(self.client_refused(tls, &alert));
        };
        let checked = match tls.name_given {
            true => "--tls-name",
            false => "the endpoint's host",
        };
        match refused {
            rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            ) => {
                let names = self
                    .presents_certificate(&tls.name)
                    .await
                    .map(|der| certificate_names(&der))
                    .unwrap_or_default();
                let mut said = format!(
                    "{}: the agent's certificate is not valid for {} ({checked})",
                    self.at(),
                    tls.name
                );
                match names.first() {
                    Some(first) => {
                        let _ = write!(
                            said,
                            "; it names {}. Give one of those with --tls-name (or \
                             RESIDENTD_TLS_NAME), e.g. --tls-name {first}",
                            names.join(", ")
                        );
                    }
                    None => said
                        .push_str("; give a name it has with --tls-name (or RESIDENTD_TLS_NAME)"),
                }
                Some(said)
            }
            // Unknown: no CA of that name; a bad signature: a CA of the
            // same name that did not sign it.
            rustls::Error::InvalidCertificate(
                CertificateError::UnknownIssuer | CertificateError::BadSignature,
            ) => Some(format!(
                "{}: the agent's certificate is not signed by the CA in --ca {} ({refused}): \
                 give the CA that signed the agent's [node.tls] cert",
                self.at(),
                tls.ca.as_deref().unwrap_or(Path::new("?")).display()
            )),
            rustls::Error::InvalidCertificate(
                CertificateError::Expired | CertificateError::ExpiredContext { .. },
            ) => Some(format!(
                "{}: the agent's certificate has expired ({refused}): renew it (the agent \
                 re-reads its [node.tls] files on SIGHUP)",
                self.at()
            )),
            rustls::Error::AlertReceived(alert) => {
                Some(self.client_refused(tls, &format!("{alert:?}")))
            }
            _ => None,
        }
    }

    /// The agent ended the handshake with `alert`: this client's
    /// certificate is what it checks.
    fn client_refused(&self, tls: &Tls, alert: &str) -> String {
        format!(
            "{}: the agent refused this client's certificate (--cert {}; it said {alert}): \
             give a certificate signed by the CA the agent's [node.tls] client_ca names",
            self.at(),
            tls.cert.as_deref().unwrap_or(Path::new("?")).display()
        )
    }

    /// The alert the endpoint ends a handshake with this client's own
    /// files with (the CA, certificate and key it was given), if it does;
    /// reads until the agent's first frame, sends nothing.
    async fn alert_after_handshake(&self, tls: &Tls) -> Option<String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(&tls.ca_pem) {
            roots.add(ca.ok()?).ok()?;
        }
        let chain = CertificateDer::pem_slice_iter(&tls.cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .ok()?;
        let key = PrivateKeyDer::from_pem_slice(&tls.key_pem).ok()?;
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .ok()?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .ok()?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        let server = ServerName::try_from(tls.name.clone()).ok()?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let listen = async {
            let tcp = TcpStream::connect((self.host.as_str(), self.port)).await?;
            let mut stream = connector.connect(server, tcp).await?;
            let mut byte = [0u8; 1];
            stream.read(&mut byte).await
        };
        let Ok(Err(e)) = tokio::time::timeout(PROBE, listen).await else {
            return None;
        };
        match find::<rustls::Error>(&e)? {
            rustls::Error::AlertReceived(alert) => Some(format!("{alert:?}")),
            _ => None,
        }
    }

    /// The certificate the endpoint presents in a TLS handshake for
    /// `name`, or `None` when it does not answer TLS. Checks nothing and
    /// sends nothing after the handshake: the handshake is broken off as
    /// soon as the certificate is seen.
    async fn presents_certificate(&self, name: &str) -> Option<CertificateDer<'static>> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let recorder = Arc::new(Recorder {
            seen: Mutex::new(None),
            schemes: provider
                .signature_verification_algorithms
                .supported_schemes(),
        });
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .ok()?
            .dangerous()
            .with_custom_certificate_verifier(recorder.clone())
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let server = ServerName::try_from(name.to_string())
            .or_else(|_| ServerName::try_from("residentd.invalid".to_string()))
            .ok()?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let host = self.host.clone();
        let _ = tokio::time::timeout(PROBE, async move {
            let tcp = TcpStream::connect((host.as_str(), self.port)).await?;
            connector.connect(server, tcp).await
        })
        .await;
        recorder.seen.lock().take()
    }
}

/// A verifier that only records the server's certificate and breaks the
/// handshake off (nothing is ever sent over such a connection).
#[derive(Debug)]
struct Recorder {
    seen: Mutex<Option<CertificateDer<'static>>>,
    schemes: Vec<SignatureScheme>,
}

impl ServerCertVerifier for Recorder {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        *self.seen.lock() = Some(end_entity.clone().into_owned());
        Err(rustls::Error::General("only looking".into()))
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("only looking".into()))
    }

    fn verify_tls13_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(rustls::Error::General("only looking".into()))
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.schemes.clone()
    }
}

/// Whether `host:port` answers HTTP/2's client preface in plaintext (with
/// its SETTINGS frame).
async fn speaks_h2c(host: &str, port: u16) -> bool {
    let look = async {
        let mut tcp = TcpStream::connect((host, port)).await?;
        // The preface, then an empty SETTINGS frame.
        tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await?;
        let mut head = [0u8; 9];
        tcp.read_exact(&mut head).await?;
        Ok::<_, io::Error>(head[3] == 0x04)
    };
    matches!(tokio::time::timeout(PROBE, look).await, Ok(Ok(true)))
}

/// The DNS and IP names (subject alternative names) of a certificate: the
/// names TLS clients check.
fn certificate_names(der: &[u8]) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return Vec::new();
    };
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(name) => Some(name.to_string()),
            GeneralName::IPAddress(bytes) => match bytes.len() {
                4 => <[u8; 4]>::try_from(*bytes)
                    .ok()
                    .map(|b| Ipv4Addr::from(b).to_string()),
                16 => <[u8; 16]>::try_from(*bytes)
                    .ok()
                    .map(|b| Ipv6Addr::from(b).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

/// `e` and every error under it, looking inside `io::Error`s too (whose
/// `source` skips the error they wrap).
fn chain<'a>(e: &'a (dyn Error + 'static)) -> Vec<&'a (dyn Error + 'static)> {
    let mut all = Vec::new();
    let mut next = Some(e);
    while let Some(e) = next {
        if all.len() == 32 {
            break;
        }
        all.push(e);
        next = match e.downcast_ref::<io::Error>().and_then(io::Error::get_ref) {
            Some(inner) => Some(inner as &(dyn Error + 'static)),
            None => e.source(),
        };
    }
    all
}

/// The first `T` on `e`'s chain.
fn find<'a, T: Error + 'static>(e: &'a (dyn Error + 'static)) -> Option<&'a T> {
    chain(e).into_iter().find_map(|e| e.downcast_ref::<T>())
}

/// The deepest `io::Error` on `e`'s chain: the one the system gave.
fn find_io<'a>(e: &'a (dyn Error + 'static)) -> Option<&'a io::Error> {
    chain(e)
        .into_iter()
        .filter_map(|e| e.downcast_ref::<io::Error>())
        .last()
}

/// `e` and what caused it, each text once ("transport error: ..." says
/// nothing by itself).
pub fn causes(e: &(dyn Error + 'static)) -> String {
    let mut texts: Vec<String> = Vec::new();
    for e in chain(e) {
        let text = e.to_string();
        if !text.is_empty() && !texts.iter().any(|t| t.contains(&text)) {
            texts.push(text);
        }
    }
    texts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_looks_inside_io_errors() {
        let tls = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let io = io::Error::new(io::ErrorKind::InvalidData, tls);
        let found = find::<rustls::Error>(&io);
        assert!(matches!(
            found,
            Some(rustls::Error::InvalidCertificate(
                CertificateError::UnknownIssuer
            ))
        ));
        assert!(causes(&io).contains("UnknownIssuer") || causes(&io).contains("issuer"));
    }
}
