//! A process's memory and CPU time from /proc, for the tests that measure a server they started
//! (the e2e scale scenario, the extender's large-upload test).

/// A process's resident memory (now, peak; MiB) and CPU time (s), from /proc.
pub fn usage(pid: u32) -> (f64, f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // the fields after the command name (which may hold spaces): utime and stime are 14 and 15
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(f64::NAN);
    // 100 ticks a second (USER_HZ) on Linux
    let cpu_s = (ticks(11) + ticks(12)) / 100.0;
    (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0, cpu_s)
}
