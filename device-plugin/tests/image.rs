//! The device plugin's image (images/Containerfile, stage `device-plugin`) starts this binary with
//! arguments it accepts, and exposes its default metrics port. The rest of the image's checks are in
//! tests/images.rs, which has no access to this binary.

#[path = "../../tests/support/dockerfile.rs"]
mod dockerfile;

use std::path::Path;
use std::process::Command;

use dockerfile::{parse, read, stage};
use gpuplace_device_plugin::metrics::DEFAULT_METRICS_LISTEN;

const BIN: &str = env!("CARGO_BIN_EXE_gpuplace-device-plugin");

#[test]
fn the_image_entry_point_and_default_arguments_parse() {
    let stages = parse(&read("images/Containerfile"));
    let s = stage(&stages, "device-plugin");
    let entry = s.exec("ENTRYPOINT");
    assert_eq!(entry.len(), 1, "{entry:?}");
    assert_eq!(Path::new(&entry[0]).file_name(), Path::new(BIN).file_name());
    let cmd = s.exec("CMD");
    let out = Command::new(BIN).args(&cmd).arg("--help").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("error:"), "CMD {cmd:?}: {err}");
    // the check refuses what the binary refuses
    assert!(!Command::new(BIN).args(&cmd).args(["--no-such-flag", "--help"]).output().unwrap().status.success());

    let port = DEFAULT_METRICS_LISTEN.rsplit(':').next().unwrap();
    assert_eq!(s.one("EXPOSE"), port, "--metrics-listen's default port");
}
