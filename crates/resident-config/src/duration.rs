//! Durations as operators write them: `10s`, `500ms`, `2m`, `1h`, `1.5s`.

use std::time::Duration;

/// Parses a duration with a unit (`ms`, `s`, `m`, `h`). Errors say what was
/// expected; the caller names the key.
pub fn parse_duration(input: &str) -> Result<Duration, String> {
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let scale = match unit.trim() {
        "ms" => 0.001,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "" => {
            return Err(format!(
                "{input:?} has no unit (write e.g. \"10s\" or \"500ms\")"
            ));
        }
        other => {
            return Err(format!(
                "unknown unit {other:?} in {input:?} (use ms, s, m or h)"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{input:?} is not a duration (write e.g. \"10s\" or \"500ms\")"))?;
    let secs = value * scale;
    if !secs.is_finite() || secs > 10.0 * 365.0 * 86400.0 {
        return Err(format!("duration {input:?} is too long"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_operators_write() {
        let ok = [
            ("10s", 10_000),
            ("500ms", 500),
            ("2m", 120_000),
            ("1h", 3_600_000),
            ("0s", 0),
            ("1.5s", 1_500),
        ];
        for (text, ms) in ok {
            assert_eq!(
                parse_duration(text),
                Ok(Duration::from_millis(ms)),
                "{text}"
            );
        }
        for bad in ["10", "ten s", "5 days", "-1s", "", "1e999s"] {
            assert!(parse_duration(bad).is_err(), "{bad} should be refused");
        }
    }
}
