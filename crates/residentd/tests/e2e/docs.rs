//! The docs agree with the code, where that can be checked mechanically:
//!
//! - every config key they name (in a TOML snippet, a row of
//!   docs/config.md's reference tables, a `key = value` in the prose, a
//!   commented-out line of an example) is one the config parser accepts in
//!   that table, as the parser itself says (its error for an unknown key
//!   lists what it accepts), and every key the parser accepts is named in
//!   docs/config.md;
//! - every metric they name (prometheus/'s rules and dashboard included)
//!   is one the agent or the router registers (crates/residentd/src/
//!   metrics.rs, crates/residentd-router/src/metrics.rs), and every
//!   metric registered has its row: the agent's in docs/operations.md, the
//!   router's in docs/router.md;
//! - every alert and recording rule they name exists in prometheus/*.yml,
//!   and every alert has its row in docs/operations.md's table;
//! - each role's row in docs/security.md and docs/config.md names the RPCs
//!   the agent asks that role of (`residentd::access::required`), every
//!   RPC of the proto under one;
//! - every `metrics_listen` they show, and the scrape target of
//!   docs/operations.md, use one port;
//! - every example config (examples/*.toml, systemd/residentd.toml, the
//!   latter also with its commented-out examples uncommented) passes
//!   `residentd --check-config`, with `--for-another-host` where it names
//!   programs, models or users this machine lacks (`EXAMPLES` says which).
//!
//! Prose claims (who outlives whom, what a unit enables) are not checked
//! here; the tests of each behaviour are.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::*;

/// Every example config, whether it is checked for another host, and why.
const EXAMPLES: &[(&str, bool, &str)] = &[
    ("examples/laptop.toml", false, "runs here as it is"),
    (
        "examples/brief.toml",
        true,
        "its programs are /usr/bin/llama-server and its models under /models",
    ),
    (
        "examples/llama-cpp-python.toml",
        true,
        "its python is /opt/llama/bin/python and its models under /models",
    ),
    (
        "examples/multi-gpu.toml",
        true,
        "its servers and models are those of a GPU node",
    ),
    (
        "examples/router-llama.toml",
        true,
        "its servers are under /opt/llama and its models under /models",
    ),
    (
        "systemd/residentd.toml",
        true,
        "it runs models as residentd-model and gives the socket to group residentd, which the package makes",
    ),
];

/// Words the docs write as `name = value` that are no config keys: fields
/// of the API's answers (docs/api.md).
const NOT_CONFIG: &[&str] = &["cause", "created", "temporary"];

