//! The wall clock the extender reads: utilization samples' ages, watch freshness, `/inspect`'s time.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, in Unix milliseconds (0 on a clock set before 1970).
pub fn now_unix_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}
