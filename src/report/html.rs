//! The report as one self-contained HTML file (inline SVG charts, inline CSS, no scripts) and as a
//! terminal summary.

use std::fmt::Write as _;

use crate::report::charts::{self, ChartError, TimeAxis, MAX_HEAT_ROWS};
use crate::report::model::{LogModel, SimModel, TurnedAway};
use crate::sim::figures::PolicyReport;

/// Text for HTML element content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Unix milliseconds as `YYYY-MM-DD HH:MM:SS UTC` (the civil-from-days algorithm, so no date crate
/// is needed for one line).
pub fn utc(ts_unix_ms: i64) -> String {
    let secs = ts_unix_ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", rem / 3600, rem / 60 % 60, rem % 60)
}

fn num(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.2}")
    } else {
        "-".into()
    }
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px auto;max-width:1000px;color:#222;line-height:1.4}\
h1{font-size:26px}h2{font-size:21px;margin-top:36px;border-bottom:1px solid #ccc}\
table{border-collapse:collapse;margin:12px 0}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}\
td.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f3f3}\
figure{margin:20px 0}figcaption{font-size:14px;color:#555;max-width:960px}svg{max-width:100%;height:auto}\
p.note{color:#555;font-size:14px}";

/// Sections written so far, and the charts among them.
struct Page {
    html: String,
    charts: usize,
}

impl Page {
    fn figure(&mut self, id: &str, svg: &str, caption: &str) {
        let _ =
            write!(self.html, "<figure id=\"{id}\">\n{svg}\n<figcaption>{}</figcaption>\n</figure>\n", escape(caption));
        self.charts += 1;
    }

    fn row(&mut self, id: &str, name: &str, value: &str) {
        let _ =
            writeln!(self.html, "<tr><th>{}</th><td class=\"n\" id=\"{id}\">{}</td></tr>", escape(name), escape(value));
    }
}

/// The HTML page and how many charts it holds.
pub fn render(log: Option<&LogModel>, sim: Option<&SimModel>) -> Result<(String, usize), ChartError> {
    let mut p = Page { html: String::new(), charts: 0 };
    let _ = write!(
        p.html,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>gpuplace capacity report</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<h1>gpuplace capacity report</h1>\n"
    );
    if let Some(m) = log {
        log_section(&mut p, m)?;
    }
    if let Some(s) = sim {
        sim_section(&mut p, s)?;
    }
    p.html.push_str("</body>\n</html>\n");
    Ok((p.html, p.charts))
}

fn files(paths: &[std::path::PathBuf]) -> String {
    paths.iter().map(|f| escape(&f.display().to_string())).collect::<Vec<_>>().join(", ")
}

fn sorted_rows(map: &std::collections::BTreeMap<String, TurnedAway>, max: usize) -> Vec<(String, TurnedAway)> {
    let mut rows: Vec<(String, TurnedAway)> = map.iter().map(|(k, v)| (k.clone(), *v)).collect();
    rows.sort_by(|a, b| b.1.total().cmp(&a.1.total()).then_with(|| a.0.cmp(&b.0)));
    if rows.len() > max {
        let rest = rows.split_off(max - 1);
        let other = rest.iter().fold(TurnedAway::default(), |a, (_, t)| TurnedAway {
            pending: a.pending + t.pending,
            bound_later: a.bound_later + t.bound_later,
        });
        rows.push((format!("{} other shapes", rest.len()), other));
    }
    rows
}

fn log_section(p: &mut Page, m: &LogModel) -> Result<(), ChartError> {
    let _ = writeln!(p.html, "<h2>Placement log</h2>\n<p>From {}.</p>", files(&m.files));
    p.html.push_str("<table id=\"log-summary\">\n");
    p.row("lines", "Lines", &m.lines.to_string());
    p.row("first", "First line", &utc(m.first_ts_unix_ms));
    p.row("last", "Last line", &utc(m.last_ts_unix_ms));
    for (verb, n) in &m.verbs {
        p.row(&format!("verb-{verb}"), &format!("{verb} decisions"), &n.to_string());
    }
    for (outcome, n) in &m.bind_outcomes {
        p.row(&format!("bind-{outcome}"), &format!("Binds {outcome}"), &n.to_string());
    }
    p.row("pods-bound", "Pods bound (distinct)", &m.pods_bound.to_string());
    for (event, n) in &m.group_events {
        p.row(&format!("group-{event}"), &format!("Group events {event}"), &n.to_string());
    }
    if let Some(peak) = m.groups.iter().map(|g| g.reserved_gpus).reduce(f64::max) {
        p.row("group-reserved-peak", "Peak GPUs reserved by group plans", &num(peak));
    }
    if let Some(last) = m.groups.last() {
        p.row("group-waiting-last", "Groups waiting at the last group line", &last.waiting.to_string());
    }
    let t = m.turned_away();
    p.row("turned-away", "Pods turned away (distinct)", &t.total().to_string());
    p.row("still-pending", "… still pending at the end of the log", &t.pending.to_string());
    if let Some(last) = m.samples.last() {
        p.row("gpus", "GPUs", &num(last.gpus));
        p.row("allocated-last", "Allocated GPUs at the last bind", &num(last.allocated));
        p.row("fragmented-last", "Fragmented GPUs at the last bind", &num(last.fragmented));
        p.row("idle-last", "Idle GPUs at the last bind", &num(last.idle));
    }
    if let Some(peak) = m.peak() {
        p.row("allocated-peak", "Peak allocated GPUs", &num(peak.allocated));
        p.row("allocated-peak-at", "… at", &utc(peak.ts_unix_ms));
    }
    if let Some(last) = m.rooms.last() {
        let text = last.room.summary();
        p.row("room-last", "Room for jobs at the last bind", text.strip_prefix("room: ").unwrap_or(&text));
        // the tightest moment for the jobs the cluster is built for: the finest level's largest job
        let finest = |s: &crate::report::model::RoomSample| s.room.levels.last().map(|l| l.largest_job_pods);
        if let Some(low) = m.rooms.iter().filter(|s| finest(s).is_some()).min_by_key(|s| finest(s)) {
            let l = low.room.levels.last().map_or("", |l| l.level.rsplit('/').next().unwrap_or(""));
            p.row(
                "room-largest-job-min",
                &format!("Smallest largest job under one {l}"),
                &format!("{} x {} GPUs at {}", finest(low).unwrap_or(0), low.room.node_gpus, utc(low.ts_unix_ms)),
            );
        }
    }
    for (verb, l) in &m.latency {
        // repeats counted in a line keep a sum and a max, not their spread: percentiles are of the
        // lines written, the mean and max of every call
        p.row(
            &format!("latency-{verb}"),
            &format!("{verb} latency p50 / p99, per line written ({})", l.lines),
            &format!("{} / {} µs", l.p50_us, l.p99_us),
        );
        p.row(
            &format!("latency-calls-{verb}"),
            &format!("{verb} latency mean / max, every call"),
            &format!("{} / {} µs", l.mean_us, l.max_us),
        );
    }
    p.html.push_str("</table>\n");

    let axis = TimeAxis::new(m.first_ts_unix_ms, m.last_ts_unix_ms);
    if m.samples.is_empty() {
        p.html.push_str("<p class=\"note\">No bind line in this log carries a cluster summary (the <code>cluster</code> field, written by gpuplace since the report was added), so the capacity, fragmentation, model and per-node charts are left out.</p>\n");
    } else {
        p.figure(
            "chart-capacity",
            &charts::capacity(&m.samples, &axis)?,
            "Right after each bind: GPUs held (a share counts as its fraction), free share left on GPUs that are partly held, and GPUs nobody holds. Releases between binds show at the next bind.",
        );
        p.figure(
            "chart-fragmentation",
            &charts::fragmentation(&m.samples, &axis)?,
            "Fragmented GPUs as a share of all free GPU capacity (fragmented plus idle): capacity that a pod asking for a whole GPU cannot use.",
        );
        p.figure("chart-models", &charts::models(&m.models)?, "Per GPU model, from the last bind's cluster summary.");
    }
    if !m.rooms.is_empty() {
        p.figure(
            "chart-room",
            &charts::whole_room(&m.rooms, &axis)?,
            "Right after each bind: nodes of the largest size with every GPU free and healthy, and network switches (ToR, spine) whose every GPU node is whole: the room node-sized pods and jobs of them have, which GPU fractions do not show.",
        );
        p.figure(
            "chart-largest-job",
            &charts::largest_job(&m.rooms, &axis)?,
            "Right after each bind: the most whole nodes under one switch (the largest job of node-sized pods that could start there now), and idle GPUs on broken nodes of the largest size, which no node-sized pod can use.",
        );
    }
    if !m.groups.is_empty() {
        p.figure(
            "chart-groups",
            &charts::groups(&m.groups, &axis)?,
            "Groups placed whole (docs/resources.md, Groups): after each group event and each bind of a group member, the groups whose members wait with no plan possible, and the GPUs held by plans for members not bound yet.",
        );
    }
    let class_rows = sorted_rows(&m.by_class, 12);
    let shape_rows = sorted_rows(&m.by_shape, 12);
    if class_rows.is_empty() {
        p.html.push_str(
            "<p class=\"note\">No pod was turned away: every filter found a node and every bind succeeded.</p>\n",
        );
    } else {
        p.figure(
            "chart-reasons",
            &charts::turned_away("Pods turned away, by reason class", &class_rows)?,
            "A pod is turned away when a filter finds no node for it (its class: the one most nodes gave; contract: the request itself was refused) or when its bind fails (bind_failed).",
        );
        p.figure(
            "chart-shapes",
            &charts::turned_away("Pods turned away, by request shape", &shape_rows)?,
            "The same pods by what each container asked for: whole GPUs, or GPUs × compute share (and memory when asked for).",
        );
    }
    if !m.nodes.is_empty() {
        let mut nodes: Vec<(&String, &crate::report::model::NodeTrack)> = m.nodes.iter().collect();
        let shown = if nodes.len() > MAX_HEAT_ROWS {
            nodes.sort_by(|a, b| b.1.points.len().cmp(&a.1.points.len()).then_with(|| a.0.cmp(b.0)));
            nodes.truncate(MAX_HEAT_ROWS);
            nodes.sort_by(|a, b| a.0.cmp(b.0));
            format!(" Showing the {MAX_HEAT_ROWS} of {} nodes bound to most often.", m.nodes.len())
        } else {
            String::new()
        };
        p.figure(
            "chart-heatmap",
            &charts::heatmap(&nodes, &axis)?,
            &format!("Nodes with at least one bind in the log. A node's colour changes only at binds to it: a release shows at its next bind.{shown}"),
        );
    }
    Ok(())
}

fn sim_section(p: &mut Page, s: &SimModel) -> Result<(), ChartError> {
    let _ = writeln!(p.html, "<h2>Simulation</h2>\n<p>From {}.</p>", files(&s.files));
    let cols = s.columns();
    p.html.push_str("<table id=\"sim-summary\">\n<tr><th>policy</th><th>workload</th><th>seeds</th><th>pods per seed</th><th>failed pods</th><th>frag. rate at 80 %</th><th>paper at 100 %</th></tr>\n");
    for r in &s.policies {
        let label = escape(&s.label(r));
        let _ = writeln!(
            p.html,
            "<tr><th>{label}</th><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\" data-policy=\"{label}\" data-field=\"failed_pods\">{}</td><td class=\"n\" data-policy=\"{label}\" data-field=\"frag_rate_pct_at_80\">{}</td><td class=\"n\">{}</td></tr>",
            escape(&r.workload),
            r.seeds.len(),
            num(r.pods_per_seed),
            num(r.failed_pods),
            num(r.frag_rate_pct_at_80),
            r.paper_unallocated_gpu_pct_at_100.map_or("-".into(), num),
        );
    }
    p.html.push_str("</table>\n<p>Unallocated GPU % (mean over seeds) by arrived workload (% of cluster GPU capacity):</p>\n<table id=\"sim-unallocated\">\n<tr><th>policy</th>");
    for c in &cols {
        let _ = write!(p.html, "<th>{c}</th>");
    }
    p.html.push_str("</tr>\n");
    for r in &s.policies {
        let label = escape(&s.label(r));
        let _ = write!(p.html, "<tr><th>{label}</th>");
        for c in &cols {
            let v = r.unallocated_gpu_pct.get(&c.to_string()).map_or("-".into(), |v| num(*v));
            let _ = write!(p.html, "<td class=\"n\" data-policy=\"{label}\" data-column=\"{c}\">{v}</td>");
        }
        p.html.push_str("</tr>\n");
    }
    p.html.push_str("</table>\n");
    if cols.is_empty() {
        p.html.push_str(
            "<p class=\"note\">The arrivals reached none of the reported columns, so there is no curve to draw.</p>\n",
        );
    } else {
        p.figure(
            "chart-unallocated",
            &charts::unallocated(s)?,
            "Lower is better: GPU capacity left unallocated as more work arrives (the FGD paper's figures). Points are the reported columns, means over the seeds.",
        );
    }
    Ok(())
}

/// The terminal summary.
pub fn summary(log: Option<&LogModel>, sim: Option<&SimModel>) -> String {
    let mut out = String::new();
    if let Some(m) = log {
        let _ = writeln!(
            out,
            "placement log: {} ({} lines, {} to {})",
            m.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "),
            m.lines,
            utc(m.first_ts_unix_ms),
            utc(m.last_ts_unix_ms)
        );
        let verbs: Vec<String> = m.verbs.iter().map(|(v, n)| format!("{v} {n}")).collect();
        let _ = writeln!(out, "  decisions: {}", verbs.join(", "));
        let outcomes: Vec<String> = m.bind_outcomes.iter().map(|(v, n)| format!("{v} {n}")).collect();
        let _ = writeln!(out, "  binds: {} ({} pods bound)", outcomes.join(", "), m.pods_bound);
        let t = m.turned_away();
        let classes: Vec<String> = m.by_class.iter().map(|(c, t)| format!("{c} {}", t.total())).collect();
        let _ = writeln!(
            out,
            "  pods turned away: {} ({} still pending, {} bound later){}",
            t.total(),
            t.pending,
            t.bound_later,
            if classes.is_empty() { String::new() } else { format!("; by class: {}", classes.join(", ")) }
        );
        match (m.samples.last(), m.peak()) {
            (Some(last), Some(peak)) => {
                let _ = writeln!(
                    out,
                    "  GPUs: {}; at the last bind {} allocated, {} fragmented, {} idle ({:.1}% of free capacity fragmented); peak {} allocated",
                    num(last.gpus),
                    num(last.allocated),
                    num(last.fragmented),
                    num(last.idle),
                    last.fragmentation_pct(),
                    num(peak.allocated)
                );
            }
            _ => out.push_str("  no cluster summary on any bind line (a log from before the report existed)\n"),
        }
        if let Some(last) = m.rooms.last() {
            let _ = writeln!(out, "  at the last bind, {}", last.room.summary());
        }
    }
    if let Some(s) = sim {
        let _ = writeln!(
            out,
            "simulate: {}",
            s.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ")
        );
        let reports: Vec<PolicyReport> =
            s.policies.iter().map(|r| PolicyReport { policy: s.label(r), ..r.clone() }).collect();
        out.push_str(&crate::sim::figures::table(&reports));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_795_246_609_086), "2026-11-21 07:36:49 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
    }

    #[test]
    fn escapes_markup() {
        assert_eq!(escape("a<b>&\"'"), "a&lt;b&gt;&amp;&quot;&#39;");
    }
}
