//! The report's charts, drawn with plotters' SVG backend into strings (text stays SVG `<text>`, so
//! no font files are needed). Every chart has a title, axis labels and a legend or a colour scale.

use std::collections::BTreeMap;

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;

use crate::placement_log::ModelCapacity;
use crate::report::model::{curve, CapacitySample, GroupSample, NodeTrack, RoomSample, SimModel, TurnedAway};

/// Why a chart could not be drawn (plotters' own error, which cannot happen on a string backend
/// short of a bug, but is reported rather than unwrapped).
#[derive(Debug, thiserror::Error)]
#[error("drawing the chart {chart:?}: {why}")]
pub struct ChartError {
    pub chart: String,
    pub why: String,
}

type Result<T> = std::result::Result<T, ChartError>;

/// Maps any plotters error to a [`ChartError`] naming the chart.
fn err<E: std::fmt::Display>(chart: &str) -> impl Fn(E) -> ChartError + '_ {
    move |e| ChartError { chart: chart.to_string(), why: e.to_string() }
}

pub const WIDTH: u32 = 960;
const HEIGHT: u32 = 400;
const FONT: &str = "sans-serif";

/// Colours that stay apart for readers with the common colour-vision deficiencies (Okabe-Ito, plus
/// grey shades beyond it).
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(213, 94, 0),
    RGBColor(240, 228, 66),
    RGBColor(0, 0, 0),
    RGBColor(120, 120, 120),
    RGBColor(180, 180, 180),
];

pub const ALLOCATED: RGBColor = RGBColor(0, 114, 178);
pub const FRAGMENTED: RGBColor = RGBColor(230, 159, 0);
pub const IDLE: RGBColor = RGBColor(0, 158, 115);
pub const PENDING: RGBColor = RGBColor(213, 94, 0);
pub const BOUND_LATER: RGBColor = RGBColor(150, 150, 150);

/// Time since the log's first line, in a unit that keeps the axis numbers short.
#[derive(Debug, Clone, Copy)]
pub struct TimeAxis {
    pub t0_unix_ms: i64,
    unit_ms: f64,
    pub unit: &'static str,
    pub end: f64,
}

impl TimeAxis {
    pub fn new(t0_unix_ms: i64, t1_unix_ms: i64) -> Self {
        let span = (t1_unix_ms - t0_unix_ms).max(0) as f64;
        let (unit_ms, unit) = if span < 120_000.0 {
            (1000.0, "seconds")
        } else if span < 7_200_000.0 {
            (60_000.0, "minutes")
        } else if span < 172_800_000.0 {
            (3_600_000.0, "hours")
        } else {
            (86_400_000.0, "days")
        };
        // a log whose lines share one instant still gets an axis of some width
        let end = (span / unit_ms).max(1e-3);
        Self { t0_unix_ms, unit_ms, unit, end }
    }

    pub fn at(&self, ts_unix_ms: i64) -> f64 {
        (ts_unix_ms - self.t0_unix_ms) as f64 / self.unit_ms
    }

    pub fn label(&self) -> String {
        format!("Time since the log's first line ({})", self.unit)
    }
}

/// `n` rows (at least one) on a segmented axis: segments 0..=n-1.
fn segments(n: usize) -> plotters::coord::ranged1d::SegmentedCoord<plotters::coord::types::RangedCoordi32> {
    (0..n.max(1) as i32 - 1).into_segmented()
}

/// Row `i` counted from the top is segment `n - 1 - i` counted from the bottom.
fn row_index(i: usize, n: usize) -> i32 {
    n.max(1) as i32 - 1 - i as i32
}

/// The segment bounds of row `i` counted from the top.
fn row(i: usize, n: usize) -> (SegmentValue<i32>, SegmentValue<i32>) {
    let k = row_index(i, n);
    (SegmentValue::Exact(k), SegmentValue::Exact(k + 1))
}

/// The label of a segment's centre: the name of the row there.
fn row_label(v: &SegmentValue<i32>, n: usize, name: impl Fn(usize) -> Option<String>) -> String {
    match v {
        SegmentValue::CenterOf(k) if *k >= 0 && (*k as usize) < n.max(1) => {
            name(n.max(1) - 1 - *k as usize).unwrap_or_default()
        }
        _ => String::new(),
    }
}

