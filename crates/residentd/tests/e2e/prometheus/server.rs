//! A real Prometheus (the Debian package's `prometheus`) on loopback,
//! scraping every second and evaluating the rules every second, and what
//! the tests ask of it and of the targets over HTTP.

use std::process::{Child, Command, Stdio};

use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::names::{RULES, dashboard_exprs, recorded, registered, rule_exprs};
use crate::support::*;

/// A process of the test, killed when dropped.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends `request` to 127.0.0.1:`port`; the status and body of the answer,
/// or `None` when nothing answers.
pub async fn http(port: u16, request: &str) -> Option<(u16, String)> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        s.write_all(request.as_bytes()).await.ok()?;
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.ok()?;
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let (head, body) = answer.split_once("\r\n\r\n")?;
        let status = head.split(' ').nth(1)?.parse().ok()?;
        Some((status, body.to_string()))
    };
    tokio::time::timeout(PATIENCE, exchange)
        .await
        .ok()
        .flatten()
}

pub fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")
}

/// `s` percent-encoded for a query string.
fn encoded(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A real Prometheus scraping the agent and the router every second and
/// evaluating the rules every second, until dropped.
pub struct Prometheus {
    port: u16,
    dir: tempfile::TempDir,
    _process: Killed,
}

impl Prometheus {
    pub fn start(agent: u16, router: u16) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let rules = workspace().join(RULES);
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: residentd\n    static_configs:\n      - targets: [\"127.0.0.1:{agent}\"]\n  - job_name: residentd-router\n    static_configs:\n      - targets: [\"127.0.0.1:{router}\"]\n",
            rules.display()
        );
        let file = dir.path().join("prometheus.yml");
        std::fs::write(&file, config).expect("write prometheus.yml");
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("a log");
        let port = free_port();
        let process = Command::new("prometheus")
            .arg(format!("--config.file={}", file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        Self {
            port,
            dir,
            _process: Killed(process),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// The `data` of an API answer, when it says `success`.
    async fn api(&self, path: &str) -> Option<Value> {
        let (status, body) = http(self.port, &get(path)).await?;
        let answer: Value = serde_json::from_str(&body).ok()?;
        (status == 200 && answer["status"] == "success").then(|| answer["data"].clone())
    }

    /// The series of the instant query `q`: labels and value.
    async fn query(&self, q: &str) -> Option<Vec<(Value, f64)>> {
        let data = self
            .api(&format!("/api/v1/query?query={}", encoded(q)))
            .await?;
        let series = data["result"].as_array()?.iter().map(|s| {
            let value = s["value"][1].as_str().and_then(|v| v.parse().ok());
            (s["metric"].clone(), value.unwrap_or(f64::NAN))
        });
        Some(series.collect())
    }

    /// Waits (bounded) until the query `q` gives a series that `want`s.
    pub async fn sees(&self, q: &str, want: impl Fn(f64) -> bool) {
        let seen = eventually(async || {
            let series = self.query(q).await.unwrap_or_default();
            series.iter().any(|(_, v)| want(*v))
        });
        let last = self.query(q).await;
        assert!(seen.await, "{q}: {last:?}\n{}", self.log());
    }
    /// Waits (bounded) until every rule was evaluated; asserts that each
    /// is loaded and evaluated without error on the real series.
    pub async fn rules_evaluate(&self) {
        let rules = until(async || {
            let data = self.api("/api/v1/rules").await?;
            let groups = data["groups"].as_array()?;
            let rules: Vec<Value> = groups
                .iter()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect();
            let evaluated = rules.iter().all(|r| r["health"] != "unknown");
            (!rules.is_empty() && evaluated).then_some(rules)
        });
        let rules = rules
            .await
            .unwrap_or_else(|| panic!("rules never evaluated:\n{}", self.log()));
        assert_eq!(rules.len(), rule_exprs().len(), "{rules:?}");
        for r in &rules {
            assert_eq!(r["health"], "ok", "{r}");
        }
    }

    /// Asserts that every name scraped from the two targets is one that
    /// metrics.rs registers (beside what Prometheus makes: up, scrape_*,
    /// ALERTS*, and the recorded series, which keep the job label).
    pub async fn scraped_only_registered_names(&self) {
        let path = format!(
            "/api/v1/label/__name__/values?match[]={}",
            encoded(r#"{job=~"residentd|residentd-router"}"#)
        );
        let scraped = self.api(&path).await.expect("metric names");
        let (registered, recorded) = (registered(), recorded());
        let names = scraped.as_array().expect("names").iter();
        for name in names.filter_map(Value::as_str) {
            let own = name == "up" || name.starts_with("scrape_") || name.starts_with("ALERTS");
            if !own && !recorded.contains(name) {
                assert!(registered.contains(name), "{name} served, not registered");
            }
        }
    }

    /// Asserts that every query of the dashboard evaluates (its variables
    /// standing for every target).
    pub async fn dashboard_queries_evaluate(&self) {
        for expr in dashboard_exprs() {
            let expr = expr.replace("$node", ".*").replace("$router", ".*");
            let answer = self.query(&expr).await;
            assert!(
                answer.is_some(),
                "Prometheus refused {expr}:\n{}",
                self.log()
            );
        }
    }
}
