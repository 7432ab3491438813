//! The node console (`GET /ui` on residentd-router) in a real headless
//! Chromium: tests/console/browser.py, Selenium from the .venv pointed at
//! Debian's chromium and chromium-driver, answers one command at a time
//! while the test changes the agent over gRPC. The router is its library
//! served in this process, in front of the real agent. Screenshots go to
//! a temporary directory (their paths are printed; RESIDENT_KEEP_SHOTS
//! keeps them); scripts/console-screenshot remakes docs/console.png with
//! the first, through RESIDENT_CONSOLE_PNG.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use resident_api::pb;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader, Lines};
use tokio::net::TcpStream;
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::support::*;

async fn router(socket: &Path) -> Router {
    router_with(socket, None).await
}

/// A router whose console takes actions with `token`.
async fn router_with(socket: &Path, token: Option<&str>) -> Router {
    let agent = socket.display().to_string();
    serve_router(&agent, None, Duration::from_secs(5), token).await
}

/// One browser at a time: the tests measure the page, not browsers
/// competing for the cores.
static ONE_BROWSER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The headless browser of tests/console/browser.py.
struct Browser {
    _alone: tokio::sync::MutexGuard<'static, ()>,
    child: Child,
    /// browser.py's TMPDIR: chromium leaves its singleton's directory
    /// there, removed with this once the browser has ended.
    _tmp: tempfile::TempDir,
    /// None once closed (the end of browser.py's input).
    stdin: Option<ChildStdin>,
    /// browser.py's process group (its pid).
    group: i32,
    answers: Lines<BufReader<ChildStdout>>,
}