/// An axis number: whole numbers on a wide axis, one or two decimals on a narrow one.
fn axis_number(v: f64, span: f64) -> String {
    if span >= 20.0 {
        format!("{v:.0}")
    } else if span >= 2.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// At most `max` samples, evenly spread (the last one always kept), so that a long log still makes
/// an SVG of reasonable size.
fn thin<T: Copy>(xs: &[T], max: usize) -> Vec<T> {
    if xs.len() <= max || max < 2 {
        return xs.to_vec();
    }
    let step = (xs.len() - 1) as f64 / (max - 1) as f64;
    (0..max).map(|i| xs[((i as f64 * step).round() as usize).min(xs.len() - 1)]).collect()
}

const MAX_POINTS: usize = 1500;

fn legend_box<'a, DB: DrawingBackend + 'a>(
    c: &mut ChartContext<'a, DB, impl CoordTranslate>,
    pos: SeriesLabelPosition,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    c.configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.5))
        .label_font((FONT, 14))
        .draw()
}

/// The axes of a line or area chart: ranges, how their ticks read, and what they measure.
struct Axes<'a> {
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    x_label: &'a dyn Fn(&f64) -> String,
    y_label: &'a dyn Fn(&f64) -> String,
    x_desc: &'a str,
    y_desc: &'a str,
}

type XyChart<'a, DB> =
    ChartContext<'a, DB, Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>>;

/// A chart with a caption and a labelled mesh on `axes`, in the report's margins and fonts: what the
/// capacity, fragmentation and unallocated charts share.
fn xy_chart<'a, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    axes: Axes<'_>,
) -> std::result::Result<XyChart<'a, DB>, DrawingAreaErrorKind<DB::ErrorType>> {
    let mut c = ChartBuilder::on(root)
        .caption(title, (FONT, 20))
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(axes.x, axes.y)?;
    c.configure_mesh()
        .max_light_lines(1)
        .x_label_formatter(axes.x_label)
        .y_label_formatter(axes.y_label)
        .x_desc(axes.x_desc)
        .y_desc(axes.y_desc)
        .axis_desc_style((FONT, 15))
        .label_style((FONT, 13))
        .draw()?;
    Ok(c)
}

/// The top of one stacked layer of the capacity chart.
type Layer = fn(&CapacitySample) -> f64;

/// Allocated, fragmented and idle GPUs over time, stacked (they add up to the healthy GPUs).
pub fn capacity(samples: &[CapacitySample], axis: &TimeAxis) -> Result<String> {
    let title = "GPU capacity over time: allocated, fragmented and idle";
    let e = err(title);
    let pts = thin(samples, MAX_POINTS);
    // the axis ends at the GPUs there are (the layers add up to them; the legend has its own box)
    let top = pts.iter().map(|s| s.gpus).fold(1.0, f64::max);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(&e)?;
        let axes = Axes {
            x: 0.0..axis.end,
            y: 0.0..top,
            x_label: &|v| axis_number(*v, axis.end),
            y_label: &|v| axis_number(*v, top),
            x_desc: &axis.label(),
            y_desc: "GPUs",
        };
        let mut c = xy_chart(&root, title, axes).map_err(&e)?;
        let layers: [(&str, RGBColor, Layer); 3] = [
            ("idle (no one holds the GPU)", IDLE, |s| s.allocated + s.fragmented + s.idle),
            ("fragmented (free share of partly held GPUs)", FRAGMENTED, |s| s.allocated + s.fragmented),
            ("allocated", ALLOCATED, |s| s.allocated),
        ];
        for (name, color, value) in layers {
            // the figures hold until the next bind, so the last ones reach the log's end
            let hold = pts.last().map(|s| (axis.end, value(s)));
            let series = pts.iter().map(|s| (axis.at(s.ts_unix_ms), value(s))).chain(hold);
            // opaque: each layer is drawn from zero over the one before
            c.draw_series(AreaSeries::new(series, 0.0, color.filled()).border_style(color.stroke_width(1)))
                .map_err(&e)?
                .label(name)
                .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled()));
        }
        legend_box(&mut c, SeriesLabelPosition::UpperRight).map_err(&e)?;
        root.present().map_err(&e)?;
    }
    Ok(svg)
}

