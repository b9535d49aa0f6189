//! gpu-check: issue 49's GPU acceptance measurements, one JSON line of results per command.
//!
//! Exit codes: 0 the measurement ran and what was asked succeeded; 1 the GPU refused what was asked
//! (an allocation past a limit: the line says where and with which CUDA error); 2 no usable GPU
//! (no libcuda, cuInit failed, no such device); 3 an internal error; 64 bad arguments.
//! The CUDA_MPS_* variables of the environment are echoed in every line, so a line says under which
//! limits it was measured.

mod cuda;
mod nvml;

use std::ffi::c_void;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use serde_json::{json, Map, Value};

use cuda::{Context, CuError, Device, DeviceBuffer, Kernel, NoGpu};

const MIB: u64 = 1 << 20;
const SPIN_PTX: &str = include_str!("spin.ptx");
/// FMAs per thread per loop round in spin.ptx.
const SPIN_FMAS_PER_ITER: u64 = 8;

#[derive(Debug, Parser)]
#[command(name = "gpu-check", version, about = "GPU acceptance checks for gpuplace's isolation (issue 49)")]
struct Cli {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0, global = true)]
    device: i32,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Allocate MiB of device memory in steps, writing every byte; report how much succeeded and the
    /// CUDA error of the step that failed. Exit 1 when not all of it could be allocated.
    Alloc {
        /// How much to allocate in all.
        #[arg(long)]
        mib: u64,
        /// Size of each cuMemAlloc, so a limit is hit at a clear point.
        #[arg(long, default_value_t = 512)]
        step_mib: u64,
        /// Keep what was allocated for this long after reporting (the guard's target). Prints a
        /// `{"event":"started","pid":..}` line first.
        #[arg(long, value_name = "S")]
        hold_s: Option<f64>,
    },
    /// The most one process can allocate (chunks halving down to --resolution-mib once one fails),
    /// the largest single allocation, and the free/total the driver and NVML report before.
    MaxAlloc {
        /// First chunk size.
        #[arg(long, default_value_t = 1024)]
        chunk_mib: u64,
        /// Stop halving the chunk below this.
        #[arg(long, default_value_t = 16)]
        resolution_mib: u64,
    },
    /// A compute-bound FMA kernel over many blocks, timed; run with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    /// 30 and 100 with the same --iters and --blocks to compare.
    Spin {
        /// Calibrate the work to take about this long (on this process's share of the GPU); the
        /// line reports the `iters` chosen, to pass to the other runs.
        #[arg(long, value_name = "T", conflicts_with = "iters")]
        ms: Option<u64>,
        /// Fixed work: loop rounds per thread (8 FMAs each).
        #[arg(long)]
        iters: Option<u32>,
        /// Blocks in the grid (default: 4 per SM the device reports; under MPS with a thread
        /// percentage the count reported may be smaller, so pass the 100 % run's).
        #[arg(long)]
        blocks: Option<u32>,
        /// Threads per block.
        #[arg(long, default_value_t = 256)]
        threads: u32,
        /// Timed runs (the line reports each and their median).
        #[arg(long, default_value_t = 3)]
        repeat: u32,
    },
    /// Device memory (NVML) before and after this process creates its CUDA context: the
    /// per-process overhead. With CUDA_MPS_PIPE_DIRECTORY set, it first measures a child without
    /// MPS (the variable removed), then itself under MPS.
    ContextOverhead {
        /// Measure this process only (no child without MPS).
        #[arg(long)]
        no_compare: bool,
        /// Keep the context this long before measuring after it (seconds).
        #[arg(long, default_value_t = 0.5)]
        settle_s: f64,
    },
}

/// Exit 2 for no GPU, else a CUDA call failed where it must not (3).
enum Failure {
    NoGpu(NoGpu),
    Cuda(CuError),
}

impl From<CuError> for Failure {
    fn from(e: CuError) -> Self {
        Failure::Cuda(e)
    }
}

