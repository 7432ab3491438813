//! A child process for the supervisor's tests. Each argument is a step,
//! run in order:
//!
//! - `sleep=MS`: sleep
//! - `exit=N`: exit with code N
//! - `ignore-term`: ignore SIGTERM from now on
//! - `grandchild`: fork a child that sleeps forever in the same group,
//!   and print its pid as `grandchild=PID`
//! - `escapee`: fork a child that leaves the group (`setsid()`) and
//!   sleeps forever, and print its pid as `escapee=PID`
//! - `escapee-alloc=MB`: the same, and the escapee allocates MB first
//! - `setsid`: start a new session (leave the process group)
//! - `alloc=MB`: allocate and touch MB megabytes, keep them
//! - `http=PATH,LOADING_MS`: serve `GET PATH` on 127.0.0.1:$PORT, 503
//!   for LOADING_MS, 200 after; never returns
//! - `flood=MBPS,SECS`: write MBPS megabytes per second of lines to stdout
//! - `print=TEXT`: print TEXT to stdout, `eprint=TEXT` to stderr
//! - `env=NAME`: print `NAME=value` (or `NAME unset`)
//! - `fds`: print `fds` and the numbers of its open descriptors
//! - `forever`: sleep until killed
//!
//! Written with std only, so it starts in a millisecond.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

fn main() {
    let mut kept: Vec<Vec<u8>> = Vec::new();
    for step in std::env::args().skip(1) {
        let (name, value) = step.split_once('=').unwrap_or((step.as_str(), ""));
        match name {
            "sleep" => std::thread::sleep(Duration::from_millis(value.parse().unwrap_or(0))),
            "exit" => std::process::exit(value.parse().unwrap_or(1)),
            "ignore-term" => ignore_term(),
            "grandchild" => grandchild(&["forever"], "grandchild"),
            "escapee" => grandchild(&["setsid", "forever"], "escapee"),
            "escapee-alloc" => {
                grandchild(&["setsid", &format!("alloc={value}"), "forever"], "escapee")
            }
            "setsid" => {
                let _ = nix::unistd::setsid();
            }
            "alloc" => kept.push(touch(value.parse().unwrap_or(0))),
            "http" => serve(value),
            "flood" => flood(value),
            "print" => println!("{value}"),
            "eprint" => eprintln!("{value}"),
            "fds" => println!("fds {}", open_fds()),
            "env" => match std::env::var(value) {
                Ok(v) => println!("{value}={v}"),
                Err(_) => println!("{value} unset"),
            },
            "forever" => loop {
                std::thread::sleep(Duration::from_secs(3600));
            },
            other => {
                eprintln!("testchild: unknown step {other:?}");
                std::process::exit(64);
            }
        }
        let _ = std::io::stdout().flush();
    }
    drop(kept);
}

fn ignore_term() {
    // SAFETY: SIG_IGN is a valid disposition for SIGTERM.
    unsafe {
        let _ = nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGTERM,
            nix::sys::signal::SigHandler::SigIgn,
        );
    }
}

fn grandchild(steps: &[&str], label: &str) {
    let mut child = std::process::Command::new(std::env::current_exe().expect("own path"))
        .args(steps)
        .spawn()
        .expect("fork a grandchild");
    println!("{label}={}", child.id());
    // Not waited for: it must outlive this step.
    let _ = child.stdin.take();
    std::mem::forget(child);
}

fn touch(mb: usize) -> Vec<u8> {
    let mut v = vec![0u8; mb << 20];
    for i in (0..v.len()).step_by(4096) {
        v[i] = 1;
    }
    println!("allocated={mb}");
    v
}

fn serve(value: &str) {
    let (path, loading_ms) = value.split_once(',').unwrap_or((value, "0"));
    let loading = Duration::from_millis(loading_ms.parse().unwrap_or(0));
    let port: u16 = std::env::var("PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .expect("PORT set");
    let listener = TcpListener::bind(("127.0.0.1", port)).expect("bind PORT");
    let started = Instant::now();
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let mut buf = [0u8; 1024];
        let n = conn.read(&mut buf).unwrap_or(0);
        let asked = String::from_utf8_lossy(&buf[..n]);
        let wanted = asked.split_whitespace().nth(1) == Some(path);
        let status = match (wanted, started.elapsed() >= loading) {
            (true, true) => "200 OK",
            (true, false) => "503 Service Unavailable",
            (false, _) => "404 Not Found",
        };
        let _ = write!(
            conn,
            "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
    }
}

fn flood(value: &str) {
    let (mbps, secs) = value.split_once(',').unwrap_or((value, "1"));
    let rate: usize = mbps.parse::<usize>().unwrap_or(1) << 20;
    let secs: u64 = secs.parse().unwrap_or(1);
    let line = format!("{}\n", "x".repeat(99));
    let started = Instant::now();
    let mut out = std::io::stdout().lock();
    let mut written = 0usize;
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(secs) {
        n += 1;
        let _ = write!(out, "{n:08} {line}");
        written += line.len() + 9;
        // Pace to the rate: ahead of schedule, sleep a little.
        let due = Duration::from_secs_f64(written as f64 / rate as f64);
        let ahead = due.saturating_sub(started.elapsed());
        if !ahead.is_zero() {
            let _ = out.flush();
            std::thread::sleep(ahead);
        }
    }
    let _ = writeln!(out, "flood done {n}");
}

/// The numbers of this process's open descriptors, space-separated, in
/// order (the one that reads the directory left out).
fn open_fds() -> String {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return "unreadable".into();
    };
    let mut fds: Vec<u32> = dir
        .flatten()
        .filter(|e| {
            // The directory's own descriptor links to the directory.
            std::fs::read_link(e.path())
                .is_ok_and(|target| !target.to_string_lossy().ends_with("/fd"))
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    fds.sort_unstable();
    fds.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}
