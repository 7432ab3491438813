//! Any text as a configuration file: parsed or refused with an error that
//! names the file, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = resident_config::parse(std::path::Path::new("fuzz.toml"), text) {
        assert!(e.to_string().starts_with("fuzz.toml"), "{e}");
    }
});