/// Fragmented share of free GPU capacity over time.
pub fn fragmentation(samples: &[CapacitySample], axis: &TimeAxis) -> Result<String> {
    let title = "Fragmentation over time: free capacity that is only fractions of GPUs";
    let e = err(title);
    let pts = thin(samples, MAX_POINTS);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(&e)?;
        let axes = Axes {
            x: 0.0..axis.end,
            y: 0.0..125.0,
            x_label: &|v| axis_number(*v, axis.end),
            y_label: &|v| if *v <= 100.0 { format!("{v:.0}") } else { String::new() },
            x_desc: &axis.label(),
            y_desc: "Fragmented, % of free GPU capacity",
        };
        let mut c = xy_chart(&root, title, axes).map_err(&e)?;
        let series: Vec<(f64, f64)> = pts.iter().map(|s| (axis.at(s.ts_unix_ms), s.fragmentation_pct())).collect();
        // the figure holds until the next bind, so the last one reaches the log's end
        let hold = series.last().map(|&(_, y)| (axis.end, y));
        c.draw_series(LineSeries::new(series.iter().copied().chain(hold), FRAGMENTED.stroke_width(2)))
            .map_err(&e)?
            .label("fragmented share of free capacity")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], FRAGMENTED.stroke_width(2)));
        if series.len() <= 200 {
            c.draw_series(series.iter().map(|&p| Circle::new(p, 3, FRAGMENTED.filled()))).map_err(&e)?;
        }
        legend_box(&mut c, SeriesLabelPosition::UpperRight).map_err(&e)?;
        root.present().map_err(&e)?;
    }
    Ok(svg)
}

/// One line of a step chart: its legend name, colour and (time, value) points.
pub struct StepLine {
    pub name: String,
    pub color: RGBColor,
    pub points: Vec<(i64, f64)>,
}

