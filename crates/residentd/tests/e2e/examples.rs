//! The examples run as shipped: `examples/router-llama.toml` with real
//! llama.cpp servers (llama-server and llama-cpp-python, by their flavors)
//! behind residentd-router, only its paths pointed at this machine's
//! servers, models the test writes and a temporary socket and state; and
//! the README's five-minute tour, as written, on the embedded example.

use std::time::Duration;

use resident_api::pb;

use crate::llama::{llama_server_bin, make_model, python, settled};
use crate::router::{post, raw};
use crate::support::*;

/// `text` with each `(from, to)` replaced, every `from` found.
fn pointed(text: &str, paths: &[(&str, String)]) -> String {
    let mut out = text.to_string();
    for (from, to) in paths {
        assert!(out.contains(from), "the example names {from}");
        out = out.replace(from, to);
    }
    out
}

/// The instance of `workload` the router started, once its memory has
/// settled after its first request: what it reserved, and the instance.
async fn settled_instance(d: &mut Daemon, workload: &str) -> (u64, pb::Instance) {
    let list = d.list().await;
    let id = list
        .iter()
        .find(|i| i.workload == workload)
        .map(|i| i.instance_id.clone())
        .unwrap_or_else(|| panic!("no instance of {workload}: {list:?}"));
    let held = settled(d, &id).await;
    // A sample past the one that settled: the agent has compared it with
    // the reservation.
    let i = d.get(&id).await;
    (held, i)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_llama_example_answers_each_first_request_within_its_reservation() {
    let (Some(python), Some(bin)) = (python(), llama_server_bin()) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let models = dir.path().join("models");
    std::fs::create_dir(&models).expect("models/");
    // Tiny LLaMA models under the example's file names.
    for (name, embd, layers) in [
        ("qwen2.5-7b-instruct-q4_k_m.gguf", 256, 4),
        ("qwen2.5-coder-14b-q4_k_m.gguf", 256, 4),
        ("nomic-embed-text-v1.5.f16.gguf", 128, 2),
    ] {
        make_model(&python, &models.join(name), embd, layers);
    }
    let venv_bin = python.parent().expect("the venv's bin");
    let text = std::fs::read_to_string(workspace().join("examples/router-llama.toml"))
        .expect("the example");
    let config = pointed(
        &text,
        &[
            (
                "unix:///run/residentd/residentd.sock",
                format!("unix://{}/agent.sock", dir.path().display()),
            ),
            (
                "\"/var/lib/residentd\"",
                format!("\"{}/state\"", dir.path().display()),
            ),
            (
                "/usr/local/bin/llama-server",
                bin.join("llama-server").display().to_string(),
            ),
            (
                "/opt/llama/bin/python3",
                venv_bin.join("python3").display().to_string(),
            ),
            ("/models/", format!("{}/", models.display())),
        ],
    );
    let file = dir.path().join("residentd.toml");
    std::fs::write(&file, &config).expect("write the config");
    // Valid here, every workload by its flavor with its overhead reserved.
    let out = std::process::Command::new(RESIDENTD)
        .arg("--check-config")
        .arg(&file)
        .output()
        .expect("--check-config");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    println!("{said}");
    assert!(out.status.success(), "{said}");
    assert_eq!(said.matches("+ overhead ").count(), 3, "{said}");
    let mut d = Daemon::start_in(dir).await;
    let r = serve_router(
        &d.socket.display().to_string(),
        None,
        Duration::from_secs(300),
        None,
    )
    .await;
    // Each model's first request, by the names OpenAI clients use: the
    // router starts it on demand.
    let requests = [
        (
            "qwen2.5-7b-instruct",
            "/v1/chat/completions",
            r#"{"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}"#,
        ),
        (
            "qwen2.5-coder-14b",
            "/v1/completions",
            r#"{"model": "coder", "prompt": "hello", "max_tokens": 4}"#,
        ),
        (
            "nomic-embed-text",
            "/v1/embeddings",
            r#"{"model": "text-embedding-3-small", "input": "hello"}"#,
        ),
    ];
    for (workload, path, body) in requests {
        let (status, _, answer) = raw(r.port, &post(path, body)).await;
        assert_eq!(status, 200, "{workload} {path}: {answer}");
        let (held, i) = settled_instance(&mut d, workload).await;
        println!(
            "{workload}: reserved {} bytes, held {held} bytes: {}",
            i.reserved_bytes, i.message
        );
        let over: u64 = i.demand.iter().map(|p| p.overrun_bytes).sum();
        assert!(
            over == 0 && !i.message.contains("OVERRUN"),
            "{workload} overran its reservation after its first request: {i:?}"
        );
        let reserved: u64 = i.demand.iter().map(|p| p.reserved_bytes).sum();
        assert!(
            held <= reserved,
            "{workload}: held {held}, reserved {reserved}"
        );
    }
    drop(r);
    assert!(d.terminate().await.success(), "{}", d.log());
}

/// The README's five-minute tour, line by line as written, on the
/// embedded example (`cargo run -p residentd`): each residentctl line
/// exits as its comment says (0, or 3 where it says "exit 3"), a line that
/// follows an instance's log follows one that still runs (the tour once
/// followed `a`, which the line before had evicted), and the Python
/// equivalent of grpcurl's Place answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_tour_runs_as_written_on_the_embedded_example() {
    let readme = std::fs::read_to_string(workspace().join("README.md")).expect("README.md");
    let tour: Vec<&str> = readme
        .lines()
        .skip_while(|l| !l.starts_with("## A five-minute tour"))
        .take_while(|l| !l.starts_with("The pool is host-bound"))
        .filter_map(|l| l.strip_prefix("    residentctl "))
        .collect();
    assert!(tour.len() >= 10, "the tour: {tour:?}");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut d = crate::shutdown::embedded(dir).await;
    for line in tour {
        let (command, comment) = line
            .split_once('#')
            .map_or((line.trim(), ""), |(c, m)| (c.trim(), m.trim()));
        let mut args: Vec<&str> = command.split_whitespace().collect();
        // Live views run until interrupted.
        if args.iter().any(|a| ["watch", "top"].contains(a)) {
            continue;
        }
        if args.contains(&"-f") {
            args.retain(|a| *a != "-f");
            let id = args[1];
            let followed = d.get(id).await;
            let live = [pb::State::Starting as i32, pb::State::Ready as i32];
            assert!(
                live.contains(&followed.state),
                "`residentctl {command}` follows {id}, which no longer runs: {followed:?}"
            );
        }
        let socket = d.socket.clone();
        let owned: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let out = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = owned.iter().map(String::as_str).collect();
            residentctl(&socket, &args)
        })
        .await
        .expect("joined");
        let want = if comment.contains("exit 3") { 3 } else { 0 };
        assert_eq!(
            out.status.code(),
            Some(want),
            "`residentctl {command}`: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // grpcurl's Place, from Python.
    let python_line = readme
        .lines()
        .find_map(|l| l.strip_prefix("    .venv/bin/python -c "))
        .expect("the README's Python equivalent of grpcurl");
    if let Some(python) = venv_python("the README's Python client line") {
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{} -c {python_line}", python.display()))
            .env("RESIDENTD_SOCKET", &d.socket)
            .output()
            .expect("sh");
        let said = String::from_utf8_lossy(&out.stdout);
        // A Placement: admitted, or refused with its reasons (the text
        // format leaves `admitted: false` out).
        assert!(
            out.status.success() && (said.contains("admitted") || said.contains("refusals")),
            "{said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(d.terminate().await.success(), "{}", d.log());
}
