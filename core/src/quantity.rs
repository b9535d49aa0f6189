//! Kubernetes resource quantities (`"8"`, `"500m"`, `"64Gi"`, `"1e3"`), parsed exactly.
//!
//! Values are kept in milli-units as `i128` so that `"0.5"`, `"500m"` and `"1Ki"` are all exact and
//! nothing is rounded silently: callers decide whether a fraction is an error.

use std::fmt;

/// A parsed quantity in thousandths of the base unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Quantity {
    milli: i128,
}

/// Why a quantity string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("empty quantity")]
    Empty,
    #[error("{0:?} is not a Kubernetes quantity (expected e.g. \"8\", \"500m\", \"64Gi\")")]
    Malformed(String),
    #[error("{0:?} is too large")]
    Overflow(String),
}

impl Quantity {
    pub fn from_milli(milli: i128) -> Self {
        Self { milli }
    }

    pub fn milli(self) -> i128 {
        self.milli
    }

    /// The value as a whole number, or `None` when it has a fractional part.
    pub fn as_integer(self) -> Option<i128> {
        (self.milli % 1000 == 0).then_some(self.milli / 1000)
    }

    /// The value rounded up to a whole number (Kubernetes rounds requests up).
    pub fn ceil_integer(self) -> i128 {
        self.milli.div_euclid(1000) + i128::from(self.milli.rem_euclid(1000) != 0)
    }

    pub fn is_negative(self) -> bool {
        self.milli < 0
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.as_integer() {
            Some(v) => write!(f, "{v}"),
            None => write!(f, "{}m", self.milli),
        }
    }
}

impl std::str::FromStr for Quantity {
    type Err = QuantityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse(s)
    }
}

/// Parses a quantity the way the API server does: sign, decimal number, then one binary suffix
/// (`Ki`..`Ei`), decimal suffix (`n`, `u`, `m`, `k`, `M`..`E`) or exponent (`e3`, `E-2`).
/// Sub-milli values round up, as Kubernetes does for requests.
pub fn parse(input: &str) -> Result<Quantity, QuantityError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(QuantityError::Empty);
    }
    let malformed = || QuantityError::Malformed(input.to_string());
    let overflow = || QuantityError::Overflow(input.to_string());

    let (negative, body) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let num_end = body.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(body.len());
    let (number, suffix) = body.split_at(num_end);
    if number.is_empty() || number == "." || number.matches('.').count() > 1 {
        return Err(malformed());
    }
    let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
    if int_part.len() + frac_part.len() > 30 {
        return Err(overflow());
    }
    // mantissa * 10^-frac_digits, as an integer
    let digits = format!("{int_part}{frac_part}");
    let mantissa: i128 = digits.parse().map_err(|_| malformed())?;
    let mut exp10: i32 = -(frac_part.len() as i32);
    let mut multiplier: i128 = 1;
    match suffix {
        "" => {}
        "Ki" => multiplier = 1 << 10,
        "Mi" => multiplier = 1 << 20,
        "Gi" => multiplier = 1 << 30,
        "Ti" => multiplier = 1 << 40,
        "Pi" => multiplier = 1 << 50,
        "Ei" => multiplier = 1 << 60,
        "n" => exp10 -= 9,
        "u" => exp10 -= 6,
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        _ => {
            let rest = suffix.strip_prefix('e').or_else(|| suffix.strip_prefix('E')).ok_or_else(malformed)?;
            let e: i32 = rest.parse().map_err(|_| malformed())?;
            if !(-40..=40).contains(&e) {
                return Err(overflow());
            }
            exp10 += e;
        }
    }
    // Convert to milli-units: value * 1000 = mantissa * multiplier * 10^(exp10 + 3)
    let mut value = mantissa.checked_mul(multiplier).ok_or_else(overflow)?;
    let shift = exp10 + 3;
    if shift >= 0 {
        let factor = 10i128.checked_pow(shift as u32).ok_or_else(overflow)?;
        value = value.checked_mul(factor).ok_or_else(overflow)?;
    } else {
        let factor = 10i128.checked_pow((-shift) as u32).ok_or_else(overflow)?;
        // round up (away from zero for the magnitude) like the API server does for requests
        value = value / factor + i128::from(value % factor != 0);
    }
    if value > i128::from(i64::MAX) * 1000 {
        return Err(overflow());
    }
    Ok(Quantity::from_milli(if negative { -value } else { value }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> i128 {
        parse(s).unwrap().milli()
    }

    #[test]
    fn parses_plain_and_suffixed_values() {
        assert_eq!(q("8"), 8000);
        assert_eq!(q("500m"), 500);
        assert_eq!(q("0.5"), 500);
        assert_eq!(q("64Gi"), 64 * (1 << 30) * 1000);
        assert_eq!(q("1k"), 1_000_000);
        assert_eq!(q("1e3"), 1_000_000);
        assert_eq!(q("-3"), -3000);
        assert_eq!(q("1n"), 1);
        assert_eq!(q("+2"), 2000);
    }

    #[test]
    fn integer_view_refuses_fractions() {
        assert_eq!(parse("2").unwrap().as_integer(), Some(2));
        assert_eq!(parse("2.5").unwrap().as_integer(), None);
        assert_eq!(parse("2500m").unwrap().ceil_integer(), 3);
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["", "abc", "1.2.3", "Gi", "1Zi", "1e", "--1", "."] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(matches!(parse("99999999999999999999999999999Ei"), Err(QuantityError::Overflow(_))));
    }
}
