//! Prometheus text-format primitives for the extender's `/metrics` ([`crate::scheduler::metrics`]):
//! a family's `HELP` and `TYPE` lines, a one-value gauge, and label-value escaping.

use std::borrow::Cow;
use std::fmt::Write as _;

/// A family's `# HELP` and `# TYPE` lines.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A gauge family of one unlabelled series.
pub fn gauge(out: &mut String, name: &str, help: &str, value: impl std::fmt::Display) {
    header(out, name, "gauge", help);
    let _ = writeln!(out, "{name} {value}");
}

/// A label value as the text format wants it: backslash, double quote and newline escaped.
pub fn escape(v: &str) -> Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return Cow::Borrowed(v);
    }
    Cow::Owned(v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_escaped_and_a_gauge_is_one_family() {
        assert_eq!(escape("a\"b\\c\nd"), r#"a\"b\\c\nd"#);
        assert!(matches!(escape("plain"), Cow::Borrowed("plain")));
        let mut out = String::new();
        gauge(&mut out, "x_ready", "1 when ready.", 1);
        assert_eq!(out, "# HELP x_ready 1 when ready.\n# TYPE x_ready gauge\nx_ready 1\n");
    }
}
