//! Where the API listens (`node.listen`) and its TLS files (`[node.tls]`):
//! a Unix socket, or TCP only with TLS or an explicit `insecure`.

use std::path::PathBuf;

use toml::Spanned;

use super::Result;
use crate::error::Source;
use crate::host::Lookups;
use crate::{Listen, TlsFiles, raw};

/// The three PEM files, read through `host`.
pub(super) fn tls(src: &Source<'_>, t: &raw::Tls, host: Lookups) -> Result<TlsFiles> {
    let read = |s: &Spanned<String>, key: &str| {
        host.read(s.get_ref())
            .map_err(|m| src.err(s.span(), key, m))
    };
    Ok(TlsFiles {
        cert: read(&t.cert, "node.tls.cert")?,
        key: read(&t.key, "node.tls.key")?,
        client_ca: read(&t.client_ca, "node.tls.client_ca")?,
    })
}

/// `tcp_allowed`: TLS is configured, or plaintext was asked for.
pub(super) fn listen(src: &Source<'_>, l: &Spanned<String>, tcp_allowed: bool) -> Result<Listen> {
    let text = l.get_ref();
    if let Some(path) = text.strip_prefix("unix://") {
        if !path.starts_with('/') {
            return Err(src.err(
                l.span(),
                "node.listen",
                format!("{text:?}: the socket path must be absolute"),
            ));
        }
        return Ok(Listen::Unix(PathBuf::from(path)));
    }
    if let Some(addr) = text.strip_prefix("tcp://") {
        let addr = addr.parse().map_err(|_| {
            src.err(
                l.span(),
                "node.listen",
                format!("{text:?}: expected tcp://HOST:PORT with an IP address"),
            )
        })?;
        if !tcp_allowed {
            let msg = "TCP needs TLS with client certificates: add [node.tls] with cert, key and \
                       client_ca, or set insecure = true to accept plaintext TCP";
            return Err(src.err(l.span(), "node.listen", msg));
        }
        return Ok(Listen::Tcp(addr));
    }
    Err(src.err(
        l.span(),
        "node.listen",
        format!("{text:?}: expected unix:///PATH or tcp://HOST:PORT"),
    ))
}