/// Lines whose figures hold until their next point, the last one to the log's end (figures taken at
/// events: group lines, binds).
/// `counts`: the figures are whole numbers, and so are the axis labels.
fn step_chart(title: &str, y_desc: &str, lines: &[StepLine], axis: &TimeAxis, counts: bool) -> Result<String> {
    let e = err(title);
    let high = lines.iter().flat_map(|l| l.points.iter().map(|p| p.1)).fold(1.0, f64::max);
    // headroom above the highest figure for the legend, a row per line
    let top = high * (1.3 + 0.1 * lines.len() as f64);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(&e)?;
        let axes = Axes {
            x: 0.0..axis.end,
            y: 0.0..top,
            x_label: &|v| axis_number(*v, axis.end),
            y_label: &|v| match counts {
                true if v.fract().abs() > 1e-9 => String::new(),
                true => format!("{v:.0}"),
                false => axis_number(*v, top),
            },
            x_desc: &axis.label(),
            y_desc,
        };
        let mut c = xy_chart(&root, title, axes).map_err(&e)?;
        for line in lines {
            let mut pts: Vec<(f64, f64)> = Vec::with_capacity(line.points.len() * 2 + 1);
            for &(ts, y) in &line.points {
                let x = axis.at(ts);
                if let Some(&(_, before)) = pts.last() {
                    pts.push((x, before));
                }
                pts.push((x, y));
            }
            if let Some(&(_, y)) = pts.last() {
                pts.push((axis.end, y));
            }
            let color = line.color;
            c.draw_series(LineSeries::new(pts, color.stroke_width(2)))
                .map_err(&e)?
                .label(line.name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        legend_box(&mut c, SeriesLabelPosition::UpperRight).map_err(&e)?;
        root.present().map_err(&e)?;
    }
    Ok(svg)
}

/// Groups waiting for room and GPUs held for groups' members not bound yet, over time.
pub fn groups(samples: &[GroupSample], axis: &TimeAxis) -> Result<String> {
    let series = |f: fn(&GroupSample) -> f64| samples.iter().map(|s| (s.ts_unix_ms, f(s))).collect();
    let lines = [
        StepLine {
            name: "groups waiting (members to place, no plan)".into(),
            color: FRAGMENTED,
            points: series(|s| s.waiting as f64),
        },
        StepLine { name: "GPUs reserved by plans".into(), color: ALLOCATED, points: series(|s| s.reserved_gpus) },
    ];
    step_chart(
        "Groups over time: groups waiting for room, GPUs reserved for their members",
        "groups waiting; GPUs reserved",
        &lines,
        axis,
        false,
    )
}

/// The room's figures at each sample, thinned to what a chart can show.
fn room_series(samples: &[RoomSample], f: impl Fn(&RoomSample) -> f64) -> Vec<(i64, f64)> {
    thin(&samples.iter().collect::<Vec<_>>(), MAX_POINTS).into_iter().map(|s| (s.ts_unix_ms, f(s))).collect()
}

/// A level's short name (`network.gpuplace.io/tor` → `tor`).
fn level_word(key: &str) -> &str {
    key.rsplit('/').next().unwrap_or(key)
}

/// Whole nodes of the largest size and whole switches per network level, over time.
pub fn whole_room(samples: &[RoomSample], axis: &TimeAxis) -> Result<String> {
    let Some(last) = samples.last() else { return step_chart("Room for jobs", "", &[], axis, true) };
    let g = last.room.node_gpus;
    let mut lines = vec![StepLine {
        name: format!("whole {g}-GPU nodes (every GPU free)"),
        color: ALLOCATED,
        points: room_series(samples, |s| s.room.whole_nodes.get(&g).copied().unwrap_or(0) as f64),
    }];
    // levels finest first; a level no node is labelled with has no line
    for (i, l) in last.room.levels.iter().enumerate().rev().filter(|(_, l)| l.switches > 0) {
        lines.push(StepLine {
            name: format!("whole {}s, of {} (every node under it whole)", level_word(&l.level), l.switches),
            color: PALETTE[(1 + lines.len()) % PALETTE.len()],
            points: room_series(samples, |s| s.room.levels.get(i).map_or(0.0, |x| x.whole as f64)),
        });
    }
    step_chart("Room for jobs over time: whole nodes and whole switches", "nodes; switches", &lines, axis, true)
}

/// The largest job of node-sized pods one switch can take, per level, and the idle GPUs stranded on
/// broken nodes of the largest size, over time.
pub fn largest_job(samples: &[RoomSample], axis: &TimeAxis) -> Result<String> {
    let Some(last) = samples.last() else { return step_chart("Largest job", "", &[], axis, true) };
    let g = last.room.node_gpus;
    let mut lines = Vec::new();
    for (i, l) in last.room.levels.iter().enumerate().rev().filter(|(_, l)| l.switches > 0) {
        lines.push(StepLine {
            name: format!("largest job under one {} (pods of {g} GPUs)", level_word(&l.level)),
            color: PALETTE[(2 + lines.len()) % PALETTE.len()],
            points: room_series(samples, |s| s.room.levels.get(i).map_or(0.0, |x| x.largest_job_pods as f64)),
        });
    }
    lines.push(StepLine {
        name: format!("idle GPUs stranded on broken {g}-GPU nodes"),
        color: PENDING,
        points: room_series(samples, |s| s.room.stranded_idle_gpus as f64),
    });
    step_chart(
        "The largest job that fits now, and idle GPUs no node-sized pod can use",
        "pods; GPUs",
        &lines,
        axis,
        true,
    )
}

/// One stacked bar per category, horizontal (category names can be long), one colour per series.
pub struct Bars<'a> {
    pub title: &'a str,
    pub value_desc: &'a str,
    pub categories: Vec<String>,
    /// (legend name, colour, one value per category)
    pub series: Vec<(String, RGBColor, Vec<f64>)>,
    /// The values are counts: whole numbers on the axis.
    pub counts: bool,
}

