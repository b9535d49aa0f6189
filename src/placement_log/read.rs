//! Reading placement logs back (docs/placement-log.md): `gpuplace report` and the simulator's
//! `--from-placement-log` what-if. JSON Lines; every problem names the file and the line.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::placement_log::{Decision, FIELDS, PLACEMENT_LOG_VERSION};

/// Why an input could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("{path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: no {what} in it (the file is empty)")]
    Empty { path: PathBuf, what: &'static str },
    #[error("{path}, line {line}: {why}")]
    Line { path: PathBuf, line: usize, why: String },
}

/// A decision and the line it came from (1-based).
#[derive(Debug, Clone, PartialEq)]
pub struct LogLine {
    pub line: usize,
    pub decision: Decision,
}

/// Each line of `text` that holds something (blank lines, a trailing newline or one added by hand,
/// are skipped) through `parse`, given its 1-based number; its error becomes the file's and the
/// line's. At least one line, or the file counts as empty of `what`. The JSON Lines inputs of
/// `report` and `simulate` all read this way.
pub(crate) fn parse_lines<T>(
    path: &Path,
    text: &str,
    what: &'static str,
    mut parse: impl FnMut(usize, &str) -> Result<T, String>,
) -> Result<Vec<T>, InputError> {
    let lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())).filter(|(_, l)| !l.is_empty());
    let out = lines
        .map(|(line, raw)| parse(line, raw).map_err(|why| InputError::Line { path: path.to_path_buf(), line, why }))
        .collect::<Result<Vec<T>, InputError>>()?;
    if out.is_empty() {
        return Err(InputError::Empty { path: path.to_path_buf(), what });
    }
    Ok(out)
}

pub(crate) fn read(path: &Path) -> Result<String, InputError> {
    std::fs::read_to_string(path).map_err(|source| InputError::Read { path: path.to_path_buf(), source })
}

/// Reads a placement log file.
pub fn read_placement_log(path: &Path) -> Result<Vec<LogLine>, InputError> {
    parse_placement_log(path, &read(path)?)
}

/// Parses a placement log's text; `path` only names it in errors.
///
/// A line must be a JSON object of schema version 1 with no field this version does not know: a
/// `simulate --json` file given here, or a log from a newer gpuplace, is refused at its first line
/// rather than read half-right.
pub fn parse_placement_log(path: &Path, text: &str) -> Result<Vec<LogLine>, InputError> {
    parse_lines(path, text, "placement decisions", |line, raw| {
        let value: Value = serde_json::from_str(raw).map_err(|e| format!("not JSON: {e}"))?;
        let Value::Object(fields) = &value else {
            return Err("not a JSON object".into());
        };
        if let Some(unknown) = fields.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(format!(
                "unknown field {unknown:?}: not a placement log line of schema version {PLACEMENT_LOG_VERSION} (a simulate --json result goes to --simulate)"
            ));
        }
        match fields.get("v").and_then(Value::as_u64) {
            Some(v) if v == u64::from(PLACEMENT_LOG_VERSION) => {}
            Some(v) => return Err(format!("schema version {v}; this gpuplace reads version {PLACEMENT_LOG_VERSION}")),
            None => return Err("no schema version \"v\": not a placement log line".into()),
        }
        let decision: Decision = serde_json::from_value(value).map_err(|e| format!("not a placement decision: {e}"))?;
        Ok(LogLine { line, decision })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("p.jsonl")
    }

    #[test]
    fn placement_log_errors_name_the_line() {
        let good = serde_json::to_string(&Decision { v: 1, verb: "filter".into(), ..Decision::default() }).unwrap();
        let text = format!("{good}\n\n{good}\n{{\"v\":1,\"verb\":\n");
        let e = parse_placement_log(p(), &text).unwrap_err().to_string();
        assert!(e.starts_with("p.jsonl, line 4: not JSON"), "{e}");

        let e = parse_placement_log(p(), "").unwrap_err().to_string();
        assert_eq!(e, "p.jsonl: no placement decisions in it (the file is empty)");
        assert!(parse_placement_log(p(), "\n  \n").is_err());

        let extra = good.replacen('{', "{\"surprise\":1,", 1);
        let e = parse_placement_log(p(), &extra).unwrap_err().to_string();
        assert!(e.contains("line 1: unknown field \"surprise\""), "{e}");

        let v2 = good.replacen("\"v\":1", "\"v\":2", 1);
        let e = parse_placement_log(p(), &v2).unwrap_err().to_string();
        assert!(e.contains("line 1: schema version 2"), "{e}");

        let e = parse_placement_log(p(), "[1,2]").unwrap_err().to_string();
        assert!(e.contains("line 1: not a JSON object"), "{e}");

        let wrong_type = good.replacen("\"candidates\":0", "\"candidates\":\"many\"", 1);
        let e = parse_placement_log(p(), &wrong_type).unwrap_err().to_string();
        assert!(e.contains("line 1: not a placement decision"), "{e}");

        let lines = parse_placement_log(p(), &format!("{good}\n\n{good}\n")).unwrap();
        assert_eq!(lines.iter().map(|l| l.line).collect::<Vec<_>>(), [1, 3]);
    }
}
