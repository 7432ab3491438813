//! Byte quantities: parsing the operator's `"9.5GB"` / `"512MiB"` and
//! printing decimal gigabytes the way refusal texts show them.

use std::fmt;

/// Bytes in a decimal gigabyte, the unit of every human-facing figure.
pub const GB: u64 = 1_000_000_000;

/// Why a byte quantity could not be read. Each variant carries the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    /// Nothing to read.
    #[error("empty byte quantity")]
    Empty,
    /// A minus sign: memory is never negative.
    #[error("negative byte quantity {0:?}")]
    Negative(String),
    /// The number part is not a plain decimal (covers NaN, inf, exponents).
    #[error(
        "{0:?} is not a number of bytes (expected digits, an optional fraction and a unit such as GB or MiB)"
    )]
    NotANumber(String),
    /// The suffix is not one we know.
    #[error("unknown unit {unit:?} in {input:?} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)")]
    UnknownUnit {
        /// The whole input.
        input: String,
        /// The suffix that was not recognised.
        unit: String,
    },
    /// The value does not fit in 64 bits of bytes.
    #[error("byte quantity {0:?} is too large")]
    Overflow(String),
}

/// The multiplier for a unit suffix, matched case-insensitively.
fn multiplier(unit: &str) -> Option<u64> {
    const K: u64 = 1_000;
    const KI: u64 = 1_024;
    let m = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => K,
        "m" | "mb" => K.pow(2),
        "g" | "gb" => K.pow(3),
        "t" | "tb" => K.pow(4),
        "kib" => KI,
        "mib" => KI.pow(2),
        "gib" => KI.pow(3),
        "tib" => KI.pow(4),
        _ => return None,
    };
    Some(m)
}

/// Parses a byte quantity: a plain integer (bytes) or a decimal number with
/// a unit: `96GB`, `9.5GB`, `512MB`, `512MiB`, `1TB`, `4096`. Decimal units
/// are powers of 1000, `i` units powers of 1024. A fraction of a byte is
/// rounded to the nearest byte. Arithmetic is exact (no floating point).
pub fn parse_bytes(input: &str) -> Result<u64, UnitError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(UnitError::Empty);
    }
    if s.starts_with('-') {
        return Err(UnitError::Negative(input.to_string()));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let unit = unit.trim_start();
    let not_a_number = || UnitError::NotANumber(input.to_string());
    let mult = match multiplier(unit) {
        Some(m) => m,
        // A suffix that starts like "nan", "inf" or "e9" with no digits
        // before it is a malformed number rather than a unit.
        None if number.is_empty() => return Err(not_a_number()),
        None => {
            return Err(UnitError::UnknownUnit {
                input: input.to_string(),
                unit: unit.to_string(),
            });
        }
    };
    let number = number.replace('_', "");
    let (int, frac) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number.as_str(), ""),
    };
    if (int.is_empty() && frac.is_empty()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(not_a_number());
    }
    let overflow = || UnitError::Overflow(input.to_string());
    let int_value: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| overflow())?
    };
    let mut total = int_value
        .checked_mul(u128::from(mult))
        .ok_or_else(overflow)?;
    if !frac.is_empty() {
        // Only the digits that can matter: 20 fractional digits exceed the
        // precision of any multiplier we have.
        let digits = &frac[..frac.len().min(20)];
        let scale = 10u128.pow(digits.len() as u32);
        let frac_value: u128 = digits.parse().map_err(|_| not_a_number())?;
        let scaled = frac_value * u128::from(mult);
        total = total
            .checked_add((scaled + scale / 2) / scale)
            .ok_or_else(overflow)?;
    }
    u64::try_from(total).map_err(|_| overflow())
}

/// A byte count shown as decimal gigabytes with one decimal: `55.0 GB`;
/// where that would read as zero for bytes that are not, megabytes with
/// one decimal (`21.6 MB`), and below a twentieth of a megabyte the bytes
/// themselves (`4096 B`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gb(pub u64);

impl fmt::Display for Gb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Integer arithmetic rounds half up, like `{:.1}` would for any
        // figure a float could carry exactly, and never loses precision.
        let tenths_of =
            |unit: u64| (u128::from(self.0) + u128::from(unit / 20)) / u128::from(unit / 10);
        let (tenths, unit) = match (tenths_of(GB), tenths_of(GB / 1000)) {
            (0, 0) if self.0 > 0 => return write!(f, "{} B", self.0),
            (0, mb) if self.0 > 0 => (mb, "MB"),
            (gb, _) => (gb, "GB"),
        };
        write!(f, "{}.{} {unit}", tenths / 10, tenths % 10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, expect: Result<u64, &str>) {
        let got = parse_bytes(input).map_err(|e| e.to_string());
        match (got, expect) {
            (Ok(g), Ok(e)) => assert_eq!(g, e, "{input}"),
            (Err(g), Err(e)) => assert!(g.contains(e), "{input}: {g:?} lacks {e:?}"),
            (g, e) => panic!("{input}: got {g:?}, expected {e:?}"),
        }
    }

    #[test]
    fn parses_the_forms_operators_write() {
        check("96GB", Ok(96 * GB));
        check("9.5GB", Ok(9_500_000_000));
        check("512MB", Ok(512_000_000));
        check("512MiB", Ok(512 * 1024 * 1024));
        check("1TB", Ok(1_000 * GB));
        check("4096", Ok(4096));
        check(" 2 GB ", Ok(2 * GB));
        check("2gb", Ok(2 * GB));
        check(".5GB", Ok(GB / 2));
        check("1_000B", Ok(1000));
        check("1.5B", Ok(2));
        check("0", Ok(0));
        check("0.1KiB", Ok(102));
        check("18446744073709551615", Ok(u64::MAX));
        check("16EiB", Err("unknown unit \"EiB\" in \"16EiB\""));
    }

    #[test]
    fn refuses_what_is_not_a_quantity_and_names_it() {
        check("", Err("empty"));
        check("-5GB", Err("negative byte quantity \"-5GB\""));
        check("NaN", Err("\"NaN\" is not a number"));
        check("inf", Err("\"inf\" is not a number"));
        check("1e9", Err("unknown unit \"e9\""));
        check("5XB", Err("unknown unit \"XB\" in \"5XB\""));
        check("1.2.3GB", Err("not a number"));
        check(".GB", Err("not a number"));
        check("18446744073709551616", Err("too large"));
        check("20000000000GB", Err("too large"));
        check(
            "99999999999999999999999999999999999999999",
            Err("too large"),
        );
    }

    #[test]
    fn prints_decimal_gigabytes_with_one_decimal() {
        let cases = [
            (0, "0.0 GB"),
            (55 * GB, "55.0 GB"),
            (9_500_000_000, "9.5 GB"),
            (32 * GB, "32.0 GB"),
            // Small figures are not shown as zeros.
            (49_999_999, "50.0 MB"),
            (21_600_000, "21.6 MB"),
            (49_999, "49999 B"),
            (50_000, "0.1 MB"),
            (50_000_000, "0.1 GB"),
            (u64::MAX, "18446744073.7 GB"),
        ];
        for (bytes, text) in cases {
            assert_eq!(Gb(bytes).to_string(), text, "{bytes}");
        }
    }
}