pub fn hbars(b: &Bars<'_>) -> Result<String> {
    let e = err(b.title);
    // a segmented axis of one segment has no height: one category gets an empty row below it
    let n = b.categories.len().max(2);
    let totals: Vec<f64> = (0..n).map(|i| b.series.iter().map(|s| s.2.get(i).copied().unwrap_or(0.0)).sum()).collect();
    let max = totals.iter().copied().fold(0.0, f64::max);
    // the right third stays free for the legend
    let top = if max > 0.0 { max * 1.6 } else { 1.0 };
    let longest = b.categories.iter().map(|c| c.chars().count()).max().unwrap_or(4);
    // the label area fits the longest name at about 7.5 px a character
    let label_w = (longest as f64 * 7.5 + 20.0).clamp(80.0, 360.0) as u32;
    let height = (110 + 34 * n as u32).max(220);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(&e)?;
        let mut c = ChartBuilder::on(&root)
            .caption(b.title, (FONT, 20))
            .margin(12)
            .x_label_area_size(50)
            .y_label_area_size(label_w)
            .build_cartesian_2d(0.0..top, segments(n))
            .map_err(&e)?;
        let names = &b.categories;
        c.configure_mesh()
            .disable_y_mesh()
            .light_line_style(TRANSPARENT)
            .y_labels(n)
            .y_label_formatter(&|v| row_label(v, n, |i| names.get(i).cloned()))
            .x_label_formatter(&|v| match b.counts {
                true if v.fract() != 0.0 => String::new(),
                true => format!("{v:.0}"),
                false => axis_number(*v, top),
            })
            .x_desc(b.value_desc)
            .axis_desc_style((FONT, 15))
            .label_style((FONT, 13))
            .draw()
            .map_err(&e)?;
        let mut base = vec![0.0; n];
        for (name, color, values) in &b.series {
            let color = *color;
            let bars: Vec<Rectangle<(f64, SegmentValue<i32>)>> = values
                .iter()
                .enumerate()
                .filter(|(_, v)| **v > 0.0)
                .map(|(i, v)| {
                    let (y0, y1) = row(i, n);
                    let mut r = Rectangle::new([(base[i], y0), (base[i] + v, y1)], color.filled());
                    r.set_margin(6, 6, 0, 0);
                    r
                })
                .collect();
            for (i, v) in values.iter().enumerate() {
                if let Some(b) = base.get_mut(i) {
                    *b += v;
                }
            }
            c.draw_series(bars)
                .map_err(&e)?
                .label(name.as_str())
                .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled()));
        }
        // the total at the end of each bar, so the numbers can be read off exactly
        c.draw_series(totals.iter().enumerate().filter(|(_, t)| **t > 0.0).map(|(i, t)| {
            Text::new(format_value(*t), (*t + top * 0.01, SegmentValue::CenterOf(row_index(i, n))), (FONT, 13))
        }))
        .map_err(&e)?;
        legend_box(&mut c, SeriesLabelPosition::UpperRight).map_err(&e)?;
        root.present().map_err(&e)?;
    }
    Ok(svg)
}