fn main() -> ExitCode {
    std::panic::set_hook(Box::new(|info| {
        // cudarc panics when a symbol is missing from libcuda; say so plainly, never a backtrace.
        eprintln!("gpu-check: internal error: {info}");
        std::process::exit(3);
    }));
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 64 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let cmd_name = match &cli.command {
        Cmd::Alloc { .. } => "alloc",
        Cmd::MaxAlloc { .. } => "max-alloc",
        Cmd::Spin { .. } => "spin",
        Cmd::ContextOverhead { .. } => "context-overhead",
    };
    let result = match cli.command {
        Cmd::Alloc { mib, step_mib, hold_s } => alloc(cli.device, mib, step_mib.max(1), hold_s),
        Cmd::MaxAlloc { chunk_mib, resolution_mib } => max_alloc(cli.device, chunk_mib.max(1), resolution_mib.max(1)),
        Cmd::Spin { ms, iters, blocks, threads, repeat } => {
            spin(cli.device, ms, iters, blocks, threads.clamp(32, 1024), repeat.max(1))
        }
        Cmd::ContextOverhead { no_compare, settle_s } => context_overhead(cli.device, no_compare, settle_s),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(Failure::NoGpu(e)) => {
            eprintln!("gpu-check: {e}");
            emit(line(cmd_name, json!({"ok": false, "no_gpu": e.to_string()})));
            ExitCode::from(2)
        }
        Err(Failure::Cuda(e)) => {
            eprintln!("gpu-check: {e}");
            emit(line(cmd_name, json!({"ok": false, "error": e.name, "error_call": e.call, "error_text": e.text})));
            ExitCode::from(3)
        }
    }
}

/// One result line: the command, the PID, the CUDA_MPS_* environment, then `fields`.
fn line(cmd: &str, fields: Value) -> Value {
    let mut m = Map::new();
    m.insert("cmd".into(), cmd.into());
    m.insert("pid".into(), std::process::id().into());
    let mut env = Map::new();
    for (k, v) in std::env::vars() {
        if k.starts_with("CUDA_MPS_") || k == "CUDA_VISIBLE_DEVICES" {
            env.insert(k, v.into());
        }
    }
    m.insert("env".into(), Value::Object(env));
    if let Value::Object(f) = fields {
        m.extend(f);
    }
    Value::Object(m)
}

