//! How a test says it cannot run here. Included by the supervisor's test
//! support, by residentd's e2e support and by the router's binary test
//! (`#[path]`), so all report
//! skips alike.

use std::io::Write as _;

/// Says that the calling test, or the part of it `why` names, cannot run
/// on this machine: the line `SKIPPED: <test>: <why>` on stdout and,
/// where `RESIDENT_SKIPPED` names a file, appended to it. cargo test shows
/// a passing test's stdout only with `--nocapture`, so `scripts/test` sets
/// the file and prints what it collected after the run; `.ci/run` counts
/// those lines. libtest names each test's thread after the test.
pub fn skip(why: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let line = format!("SKIPPED: {test}: {why}");
    println!("{line}");
    if let Some(path) = std::env::var_os("RESIDENT_SKIPPED") {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("the RESIDENT_SKIPPED file");
        // One write, so that lines of tests running side by side stay whole.
        file.write_all(format!("{line}\n").as_bytes())
            .expect("write the RESIDENT_SKIPPED file");
    }
}
