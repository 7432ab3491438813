//! Metric names: those the agent and the router register (read from their
//! `metrics.rs`), those the rules record, and those a PromQL expression
//! reads, so that the dashboard and the rules can be checked against the
//! real names.

use std::collections::BTreeSet;

use crate::support::workspace;

/// The rules, the dashboard and their promtool tests.
pub const RULES: &str = "prometheus/residentd-rules.yml";
pub const RULE_TESTS: &str = "prometheus/residentd-rules.test.yml";
pub const DASHBOARD: &str = "prometheus/residentd-dashboard.json";

/// What Prometheus itself makes: a target's `up`, and `ALERTS`.
const PROMETHEUS_OWN: [&str; 2] = ["up", "ALERTS"];

fn read(path: &str) -> String {
    let path = workspace().join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The names of the samples a `metrics.rs` serves: each registration's
/// name after the registry's prefix, with `_total` for a counter and
/// `_bucket`, `_sum`, `_count` for a histogram (the type read from the
/// registered field's declaration in `struct Metrics`).
pub fn registered_in(path: &str) -> BTreeSet<String> {
    let source = read(path);
    let prefix = between(&source, "Registry::with_prefix(\"", "\"")
        .unwrap_or_else(|| panic!("{path}: no Registry::with_prefix"));
    let fields = source
        .split_once("pub struct Metrics {")
        .and_then(|(_, s)| s.split_once("\n}"))
        .unwrap_or_else(|| panic!("{path}: no struct Metrics"))
        .0;
    let mut names = BTreeSet::new();
    for call in source.split(".register(").skip(1) {
        let name = between(call, "\"", "\"").expect("a registered name");
        let field = between(call, "m.", ".clone()").expect("a registered field");
        let kind = fields
            .lines()
            .find_map(|l| l.trim().strip_prefix(&format!("{field}: ")))
            .unwrap_or_else(|| panic!("{path}: field {field} not declared"));
        let base = format!("{prefix}_{name}");
        let suffixes: &[&str] = if kind.contains("Counter") {
            &["_total"]
        } else if kind.contains("Histogram") {
            &["_bucket", "_sum", "_count"]
        } else {
            assert!(kind.contains("Gauge"), "{path}: {field}: {kind}");
            &[""]
        };
        names.extend(suffixes.iter().map(|s| format!("{base}{s}")));
    }
    assert!(names.len() > 5, "{path}: registrations not found");
    names
}

fn between<'a>(s: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let (_, rest) = s.split_once(open)?;
    Some(rest.split_once(close)?.0)
}

/// What the agent and the router register.
pub fn registered() -> BTreeSet<String> {
    let mut names = registered_in("crates/residentd/src/metrics.rs");
    names.extend(registered_in("crates/residentd-router/src/metrics.rs"));
    names
}

/// The metric names of the Metrics tables of docs/operations.md and
/// docs/router.md.
pub fn documented() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for path in ["docs/operations.md", "docs/router.md"] {
        let doc = read(path);
        let (_, section) = doc.split_once("\n## Metrics\n").expect("a Metrics section");
        let section = section.split("\n## ").next().unwrap_or_default();
        let table = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `")?.split_once('`'));
        for (name, row) in table {
            match row.split('|').nth(1).map(str::trim) {
                Some("histogram") => {
                    names.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}")))
                }
                _ => {
                    names.insert(name.to_string());
                }
            }
        }
    }
    names
}

/// The names the rules record.
pub fn recorded() -> BTreeSet<String> {
    read(RULES)
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record: "))
        .map(|n| n.trim().to_string())
        .collect()
}

/// Every name a dashboard or rule query may read.
pub fn known() -> BTreeSet<String> {
    let mut names = registered();
    names.extend(recorded());
    names.extend(PROMETHEUS_OWN.map(String::from));
    names
}

