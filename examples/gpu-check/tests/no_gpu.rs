//! gpu-check without a GPU: the program must say plainly that libcuda is missing (exit 2), never
//! panic; bad arguments exit 64; and run.sh works end to end against fakes (tests/dry-run.sh).

use std::process::Command;

fn gpu_check(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-check")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn libcuda_here() -> bool {
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[test]
fn every_command_without_libcuda_exits_2_with_a_clear_message() {
    if libcuda_here() {
        eprintln!("libcuda is present here: the no-driver path cannot be checked");
        return;
    }
    for args in [
        &["alloc", "--mib", "1"][..],
        &["alloc", "--mib", "1", "--hold-s", "0"],
        &["max-alloc"],
        &["spin", "--ms", "10"],
        &["context-overhead"],
    ] {
        let (code, stdout, stderr) = gpu_check(args);
        assert_eq!(code, 2, "{args:?}: {stdout} {stderr}");
        assert!(stderr.contains("libcuda") && !stderr.contains("panicked"), "{args:?}: {stderr}");
        let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(last["ok"], false, "{args:?}: {stdout}");
        assert!(last["no_gpu"].as_str().unwrap().contains("libcuda"), "{args:?}: {stdout}");
        assert!(last["pid"].as_u64().is_some());
    }
}

#[test]
fn bad_arguments_exit_64_and_help_exits_0() {
    assert_eq!(gpu_check(&["alloc"]).0, 64);
    assert_eq!(gpu_check(&["spin", "--ms", "1", "--iters", "2"]).0, 64);
    assert_eq!(gpu_check(&["frobnicate"]).0, 64);
    let (code, stdout, _) = gpu_check(&["--help"]);
    assert_eq!(code, 0);
    for cmd in ["alloc", "max-alloc", "spin", "context-overhead"] {
        assert!(stdout.contains(cmd), "{stdout}");
    }
}

/// run.sh against a fake libcuda and libnvidia-ml, fake nvidia-smi, MPS control and plugin (needs a C
/// compiler; about 40 s of mostly waiting).
#[test]
fn run_sh_dry_run() {
    if Command::new("cc").arg("--version").output().is_err() {
        eprintln!("no C compiler: dry run skipped");
        return;
    }
    let dir = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("bash")
        .arg(format!("{dir}/tests/dry-run.sh"))
        .arg(env!("CARGO_BIN_EXE_gpu-check"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("dry run: all checks passed"), "{stdout}");
}
