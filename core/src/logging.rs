//! Log output for both binaries (`gpuplace` and `gpuplace-device-plugin`), on stderr: text, coloured
//! only when stderr is a terminal (a pod's log or a file gets no ANSI escapes), or JSON lines for log
//! collectors. `RUST_LOG` filters either. What is not a log event (the start-up banner, a fatal
//! error) goes through [`say`], in the same format.

use std::io::IsTerminal as _;
use std::sync::OnceLock;

use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::EnvFilter;

/// The format [`init`] installed, for [`say`].
static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// `--log-format`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines; ANSI colours only on a terminal.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields` (`message` and the event's
    /// fields) and the spans.
    Json,
}

/// Installs the global subscriber: `RUST_LOG` when set and valid, else `default_filter`.
pub fn init(format: LogFormat, default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let _ = FORMAT.set(format);
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_ansi(false).init(),
    }
}

/// A line on stderr that no filter hides: the start-up banner, a fatal error. As it is in text; in
/// JSON, an object shaped like the log lines (`timestamp`, `level`, `fields.message`, `target`), so
/// that every line a collector reads parses.
pub fn say(level: tracing::Level, target: &str, text: &str) {
    if FORMAT.get() != Some(&LogFormat::Json) {
        eprintln!("{text}");
        return;
    }
    let mut timestamp = String::new();
    // the clock tracing-subscriber's own JSON lines use (RFC 3339); writing to a String cannot fail
    let _ = SystemTime.format_time(&mut Writer::new(&mut timestamp));
    let line = serde_json::json!({
        "timestamp": timestamp,
        "level": level.as_str(),
        "fields": { "message": text },
        "target": target,
    });
    eprintln!("{line}");
}