/// A number as the tables print it: no decimals for whole numbers, else two.
pub fn format_value(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// Pods turned away by category, split by whether they were bound later.
pub fn turned_away(title: &str, rows: &[(String, TurnedAway)]) -> Result<String> {
    hbars(&Bars {
        title,
        value_desc: "Pods (each counted once, by the last time it was turned away)",
        counts: true,
        categories: rows.iter().map(|r| r.0.clone()).collect(),
        series: vec![
            ("still pending at the end of the log".into(), PENDING, rows.iter().map(|r| r.1.pending as f64).collect()),
            ("bound later".into(), BOUND_LATER, rows.iter().map(|r| r.1.bound_later as f64).collect()),
        ],
    })
}

/// Allocated, fragmented and idle GPUs per model at the last bind.
pub fn models(models: &BTreeMap<String, ModelCapacity>) -> Result<String> {
    let rows: Vec<(&String, &ModelCapacity)> = models.iter().collect();
    hbars(&Bars {
        title: "GPU usage by model, at the last bind",
        value_desc: "GPUs",
        counts: false,
        categories: rows.iter().map(|r| r.0.clone()).collect(),
        series: vec![
            ("allocated".into(), ALLOCATED, rows.iter().map(|r| r.1.allocated_gpus).collect()),
            ("fragmented".into(), FRAGMENTED, rows.iter().map(|r| r.1.fragmented_gpus).collect()),
            ("idle".into(), IDLE, rows.iter().map(|r| f64::from(r.1.idle_gpus)).collect()),
        ],
    })
}

/// Light (0 %) to dark (100 %) blue.
fn heat(frac: f64) -> RGBColor {
    let f = frac.clamp(0.0, 1.0);
    let lerp = |a: u8, b: u8| (f64::from(a) + (f64::from(b) - f64::from(a)) * f).round() as u8;
    RGBColor(lerp(239, 8), lerp(243, 48), lerp(255, 107))
}

const NO_DATA: RGBColor = RGBColor(225, 225, 225);

/// Most rows a heat map shows; more would be unreadable (the nodes bound to most are kept).
pub const MAX_HEAT_ROWS: usize = 60;
const HEAT_COLUMNS: usize = 48;

/// Per node (rows) and time bucket (columns): the node's allocated share of its GPUs as of the last
/// bind to it by the end of the bucket; grey before its first bind.
pub fn heatmap(nodes: &[(&String, &NodeTrack)], axis: &TimeAxis) -> Result<String> {
    let title = "Allocation per node over time (% of the node's GPUs, as of the last bind to it)";
    let e = err(title);
    // as for bars: one node gets an empty row below it
    let rows = nodes.len().max(2);
    let cols = HEAT_COLUMNS;
    let longest = nodes.iter().map(|(n, _)| n.chars().count()).max().unwrap_or(4);
    let label_w = (longest as f64 * 7.5 + 20.0).clamp(80.0, 300.0) as u32;
    let height = (120 + 18 * rows as u32).max(260);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(&e)?;
        let (plot, scale) = root.split_horizontally(WIDTH - 130);
        let mut c = ChartBuilder::on(&plot)
            .caption(title, (FONT, 18))
            .margin(12)
            .x_label_area_size(50)
            .y_label_area_size(label_w)
            .build_cartesian_2d(0.0..axis.end, segments(rows))
            .map_err(&e)?;
        c.configure_mesh()
            .disable_mesh()
            .y_labels(rows)
            .y_label_formatter(&|v| row_label(v, rows, |i| nodes.get(i).map(|n| n.0.clone())))
            .x_label_formatter(&|v| axis_number(*v, axis.end))
            .x_desc(axis.label())
            .y_desc("Node")
            .axis_desc_style((FONT, 15))
            .label_style((FONT, 12))
            .draw()
            .map_err(&e)?;
        let width = axis.end / cols as f64;
        let mut cells = Vec::with_capacity(rows * cols);
        for (r, (_, track)) in nodes.iter().enumerate() {
            let mut k = 0;
            let mut last: Option<f64> = None;
            for col in 0..cols {
                let end = width * (col + 1) as f64;
                while k < track.points.len() && axis.at(track.points[k].0) <= end + 1e-9 {
                    last = Some(track.points[k].1);
                    k += 1;
                }
                let color = match last {
                    Some(a) if track.gpus > 0 => heat(a / f64::from(track.gpus)),
                    Some(_) => heat(0.0),
                    None => NO_DATA,
                };
                let (y0, y1) = row(r, rows);
                cells.push(Rectangle::new([(width * col as f64, y0), (end, y1)], color.filled()));
            }
        }
        c.draw_series(cells).map_err(&e)?;
        // the colour scale, beside the chart
        let font = (FONT, 13).into_font();
        scale.draw(&Text::new("allocated", (10, 50), font.clone())).map_err(&e)?;
        let (top, step) = (72, 22);
        for i in 0..=4 {
            let frac = 1.0 - f64::from(i) / 4.0;
            let y = top + i * step;
            scale.draw(&Rectangle::new([(10, y), (34, y + step)], heat(frac).filled())).map_err(&e)?;
            scale.draw(&Text::new(format!("{:.0}%", frac * 100.0), (40, y + 5), font.clone())).map_err(&e)?;
        }
        let y = top + 5 * step + 12;
        scale.draw(&Rectangle::new([(10, y), (34, y + step)], NO_DATA.filled())).map_err(&e)?;
        scale.draw(&Text::new("no bind yet", (40, y + 5), font)).map_err(&e)?;
        root.present().map_err(&e)?;
    }
    Ok(svg)
}

