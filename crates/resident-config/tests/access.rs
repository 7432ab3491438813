//! `[node.access]`: principals parsed and resolved, every mistake named
//! with its key.

use std::path::Path;

use resident_config::{Access, Principal, parse};

fn config(access: &str) -> String {
    format!("[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/r.sock\"\n{access}\n")
}

#[test]
fn principals_of_every_kind_are_read_and_names_resolved() {
    let text = config(
        "[node.access]\nviewers = [\"group:root\", \"cert-dns:dash.example\"]\noperators = [\"uid:1000\", \"gid:27\", \"cert-cn:orchestrator\"]\nadmins = [\"user:root\", \"cert-uri:spiffe://example/admin\"]\n",
    );
    let c = parse(Path::new("r.toml"), &text).expect("valid");
    assert_eq!(
        c.node.access,
        Some(Access {
            viewers: vec![Principal::Gid(0), Principal::CertDns("dash.example".into())],
            operators: vec![
                Principal::Uid(1000),
                Principal::Gid(27),
                Principal::CertCn("orchestrator".into())
            ],
            admins: vec![
                Principal::Uid(0),
                Principal::CertUri("spiffe://example/admin".into())
            ],
        })
    );
    let none = parse(Path::new("r.toml"), &config("")).expect("valid");
    assert_eq!(none.node.access, None, "no table: the defaults");
}

#[test]
fn mistakes_are_named_with_their_key() {
    let check = |access: &str, want: &str| {
        let err = parse(Path::new("r.toml"), &config(access))
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "want {want:?} in: {err}");
    };
    check(
        "[node.access]\noperators = [\"uid:1\", \"root\"]",
        "r.toml:5: node.access.operators[1]: \"root\" is not a principal (uid:N, gid:N, user:NAME",
    );
    check(
        "[node.access]\nviewers = [\"uid:alice\"]",
        "node.access.viewers[0]: \"uid:alice\": \"alice\" is not a uid number",
    );
    check(
        "[node.access]\nadmins = [\"user:no-such-user-here\"]",
        "node.access.admins[0]: no user \"no-such-user-here\" on this machine",
    );
    check(
        "[node.access]\nadmins = [\"cert-cn:\"]",
        "node.access.admins[0]: \"cert-cn:\" names no cert-cn",
    );
    check(
        "[node.access]\nwatchers = []",
        "node.access.watchers: unknown field `watchers`",
    );
    check(
        "allow_uids = [1000]\n[node.access]\noperators = [\"uid:1000\"]",
        "node.access: give either [node.access] or allow_uids / allow_gids",
    );
}

#[test]
fn listen_takes_one_address_or_a_list() {
    use resident_config::Listen;
    let with = |listen: &str| format!("[node]\nname = \"n\"\nlisten = {listen}\ninsecure = true\n");
    let c = parse(
        Path::new("r.toml"),
        &with("[\"unix:///run/r.sock\", \"tcp://127.0.0.1:7443\"]"),
    )
    .expect("valid");
    assert_eq!(
        c.node.listen,
        [
            Listen::Unix("/run/r.sock".into()),
            Listen::Tcp("127.0.0.1:7443".parse().expect("addr"))
        ]
    );
    assert_eq!(c.node.socket(), Some(Path::new("/run/r.sock")));
    let check = |listen: &str, want: &str| {
        let err = parse(Path::new("r.toml"), &with(listen))
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "want {want:?} in: {err}");
    };
    check("[]", "r.toml:3: node.listen: names no address");
    check(
        "[\"unix:///a.sock\", \"tcp://nowhere\"]",
        "node.listen[1]: \"tcp://nowhere\": expected tcp://HOST:PORT",
    );
    check(
        "[\"unix:///a.sock\", \"unix:///a.sock\"]",
        "node.listen[1]: \"unix:///a.sock\" is listed twice",
    );
}