/// The `expr:` of every rule: inline, or the block below `expr: |`.
pub fn rule_exprs() -> Vec<String> {
    let text = read(RULES);
    let lines: Vec<&str> = text.lines().collect();
    let mut exprs = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(value) = line.trim_start().strip_prefix("expr: ") else {
            continue;
        };
        if value.trim() != "|" {
            exprs.push(value.trim().to_string());
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let block: Vec<&str> = lines[i + 1..]
            .iter()
            .take_while(|l| l.len() - l.trim_start().len() > indent)
            .map(|l| l.trim())
            .collect();
        exprs.push(block.join("\n"));
    }
    exprs
}

/// Every query of the dashboard: each panel target's `expr` (rows'
/// panels included), and each templating variable's metric selector
/// (`label_values(SELECTOR, label)`).
pub fn dashboard_exprs() -> Vec<String> {
    let dashboard: serde_json::Value = serde_json::from_str(&read(DASHBOARD)).expect("JSON");
    let mut exprs = Vec::new();
    let mut panels: Vec<&serde_json::Value> = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        panels.push(p);
        panels.extend(p["panels"].as_array().into_iter().flatten());
    }
    for p in panels {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push(t["expr"].as_str().expect("a target's expr").to_string());
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        if v["type"] != "query" {
            continue;
        }
        let query = v["query"]["query"].as_str().expect("a variable's query");
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.rsplit_once(','))
            .map(|(selector, _)| selector)
            .unwrap_or_else(|| panic!("a label_values(SELECTOR, label) query: {query}"));
        exprs.push(inner.to_string());
    }
    exprs
}

/// Words of PromQL that are no metric: operators, modifiers, aggregations
/// (which may come before their `by (...)`), and the numbers' names.
const KEYWORDS: [&str; 26] = [
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "atan2",
    "inf",
    "nan",
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
];

/// The metric names `expr` reads: every identifier that is not inside a
/// string, a label matcher `{...}`, a range `[...]` or a grouping list
/// `by (...)`, nor a function called, a keyword, a number or duration, or
/// a Grafana `$variable`.
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut grouping = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = past_quoted(&chars, i);
        } else if c == '{' || c == '[' || (c == '(' && grouping) {
            let close = match c {
                '{' => '}',
                '[' => ']',
                _ => ')',
            };
            i += 1;
            while i < chars.len() && chars[i] != close {
                i = if matches!(chars[i], '"' | '\'' | '`') {
                    past_quoted(&chars, i)
                } else {
                    i + 1
                };
            }
            i += 1;
            grouping = false;
        } else if c.is_ascii_digit() || c == '$' {
            i += 1;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_.".contains(chars[i])) {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i])) {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace());
            let lower = word.to_lowercase();
            if [
                "by",
                "without",
                "on",
                "ignoring",
                "group_left",
                "group_right",
            ]
            .contains(&lower.as_str())
            {
                // `group_left label` needs no parentheses.
                grouping = next == Some(&'(');
            } else if next != Some(&'(') && !KEYWORDS.contains(&lower.as_str()) {
                names.insert(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The index just past the quoted string that starts at `start`.
fn past_quoted(chars: &[char], start: usize) -> usize {
    let quote = chars[start];
    let mut i = start + 1;
    while i < chars.len() && chars[i] != quote {
        i += if chars[i] == '\\' { 2 } else { 1 };
    }
    i + 1
}

#[test]
fn metric_names_reads_only_the_metrics_of_an_expression() {
    let cases: [(&str, &[&str]); 6] = [
        (
            "sum by (job, le) (rate(a_bucket{x=\"}{\", y=~'b|c'}[5m:1m])) / on (job) group_left (d) c:d:e offset 30m > bool 0.5",
            &["a_bucket", "c:d:e"],
        ),
        (
            "histogram_quantile(0.99, sum without (rpc) (rate(h_bucket[$__rate_interval])))",
            &["h_bucket"],
        ),
        ("x unless x offset 1h == 1 or vector(0) * Inf", &["x"]),
        ("up{job=\"residentd\", instance=~\"$node\"} == 0", &["up"]),
        ("count by (state) (s == 1) + 1e9 - -0x1F", &["s"]),
        ("max(m) by (pool) and min (n)", &["m", "n"]),
    ];
    for (expr, want) in cases {
        let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
        assert_eq!(metric_names(expr), want, "{expr}");
    }
}