fn emit(v: Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn mib(bytes: u64) -> u64 {
    bytes / MIB
}

/// The device, its name, and a context on it.
fn open(ordinal: i32) -> Result<(Device, Map<String, Value>, Context), Failure> {
    let dev = Device::open(ordinal).map_err(Failure::NoGpu)?;
    let mut info = Map::new();
    info.insert("device".into(), ordinal.into());
    info.insert("device_name".into(), dev.name()?.into());
    info.insert("driver_cuda_version".into(), cuda::driver_version()?.into());
    let ctx = dev.context()?;
    Ok((dev, info, ctx))
}

fn alloc(ordinal: i32, total_mib: u64, step_mib: u64, hold_s: Option<f64>) -> Result<u8, Failure> {
    if hold_s.is_some() {
        emit(line("alloc", json!({"event": "started"})));
    }
    let (_dev, info, ctx) = open(ordinal)?;
    let (free0, total) = cuda::mem_info(&ctx)?;
    let start = Instant::now();
    let mut bufs = Vec::new();
    let mut done = 0u64;
    let mut failure: Option<CuError> = None;
    while done < total_mib {
        let n = step_mib.min(total_mib - done);
        match DeviceBuffer::alloc(&ctx, n * MIB).and_then(|b| b.touch(0xa5).map(|()| b)) {
            Ok(b) => {
                bufs.push(b);
                done += n;
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let elapsed_ms = start.elapsed().as_secs_f64() * 1e3;
    let free1 = cuda::mem_info(&ctx).map(|(f, _)| mib(f)).ok();
    let ok = failure.is_none();
    let mut out = json!({
        "ok": ok,
        "requested_mib": total_mib,
        "step_mib": step_mib,
        "allocated_mib": done,
        "error": failure.as_ref().map(|e| e.name.clone()),
        "error_call": failure.as_ref().map(|e| e.call),
        "failed_step_at_mib": failure.as_ref().map(|_| done),
        "cu_free_mib_before": mib(free0),
        "cu_free_mib_after": free1,
        "cu_total_mib": mib(total),
        "elapsed_ms": round1(elapsed_ms),
        "hold_s": hold_s,
    });
    out.as_object_mut().unwrap().extend(info);
    emit(line("alloc", out));
    if let Some(s) = hold_s {
        std::thread::sleep(Duration::from_secs_f64(s.max(0.0)));
    }
    drop(bufs);
    Ok(if ok { 0 } else { 1 })
}

fn max_alloc(ordinal: i32, chunk_mib: u64, resolution_mib: u64) -> Result<u8, Failure> {
    let dev = Device::open(ordinal).map_err(Failure::NoGpu)?;
    let nvml = dev.pci_bus_id().map_err(|e| e.to_string()).and_then(|bus| nvml::Nvml::open(&bus));
    let nvml_before = nvml.as_ref().ok().and_then(|n| n.memory().ok());
    let (_dev, info, ctx) = open(ordinal)?;
    let (free0, total) = cuda::mem_info(&ctx)?;

    // Total: chunks, halving once one fails, down to the resolution.
    let start = Instant::now();
    let mut bufs = Vec::new();
    let mut chunk = chunk_mib;
    let mut reached = 0u64;
    let last_error = loop {
        match DeviceBuffer::alloc(&ctx, chunk * MIB).and_then(|b| b.touch(0x5a).map(|()| b)) {
            Ok(b) => {
                reached += chunk;
                bufs.push(b);
            }
            Err(e) => {
                if !e.is_out_of_memory() || chunk / 2 < resolution_mib {
                    break e;
                }
                chunk /= 2;
            }
        }
    };
    let free_at_max = cuda::mem_info(&ctx).map(|(f, _)| mib(f)).ok();
    drop(bufs);

    // Largest single allocation: binary search between the resolution and the total reached.
    let (mut lo, mut hi) = (0u64, reached + resolution_mib);
    while hi - lo > resolution_mib {
        let mid = (lo + hi) / 2;
        if DeviceBuffer::alloc(&ctx, mid * MIB).is_ok() {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let elapsed_ms = start.elapsed().as_secs_f64() * 1e3;
    let mut out = json!({
        "ok": true,
        "max_total_mib": reached,
        "largest_single_mib": lo,
        "resolution_mib": resolution_mib,
        "stopped_on": last_error.name,
        "cu_free_mib_before": mib(free0),
        "cu_total_mib": mib(total),
        "cu_free_mib_at_max": free_at_max,
        "nvml_total_mib": nvml_before.as_ref().map(|m| mib(m.total)),
        "nvml_free_mib_before_context": nvml_before.as_ref().map(|m| mib(m.free)),
        "nvml": nvml.as_ref().err(),
        "elapsed_ms": round1(elapsed_ms),
    });
    out.as_object_mut().unwrap().extend(info);
    emit(line("max-alloc", out));
    Ok(0)
}

fn spin(
    ordinal: i32,
    target_ms: Option<u64>,
    iters: Option<u32>,
    blocks: Option<u32>,
    threads: u32,
    repeat: u32,
) -> Result<u8, Failure> {
    let (dev, info, ctx) = open(ordinal)?;
    let sm_count = dev.sm_count()?;
    let blocks = blocks.unwrap_or((sm_count.max(1) as u32) * 4).max(1);
    let load_start = Instant::now();
    let kernel = Kernel::from_ptx(&ctx, SPIN_PTX, "spin")?;
    let load_ms = load_start.elapsed().as_secs_f64() * 1e3;
    let out_buf = DeviceBuffer::alloc(&ctx, u64::from(blocks) * u64::from(threads) * 4)?;

    let run = |n: u32| -> Result<f64, CuError> {
        let mut ptr = out_buf.ptr;
        let mut n = n;
        let mut params = [&mut ptr as *mut _ as *mut c_void, &mut n as *mut _ as *mut c_void];
        let t = Instant::now();
        kernel.launch(blocks, threads, &mut params)?;
        cuda::synchronize()?;
        Ok(t.elapsed().as_secs_f64() * 1e3)
    };
    // Warm-up (the first launch pays for loading the kernel onto the GPU).
    run(1000)?;
    let (iters, calibration) = match (iters, target_ms) {
        (Some(n), _) => (n, None),
        (None, target) => {
            let target = target.unwrap_or(1000).max(1) as f64;
            // Double the work until a run takes 50 ms, then scale to the target.
            let mut n: u64 = 10_000;
            let mut t = run(n as u32)?;
            while t < 50.0 && n < u64::from(u32::MAX) / 2 {
                n *= 2;
                t = run(n as u32)?;
            }
            let scaled = ((n as f64) * target / t.max(1e-3)).clamp(1000.0, f64::from(u32::MAX)) as u32;
            (scaled, Some((n, round1(t))))
        }
    };
    let mut times = Vec::new();
    for _ in 0..repeat {
        times.push(run(iters)?);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let flop = 2.0 * (u64::from(blocks) * u64::from(threads)) as f64 * f64::from(iters) * SPIN_FMAS_PER_ITER as f64;
    let mut out = json!({
        "ok": true,
        "iters": iters,
        "blocks": blocks,
        "threads": threads,
        "sm_count": sm_count,
        "elapsed_ms": times.iter().map(|t| round1(*t)).collect::<Vec<_>>(),
        "median_ms": round1(median),
        "tflops": round3(flop / (median / 1e3) / 1e12),
        "module_load_ms": round1(load_ms),
        "calibration_iters": calibration.map(|c| c.0),
        "calibration_ms": calibration.map(|c| c.1),
    });
    out.as_object_mut().unwrap().extend(info);
    emit(line("spin", out));
    Ok(0)
}

fn context_overhead(ordinal: i32, no_compare: bool, settle_s: f64) -> Result<u8, Failure> {
    let mps = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").is_some_and(|v| !v.is_empty());
    // The comparison without MPS first, in a child (MPS is chosen at context creation, per process).
    let without_mps = if mps && !no_compare {
        let exe = std::env::current_exe().map_err(|e| Failure::Cuda(internal(&e.to_string())))?;
        let mut cmd = std::process::Command::new(exe);
        cmd.args(["--device", &ordinal.to_string(), "context-overhead", "--no-compare"])
            .args(["--settle-s", &settle_s.to_string()]);
        for (k, _) in std::env::vars() {
            if k.starts_with("CUDA_MPS_") {
                cmd.env_remove(k);
            }
        }
        let out = cmd.output();
        Some(match out {
            Ok(o) => String::from_utf8_lossy(&o.stdout)
                .lines()
                .last()
                .and_then(|l| serde_json::from_str::<Value>(l).ok())
                .unwrap_or_else(
                    || json!({"ok": false, "exit": o.status.code(), "stderr": String::from_utf8_lossy(&o.stderr)}),
                ),
            Err(e) => json!({"ok": false, "spawn_error": e.to_string()}),
        })
    } else {
        None
    };

    let dev = Device::open(ordinal).map_err(Failure::NoGpu)?;
    let nvml = dev.pci_bus_id().map_err(|e| e.to_string()).and_then(|bus| nvml::Nvml::open(&bus));
    let before = nvml.as_ref().ok().and_then(|n| n.memory().ok());
    let t = Instant::now();
    let ctx = dev.context()?;
    // Make the context do something, as a real client would before its first allocation.
    let probe = DeviceBuffer::alloc(&ctx, MIB)?;
    probe.touch(0)?;
    let create_ms = t.elapsed().as_secs_f64() * 1e3;
    drop(probe);
    std::thread::sleep(Duration::from_secs_f64(settle_s.max(0.0)));
    let after = nvml.as_ref().ok().and_then(|n| n.memory().ok());
    let (cu_free, cu_total) = cuda::mem_info(&ctx)?;
    let overhead = match (&before, &after) {
        (Some(b), Some(a)) => Some(b.free as i64 / MIB as i64 - a.free as i64 / MIB as i64),
        _ => None,
    };
    let mut out = json!({
        "ok": true,
        "mps": mps,
        "nvml_free_mib_before": before.as_ref().map(|m| mib(m.free)),
        "nvml_free_mib_after": after.as_ref().map(|m| mib(m.free)),
        "nvml_total_mib": before.as_ref().map(|m| mib(m.total)),
        "overhead_mib": overhead,
        "cu_free_mib": mib(cu_free),
        "cu_total_mib": mib(cu_total),
        "context_create_ms": round1(create_ms),
        "nvml": nvml.as_ref().err(),
        "without_mps": without_mps,
    });
    let mut info = Map::new();
    info.insert("device".into(), ordinal.into());
    info.insert("device_name".into(), dev.name()?.into());
    out.as_object_mut().unwrap().extend(info);
    emit(line("context-overhead", out));
    Ok(0)
}

fn internal(msg: &str) -> CuError {
    CuError { call: "gpu-check", name: "INTERNAL".into(), text: msg.into() }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}