impl Browser {
    /// A browser, or `None` after saying why the test is skipped (a
    /// failure under CI, which installs chromium and selenium).
    async fn start() -> Option<Self> {
        let python = venv_python("the console's browser tests")?;
        let alone = ONE_BROWSER.lock().await;
        let tmp = tempfile::tempdir().expect("tempdir");
        let mut child = tokio::process::Command::new(python)
            .arg(workspace().join("tests/console/browser.py"))
            .env("TMPDIR", tmp.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // Its own process group, which chromedriver and chromium join:
            // what `drop` kills if anything of it is left.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .expect("run browser.py");
        let stdin = child.stdin.take().expect("stdin");
        let answers = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let group = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .expect("a pid");
        let mut b = Self {
            _alone: alone,
            child,
            _tmp: tmp,
            stdin: Some(stdin),
            group,
            answers,
        };
        let first = b.answer("start").await;
        if let Some(why) = first["skip"].as_str() {
            assert!(std::env::var_os("CI").is_none(), "{why}");
            skip(why);
            return None;
        }
        assert_eq!(first["ready"], true, "{first}");
        Some(b)
    }

    async fn answer(&mut self, what: &str) -> Value {
        let line = tokio::time::timeout(PATIENCE, self.answers.next_line())
            .await
            .unwrap_or_else(|_| panic!("browser.py answers {what} within the patience"))
            .expect("read browser.py")
            .unwrap_or_else(|| panic!("browser.py ended before answering {what}"));
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{what}: {e}: {line}"))
    }

    /// Runs one command; its answer, which must be `ok`.
    async fn run(&mut self, args: &[&str]) -> Value {
        let line = format!("{}\n", args.join("\t"));
        self.stdin
            .as_mut()
            .expect("browser.py's input is open")
            .write_all(line.as_bytes())
            .await
            .expect("write to browser.py");
        let what = args.join(" ");
        let answer = self.answer(&what).await;
        assert_eq!(answer["ok"], true, "{what}: {answer}");
        answer
    }

    /// Waits for an element of `css` with `words` in it; the seconds it took.
    async fn text(&mut self, css: &str, words: &str) -> f64 {
        let a = self.run(&["text", css, words]).await;
        a["took"].as_f64().expect("took")
    }

    /// Takes a screenshot into `dir`, named `name`.
    async fn shot(&mut self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        self.run(&["shot", &path.display().to_string()]).await;
        println!("screenshot: {}", path.display());
        path
    }
}

impl Drop for Browser {
    /// Ends browser.py's input, so that it quits the driver (chromedriver
    /// and its chromium) and exits; waits for that (bounded), then kills
    /// whatever is left of its process group, passed or failed. A SIGKILL
    /// of browser.py alone left chromedriver and chromium running.
    fn drop(&mut self) {
        drop(self.stdin.take());
        let bound = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < bound {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let group = nix::unistd::Pid::from_raw(self.group);
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.start_kill();
        let _ = self.child.try_wait();
    }
}

/// A workload of /bin/sleep holding `mb` MB of pool `gpu0`.
fn tiny(name: &str, mb: u64) -> String {
    format!(
        "[[workload]]\nname = \"{name}\"\ncommand = [\"/bin/sleep\", \"3600\"]\nstop_grace = \"2s\"\n[workload.memory.gpu0]\nweights = \"{mb}MB\"\n"
    )
}

#[tokio::test]
async fn the_page_follows_starts_refusals_and_logs_without_a_reload() {
    let talker = "[[workload]]\nname = \"talker\"\ncommand = [\"/bin/sh\", \"-c\", \"echo '<img src=x id=injected>'; i=0; while true; do i=$((i+1)); echo talk-$i; sleep 0.2; done\"]\nstop_grace = \"2s\"\n[workload.memory.gpu0]\nweights = \"1GB\"\n";
    let config = format!(
        "{}{}{}{talker}",
        pool("gpu0", "10GB"),
        sleeper("small", "gpu0", 4, ""),
        sleeper("big", "gpu0", 8, "")
    );
    let mut d = Daemon::start(&config).await;
    d.started("small", "s1").await;
    let r = router(&d.socket).await;
    let Some(mut b) = Browser::start().await else {
        return;
    };
    let shots = tempfile::tempdir().expect("a temporary directory");
    b.run(&["open", &format!("{}/ui", r.base)]).await;
    b.text("#mode", "Read-only").await;
    b.text("[data-pool=\"gpu0\"]", "budget 10.0 GB").await;
    b.text("[data-pool=\"gpu0\"] .legend", "s1 4.0 GB").await;
    b.text("#instances tr[data-id=\"s1\"]", "small").await;

    // A start over gRPC, drawn without a reload.
    let began = std::time::Instant::now();
    d.started("small", "s2").await;
    b.text("#instances tr[data-id=\"s2\"]", "small").await;
    let shown = began.elapsed();
    b.text("[data-pool=\"gpu0\"]", "used 8.0 GB").await;
    // Within a second of the agent's event, in the page's own clock (the
    // time from the Start call, seen through Selenium, is only printed:
    // on a loaded machine it is mostly the browser's).
    let after =
        "document.querySelector('#instances tr[data-id=\"s2\"]').dataset.shownAfterMs ?? '0'";
    let after = b.run(&["js", after]).await;
    let after: f64 = after["value"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .expect("ms");
    println!(
        "a start drawn {after} ms after its event reached the page, seen {shown:?} after the Start call"
    );
    assert!(after < 1000.0, "{after} ms");
    b.text("#events [data-kind=\"TRANSITION\"]", "s2 (small)")
        .await;

    // A refusal, with the API's words and its holders.
    let mut refused = start_req("big", "b1");
    refused.on_full = pb::Policy::Refuse as i32;
    let status = d.client.start(refused).await.expect_err("no room for big");
    let (_, placement) = refusal_details(&status);
    let words = placement.refusals[0].message.clone();
    b.text("#events [data-kind=\"REFUSED\"] .why", &words).await;
    b.text("#events [data-kind=\"REFUSED\"] .holders", "s1 (4.0 GB)")
        .await;
    b.text("#events [data-kind=\"REFUSED\"] .holders", "s2 (4.0 GB)")
        .await;

    // The logs pane follows one instance's output.
    d.started("talker", "t1").await;
    b.text("#instances tr[data-id=\"t1\"]", "talker").await;
    b.run(&["click", "#instances tr[data-id=\"t1\"] button"])
        .await;
    b.text("#logs", "talk-1").await;
    // The rows stay while the figures change: the button keeps its focus.
    let mark = "document.querySelector('#instances tr[data-id=\"t1\"]').dataset.mark = 'kept'";
    b.run(&["js", mark]).await;
    let draws = b.run(&["js", "Number(document.body.dataset.draws)"]).await;
    let draws = draws["value"].as_u64().expect("draws");
    let redrawn = format!("Number(document.body.dataset.draws) > {draws}");
    let redrawn = until(async || {
        b.run(&["js", &redrawn]).await["value"]
            .as_bool()
            .filter(|&r| r)
    })
    .await;
    assert!(redrawn.is_some(), "the node is drawn again");
    let focus = "document.activeElement.closest('tr')?.dataset.mark ?? null";
    let focused = b.run(&["js", focus]).await;
    assert_eq!(
        focused["value"], "kept",
        "the focused button is the same after a drawing"
    );
    let later = until(async || {
        let a = b
            .run(&[
                "js",
                "document.querySelector('#logs').lastElementChild?.dataset.seq",
            ])
            .await;
        a["value"]
            .as_str()
            .and_then(|s| s.parse::<u64>().ok())
            .filter(|&seq| seq >= 5)
    })
    .await;
    assert!(later.is_some(), "the logs pane follows new lines");
    // A server's output is shown as text, never as markup.
    b.text("#logs", "<img src=x id=injected>").await;
    let markup = b
        .run(&["js", "document.querySelector('#logs img') === null"])
        .await;
    assert_eq!(markup["value"], true, "a log line became an element");

    // The what-if of the same start says the same.
    b.text("#whatif-workload", "big").await;
    b.run(&[
        "js",
        "(document.querySelector('#whatif-workload').value = 'big', true)",
    ])
    .await;
    b.run(&["click", "#whatif button[type=submit]"]).await;
    b.text("#whatif-answer", "would be").await;

    // Light, dark, and a phone's width.
    let light = b.shot(shots.path(), "light-1280.png").await;
    // scripts/console-screenshot: this one is docs/console.png.
    if let Some(keep) = std::env::var_os("RESIDENT_CONSOLE_PNG") {
        std::fs::copy(&light, keep).expect("copy the screenshot");
    }
    b.run(&["dark", "on"]).await;
    b.run(&["size", "1280", "900"]).await;
    b.shot(shots.path(), "dark-1280.png").await;
    b.run(&["size", "390", "844"]).await;
    let phone = b.shot(shots.path(), "dark-phone.png").await;
    let wide = b
        .run(&[
            "js",
            "document.documentElement.scrollWidth <= window.innerWidth + 1",
        ])
        .await;
    assert_eq!(wide["value"], true, "the page fits a phone's width");
    assert!(std::fs::metadata(phone).expect("a screenshot").len() > 0);
    // An agent gone is said.
    d.terminate().await;
    b.text("#status", "agent out of reach").await;

    // Kept for a look when asked (RESIDENT_KEEP_SHOTS).
    if std::env::var_os("RESIDENT_KEEP_SHOTS").is_some() {
        println!("screenshots kept in {}", shots.keep().display());
    }
}

#[tokio::test]
async fn a_hundred_instances_render_within_a_second() {
    let config = format!("{}{}", pool("gpu0", "100GB"), tiny("tiny", 1));
    let mut d = Daemon::start(&config).await;
    for n in 0..100 {
        d.started("tiny", &format!("t{n:03}")).await;
    }
    let r = router(&d.socket).await;
    let Some(mut b) = Browser::start().await else {
        return;
    };
    b.run(&["open", &format!("{}/ui", r.base)]).await;
    b.run(&["count", "#instances tbody tr", "100"]).await;
    // In the page's own clock: from the moment it was asked for, and from
    // its script's start (the console's own part: the events stream
    // opened, the router's Watch and Node, the drawing) to the rows.
    let figure = async |b: &mut Browser, name: &str| -> f64 {
        let v = b
            .run(&["js", &format!("document.body.dataset.{name}")])
            .await;
        v["value"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .expect(name)
    };
    let first = figure(&mut b, "firstDrawnMs").await;
    let began = figure(&mut b, "scriptBeganMs").await;
    let drawing = figure(&mut b, "renderMs").await;
    println!(
        "100 instances: page asked for to 100 rows drawn {first} ms, of which the script's start to the rows {} ms, one drawing {drawing} ms",
        first - began
    );
    // Where the time went, should it be too long: the page's own
    // timeline (name, start, response start, end in ms) and its outages.
    let downs = b.run(&["js", "document.body.dataset.downs ?? ''"]).await;
    let timeline = "JSON.stringify(performance.getEntries().map(e => [e.name.split('/').pop(), Math.round(e.startTime), Math.round(e.responseStart ?? 0), Math.round(e.responseEnd ?? 0)]))";
    let timeline = b.run(&["js", timeline]).await;
    assert!(
        first - began < 1000.0,
        "{} ms; {}; {}",
        first - began,
        timeline["value"],
        downs["value"]
    );
}

/// tests/router/slow_server.py as workload `name` of pool `gpu0`: a
/// streamed answer sends a chunk every 50 ms.
fn slow(name: &str, python: &Path) -> String {
    format!(
        "[[workload]]\nname = \"{name}\"\ncommand = [\"{py}\", \"{script}\", \"${{PORT}}\"]\nstop_grace = \"2s\"\n[workload.memory.gpu0]\nweights = \"1GB\"\n[workload.readiness]\nhttp = \"/v1/models\"\ntimeout = \"30s\"\n",
        py = python.display(),
        script = workspace().join("tests/router/slow_server.py").display(),
    )
}

/// A streamed chat completion of `model` through the router at `base`,
/// open once its first chunk has come.
async fn open_stream(base: &str, model: &str) -> TcpStream {
    let body = format!(
        r#"{{"model": "{model}", "stream": true, "max_tokens": 2000, "messages": [{{"role": "user", "content": "hi"}}]}}"#
    );
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let address = base.strip_prefix("http://").expect("http");
    let mut s = TcpStream::connect(address).await.expect("connect");
    s.write_all(request.as_bytes()).await.expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let first = tokio::time::timeout(PATIENCE, async {
        while !String::from_utf8_lossy(&seen).contains("data: ") {
            let n = s.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
    });
    first.await.expect("a first chunk within the patience");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_requests_in_flight_show_per_model() {
    let Some(python) = venv_python("the console test's model server") else {
        return;
    };
    let config = format!("{}{}", pool("gpu0", "10GB"), slow("demo", &python));
    let d = Daemon::start(&config).await;
    let r = router(&d.socket).await;
    let Some(mut b) = Browser::start().await else {
        return;
    };
    b.run(&["open", &format!("{}/ui", r.base)]).await;
    b.text("#status", "live").await;
    // Started on demand by the request, which stays in flight.
    let stream = open_stream(&r.base, "demo").await;
    let began = std::time::Instant::now();
    b.text("#traffic [data-model=\"demo\"]", "1 in flight")
        .await;
    println!(
        "a request in flight shown {:?} after its first chunk",
        began.elapsed()
    );
    b.text("#instances tr[data-id=\"demo\"]", "READY").await;
    // The request holds its model: the hold's rest is shown (the router's
    // hold is 30 s, renewed every third of it).
    let hold = "document.querySelector('#instances tr[data-id=\"demo\"]').cells[9].textContent";
    let left = until(async || {
        let v = b.run(&["js", hold]).await["value"].as_str()?.to_string();
        v.strip_suffix(" s")?.parse::<u64>().ok()
    })
    .await
    .expect("the hold's rest in seconds");
    assert!((1..=30).contains(&left), "{left}");
    drop(stream);
    b.text("#traffic [data-model=\"demo\"]", "0 in flight")
        .await;
    // The answer cut off is listed; then one read to its end, with its
    // five tokens, its time to the first and its rate.
    b.text("#recent tbody tr[data-model=\"demo\"]", "(cut off)")
        .await;
    let whole = read_stream(&r.base, "demo", 5).await;
    assert_eq!(whole.matches("data: {").count(), 5, "{whole}");
    let row = "[...document.querySelectorAll('#recent tbody tr')].map(r => [...r.cells].map(c => c.textContent)).find(c => c[5] === '5') ?? null";
    let row = until(async || {
        let v = b.run(&["js", row]).await["value"].clone();
        v.as_array().cloned()
    })
    .await
    .expect("the whole answer is listed with its 5 tokens");
    let cell = |k: usize| row[k].as_str().unwrap_or_default().to_string();
    assert_eq!(cell(2), "200", "{row:?}");
    assert!(
        cell(3).ends_with(" ms") || cell(3).ends_with(" s"),
        "first token: {row:?}"
    );
    // Four gaps of 50 ms after the first token: about 20 tokens/s.
    let rate: f64 = cell(6).parse().expect("tokens/s");
    assert!(rate > 2.0 && rate < 40.0, "{row:?}");
    drop(d);
}

/// A streamed chat completion of `max_tokens` through the router at
/// `base`, read to its end.
async fn read_stream(base: &str, model: &str, max_tokens: u32) -> String {
    let body = format!(
        r#"{{"model": "{model}", "stream": true, "max_tokens": {max_tokens}, "messages": [{{"role": "user", "content": "hi"}}]}}"#
    );
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let address = base.strip_prefix("http://").expect("http");
    let mut s = TcpStream::connect(address).await.expect("connect");
    s.write_all(request.as_bytes()).await.expect("send");
    let mut answer = String::new();
    tokio::time::timeout(PATIENCE, s.read_to_string(&mut answer))
        .await
        .expect("the whole answer within the patience")
        .expect("read");
    answer
}

/// `POST /ui/act` with `body` (and `token` as the bearer): the status and
/// the answer's body.
async fn act(base: &str, token: Option<&str>, body: &str) -> (u16, String) {
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let request = format!(
        "POST /ui/act HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let address = base.strip_prefix("http://").expect("http");
    let mut s = TcpStream::connect(address).await.expect("connect");
    s.write_all(request.as_bytes()).await.expect("send");
    let mut answer = String::new();
    tokio::time::timeout(PATIENCE, s.read_to_string(&mut answer))
        .await
        .expect("answered within the patience")
        .expect("read");
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("a status line: {answer}"));
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    (status, body.to_string())
}

/// For the row of `ROW`: the window's width, how far its table is
/// scrolled sideways, and for each button shown whether it lies inside
/// the table's frame and the window, and is the element at its own
/// centre.
const BUTTONS_ON_SCREEN: &str = "(() => {\
  const row = document.querySelector('#instances tr[data-id=\"ROW\"]');\
  const frame = row.closest('.scroll');\
  window.scrollTo(0, row.getBoundingClientRect().top + window.scrollY - 100);\
  const f = frame.getBoundingClientRect();\
  const buttons = [...row.querySelectorAll('button')]\
    .filter((b) => getComputedStyle(b).display !== 'none')\
    .map((b) => {\
      const r = b.getBoundingClientRect();\
      const inside = r.left >= f.left && r.right <= f.right && r.right <= window.innerWidth\
        && r.top >= 0 && r.bottom <= window.innerHeight;\
      const on_top = document.elementFromPoint((r.left + r.right) / 2, (r.top + r.bottom) / 2) === b;\
      return { text: b.textContent, left: Math.round(r.left), right: Math.round(r.right), inside, on_top };\
    });\
  return JSON.stringify({ width: window.innerWidth, frame_right: Math.round(f.right), scroll_left: frame.scrollLeft, buttons });\
})()";

#[tokio::test]
async fn what_if_shows_places_answer_and_actions_are_off_until_turned_on() {
    // And a pool of the machine's memory with a budget far beyond it.
    let config = format!(
        "{}{}{}[[pool]]\nname = \"mem\"\nbudget = \"100TB\"\nhost = true\n\n",
        pool("gpu0", "10GB"),
        sleeper("small", "gpu0", 4, ""),
        sleeper("big", "gpu0", 8, "")
    );
    let mut d = Daemon::start(&config).await;
    d.started("small", "s1").await;
    let Some(mut b) = Browser::start().await else {
        return;
    };

    // Read-only: no action buttons, and an action sent anyway is refused
    // by the router before it reaches the agent.
    let r = router(&d.socket).await;
    b.run(&["open", &format!("{}/ui", r.base)]).await;
    b.text("#mode", "Read-only").await;
    b.text("#instances tr[data-id=\"s1\"]", "READY").await;
    // The budget beyond the machine's memory is said for what it is.
    b.text("[data-pool=\"mem\"] .legend", "not available").await;
    // (`absent` answers ok only where the words are nowhere on the page.)
    b.run(&["absent", "foreign"]).await;
    // What happened before the page (and the router) began is shown,
    // without a time of its own.
    b.text("#events [data-live=\"false\"]", "s1 (small) → READY")
        .await;
    b.text("#events [data-live=\"false\"] time", "earlier")
        .await;
    for action in ["stop", "sleep", "wake"] {
        let shown = format!(
            "getComputedStyle(document.querySelector('#instances tr[data-id=\"s1\"] button[data-action={action}]')).display"
        );
        assert_eq!(b.run(&["js", &shown]).await["value"], "none", "{action}");
    }
    let token_box = "getComputedStyle(document.querySelector('#token-form')).display";
    assert_eq!(b.run(&["js", token_box]).await["value"], "none");
    assert_eq!(
        b.run(&[
            "js",
            "getComputedStyle(document.querySelector('#start')).display"
        ])
        .await["value"],
        "none"
    );
    let (status, body) = act(
        &r.base,
        Some("anything"),
        r#"{"action": "stop", "id": "s1"}"#,
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("read-only"), "{body}");
    assert_eq!(d.get("s1").await.state, pb::State::Ready as i32);

    // What-if: the page's answer is Place's, in its words.
    let place = d
        .client
        .place(pb::PlaceRequest {
            workload: "big".into(),
            on_full: 0,
            ..Default::default()
        })
        .await
        .expect("place")
        .into_inner();
    b.text("#whatif-workload", "big").await;
    b.run(&[
        "js",
        "(document.querySelector('#whatif-workload').value = 'big', true)",
    ])
    .await;
    b.run(&["click", "#whatif button[type=submit]"]).await;
    // big (8 GB) beside s1 (4 GB) in 10 GB, and the page's Place refuses
    // (policy refuse): refused, and the page says why in Place's words.
    assert!(!place.admitted, "big does not fit beside s1: {place:?}");
    b.text("#whatif-answer", "would be refused").await;
    b.text("#whatif-answer .why", &place.refusals[0].message)
        .await;
    b.text("#whatif-answer .why", "held by s1 (small) 4.0 GB")
        .await;
    // And an admitted one: small (4 GB) fits beside s1 as the node is.
    let place = d
        .client
        .place(pb::PlaceRequest {
            workload: "small".into(),
            on_full: 0,
            ..Default::default()
        })
        .await
        .expect("place")
        .into_inner();
    assert!(place.admitted && place.evict.is_empty(), "{place:?}");
    b.run(&[
        "js",
        "(document.querySelector('#whatif-workload').value = 'small', true)",
    ])
    .await;
    b.run(&["click", "#whatif button[type=submit]"]).await;
    b.text("#whatif-answer", "A start of small would be admitted")
        .await;
    b.text("#whatif-answer", "It fits as the node is.").await;
    // Nothing was started by asking.
    assert_eq!(d.ids().await, ["s1"]);
    let shots = tempfile::tempdir().expect("a temporary directory");
    b.shot(shots.path(), "what-if.png").await;
    drop(r);

    // Turned on: a wrong token is refused; the right one stops and starts,
    // each a call of the router's that the agent audits.
    let token = "console-test-token";
    let r = router_with(&d.socket, Some(token)).await;
    b.run(&["open", &format!("{}/ui", r.base)]).await;
    b.text("#mode", "Actions on").await;
    b.text("#instances tr[data-id=\"s1\"] td.tools", "stop")
        .await;
    b.run(&[
        "js",
        "(document.querySelector('#token').value = 'wrong', true)",
    ])
    .await;
    b.run(&[
        "click",
        "#instances tr[data-id=\"s1\"] button[data-action=stop]",
    ])
    .await;
    b.text("#act-answer", "token").await;
    assert_eq!(
        b.run(&["js", "document.querySelector('#act-answer').dataset.status"])
            .await["value"],
        "401"
    );
    assert_eq!(d.get("s1").await.state, pb::State::Ready as i32);
    b.run(&[
        "js",
        &format!("(document.querySelector('#token').value = '{token}', true)"),
    ])
    .await;
    b.run(&[
        "click",
        "#instances tr[data-id=\"s1\"] button[data-action=stop]",
    ])
    .await;
    b.text("#act-answer", "stop s1: ").await;
    d.wait_state("s1", pb::State::Exited).await;
    b.text("#instances tr[data-id=\"s1\"]", "EXITED").await;
    b.run(&[
        "js",
        "(document.querySelector('#whatif-workload').value = 'small', true)",
    ])
    .await;
    b.run(&["click", "#start"]).await;
    // The id a start on demand gets: the workload's name.
    b.text("#act-answer", "start small: ").await;
    let started = d.wait_state("small", pb::State::Ready).await;
    assert_eq!(started.workload, "small");
    // Stopped and started again from the page: the new run takes the
    // ended one's row, none is left beside it.
    b.run(&[
        "click",
        "#instances tr[data-id=\"small\"] button[data-action=stop]",
    ])
    .await;
    d.wait_state("small", pb::State::Exited).await;
    b.text("#instances tr[data-id=\"small\"]", "EXITED").await;
    b.run(&["click", "#start"]).await;
    d.wait_state("small", pb::State::Ready).await;
    b.text("#instances tr[data-id=\"small\"]", "READY").await;
    let rows = "[...document.querySelectorAll('#instances tbody tr')].filter(r => r.dataset.workload === 'small').map(r => r.dataset.id + ' ' + r.dataset.state)";
    let rows = b.run(&["js", rows]).await;
    assert_eq!(
        rows["value"],
        serde_json::json!(["s1 EXITED", "small READY"]),
        "one row per instance id"
    );
    let mut ids = d.ids().await;
    ids.sort();
    assert_eq!(ids, ["s1", "small"], "nothing started beside small");
    let log = d.log();
    let audited = |rpc: &str, id: &str| {
        log.lines().any(|l| {
            l.contains(" audit: ")
                && l.contains(&format!("rpc=\"{rpc}\""))
                && l.contains("outcome=\"ok\"")
                && l.contains(id)
        })
    };
    assert!(audited("Stop", "s1"), "the Stop is audited: {log}");
    assert!(
        audited("Start", &started.instance_id),
        "the Start is audited: {log}"
    );
    b.text("#instances tr[data-state=\"READY\"]", "small").await;
    b.shot(shots.path(), "actions-on.png").await;
    if std::env::var_os("RESIDENT_KEEP_SHOTS").is_some() {
        println!("screenshots kept in {}", shots.keep().display());
    }
}

#[tokio::test]
async fn the_buttons_are_on_screen_at_1280_px_with_a_models_long_name() {
    // An instance as a router starts one on demand: its id is its
    // workload's name, here a model's as people write them.
    let name = "qwen2.5-coder-32b-instruct-q4_k_m";
    let config = format!("{}{}", pool("gpu0", "40GB"), sleeper(name, "gpu0", 20, ""));
    let mut d = Daemon::start(&config).await;
    d.started(name, name).await;
    let r = router_with(&d.socket, Some("console-test-token")).await;
    let Some(mut b) = Browser::start().await else {
        return;
    };
    b.run(&["size", "1280", "900"]).await;
    b.run(&["open", &format!("{}/ui", r.base)]).await;
    b.text("#mode", "Actions on").await;
    let row = format!("#instances tr[data-id=\"{name}\"]");
    b.text(&row, "READY").await;
    // Inside the table's frame, unscrolled, and each the element at its
    // own centre (nothing drawn over it).
    let seen = b
        .run(&["js", &BUTTONS_ON_SCREEN.replace("ROW", name)])
        .await;
    let seen: Value = serde_json::from_str(seen["value"].as_str().expect("JSON")).expect("JSON");
    let buttons = seen["buttons"].as_array().expect("buttons");
    assert!(
        seen["width"].as_f64() <= Some(1280.0) && seen["scroll_left"] == 0,
        "{seen}"
    );
    let texts: Vec<&str> = buttons.iter().filter_map(|b| b["text"].as_str()).collect();
    assert_eq!(texts, ["logs", "stop", "sleep"], "{seen}");
    for button in buttons {
        assert_eq!(
            (&button["inside"], &button["on_top"]),
            (&Value::Bool(true), &Value::Bool(true)),
            "a button off screen at 1280 px: {seen}"
        );
    }
    let shots = tempfile::tempdir().expect("a temporary directory");
    b.shot(shots.path(), "actions-1280.png").await;
    if std::env::var_os("RESIDENT_KEEP_SHOTS").is_some() {
        println!("screenshots kept in {}", shots.keep().display());
    }
}

#[tokio::test]
async fn the_page_puts_a_server_to_sleep_and_wakes_it() {
    // The vLLM stand-in of the sleep tests, READY as `b`.
    let (mut d, _) = crate::sleep::big_ready("").await;
    let token = "console-test-token";
    let r = router_with(&d.socket, Some(token)).await;
    let Some(mut b) = Browser::start().await else {
        return;
    };
    b.run(&["open", &format!("{}/ui", r.base)]).await;
    b.text("#mode", "Actions on").await;
    b.run(&[
        "js",
        &format!("(document.querySelector('#token').value = '{token}', true)"),
    ])
    .await;
    b.run(&[
        "click",
        "#instances tr[data-id=\"b\"] button[data-action=sleep]",
    ])
    .await;
    b.text("#act-answer", "sleep b: SLEEPING").await;
    b.text("#instances tr[data-id=\"b\"]", "SLEEPING").await;
    assert_eq!(d.get("b").await.state, pb::State::Sleeping as i32);
    // Asleep, its residue in the pool is drawn as a sleeper's.
    b.text(
        "[data-pool=\"gpu\"] .legend [data-state=\"SLEEPING\"]",
        "b (asleep)",
    )
    .await;
    b.run(&[
        "click",
        "#instances tr[data-id=\"b\"] button[data-action=wake]",
    ])
    .await;
    b.text("#act-answer", "wake b: ").await;
    d.wait_state("b", pb::State::Ready).await;
    b.text("#instances tr[data-id=\"b\"]", "READY").await;
    let log = d.log();
    let audited = |rpc: &str| {
        log.lines()
            .filter(|l| {
                l.contains(" audit: ")
                    && l.contains(&format!("rpc=\"{rpc}\""))
                    && l.contains("instance_id=\"b\"")
                    && l.contains("outcome=\"ok\"")
            })
            .count()
    };
    assert_eq!(audited("Sleep"), 1, "the page's Sleep is audited: {log}");
    // The first Start began it; the page's wake is the second.
    assert_eq!(audited("Start"), 2, "the page's wake is audited: {log}");
}