/// The docs: README.md, ARCHITECTURE.md and docs/*.md, each with its text.
fn docs() -> Vec<(String, String)> {
    let root = workspace();
    let mut files = vec![PathBuf::from("README.md"), PathBuf::from("ARCHITECTURE.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| PathBuf::from("docs").join(p.file_name().expect("a name")))
        .collect();
    pages.sort();
    files.extend(pages);
    files
        .into_iter()
        .map(|f| {
            let text = std::fs::read_to_string(root.join(&f))
                .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            (f.display().to_string(), text)
        })
        .collect()
}

fn read(file: &str) -> String {
    std::fs::read_to_string(workspace().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

// ---- config keys ---------------------------------------------------------

/// The tables of the config, as the docs write their paths (`*` for the
/// name of a memory table, which is a pool or a label of the workload's).
const TABLES: &[&str] = &[
    "",
    "node",
    "node.access",
    "node.tls",
    "pool",
    "group",
    "workload",
    "workload.memory.*",
    "workload.readiness",
    "workload.restart",
    "workload.sleep",
    "workload.sleep.memory.*",
];

/// The keys the parser accepts in `table`, as it says itself: a document
/// with an unknown key there is refused with the list of those it expects.
fn accepted(table: &str) -> BTreeSet<String> {
    let mut doc = String::new();
    let segments: Vec<&str> = table.split('.').filter(|s| !s.is_empty()).collect();
    if let Some(first) = segments.first() {
        if ["pool", "group", "workload"].contains(first) {
            doc += &format!("[[{first}]]\nname = \"x\"\n");
            if segments.len() > 1 {
                let path = segments.join(".").replace('*', "ram");
                doc += &format!("[{path}]\n");
            }
        } else {
            doc += &format!("[{}]\n", segments.join("."));
        }
    }
    doc += "zz_no_such_key = 1\n";
    let e = resident_config::parse_with(
        Path::new("probe.toml"),
        &doc,
        resident_config::Host::Elsewhere,
    )
    .expect_err("an unknown key is refused");
    let said = e.to_string();
    let listed = said
        .split_once("unknown field `zz_no_such_key`, expected")
        .unwrap_or_else(|| panic!("[{table}]: the parser's answer lists no keys: {said}"))
        .1;
    backticked(listed).into_iter().collect()
}

/// The backticked words of `text`, in order.
fn backticked(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// A table path as written (`workload.memory.gpu`, `[[pool]]`,
/// `workload.sleep.memory.POOL`) in the form of `TABLES`.
fn table_of(written: &str) -> String {
    let inner = written.trim().trim_matches(|c| c == '[' || c == ']');
    let segments: Vec<&str> = inner.split('.').collect();
    let mut out: Vec<&str> = Vec::new();
    for (i, s) in segments.iter().enumerate() {
        if i > 0 && segments[i - 1] == "memory" {
            out.push("*");
        } else {
            out.push(s);
        }
    }
    out.join(".")
}

/// A config key the docs name: where, in which table (`None`: any), which.
#[derive(Debug)]
struct Named {
    at: String,
    table: Option<String>,
    key: String,
}

/// A line that opens a TOML table (`[node.access]`, `[[workload]]`,
/// `# [workload.memory.ram]` commented out): its path.
fn header(line: &str) -> Option<String> {
    let l = line.trim_start().trim_start_matches('#').trim();
    let l = l.split('#').next().unwrap_or_default().trim();
    let ok = l.starts_with('[')
        && l.ends_with(']')
        && l.chars()
            .nth(1)
            .is_some_and(|c| c == '[' || c.is_ascii_lowercase())
        && l.chars()
            .all(|c| c.is_ascii_alphanumeric() || "[]._*-".contains(c));
    ok.then(|| table_of(l))
}

/// A line that sets a key (`key = value`, `# key = value` commented out):
/// the key.
fn key_line(line: &str) -> Option<String> {
    let l = line.trim_start().trim_start_matches('#').trim_start();
    let (key, value) = l.split_once('=')?;
    let key = key.trim();
    let valid = !key.is_empty()
        && key.starts_with(|c: char| c.is_ascii_lowercase())
        && key
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.');
    // `key = value`, spaced as TOML is written here (a shell's `A=b` is not).
    let spaced = l[key.len()..].starts_with(' ');
    (valid && spaced && !value.trim().is_empty()).then(|| {
        // A dotted key names its first table's key.
        key.split('.').next().unwrap_or(key).to_string()
    })
}

/// The TOML of a doc: fenced ```toml blocks, and code blocks (fenced
/// without a language, or indented) with a table header in them. Each
/// line with its number.
fn toml_blocks(text: &str) -> Vec<Vec<(usize, String)>> {
    let lines: Vec<&str> = text.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let l = lines[i];
        if let Some(lang) = l.trim_start().strip_prefix("```") {
            let lang = lang.trim().to_string();
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                body.push((i + 1, lines[i].to_string()));
                i += 1;
            }
            i += 1;
            let tomlish = lang == "toml"
                || (lang.is_empty()
                    && body
                        .iter()
                        .any(|(_, b)| header(b).is_some() && !b.trim_start().starts_with('#')));
            if tomlish {
                blocks.push(body);
            }
            continue;
        }
        if l.starts_with("    ") && (i == 0 || lines[i - 1].trim().is_empty()) {
            let mut body = Vec::new();
            while i < lines.len() && (lines[i].starts_with("    ") || lines[i].trim().is_empty()) {
                body.push((i + 1, lines[i].get(4..).unwrap_or_default().to_string()));
                i += 1;
            }
            if body
                .iter()
                .any(|(_, b)| header(b).is_some() && !b.trim_start().starts_with('#'))
            {
                blocks.push(body);
            }
            continue;
        }
        i += 1;
    }
    blocks
}

/// The keys a block of TOML sets, each in its table (commented-out lines
/// too, when `comments`: an example's lines to uncomment).
fn keys_of_block(file: &str, block: &[(usize, String)], comments: bool, out: &mut Vec<Named>) {
    let mut table: Option<String> = None;
    for (n, line) in block {
        let commented = line.trim_start().starts_with('#');
        if commented && !comments {
            continue;
        }
        if let Some(t) = header(line) {
            table = Some(t);
            continue;
        }
        if let Some(key) = key_line(line) {
            out.push(Named {
                at: format!("{file}:{n}"),
                table: Some(table.clone().unwrap_or_default()),
                key,
            });
        }
    }
}

/// Rows of docs/config.md's reference tables: under a heading that names
/// a table (`## [[workload]]`), the keys of each row's first cell
/// (`memory.POOL.weights`, `readiness.http` / `.tcp`).
fn reference_rows(file: &str, text: &str, out: &mut Vec<Named>) {
    let mut table: Option<String> = None;
    for (n, line) in text.lines().enumerate() {
        if line.starts_with('#') {
            table = backticked(line)
                .into_iter()
                .find(|t| t.starts_with('['))
                .map(|t| table_of(&t));
            continue;
        }
        let Some(t) = &table else { continue };
        let Some(first) = line.strip_prefix('|').and_then(|r| r.split('|').next()) else {
            continue;
        };
        let mut parent = String::new();
        for item in backticked(first) {
            let full = match item.strip_prefix('.') {
                Some(rest) => format!("{parent}.{rest}"),
                None => item.clone(),
            };
            let mut path: Vec<&str> = full.split('.').collect();
            let key = path.pop().unwrap_or_default().to_string();
            parent = path.join(".");
            let sub = if parent.is_empty() {
                t.clone()
            } else {
                table_of(&format!("{t}.{parent}"))
            };
            out.push(Named {
                at: format!("{file}:{}", n + 1),
                table: Some(sub),
                key,
            });
        }
    }
}

/// `key = value` and `[table]` in the prose's backticks.
fn prose(file: &str, text: &str, out: &mut Vec<Named>, tables: &mut Vec<(String, String)>) {
    for (n, line) in text.lines().enumerate() {
        for item in backticked(line) {
            if let Some(t) = header(&item)
                && !item.contains(' ')
            {
                tables.push((format!("{file}:{}", n + 1), t));
            } else if let Some(key) = key_line(&item)
                && !NOT_CONFIG.contains(&key.as_str())
            {
                out.push(Named {
                    at: format!("{file}:{}", n + 1),
                    table: None,
                    key,
                });
            }
        }
    }
}

#[test]
fn every_config_key_the_docs_name_is_one_the_parser_accepts_and_each_is_documented() {
    let keys: BTreeMap<String, BTreeSet<String>> = TABLES
        .iter()
        .map(|t| (t.to_string(), accepted(t)))
        .collect();
    assert!(keys["node"].contains("listen") && keys["workload.memory.*"].contains("from_gguf"));
    let any: BTreeSet<&String> = keys.values().flatten().collect();
    let mut named = Vec::new();
    let mut tables = Vec::new();
    for (file, text) in docs() {
        for block in toml_blocks(&text) {
            keys_of_block(&file, &block, false, &mut named);
        }
        if file == "docs/config.md" {
            reference_rows(&file, &text, &mut named);
        }
        prose(&file, &text, &mut named, &mut tables);
    }
    for (file, _, _) in EXAMPLES {
        let text = read(file);
        let lines: Vec<(usize, String)> = text
            .lines()
            .enumerate()
            .map(|(n, l)| (n + 1, l.to_string()))
            .collect();
        keys_of_block(file, &lines, true, &mut named);
    }
    assert!(named.len() > 200, "the docs name keys: {}", named.len());
    let mut wrong = Vec::new();
    for n in &named {
        let known = match &n.table {
            None => any.contains(&n.key),
            Some(t) => keys.get(t).is_some_and(|k| k.contains(&n.key)),
        };
        if !known {
            wrong.push(format!(
                "{}: {:?} in [{}]",
                n.at,
                n.key,
                n.table.as_deref().unwrap_or("any table")
            ));
        }
    }
    for (at, t) in &tables {
        if !keys.contains_key(t) {
            wrong.push(format!("{at}: no table [{t}]"));
        }
    }
    // And the reverse: every key the parser accepts is named in the
    // reference (docs/config.md), at least in backticks.
    let reference: BTreeSet<String> = backticked(&read("docs/config.md"))
        .iter()
        .flat_map(|t| {
            t.split(['.', ' ', '=', '[', ']'])
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect();
    for (t, ks) in &keys {
        for k in ks {
            if !reference.contains(k) {
                wrong.push(format!("docs/config.md: no word of key {k:?} of [{t}]"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "config keys the docs and the parser disagree on:\n{}",
        wrong.join("\n")
    );
}

// ---- metrics -------------------------------------------------------------

/// The families a metrics.rs registers, by their exposed name (with the
/// registry's prefix and a counter's `_total`), and each one's type.
fn registered(source: &str) -> BTreeMap<String, &'static str> {
    let text = read(source);
    let prefix = text
        .split_once("Registry::with_prefix(\"")
        .and_then(|(_, rest)| rest.split_once('"'))
        .map(|(p, _)| p.to_string())
        .unwrap_or_else(|| panic!("{source}: no Registry::with_prefix"));
    // The fields of `struct Metrics` and their types.
    let body = text
        .split_once("pub struct Metrics {")
        .and_then(|(_, rest)| rest.split_once("\n}"))
        .map(|(body, _)| body)
        .unwrap_or_else(|| panic!("{source}: no struct Metrics"));
    let fields: BTreeMap<String, String> = body
        .lines()
        .filter_map(|l| {
            let (name, ty) = l.trim().split_once(": ")?;
            let plain = name.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            (plain && !name.is_empty()).then(|| (name.to_string(), ty.to_string()))
        })
        .collect();
    let mut out = BTreeMap::new();
    for call in text.split(".register(").skip(1) {
        // register("name", "help", m.field.clone())
        let quoted: Vec<&str> = call.splitn(5, '"').collect();
        let name = quoted[1].to_string();
        let field = quoted[4]
            .split("m.")
            .nth(1)
            .and_then(|f| f.split('.').next())
            .unwrap_or_else(|| panic!("{source}: register({name:?}) of no m.FIELD"));
        let ty = fields
            .get(field)
            .unwrap_or_else(|| panic!("{source}: no field {field}"));
        let kind = if ty.contains("Counter") {
            "counter"
        } else if ty.contains("Histogram") {
            "histogram"
        } else {
            "gauge"
        };
        let full = match kind {
            "counter" => format!("{prefix}_{name}_total"),
            _ => format!("{prefix}_{name}"),
        };
        out.insert(full, kind);
    }
    assert!(out.len() > 3, "{source}: registers {out:?}");
    out
}

/// The metric names in `text`: `residentd_...` words that are not part of
/// a recording rule's name (`pool:residentd_pool_used:ratio`), a prefix
/// (`residentd_router_`) or a Rust path (`residentd_router::App`).
fn metric_names(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut rest = line;
        let mut offset = 0;
        while let Some(i) = rest.find("residentd_") {
            let at = offset + i;
            let before = line[..at].chars().next_back();
            let word: String = line[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let after = line[at + word.len()..].chars().next();
            let part_of_more =
                before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
            if !part_of_more && !word.ends_with('_') && after != Some(':') {
                out.push((n + 1, word.clone()));
            }
            offset = at + word.len().max(1);
            rest = &line[offset..];
        }
    }
    out
}

/// Every metric the docs (README, docs/, ARCHITECTURE.md, the rules, their
/// tests and the dashboard) name.
fn sources_naming_metrics() -> Vec<(String, String)> {
    let mut out = docs();
    for f in [
        "prometheus/residentd-rules.yml",
        "prometheus/residentd-rules.test.yml",
        "prometheus/residentd-dashboard.json",
    ] {
        out.push((f.to_string(), read(f)));
    }
    out
}

#[test]
fn every_metric_the_docs_name_is_registered_and_each_registered_one_is_documented() {
    let agent = registered("crates/residentd/src/metrics.rs");
    let router = registered("crates/residentd-router/src/metrics.rs");
    let mut series: BTreeSet<String> = BTreeSet::new();
    for (name, kind) in agent.iter().chain(&router) {
        series.insert(name.clone());
        if *kind == "histogram" {
            for s in ["_bucket", "_sum", "_count"] {
                series.insert(format!("{name}{s}"));
            }
        }
    }
    let mut wrong = Vec::new();
    for (file, text) in sources_naming_metrics() {
        for (n, name) in metric_names(&text) {
            if !series.contains(&name) {
                wrong.push(format!(
                    "{file}:{n}: {name} is no metric of the agent or the router"
                ));
            }
        }
    }
    // Each family has its row: `| `name` | type | ...`.
    for (page, families) in [("docs/operations.md", &agent), ("docs/router.md", &router)] {
        let rows: BTreeSet<String> = read(page)
            .lines()
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next().map(str::to_string))
            .collect();
        for name in families.keys() {
            if !rows.contains(name) {
                wrong.push(format!("{page}: no row for the metric {name}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "metrics the docs and the code disagree on:\n{}",
        wrong.join("\n")
    );
}

// ---- alerts and recording rules ------------------------------------------

/// The `- alert:` and `- record:` names of prometheus/*.yml.
fn rules(kind: &str) -> BTreeSet<String> {
    let text = read("prometheus/residentd-rules.yml");
    let tag = format!("- {kind}:");
    text.lines()
        .filter_map(|l| l.trim().strip_prefix(&tag).map(|n| n.trim().to_string()))
        .collect()
}

#[test]
fn every_alert_and_rule_the_docs_name_exists_and_each_alert_is_documented() {
    let alerts = rules("alert");
    let records = rules("record");
    assert!(
        alerts.len() > 5 && records.len() > 5,
        "{alerts:?} {records:?}"
    );
    let mut wrong = Vec::new();
    let mut docs_and_dashboard = docs();
    docs_and_dashboard.push((
        "prometheus/residentd-dashboard.json".into(),
        read("prometheus/residentd-dashboard.json"),
    ));
    for (file, text) in &docs_and_dashboard {
        for (n, line) in text.lines().enumerate() {
            // Alerts: `ResidentdSomething`.
            for word in line.split(|c: char| !c.is_ascii_alphanumeric()) {
                let alert = word.starts_with("Residentd")
                    && word[9..].starts_with(|c: char| c.is_ascii_uppercase());
                if alert && !alerts.contains(word) {
                    wrong.push(format!("{file}:{}: no alert {word}", n + 1));
                }
            }
            // Recording rules: `level:residentd_metric:operations`.
            for word in line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')) {
                let parts: Vec<&str> = word.split(':').collect();
                let record = parts.len() == 3 && parts[1].starts_with("residentd_");
                if record && !records.contains(word) {
                    wrong.push(format!("{file}:{}: no recording rule {word}", n + 1));
                }
            }
        }
    }
    let table: BTreeSet<String> = read("docs/operations.md")
        .lines()
        .filter_map(|l| {
            l.strip_prefix("| `Residentd")?
                .split('`')
                .next()
                .map(|n| format!("Residentd{n}"))
        })
        .collect();
    for alert in &alerts {
        if !table.contains(alert) {
            wrong.push(format!(
                "docs/operations.md: no row for the alert {alert} in the alerts' table"
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "alerts the docs and the rules disagree on:\n{}",
        wrong.join("\n")
    );
}

// ---- roles ---------------------------------------------------------------

#[test]
fn the_role_tables_name_each_rpc_under_the_role_it_needs() {
    // The RPCs of the contract, and the role the agent asks of each.
    let proto = read("proto/resident/v1/node_agent.proto");
    let rpcs: BTreeSet<String> = proto
        .lines()
        .filter_map(|l| l.trim().strip_prefix("rpc ")?.split('(').next())
        .map(str::to_string)
        .collect();
    assert!(rpcs.len() > 10, "{rpcs:?}");
    let mut needs: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for rpc in &rpcs {
        let role = residentd::access::required(&format!("/resident.v1.NodeAgent/{rpc}"))
            .unwrap_or_else(|| panic!("{rpc} needs no role"));
        needs.entry(role.as_str()).or_default().insert(rpc.clone());
    }
    // Each row of a role names the RPCs that role adds: docs/security.md's
    // `| `operator` | and Start, ...`, docs/config.md's `| `operators` | ...`.
    let mut wrong = Vec::new();
    for (file, plural) in [("docs/security.md", ""), ("docs/config.md", "s")] {
        let text = read(file);
        for (role, wanted) in &needs {
            let start = format!("| `{role}{plural}` |");
            let Some(row) = text.lines().find(|l| l.starts_with(&start)) else {
                wrong.push(format!("{file}: no row {start}"));
                continue;
            };
            let named: BTreeSet<String> = row
                .split(|c: char| !c.is_ascii_alphanumeric())
                .filter(|w| rpcs.contains(*w))
                .map(str::to_string)
                .collect();
            if &named != wanted {
                wrong.push(format!(
                    "{file}: the {role} row names {named:?}, the agent asks {role} of {wanted:?}"
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

// ---- the metrics port ----------------------------------------------------

#[test]
fn every_metrics_listen_shown_and_the_scrape_target_use_one_port() {
    let mut ports: Vec<(String, String)> = Vec::new();
    let mut texts = docs();
    for (file, _, _) in EXAMPLES {
        texts.push((file.to_string(), read(file)));
    }
    for (file, text) in &texts {
        for (n, line) in text.lines().enumerate() {
            let at = format!("{file}:{}", n + 1);
            if let Some((_, rest)) = line.split_once("metrics_listen = \"") {
                let addr = rest.split('"').next().unwrap_or_default();
                let port = addr.rsplit(':').next().unwrap_or_default();
                ports.push((at.clone(), port.to_string()));
            }
            // The scrape config: `- targets: ["127.0.0.1:9187"]     # metrics_listen`.
            if line.contains("targets:") && line.contains("# metrics_listen") {
                let addr = line.split('"').nth(1).unwrap_or_default();
                let port = addr.rsplit(':').next().unwrap_or_default();
                ports.push((at, port.to_string()));
            }
        }
    }
    assert!(ports.len() >= 2, "{ports:?}");
    let distinct: BTreeSet<&String> = ports.iter().map(|(_, p)| p).collect();
    assert_eq!(
        distinct.len(),
        1,
        "the docs show several metrics ports: {ports:#?}"
    );
}

// ---- example configs -----------------------------------------------------

/// `residentd --check-config FILE` (for another host when `elsewhere`):
/// whether it passed, and what it said.
fn check_config(file: &Path, elsewhere: bool) -> (bool, String) {
    let mut cmd = Command::new(RESIDENTD);
    cmd.arg("--check-config").arg(file);
    if elsewhere {
        cmd.arg("--for-another-host");
    }
    let out = cmd.output().expect("residentd --check-config");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), said)
}

/// `text` with every commented-out line of TOML (a table header or a
/// `key = value`) uncommented: the examples a shipped file offers.
fn uncommented(text: &str) -> String {
    text.lines()
        .map(|l| {
            let bare = l.trim_start().strip_prefix('#').map(str::trim_start);
            match bare {
                Some(b) if header(b).is_some() || key_line(b).is_some() => b.to_string(),
                _ => l.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn every_example_config_passes_check_config() {
    let root = workspace();
    let listed: BTreeSet<String> = EXAMPLES.iter().map(|(f, _, _)| f.to_string()).collect();
    let mut shipped: BTreeSet<String> = std::fs::read_dir(root.join("examples"))
        .expect("examples/")
        .filter_map(|e| e.ok())
        .map(|e| format!("examples/{}", e.file_name().to_string_lossy()))
        .filter(|f| f.ends_with(".toml"))
        .collect();
    shipped.insert("systemd/residentd.toml".into());
    assert_eq!(listed, shipped, "EXAMPLES lists every example config");
    let mut failed = Vec::new();
    for (file, elsewhere, why) in EXAMPLES {
        let (ok, said) = check_config(&root.join(file), *elsewhere);
        println!("{file} (for another host: {elsewhere}, {why}):\n{said}");
        if !ok {
            failed.push(format!("{file}:\n{said}"));
        }
    }
    // The shipped config with its commented examples taken up.
    let dir = tempfile::tempdir().expect("tempdir");
    let taken = dir.path().join("residentd.toml");
    let text = uncommented(&read("systemd/residentd.toml"));
    std::fs::write(&taken, &text).expect("write");
    let (ok, said) = check_config(&taken, true);
    println!("systemd/residentd.toml uncommented:\n{text}\n{said}");
    if !ok {
        failed.push(format!(
            "systemd/residentd.toml, its examples uncommented:\n{said}"
        ));
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}
