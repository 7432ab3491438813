//! Any text as a byte quantity: a value or an error, never a panic; a value
//! written back in bytes parses to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(bytes) = resident_core::parse_bytes(text) {
        assert_eq!(resident_core::parse_bytes(&bytes.to_string()), Ok(bytes));
    }
});
