//! `[node.access]`: the principals each role is granted to, every entry
//! checked (a known prefix, a uid or gid number, a user or group that
//! exists here, a non-empty certificate name).

use toml::Spanned;

use super::Result;
use crate::error::Source;
use crate::host::Lookups;
use crate::{Access, Principal, raw};

const KINDS: &str =
    "uid:N, gid:N, user:NAME, group:NAME, cert-dns:NAME, cert-uri:URI, cert-cn:NAME";

pub(super) fn access(src: &Source<'_>, a: &raw::Access, host: Lookups) -> Result<Access> {
    let list = |entries: &[Spanned<String>], name: &str| -> Result<Vec<Principal>> {
        entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let key = format!("node.access.{name}[{i}]");
                principal(e.get_ref(), host).map_err(|m| src.err(e.span(), key, m))
            })
            .collect()
    };
    Ok(Access {
        viewers: list(&a.viewers, "viewers")?,
        operators: list(&a.operators, "operators")?,
        admins: list(&a.admins, "admins")?,
    })
}

fn principal(text: &str, host: Lookups) -> std::result::Result<Principal, String> {
    let Some((kind, value)) = text.split_once(':') else {
        return Err(format!("{text:?} is not a principal ({KINDS})"));
    };
    if value.is_empty() {
        return Err(format!("{text:?} names no {kind}"));
    }
    let number = |what: &str| {
        value
            .parse::<u32>()
            .map_err(|_| format!("{text:?}: {value:?} is not a {what} number"))
    };
    Ok(match kind {
        "uid" => Principal::Uid(number("uid")?),
        "gid" => Principal::Gid(number("gid")?),
        "user" => Principal::Uid(host.user(value)?.uid),
        "group" => Principal::Gid(host.group(value)?),
        "cert-dns" => Principal::CertDns(value.to_string()),
        "cert-uri" => Principal::CertUri(value.to_string()),
        "cert-cn" => Principal::CertCn(value.to_string()),
        _ => return Err(format!("{text:?} is not a principal ({KINDS})")),
    })
}