/// Unallocated GPU % against arrived workload per policy, as the FGD paper plots it; the paper's own
/// figure at 100 % is a hollow marker where the trace has it.
pub fn unallocated(sim: &SimModel) -> Result<String> {
    let title = "Unallocated GPU % against arrived workload, per policy";
    let e = err(title);
    let cols = sim.columns();
    let (x0, x1) = match (cols.first(), cols.last()) {
        (Some(&a), Some(&b)) if b > a => (f64::from(a), f64::from(b)),
        (Some(&a), _) => (f64::from(a) - 5.0, f64::from(a) + 5.0),
        _ => (0.0, 100.0),
    };
    let ymax = sim
        .policies
        .iter()
        .flat_map(|p| p.unallocated_gpu_pct.values().copied().chain(p.paper_unallocated_gpu_pct_at_100))
        .fold(1.0, f64::max);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 460)).into_drawing_area();
        root.fill(&WHITE).map_err(&e)?;
        let axes = Axes {
            x: x0..x1,
            y: 0.0..ymax * 1.1,
            x_label: &|v| format!("{v:.0}"),
            y_label: &|v| axis_number(*v, ymax),
            x_desc: "Arrived workload (% of cluster GPU capacity)",
            y_desc: "Unallocated GPU (% of capacity)",
        };
        let mut c = xy_chart(&root, title, axes).map_err(&e)?;
        for (i, p) in sim.policies.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let pts = curve(p);
            c.draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                .map_err(&e)?
                .label(sim.label(p))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
            c.draw_series(pts.iter().map(|&pt| Circle::new(pt, 3, color.filled()))).map_err(&e)?;
            if let Some(paper) = p.paper_unallocated_gpu_pct_at_100 {
                c.draw_series(std::iter::once(Circle::new((100.0, paper), 6, color.stroke_width(2))))
                    .map_err(&e)?
                    .label(format!("{} (paper, at 100 %)", sim.label(p)))
                    .legend(move |(x, y)| Circle::new((x + 9, y), 5, color.stroke_width(2)));
            }
        }
        legend_box(&mut c, SeriesLabelPosition::UpperRight).map_err(&e)?;
        root.present().map_err(&e)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_axis_picks_a_readable_unit() {
        assert_eq!(TimeAxis::new(0, 30_000).unit, "seconds");
        assert_eq!(TimeAxis::new(0, 30 * 60_000).unit, "minutes");
        let h = TimeAxis::new(1_000, 1_000 + 5 * 3_600_000);
        assert_eq!(h.unit, "hours");
        assert_eq!(h.at(1_000 + 3_600_000), 1.0);
        assert!(TimeAxis::new(5, 5).end > 0.0);
    }

    #[test]
    fn thinning_keeps_the_ends() {
        let xs: Vec<u32> = (0..10_000).collect();
        let t = thin(&xs, 100);
        assert_eq!((t.len(), t[0], t[99]), (100, 0, 9_999));
        assert_eq!(thin(&xs[..5], 100), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn bars_carry_title_legend_and_totals() {
        let svg = hbars(&Bars {
            title: "T <&>",
            value_desc: "Pods",
            counts: true,
            categories: vec!["a".into(), "b".into()],
            series: vec![("s1".into(), PENDING, vec![1.0, 2.0]), ("s2".into(), BOUND_LATER, vec![0.5, 0.0])],
        })
        .unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("T &lt;&amp;&gt;"), "escaped title");
        for s in ["s1", "s2", "Pods", ">\na\n<", "1.50", ">\n2\n<"] {
            assert!(svg.contains(s), "{s}");
        }
    }
}
